"""Jit-compiled prefill and reference decode over a model, and the checks on their inputs.

The model is split once into (graphdef, state); the compiled function takes the state as an argument, so weights
are neither baked into the executable nor copied per call.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dwdp.model import Cache, Qwen35MoeForCausalLM
from jax_dwdp.model.qwen35_moe import LogitsMode


class InputError(ValueError):
    """Token ids, lengths or shapes that a prefill cannot run; the message says which and why."""


def check_tokens(tokens, vocab_size: int, lengths=None) -> tuple[np.ndarray, np.ndarray]:
    """Validates a [B, T] batch of token ids (right-padded) and its lengths; returns int32 numpy arrays."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise InputError(f"tokens must be a [batch, seq_len] array, got shape {tokens.shape}")
    if tokens.size == 0:
        raise InputError(f"tokens is empty (shape {tokens.shape}); need at least one token per sequence")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise InputError(f"tokens must be integers, got dtype {tokens.dtype}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise InputError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    b, t = tokens.shape
    if lengths is None:
        lengths = np.full((b,), t, np.int32)
    lengths = np.asarray(lengths)
    if lengths.shape != (b,) or not np.issubdtype(lengths.dtype, np.integer):
        raise InputError(f"lengths must be {b} integers, got shape {lengths.shape} dtype {lengths.dtype}")
    if lengths.min() < 1 or lengths.max() > t:
        raise InputError(f"lengths must lie in [1, {t}], got min {lengths.min()} max {lengths.max()}")
    return tokens.astype(np.int32), lengths.astype(np.int32)


def jit_prefill(
    model: Qwen35MoeForCausalLM, *, logits: LogitsMode = "all", cache_len: int | None = None
) -> Callable[..., tuple[jax.Array | None, Cache]]:
    """Returns prefill(tokens [B, T], lengths [B] | None) -> (logits, cache), compiled once per shape."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens, lengths):
        return nnx.merge(graphdef, state).prefill(tokens, lengths, logits=logits, cache_len=cache_len)

    def prefill(tokens, lengths=None):
        tokens, lengths = check_tokens(tokens, model.cfg.vocab_size, lengths)
        return run(state, jnp.asarray(tokens), jnp.asarray(lengths))

    prefill.lower = lambda tokens, lengths: run.lower(state, tokens, lengths)  # for AOT compile timing
    return prefill


def jit_decode_step(model: Qwen35MoeForCausalLM) -> Callable[[jax.Array, Cache], tuple[jax.Array, Cache]]:
    """Returns decode(tokens [B], cache) -> (logits [B, V], cache), the reference single-token step."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens, cache):
        return nnx.merge(graphdef, state).decode_step(tokens, cache)

    def decode(tokens, cache: Cache):
        tokens = np.asarray(tokens)
        check_tokens(tokens[:, None], model.cfg.vocab_size)
        if int(jnp.max(cache.lengths)) >= cache.capacity:
            raise InputError(
                f"the cache is full ({cache.capacity} positions); prefill with a larger cache_len to decode"
            )
        return run(state, jnp.asarray(tokens, jnp.int32), cache)

    return decode

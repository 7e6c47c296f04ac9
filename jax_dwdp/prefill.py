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

from jax_dwdp.model import Cache, CausalLM
from jax_dwdp.model.cache import LogitsMode
from jax_dwdp.programs import precision_scope
from jax_dwdp.runner import StageRunner, execution_mode


class InputError(ValueError):
    """Token ids, lengths or shapes that a prefill cannot run; the message says which and why."""


def check_tokens(tokens, vocab_size: int, lengths=None, *, min_length: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Validates a [B, T] batch of token ids (right-padded) and its lengths (at least `min_length`: 0 when the
    tokens continue a cache); returns int32 numpy arrays."""
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
    if lengths.min() < min_length or lengths.max() > t:
        raise InputError(f"lengths must lie in [{min_length}, {t}], got min {lengths.min()} max {lengths.max()}")
    return tokens.astype(np.int32), lengths.astype(np.int32)


def check_cache(cache: Cache, model: CausalLM, lengths: np.ndarray) -> None:
    """A cache that a prefill continues: the model's layers, the batch's sequences, room for the new tokens."""
    if (cache.full_layer_ids, cache.linear_layer_ids) != (model.full_layer_ids, model.linear_layer_ids):
        raise InputError(f"the cache holds layers {cache.full_layer_ids + cache.linear_layer_ids}, not this model's")
    held = np.asarray(cache.lengths)
    if held.shape != lengths.shape:
        raise InputError(f"the cache is for {held.shape[0]} sequences, the tokens are {lengths.shape[0]}")
    need = held + lengths
    if need.max() > cache.capacity:
        i = int(np.argmax(need))
        raise InputError(f"the cache holds {cache.capacity} positions; sequence {i} needs {int(need[i])} "
                         f"({int(held[i])} cached + {int(lengths[i])} new): prefill the first piece with a larger "
                         "cache_len")


def jit_prefill(
    model: CausalLM,
    *,
    logits: LogitsMode = "all",
    cache_len: int | None = None,
    layerwise: bool = False,
    mode: str | None = None,
) -> Callable[..., tuple[jax.Array | None, Cache]]:
    """Returns prefill(tokens [B, T], lengths [B] | None, cache=None) -> (logits, cache), compiled once per shape.

    With `cache` (what an earlier call returned, for the same sequences) the tokens continue it: sequence b's
    tokens take positions cache.lengths[b] onwards, a length may be 0 (that sequence's cache stays as it was), and
    the cache's capacity replaces cache_len. So a long prompt can be prefilled in pieces (chunked prefill): give the
    first piece cache_len = the whole prompt's length; the pieces' logits, side by side, and the last cache are those
    of one prefill of the whole prompt.

    `prefill.compile(tokens, lengths)` compiles ahead of time; `prefill.lower(tokens, lengths)` gives the whole
    model's lowered program. mode="layerwise" (or layerwise=True) compiles one program per layer type instead of one
    for the whole model (the same numbers, a compile time independent of depth; see jax_dwdp.runner); a scanned
    model is `jax_dwdp.scan.jit_prefill_scanned`'s.
    """
    mode = execution_mode(mode, layerwise=layerwise)
    if mode == "scanned":
        raise ValueError("jit_prefill runs whole or layer-wise programs; for a scanned model use "
                         "jax_dwdp.scan.jit_prefill_scanned(ScannedModel.from_model(model))")
    if not (model.is_first and model.is_last):
        raise ValueError("jit_prefill needs the whole model; pipeline stages run through jax_dwdp.parallel")
    runner = StageRunner(model)
    options = dict(logits=logits, cache_len=cache_len)

    def prefill(tokens, lengths=None, cache: Cache | None = None):
        tokens, lengths = check_tokens(tokens, model.cfg.vocab_size, lengths, min_length=0 if cache else 1)
        if cache is None:
            return runner(tokens, lengths, mode=mode, **options)
        check_cache(cache, model, lengths)
        return runner(tokens, lengths, mode=mode, logits=logits, cache_len=cache.capacity, cache=cache)

    prefill.compile = lambda tokens, lengths: runner.compile(tokens, lengths, mode=mode, **options)
    prefill.lower = lambda tokens, lengths: runner.lower(tokens, lengths, **options)
    return prefill


def jit_decode_step(model: CausalLM) -> Callable[[jax.Array, Cache], tuple[jax.Array, Cache]]:
    """Returns decode(tokens [B], cache) -> (logits [B, V], cache), the reference single-token step."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens, cache):
        with precision_scope(model.dtype):
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

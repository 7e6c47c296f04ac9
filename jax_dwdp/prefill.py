"""Jit-compiled prefill and reference decode over a model, and the checks on their inputs.

The model is split once into (graphdef, state); the compiled function takes the state as an argument, so weights
are neither baked into the executable nor copied per call.
"""

from __future__ import annotations

import functools
import threading
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


def _precision(dtype):
    """fp32 models are reference runs: every matmul in full fp32 (the GPU would otherwise use TF32)."""
    return jax.default_matmul_precision("highest" if jnp.dtype(dtype) == jnp.float32 else None)


class StageProgram:
    """A compiled `model.forward` (whole model or one pipeline stage): (x, lengths) -> (logits | hidden, cache).

    layerwise=False compiles the range as one program. layerwise=True compiles one program per layer type (the
    layers of a type share it, their weights passed as arguments) and runs the layers from Python: the same
    numbers, a compile time independent of depth (XLA needs about 10 s per layer on the GPU for whole-model
    programs), and some host time per layer to dispatch it (hidden while the GPU is busier than the host).
    """

    def __init__(self, model: Qwen35MoeForCausalLM, *, logits: LogitsMode = "all", cache_len: int | None = None,
                 layerwise: bool = False):
        self.model, self.logits, self.cache_len, self.layerwise = model, logits, cache_len, layerwise
        self.graphdef, self.state = nnx.split(model)
        if layerwise:
            # Layers of one type differ only in weights and their static layer id: run every layer through the
            # graphdef of the first layer of its type, so that they share one executable.
            self.canonical = canonical_graphs(model)
            self.layer_states = {id(layer): nnx.state(layer) for layer in model.layers}
            self._graph = StaticGraph.of(self.graphdef)
        else:
            self._whole = jax.jit(self._forward)

    def _forward(self, state, x, lengths):
        with _precision(self.model.dtype):
            return nnx.merge(self.graphdef, state).forward(x, lengths, logits=self.logits, cache_len=self.cache_len)

    def _run_layer(self, layer, h, positions, lengths, experts):
        if experts is not None:
            raise ValueError("layer-wise prefill takes no expert override")
        return _run_layer(self.canonical[layer.layer_type], self.layer_states[id(layer)], h, positions, lengths)

    def __call__(self, x: jax.Array, lengths: jax.Array):
        if not self.layerwise:
            return self._whole(self.state, x, lengths)
        model = self.model
        h = _embed(self._graph, self.state, x) if model.is_first else x
        h, cache = model.forward_layers(h, lengths, cache_len=self.cache_len, run_layer=self._run_layer)
        out = _head(self._graph, self.state, h, lengths, self.logits) if model.is_last else h
        return out, cache

    def lower(self, x: jax.Array, lengths: jax.Array):
        """The lowered whole-range program (to inspect its HLO); not available layer-wise."""
        if self.layerwise:
            raise ValueError("a layer-wise program is several programs; lower() needs layerwise=False")
        return self._whole.lower(self.state, x, lengths)

    def compile(self, x: jax.Array, lengths: jax.Array) -> None:
        """Compiles ahead of time for these shapes (layer-wise: by one run, which compiles each program once)."""
        if self.layerwise:
            jax.block_until_ready(self(x, lengths))
        else:
            self._whole.lower(self.state, x, lengths).compile()


class StaticGraph:
    """A flax GraphDef as a static jit argument, its hash computed once.

    jit hashes static arguments on every call, and GraphDef.__hash__ walks the whole module graph each time (about
    0.6 ms per call for one decoder layer on a 2-core CPU; the whole model's graphdef, for embed and head, more).
    Layer-wise drivers make one such call per layer, so they wrap their graphdefs once, through `of`, which hands
    every driver the same wrapper for equal graphdefs: jit then finds its cached executable by identity instead of
    comparing two module graphs on each call, and drivers built from the same model share executables.
    """

    __slots__ = ("value", "_hash")
    _interned: dict = {}
    _lock = threading.Lock()

    def __init__(self, graphdef):
        self.value, self._hash = graphdef, hash(graphdef)

    @classmethod
    def of(cls, graphdef) -> StaticGraph:
        new = cls(graphdef)
        with cls._lock:
            return cls._interned.setdefault(new, new)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, StaticGraph) and (self.value is other.value or self.value == other.value)


def canonical_graphs(model: Qwen35MoeForCausalLM) -> dict[str, StaticGraph]:
    """Layer type -> the graphdef of the model's first layer of that type. Layers of one type differ only in weights
    and their static layer id, so running every layer through its type's graphdef shares one executable."""
    graphs = {}
    for layer in model.layers:
        if layer.layer_type not in graphs:
            graphs[layer.layer_type] = StaticGraph.of(nnx.graphdef(layer))
    return graphs


@functools.partial(jax.jit, static_argnums=(0,))
def _run_layer(graph: StaticGraph, state, h, positions, lengths):
    with _precision(h.dtype):
        return nnx.merge(graph.value, state)(h, positions, lengths)


@functools.partial(jax.jit, static_argnums=(0,))
def _embed(graph: StaticGraph, state, tokens):
    return nnx.merge(graph.value, state).embed(tokens)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _head(graph: StaticGraph, state, h, lengths, mode):
    with _precision(h.dtype):
        return nnx.merge(graph.value, state).head(h, lengths, mode)


def jit_prefill(
    model: Qwen35MoeForCausalLM,
    *,
    logits: LogitsMode = "all",
    cache_len: int | None = None,
    layerwise: bool = False,
) -> Callable[..., tuple[jax.Array | None, Cache]]:
    """Returns prefill(tokens [B, T], lengths [B] | None) -> (logits, cache), compiled once per shape.

    `prefill.compile(tokens, lengths)` compiles ahead of time. See StageProgram for `layerwise`.
    """
    if not (model.is_first and model.is_last):
        raise ValueError("jit_prefill needs the whole model; pipeline stages run through jax_dwdp.parallel")
    program = StageProgram(model, logits=logits, cache_len=cache_len, layerwise=layerwise)

    def prefill(tokens, lengths=None):
        tokens, lengths = check_tokens(tokens, model.cfg.vocab_size, lengths)
        return program(jnp.asarray(tokens), jnp.asarray(lengths))

    prefill.compile = lambda tokens, lengths: program.compile(jnp.asarray(tokens), jnp.asarray(lengths))
    prefill.lower = lambda tokens, lengths: program.lower(jnp.asarray(tokens), jnp.asarray(lengths))
    return prefill


def jit_decode_step(model: Qwen35MoeForCausalLM) -> Callable[[jax.Array, Cache], tuple[jax.Array, Cache]]:
    """Returns decode(tokens [B], cache) -> (logits [B, V], cache), the reference single-token step."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, tokens, cache):
        with _precision(model.dtype):
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

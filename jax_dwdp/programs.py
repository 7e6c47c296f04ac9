"""The compiled pieces every driver shares: a layer, the embedding, the head, keyed by a hashed-once graphdef.

Layers of one type differ only in weights and their static layer id, so every layer runs through the graphdef of
the first layer of its type (`canonical_graphs`) and the layers of a type share one executable. These functions are
module-level jits: two drivers over equal models (a second `jit_prefill`, another independent rank) find the same
executables.
"""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
from flax import nnx


def precision_scope(dtype):
    """fp32 models are reference runs: every matmul in full fp32 (the GPU would otherwise use TF32)."""
    return jax.default_matmul_precision("highest" if jnp.dtype(dtype) == jnp.float32 else None)


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


def shell_of(model):
    """(graphdef, state) of a model's embedding, final norm and lm_head, without its layers: what the embed and
    head programs read. A call's arguments are flattened leaf by leaf on the host, so passing the whole model's
    state to them (every layer's weights) cost about 2.6 ms of host time per call on an H200 host, the GPU idle
    meanwhile at the start of a prefill."""
    graphdef, state = nnx.split(model)
    shell = nnx.merge(graphdef, state)  # new module objects: `model` itself keeps its layers
    shell.layers = nnx.List([])
    return nnx.split(shell)


def canonical_graphs(model) -> dict[str, StaticGraph]:
    """Layer type -> the graphdef of the model's first layer of that type."""
    graphs = {}
    for layer in model.layers:
        if layer.layer_type not in graphs:
            graphs[layer.layer_type] = StaticGraph.of(nnx.graphdef(layer))
    return graphs


def layer_body(graph: StaticGraph, source, state, h, positions, lengths, pending, ahead, layer_cache=None):
    """One decoder layer with its experts from `source` (jax_dwdp.sources); traced.

    `pending` is what the source delivered for this layer. `ahead` (sources that fetch inside the program, see
    ExpertSource.gathers) is the next layer's fetch operand: its fetch is issued here, ordered after this layer's
    input, so that it overlaps this layer. `layer_cache` is the layer's cache from an earlier prefill that these
    tokens continue, or None. Returns ((h, cache), the next layer's experts or None).
    """
    fetched = None
    if ahead is not None:
        h, fetched = source.overlap(h, ahead)
    with precision_scope(h.dtype):
        layer = nnx.merge(graph.value, state)
        return layer(h, positions, lengths, source.experts(pending), layer_cache), fetched


def embed_body(graph: StaticGraph, state, tokens):
    return nnx.merge(graph.value, state).embed(tokens)


def head_body(graph: StaticGraph, mode, state, h, lengths):
    with precision_scope(h.dtype):
        return nnx.merge(graph.value, state).head(h, lengths, mode)


# One device (or independent ranks, each on its own device): the executables are shared by every driver.
run_layer = jax.jit(layer_body, static_argnums=(0, 1))
run_embed = jax.jit(embed_body, static_argnums=(0,))
run_head = jax.jit(head_body, static_argnums=(0, 1))

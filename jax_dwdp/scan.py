"""One compiled program for any depth: the layer stack as a `lax.scan` over stacked weights (single device).

Qwen3.5's layers repeat a pattern (3 linear-attention layers, then a full-attention layer: `full_attention_interval`
= 4). `ScannedModel` holds the whole model's layers as one stacked state per position in that period (leading axis:
the blocks) plus the layers after the last whole period (the tail, unrolled), and `jit_prefill_scanned` compiles
embed, a scan over the blocks (one body: one period of layers), the tail and the head as one program: its compile
time does not grow with depth, and a prefill is one dispatch.

Memory: `ScannedModel.from_model(model)` restacks the weights of a loaded (or random) model on its device, one
weight at a time, each layer's copy deleted as soon as it is in the stack: the peak above the model is one stacked
weight (for 35b-a3b, a position's expert gate_up over 10 blocks, 10.7 GB), never a second copy of the model. The
model it consumed is unusable afterwards (its layer weights are deleted), and so is every model that shares those
arrays (e.g. `set_fused_swiglu`'s result and its source, and programs built from them). Compile time is that of
one period plus the tail: independent of depth for patterns that repeat from the first layer (Qwen3.5's); an
irregular pattern leaves more layers in the unrolled tail. Not yet measured on a GPU: inside the scan each block's
weights are slices of the stacks, which XLA may copy before a custom call (the grouped GEMM, the GDN kernels).

Which drivers keep the layer-wise path, and why: pipeline stages, DWDP (XLA gather, CUDA VMM store), DEP and
independent ranks run through `parallel.runner.StageRunner` layer by layer, because their expert sources act
between layers (a gather issued one layer ahead, the store's copy of layer l+1 waited on before layer l+1, a
process's hand-off) and keep per-layer expert weights; one process per device already gives each of them its own
host thread. Chunked prefill (continuing a cache) also stays layer-wise.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dwdp.config import FULL_ATTENTION, LINEAR_ATTENTION
from jax_dwdp.model import Cache, Qwen35MoeForCausalLM
from jax_dwdp.model.qwen35_moe import LogitsMode, cache_length
from jax_dwdp.programs import StaticGraph, canonical_graphs, precision_scope, shell_of


def period_of(layer_types: tuple[str, ...], interval: int) -> tuple[tuple[str, ...], int]:
    """(the repeating period of layer types, how many whole periods open the stack); layers after those periods
    (a partial period, or an irregular pattern's rest) form the tail."""
    p = max(1, min(interval, len(layer_types)))
    period = tuple(layer_types[:p])
    blocks = 0
    while (blocks + 1) * p <= len(layer_types) and tuple(layer_types[blocks * p:(blocks + 1) * p]) == period:
        blocks += 1
    return period, blocks


@functools.partial(jax.jit, donate_argnums=0)
def _put(stack, value, index):
    return stack.at[index].set(value)


def _stack(arrays: list[jax.Array]) -> jax.Array:
    """One stacked array from same-shape arrays on one device; each input deleted once it is in (donated writes)."""
    first = arrays[0]
    stack = jnp.zeros((len(arrays), *first.shape), first.dtype, device=next(iter(first.devices())))
    for i, a in enumerate(arrays):
        stack = _put(stack, a, i)
        a.delete()
    return stack


@dataclasses.dataclass
class ScannedModel:
    """The whole model for `jit_prefill_scanned`: embedding, head, the stacked period and the tail."""

    model_graph: StaticGraph  # the model without its layers (embedding, final norm, lm_head)
    model_state: nnx.State
    period: tuple[str, ...]  # layer types of one period
    graphs: dict  # layer type -> StaticGraph (the first layer of the type's)
    blocks: int
    stacked: tuple  # per position in the period: that layer's state with a leading [blocks] axis
    tail_types: tuple[str, ...]
    tail: tuple  # per tail layer: its state
    cfg: object
    dtype: object

    @classmethod
    def from_model(cls, model: Qwen35MoeForCausalLM) -> "ScannedModel":
        """Restacks a whole model's layers (see the module docstring: `model` is consumed)."""
        if not (model.is_first and model.is_last):
            raise ValueError("ScannedModel needs the whole model (a pipeline stage runs layer-wise)")
        cfg = model.cfg
        devices = {d for leaf in jax.tree.leaves(nnx.state(model)) for d in leaf.devices()}
        if len(devices) != 1:
            raise ValueError(f"ScannedModel needs a model on one device; its weights are on {len(devices)}")
        graphs = canonical_graphs(model)
        period, blocks = period_of(cfg.layer_types, cfg.full_attention_interval)
        layers = list(model.layers)
        p = len(period)
        stacked = []
        for j in range(p if blocks else 0):
            states = [nnx.state(layers[b * p + j]) for b in range(blocks)]
            leaves = [jax.tree.leaves(s) for s in states]
            treedef = jax.tree.structure(states[0])
            stacked.append(jax.tree.unflatten(treedef, [_stack([ls[i] for ls in leaves])
                                                        for i in range(len(leaves[0]))]))
        tail_layers = layers[blocks * p:]
        tail = tuple(nnx.state(layer) for layer in tail_layers)
        shell_graph, shell_state = shell_of(model)
        return cls(model_graph=StaticGraph.of(shell_graph), model_state=shell_state, period=period, graphs=graphs,
                   blocks=blocks, stacked=tuple(stacked), tail_types=tuple(layer.layer_type for layer in tail_layers),
                   tail=tail, cfg=cfg, dtype=model.dtype)


def _layer(kind: str, graph: StaticGraph, state, h, positions, lengths, cache_len: int):
    """One layer; its K/V padded to cache_len (the Cache layout), its conv / recurrent state as it is."""
    h, out = nnx.merge(graph.value, state)(h, positions, lengths)
    if kind == FULL_ATTENTION:  # K, V [B, T, nkv, hd]
        pad = ((0, 0), (0, cache_len - h.shape[1]), (0, 0), (0, 0))
        out = (jnp.pad(out[0], pad), jnp.pad(out[1], pad))
    return h, out


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _forward(model_graph, graphs, period, tail_types, mode, cache_len, model_state, stacked, tail, tokens, lengths):
    graphs = dict(graphs)
    shell = nnx.merge(model_graph.value, model_state)
    h = shell.embed(tokens)
    with precision_scope(h.dtype):
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))

        def body(h, states):
            outs = []
            for typ, state in zip(period, states):
                h, out = _layer(typ, graphs[typ], state, h, positions, lengths, cache_len)
                outs.append(out)
            return h, tuple(outs)

        outs: list[tuple[str, tuple]] = []  # (type, (a, b) with a leading layer axis), in layer order
        if stacked:
            h, block_outs = jax.lax.scan(body, h, stacked)
            for kind in (LINEAR_ATTENTION, FULL_ATTENTION):
                slots = [j for j, typ in enumerate(period) if typ == kind]
                if slots:  # [blocks, slots, ...] -> [blocks * slots, ...]: layer order within the blocks
                    pair = tuple(jnp.stack([block_outs[j][k] for j in slots], axis=1).reshape(
                        -1, *block_outs[slots[0]][k].shape[1:]) for k in (0, 1))
                    outs.append((kind, pair))
        for typ, state in zip(tail_types, tail):
            h, out = _layer(typ, graphs[typ], state, h, positions, lengths, cache_len)
            outs.append((typ, tuple(x[None] for x in out)))

        def gather(kind, k):
            parts = [pair[k] for typ, pair in outs if typ == kind]
            return jnp.concatenate(parts) if parts else None

        logits = shell.head(h, lengths, mode)
        return logits, {kind: (gather(kind, 0), gather(kind, 1)) for kind in (LINEAR_ATTENTION, FULL_ATTENTION)}


def jit_prefill_scanned(scanned: ScannedModel, *, logits: LogitsMode = "all", cache_len: int | None = None):
    """prefill(tokens [B, T], lengths [B] | None) -> (logits, Cache), the same results as `jit_prefill` on the model
    the ScannedModel was made from, compiled as one program (one per shape). `prefill.compile(tokens, lengths)`
    compiles ahead of time."""
    from jax_dwdp.prefill import check_tokens

    cfg = scanned.cfg
    graphs = tuple(sorted(scanned.graphs.items()))
    executables = {}  # (tokens shape, cache length) -> compiled program

    def executable(tokens, lengths):
        tokens, lengths = check_tokens(tokens, cfg.vocab_size, lengths)
        length = cache_length(tokens.shape[1], cache_len)
        key = (tokens.shape, length)
        if key not in executables:
            static = (scanned.model_graph, graphs, scanned.period, scanned.tail_types, logits, length)
            executables[key] = _forward.lower(*static, *dynamic(tokens, lengths)).compile()
        return executables[key], tokens, lengths, length

    def dynamic(tokens, lengths):
        return scanned.model_state, scanned.stacked, scanned.tail, jnp.asarray(tokens), jnp.asarray(lengths)

    def prefill(tokens, lengths=None):
        exe, tokens, lengths, length = executable(tokens, lengths)
        out, caches = exe(*dynamic(tokens, lengths))
        return out, _cache(scanned, caches, lengths, tokens.shape[0], length)

    prefill.compile = lambda tokens, lengths=None: executable(tokens, lengths)[0]
    return prefill


def _cache(scanned: ScannedModel, caches, lengths, b: int, cache_len: int) -> Cache:
    cfg = scanned.cfg
    (conv, recurrent), (key, value) = caches[LINEAR_ATTENTION], caches[FULL_ATTENTION]
    device = next(iter(jax.tree.leaves(scanned.model_state)[0].devices()))
    return Cache.assemble(cfg, scanned.dtype, key=key, value=value, conv=conv, recurrent=recurrent,
                          lengths=jax.device_put(np.asarray(lengths, np.int32), device), batch=b,
                          cache_len=cache_len, full_layer_ids=cfg.layer_ids(FULL_ATTENTION),
                          linear_layer_ids=cfg.layer_ids(LINEAR_ATTENTION), device=device)

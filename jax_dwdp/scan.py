"""One compiled program for any depth: a layer stack as a `lax.scan` over stacked weights (one device).

Qwen3.5's layers repeat a pattern (3 linear-attention layers, then a full-attention layer: `full_attention_interval`
= 4). `ScannedModel` holds the layers of a model or of one pipeline stage [start_layer, end_layer) as one stacked
state per position in that period (leading axis: the blocks) plus the layers after the last whole period (the tail,
unrolled), and compiles embed (first stage), a scan over the blocks (one body: one period of layers), the tail and
the head (last stage) as one program: its compile time does not grow with depth, and a prefill (or a stage's share
of one microbatch) is one dispatch. A stage may start anywhere in the pattern: its period is read from its own
first layers (a stage starting at layer 2 of a 3 + 1 pattern repeats linear, full, linear, linear). Nemotron-H's
pattern is read from the range itself (`NemotronHConfig.scan_period`: the period that leaves the fewest layers to
compile; Nano 30B-A3B repeats "MEMEM*E" five times and unrolls the 17 layers after).

Memory: `ScannedModel.from_model(model)` restacks the weights of a loaded (or random) model on its device, one
weight at a time, each layer's copy deleted as soon as it is in the stack: the peak above the model is one stacked
weight (for 35b-a3b, a position's expert gate_up over 10 blocks, 10.7 GB), never a second copy of the model. The
model it consumed is unusable afterwards (its layer weights are deleted), and so is every model that shares those
arrays (e.g. `set_fused_swiglu`'s result and its source, and programs built from them); `consume=False` keeps the
model (the stacks are then a second copy: tests, and pipelines split from a caller's model). Compile time is that
of one period plus the tail: independent of depth for patterns that repeat (Qwen3.5's); an irregular pattern
leaves more layers in the unrolled tail.

Which drivers keep the layer-wise path, and why: DWDP (XLA gather, CUDA VMM store), DEP and independent ranks run
through `jax_dwdp.runner.StageRunner` layer by layer, because their expert sources act between layers (a gather
issued one layer ahead, the store's copy of layer l+1 waited on before layer l+1, a process's hand-off) and keep
per-layer expert weights. Pipeline stages with their own experts (`Pipeline(..., scan=True)`, `--pipeline P
--scan`) can run scanned: one dispatch per stage and microbatch instead of one per layer, so the host time a stage
costs does not grow with its depth. Chunked prefill (continuing a cache) stays layer-wise.

The layer weights inside the scan: each iteration takes its block's weights out of the stacks with a dynamic slice.
XLA copies such a slice into a buffer of its own unless the op reading it can take the address inside the stack.
On a GPU it copies the dense weights: a 32-layer 4K prefill on an H100 ran 392 device-to-device copies (2.9 ms,
~5% of it, the whole of the scan's extra kernel time against the layer-wise programs; 2026-12-05); the expert
weights (the CUTLASS custom calls' operands) are not copied. XLA's dynamic-slice fusion
(`xla_gpu_enable_dynamic_slice_fusion`, per executable) did not remove one of them (H100, 2026-12-05: 392 / 400
copies at 4K / 16K with it as without, at 32K their time within 0.05 ms, the kernel time within 0.2%), so
it is not used (benchmarks/RESULTS.md, "Scanned layer stack and compile time").
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dwdp.config import FULL_ATTENTION, LINEAR_ATTENTION
from jax_dwdp.model import Cache, CausalLM, abstract_model, init_model
from jax_dwdp.model.cache import LogitsMode, cache_length, kv_entry
from jax_dwdp.devices import place
from jax_dwdp.prefill import check_tokens
from jax_dwdp.programs import StaticGraph, canonical_graphs, precision_scope, shell_of
from jax_dwdp.progress import layers


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


def _stack(arrays: list[jax.Array], consume: bool) -> jax.Array:
    """One stacked array from same-shape arrays on one device; with `consume`, each input is deleted once it is in
    (donated writes)."""
    first = arrays[0]
    stack = jnp.zeros((len(arrays), *first.shape), first.dtype, device=next(iter(first.devices())))
    for i, a in enumerate(arrays):
        stack = _put(stack, a, i)
        if consume:
            a.delete()
    return stack


@dataclasses.dataclass(eq=False)  # (identity: its fields are arrays)
class ScannedModel:
    """A model or pipeline stage for one scanned program: its shell (embedding and/or head), the stacked period
    and the tail. `scanned(x, lengths, logits=, cache_len=)` runs it (see `__call__`)."""

    model_graph: StaticGraph  # the model without its layers (embedding, final norm, lm_head: those it has)
    model_state: nnx.State
    period: tuple[str, ...]  # layer types of one period
    graphs: dict  # layer type -> StaticGraph (the first layer of the type's)
    blocks: int
    stacked: tuple  # per position in the period: that layer's state with a leading [blocks] axis
    tail_types: tuple[str, ...]
    tail: tuple  # per tail layer: its state
    cfg: object
    dtype: object
    start_layer: int
    end_layer: int
    full_layer_ids: tuple[int, ...]  # the range's full-attention layers (global ids), its cache's slots
    linear_layer_ids: tuple[int, ...]
    device: object
    _executables: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def is_first(self) -> bool:
        return self.start_layer == 0

    @property
    def is_last(self) -> bool:
        return self.end_layer == self.cfg.num_hidden_layers

    @classmethod
    def from_model(cls, model: CausalLM, *, consume: bool = True) -> "ScannedModel":
        """Restacks a model's (or a stage's) layers; `model` is consumed unless `consume=False` (see the module
        docstring)."""
        cfg = model.cfg
        devices = {d for leaf in jax.tree.leaves(nnx.state(model)) for d in leaf.devices()}
        if len(devices) != 1:
            raise ValueError(f"ScannedModel needs a model on one device; its weights are on {len(devices)}")
        graphs = canonical_graphs(model)
        layers = list(model.layers)
        period, blocks = period_of(tuple(layer.layer_type for layer in layers),
                                   cfg.scan_period(model.start_layer, model.end_layer))
        p = len(period)
        stacked = []
        for j in range(p if blocks else 0):
            states = [nnx.state(layers[b * p + j]) for b in range(blocks)]
            leaves = [jax.tree.leaves(s) for s in states]
            treedef = jax.tree.structure(states[0])
            stacked.append(jax.tree.unflatten(treedef, [_stack([ls[i] for ls in leaves], consume)
                                                        for i in range(len(leaves[0]))]))
        tail_layers = layers[blocks * p:]
        tail = tuple(nnx.state(layer) for layer in tail_layers)
        shell_graph, shell_state = shell_of(model)
        return cls(model_graph=StaticGraph.of(shell_graph), model_state=shell_state, period=period, graphs=graphs,
                   blocks=blocks, stacked=tuple(stacked), tail_types=tuple(layer.layer_type for layer in tail_layers),
                   tail=tail, cfg=cfg, dtype=model.dtype, start_layer=model.start_layer, end_layer=model.end_layer,
                   full_layer_ids=model.full_layer_ids, linear_layer_ids=model.linear_layer_ids, device=devices.pop())

    @classmethod
    def from_layers(cls, cfg, make_range, start_layer: int = 0, end_layer: int | None = None, *,
                    consume: bool = True) -> "ScannedModel":
        """Builds the range [start_layer, end_layer) one layer at a time, straight into the stacked layout:
        `make_range(a, a + 1)` gives layer a as a one-layer model on one device (with the embedding when a == 0,
        the final norm and lm_head when a is the last layer): a checkpoint loader (`parallel.checkpoint_layers.CheckpointLayers`) or
        `init_model`. Each layer's weights are written into their stacks and, with `consume`, deleted at once, so
        the peak is the range's weights plus one layer's (from_model's restacking keeps a whole stacked weight
        beside the model); no layer is ever held twice. (For a model that is already built, from_model is the one
        that keeps the peak low: stacking it layer by layer would hold every stack beside the rest of the model.)"""
        end_layer = cfg.num_hidden_layers if end_layer is None else end_layer
        if not 0 <= start_layer < end_layer <= cfg.num_hidden_layers:
            raise ValueError(f"layer range [{start_layer}, {end_layer}) is empty or outside [0, "
                             f"{cfg.num_hidden_layers})")
        period, blocks = period_of(tuple(cfg.layer_types[start_layer:end_layer]),
                                   cfg.scan_period(start_layer, end_layer))
        p = len(period)
        stacks: list = [None] * p  # per position in the period: (treedef, [stacked leaf])
        tail, graphs, shell, device, dtype = [], {}, {}, None, None
        with layers(f"stacking layers [{start_layer}, {end_layer})", end_layer - start_layer) as bar:
            for i, layer_id in enumerate(range(start_layer, end_layer)):
                piece = make_range(layer_id, layer_id + 1)
                devices = {d for leaf in jax.tree.leaves(nnx.state(piece)) for d in leaf.devices()}
                if len(devices) != 1:
                    raise ValueError(f"ScannedModel needs its layers on one device; layer {layer_id} is on "
                                     f"{len(devices)}")
                if device is not None and devices != {device}:
                    raise ValueError(f"ScannedModel needs its layers on one device; layer {layer_id} is on "
                                     f"{devices.pop()}, the layers before it on {device}")
                device, dtype = devices.pop(), piece.dtype
                layer = piece.layers[0]
                graphs.setdefault(layer.layer_type, StaticGraph.of(nnx.graphdef(layer)))
                shell.update(nnx.to_flat_state(shell_of(piece)[1]))  # the embedding (layer 0), the head (the last)
                b, j = divmod(i, p)
                bar.advance(sum(x.nbytes for x in jax.tree.leaves(nnx.state(layer))))
                if b >= blocks:
                    tail.append((layer.layer_type, nnx.state(layer)))
                    continue
                leaves, treedef = jax.tree.flatten(nnx.state(layer))
                if stacks[j] is None:
                    stacks[j] = (treedef, [jnp.zeros((blocks, *x.shape), x.dtype, device=device) for x in leaves])
                for k, x in enumerate(leaves):
                    stacks[j][1][k] = _put(stacks[j][1][k], x, b)
                    if consume:
                        x.delete()
        shell_graph, _ = shell_of(abstract_model(cfg, dtype=dtype, start_layer=start_layer, end_layer=end_layer,
                                                 kernels=piece.kernels))
        return cls(model_graph=StaticGraph.of(shell_graph), model_state=nnx.from_flat_state(sorted(shell.items())),
                   period=period, graphs=graphs, blocks=blocks,
                   stacked=tuple(jax.tree.unflatten(treedef, leaves) for treedef, leaves in stacks),
                   tail_types=tuple(typ for typ, _ in tail), tail=tuple(state for _, state in tail), cfg=cfg,
                   dtype=dtype, start_layer=start_layer, end_layer=end_layer,
                   full_layer_ids=cfg.layer_ids(FULL_ATTENTION, start_layer, end_layer),
                   linear_layer_ids=cfg.layer_ids(LINEAR_ATTENTION, start_layer, end_layer), device=device)

    @classmethod
    def random(cls, cfg, *, dtype, seed: int = 0, start_layer: int = 0, end_layer: int | None = None, device=None,
               fused_swiglu: bool = False, kernels=None) -> "ScannedModel":
        """Random weights (`init_model`'s: they depend on the global layer only, so this is the model init_model
        draws for the same seed) made one layer at a time into the stacks (`from_layers`) on `device`; `kernels`:
        the kernel choices (default: the process's)."""
        return cls.from_layers(cfg, lambda a, b: init_model(cfg, dtype=dtype, seed=seed, start_layer=a, end_layer=b,
                                                            device=device, fused_swiglu=fused_swiglu,
                                                            kernels=kernels),
                               start_layer, end_layer)

    def describe(self) -> str:
        return (f"scanned: {self.blocks} block{'' if self.blocks == 1 else 's'} of {len(self.period)} layers"
                f" + {len(self.tail)}")

    # ---- running -----------------------------------------------------------------------------------------------
    def executable(self, x, lengths, *, logits: LogitsMode = "all", cache_len: int | None = None):
        """The compiled program for x's shape (tokens [B, T] on the first stage, else hidden states [B, T, H]),
        this logits mode (a last stage's; others return hidden states) and cache length."""
        length = cache_length(x.shape[1], cache_len)
        mode = logits if self.is_last else "none"
        key = (tuple(x.shape), str(x.dtype), mode, length)
        if key not in self._executables:
            static = (self.model_graph, tuple(sorted(self.graphs.items())), self.period, self.tail_types,
                      self.is_first, self.is_last, mode, length)
            self._executables[key] = _forward.lower(*static, *self._dynamic(x, lengths)).compile()
        return self._executables[key], length

    def _dynamic(self, x, lengths):
        return self.model_state, self.stacked, self.tail, *self.place(x, lengths)

    def place(self, *arrays) -> tuple:
        """The arrays on this model's device, by one transfer call (jax_dwdp.devices.place)."""
        return place(arrays, self.device)

    def __call__(self, x, lengths, *, logits: LogitsMode = "all", cache_len: int | None = None):
        """x: tokens [B, T] int32 (first stage) or hidden states [B, T, H] (other stages), right-padded; lengths [B]
        int32. Returns (logits, or the hidden states on a stage that is not the last; the range's Cache), as the
        layer-wise StageRunner does. Inputs are not validated here (`jit_prefill_scanned` and `Pipeline.prefill`
        check tokens)."""
        exe, length = self.executable(x, lengths, logits=logits, cache_len=cache_len)
        x, lengths = self.place(x, lengths)
        out, caches = exe(self.model_state, self.stacked, self.tail, x, lengths)
        return out, self._cache(caches, lengths, x.shape[0], length)

    def _cache(self, caches, lengths, b: int, cache_len: int) -> Cache:
        (conv, recurrent), (key, value) = caches[LINEAR_ATTENTION], caches[FULL_ATTENTION]
        return Cache.assemble(self.cfg, self.dtype, key=key, value=value, conv=conv, recurrent=recurrent,
                              lengths=lengths, batch=b, cache_len=cache_len, full_layer_ids=self.full_layer_ids,
                              linear_layer_ids=self.linear_layer_ids, device=self.device)


def _layer(kind: str, graph: StaticGraph, state, h, positions, lengths, cache_len: int):
    """One layer; its K/V padded to cache_len (the Cache layout), its conv / recurrent state as it is (None: a
    Nemotron-H MoE or MLP layer, which leaves no cache)."""
    h, out = nnx.merge(graph.value, state)(h, positions, lengths)
    return h, (kv_entry(out, cache_len) if kind == FULL_ATTENTION else out)


@functools.partial(jax.jit, static_argnums=tuple(range(8)))
def _forward(model_graph, graphs, period, tail_types, is_first, is_last, mode, cache_len, model_state, stacked, tail,
             x, lengths):
    graphs = dict(graphs)
    shell = nnx.merge(model_graph.value, model_state)
    h = shell.embed(x) if is_first else x
    with precision_scope(h.dtype):
        b, t = x.shape[:2]
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
            if out is not None:  # (MoE and MLP layers leave no cache)
                outs.append((typ, tuple(x[None] for x in out)))

        def gather(kind, k):
            parts = [pair[k] for typ, pair in outs if typ == kind]
            return jnp.concatenate(parts) if parts else None

        out = shell.head(h, lengths, mode) if is_last else h
        return out, {kind: (gather(kind, 0), gather(kind, 1)) for kind in (LINEAR_ATTENTION, FULL_ATTENTION)}


def jit_prefill_scanned(scanned: ScannedModel, *, logits: LogitsMode = "all", cache_len: int | None = None):
    """prefill(tokens [B, T], lengths [B] | None) -> (logits, Cache), the same results as `jit_prefill` on the model
    the ScannedModel was made from (the whole model), compiled as one program (one per shape).
    `prefill.compile(tokens, lengths)` compiles ahead of time."""
    if not (scanned.is_first and scanned.is_last):
        raise ValueError("jit_prefill_scanned needs the whole model; a pipeline stage's ScannedModel is called with "
                         "its stage's input (Pipeline(..., scan=True))")
    vocab = scanned.cfg.vocab_size

    def prefill(tokens, lengths=None):
        tokens, lengths = check_tokens(tokens, vocab, lengths)
        return scanned(tokens, lengths, logits=logits, cache_len=cache_len)

    def compile_(tokens, lengths=None):
        tokens, lengths = check_tokens(tokens, vocab, lengths)
        return scanned.executable(tokens, lengths, logits=logits, cache_len=cache_len)[0]

    prefill.compile = compile_
    return prefill

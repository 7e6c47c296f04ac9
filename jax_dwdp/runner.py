"""The stage runner: one model or pipeline stage on its device(s), its experts from an ExpertSource.

This is the one layer loop (`StageRunner._run`) and the one place where DWDP's prefetch is scheduled: layer l+1's
experts start to move right before layer l is enqueued, so that they move while layer l computes. Every driver is
a thin user: `jit_prefill` (one device, `LocalSource`), `Pipeline` (a stage per mesh row: `LocalSource`, `XlaGatherSource` or `FfiStoreSource`
over the row's DWDP ranks), `IndependentRanks` (a runner per device: `XlaPeerCopySource` or `FfiStoreSource`).

Two ways to compile the same loop (the execution modes a runner runs; `execution_mode` is the one check of a
mode, "scanned" being `jax_dwdp.scan`'s):
- layer-wise: one program per layer type (the layers of a type share it, their weights passed as
  arguments), the loop driven from Python. The compile time does not grow with depth (XLA needs about 10 s per
  layer on the GPU for whole-model programs); the programs depend on neither the logits mode nor the cache
  length, so one set serves every call.
- whole (the default, DEFAULT_MODE): the loop traced into one program per (logits mode, cache length), for sources
  that can (`LocalSource`, `XlaGatherSource`, `DepDispatchSource`); sources that act between layers run
  layer-wise whatever the mode.

Placement: `mesh` (a 1-D 'dwdp' mesh; the model already placed on it, see dwdp.place_model) runs the programs
over the ranks with shard_map, the batch split evenly over them (a batch that the ranks do not divide gets rows of
length 0, dropped from the results); `device` runs them on that device with the stage's non-expert weights there
(taken from a replicated array's own shard, else copied: independent ranks); neither runs the model where it is.
The runner keeps only what its programs read: with a source that provides the experts, the model's own expert
arrays are not referenced (the caller's model may still hold them).

`profile` runs the loop with each layer split into its mixer and its MoE, every rank waited for separately: how
long each rank waits at the MoE for the slowest one (DEP's per-layer synchronisation).
"""

from __future__ import annotations

import functools
import time
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dwdp.model import Cache, CausalLM, is_expert_weight
from jax_dwdp.model.cache import LogitsMode
from jax_dwdp.sources import AXIS, ExpertSource, LocalSource
from jax_dwdp.devices import place, put
from jax_dwdp.programs import (StaticGraph, canonical_graphs, embed_body, head_body, layer_body, precision_scope,
                               run_embed, run_head, run_layer, shell_of)


MODES = ("whole", "layerwise", "scanned")
DEFAULT_MODE = "whole"  # one program: XLA schedules across layers; "layerwise" for deep models' compile time


def execution_mode(mode: str | None = None, *, layerwise: bool = False, scan: bool = False) -> str:
    """The one check of an execution mode: `mode`, a word of MODES, or the booleans of the API's older keywords
    (layerwise=True: "layerwise", scan=True: "scanned"), which must not disagree with it; DEFAULT_MODE when
    nothing asks."""
    if mode is not None and mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose one of {', '.join(MODES)}")
    if layerwise and scan:
        raise ValueError("layerwise=True and scan=True: one execution mode at a time")
    implied = "layerwise" if layerwise else "scanned" if scan else None
    if mode is not None and implied is not None and mode != implied:
        raise ValueError(f"mode {mode!r} with {'layerwise' if layerwise else 'scan'}=True: give one of them")
    return mode or implied or DEFAULT_MODE


class StageRunner:
    """runner(x, lengths, *, logits, cache_len, mode) -> (logits or hidden states, the stage's Cache)."""

    def __init__(self, model: CausalLM, source: ExpertSource | None = None, *, mesh: Mesh | None = None,
                 device: jax.Device | None = None):
        self.source, self.mesh, self.device = source or LocalSource(), mesh, device
        self.ranks = mesh.shape[AXIS] if mesh is not None else 1
        graphdef, state = nnx.split(model)
        # The weights the programs take: the experts replaced by scalar placeholders when the source provides them.
        where = NamedSharding(mesh, P()) if mesh is not None else device
        flat = []
        for path, var in nnx.to_flat_state(state):
            value = var.get_value()
            if self.source.replaces_experts and is_expert_weight(path):
                value = put(jnp.zeros((), value.dtype), where) if mesh is not None else jax.device_put(
                    jnp.zeros((), value.dtype), where)
            elif device is not None:
                value = on_device(value, device)
            flat.append((path, type(var)(value)))
        self.graphdef, self.state = graphdef, nnx.from_flat_state(flat)
        self.stage = nnx.merge(graphdef, self.state)  # the layer structure the loop walks
        shell_graph, self.shell_state = shell_of(self.stage)  # what embed and head read, without the layers
        self.shell_graph = StaticGraph.of(shell_graph)
        self.layer_states = [nnx.state(layer) for layer in self.stage.layers]
        self.canonical = canonical_graphs(self.stage)
        self._programs: dict = {}

    # ---- the layer loop ----------------------------------------------------------------------------------------
    def _run(self, ops, x, lengths, logits, cache_len, abort_on_error, cache=None):
        """embed -> layers -> head, each piece through `ops` (compiled programs, or traced calls); `cache` is an
        earlier prefill's cache that these tokens continue."""
        source, stage = ops.source, ops.stage
        h = ops.embed(x) if stage.is_first else x
        last = len(stage.layers) - 1
        pending = source.first(h)

        def run_layer(i, layer, h, positions, lens, layer_cache):
            nonlocal pending
            # DWDP's prefetch: layer i+1's experts start moving now, before layer i is enqueued, and move under it.
            ahead = source.prefetch(i + 1, h) if i < last else None
            (h, out), fetched = ops.layer(i, layer, h, positions, lens, pending, ahead if source.gathers else None,
                                          layer_cache)
            pending = source.delivered(ahead, fetched)
            return h, out

        try:
            h, cache = stage.forward_layers(h, lengths, cache_len=cache_len, run_layer=run_layer, cache=cache)
        except BaseException:
            if abort_on_error:
                source.abort()
            raise
        if not stage.is_last:
            return h, cache
        return (None if logits == "none" else ops.head(logits, h, lengths)), cache

    # ---- running -----------------------------------------------------------------------------------------------
    def place(self, *arrays) -> tuple:
        """The call's arrays (tokens or hidden states, lengths) on this runner's devices, by one transfer call."""
        if self.mesh is not None:
            return put(arrays, NamedSharding(self.mesh, P(AXIS)))
        return place(arrays, self.device)

    def __call__(self, x, lengths, *, logits: LogitsMode = "all", cache_len: int | None = None,
                 mode: str = DEFAULT_MODE, abort_on_error: bool = True, cache: Cache | None = None):
        """x: tokens [B, T] (first stage) or hidden states [B, T, H]; lengths [B]. `abort_on_error=False` leaves
        the source's abort to the caller (independent ranks abort once, after every rank has stopped). `cache`
        (one device only): the stage's cache from an earlier prefill of the same sequences, which x continues.
        Over N ranks, a batch that N does not divide is padded with rows of length 0, which the results leave out."""
        if cache is not None and (self.mesh is not None or not isinstance(self.source, LocalSource)):
            raise ValueError("a prefill continues a cache on one device with its own experts only")
        batch = x.shape[0]
        x, lengths = pad_batch(x, lengths, padded_rows(batch, self.ranks))
        x, lengths = self.place(x, lengths)
        if cache is not None:
            cache = jax.device_put(cache, self.device) if self.device is not None else cache
        if not self._layerwise(mode):
            args = (self.state, self.source.operands(), x, lengths) + (() if cache is None else (cache,))
            out = self._whole(logits, cache_len)(*args)
        else:
            out = self._run(_Programs(self), x, lengths, logits, cache_len, abort_on_error, cache)
        return take_rows(out, batch) if x.shape[0] != batch else out

    def profile(self, x, lengths, *, cache_len: int | None = None) -> dict:
        """One layer-wise prefill (logits "none") with each layer run as two programs, its mixer (norm, attention
        or Gated DeltaNet, residual) and its MoE (norm, the source's experts, residual), each waited for on every
        rank separately (one host thread per rank on GPUs). Every layer starts when the previous one has ended on
        all ranks, so a rank's mixer end is when it reaches the MoE, where DEP exchanges tokens.

        Returns {"mixer_ms": [layers][ranks] each rank's mixer, "moe_ms": [layers] from the last rank's mixer end
        to the last rank's MoE end, "wait_ms": [layers][ranks] how long each rank waits at the MoE for the slowest
        rank (max over ranks of the mixer end minus its own), "layer_ms": [layers]}. Sources that fetch inside the
        previous layer's program (`gathers`) issue that fetch in the mixer's program."""
        batch = x.shape[0]
        x, lengths = pad_batch(x, lengths, padded_rows(batch, self.ranks))
        ops = _Profiled(self)
        try:
            self._run(ops, *self.place(x, lengths), "none", cache_len, True)
        finally:
            ops.close()
        return ops.report()

    def lower(self, x, lengths, *, logits: LogitsMode = "all", cache_len: int | None = None):
        """The lowered whole-stage program (to inspect its HLO)."""
        if not self.source.whole_program:
            raise ValueError(f"{type(self.source).__name__} experts run layer-wise only")
        return self._whole(logits, cache_len).lower(self.state, self.source.operands(), *self.place(x, lengths))

    def compile(self, x, lengths, *, logits: LogitsMode = "all", cache_len: int | None = None,
                mode: str = DEFAULT_MODE) -> None:
        """Compiles ahead of time for these shapes (layer-wise: by one run, which compiles each program once)."""
        if not self._layerwise(mode):
            self.lower(x, lengths, logits=logits, cache_len=cache_len).compile()
        else:
            jax.block_until_ready(self(x, lengths, logits=logits, cache_len=cache_len, mode="layerwise"))

    def _layerwise(self, mode: str) -> bool:
        """Whether a call in `mode` runs layer by layer: "layerwise", or "whole" with a source that acts between
        layers (it cannot run inside one program)."""
        if execution_mode(mode) == "scanned":
            raise ValueError("a StageRunner runs whole or layer-wise programs; a scanned stage is a ScannedModel")
        return mode == "layerwise" or not self.source.whole_program

    # ---- programs ----------------------------------------------------------------------------------------------
    def _whole(self, logits, cache_len):
        key = ("whole", logits, cache_len)
        if key not in self._programs:
            def body(state, operands, x, lengths, cache=None):
                stage = nnx.merge(self.graphdef, state)
                with precision_scope(stage.dtype):
                    return self._run(_Traced(self, stage, self.source.bind(operands)), x, lengths.astype(jnp.int32),
                                     logits, cache_len, abort_on_error=False, cache=cache)
            if self.mesh is not None:
                b = P(AXIS)
                out = None if (self.stage.is_last and logits == "none") else b
                cache = Cache(key=P(None, AXIS), value=P(None, AXIS), conv=P(None, AXIS), recurrent=P(None, AXIS),
                              lengths=b, full_layer_ids=self.stage.full_layer_ids,
                              linear_layer_ids=self.stage.linear_layer_ids)
                body = jax.shard_map(body, mesh=self.mesh, in_specs=(P(), b, b, b), out_specs=(out, cache),
                                     check_vma=False)
            self._programs[key] = jax.jit(body)
        return self._programs[key]

    def program(self, kind: str, *key):
        """The compiled embed / head(mode) / layer(type) program, shared by every call of this runner."""
        if (kind, *key) in self._programs:
            return self._programs[(kind, *key)]
        b = P(AXIS)
        if kind == "embed":
            fn, static, specs, out = embed_body, (self.shell_graph,), (P(), b), b
        elif kind == "head":
            fn, static, specs, out = head_body, (self.shell_graph, *key), (P(), b, b), b
        elif kind == "mixer":
            fn, static, specs, out = (mixer_body, (self.canonical[key[0]], self.source), (P(), b, b, b, P(), b),
                                      ((b, b), b))
        elif kind == "moe":
            fn, static, specs, out = moe_body, (self.canonical[key[0]], self.source), (P(), b, b), b
        else:
            # (the last argument, a continued cache, is None on a mesh: see __call__)
            fn, static, specs, out = (layer_body, (self.canonical[key[0]], self.source), (P(), b, b, b, b, b, P()),
                                      ((b, b), b))
        if self.mesh is None:  # the module-level programs, shared with every other runner
            program = functools.partial({"embed": run_embed, "head": run_head, "layer": run_layer, "mixer": run_mixer,
                                         "moe": run_moe}[kind], *static)
        else:
            program = jax.jit(jax.shard_map(functools.partial(fn, *static), mesh=self.mesh, in_specs=specs,
                                            out_specs=out, check_vma=False))
        self._programs[(kind, *key)] = program
        return program


class _Programs:
    """The loop's pieces as compiled programs (layer-wise)."""

    def __init__(self, runner: StageRunner):
        self.runner, self.stage, self.source = runner, runner.stage, runner.source

    def embed(self, x):
        return self.runner.program("embed")(self.runner.shell_state, x)

    def layer(self, i, layer, h, positions, lengths, pending, ahead, layer_cache):
        program = self.runner.program("layer", layer.layer_type)
        return program(self.runner.layer_states[i], h, positions, lengths, pending, ahead, layer_cache)

    def head(self, mode, h, lengths):
        return self.runner.program("head", mode)(self.runner.shell_state, h, lengths)


class _Traced:
    """The loop's pieces as plain calls, inside one whole-stage program."""

    def __init__(self, runner: StageRunner, stage, source: ExpertSource):
        self.canonical, self.stage, self.source = runner.canonical, stage, source

    def embed(self, x):
        return self.stage.embed(x)

    def layer(self, i, layer, h, positions, lengths, pending, ahead, layer_cache):
        return layer_body(self.canonical[layer.layer_type], self.source, nnx.state(layer), h, positions, lengths,
                          pending, ahead, layer_cache)

    def head(self, mode, h, lengths):
        return self.stage.head(h, lengths, mode)


class _Profiled(_Programs):
    """The loop's pieces as compiled programs, each layer as its mixer then its MoE, every rank timed (profile)."""

    def __init__(self, runner: StageRunner):
        super().__init__(runner)
        threads = runner.ranks > 1
        self._pool = ThreadPoolExecutor(runner.ranks, thread_name_prefix="profile-rank") if threads else None
        self.mixer_ms, self.moe_ms, self.layer_ms = [], [], []

    def _ready_ms(self, array, t0) -> list[float]:
        """Per rank (in mesh order), when its shard of `array` was ready, in ms after t0."""
        shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)

        def ready(shard):
            shard.data.block_until_ready()
            return (time.perf_counter() - t0) * 1e3
        return list(self._pool.map(ready, shards)) if self._pool is not None else [ready(s) for s in shards]

    def layer(self, i, layer, h, positions, lengths, pending, ahead, layer_cache):
        runner = self.runner
        state = runner.layer_states[i]
        t0 = time.perf_counter()
        (x, out), fetched = runner.program("mixer", layer.layer_type)(state, h, positions, lengths, layer_cache,
                                                                      ahead)
        mixer = self._ready_ms(x, t0)
        h = runner.program("moe", layer.layer_type)(state, x, pending)
        end = max(self._ready_ms(h, t0))
        self.mixer_ms.append(mixer)
        self.moe_ms.append(end - max(mixer))
        self.layer_ms.append(end)
        return (h, out), fetched

    def close(self):
        if self._pool is not None:
            self._pool.shutdown()

    def report(self) -> dict:
        mixer = np.asarray(self.mixer_ms)
        wait = mixer.max(axis=1, keepdims=True) - mixer
        return {"mixer_ms": mixer.round(3).tolist(), "moe_ms": np.round(self.moe_ms, 3).tolist(),
                "wait_ms": wait.round(3).tolist(), "layer_ms": np.round(self.layer_ms, 3).tolist()}


def mixer_body(graph: StaticGraph, source, state, h, positions, lengths, layer_cache=None, ahead=None):
    """A decoder layer's first half (DecoderLayer.mix), and the next layer's fetch for sources that fetch inside
    a program (`ahead`, see layer_body). Returns ((x, cache), the next layer's experts or None)."""
    fetched = None
    if ahead is not None:
        h, fetched = source.overlap(h, ahead)
    with precision_scope(h.dtype):
        return nnx.merge(graph.value, state).mix(h, positions, lengths, layer_cache), fetched


def moe_body(graph: StaticGraph, source, state, x, pending):
    """A decoder layer's second half (DecoderLayer.moe) with the experts from `source`."""
    with precision_scope(x.dtype):
        return nnx.merge(graph.value, state).moe(x, source.experts(pending))


run_mixer = jax.jit(mixer_body, static_argnums=(0, 1))
run_moe = jax.jit(moe_body, static_argnums=(0, 1))


def on_device(value: jax.Array, device: jax.Device) -> jax.Array:
    """`value` on `device` alone: the shard it already has there when it holds the whole array there (a replicated
    array), else a copy."""
    if isinstance(value, jax.Array) and device in value.devices():
        for shard in value.addressable_shards:
            if shard.device == device and shard.data.shape == value.shape:
                return shard.data
    return jax.device_put(value, device)


def padded_rows(batch: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that holds `batch` rows."""
    return -(-batch // multiple) * multiple


def pad_batch(x, lengths, rows: int):
    """x [B, ...] and lengths [B] grown to `rows` rows of length 0 (token 0 / zero hidden states): a length-0 row
    changes no other row and its outputs are finite and ignored."""
    pad = rows - x.shape[0]
    if pad == 0:
        return x, lengths
    if isinstance(x, jax.Array):
        x = jnp.pad(x, ((0, pad),) + ((0, 0),) * (x.ndim - 1))
    else:
        x = np.concatenate([np.asarray(x), np.zeros((pad, *x.shape[1:]), np.asarray(x).dtype)])
    lengths = np.concatenate([np.asarray(lengths), np.zeros((pad,), np.asarray(lengths).dtype)])
    return x, lengths


def take_rows(out, batch: int):
    """(logits or hidden states, Cache) of a padded batch -> those of its first `batch` rows."""
    logits, cache = out
    if logits is not None:
        logits = logits[:batch]
    rows = slice(0, batch)
    cache = cache.replace(key=cache.key[:, rows], value=cache.value[:, rows], conv=cache.conv[:, rows],
                          recurrent=cache.recurrent[:, rows], lengths=cache.lengths[rows])
    return logits, cache

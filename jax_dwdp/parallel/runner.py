"""The stage runner: one model or pipeline stage on its device(s), its experts from an ExpertSource.

This is the one layer loop (`StageRunner._run`) and the one place where DWDP's prefetch is scheduled: layer l+1's
experts start to move right before layer l is enqueued, so that they move while layer l computes. Every driver is
a thin user: `jit_prefill` (one device, `Local`), `Pipeline` (a stage per mesh row: `Local`, `Gather` or `Store`
over the row's DWDP ranks), `IndependentRanks` (a runner per device: `PeerCopy` or `Store`).

Two ways to compile the same loop:
- layer-wise (default): one program per layer type (the layers of a type share it, their weights passed as
  arguments), the loop driven from Python. The compile time does not grow with depth (XLA needs about 10 s per
  layer on the GPU for whole-model programs); the programs depend on neither the logits mode nor the cache
  length, so one set serves every call.
- whole: the loop traced into one program per (logits mode, cache length), for sources that can (`Local`,
  `Gather`); others always run layer-wise.

Placement: `mesh` (a 1-D 'dwdp' mesh; the model already placed on it, see dwdp.place_model) runs the programs
over the ranks with shard_map, the batch split evenly over them; `device` copies the stage's non-expert weights
to that device (independent ranks); neither runs the model where it is.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dwdp.model import Cache, Qwen35MoeForCausalLM
from jax_dwdp.model.qwen35_moe import LogitsMode
from jax_dwdp.parallel.experts import AXIS, ExpertSource, Local, is_expert_weight
from jax_dwdp.programs import (StaticGraph, canonical_graphs, embed_body, head_body, layer_body, precision_scope,
                               run_embed, run_head, run_layer)


class StageRunner:
    """runner(x, lengths, *, logits, cache_len, layerwise) -> (logits or hidden states, the stage's Cache)."""

    def __init__(self, model: Qwen35MoeForCausalLM, source: ExpertSource | None = None, *, mesh: Mesh | None = None,
                 device: jax.Device | None = None, barrier=lambda x: x):
        """`barrier` (cpu_barrier) waits for each layer on the CPU, for drivers that run several devices' layers
        from Python (see cpu_barrier)."""
        self.model, self.source, self.mesh, self.device = model, source or Local(), mesh, device
        self._barrier = barrier
        self.ranks = mesh.shape[AXIS] if mesh is not None else 1
        graphdef, state = nnx.split(model)
        # The weights the programs take: the experts replaced by scalar placeholders when the source provides them.
        where = NamedSharding(mesh, P()) if mesh is not None else device
        flat = []
        for path, var in nnx.to_flat_state(state):
            value = var.get_value()
            if self.source.replaces_experts and is_expert_weight(path):
                value = jax.device_put(jnp.zeros((), value.dtype), where)
            elif device is not None:
                value = jax.device_put(value, device)
            flat.append((path, type(var)(value)))
        self.graphdef, self.state = graphdef, nnx.from_flat_state(flat)
        self.graph = StaticGraph.of(graphdef)
        self.stage = nnx.merge(graphdef, self.state)  # the layer structure the loop walks
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
            pending = fetched if source.gathers else ahead
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
    def place(self, x):
        if self.mesh is not None:
            return jax.device_put(x, NamedSharding(self.mesh, P(AXIS)))
        return jax.device_put(x, self.device) if self.device is not None else jnp.asarray(x)

    def __call__(self, x, lengths, *, logits: LogitsMode = "all", cache_len: int | None = None,
                 layerwise: bool = True, abort_on_error: bool = True, cache: Cache | None = None):
        """x: tokens [B, T] (first stage) or hidden states [B, T, H]; lengths [B]. `abort_on_error=False` leaves
        the source's abort to the caller (independent ranks abort once, after every rank has stopped). `cache`
        (one device only): the stage's cache from an earlier prefill of the same sequences, which x continues."""
        if x.shape[0] % self.ranks:
            raise ValueError(f"batch {x.shape[0]} cannot be split evenly over {self.ranks} DWDP ranks")
        if cache is not None and (self.mesh is not None or not isinstance(self.source, Local)):
            raise ValueError("a prefill continues a cache on one device with its own experts only")
        x, lengths = self.place(x), self.place(lengths)
        if cache is not None:
            cache = jax.device_put(cache, self.device) if self.device is not None else cache
        if not layerwise and self.source.whole_program:
            args = (self.state, self.source.operands(), x, lengths) + (() if cache is None else (cache,))
            return self._whole(logits, cache_len)(*args)
        return self._run(_Programs(self), x, lengths, logits, cache_len, abort_on_error, cache)

    def lower(self, x, lengths, *, logits: LogitsMode = "all", cache_len: int | None = None):
        """The lowered whole-stage program (to inspect its HLO)."""
        if not self.source.whole_program:
            raise ValueError(f"{type(self.source).__name__} experts run layer-wise only")
        return self._whole(logits, cache_len).lower(self.state, self.source.operands(), self.place(x),
                                                    self.place(lengths))

    def compile(self, x, lengths, *, logits: LogitsMode = "all", cache_len: int | None = None,
                layerwise: bool = True) -> None:
        """Compiles ahead of time for these shapes (layer-wise: by one run, which compiles each program once)."""
        if not layerwise and self.source.whole_program:
            self.lower(x, lengths, logits=logits, cache_len=cache_len).compile()
        else:
            jax.block_until_ready(self(x, lengths, logits=logits, cache_len=cache_len))

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
                out = None if (self.model.is_last and logits == "none") else b
                cache = Cache(key=P(None, AXIS), value=P(None, AXIS), conv=P(None, AXIS), recurrent=P(None, AXIS),
                              lengths=b, full_layer_ids=self.model.full_layer_ids,
                              linear_layer_ids=self.model.linear_layer_ids)
                body = jax.shard_map(body, mesh=self.mesh, in_specs=(P(), b, b, b), out_specs=(out, cache),
                                     check_vma=False)
            self._programs[key] = jax.jit(body)
        return self._programs[key]

    def program(self, kind: str, *key):
        """The compiled embed / head(mode) / layer(type) program, shared by every call of this runner."""
        if (kind, *key) in self._programs:
            return self._programs[(kind, *key)]
        if kind == "embed":
            fn, static, specs, out = embed_body, (self.graph,), (P(), P(AXIS)), P(AXIS)
        elif kind == "head":
            fn, static, specs, out = head_body, (self.graph, *key), (P(), P(AXIS), P(AXIS)), P(AXIS)
        else:
            b = P(AXIS)
            # (the last argument, a continued cache, is None on a mesh: see __call__)
            fn, static, specs, out = (layer_body, (self.canonical[key[0]], self.source), (P(), b, b, b, b, b, P()),
                                      ((b, b), b))
        if self.mesh is None:  # the module-level programs, shared with every other runner
            program = functools.partial({"embed": run_embed, "head": run_head, "layer": run_layer}[kind], *static)
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
        return self.runner.program("embed")(self.runner.state, x)

    def layer(self, i, layer, h, positions, lengths, pending, ahead, layer_cache):
        program = self.runner.program("layer", layer.layer_type)
        return self.runner._barrier(program(self.runner.layer_states[i], h, positions, lengths, pending, ahead,
                                            layer_cache))

    def head(self, mode, h, lengths):
        return self.runner.program("head", mode)(self.runner.state, h, lengths)


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

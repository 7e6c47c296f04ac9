"""Pipeline parallelism: contiguous layer ranges on the rows of the mesh, microbatches pushed through them.

Each stage is a model built for its range [start_layer, end_layer) on its own device(s): it holds only those
layers' weights (loaders skip other layers' tensors without reading them) and allocates caches only for them, one
slot per layer of the range with a recurrent state (Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba-2) or K/V (full
attention); Nemotron-H's MoE and MLP layers hold none. Stages may cut anywhere in the pattern (Qwen3.5's 3 linear + 1
full, Nemotron-H's Mamba-2 / MoE / attention sequence); expert backends place and move the experts of the stage's MoE
layers only.

The prefill is GPipe-style and MPMD: each stage is its own compiled program (with `scan=True`, one scanned program per
stage over its stacked layers, `jax_dwdp.scan`: one dispatch per stage and microbatch; otherwise the stage runner's
programs, one per layer type with `layerwise`). The driver enqueues stage s for
microbatch m right after stage s-1, and JAX's asynchronous dispatch lets stage s work on microbatch m while stage
s-1 works on m+1; activations move between the stages' devices with device_put (a device-to-device copy).

With one process per device (jax.distributed, `--num-processes`), each process builds and runs only the stages
whose devices it drives, and the hidden states go from stage s-1's process to stage s's through a two-device
program (`Handoff`: a ppermute, which both processes run); the last stage's process holds the logits.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jax_dwdp.config import FULL_ATTENTION, LINEAR_ATTENTION
from jax_dwdp.devices import builder_device, make_mesh, put
from jax_dwdp.families import FamilyConfig
from jax_dwdp.model import Cache, CausalLM, abstract_model, init_model, with_kernels
from jax_dwdp.model.cache import LogitsMode
from jax_dwdp.parallel.backends import ExpertBackend, expert_backend
from jax_dwdp.parallel.checkpoint_layers import CheckpointLayers
from jax_dwdp.parallel.placement import build_placed, model_range
from jax_dwdp.prefill import InputError, check_tokens
from jax_dwdp.runner import StageRunner, execution_mode, pad_batch, padded_rows, take_rows
from jax_dwdp.scan import ScannedModel
from jax_dwdp.sources import AXIS
from jax_dwdp.weights import load_checkpoint
from jax_dwdp.weights.hf_loader import load_config


@dataclasses.dataclass(frozen=True)
class StageSpec:
    stage: int
    start_layer: int
    end_layer: int
    linear_attention_layers: tuple[int, ...]  # the layers with a recurrent state (Gated DeltaNet, Mamba-2)
    full_attention_layers: tuple[int, ...]
    moe_layers: tuple[int, ...] = ()  # the layers with routed experts


def plan_stages(cfg: FamilyConfig, pipeline: int, boundaries: list[int] | None = None) -> list[StageSpec]:
    """Contiguous layer ranges for `pipeline` stages.

    Without boundaries the split is as even as possible, earlier stages taking the remainder (10 layers over 4
    stages: 3, 3, 2, 2). `boundaries` gives the pipeline - 1 first layers of stages 1.. explicitly.
    """
    n = cfg.num_hidden_layers
    if pipeline < 1:
        raise ValueError(f"pipeline must be >= 1, got {pipeline}")
    if boundaries is None:
        if pipeline > n:
            raise ValueError(f"{pipeline} pipeline stages for {n} layers: every stage needs at least one layer")
        base, extra = divmod(n, pipeline)
        sizes = [base + (s < extra) for s in range(pipeline)]
        starts = [sum(sizes[:s]) for s in range(pipeline)]
    else:
        boundaries = [int(b) for b in boundaries]
        if len(boundaries) != pipeline - 1:
            raise ValueError(f"{pipeline} stages need {pipeline - 1} boundaries, got {len(boundaries)}: {boundaries}")
        starts = [0, *boundaries]
        for a, b in zip(starts, [*boundaries, n]):
            if not a < b:
                raise ValueError(f"stage boundaries {boundaries} leave an empty stage [{a}, {b}) in {n} layers")
        if starts[-1] >= n:
            raise ValueError(f"stage boundary {starts[-1]} is outside the {n} layers")
    ends = [*starts[1:], n]
    return [
        StageSpec(s, a, b, cfg.layer_ids(LINEAR_ATTENTION, a, b), cfg.layer_ids(FULL_ATTENTION, a, b),
                  cfg.moe_layer_ids(a, b))
        for s, (a, b) in enumerate(zip(starts, ends))
    ]


def stage_from_model(model: CausalLM, start_layer: int, end_layer: int, device) -> CausalLM:
    """The stage [start_layer, end_layer) of a whole model, its weights copied to `device` (tests, benchmarks)."""
    graphdef, state = nnx.split(model_range(model, start_layer, end_layer))
    return nnx.merge(graphdef, jax.device_put(state, device))


def check_layout(batch: int, microbatches: int, ranks: int) -> None:
    """Any batch runs over any microbatches and ranks (padded with rows of length 0); the counts must be >= 1."""
    if microbatches < 1 or ranks < 1 or batch < 1:
        raise InputError(f"need a batch, microbatches and ranks >= 1, got batch {batch}, {microbatches} "
                         f"microbatches, {ranks} ranks")


def microbatch_rows(batch: int, microbatches: int, ranks: int) -> tuple[int, int]:
    """(rows per microbatch, microbatches that hold real rows) for `batch` sequences in up to `microbatches`
    microbatches, each split over `ranks` ranks: a microbatch has ceil(batch / microbatches) rows rounded up to a
    multiple of the ranks, the last one padded with rows of length 0; microbatches that would hold only padding are
    not run (a batch of 2 in 4 microbatches runs 2)."""
    check_layout(batch, microbatches, ranks)
    size = padded_rows(padded_rows(batch, microbatches) // microbatches, ranks)
    return size, padded_rows(batch, size) // size


class Pipeline:
    """Stages of one model on the rows of a (pipeline, dwdp) mesh, each run by a StageRunner (or, with `scan=True`,
    as one scanned program, `jax_dwdp.scan.ScannedModel`).

    `experts` is chosen once, a word of `backends.BACKENDS` (or an ExpertBackend): "local" (each device holds all
    of its stage's experts; with a 'dwdp' axis of N > 1, the replicated baseline), "xla" (DWDP: each of the row's
    N ranks stores 1/N of its stage's experts, the layers all-gather them one layer ahead), "ffi" (DWDP through
    one CUDA VMM expert store per stage, GPUs only; the stores belong to the backend, which this pipeline owns:
    close it with `close()` or a `with` block) or "dep" (DEP: the ranks hold the same blocks as "xla", but each
    MoE sends its tokens to the ranks holding their experts and back). Default: "xla" with N > 1 ranks, else
    "local". With ranks the batch is split over them. (SGLang refuses DWDP together with pipeline parallelism; here the two compose.)

    `scan=True` (one device per stage, its own experts): each stage is built one layer at a time straight into a
    `ScannedModel`'s stacks (`ScannedModel.from_layers`: make_range(stage, l, l + 1) per layer, each layer's arrays
    freed once stacked unless the pipeline was split from a caller's model; `models` then holds None) and runs as one
    scanned program per microbatch, so the host enqueues one call per stage and microbatch instead of one per
    layer.

    With N > 1 ranks a stage is built one layer at a time (`make_range(stage, a, b)` gives layers [a, b) on the
    stage's first device; dwdp.build_placed), each layer placed on the row before the next is made.
    """

    def __init__(self, cfg: FamilyConfig, stages: list[StageSpec], mesh, make_range, *, dtype,
                 experts: str | ExpertBackend | None = None, owned: bool = True, scan: bool = False):
        """make_range(stage index, a, b) -> the model of layers [a, b) on the stage's first device; `owned`: its
        arrays belong to this pipeline (made for it), so they are freed as soon as they are placed."""
        self.cfg, self.stages, self.mesh, self.dtype = cfg, stages, mesh, dtype
        self.ranks = mesh.shape[AXIS]
        me = jax.process_index()
        # With one process per device: the stages this process runs (all of them in a single process).
        self.mine = [any(d.process_index == me for d in mesh.devices[s].flat) for s in range(len(stages))]
        self.handoffs = [None] + [Handoff(mesh.devices[s - 1], mesh.devices[s]) if _crosses(mesh, s) else None
                                  for s in range(1, len(stages))]
        if any(self.handoffs) and self.ranks > 1:
            raise ValueError("a pipeline across processes runs one device per stage (--dwdp / --dep ranks across "
                             "processes with one stage, or stages across processes without ranks)")
        self.backend = expert_backend(experts or ("xla" if self.ranks > 1 else "local"))
        self.experts = self.backend.name
        self.scan = scan
        if scan and self.ranks > 1:
            raise ValueError(f"scan=True runs each stage as one scanned program on one device with its own experts; "
                             f"{self.ranks} ranks per stage with experts {self.experts!r} run layer-wise (their "
                             f"expert sources act between layers)")
        self.backend.check(list(mesh.devices.flat), self.ranks)  # before any weights are made
        self.devices = [mesh.devices[s, 0] for s in range(len(stages))]
        self.row_meshes = [Mesh(mesh.devices[s], (AXIS,)) for s in range(len(stages))]
        self.load_reports: list = []  # one per stage when loaded from a checkpoint
        try:
            if scan:
                self.models = [None] * len(stages)
                scanned = [ScannedModel.from_layers(self.cfg, functools.partial(make_range, st.stage), st.start_layer,
                                                    st.end_layer, consume=owned) if self.mine[st.stage] else None
                           for st in stages]
            else:
                self.models = [self._build(st, make_range, dtype, owned) if self.mine[st.stage] else None
                               for st in stages]
        except BaseException as e:
            self.close(e)
            raise
        if self.ranks > 1:
            self.input_shardings = [NamedSharding(row, P(AXIS)) for row in self.row_meshes]
        else:
            self.input_shardings = [SingleDeviceSharding(d) for d in self.devices]
        if scan:
            self.runners = scanned
            return
        self.runners = [None if m is None else StageRunner(m, self.backend.stage_source(s, m, self.row_meshes[s]),
                                                           mesh=self.row_meshes[s] if self.ranks > 1 else None)
                        for s, m in enumerate(self.models)]

    @property
    def holds_logits(self) -> bool:
        """Whether this process holds (its part of) the prefill's logits: it runs the last stage."""
        return self.mine[-1]

    @property
    def reports(self) -> bool:
        """Whether this process reports the results: the last stage's first device is its own."""
        return self.mesh.devices[-1, 0].process_index == jax.process_index()

    def _build(self, st: StageSpec, make_range, dtype, owned: bool) -> CausalLM:
        """Stage `st`: as made, on its device (one rank); else placed on its row one layer at a time, where the
        expert backend puts each weight."""
        ranges = functools.partial(make_range, st.stage)
        if self.ranks == 1:
            return ranges(st.start_layer, st.end_layer)
        placement = self.backend.placement(self.row_meshes[st.stage], self.cfg,
                                           len(self.cfg.moe_layer_ids(st.start_layer, st.end_layer)), dtype,
                                           owned=owned, stage=st.stage)
        stage = build_placed(self.cfg, st.start_layer, st.end_layer, ranges, placement, dtype=dtype)
        self.backend.built(st.stage)
        return stage

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def random(cls, cfg: FamilyConfig, pipeline: int, *, dwdp: int = 1, dtype=jnp.bfloat16, seed: int = 0,
               boundaries=None, devices=None, fused_swiglu: bool = False, experts: str | None = None,
               scan: bool = False, kernels=None) -> "Pipeline":
        """Random weights drawn per stage on its own device (no stage ever holds another's weights); they depend
        on the global layer only, so every layout of one seed is the same model.
        `fused_swiglu`: expert gate_up weights in the fused SwiGLU kernel's layout (`set_fused_swiglu`);
        `kernels`: the kernel choices (default: the process's)."""
        mesh = make_mesh(pipeline, dwdp, devices)
        stages = plan_stages(cfg, pipeline, boundaries)

        def make_range(stage, a, b):
            return init_model(cfg, dtype=dtype, seed=seed, start_layer=a, end_layer=b,
                              device=builder_device(mesh.devices[stage]), fused_swiglu=fused_swiglu,
                              kernels=kernels)
        return cls(cfg, stages, mesh, make_range, dtype=dtype, experts=experts, scan=scan)

    @classmethod
    def from_model(cls, model: CausalLM, pipeline: int, *, dwdp: int = 1, boundaries=None,
                   devices=None, experts: str | None = None, scan: bool = False) -> "Pipeline":
        """Splits a whole model into stages (for comparing with the one-device model); `model` is left as it was."""
        mesh = make_mesh(pipeline, dwdp, devices)
        stages = plan_stages(model.cfg, pipeline, boundaries)

        def make_range(stage, a, b):
            if mesh.shape[AXIS] == 1:
                return stage_from_model(model, a, b, mesh.devices[stage, 0])
            return model_range(model, a, b)  # placed from where it is, not copied first
        return cls(model.cfg, stages, mesh, make_range, dtype=model.dtype, experts=experts, owned=False, scan=scan)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, pipeline: int, *, dwdp: int = 1, dtype=jnp.bfloat16,
                        boundaries=None, devices=None, cfg: FamilyConfig | None = None,
                        fused_swiglu: bool = False, experts: str | None = None, scan: bool = False,
                        kernels=None) -> "Pipeline":
        """Each stage loads only its own layers (HF or Orbax folder), straight onto its device (one rank) or one
        layer at a time onto its first device, each placed on the row before the next loads (N ranks); with
        `scan=True` one layer at a time into the stage's stacks (`CheckpointLayers`, the file opened once).
        `fused_swiglu`: expert gate_up weights in the fused SwiGLU kernel's layout (`set_fused_swiglu`)."""
        cfg = cfg or load_config(checkpoint_dir)
        backend = expert_backend(experts or ("xla" if dwdp > 1 else "local"))
        mesh = make_mesh(pipeline, dwdp, devices)
        stages = plan_stages(cfg, pipeline, boundaries)
        reports, loaders = [], {}

        def make_range(stage, a, b):
            device = builder_device(mesh.devices[stage])
            if dwdp > 1 or scan:  # (a scanned stage is loaded one layer at a time)
                if stage not in loaders:
                    # Replicated experts ("local") are loaded whole: splitting them first would only gather them back.
                    row = Mesh(mesh.devices[stage], (AXIS,)) if dwdp > 1 and backend.splits_experts else None
                    loaders[stage] = CheckpointLayers(checkpoint_dir, cfg, dtype, device, fused_swiglu=fused_swiglu,
                                                      row=row, kernels=kernels)
                return loaders[stage](a, b)
            sharding = SingleDeviceSharding(device)
            model, report = load_checkpoint(checkpoint_dir, cfg=cfg, dtype=dtype, start_layer=a, end_layer=b,
                                            placement=lambda *_: sharding, fused_swiglu=fused_swiglu)
            reports.append(report)
            return model if kernels is None else with_kernels(model, kernels)
        try:
            pipe = cls(cfg, stages, mesh, make_range, dtype=dtype, experts=backend, scan=scan)
        finally:
            for loader in loaders.values():
                loader.close()
        if dwdp > 1 or scan:
            reports = [loaders[st.stage].report(st.start_layer, st.end_layer) for st in stages if st.stage in loaders]
        pipe.load_reports = reports
        return pipe

    # ---- lifetime -----------------------------------------------------------------------------
    @property
    def stores(self) -> list:
        """The FFI backend's expert stores, one per stage this process builds (empty for the other backends)."""
        return list(getattr(self.backend, "stores", {}).values())

    def close(self, exc: BaseException | None = None) -> None:
        """Releases what the expert backend opened (the FFI stores; the other backends hold nothing outside XLA);
        while `exc` propagates, a failure to close only warns. An FFI pipeline cannot run afterwards."""
        self.backend.close(exc)

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)

    # ---- prefill ------------------------------------------------------------------------------
    def prefill(self, tokens, lengths=None, *, microbatches: int = 1, logits: LogitsMode = "all",
                cache_len: int | None = None, layerwise: bool = False, mode: str | None = None,
                stage_threads: bool = True) -> tuple[jax.Array | None, list[Cache]]:
        """Returns (logits on the last stage's device, one Cache per stage on that stage's device). With one process
        per device, every process calls it with the same arguments; it returns the logits in the process that holds
        them (`holds_logits`, else None) and the caches of the stages it runs (None for the others).

        Any batch: microbatches of ceil(B / microbatches) sequences rounded up to a multiple of the ranks, padded
        with rows of length 0 that the results leave out (`microbatch_rows`).
        mode="layerwise" (or layerwise=True) compiles one program per layer type instead of one per stage (FFI
        experts: always); a scanned pipeline (built with `scan=True`) runs its one program per stage and refuses
        another mode.
        stage_threads (one process, several stages): each stage is enqueued from its own host thread, which takes
        the microbatches in order as the previous stage hands them on. From one thread, an enqueue that waits for a
        full launch queue on one GPU (a long stage is thousands of kernels) holds back the next stage's work on the
        other GPU; per-stage threads let each device's queue fill independently. False: one thread, stage by stage within each microbatch. (JAX's thread-local settings, e.g. a
        `jax.default_device` or `transfer_guard` context around this call, do not reach the stage threads; the
        stages place their inputs explicitly.)"""
        mode = execution_mode(mode, layerwise=layerwise)
        if self.scan and mode == "layerwise":
            raise ValueError("layerwise=True: this pipeline's stages are scanned programs (built with scan=True)")
        if mode == "scanned" and not self.scan:
            raise ValueError("mode 'scanned': build the pipeline with scan=True (its stages restacked)")
        tokens, lengths = check_tokens(tokens, self.cfg.vocab_size, lengths)
        batch = tokens.shape[0]
        size, used = microbatch_rows(batch, microbatches, self.ranks)
        tokens, lengths = pad_batch(tokens, lengths, size * used)
        hidden = (size, tokens.shape[1], self.cfg.hidden_size)
        options = {} if self.scan else {"mode": mode}

        def step(s: int, m: int, x):
            """Stage s on microbatch m, whose input x is its tokens (stage 0) or stage s-1's output: (stage s's
            output, its cache; None where another process runs the stage, x then passed on as it is)."""
            rows = slice(m * size, (m + 1) * size)
            if self.handoffs[s] is not None:  # stage s-1's process -> stage s's process
                x = self.handoffs[s](x, hidden, self.dtype)
            if self.runners[s] is None:
                return x, None
            x = put(x, self.input_shardings[s])  # stage s-1 rank r -> stage s rank r
            lens = put(lengths[rows], self.input_shardings[s])
            return self.runners[s](x, lens, logits=logits, cache_len=cache_len, **options)

        inputs = [tokens[m * size:(m + 1) * size] for m in range(used)]
        threaded = stage_threads and len(self.stages) > 1 and not any(self.handoffs)
        outs, caches = (_stages_in_threads if threaded else _stages_in_turn)(step, inputs, len(self.stages))
        out = None if logits == "none" or not self.holds_logits else jnp.concatenate(outs, axis=0)
        results = out, [Cache.concat_batch(c) if c else None for c in caches]
        return results if size * used == batch else _first_rows(results, batch)


def _stages_in_turn(step, inputs: list, stages: int) -> tuple[list, list[list]]:
    """Every microbatch through every stage, from this thread: (last outputs per microbatch, caches per stage)."""
    outs, caches = [], [[] for _ in range(stages)]
    for m, x in enumerate(inputs):
        for s in range(stages):
            x, cache = step(s, m, x)
            if cache is not None:
                caches[s].append(cache)
        outs.append(x)
    return outs, caches


_STOP = object()  # handed down the stages when one has failed


def _stages_in_threads(step, inputs: list, stages: int) -> tuple[list, list[list]]:
    """The same as `_stages_in_turn`, each stage run by its own thread: stage s takes microbatch m's input from a
    queue that stage s-1 fills, in microbatch order. The first error stops every stage (each finishes the step it
    is in) and is raised here, the others' errors attached as notes. Ctrl-C while waiting stops the stages too and
    waits for them to finish their steps (a second Ctrl-C stops waiting), so nothing a stage still uses (an FFI
    expert store) is released under it."""
    links = [queue.SimpleQueue() for _ in range(stages + 1)]
    for x in inputs:
        links[0].put(x)
    caches: list[list] = [[None] * len(inputs) for _ in range(stages)]
    failed, errors = threading.Event(), []

    def run(s: int):
        for m in range(len(inputs)):
            x = links[s].get()
            if x is _STOP or failed.is_set():
                break
            try:
                x, caches[s][m] = step(s, m, x)
            except BaseException as e:  # noqa: BLE001 (re-raised by the caller's thread)
                errors.append(e)
                failed.set()
                break
            links[s + 1].put(x)
        else:
            return
        links[s + 1].put(_STOP)

    threads = [threading.Thread(target=run, args=(s,), name=f"pipeline-stage{s}", daemon=True)
               for s in range(stages)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            t.join()
    except BaseException:  # Ctrl-C while waiting: the stages stop after their current step, which is waited for
        failed.set()
        for t in threads:
            t.join()
        raise
    if errors:
        for other in errors[1:]:
            errors[0].add_note(f"another pipeline stage failed too: {other!r}")
        raise errors[0]
    outs = [links[stages].get() for _ in inputs]
    return outs, [[c for c in per_stage if c is not None] for per_stage in caches]


def _crosses(mesh, s: int) -> bool:
    """Whether the hand-off from stage s-1 to stage s leaves a process (one process per device)."""
    return any(a.process_index != b.process_index for a, b in zip(mesh.devices[s - 1].flat, mesh.devices[s].flat))


class Handoff:
    """Stage s-1's hidden states [B, T, H] to stage s's device when the two belong to different processes: a
    two-device program (ppermute from the first to the second) that both processes run; the sender passes its
    array, the receiver None (it contributes a zero block of the same shape). Returns the array on the receiving
    device in the receiver, None in the sender."""

    AXIS = "handoff"

    def __init__(self, sending_row, receiving_row):
        self.send, self.receive = np.asarray(sending_row).flat[0], np.asarray(receiving_row).flat[0]
        self.mesh = Mesh(np.array([self.send, self.receive]), (self.AXIS,))
        self.sharding = NamedSharding(self.mesh, P(self.AXIS))
        self.program = jax.jit(jax.shard_map(lambda a: jax.lax.ppermute(a, self.AXIS, [(0, 1)]), mesh=self.mesh,
                                             in_specs=P(self.AXIS), out_specs=P(self.AXIS), check_vma=False))

    def __call__(self, x, shape, dtype):
        me = jax.process_index()
        if me not in (self.send.process_index, self.receive.process_index):
            return None  # a hand-off between two other processes
        blocks = []
        if self.send.process_index == me:
            blocks.append(jax.device_put(x, self.send)[None])
        if self.receive.process_index == me:
            blocks.append(jax.device_put(jnp.zeros((1, *shape), dtype), self.receive))
        both = jax.make_array_from_single_device_arrays((2, *shape), self.sharding, blocks)
        moved = self.program(both)
        if self.receive.process_index != me:
            return None
        return next(s.data[0] for s in moved.addressable_shards if s.device == self.receive)


def _first_rows(results, batch: int):
    """(logits, per-stage caches) of a padded batch -> those of its first `batch` rows."""
    out, caches = results
    return (None if out is None else out[:batch]), [None if c is None else take_rows((None, c), batch)[1]
                                                    for c in caches]


def stage_weight_bytes(cfg: FamilyConfig, stage: StageSpec, dtype=jnp.bfloat16) -> int:
    """Bytes of a stage's weights, from shapes alone (nothing is allocated)."""
    abstract = nnx.state(abstract_model(cfg, dtype=dtype, start_layer=stage.start_layer, end_layer=stage.end_layer))
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract)))


def cache_bytes_per_token(cfg: FamilyConfig, stage: StageSpec, dtype=jnp.bfloat16) -> int:
    """K and V bytes one token adds to the stage's full-attention caches."""
    return 2 * len(stage.full_attention_layers) * cfg.num_key_value_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def cache_bytes_per_sequence(cfg: FamilyConfig, stage: StageSpec, dtype=jnp.bfloat16) -> int:
    """Fixed-size state one sequence keeps in the stage's recurrent layers (Gated DeltaNet or Mamba-2: conv state +
    fp32 state)."""
    per_layer = int(np.prod(cfg.conv_state_shape)) * jnp.dtype(dtype).itemsize
    per_layer += int(np.prod(cfg.recurrent_state_shape)) * 4
    return len(stage.linear_attention_layers) * per_layer

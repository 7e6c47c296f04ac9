"""Pipeline parallelism: contiguous layer ranges on the rows of the mesh, microbatches pushed through them.

Each stage is a model built for its range [start_layer, end_layer) on its own device(s): it holds only those
layers' weights (loaders skip other layers' tensors without reading them) and allocates caches only for them, one
slot per linear- or full-attention layer of the range. Stages may cut through the 3 linear + 1 full pattern.

The prefill is GPipe-style and MPMD: each stage is its own compiled program. The driver enqueues stage s for
microbatch m right after stage s-1, and JAX's asynchronous dispatch lets stage s work on microbatch m while stage
s-1 works on m+1; activations move between the stages' devices with device_put (a device-to-device copy).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from jax_dwdp.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from jax_dwdp.model import Cache, Qwen35MoeForCausalLM, abstract_model, init_model
from jax_dwdp.model.moe import fused_swiglu_enabled, set_fused_swiglu
from jax_dwdp.model.qwen35_moe import LogitsMode
from jax_dwdp.parallel.dwdp import check_experts_choice, expert_blocks, place_model
from jax_dwdp.parallel.experts import AXIS, Gather, Local, Store
from jax_dwdp.parallel.mesh import cpu_barrier, make_mesh
from jax_dwdp.parallel.runner import StageRunner
from jax_dwdp.prefill import InputError, check_tokens


@dataclasses.dataclass(frozen=True)
class StageSpec:
    stage: int
    start_layer: int
    end_layer: int
    linear_attention_layers: tuple[int, ...]
    full_attention_layers: tuple[int, ...]


def plan_stages(cfg: ModelConfig, pipeline: int, boundaries: list[int] | None = None) -> list[StageSpec]:
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
        StageSpec(s, a, b, cfg.layer_ids(LINEAR_ATTENTION, a, b), cfg.layer_ids(FULL_ATTENTION, a, b))
        for s, (a, b) in enumerate(zip(starts, ends))
    ]


def stage_from_model(model: Qwen35MoeForCausalLM, start_layer: int, end_layer: int, device) -> Qwen35MoeForCausalLM:
    """The stage [start_layer, end_layer) of a whole model, its weights copied to `device` (tests, benchmarks)."""
    graphdef, abstract = nnx.split(abstract_model(model.cfg, dtype=model.dtype, start_layer=start_layer,
                                                  end_layer=end_layer))
    full = dict(nnx.to_flat_state(nnx.state(model)))
    leaves = []
    for path, var in nnx.to_flat_state(abstract):
        src = ("layers", path[1] + start_layer, *path[2:]) if path[0] == "layers" else path
        leaves.append((path, type(var)(jax.device_put(full[src].get_value(), device))))
    stage = nnx.merge(graphdef, nnx.from_flat_state(leaves))
    return set_fused_swiglu(stage, fused_swiglu_enabled(model), permute=False)  # the weights came in their layout


def check_layout(batch: int, microbatches: int, ranks: int) -> None:
    """A batch must split into equal microbatches, and a microbatch evenly over the DWDP ranks."""
    if microbatches < 1 or batch % microbatches:
        raise InputError(f"batch {batch} cannot be split into {microbatches} equal microbatches")
    if (batch // microbatches) % ranks:
        raise InputError(f"a microbatch of {batch // microbatches} sequences cannot be split evenly over "
                         f"{ranks} DWDP ranks")


class Pipeline:
    """Stages of one model on the rows of a (pipeline, dwdp) mesh, each run by a StageRunner.

    `experts` is chosen once: "local" (each device holds all of its stage's experts; with a 'dwdp' axis of N > 1,
    the replicated baseline), "xla" (DWDP: each of the row's N ranks stores 1/N of its stage's experts, the
    layers all-gather them one layer ahead) or "ffi" (DWDP through one CUDA VMM expert store per stage, GPUs
    only; the stage's experts move into the store, which this pipeline owns: close it with `close()` or a `with`
    block). Default: "xla" with N > 1 ranks, else "local". With ranks the batch is split over them. (SGLang
    refuses DWDP together with pipeline parallelism; here the two compose.)
    """

    def __init__(self, cfg: ModelConfig, stages: list[StageSpec], models: list[Qwen35MoeForCausalLM], mesh, *,
                 experts: str | None = None):
        self.cfg, self.stages, self.mesh = cfg, stages, mesh
        self.ranks = mesh.shape[AXIS]
        self.experts = experts = experts or ("xla" if self.ranks > 1 else "local")
        check_experts_choice(experts, self.ranks)
        if experts == "ffi":
            from jax_dwdp.parallel.dwdp_ffi import require_gpus

            require_gpus(mesh.devices.flat)  # before any weights move
        self.devices = [mesh.devices[s, 0] for s in range(len(stages))]
        self.row_meshes = [Mesh(mesh.devices[s], (AXIS,)) for s in range(len(stages))]
        if self.ranks > 1:
            # Expert weights split over the row (or, "local", replicated), the rest replicated; the unsplit stage
            # models are dropped.
            models = [place_model(m, row, split_experts=experts != "local") for m, row in zip(models, self.row_meshes)]
            self.input_shardings = [NamedSharding(row, P(AXIS)) for row in self.row_meshes]
        else:
            self.input_shardings = [SingleDeviceSharding(d) for d in self.devices]
        self.models = models
        self.stores: list = []
        if experts == "ffi":
            from jax_dwdp.parallel.dwdp_ffi import ExpertStore

            try:
                for m in models:  # each stage's experts move into its store: the XLA copies are deleted
                    self.stores.append(ExpertStore.from_sharded(expert_blocks(m), cfg.num_experts))
            except BaseException as e:
                self.close(e)
                raise
            sources = [Store(store, row) for store, row in zip(self.stores, self.row_meshes)]
        elif experts == "xla":
            sources = [Gather(expert_blocks(m), row) for m, row in zip(models, self.row_meshes)]
        else:
            sources = [Local() for _ in models]
        mesh_of = self.row_meshes if self.ranks > 1 else [None] * len(models)
        self.runners = [StageRunner(m, source, mesh=row) for m, source, row in zip(models, sources, mesh_of)]
        self.load_reports: list = []  # one line per stage when loaded from a checkpoint

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def random(cls, cfg: ModelConfig, pipeline: int, *, dwdp: int = 1, dtype=jnp.bfloat16, seed: int = 0,
               boundaries=None, devices=None, fused_swiglu: bool = False, experts: str | None = None) -> "Pipeline":
        """Random weights drawn per stage on its own device (no stage ever holds another's weights); they depend
        on the global layer only, so every layout of one seed is the same model.
        `fused_swiglu`: expert gate_up weights in the fused SwiGLU kernel's layout (`set_fused_swiglu`)."""
        mesh = make_mesh(pipeline, dwdp, devices)
        stages = plan_stages(cfg, pipeline, boundaries)
        models = [init_model(cfg, dtype=dtype, seed=seed, start_layer=st.start_layer, end_layer=st.end_layer,
                             device=mesh.devices[st.stage, 0], fused_swiglu=fused_swiglu)
                  for st in stages]
        return cls(cfg, stages, models, mesh, experts=experts)

    @classmethod
    def from_model(cls, model: Qwen35MoeForCausalLM, pipeline: int, *, dwdp: int = 1, boundaries=None,
                   devices=None, experts: str | None = None) -> "Pipeline":
        """Splits a whole model into stages (for comparing with the one-device model)."""
        mesh = make_mesh(pipeline, dwdp, devices)
        stages = plan_stages(model.cfg, pipeline, boundaries)
        models = [stage_from_model(model, st.start_layer, st.end_layer, mesh.devices[st.stage, 0]) for st in stages]
        return cls(model.cfg, stages, models, mesh, experts=experts)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, pipeline: int, *, dwdp: int = 1, dtype=jnp.bfloat16,
                        boundaries=None, devices=None, cfg: ModelConfig | None = None,
                        fused_swiglu: bool = False, experts: str | None = None) -> "Pipeline":
        """Each stage loads only its own layers (HF or Orbax folder), straight onto its device.
        `fused_swiglu`: expert gate_up weights in the fused SwiGLU kernel's layout (`set_fused_swiglu`)."""
        from jax_dwdp.weights import load_checkpoint
        from jax_dwdp.weights.hf_loader import load_config

        cfg = cfg or load_config(checkpoint_dir)
        mesh = make_mesh(pipeline, dwdp, devices)
        stages = plan_stages(cfg, pipeline, boundaries)
        models, reports = [], []
        for st in stages:
            sharding = jax.sharding.SingleDeviceSharding(mesh.devices[st.stage, 0])
            model, report = load_checkpoint(checkpoint_dir, cfg=cfg, dtype=dtype, start_layer=st.start_layer,
                                            end_layer=st.end_layer, placement=lambda *_, sh=sharding: sh,
                                            fused_swiglu=fused_swiglu)
            models.append(model)
            reports.append(report)
        pipe = cls(cfg, stages, models, mesh, experts=experts)
        pipe.load_reports = reports
        return pipe

    # ---- lifetime -----------------------------------------------------------------------------
    def close(self, exc: BaseException | None = None) -> None:
        """Releases the FFI expert stores, if any (the other backends hold nothing outside XLA); while `exc`
        propagates, a failure to close only warns (close_store). An FFI pipeline cannot run afterwards."""
        if self.stores:
            from jax_dwdp.parallel.dwdp_ffi import close_store

            for store in self.stores:
                close_store(store, exc)

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)

    # ---- prefill ------------------------------------------------------------------------------
    def prefill(self, tokens, lengths=None, *, microbatches: int = 1, logits: LogitsMode = "all",
                cache_len: int | None = None, layerwise: bool = False) -> tuple[jax.Array | None, list[Cache]]:
        """Returns (logits on the last stage's device, one Cache per stage on that stage's device).

        layerwise=True compiles one program per layer type instead of one per stage (FFI experts: always)."""
        tokens, lengths = check_tokens(tokens, self.cfg.vocab_size, lengths)
        batch = tokens.shape[0]
        check_layout(batch, microbatches, self.ranks)
        size = batch // microbatches
        wait = cpu_barrier(self.devices[0].platform)
        outs, caches = [], [[] for _ in self.stages]
        for m in range(microbatches):
            rows = slice(m * size, (m + 1) * size)
            x = tokens[rows]
            for s, runner in enumerate(self.runners):
                x = jax.device_put(x, self.input_shardings[s])  # stage s-1 rank r -> stage s rank r
                lens = jax.device_put(lengths[rows], self.input_shardings[s])
                x, cache = wait(runner(x, lens, logits=logits, cache_len=cache_len, layerwise=layerwise))
                caches[s].append(cache)
            outs.append(x)
        out = None if logits == "none" else jnp.concatenate(outs, axis=0)
        return out, [Cache.concat_batch(c) for c in caches]


def stage_weight_bytes(cfg: ModelConfig, stage: StageSpec, dtype=jnp.bfloat16) -> int:
    """Bytes of a stage's weights, from shapes alone (nothing is allocated)."""
    abstract = nnx.state(abstract_model(cfg, dtype=dtype, start_layer=stage.start_layer, end_layer=stage.end_layer))
    return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract)))


def cache_bytes_per_token(cfg: ModelConfig, stage: StageSpec, dtype=jnp.bfloat16) -> int:
    """K and V bytes one token adds to the stage's full-attention caches."""
    return 2 * len(stage.full_attention_layers) * cfg.num_key_value_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def cache_bytes_per_sequence(cfg: ModelConfig, stage: StageSpec, dtype=jnp.bfloat16) -> int:
    """Fixed-size state one sequence keeps in the stage's linear-attention layers (conv state + fp32 state)."""
    per_layer = cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * jnp.dtype(dtype).itemsize
    per_layer += cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return len(stage.linear_attention_layers) * per_layer

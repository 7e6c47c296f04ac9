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
from jax_dwdp.parallel.mesh import cpu_barrier, make_mesh
from jax_dwdp.prefill import InputError, StageProgram, check_tokens


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


class Pipeline:
    """Stages of one model on the rows of a (pipeline, dwdp) mesh.

    With a 'dwdp' axis of N > 1, each stage runs as DWDP over the N devices of its row (jax_dwdp.parallel.dwdp):
    the batch is split over the ranks, each rank stores 1/N of its stage's experts. With N = 1 a stage is one
    device. (SGLang refuses DWDP together with pipeline parallelism; here the two compose.)
    """

    def __init__(self, cfg: ModelConfig, stages: list[StageSpec], models: list[Qwen35MoeForCausalLM], mesh):
        from jax_dwdp.parallel.dwdp import AXIS, shard_model

        self.cfg, self.stages, self.mesh = cfg, stages, mesh
        self.ranks = mesh.shape[AXIS]
        self.devices = [mesh.devices[s, 0] for s in range(len(stages))]
        self.row_meshes = [Mesh(mesh.devices[s], (AXIS,)) for s in range(len(stages))]
        if self.ranks > 1:
            # Expert weights split over the row, the rest replicated; the unsharded stage models are dropped.
            self.sharded = [shard_model(m, row) for m, row in zip(models, self.row_meshes)]
            self.models = [nnx.merge(g, s) for g, s, _ in self.sharded]
            self.input_shardings = [NamedSharding(row, P(AXIS)) for row in self.row_meshes]
        else:
            self.sharded, self.models = None, models
            self.input_shardings = [SingleDeviceSharding(d) for d in self.devices]
        self._programs: dict = {}
        self._stores = None  # the FFI expert stores, one per stage, once dwdp_backend='ffi' is used
        self.load_reports: list = []  # one line per stage when loaded from a checkpoint

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def random(cls, cfg: ModelConfig, pipeline: int, *, dwdp: int = 1, dtype=jnp.bfloat16, seed: int = 0,
               boundaries=None, devices=None, fused_swiglu: bool = False) -> "Pipeline":
        """Random weights drawn per stage on its own device (no stage ever holds another's weights).
        `fused_swiglu`: expert gate_up weights in the fused SwiGLU kernel's layout (`set_fused_swiglu`)."""
        mesh = make_mesh(pipeline, dwdp, devices)
        stages = plan_stages(cfg, pipeline, boundaries)
        models = [init_model(cfg, dtype=dtype, seed=seed + st.stage, start_layer=st.start_layer,
                             end_layer=st.end_layer, device=mesh.devices[st.stage, 0], fused_swiglu=fused_swiglu)
                  for st in stages]
        return cls(cfg, stages, models, mesh)

    @classmethod
    def from_model(cls, model: Qwen35MoeForCausalLM, pipeline: int, *, dwdp: int = 1, boundaries=None,
                   devices=None) -> "Pipeline":
        """Splits a whole model into stages (for comparing with the one-device model)."""
        mesh = make_mesh(pipeline, dwdp, devices)
        stages = plan_stages(model.cfg, pipeline, boundaries)
        models = [stage_from_model(model, st.start_layer, st.end_layer, mesh.devices[st.stage, 0]) for st in stages]
        return cls(model.cfg, stages, models, mesh)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, pipeline: int, *, dwdp: int = 1, dtype=jnp.bfloat16,
                        boundaries=None, devices=None, cfg: ModelConfig | None = None,
                        fused_swiglu: bool = False) -> "Pipeline":
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
        pipe = cls(cfg, stages, models, mesh)
        pipe.load_reports = reports
        return pipe

    # ---- prefill ------------------------------------------------------------------------------
    def programs(self, logits: LogitsMode, cache_len: int | None, layerwise: bool, dwdp_backend: str = "xla") -> list:
        if dwdp_backend not in ("xla", "ffi"):
            raise ValueError(f"DWDP backend {dwdp_backend!r}: choose 'xla' or 'ffi'")
        if dwdp_backend == "ffi" and self.ranks == 1:
            raise ValueError("the FFI DWDP backend needs DWDP ranks > 1")
        key = (logits, cache_len, layerwise, dwdp_backend)
        if key not in self._programs:
            if self.ranks > 1:
                from jax_dwdp.parallel.dwdp import DwdpProgram, LayerwiseDwdp

                if dwdp_backend == "ffi":
                    # The stage's expert blocks move into one CUDA VMM store per stage (made on first use and
                    # shared by every program); the XLA copies are deleted, so the XLA backend is gone after this.
                    if self._stores is None:
                        from jax_dwdp.parallel.dwdp import expert_blocks
                        from jax_dwdp.parallel.dwdp_ffi import ExpertStore

                        stores = []
                        try:
                            for _, state, _ in self.sharded:
                                stores.append(ExpertStore.from_sharded(expert_blocks(state), self.cfg.num_experts))
                        except BaseException:
                            for store in stores:
                                store.close()
                            self._programs.clear()
                            raise
                        self._stores = stores
                        # Programs made earlier hold the deleted expert arrays.
                        self._programs = {k: v for k, v in self._programs.items() if k[3] == "ffi"}
                    self._programs[key] = [
                        LayerwiseDwdp(m, row, backend="ffi", logits=logits, cache_len=cache_len, sharded=sh,
                                      store=store)
                        for m, row, sh, store in zip(self.models, self.row_meshes, self.sharded, self._stores)]
                elif self._stores is not None:
                    raise ValueError("this pipeline's experts live in the FFI store now; keep dwdp_backend='ffi'")
                elif layerwise:
                    self._programs[key] = [
                        LayerwiseDwdp(m, row, backend="xla", logits=logits, cache_len=cache_len, sharded=sh)
                        for m, row, sh in zip(self.models, self.row_meshes, self.sharded)]
                else:
                    self._programs[key] = [
                        DwdpProgram(m, row, logits=logits, cache_len=cache_len, sharded=sh)
                        for m, row, sh in zip(self.models, self.row_meshes, self.sharded)]
            else:
                self._programs[key] = [StageProgram(m, logits=logits, cache_len=cache_len, layerwise=layerwise)
                                       for m in self.models]
        return self._programs[key]

    def close(self, exc: BaseException | None = None) -> None:
        """Releases the FFI expert stores, if any (the XLA paths hold nothing outside XLA); while `exc` propagates,
        a failure to close only warns (close_store). The pipeline cannot run the FFI backend afterwards (its
        experts lived in the stores)."""
        if self._stores:
            from jax_dwdp.parallel.dwdp_ffi import close_store

            for store in self._stores:
                close_store(store, exc)
        self._programs = {k: v for k, v in self._programs.items() if k[3] != "ffi"}

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)

    def prefill(self, tokens, lengths=None, *, microbatches: int = 1, logits: LogitsMode = "all",
                cache_len: int | None = None, layerwise: bool = False,
                dwdp_backend: str = "xla") -> tuple[jax.Array | None, list[Cache]]:
        """Returns (logits on the last stage's device, one Cache per stage on that stage's device).

        With DWDP ranks, dwdp_backend "xla" all-gathers experts, "ffi" reads them through the CUDA VMM store (GPUs
        only; always layer-wise)."""
        tokens, lengths = check_tokens(tokens, self.cfg.vocab_size, lengths)
        batch = tokens.shape[0]
        if microbatches < 1 or batch % microbatches:
            raise InputError(f"batch {batch} cannot be split into {microbatches} equal microbatches")
        if (batch // microbatches) % self.ranks:
            raise InputError(f"a microbatch of {batch // microbatches} sequences cannot be split evenly over "
                             f"{self.ranks} DWDP ranks")
        size = batch // microbatches
        programs = self.programs(logits, cache_len, layerwise, dwdp_backend)
        wait = cpu_barrier(self.devices[0].platform)
        outs, caches = [], [[] for _ in self.stages]
        for m in range(microbatches):
            rows = slice(m * size, (m + 1) * size)
            x = tokens[rows]
            for s, program in enumerate(programs):
                x = jax.device_put(x, self.input_shardings[s])  # stage s-1 rank r -> stage s rank r
                x, cache = wait(program(x, jax.device_put(lengths[rows], self.input_shardings[s])))
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

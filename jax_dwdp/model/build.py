"""Building models: random weights created on the device inside jit, or an abstract model to load into; what the
engine asks of either family's layers (which hold routed experts, and where)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dwdp.families import FamilyConfig
from jax_dwdp.kernels.choices import KernelChoices, resolve
from jax_dwdp.model.moe import set_fused_swiglu
from jax_dwdp.model.nemotron_h import NemotronHBlock, NemotronHForCausalLM
from jax_dwdp.model.qwen35_moe import DecoderLayer, Qwen35MoeForCausalLM
from jax_dwdp.nemotron_h_config import NemotronHConfig

CausalLM = Qwen35MoeForCausalLM | NemotronHForCausalLM  # a model (or pipeline stage) of either family

# Each family's layer class: where its routed experts sit in a layer and the names of their two weights (first the
# one that reads the tokens: Qwen3.5's gate_up_proj, Nemotron-H's up_proj; then down_proj).
EXPERT_WEIGHTS = {cls.EXPERTS: cls.EXPERT_WEIGHTS for cls in (DecoderLayer, NemotronHBlock)}


def expert_weight_index(path: tuple) -> int | None:
    """Which routed-expert weight a flat nnx state path of a model (or stage) names: 0 (gate_up_proj / up_proj),
    1 (down_proj), or None for every other weight."""
    if len(path) != 5 or path[0] != "layers":
        return None
    names = EXPERT_WEIGHTS.get(tuple(path[2:4]), ())
    return names.index(path[4]) if path[4] in names else None


def is_expert_weight(path: tuple) -> bool:
    """A flat nnx state path of a model (or stage) that names a routed expert weight, in either family."""
    return expert_weight_index(path) is not None


def expert_slots(model) -> tuple[int | None, ...]:
    """Per layer of a model (or stage), its index among the layers with routed experts, None for a layer without
    (Qwen3.5: 0, 1, 2, ...; Nemotron-H "MEM*E": None, 0, None, None, 1). Expert stores hold the expert layers only,
    in this order."""
    slots, k = [], 0
    for layer in model.layers:
        slots.append(k if layer.has_experts else None)
        k += layer.has_experts
    return tuple(slots)


def model_class(cfg: FamilyConfig) -> type[Qwen35MoeForCausalLM] | type[NemotronHForCausalLM]:
    """The model family of a config: its config class decides (chosen from config.json's model_type)."""
    return NemotronHForCausalLM if isinstance(cfg, NemotronHConfig) else Qwen35MoeForCausalLM


def abstract_model(
    cfg: FamilyConfig, *, dtype=jnp.bfloat16, start_layer: int = 0, end_layer: int | None = None,
    kernels: KernelChoices | None = None,
) -> CausalLM:
    """The model's structure with ShapeDtypeStruct leaves: allocates nothing (for loaders). `kernels`: its kernel
    choices (default: the process's, `KernelChoices.from_environment()`)."""
    kernels = resolve(kernels)  # (resolved outside eval_shape's trace)
    return nnx.eval_shape(
        lambda: model_class(cfg)(
            cfg, dtype=dtype, start_layer=start_layer, end_layer=end_layer, rngs=nnx.Rngs(0), kernels=kernels
        )
    )


def init_model(
    cfg: FamilyConfig,
    *,
    dtype=jnp.bfloat16,
    seed: int = 0,
    start_layer: int = 0,
    end_layer: int | None = None,
    device: jax.Device | None = None,
    fused_swiglu: bool = False,
    kernels: KernelChoices | None = None,
) -> CausalLM:
    """A model with random weights, generated directly on `device` (default: the first device).

    Each parameter is drawn on the device by its own small (cached) computation, so a 35B-parameter model never
    passes through host memory. (One jit over the whole constructor took minutes to compile for 40 layers.)
    `fused_swiglu` puts the expert gate_up weights in the fused-SwiGLU layout (`set_fused_swiglu`, opt-in). The
    weights are drawn in the checkpoint layout and then permuted, so a seed gives the same model either way.
    `kernels`: the model's kernel choices (default: the process's, `KernelChoices.from_environment()`).
    """
    if fused_swiglu and isinstance(cfg, NemotronHConfig):
        raise ValueError("fused_swiglu: Nemotron-H's experts have no gate (relu^2), there is no SwiGLU to fuse")
    device = device or jax.devices()[0]
    with jax.default_device(device):
        model = model_class(cfg)(
            cfg, dtype=dtype, start_layer=start_layer, end_layer=end_layer, rngs=nnx.Rngs(seed), kernels=kernels
        )
        return set_fused_swiglu(model, True, donate=True) if fused_swiglu else model


def with_kernels(model, kernels: KernelChoices):
    """A model (or any module of one: a layer, a mixer) that shares `model`'s weights and takes the kernel forms
    of `kernels`: every module's static `kernels` attribute is replaced in a copy of the graph, so `model`, and the
    programs compiled from it, stay as they were (benchmarks compare forms on one set of weights this way)."""
    graphdef, state = nnx.split(model)
    new = nnx.merge(graphdef, state)  # new module objects sharing the weights
    for _, module in nnx.iter_modules(new):
        if "kernels" in vars(module):
            module.kernels = kernels
    return new

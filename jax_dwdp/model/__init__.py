"""The model families in Flax NNX: Qwen3.5-MoE and Nemotron-H."""

from jax_dwdp.model.build import abstract_model, init_model, model_class, with_kernels
from jax_dwdp.model.moe import fused_swiglu_enabled, set_fused_swiglu
from jax_dwdp.model.nemotron_h import NemotronHForCausalLM
from jax_dwdp.model.qwen35_moe import Cache, DecoderLayer, Qwen35MoeForCausalLM

__all__ = [
    "Cache",
    "DecoderLayer",
    "Qwen35MoeForCausalLM",
    "NemotronHForCausalLM",
    "model_class",
    "abstract_model",
    "init_model",
    "with_kernels",
    "fused_swiglu_enabled",
    "set_fused_swiglu",
]

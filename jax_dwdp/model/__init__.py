"""The Qwen3.5-MoE text model in Flax NNX."""

from jax_dwdp.model.build import abstract_model, init_model, with_kernels
from jax_dwdp.model.moe import fused_swiglu_enabled, set_fused_swiglu
from jax_dwdp.model.qwen35_moe import Cache, DecoderLayer, Qwen35MoeForCausalLM

__all__ = [
    "Cache",
    "DecoderLayer",
    "Qwen35MoeForCausalLM",
    "abstract_model",
    "init_model",
    "with_kernels",
    "fused_swiglu_enabled",
    "set_fused_swiglu",
]

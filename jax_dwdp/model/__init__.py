"""The model families in Flax NNX: Qwen3.5-MoE and Nemotron-H."""

from jax_dwdp.model.build import (CausalLM, abstract_model, expert_slots, expert_weight_index, init_model,
                                  is_expert_weight, model_class, with_kernels)
from jax_dwdp.model.cache import Cache, LogitsMode
from jax_dwdp.model.moe import fused_swiglu_enabled, set_fused_swiglu
from jax_dwdp.model.nemotron_h import NemotronHBlock, NemotronHForCausalLM
from jax_dwdp.model.qwen35_moe import DecoderLayer, Qwen35MoeForCausalLM

__all__ = [
    "CausalLM",
    "Cache",
    "LogitsMode",
    "DecoderLayer",
    "NemotronHBlock",
    "Qwen35MoeForCausalLM",
    "NemotronHForCausalLM",
    "model_class",
    "abstract_model",
    "init_model",
    "with_kernels",
    "expert_slots",
    "expert_weight_index",
    "is_expert_weight",
    "fused_swiglu_enabled",
    "set_fused_swiglu",
]

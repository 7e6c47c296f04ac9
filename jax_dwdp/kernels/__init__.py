"""Kernels behind small functions: attention, grouped matmul, gated delta rule.

Each function picks its implementation where the program is lowered, so model code stays the same on the CPU
(portable XLA paths, the numerical reference) and on the GPU (cuDNN flash attention, the CUTLASS grouped matmul,
Pallas kernels); which GPU form runs is the model's `KernelChoices` (`choices.py`), passed to each function.
"""

from jax_dwdp.kernels.attention import cached_attention, causal_attention, decode_attention
from jax_dwdp.kernels.choices import KernelChoices
from jax_dwdp.kernels.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_step
from jax_dwdp.kernels.grouped_matmul import ROW_MULTIPLE as GROUPED_MATMUL_ROW_MULTIPLE
from jax_dwdp.kernels.grouped_matmul import (
    deinterleave_gate_up,
    grouped_matmul,
    grouped_matmul_gather,
    grouped_matmul_gather_swiglu,
    grouped_matmul_swiglu,
    interleave_gate_up,
)
from jax_dwdp.kernels.permute import combine_rows, dispatch_rows, gather_rows

__all__ = [
    "KernelChoices",
    "causal_attention",
    "cached_attention",
    "decode_attention",
    "chunk_gated_delta_rule",
    "recurrent_gated_delta_step",
    "grouped_matmul",
    "grouped_matmul_swiglu",
    "grouped_matmul_gather",
    "grouped_matmul_gather_swiglu",
    "gather_rows",
    "dispatch_rows",
    "combine_rows",
    "interleave_gate_up",
    "deinterleave_gate_up",
    "GROUPED_MATMUL_ROW_MULTIPLE",
]

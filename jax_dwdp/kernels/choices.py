"""Which form of each kernel runs: one frozen record, `KernelChoices`, built once per process (the platform's
defaults, then the environment) and handed to the model when it is built. The model's modules keep it as a static
attribute (part of their graphdef, so every compiled program is keyed by it) and pass it to the kernel functions.
No other module reads a JAX_DWDP_* kernel variable.

A field chooses the form of a computation lowered for a CUDA GPU: every GPU form sits behind `lax.platform_dependent`
(or is traced only where a GPU backend exists), so a program lowered for the CPU takes the XLA forms whatever the
record says. fp32 inputs (the reference runs) take the XLA forms too, but for the routing and the dispatch, whose
kernels compute the same results in any dtype. The kernel functions keep an explicit `implementation=` that
overrides the record (tests and benchmarks force a form with it).

Every field with its variable, values, defaults and the measurement behind the default: docs/kernels.md, "Kernel
choices".
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from jax_dwdp.kernels._backend import default_platform

PREFIX = "JAX_DWDP_"
GROUPED_MATMUL_FORMS = ("cutlass", "mosaic", "xla")
KERNEL_FORMS = ("pallas", "xla")
SILU_FORMS = ("ex2", "tanh")
# (allowed values; None: free text, a CUTLASS tile checked against the library's list when first used, since the
# library loads only on a GPU). Booleans are 1 / 0 in the environment.
_VALUES: dict[str, tuple | None] = {
    "grouped_matmul": GROUPED_MATMUL_FORMS,
    "gmm_config": None,
    "gmm_cmd_buffer": (True, False),
    "gather_config": None,
    "gather_swiglu_config": None,
    "moe_gather": (True, False, None),
    "moe_merged_projection": (True, False, None),
    "routing": KERNEL_FORMS,
    "dispatch": KERNEL_FORMS,
    "conv": (*KERNEL_FORMS, None),
    "conv_silu": SILU_FORMS,
    "norm_rope": KERNEL_FORMS,
    "gdn": KERNEL_FORMS,
    "ssd": KERNEL_FORMS,
}
# Variables of forms that are gone: set, they are refused rather than silently ignored.
REMOVED = {
    "JAX_DWDP_GDN_CONV": "the conv inside the gated delta rule's prep kernel",
    "JAX_DWDP_COMBINE": "the Pallas combine kernel",
    "JAX_DWDP_MERGE_QKV": "the merged q, k, v projection",
}


def env_var(field: str) -> str:
    """The environment variable of a field: JAX_DWDP_ + its name in capitals."""
    return PREFIX + field.upper()


@dataclasses.dataclass(frozen=True)
class KernelChoices:
    """One choice per kernel (values and defaults: `_VALUES`, `defaults`; the table: docs/kernels.md, "Kernel
    choices"). Build it with `from_environment()` (what a model gets by default), `defaults(platform)`, or
    `replace(...)` of either."""

    grouped_matmul: str  # the MoE grouped matmuls of half-type inputs (the CUTLASS kernel takes bf16 only: fp16
    # gets Mosaic when "cutlass" is chosen)
    gmm_config: str | None  # the CUTLASS grouped GEMM's tile (name, or index into `_cutlass.config_names()`)
    gmm_cmd_buffer: bool  # register that GEMM with XLA's command-buffer (CUDA graph) trait
    gather_config: str | None  # the gather grouped GEMM's tile (`_cutlass.gather_config_names()`)
    gather_swiglu_config: str | None  # the gather + SwiGLU GEMM's tile (`_cutlass.gather_swiglu_config_names()`)
    moe_gather: bool | None  # the gate_up GEMM gathers the tokens itself (no dispatch); None: `moe.gather_in_gemm`
    moe_merged_projection: bool | None  # router + shared expert projections as one matmul; None: by token count
    routing: str  # top-k of the router's softmax and the counting sort by expert (`kernels.routing`)
    dispatch: str  # the tokens into expert order (`kernels.permute.dispatch_rows`)
    conv: str | None  # Gated DeltaNet's causal conv + SiLU (`kernels.conv`); None: by token count
    conv_silu: str  # the SiLU inside the Pallas conv kernel
    norm_rope: str  # attention's q/k norm + partial RoPE (`kernels.norm_rope`)
    gdn: str  # the chunked gated delta rule of bf16/fp16 inputs (`kernels.gated_delta_rule`)
    ssd: str  # Mamba-2's chunked SSD scan of bf16/fp16 inputs (`kernels.ssd`)

    def __post_init__(self):
        for field, allowed in _VALUES.items():
            value = getattr(self, field)
            if allowed is None:
                if value is not None and (not isinstance(value, str) or not value):
                    raise ValueError(f"KernelChoices.{field}={value!r}: a tile name or index (a non-empty string), or "
                                     "None for the default")
            elif isinstance(allowed[0], bool):
                if not isinstance(value, bool) and not (value is None and None in allowed):
                    raise ValueError(f"KernelChoices.{field}={value!r} is none of {allowed}")
            elif value not in allowed:
                raise ValueError(f"KernelChoices.{field}={value!r} is none of {allowed}")

    def replace(self, **changes: Any) -> KernelChoices:
        """A copy with some fields changed (each checked)."""
        unknown = set(changes) - set(_VALUES)
        if unknown:
            raise TypeError(f"KernelChoices has no field {', '.join(sorted(unknown))}; fields: {', '.join(_VALUES)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def defaults(cls, platform: str | None = None) -> KernelChoices:
        """The defaults where the default backend is `platform` ('gpu', 'cpu', ...; default: this process's).
        Two differ by platform: the grouped matmul (the CUTLASS call needs its library and a GPU backend to be
        traced) and the gated delta rule (its Pallas kernels are left untraced where no GPU runs them, so a CPU
        machine's programs hold the XLA form only). The others name their GPU kernel everywhere: it is chosen when
        a program is lowered for CUDA, and a CPU lowering takes XLA's form."""
        gpu = (platform or default_platform()) == "gpu"
        if gpu:
            from jax_dwdp.kernels import _cutlass  # (a file check: nothing is loaded)

            # CUTLASS: 1.04-1.37x torch._grouped_mm and 1.4-11x Mosaic's ragged_dot_mgpu (benchmarks/RESULTS.md,
            # "MoE grouped GEMM"); Mosaic is the fallback where the library is not built.
            grouped = "cutlass" if _cutlass.available() else "mosaic"
        else:
            grouped = "xla"
        return cls(
            grouped_matmul=grouped,
            gmm_config=None,  # by rows per group: the automatic tile was the fastest of seven (H200, 2026-12-02)
            gmm_cmd_buffer=False,  # at parity (232.3 vs 232.3 ms at 16K, H200 2026-12-02) with more host time
            gather_config=None,
            gather_swiglu_config=None,
            moe_gather=None,  # by shape: faster than the dispatch at hidden 2048, and wider only up to 40,960 rows
            moe_merged_projection=None,  # from 1,024 tokens: the MoE block 2.145 vs 2.171 ms at 16K (H100)
            routing="pallas",  # top-k 0.077 vs 0.199 ms, sort 0.065 vs 0.135 ms at 16K (H200, 2026-12-02)
            dispatch="pallas",  # 1.48x / 1.53x XLA's row gather at 16K / 32K (H200, 2026-12-01)
            conv=None,  # the kernel from 8,192 tokens: the linear-attention layer 1.6% / 0.5% faster at 16K / 32K
            conv_silu="ex2",  # the kernel 0.256 vs 0.271 ms (exact SiLU) at 16K, within a bf16 step (H100)
            norm_rope="pallas",  # the attention mixer 5.292 vs 5.387 ms at 16K (H200, 2026-12-01)
            gdn="pallas" if gpu else "xla",  # 0.957 ms vs 13.05 ms for the XLA scan at 16K (H200, 2026-12-01)
            ssd="pallas" if gpu else "xla",  # 0.725 vs 3.890 ms for the XLA scan at 16K (H100, 2026-12-08)
        )

    @classmethod
    def read_environment(cls, environ: Mapping[str, str] | None = None, platform: str | None = None) -> KernelChoices:
        """`defaults(platform)` with every JAX_DWDP_* kernel variable set in `environ` (default os.environ) applied;
        an empty variable counts as unset. A value outside a field's values is refused naming the variable, its
        value and the allowed values. Not cached: `from_environment()` is what the model reads."""
        environ = os.environ if environ is None else environ
        for var, what in REMOVED.items():
            if environ.get(var):
                raise ValueError(f"${var}={environ[var]!r}: {what} was measured slower than the default and removed "
                                 "(benchmarks/RESULTS.md, 'Variants measured slower'); unset it")
        changes = {}
        for field, allowed in _VALUES.items():
            var = env_var(field)
            raw = environ.get(var, "")
            if raw == "":
                continue
            if allowed is None:
                changes[field] = raw
            elif isinstance(allowed[0], bool):
                if raw not in ("1", "0"):
                    raise ValueError(f"${var}={raw!r}: use 1 or 0 (unset: the default)")
                changes[field] = raw == "1"
            elif raw not in allowed:
                raise ValueError(f"${var}={raw!r} is none of {tuple(a for a in allowed if a is not None)}")
            else:
                changes[field] = raw
        return cls.defaults(platform).replace(**changes)

    from_environment: ClassVar[Callable[[], KernelChoices]]  # (set below: a cached function of no arguments)


@functools.lru_cache(maxsize=1)
def _from_environment() -> KernelChoices:
    """The process's choices: `read_environment()` on the first call, the same object after (a variable set later
    changes nothing: build a model with `kernels=` instead). `KernelChoices.from_environment.cache_clear()` rereads
    (tests)."""
    return KernelChoices.read_environment()


KernelChoices.from_environment = staticmethod(_from_environment)


def resolve(kernels: KernelChoices | None) -> KernelChoices:
    """`kernels`, or the process's choices when None (a kernel function called without a model's choices)."""
    return KernelChoices.from_environment() if kernels is None else kernels

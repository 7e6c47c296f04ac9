"""The CUTLASS sm90 grouped GEMM (ffi/grouped_gemm) behind XLA FFI custom calls: the plain grouped matmul, the
gate_up projection with SiLU(gate) * up fused into its epilogue, and the gate_up projection that gathers its rows
from the unpermuted tokens (with or without SiLU(gate) * up fused: ffi/grouped_gemm/gather_gemm.cuh).

The shared library `jax_dwdp/_lib/libjax_dwdp_gmm.so` (or the path in $JAX_DWDP_GMM_LIB) is loaded on first use
only, never when jax_dwdp is imported, and its handlers are registered once for the CUDA platform
(jax_dwdp.native).

Choices (`KernelChoices`, passed down by the grouped matmul functions; each call here takes them as arguments):
- `gmm_config` (`preferred=`): a kernel configuration by name or by index into `config_names()`; default: chosen from
  the average rows per group (`pick_config`: the cooperative 128x256 tile without a cluster from 64 rows per group).
  The fused SwiGLU kernel is built for two of those tiles (`swiglu_config_names()`); for it, a preferred name it
  lacks keeps the automatic choice, with a warning. (The `config=` argument indexes the function's own list.)
- `gather_config`, `gather_swiglu_config` (`config=`): the gather kernels' configuration by name or index into
  `gather_config_names()` / `gather_swiglu_config_names()`; default: the first of each.
- `gmm_cmd_buffer` (`cmd_buffer=`): the grouped GEMM's handler with the command-buffer (CUDA graph) trait, so that
  XLA records it into its command buffers with the kernels around it (both handlers are registered, under two
  target names). It runs (the handler takes its device from XLA's FFI context: cudaStreamGetDevice is refused
  during stream capture) and measured at parity over the 40-layer 35b-a3b prefill on an H200 (66.0 vs 66.8 ms at
  4K, 232.3 vs 232.3 at 16K, 528.5 vs 527.4 at 32K) with more host time per call (2026-12-02; benchmarks/RESULTS.md,
  "Variants measured slower"), so it is off by default and kept as an option.
"""

from __future__ import annotations

import ctypes
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_dwdp.kernels.choices import env_var
from jax_dwdp.native import NativeLibrary

TARGET = "jax_dwdp_grouped_gemm"
SWIGLU_TARGET = "jax_dwdp_grouped_gemm_swiglu"
CMD_BUFFER_SUFFIX = "_cmd_buffer"  # the same kernels' handlers with XLA's command-buffer trait (`cmd_buffer=True`)
GATHER_TARGET = "jax_dwdp_gather_grouped_gemm"
GATHER_SWIGLU_TARGET = "jax_dwdp_gather_grouped_gemm_swiglu"
_warned: set[str] = set()


class CutlassUnavailable(RuntimeError):
    """The CUTLASS grouped matmul cannot run here (library not built, or no CUDA GPU)."""


def _declare(lib: ctypes.CDLL) -> None:
    lib.JaxDwdpGroupedGemmWorkspaceBytes.restype = ctypes.c_size_t
    lib.JaxDwdpGroupedGemmWorkspaceBytes.argtypes = [ctypes.c_int32, ctypes.c_int32]
    for prefix in ("JaxDwdpGroupedGemm", "JaxDwdpGroupedGemmSwiglu"):
        getattr(lib, prefix + "NumConfigs").restype = ctypes.c_int32
        getattr(lib, prefix + "NumConfigs").argtypes = []
        getattr(lib, prefix + "ConfigName").restype = ctypes.c_char_p
        getattr(lib, prefix + "ConfigName").argtypes = [ctypes.c_int32]
        getattr(lib, prefix)  # the handlers themselves
        getattr(lib, prefix + "NoGraph")
    lib.JaxDwdpGatherGroupedGemmWorkspaceBytes.restype = ctypes.c_size_t
    lib.JaxDwdpGatherGroupedGemmWorkspaceBytes.argtypes = [ctypes.c_int32]
    for prefix in ("JaxDwdpGatherGroupedGemm", "JaxDwdpGatherGroupedGemmSwiglu"):
        getattr(lib, prefix + "NumConfigs").restype = ctypes.c_int32
        getattr(lib, prefix + "NumConfigs").argtypes = []
        getattr(lib, prefix + "ConfigName").restype = ctypes.c_char_p
        getattr(lib, prefix + "ConfigName").argtypes = [ctypes.c_int32]
    lib.JaxDwdpGatherGroupedGemm
    lib.JaxDwdpGatherGroupedGemmSwiglu


LIBRARY = NativeLibrary(
    "CUTLASS grouped matmul library", "libjax_dwdp_gmm.so", "JAX_DWDP_GMM_LIB", CutlassUnavailable, declare=_declare,
    build_hint="build it with cmake from ffi/grouped_gemm (see benchmarks/gpu/grouped_matmul_h200.sh) or pick "
               "implementation='mosaic'")
library_path, available, _lib = LIBRARY.path, LIBRARY.available, LIBRARY.load


def config_names() -> list[str]:
    lib = _lib()
    return [lib.JaxDwdpGroupedGemmConfigName(i).decode() for i in range(lib.JaxDwdpGroupedGemmNumConfigs())]


def swiglu_config_names() -> list[str]:
    """The configurations compiled with the fused SwiGLU epilogue (a subset of `config_names()`' tiles)."""
    lib = _lib()
    return [lib.JaxDwdpGroupedGemmSwigluConfigName(i).decode() for i in range(lib.JaxDwdpGroupedGemmSwigluNumConfigs())]


def gather_config_names() -> list[str]:
    """The configurations of the gather grouped GEMM (`grouped_matmul_gather`)."""
    lib = _lib()
    return [lib.JaxDwdpGatherGroupedGemmConfigName(i).decode()
            for i in range(lib.JaxDwdpGatherGroupedGemmNumConfigs())]


def gather_swiglu_config_names() -> list[str]:
    """The configurations of the gather grouped GEMM with the fused SwiGLU (`grouped_matmul_gather_swiglu`). (Two
    persistent forms, one CTA per SM with the next tile's loads under this one's epilogue, measured slower on an
    H200 (kernel 1.05-1.17x slower, or 0.86-0.99x the default's speed, 2026-12-04) and were removed:
    benchmarks/RESULTS.md, "Variants measured slower".)"""
    lib = _lib()
    return [lib.JaxDwdpGatherGroupedGemmSwigluConfigName(i).decode()
            for i in range(lib.JaxDwdpGatherGroupedGemmSwigluNumConfigs())]


def _gather_choice(names: list[str], config: int | str | None, what: str, field: str) -> int:
    """Index into `names` of `config` (a name or an index, from `config=` or `KernelChoices.<field>`), else 0."""
    choice = 0 if config is None else config
    where = f"(config=, or KernelChoices.{field} / ${env_var(field)})"
    if isinstance(choice, str) and choice.isdigit():
        choice = int(choice)
    if isinstance(choice, str):
        if choice not in names:
            raise ValueError(f"{what} config {choice!r} {where} is none of {names}")
        choice = names.index(choice)
    if not 0 <= int(choice) < len(names):
        raise ValueError(f"{what} config index {choice} {where} is out of range for {names}")
    return int(choice)


def _register() -> None:
    if jax.default_backend() != "gpu":
        raise CutlassUnavailable(
            f"the CUTLASS grouped matmul needs a CUDA GPU (JAX's default backend is {jax.default_backend()!r})"
        )
    LIBRARY.register({TARGET: "JaxDwdpGroupedGemmNoGraph", SWIGLU_TARGET: "JaxDwdpGroupedGemmSwigluNoGraph",
                      TARGET + CMD_BUFFER_SUFFIX: "JaxDwdpGroupedGemm",
                      SWIGLU_TARGET + CMD_BUFFER_SUFFIX: "JaxDwdpGroupedGemmSwiglu",
                      GATHER_TARGET: "JaxDwdpGatherGroupedGemm", GATHER_SWIGLU_TARGET: "JaxDwdpGatherGroupedGemmSwiglu"})


def _max_sm_count() -> int:
    counts = [getattr(d, "core_count", 0) or 0 for d in jax.local_devices() if d.platform == "gpu"]
    return max(counts, default=0)  # 0: the library's upper bound (1024 SMs)


@functools.lru_cache(maxsize=None)
def workspace_bytes(groups: int, sm_count: int) -> int:
    return int(_lib().JaxDwdpGroupedGemmWorkspaceBytes(groups, sm_count))


def pick_config(m: int, n: int, groups: int, names: list[str] | None = None, preferred: str | None = None) -> int:
    """Index into `names` (default `config_names()`) of the kernel configuration: `preferred`
    (`KernelChoices.gmm_config`: a name, or an index into `config_names()`), else by average rows per group (like
    PyTorch)."""
    full = config_names()
    names = full if names is None else names
    if preferred:
        name = full[int(preferred)] if preferred.isdigit() and int(preferred) < len(full) else preferred
        if name in names:
            return names.index(name)
        if name not in full:
            raise ValueError(f"KernelChoices.gmm_config / $JAX_DWDP_GMM_CONFIG={preferred!r} is none of {full}")
        if name not in _warned:  # a configuration without a fused SwiGLU build: keep the automatic choice
            _warned.add(name)
            warnings.warn(f"KernelChoices.gmm_config={preferred!r}: {name} has no fused SwiGLU build ({names}); the "
                          "fused gate_up projection keeps its automatic choice", stacklevel=2)
    rows_per_group = m / max(groups, 1)
    # Measured on an H200 (2026-11-30, benchmarks/RESULTS.md, "MoE grouped GEMM") at 80-512 rows per group: the
    # cooperative 128x256 tile without a cluster was the fastest of the five configs on every uniform-routing case,
    # and ahead of the 2x1-cluster tile on the skewed ones (the fastest of seven again on 2026-12-02). A 2x1 cluster pairs M tiles that mostly belong to
    # different groups; without it, the 64x128 ping-pong tile also beat its clustered form (by 1-9%), so small
    # groups (below half a 128-row tile; not measured there) get that one.
    small = rows_per_group < 64 or n <= 128
    return names.index("pingpong_64x128x128_c1x1" if small else "coop_128x256x64_c1x1")


def _call(target: str, names: list[str], n_out: int, x, w, group_sizes, config, preferred: str | None = None,
          cmd_buffer: bool = False) -> jax.Array:
    m, k = x.shape
    g, n, _ = w.shape
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"cutlass grouped matmul takes bfloat16 x and w, got {x.dtype} and {w.dtype}")
    _register()
    if cmd_buffer:
        target += CMD_BUFFER_SUFFIX
    if config is None:
        cfg = pick_config(m, n, g, names, preferred)
    elif isinstance(config, str):
        if config not in names:
            raise ValueError(f"cutlass config {config!r} is not built for this call; one of {names}")
        cfg = names.index(config)
    else:
        cfg = int(config)
        if not 0 <= cfg < len(names):
            raise ValueError(f"cutlass config index {cfg} is out of range for this call's configs {names}")
    ws = workspace_bytes(g, _max_sm_count())
    out, _ = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct((m, n_out), jnp.bfloat16), jax.ShapeDtypeStruct((ws,), jnp.uint8)),
        vmap_method="sequential",
    )(x, w, group_sizes.astype(jnp.int32), config=np.int32(cfg))
    return out


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, config: int | str | None = None,
                   preferred: str | None = None, cmd_buffer: bool = False) -> jax.Array:
    """x [M, K] bf16 rows sorted by group; w [G, N, K] bf16; group_sizes [G] int32 (device). Returns [M, N] bf16.

    Rows past sum(group_sizes) are zeros. Needs K % 8 == 0 and N % 8 == 0 (16-byte TMA rows). `config`: a name or
    index into `config_names()`, else `preferred` or the automatic choice (`pick_config`); `cmd_buffer`: the handler
    with the command-buffer trait (see the module's docstring).
    """
    k, n = x.shape[1], w.shape[1]
    if k % 8 or n % 8:
        raise ValueError(f"cutlass grouped matmul needs K % 8 == 0 and N % 8 == 0, got K={k} N={n}")
    return _call(TARGET, config_names(), n, x, w, group_sizes, config, preferred, cmd_buffer)


def grouped_matmul_swiglu(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, config: int | str | None = None,
    preferred: str | None = None, cmd_buffer: bool = False,
) -> jax.Array:
    """The gate_up projection with SiLU(gate) * up in the epilogue: x [M, K] bf16 rows sorted by group; w [G, 2I, K]
    bf16 with gate and up rows interleaved in blocks of 8 (`grouped_matmul.interleave_gate_up`); returns [M, I] bf16
    = silu(x @ gate^T) * (x @ up^T), computed from the fp32 accumulators. Rows past sum(group_sizes) are zeros.
    Needs K % 8 == 0 and I % 8 == 0. `config`, `preferred`, `cmd_buffer`: as `grouped_matmul`'s.
    """
    k, n = x.shape[1], w.shape[1]
    if k % 8 or n % 16:
        raise ValueError(f"cutlass fused SwiGLU grouped matmul needs K % 8 == 0 and 2I % 16 == 0, got K={k} 2I={n}")
    return _call(SWIGLU_TARGET, swiglu_config_names(), n // 2, x, w, group_sizes, config, preferred, cmd_buffer)


def _gather_call(target: str, what: str, n_multiple: int, n_out_div: int, x, row_token, w, group_sizes,
                 config: int) -> jax.Array:
    (_, k), (m,), (g, n, _) = x.shape, row_token.shape, w.shape
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"cutlass {what} takes bfloat16 x and w, got {x.dtype} and {w.dtype}")
    if k % 8 or n % n_multiple:
        raise ValueError(f"cutlass {what} needs K % 8 == 0 and N % {n_multiple} == 0 (w's rows), got K={k} N={n}")
    _register()
    ws = int(_lib().JaxDwdpGatherGroupedGemmWorkspaceBytes(g))
    out, _ = jax.ffi.ffi_call(
        target,
        (jax.ShapeDtypeStruct((m, n // n_out_div), jnp.bfloat16), jax.ShapeDtypeStruct((ws,), jnp.uint8)),
        vmap_method="sequential",
    )(x, row_token.astype(jnp.int32), w, group_sizes.astype(jnp.int32), config=np.int32(config))
    return out


def grouped_matmul_gather(x: jax.Array, row_token: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                          config: int | str | None = None) -> jax.Array:
    """out[r] = x[row_token[r]] @ w[g]^T for the rows r of each group g (rows in group order), with the gather
    inside the GEMM's loads: x [T, K] bf16 (tokens in their own order), row_token [M] int32, w [G, N, K] bf16,
    group_sizes [G] int32 (device). Returns [M, N] bf16. Rows past sum(group_sizes), and rows whose token index is
    outside [0, T), are zeros. Needs K % 8 == 0 and N % 8 == 0. `config`: a name or index into
    `gather_config_names()` (`KernelChoices.gather_config`; default: the first).
    """
    choice = _gather_choice(gather_config_names(), config, "gather grouped matmul", "gather_config")
    return _gather_call(GATHER_TARGET, "gather grouped matmul", 8, 1, x, row_token, w, group_sizes, choice)


def grouped_matmul_gather_swiglu(x: jax.Array, row_token: jax.Array, w: jax.Array, group_sizes: jax.Array, *,
                                 config: int | str | None = None) -> jax.Array:
    """The gate_up projection with the gather in its loads and SiLU(gate) * up in its epilogue: x [T, K] bf16,
    row_token [M] int32, w [G, 2I, K] bf16 in the checkpoint's layout (gate rows, then up rows), group_sizes [G].
    Returns [M, I] bf16 = silu(gate) * up in fp32 from gate and up rounded to bf16 (as `grouped_matmul_gather`,
    then the activation, computes it). Rows past sum(group_sizes) and rows of a token outside [0, T) are zeros.
    Needs K % 8 == 0 and I % 8 == 0. `config`: a name or index into `gather_swiglu_config_names()`
    (`KernelChoices.gather_swiglu_config`; default: the first).
    """
    choice = _gather_choice(gather_swiglu_config_names(), config, "gather SwiGLU grouped matmul",
                            "gather_swiglu_config")
    return _gather_call(GATHER_SWIGLU_TARGET, "gather SwiGLU grouped matmul", 16, 2, x, row_token, w, group_sizes,
                        choice)

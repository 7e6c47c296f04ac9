"""The CUTLASS sm90 grouped GEMM (ffi/grouped_gemm) behind an XLA FFI custom call.

The shared library `jax_dwdp/_lib/libjax_dwdp_gmm.so` (or the path in $JAX_DWDP_GMM_LIB) is loaded with ctypes on
first use only, never when jax_dwdp is imported, and its handler is registered once for the CUDA platform.

Switches (read at trace time):
- $JAX_DWDP_GMM_CONFIG: a kernel configuration by name or index (see `config_names()`); default: chosen from the
  average rows per group (`pick_config`: the cooperative 128x256 tile without a cluster from 32 rows per group).
- $JAX_DWDP_GMM_CMD_BUFFER=1: register the handler with the command-buffer (CUDA graph) trait (off by default:
  inside XLA command buffers the launch failed with cudaErrorStreamCaptureUnsupported on an H200, 2026-11-30).
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "jax_dwdp_grouped_gemm"
_LIB_NAME = "libjax_dwdp_gmm.so"
_lock = threading.Lock()
_registered: dict[str, object] = {}


class CutlassUnavailable(RuntimeError):
    """The CUTLASS grouped matmul cannot run here (library not built, or no CUDA GPU)."""


def library_path() -> Path:
    env = os.environ.get("JAX_DWDP_GMM_LIB")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "_lib" / _LIB_NAME


def available() -> bool:
    """True when the library file exists (cheap: nothing is loaded)."""
    return library_path().is_file()


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    path = library_path()
    if not path.is_file():
        raise CutlassUnavailable(
            f"the CUTLASS grouped matmul library {path} is not built; build it with cmake from ffi/grouped_gemm "
            "(see benchmarks/gpu/grouped_matmul_h200.sh) or pick implementation='mosaic'"
        )
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise CutlassUnavailable(f"cannot load {path}: {e}") from e
    lib.JaxDwdpGroupedGemmWorkspaceBytes.restype = ctypes.c_size_t
    lib.JaxDwdpGroupedGemmWorkspaceBytes.argtypes = [ctypes.c_int32, ctypes.c_int32]
    lib.JaxDwdpGroupedGemmNumConfigs.restype = ctypes.c_int32
    lib.JaxDwdpGroupedGemmNumConfigs.argtypes = []
    lib.JaxDwdpGroupedGemmConfigName.restype = ctypes.c_char_p
    lib.JaxDwdpGroupedGemmConfigName.argtypes = [ctypes.c_int32]
    return lib


def config_names() -> list[str]:
    lib = _lib()
    return [lib.JaxDwdpGroupedGemmConfigName(i).decode() for i in range(lib.JaxDwdpGroupedGemmNumConfigs())]


def _register() -> None:
    with _lock:
        if TARGET in _registered:
            return
        if jax.default_backend() != "gpu":
            raise CutlassUnavailable(
                f"the CUTLASS grouped matmul needs a CUDA GPU (JAX's default backend is {jax.default_backend()!r})"
            )
        lib = _lib()
        graphs = os.environ.get("JAX_DWDP_GMM_CMD_BUFFER", "0") == "1"  # capture failed on H200 (cudaErrorStreamCaptureUnsupported)
        fn = lib.JaxDwdpGroupedGemm if graphs else lib.JaxDwdpGroupedGemmNoGraph
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(fn), platform="CUDA")
        _registered[TARGET] = fn


def _max_sm_count() -> int:
    counts = [getattr(d, "core_count", 0) or 0 for d in jax.local_devices() if d.platform == "gpu"]
    return max(counts, default=0)  # 0: the library's upper bound (1024 SMs)


@functools.lru_cache(maxsize=None)
def workspace_bytes(groups: int, sm_count: int) -> int:
    return int(_lib().JaxDwdpGroupedGemmWorkspaceBytes(groups, sm_count))


def pick_config(m: int, n: int, groups: int) -> int:
    """Index of the kernel configuration: $JAX_DWDP_GMM_CONFIG, else by average rows per group (like PyTorch)."""
    names = config_names()
    env = os.environ.get("JAX_DWDP_GMM_CONFIG")
    if env:
        if env.isdigit() and int(env) < len(names):
            return int(env)
        if env in names:
            return names.index(env)
        raise ValueError(f"JAX_DWDP_GMM_CONFIG={env!r} is none of {names}")
    rows_per_group = m / max(groups, 1)
    # Measured on an H200 (benchmarks/RESULTS.md, 2026-11-30, fourth session) at 80-512 rows per group: the
    # cooperative 128x256 tile without a cluster was the fastest of the five configs on every uniform-routing case,
    # and ahead of the previous choice on the skewed ones. A 2x1 cluster pairs M tiles that mostly belong to
    # different groups; without it, the 64x128 ping-pong tile also beat its clustered form (by 1-9%), so small
    # groups (below half a 128-row tile; not measured there) get that one.
    small = rows_per_group < 64 or n <= 128
    return names.index("pingpong_64x128x128_c1x1" if small else "coop_128x256x64_c1x1")


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, config: int | str | None = None) -> jax.Array:
    """x [M, K] bf16 rows sorted by group; w [G, N, K] bf16; group_sizes [G] int32 (device). Returns [M, N] bf16.

    Rows past sum(group_sizes) are zeros. Needs K % 8 == 0 and N % 8 == 0 (16-byte TMA rows).
    """
    m, k = x.shape
    g, n, _ = w.shape
    if x.dtype != jnp.bfloat16 or w.dtype != jnp.bfloat16:
        raise ValueError(f"cutlass grouped matmul takes bfloat16 x and w, got {x.dtype} and {w.dtype}")
    if k % 8 or n % 8:
        raise ValueError(f"cutlass grouped matmul needs K % 8 == 0 and N % 8 == 0, got K={k} N={n}")
    _register()
    if config is None:
        cfg = pick_config(m, n, g)
    elif isinstance(config, str):
        cfg = config_names().index(config)
    else:
        cfg = int(config)
    ws = workspace_bytes(g, _max_sm_count())
    out, _ = jax.ffi.ffi_call(
        TARGET,
        (jax.ShapeDtypeStruct((m, n), jnp.bfloat16), jax.ShapeDtypeStruct((ws,), jnp.uint8)),
        vmap_method="sequential",
    )(x, w, group_sizes.astype(jnp.int32), config=np.int32(cfg))
    return out

"""The FFI libraries are built by `pip install` wherever a CUDA toolkit is present (CI has one), and loading them
is only ever attempted on the FFI path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "ffi"))
from cuda_paths import cuda_home  # noqa: E402

from tests.elf_symbols import exported_functions  # noqa: E402

LIB = ROOT / "jax_dwdp" / "_lib" / "libjax_dwdp_ffi.so"


@pytest.mark.skipif(cuda_home() is None, reason="no CUDA toolkit here: pip install builds no FFI library")
def test_dwdp_library_exports_the_handlers_and_no_c_api():
    """The store's library is its XLA FFI handlers (the ones dwdp_ffi registers) and nothing Python calls
    directly: its C functions (C++ ones are mangled, `_Z...`) are exactly the handlers. The test-only library adds
    the two prefetches with fault injection."""
    from jax_dwdp.parallel.dwdp_ffi import HANDLERS, library_path

    path = library_path()
    assert path.is_file(), f"{path} missing: `pip install -e .` should have built it (cuda.h is at {cuda_home()})"
    c_functions = {name for name in exported_functions(path) if not name.startswith("_Z")}
    assert c_functions == set(HANDLERS.values()) == {"JaxDwdpStorePrefetch", "JaxDwdpStorePrefetchInPlace",
                                                     "JaxDwdpStoreWait"}, c_functions
    testing = path.with_name("libjax_dwdp_ffi_testing.so")
    assert testing.is_file(), f"{testing} missing: `pip install -e .` builds it beside {path.name}"
    c_functions = {name for name in exported_functions(testing) if not name.startswith("_Z")}
    assert c_functions == {"JaxDwdpStorePrefetch", "JaxDwdpStorePrefetchInPlace", "JaxDwdpStoreWait",
                           "JaxDwdpStoreTestingPrefetch", "JaxDwdpStoreTestingPrefetchInPlace"}, c_functions


@pytest.mark.skipif(cuda_home() is None, reason="no CUDA toolkit here: pip install builds no FFI library")
def test_grouped_gemm_library_is_built():
    path = ROOT / "jax_dwdp" / "_lib" / "libjax_dwdp_gmm.so"
    assert path.is_file(), f"{path} missing: `pip install -e .` builds it with the nvidia-cutlass headers"
    exported = exported_functions(path)
    for symbol in ("JaxDwdpGroupedGemm", "JaxDwdpGroupedGemmNoGraph", "JaxDwdpGroupedGemmWorkspaceBytes",
                   "JaxDwdpGroupedGemmSwiglu", "JaxDwdpGroupedGemmSwigluNoGraph"):
        assert symbol in exported, symbol


def test_missing_library_is_a_clear_error(tmp_path, monkeypatch):
    from jax_dwdp.parallel import dwdp_ffi

    monkeypatch.setenv("JAX_DWDP_FFI_LIB", str(tmp_path / "nothing.so"))
    dwdp_ffi.LIBRARY.load.cache_clear()
    try:
        with pytest.raises(dwdp_ffi.FfiUnavailable, match="not built .*nothing.so does not exist"):
            dwdp_ffi.load_library()
    finally:
        dwdp_ffi.LIBRARY.load.cache_clear()


def test_exported_functions_come_from_the_dynamic_symbol_table_not_the_bytes():
    """A name in a library's bytes is not an export: the reader finds the loader's function symbols only (this
    process's libc: malloc is one; GLIBC_2.2.5, a version name in its bytes, is not)."""
    libc = next(Path(line.split()[-1]) for line in Path("/proc/self/maps").read_text().splitlines()
                if "/libc.so" in line or "/libc-" in line)
    assert b"GLIBC_2.2.5" in libc.read_bytes() or b"GLIBC_2.17" in libc.read_bytes()
    exported = exported_functions(libc)
    assert {"malloc", "free", "printf"} <= exported
    assert not {"GLIBC_2.2.5", "GLIBC_2.17"} & exported

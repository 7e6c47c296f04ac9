"""Builds the FFI libraries of `ffi/` with CMake into jax_dwdp/_lib/ when a CUDA toolkit is present.

JAX_DWDP_BUILD_FFI=1 makes a failed or impossible build an error (CI sets it), =0 skips it; unset, the build runs
when cuda.h is found and is skipped with a notice otherwise (the XLA paths need no FFI library).
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "ffi"))
from build_notice import SKIP, notice, record  # noqa: E402
from cuda_paths import cuda_home, cutlass_include_dir  # noqa: E402


class CMakeFfiBuild(build_ext):
    def build_extension(self, ext):
        mode = os.environ.get("JAX_DWDP_BUILD_FFI")
        lib_dir = self._lib_dir(ext)
        if mode == "0":
            notice("JAX_DWDP_BUILD_FFI=0: the FFI libraries are not built")
            record(lib_dir, "skipped", "JAX_DWDP_BUILD_FFI=0 at install")
            return
        home = cuda_home()
        cmake = shutil.which("cmake")
        if home is None or cmake is None:
            why = "no CUDA toolkit (cuda.h) found" if home is None else "no cmake found"
            if mode == "1":
                raise RuntimeError(f"jax_dwdp: cannot build the FFI libraries: {why}")
            notice(f"{why}; the FFI libraries are not built (the XLA paths do not need them)")
            record(lib_dir, "skipped", f"{why} at install")
            return
        notice(f"building the FFI libraries with CMake (CUDA toolkit at {home}; a few minutes on 2 cores); {SKIP}")
        start = time.monotonic()
        try:
            self._cmake(ext, home, cmake, lib_dir)
            notice(f"FFI libraries built in {time.monotonic() - start:.0f} s")
            record(lib_dir, "built", f"CUDA toolkit at {home}", time.monotonic() - start)
        except (subprocess.CalledProcessError, ImportError, OSError) as e:
            record(lib_dir, "failed", str(e), time.monotonic() - start)
            if mode == "1":
                raise
            notice(f"the FFI libraries did not build ({e}); the XLA paths do not need them (JAX_DWDP_BUILD_FFI=1 "
                   "makes this an error; `pip install -v` shows the compiler's output)")

    def _lib_dir(self, ext) -> Path:
        if getattr(self, "editable_mode", False) or self.inplace:
            return ROOT / "jax_dwdp" / "_lib"  # an editable install imports jax_dwdp from the source tree
        return Path(self.get_ext_fullpath(ext.name)).parent  # the wheel's build tree

    def _cmake(self, ext, home: str, cmake: str, lib_dir: Path) -> None:
        import jaxlib  # the XLA FFI headers ship with jaxlib (jax.ffi.include_dir() points there)

        lib_dir.mkdir(parents=True, exist_ok=True)
        build_dir = Path(self.build_temp) / "ffi"
        args = [
            f"-DXLA_FFI_INCLUDE_DIR={Path(jaxlib.__file__).parent / 'include'}",
            f"-DJAX_DWDP_LIB_DIR={lib_dir.resolve()}",
            f"-DCUDAToolkit_ROOT={home}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        nvcc = Path(home) / "bin" / "nvcc"
        cutlass = cutlass_include_dir()
        if nvcc.is_file() and cutlass and os.environ.get("JAX_DWDP_BUILD_GMM") != "0":
            args += [f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCUTLASS_INCLUDE_DIR={cutlass}"]
        else:
            notice("no nvcc or no CUTLASS headers; the grouped GEMM library is not built")
        jobs = str(os.cpu_count() or 2)
        subprocess.run([cmake, "-S", str(ROOT / "ffi"), "-B", str(build_dir), *args], check=True)
        subprocess.run([cmake, "--build", str(build_dir), "-j", jobs], check=True)

    def copy_extensions_to_source(self):
        pass  # editable builds already wrote the libraries into the source tree

    def get_outputs(self):
        return []  # the libraries are data files of jax_dwdp/_lib, not importable extension modules


setup(
    # One placeholder extension: CMake builds every library of ffi/ into jax_dwdp/_lib/ next to it.
    ext_modules=[Extension("jax_dwdp._lib._placeholder", sources=["ffi/dwdp_store/handlers.cc"])],
    cmdclass={"build_ext": CMakeFfiBuild},
)

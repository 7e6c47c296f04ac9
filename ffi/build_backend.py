"""jax_dwdp's PEP 517 build backend: setuptools, plus the FFI libraries' build needs when they can be built.

The XLA FFI headers come from jaxlib and the CUTLASS headers from the `nvidia-cutlass` wheel; both are needed only
to compile `ffi/`, which needs a CUDA toolkit. So they are asked for only when `cuda.h` is found (or
JAX_DWDP_BUILD_FFI=1), and a CPU-only install stays light. setup.py runs the CMake build itself.
"""

import os
import sys
import tomllib
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the PEP 517 hooks this module does not override)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_notice import SKIP, notice  # noqa: E402
from cuda_paths import cuda_home  # noqa: E402

def _jaxlib_pins() -> list[str]:
    """The project's own jaxlib pins (pyproject.toml): the XLA FFI headers must match the jaxlib it runs with."""
    with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return [d for d in deps if d.replace(" ", "").startswith("jaxlib")]


_FFI_REQUIRES = ["cmake>=3.24", *_jaxlib_pins(), "nvidia-cutlass==4.2.0.0"]


def _ffi_requires() -> list[str]:
    mode = os.environ.get("JAX_DWDP_BUILD_FFI")
    if mode == "0":
        return []
    home = cuda_home()
    if not (home or mode == "1"):
        return []
    where = f"a CUDA toolkit is at {home}" if home else "JAX_DWDP_BUILD_FFI=1"
    notice(f"{where}: this install also builds the FFI libraries with CMake (fetching cmake and the CUTLASS "
           f"headers, then a few minutes of compiling on 2 cores); {SKIP}")
    return _FFI_REQUIRES


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _ffi_requires()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _ffi_requires()

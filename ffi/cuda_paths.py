"""Where the CUDA toolkit and the CUTLASS headers are (shared by the build backend and setup.py)."""

import os
import shutil
from pathlib import Path


def cuda_home() -> str | None:
    """The CUDA toolkit root holding include/cuda.h, or None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for c in candidates:
        if c and (Path(c) / "include" / "cuda.h").is_file():
            return c
    return None


def cutlass_include_dir() -> str | None:
    """CUTLASS's include/ (JAX_DWDP_CUTLASS_DIR, else the installed nvidia-cutlass wheel), or None."""
    env = os.environ.get("JAX_DWDP_CUTLASS_DIR")
    if env:
        return env
    try:
        import cutlass_library
    except Exception:
        return None
    inc = Path(cutlass_library.__file__).resolve().parent / "source" / "include"
    return str(inc) if (inc / "cutlass" / "cutlass.h").is_file() else None

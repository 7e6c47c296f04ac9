"""mamba_ssm's Triton kernels from a wheel built without its CUDA extensions (`MAMBA_SKIP_CUDA_BUILD=TRUE`).

The package's __init__ imports `selective_scan_cuda` (Mamba-1's CUDA scan) at the top. transformers binds the
Mamba-2 kernels by a bare `import mamba_ssm`, and bench_ssd.py imports the Triton SSD ops under it, so both need the
package to import: the missing extension is put in as a stand-in that refuses any use.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types


class MissingExtension(types.ModuleType):
    """Stands in for a CUDA extension of mamba_ssm that its wheel was built without, so that the package imports and
    its Triton kernels can be used. Any use of the extension itself is refused."""

    def __getattr__(self, name: str):
        raise AttributeError(f"{self.__name__} is a stand-in (mamba_ssm was built without its CUDA extensions): "
                             f"{self.__name__}.{name} is not available")


def import_mamba_ssm() -> list[str]:
    """Imports mamba_ssm, a stand-in in place of selective_scan_cuda where it is missing. Returns what it did or
    found, in words (empty: the package imported as it is); it does not raise."""
    if importlib.util.find_spec("mamba_ssm") is None:
        return ["mamba_ssm is not installed (the wheel in .whl/, pip install --no-deps)"]
    notes = []
    if importlib.util.find_spec("selective_scan_cuda") is None:
        stand_in = MissingExtension("selective_scan_cuda")
        stand_in.__spec__ = importlib.machinery.ModuleSpec("selective_scan_cuda", None)  # find_spec() answers it
        sys.modules["selective_scan_cuda"] = stand_in
        notes.append("selective_scan_cuda (Mamba-1's CUDA scan, not used) is a stand-in")
    try:
        importlib.import_module("mamba_ssm")
    except Exception as e:  # noqa: BLE001 (the callers fall back and say why)
        notes.append(f"mamba_ssm does not import ({type(e).__name__}: {e})")
    return notes

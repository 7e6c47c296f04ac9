"""The one loader of jax_dwdp's native libraries (built from ffi/ into jax_dwdp/_lib/ by `pip install`).

A library is found (its environment variable, else jax_dwdp/_lib/), loaded with ctypes, its C signatures declared
and its XLA FFI handlers registered on first use only: importing jax_dwdp never loads one, so CPU-only machines
work without them. Every failure is the library's own error type with one message saying what to do.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import jax

LIB_DIR = Path(__file__).resolve().parent / "_lib"
REBUILD = "rebuild it: `pip install -e .` (JAX_DWDP_BUILD_FFI=1 makes a failed build an error)"


def build_status() -> str:
    """One line on the FFI libraries: what the install did (jax_dwdp/_lib/BUILD.json, written by setup.py) and
    which libraries are there."""
    present = sorted(p.name for p in LIB_DIR.glob("*.so"))
    libraries = ", ".join(present) if present else "none"
    try:
        record = json.loads((LIB_DIR / "BUILD.json").read_text())
    except (OSError, ValueError):
        return f"FFI libraries: {libraries} (no build record in {LIB_DIR})"
    took = f" in {record['seconds']} s" if record.get("seconds") is not None else ""
    return (f"FFI libraries: {libraries}; the install of {record.get('when', '?')} {record.get('outcome', '?')} them"
            f"{took} ({record.get('detail', '')})")


class NativeLibrary:
    """One shared library: `load()` (cached) returns the ctypes handle, `register(...)` its FFI handlers."""

    def __init__(self, what: str, file_name: str, env_var: str, error: type[Exception], *,
                 declare: Callable[[ctypes.CDLL], None], needs_driver: bool = False, build_hint: str = REBUILD):
        """`declare(lib)` sets the C signatures (an AttributeError there means a stale library); `needs_driver`
        loads libcuda.so.1 first, RTLD_GLOBAL, for libraries that resolve the driver's cu* symbols at load."""
        self.what, self.file_name, self.env_var, self.error = what, file_name, env_var, error
        self._declare, self._needs_driver, self._build_hint = declare, needs_driver, build_hint
        self._registered: set[str] = set()
        self._lock = threading.Lock()
        self.load = functools.cache(self._load)

    def path(self) -> Path:
        env = os.environ.get(self.env_var)
        return Path(env) if env else LIB_DIR / self.file_name

    def available(self) -> bool:
        """True when the library file exists (cheap: nothing is loaded)."""
        return self.path().is_file()

    def _load(self) -> ctypes.CDLL:
        path = self.path()
        if not path.is_file():
            raise self.error(f"the {self.what} is not built ({path} does not exist); {self._build_hint}")
        if self._needs_driver:
            try:
                ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                raise self.error(f"the {self.what} needs the NVIDIA driver (libcuda.so.1): {e}") from None
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise self.error(f"cannot load {path}: {e}") from e
        try:
            self._declare(lib)
        except AttributeError as e:
            raise self.error(f"{path} lacks a symbol this jax_dwdp needs ({e}): it was built from older sources; "
                             f"{REBUILD}") from e
        return lib

    def register(self, handlers: dict[str, str]) -> ctypes.CDLL:
        """Registers FFI target name -> exported handler symbol for the CUDA platform, each once per process."""
        lib = self.load()
        with self._lock:
            for target, symbol in handlers.items():
                if target not in self._registered:
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
                    self._registered.add(target)
        return lib

"""Fault injection for the GPU tests of the DWDP expert store, outside the production code: stores whose prefetch
runs the test-only handler library (libjax_dwdp_ffi_testing.so, ffi/dwdp_store/testing.cc), which is the production
prefetch behind three more attributes:

- poison=True: every prefetch destination is filled with NaN on the copy stream before its copies (a byte the
  copies miss stays NaN);
- delay_ms: the copy stream is held that long before each prefetch's copies (a read of the experts that does not
  wait for its copy sees the poison);
- inject_error(code): the next prefetch fails as if cuMemcpyDtoDAsync had returned `code` (a word of host memory
  this store owns, which the handler takes and resets).

`FaultyExpertStore` / `FaultyProcessExpertStore` take these as constructor options besides the production ones
(`from_sharded(..., poison=True, delay_ms=20)` works), and `FaultyFfiBackend` makes a Pipeline over them.
"""

from __future__ import annotations

import jax
import numpy as np

from jax_dwdp.native import NativeLibrary
from jax_dwdp.parallel.backends import FfiBackend
from jax_dwdp.parallel.dwdp_ffi import ExpertStore, FfiUnavailable, ProcessExpertStore, load_library

TESTING_PREFETCH_TARGET = "jax_dwdp_dwdp_prefetch_testing"

TESTING_LIBRARY = NativeLibrary(
    "DWDP FFI test library", "libjax_dwdp_ffi_testing.so", "JAX_DWDP_FFI_TESTING_LIB", FfiUnavailable,
    declare=lambda lib: lib.JaxDwdpStoreTestingPrefetch, needs_driver=True)


class Faulty:
    """The fault-injection options of a store (see the module doc); mixed in before the production class."""

    prefetch_target = TESTING_PREFETCH_TARGET

    def __init__(self, *args, poison: bool = False, delay_ms: int = 0, **kwargs):
        load_library()
        TESTING_LIBRARY.register({TESTING_PREFETCH_TARGET: "JaxDwdpStoreTestingPrefetch"})
        self.poison, self.delay_ms = poison, delay_ms
        self._inject = np.zeros(1, np.int64)  # read and reset by the handler; lives as long as the store
        super().__init__(*args, **kwargs)

    def inject_error(self, code: int) -> None:
        """Makes the next prefetch fail as if a CUDA call had returned `code`."""
        self.check_open()
        self._inject[0] = code

    def prefetch_attributes(self, layer: int) -> dict:
        return {**super().prefetch_attributes(layer), "poison": np.int64(self.poison),
                "delay_ms": np.int64(self.delay_ms), "inject": np.int64(self._inject.ctypes.data)}


class FaultyExpertStore(Faulty, ExpertStore):
    """An ExpertStore whose prefetch can poison, delay and fail."""


class FaultyProcessExpertStore(Faulty, ProcessExpertStore):
    """A ProcessExpertStore whose prefetch can poison, delay and fail."""


class FaultyFfiBackend(FfiBackend):
    """experts="ffi" over FaultyExpertStores (one process driving every device of a stage's row)."""

    def _open(self, mesh, cfg, num_layers, dtype, *, name):
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        devices = list(mesh.devices.flat)
        assert all(d.process_index == jax.process_index() for d in devices), "one process drives the row"
        return FaultyExpertStore(devices, num_layers, cfg.num_experts, ((2 * i, h), (h, i)), dtype,
                                 **self.store_options)

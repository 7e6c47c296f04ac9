"""Fault injection for the GPU tests of the DWDP expert store, outside the production code: stores whose prefetches
run the test-only handler library (libjax_dwdp_ffi_testing.so, ffi/dwdp_store/testing.cc), which is the production
prefetch (in place or copying out) behind more attributes:

- poison=True: every prefetch destination (copying out: the outputs; in place: the peers' slots of the layer's
  view) is filled with NaN on the copy stream before its copies (a byte the copies miss stays NaN);
- delay_ms: the copy stream is held that long before each prefetch's copies (a read of the experts that does not
  wait for its copy sees the poison);
- inject_error(code): the next prefetch fails as if cuMemcpyDtoDAsync had returned `code` (a word of host memory
  this store owns, which the handler takes and resets);
- skip_peers=True (in place): the prefetch records its events and copies nothing (the one-GPU benchmark's layer
  without the link).

`connect_in_process(stores)` connects ProcessExpertStores of one process (ranks of one job on one GPU: their
blocks traded as descriptors exactly as between processes).

`FaultyExpertStore` / `FaultyProcessExpertStore` take these as constructor options besides the production ones
(`from_sharded(..., poison=True, delay_ms=20)` works), and `FaultyFfiBackend` makes a Pipeline over them.
"""

from __future__ import annotations

import os

import jax
import numpy as np

from jax_dwdp.native import NativeLibrary
from jax_dwdp.parallel.backends import FfiBackend
from jax_dwdp.parallel.dwdp_ffi import ExpertStore, FfiUnavailable, ProcessExpertStore, load_library

TESTING_PREFETCH_TARGET = "jax_dwdp_dwdp_prefetch_testing"
TESTING_PREFETCH_IN_PLACE_TARGET = "jax_dwdp_dwdp_prefetch_in_place_testing"

TESTING_LIBRARY = NativeLibrary(
    "DWDP FFI test library", "libjax_dwdp_ffi_testing.so", "JAX_DWDP_FFI_TESTING_LIB", FfiUnavailable,
    declare=lambda lib: (lib.JaxDwdpStoreTestingPrefetch, lib.JaxDwdpStoreTestingPrefetchInPlace),
    needs_driver=True)


class Faulty:
    """The fault-injection options of a store (see the module doc); mixed in before the production class."""

    prefetch_target, prefetch_in_place_target = TESTING_PREFETCH_TARGET, TESTING_PREFETCH_IN_PLACE_TARGET

    def __init__(self, *args, poison: bool = False, delay_ms: int = 0, skip_peers: bool = False, **kwargs):
        load_library()
        TESTING_LIBRARY.register({TESTING_PREFETCH_TARGET: "JaxDwdpStoreTestingPrefetch",
                                  TESTING_PREFETCH_IN_PLACE_TARGET: "JaxDwdpStoreTestingPrefetchInPlace"})
        self.poison, self.delay_ms, self.skip_peers = poison, delay_ms, skip_peers
        self._inject = np.zeros(1, np.int64)  # read and reset by the handler; lives as long as the store
        super().__init__(*args, **kwargs)

    def inject_error(self, code: int) -> None:
        """Makes the next prefetch fail as if a CUDA call had returned `code`."""
        self.check_open()
        self._inject[0] = code

    def _faults(self) -> dict:
        return {"poison": np.int64(self.poison), "delay_ms": np.int64(self.delay_ms),
                "inject": np.int64(self._inject.ctypes.data)}

    def prefetch_attributes(self, layer: int) -> dict:
        return {**super().prefetch_attributes(layer), **self._faults()}

    def in_place_attributes(self) -> dict:
        return {**super().in_place_attributes(), **self._faults(), "skip_peers": np.int64(self.skip_peers)}


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


def connect_in_process(stores) -> None:
    """Connects ProcessExpertStores of one job that live in this process (rank r = stores[r]): every rank exports
    its blocks and every other rank imports them, as `connect` does across processes; the descriptors are closed."""
    exported = [store.export() for store in stores]
    try:
        for store in stores:
            for peer, fds in enumerate(exported):
                if peer != store.rank:
                    store.import_peer(peer, fds)
            store.connected = True
    finally:
        for fds in exported:
            for fd in fds:
                os.close(fd)

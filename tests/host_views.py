"""In-place expert stores over host memory, for CPU tests of the code that reads the CUDA store's views.

`HostViews` hands each device's view of each layer's experts as `device_view` views of 256-byte aligned host memory
it owns, as the CUDA store hands views of its composite ranges. A view is poisoned until its layer is prefetched:
NaN everywhere, its first element a NaN whose payload names the layer. `prefetch_in_place(dep, experts)` is, like
the CUDA call, given the views as operands inside the calling program and has to find the layer from them: a host
callback reads the copy of the gate_up view it is handed (the marker, or the layer's data once filled) and fills
that layer's views on every device, recording the layer in `prefetched`. So a runner that hands the call the wrong
views, or reads a layer it never prefetched, reads NaN. `wait` is the identity (the host fills before the program
goes on).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jax_dwdp.parallel.device_view import view
from jax_dwdp.parallel.dwdp_ffi import ExpertStore

QUIET_NAN = 0x7FC00000


class HostViews:
    """Subclasses give `layer_data(layer, w)`: weight w of the layer as its views show it once prefetched."""

    in_place = True

    def __init__(self, devices, num_layers: int, num_experts: int, shapes, dtype, rows: int | None = None):
        """`rows` experts in each view's memory (>= num_experts: a store's padding slots), num_experts in the view."""
        self.devices, self.num_layers, self.num_experts = list(devices), num_layers, num_experts
        self.shapes, self.dtype = tuple(tuple(s) for s in shapes), np.dtype(dtype)
        if self.dtype != np.float32:
            raise ValueError("HostViews marks its poisoned views with float32 NaN payloads")
        self.prefetched: list[int] = []
        self.closed = False
        self._owners, self._windows, self._views = [], {}, {}
        for d, device in enumerate(self.devices):
            for layer in range(num_layers):
                for w, shape in enumerate(self.shapes):
                    full = (rows or num_experts, *shape)
                    nbytes = int(np.prod(full)) * self.dtype.itemsize
                    owner = np.empty(nbytes + 256, np.uint8)
                    start = (-owner.ctypes.data) % 256
                    window = owner[start:start + nbytes].view(self.dtype).reshape(full)
                    self._owners.append(owner)
                    self._windows[d, layer, w] = window
                    self._views[d, layer, w] = view(window.ctypes.data, (num_experts, *shape), self.dtype, device)
                    self._poison(window, layer)

    @staticmethod
    def _poison(window, layer):
        window[...] = np.nan
        window.reshape(-1).view(np.uint32)[0] = QUIET_NAN | (layer + 1)

    def layer_data(self, layer: int, w: int) -> np.ndarray:
        raise NotImplementedError

    def _layer_of(self, gate_up: np.ndarray) -> int:
        first = gate_up.reshape(-1)[:1].view(np.uint32)[0]
        for layer in range(self.num_layers):
            if first == QUIET_NAN | (layer + 1) or np.array_equal(
                    gate_up, self.layer_data(layer, 0)[:self.num_experts]):
                return layer
        raise AssertionError("prefetch_in_place was given no layer's views")

    def check_open(self):
        assert not self.closed

    def prefetch_in_place(self, dep, experts):
        def fill(dep, gate_up):
            layer = self._layer_of(np.asarray(gate_up))
            self.prefetched.append(layer)
            for (d, l, w), window in self._windows.items():
                if l == layer:
                    window[...] = self.layer_data(layer, w)
            return np.zeros((1,), np.int32)
        return io_callback(fill, jax.ShapeDtypeStruct((1,), jnp.int32), dep, experts[0])

    def layer_experts(self, layer, device=None):
        return tuple(self._views[self.devices.index(device or self.devices[0]), layer, w] for w in range(2))

    sharded_layer_experts = ExpertStore.sharded_layer_experts
    rank_of = ExpertStore.rank_of

    def repoison(self):
        """Every view poisoned again (as before its first prefetch)."""
        for (d, layer, w), window in self._windows.items():
            self._poison(window, layer)

    def wait(self, experts, after):
        return experts, after

    def sync(self):
        pass

    def close(self):
        self.closed = True

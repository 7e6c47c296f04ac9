"""The runner reading experts in place (`FfiStoreSource` over a store whose `in_place` is true), on the CPU: a
stand-in store hands each layer's experts as device_view views of host memory it owns (as the CUDA store hands
views of its composite ranges), its prefetch is a custom-call-free token and its wait the identity. The runner's
logits and caches equal the layers' own experts, on one device (independent ranks) and over a 2-device 'dwdp' mesh
(each device's shard its own view)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.parallel.device_view import view
from jax_dwdp.parallel.dwdp_ffi import ExpertStore
from jax_dwdp.parallel.placement import place_model
from jax_dwdp.runner import StageRunner
from jax_dwdp.sources import FfiStoreSource, LocalSource
from tests.hf_reference import rel_err

CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=3, vocab_size=200)


class HostViewStore:
    """In place over host memory: per device and layer, the layer's full experts in a 256-byte aligned buffer this
    object owns, handed out as views; the views are poisoned (NaN) until a prefetch of their layer, so a layer that
    reads experts it did not prefetch fails."""

    in_place = True

    def __init__(self, model, devices):
        self.devices, self.num_experts = list(devices), model.cfg.num_experts
        self.closed, self.prefetched = False, []
        experts = [(np.asarray(layer.mlp.experts.gate_up_proj[...]), np.asarray(layer.mlp.experts.down_proj[...]))
                   for layer in model.layers]
        self.shapes = tuple(w.shape[1:] for w in experts[0])
        self.experts, self._owners, self._windows, self._views = experts, [], {}, {}
        for d, device in enumerate(self.devices):
            for layer, weights in enumerate(experts):
                for w, weight in enumerate(weights):
                    owner = np.empty(weight.nbytes + 256, np.uint8)
                    start = (-owner.ctypes.data) % 256
                    window = owner[start:start + weight.nbytes].view(weight.dtype).reshape(weight.shape)
                    window[...] = np.nan
                    self._owners.append(owner)
                    self._windows[d, layer, w] = window
                    self._views[d, layer, w] = view(window.ctypes.data, weight.shape, weight.dtype, device)

    def check_open(self):
        assert not self.closed

    def prefetch_in_place(self, dep, layer):
        # The CUDA store's copy runs on its copy stream; here the host fills the memory before the program runs.
        self.prefetched.append(layer)
        for (d, l, w), window in self._windows.items():
            if l == layer:
                window[...] = self.experts[layer][w]
        return jnp.zeros((1,), jnp.int32)

    def layer_experts(self, layer, device=None):
        return tuple(self._views[self.devices.index(device or self.devices[0]), layer, w] for w in range(2))

    sharded_layer_experts = ExpertStore.sharded_layer_experts
    rank_of = ExpertStore.rank_of

    def wait(self, experts, after):
        return experts

    def sync(self):
        pass


def _inputs(rng):
    tokens = rng.integers(0, CFG.vocab_size, (2, 40)).astype(np.int32)
    return tokens, np.array([40, 23], np.int32)


def test_a_runner_reads_the_views_on_one_device():
    rng = np.random.default_rng()
    model = init_model(CFG, dtype=jnp.float32, seed=int(rng.integers(1 << 30)))
    device = jax.devices()[0]
    tokens, lengths = _inputs(rng)
    want, want_cache = StageRunner(model, LocalSource(), device=device)(tokens, lengths, cache_len=40,
                                                                        mode="layerwise")
    store = HostViewStore(model, [device])
    got, cache = StageRunner(model, FfiStoreSource(store), device=device)(tokens, lengths, cache_len=40,
                                                                         mode="layerwise")
    assert store.prefetched == [0, 1, 2]
    assert rel_err(got, want) <= 1e-6 and rel_err(cache.recurrent, want_cache.recurrent) <= 1e-6


@pytest.mark.devices(2)
def test_a_runner_reads_each_devices_views_over_a_mesh():
    rng = np.random.default_rng()
    model = init_model(CFG, dtype=jnp.float32, seed=int(rng.integers(1 << 30)))
    devices = jax.devices()[:2]
    mesh = Mesh(np.array(devices), ("dwdp",))
    tokens, lengths = _inputs(rng)
    # The reference: the same mesh, every rank holding every expert (same per-rank batches, same programs' shapes).
    replicated = StageRunner(place_model(model, mesh, split_experts=False), LocalSource(), mesh=mesh)
    want, _ = replicated(tokens, lengths, cache_len=40, mode="layerwise")
    store = HostViewStore(model, devices)
    placed = place_model(model, mesh)
    got, _ = StageRunner(placed, FfiStoreSource(store, mesh), mesh=mesh)(tokens, lengths, cache_len=40,
                                                                          mode="layerwise")
    # Rank r prefills sequence r (one per rank) against the full experts of its own device's views.
    assert rel_err(np.asarray(got), np.asarray(want)) <= 1e-6
    with pytest.raises(ValueError, match="are not the store's ranks"):
        store.sharded_layer_experts(0, Mesh(np.array(devices[::-1]), ("dwdp",)))

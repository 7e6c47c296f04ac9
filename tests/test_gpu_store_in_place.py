"""The DWDP expert store read in place, on ONE GPU (skipped without one; JAX_DWDP_TEST_GPU=1 on a GPU machine).

Two ranks of one store live in this process on the same device (ProcessExpertStores connected in process: their
blocks traded as POSIX descriptors exactly as between processes; a "peer" copy is then HBM to HBM):
- read-after-write: every prefetch fills the peers' slots with NaN first and holds its copy stream 40 ms; the
  experts the MoE gets after the wait are every rank's, exactly, and the rank's own block (mapped, never copied)
  is untouched;
- a StageRunner over each rank's store equals the same runner with the layers' own experts (fp32), twice in a row;
- write-after-read: a program still reading layer 0's slots while layer 2's prefetch (same slot set) poisons and
  refills them sees layer 0's experts to its end;
- a prefetch into a slot set whose layer is not yet waited for is refused (the depth-2 hazard), and three slot sets
  allow depth 2;
- each store's device memory is the plan's (its blocks plus, in place, two layers of the peers' slots) within 5%;
- every CUDA object is released at the end.
Poison and delays come from tests/store_testing.py (the test-only handler library).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.parallel.expert_layout import ExpertLayout, rank_memory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)"),
]

# fp32 experts whose rank blocks are 2 MiB multiples: 4 experts per rank x gate_up 512 x 512 x 4 B = 4 MiB, down
# 512 x 256 x 4 B x 4 = 2 MiB.
CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=4, vocab_size=300, hidden_size=512,
                                         moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2)


def _experts(model, layer):
    mlp = model.layers[layer].mlp.experts
    return np.asarray(mlp.gate_up_proj[...]), np.asarray(mlp.down_proj[...])


def _stores(model, cfg, **options):
    """Ranks 0 and 1 of one in-place store on device 0, filled with the model's experts and connected."""
    from jax_dwdp.parallel.dwdp_ffi import ProcessExpertStore
    from tests.store_testing import FaultyProcessExpertStore, connect_in_process

    dev = jax.devices()[0]
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    faulty = any(k in options for k in ("poison", "delay_ms", "skip_peers"))
    kind = FaultyProcessExpertStore if faulty else ProcessExpertStore
    stores = [kind(dev, r, 2, cfg.num_hidden_layers, cfg.num_experts, ((2 * i, h), (h, i)), jnp.float32, **options)
              for r in range(2)]
    s = stores[0].layout.slots_per_rank
    for layer in range(cfg.num_hidden_layers):
        for w, weight in enumerate(_experts(model, layer)):
            for r, store in enumerate(stores):
                store.fill(layer, w, r, jax.device_put(weight[r * s:(r + 1) * s], dev))
    connect_in_process(stores)
    assert all(store.in_place and store.info()["mode"] == "in_place" for store in stores), stores[0].info()
    return stores


def _close(stores):
    from jax_dwdp.parallel.dwdp_ffi import live_objects

    for store in stores:
        store.close()
    assert all(v == 0 for v in live_objects().values()), live_objects()


def _prefetch(store, layer, dep):
    """Layer `layer`'s prefetch: the call finds the layer from the views it is given (one program for all)."""
    return _prefetch_program(store)(dep, store.layer_experts(layer))


def _prefetch_program(store):
    if not hasattr(store, "_test_prefetch"):
        store._test_prefetch = jax.jit(store.prefetch_in_place)
    return store._test_prefetch


def _waited(store, layer, dep):
    """Layer `layer`'s experts after the store's wait (the program returns the `after` the wait hands back too: that
    output keeps the wait in it)."""
    gate_up, down = store.layer_experts(layer)
    return jax.jit(lambda g, d, x: store.wait((g, d), x))(gate_up, down, dep)[0]


def test_the_views_hold_every_ranks_experts_after_the_wait():
    model = init_model(CFG, dtype=jnp.float32, seed=int(np.random.default_rng().integers(1 << 30)))
    stores = _stores(model, CFG, poison=True, delay_ms=40)
    dep = jnp.ones(4)
    try:
        for store in stores:
            for layer in range(CFG.num_hidden_layers):
                _prefetch(store, layer, dep)
                got = _waited(store, layer, dep)
                for w, want in enumerate(_experts(model, layer)):
                    g = np.asarray(got[w])
                    assert np.isfinite(g).all(), (store.rank, layer, w, "read before the copy ended")
                    assert np.array_equal(g, want), (store.rank, layer, w)
    finally:
        _close(stores)


def test_a_runner_in_place_equals_the_layers_own_experts():
    from jax_dwdp.runner import StageRunner
    from jax_dwdp.sources import FfiStoreSource, LocalSource
    from tests.hf_reference import rel_err

    rng = np.random.default_rng()
    model = init_model(CFG, dtype=jnp.float32, seed=int(rng.integers(1 << 30)))
    dev = jax.devices()[0]
    tokens = rng.integers(0, CFG.vocab_size, (2, 80)).astype(np.int32)
    lengths = np.array([80, 53], np.int32)
    local = StageRunner(model, LocalSource(), device=dev)
    want, want_cache = local(tokens, lengths, cache_len=80, mode="layerwise")
    stores = _stores(model, CFG, poison=True, delay_ms=20)
    try:
        for store in stores:
            runner = StageRunner(model, FfiStoreSource(store), device=dev)
            for call in range(2):  # the second reuses the views, the slots and the compiled programs
                got, cache = runner(tokens, lengths, cache_len=80, mode="layerwise")
                errors = {"logits": rel_err(got, want), "key": rel_err(cache.key, want_cache.key),
                          "recurrent": rel_err(cache.recurrent, want_cache.recurrent)}
                print(f"rank {store.rank} call {call}: in place vs own experts {errors}")
                assert np.isfinite(np.asarray(got)).all() and max(errors.values()) <= 1e-6, errors
    finally:
        _close(stores)


def test_a_slot_is_not_refilled_while_its_layer_still_reads_it():
    """Layers 0 and 2 share slot set 0. A long program reads layer 0's views; layer 2's prefetch, enqueued while it
    runs, poisons and refills set 0 on the copy stream. The write-after-read guard (the copy stream waits for
    everything XLA enqueued before the prefetch) keeps the poison and layer 2's experts out until the reader ends."""
    model = init_model(CFG, dtype=jnp.float32, seed=11)
    stores = _stores(model, CFG, poison=True)
    store, dep = stores[0], jnp.ones(4)

    def read_long(g, d, x):
        (g, d), x = store.wait((g, d), x)
        def body(_, acc):  # every iteration reads the whole of both weights
            return jnp.tanh(acc * 0.5 + g[:, :256, :256] + d[:, :256, :].sum(-1, keepdims=True))
        return jax.lax.fori_loop(0, 3000, body, jnp.zeros((8, 256, 256), jnp.float32)), x  # x keeps the wait

    try:
        gate_up0, down0 = _experts(model, 0)
        want = jax.jit(lambda g, d: jax.lax.fori_loop(
            0, 3000, lambda _, acc: jnp.tanh(acc * 0.5 + g[:, :256, :256] + d[:, :256, :].sum(-1, keepdims=True)),
            jnp.zeros((8, 256, 256), jnp.float32)))(gate_up0, down0)
        reader = jax.jit(read_long)
        for _ in range(2):
            _prefetch(store, 0, dep)
            got, _ = reader(*store.layer_experts(0), dep)  # enqueued, still running
            _prefetch(store, 2, dep)  # same slot set: poisons it, then copies layer 2's peer block
            got = np.asarray(got)
            assert np.isfinite(got).all(), "layer 2's prefetch overwrote slots layer 0 was still reading"
            assert np.allclose(got, np.asarray(want), rtol=1e-6, atol=1e-6)
            layer2 = _waited(store, 2, dep)
            assert np.array_equal(np.asarray(layer2[0]), _experts(model, 2)[0])
    finally:
        _close(stores)


def test_a_prefetch_into_a_set_not_yet_read_is_refused():
    from jax_dwdp.parallel.dwdp_ffi import ProcessExpertStore
    from tests.store_testing import connect_in_process

    model = init_model(CFG, dtype=jnp.float32, seed=5)
    stores = _stores(model, CFG)
    dep = jnp.ones(4)
    try:
        store = stores[0]
        _prefetch(store, 0, dep)
        _prefetch(store, 1, dep)  # the other set: fine
        with pytest.raises(Exception, match=r"layer 0's experts, in the same slot set \(0 of 2\), are prefetched "
                                            r"and not yet waited for"):
            jax.block_until_ready(_prefetch(store, 2, dep))
        store.sync()  # forgets the unwaited prefetches (their copies finished)
        _prefetch(store, 2, dep)
        assert np.array_equal(np.asarray(_waited(store, 2, dep)[1]), _experts(model, 2)[1])
        # A target that is no view of this store on this device (an XLA array; the other rank's store's view):
        # refused by name, nothing copied.
        fresh = jnp.zeros_like(store.layer_experts(0)[0]), jnp.zeros_like(store.layer_experts(0)[1])
        for target in (fresh, stores[1].layer_experts(1)):
            with pytest.raises(Exception, match="its target is not a layer's gate_up view of the store on device"):
                jax.block_until_ready(_prefetch_program(store)(dep, target))
    finally:
        _close(stores)
    # Depth 2 (three layers in flight) needs three slot sets.
    dev = jax.devices()[0]
    h, i = CFG.hidden_size, CFG.moe_intermediate_size
    stores = [ProcessExpertStore(dev, r, 2, 4, 8, ((2 * i, h), (h, i)), jnp.float32, slot_sets=3) for r in range(2)]
    try:
        connect_in_process(stores)
        for layer in range(3):
            _prefetch(stores[0], layer, dep)
        with pytest.raises(Exception, match=r"layer 0's experts, in the same slot set \(0 of 3\)"):
            jax.block_until_ready(_prefetch(stores[0], 3, dep))
        stores[0].sync()
    finally:
        _close(stores)


@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "copy out"])
def test_each_stores_device_memory_is_the_plans(in_place):
    """35b-a3b expert shapes (bf16), 2 layers, two ranks on one GPU: the driver's free memory drops by each rank's
    blocks plus, in place, two layers of the peers' slots (plan: resident_expert_bytes + store_slot_bytes), within
    5%. Copying out, the store holds only the blocks (the prefetch buffers are XLA's, per call)."""
    from jax_dwdp.parallel.dwdp_ffi import ProcessExpertStore, device_memory

    cfg = ModelConfig.preset("35b-a3b")
    dev = jax.devices()[0]
    h, i, layers = cfg.hidden_size, cfg.moe_intermediate_size, 2
    plan = rank_memory(cfg, ExpertLayout(cfg.num_experts, 2), 0, layers, 2)
    expected = plan["resident_expert_bytes"] + (plan["store_slot_bytes"] if in_place else 0)
    stores = []
    try:
        for r in range(2):
            free_before, _ = device_memory(dev)
            stores.append(ProcessExpertStore(dev, r, 2, layers, cfg.num_experts, ((2 * i, h), (h, i)),
                                             jnp.bfloat16, in_place=in_place))
            used = free_before - device_memory(dev)[0]
            print(f"rank {r} {'in place' if in_place else 'copy out'}: store {used / 2**30:.3f} GiB, plan "
                  f"{expected / 2**30:.3f} GiB")
            assert stores[-1].in_place == in_place
            assert abs(used - expected) <= 0.05 * expected, (used, expected)
            assert stores[-1].slot_bytes() == (plan["store_slot_bytes"] if in_place else 0)
    finally:
        _close(stores)

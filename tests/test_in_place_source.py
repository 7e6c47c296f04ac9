"""The runner reading experts in place (`FfiStoreSource` over a store whose `in_place` is true), on the CPU: a
stand-in store (tests/host_views.py) hands each layer's experts as device_view views of host memory it owns (as the
CUDA store hands views of its composite ranges), poisoned until a prefetch given those views as operands fills
them (a host callback), and its wait is the identity. The runner's
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
from jax_dwdp.parallel.placement import place_model
from jax_dwdp.runner import StageRunner
from jax_dwdp.sources import FfiStoreSource, LocalSource
from tests.hf_reference import rel_err
from tests.host_views import HostViews

CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=3, vocab_size=200)


class HostViewStore(HostViews):
    """In place over host memory (tests/host_views.py): per device and layer, the layer's full experts."""

    def __init__(self, model, devices):
        self.experts = [(np.asarray(layer.mlp.experts.gate_up_proj[...]), np.asarray(layer.mlp.experts.down_proj[...]))
                        for layer in model.layers]
        super().__init__(devices, len(self.experts), model.cfg.num_experts, [w.shape[1:] for w in self.experts[0]],
                         self.experts[0][0].dtype)

    def layer_data(self, layer, w):
        return self.experts[layer][w]


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
    source = FfiStoreSource(store)
    runner = StageRunner(model, source, device=device)
    for run in range(2):  # the second run: every view poisoned again, the same compiled programs
        got, cache = jax.block_until_ready(runner(tokens, lengths, cache_len=40, mode="layerwise"))
        assert store.prefetched == [0, 1, 2] * (run + 1)  # (the callbacks ran inside the programs just waited for)
        assert rel_err(got, want) <= 1e-6 and rel_err(cache.recurrent, want_cache.recurrent) <= 1e-6
        store.repoison()
    # Layer l+1's prefetch ran inside layer l's program (the one layer program serves all three layers): the only
    # program of the source's own is the first layer's prefetch.
    assert list(source._programs) == ["in_place"]


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
    assert sorted(store.prefetched) == [0, 0, 1, 1, 2, 2]  # each layer once per device
    with pytest.raises(ValueError, match="are not the store's ranks"):
        store.sharded_layer_experts(0, Mesh(np.array(devices[::-1]), ("dwdp",)))


@pytest.mark.parametrize("family", ["qwen35_moe", "nemotron_h"])
def test_the_moe_reads_awaited_experts_only_through_their_wait(family):
    """AwaitedExperts (the FFI store's experts): the MoE reads what `wait` returns, not the arrays it was handed
    (here NaN-poisoned, as slots a copy has not yet written), and calls it once, with its first grouped matmul's
    input (the dispatched rows [M*k + pad, H]), not the MoE's input; and that matmul reads the input the wait hands
    back (the data that keeps the store's wait in the program): a wait handing back other rows changes the output."""
    from jax_dwdp.model.moe import AwaitedExperts
    from jax_dwdp.nemotron_h_config import NemotronHConfig

    cfg = CFG if family == "qwen35_moe" else NemotronHConfig.preset("tiny")
    model = init_model(cfg, dtype=jnp.float32, seed=3)
    blocks = [getattr(layer, "mlp", None) or getattr(layer, "mixer", None) for layer in model.layers]
    moe = next(block for block in blocks if hasattr(block, "experts"))
    experts = moe.experts
    own = (experts.gate_up_proj[...], experts.down_proj[...]) if family == "qwen35_moe" else (
        experts.up_proj[...], experts.down_proj[...])
    poisoned = tuple(jnp.full_like(w, jnp.nan) for w in own)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 37, cfg.hidden_size)), jnp.float32)
    seen = []

    def wait(weights, after):
        seen.append(after.shape)
        assert all(bool(jnp.isnan(w).all()) for w in weights)  # handed the arrays the copy writes
        return own, after

    got = moe(x, AwaitedExperts(poisoned, wait))
    want = moe(x, own)
    err = rel_err(got, want)
    moved = rel_err(moe(x, AwaitedExperts(poisoned, lambda w, after: (own, jnp.roll(after, 1, axis=0)))), want)
    print(f"{family}: awaited vs own experts {err:.1e}; wait's `after` {seen}; "
          f"with rows handed back rolled {moved:.1e}")
    assert np.isfinite(np.asarray(got)).all() and err == 0.0 and moved > 1e-3
    k = cfg.num_experts_per_tok
    rows = 2 * 37 * k
    assert len(seen) == 1 and seen[0][0] >= rows and seen[0][0] % 8 == 0 and seen[0][0] - rows < 8


@pytest.mark.parametrize("family", ["qwen35_moe", "nemotron_h"])
def test_the_store_wait_in_a_moe_is_data_not_an_effect(family):
    """ExpertStore.wait inside a MoE: one dwdp_wait custom call, no JAX effect on the program (an effect would send
    every call of the layer programs through JAX's Python dispatch path), its output aliasing `after`, and that
    output used (the barrier's copy of it feeds the grouped matmul), so XLA keeps and orders the call by data.
    Compiled for the CPU (the call cannot run without a GPU; its handler is looked up at code generation)."""
    import types

    from jax_dwdp.model.moe import AwaitedExperts
    from jax_dwdp.nemotron_h_config import NemotronHConfig
    from jax_dwdp.parallel.dwdp_ffi import WAIT_TARGET, ExpertStore

    cfg = CFG if family == "qwen35_moe" else NemotronHConfig.preset("tiny")
    model = init_model(cfg, dtype=jnp.float32, seed=3)
    blocks = [getattr(layer, "mlp", None) or getattr(layer, "mixer", None) for layer in model.layers]
    moe = next(block for block in blocks if hasattr(block, "experts"))
    own = (moe.experts.gate_up_proj[...], moe.experts.down_proj[...]) if family == "qwen35_moe" else (
        moe.experts.up_proj[...], moe.experts.down_proj[...])
    ints = np.array([0], np.int64)
    store = types.SimpleNamespace(check_open=lambda: None, vmm=types.SimpleNamespace(wait_attributes=lambda: dict(
        store=np.int64(1), table=np.int64(1), ordinals=ints, contexts=ints, done=ints)))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((1, 19, cfg.hidden_size)), jnp.float32)
    def forward(x):
        return moe(x, AwaitedExperts(own, lambda w, after: ExpertStore.wait(store, w, after)))

    closed = jax.make_jaxpr(forward)(x)
    assert not closed.effects, closed.effects
    eqns = [e for e in closed.jaxpr.eqns if e.primitive.name == "ffi_call"]
    assert len(eqns) == 1 and eqns[0].params["target_name"] == WAIT_TARGET
    call = eqns[0]
    assert not call.params["has_side_effect"] and tuple(call.params["input_output_aliases"]) == ((2, 0),)
    barrier = next(e for e in closed.jaxpr.eqns if call.outvars[0] in e.invars)
    assert barrier.primitive.name == "optimization_barrier"
    waited = barrier.outvars[list(barrier.invars).index(call.outvars[0])]
    users = [e.primitive.name for e in closed.jaxpr.eqns if waited in e.invars]
    print(f"{family}: the waited input feeds {users}")
    assert users, "the wait's output is not used: XLA would drop the wait"
    hlo = jax.jit(forward).lower(x).as_text()
    assert hlo.count(WAIT_TARGET) == 1 and "has_side_effect = true" not in hlo and "output_operand_aliases" in hlo
    # Through XLA's optimizations (CPU's pipeline: DCE, the barrier's removal): the call survives to code
    # generation, where the CPU finds no handler for it; a caller that drops the `after` the wait hands back loses
    # the call entirely (so the data, not an effect, is what keeps it).
    with pytest.raises(Exception, match=f"No FFI handler registered for {WAIT_TARGET}"):
        jax.jit(forward).lower(x).compile()

    def dropping(x):
        def wait(weights, after):
            return ExpertStore.wait(store, weights, after)[0], after
        return moe(x, AwaitedExperts(own, wait))

    assert WAIT_TARGET not in jax.jit(dropping).lower(x).compile().as_text()

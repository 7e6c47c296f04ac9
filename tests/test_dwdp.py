"""DWDP over XLA on CPU devices: expert layout, sharded storage, equality with one device, independent ranks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import Cache, init_model
from jax_dwdp.parallel import Pipeline
from jax_dwdp.parallel.dwdp import IndependentRanks
from jax_dwdp.parallel.expert_layout import ExpertLayout, rank_memory
from jax_dwdp.prefill import jit_prefill
from tests.hf_reference import rel_err

# 6 experts: 4 ranks do not divide them (2 slots each, the last rank holds 2 padding slots).
CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=6, vocab_size=90, num_experts=6, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def setup():
    model = init_model(CFG, dtype=jnp.float32, seed=21)
    rng = np.random.default_rng(99)
    tokens = rng.integers(0, CFG.vocab_size, (8, 70)).astype(np.int32)
    lengths = np.array([70, 33, 70, 5, 64, 70, 1, 48], np.int32)
    logits, cache = jit_prefill(model, cache_len=70)(tokens, lengths)
    return model, tokens, lengths, logits, cache


def test_expert_layout():
    even = ExpertLayout(8, 4)
    assert [list(even.owned(r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    odd = ExpertLayout(6, 4)
    assert odd.slots_per_rank == 2 and odd.padded_experts == 8
    assert [list(odd.owned(r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], []]
    assert [odd.padding_slots(r) for r in range(4)] == [0, 0, 0, 2]
    assert sorted(e for r in range(4) for e in odd.owned(r)) == list(range(6))  # every expert owned once
    assert all(odd.owner(e) == r for r in range(4) for e in odd.owned(r))
    with pytest.raises(ValueError, match="would own none"):
        ExpertLayout(3, 4)
    big = ModelConfig.preset("35b-a3b")
    per_expert = 3 * 2048 * 512 * 2  # gate_up + down of one 35B-A3B expert, bf16
    for ranks in (2, 4, 8):
        # In place (its 4 / 2 MiB experts make every block a 2 MiB multiple): slots for two layers of the peers'
        # blocks, no XLA buffer, and only the peers' experts move.
        mem = rank_memory(big, ExpertLayout(256, ranks), 0, 40, 2)
        assert mem["store_mode"] == "in_place" and mem["prefetch_buffer_bytes"] == 0
        assert mem["store_slot_bytes"] == 2 * (ranks - 1) * (256 // ranks) * per_expert
        assert mem["peer_bytes_per_layer"] == (256 - 256 // ranks) * per_expert
        assert mem["local_copy_bytes_per_layer"] == 0
    assert [rank_memory(big, ExpertLayout(256, n), 0, 40, 2)["store_slot_bytes"] / 2**30 for n in (2, 4, 8)] == [
        1.5, 2.25, 2.625]
    odd_mem = rank_memory(CFG, odd, 3, 6, 4)
    assert odd_mem["resident_expert_bytes"] == 6 * 2 * 3 * CFG.hidden_size * CFG.moe_intermediate_size * 4
    # The tiny model's blocks are far below the granularity: copied out, the own block too.
    assert odd_mem["store_mode"] == "copy" and odd_mem["store_slot_bytes"] == 0
    assert odd_mem["prefetch_buffer_bytes"] == 2 * 6 * 3 * CFG.hidden_size * CFG.moe_intermediate_size * 4
    assert odd_mem["local_copy_bytes_per_layer"] == 0  # rank 3 of (6, 4) owns no expert
    assert odd_mem["xla_gather_buffer_bytes"] > odd_mem["prefetch_buffer_bytes"]  # the gather moves padding too


@pytest.mark.parametrize("pipeline,dwdp,microbatches", [
    pytest.param(*case, marks=pytest.mark.devices(case[0] * case[1]))  # pipeline stages x DWDP ranks
    for case in [(1, 2, 1), (1, 4, 1), (2, 2, 1), (2, 2, 2), (2, 4, 1)]])
def test_dwdp_equals_one_device(setup, pipeline, dwdp, microbatches):
    """Against one device running the same per-rank batches: 1e-5; against the unsplit batch: 1e-4 (batch shape
    changes fp32 summation order only)."""
    model, tokens, lengths, ref_logits, ref_cache = setup
    pipe = Pipeline.from_model(model, pipeline, dwdp=dwdp)
    logits, caches = pipe.prefill(tokens, lengths, microbatches=microbatches, cache_len=70)
    merged = Cache.concat_layers(caches, jax.devices()[0])
    same_split, split_caches = Pipeline.from_model(model, 1).prefill(tokens, lengths, cache_len=70,
                                                                     microbatches=microbatches * dwdp)
    for name, got, want_split, want in [
        ("logits", logits, same_split, ref_logits),
        *[(f, getattr(merged, f), getattr(split_caches[0], f), getattr(ref_cache, f))
          for f in ("key", "value", "conv", "recurrent")],
    ]:
        e1, e2 = rel_err(got, want_split), rel_err(got, want)
        print(f"P={pipeline} N={dwdp} M={microbatches} {name}: vs same split {e1:.1e}, vs unsplit {e2:.1e}")
        assert e1 <= 1e-5 and e2 <= 1e-4, name


@pytest.mark.devices(4)
def test_each_rank_stores_only_its_expert_block(setup):
    model, *_ = setup
    pipe = Pipeline.from_model(model, 1, dwdp=4)
    layer = pipe.models[0].layers[2]
    gate_up = layer.mlp.experts.gate_up_proj[...]
    assert gate_up.shape[0] == 8  # padded to 4 ranks x 2 slots
    source = np.asarray(model.layers[2].mlp.experts.gate_up_proj[...])
    for shard in gate_up.addressable_shards:
        rank = pipe.row_meshes[0].devices.tolist().index(shard.device)
        block = np.asarray(shard.data)
        assert block.shape[0] == 2
        owned = ExpertLayout(6, 4).owned(rank)
        np.testing.assert_array_equal(block[: len(owned)], source[owned.start:owned.stop])
        assert not block[len(owned):].any()  # padding slots are zeros
    # Non-expert weights are replicated on every rank.
    assert len(layer.mlp.gate.weight[...].addressable_shards) == 4


@pytest.mark.devices(2)
def test_eager_layer_inputs_live_on_the_ranks_device(setup):
    """Driven eagerly on device 1, the layers get no positions from the host when the tokens start their sequences
    (each attention layer makes 0..T-1 inside its program) and, continuing a cache, positions on device 1, not an op
    queued on the default device 0 (on GPUs that op waits for all of device 0's work, so independent ranks ran one
    after the other)."""
    model, tokens, lengths, *_ = setup
    dev = jax.devices()[1]
    h = jax.device_put(jnp.ones((2, 9, CFG.hidden_size), jnp.float32), dev)
    seen = []

    def run_layer(index, layer, h, positions, lens, layer_cache):
        seen.append(positions)
        return layer(h, positions, lens, None, layer_cache)

    lens = jax.device_put(np.array([9, 4], np.int32), dev)
    out, cache = model.forward_layers(h, lens, run_layer=run_layer, cache_len=18)
    assert len(seen) == CFG.num_hidden_layers and all(p is None for p in seen), seen
    assert out.devices() == {dev} and cache.key.devices() == cache.recurrent.devices() == {dev}
    seen.clear()
    out, cache = model.forward_layers(h, lens, run_layer=run_layer, cache=cache)
    assert len(seen) == CFG.num_hidden_layers
    for p in seen:
        assert isinstance(p, jax.Array) and p.devices() == {dev}, p
        np.testing.assert_array_equal(np.asarray(p), np.array([9, 4])[:, None] + np.arange(9))
    assert out.devices() == {dev} and cache.key.devices() == cache.recurrent.devices() == {dev}
    # Sharded over a mesh (a DWDP StageRunner): positions come with h's batch sharding.
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()[:2]), ("dwdp",))
    sharded_h = jax.device_put(jnp.ones((2, 9, CFG.hidden_size), jnp.float32), NamedSharding(mesh, PartitionSpec("dwdp")))
    from jax_dwdp.model.qwen35_moe import _positions

    p = _positions(sharded_h, 2, 9)
    assert isinstance(p, jax.Array) and p.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("dwdp")), 2)
    np.testing.assert_array_equal(np.asarray(p), np.broadcast_to(np.arange(9), (2, 9)))
    # A range without full-attention layers: its empty key/value leaves are made on the same device.
    from jax_dwdp.model import init_model as init

    linear_only = [i for i, t in enumerate(CFG.layer_types) if t == "linear_attention"][:2]
    assert linear_only == [0, 1], CFG.layer_types
    part = init(CFG, dtype=jnp.float32, seed=3, start_layer=0, end_layer=2, device=dev)
    _, part_cache = part.forward_layers(h, jax.device_put(np.array([9, 4], np.int32), dev))
    assert part_cache.key.shape[0] == 0
    assert all(a.devices() == {dev} for a in jax.tree.leaves(part_cache)), "cache leaves off the layers' device"


@pytest.mark.devices(2)
def test_independent_ranks_run_their_own_batches_and_lengths(setup):
    """Rank 0 prefills 3 sequences of 70 tokens while rank 1 prefills one of 41: each equals one device."""
    model, tokens, lengths, *_ = setup
    ranks = IndependentRanks(model, jax.devices()[:2])
    work = {0: (tokens[:3], lengths[:3]), 1: (tokens[3:4, :41], None)}
    outs = {r: ranks.prefill(r, t, n, cache_len=72) for r, (t, n) in work.items()}  # both enqueued first
    for r, (t, n) in work.items():
        logits, cache = outs[r]
        assert logits.devices() == {jax.devices()[r]}
        assert all(a.devices() == {jax.devices()[r]} for a in jax.tree.leaves(cache)), "cache off the rank's device"
        want_logits, want_cache = jit_prefill(model, cache_len=72)(t, n)
        errs = {"logits": rel_err(logits, want_logits), "recurrent": rel_err(cache.recurrent, want_cache.recurrent),
                "key": rel_err(cache.key, want_cache.key)}
        print(f"independent rank {r}: " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()))
        assert all(v <= 1e-5 for v in errs.values()), errs
    # prefill_all: the same work, each rank dispatched from its own thread, same numbers.
    both = ranks.prefill_all(work, cache_len=72)
    for r in work:
        np.testing.assert_array_equal(np.asarray(both[r][0]), np.asarray(outs[r][0]))
        assert both[r][0].devices() == {jax.devices()[r]}
    with pytest.raises(ValueError, match="rank 5 is not one of"):
        ranks.prefill_all({5: work[0]})
    # Each rank keeps only its own expert blocks resident.
    for layer in ranks.source.blocks:
        for r, (gate_up, down) in enumerate(layer):
            assert gate_up.shape[0] == down.shape[0] == 3 and gate_up.devices() == {jax.devices()[r]}
    # ... and its runner holds no expert weights of its own, only placeholders.
    for r, runner in enumerate(ranks.runners):
        experts = runner.stage.layers[0].mlp.experts
        assert experts.gate_up_proj[...].shape == () and experts.gate_up_proj[...].devices() == {jax.devices()[r]}


@pytest.mark.parametrize("pipeline,dwdp", [pytest.param(*case, marks=pytest.mark.devices(case[0] * case[1]))
                                           for case in [(1, 2), (1, 4), (2, 2)]])
def test_layerwise_dwdp_equals_whole_program(setup, pipeline, dwdp):
    """Layer-wise DWDP (XlaGatherSource experts: one program per layer type, the next layer's gather inside each) against the
    whole-stage program and against one device on the same per-rank batches (the FFI path's structure)."""
    model, tokens, lengths, *_ = setup
    pipe = Pipeline.from_model(model, pipeline, dwdp=dwdp)
    whole, whole_caches = pipe.prefill(tokens, lengths, cache_len=70)
    layerwise, layer_caches = pipe.prefill(tokens, lengths, cache_len=70, layerwise=True)
    one, one_caches = Pipeline.from_model(model, 1).prefill(tokens, lengths, cache_len=70, microbatches=dwdp)
    got = Cache.concat_layers(layer_caches, jax.devices()[0])
    for name, a, b, c in [("logits", layerwise, whole, one),
                          *[(f, getattr(got, f), getattr(Cache.concat_layers(whole_caches, jax.devices()[0]), f),
                             getattr(one_caches[0], f)) for f in ("key", "value", "conv", "recurrent", "lengths")]]:
        e1, e2 = rel_err(a, b), rel_err(a, c)
        print(f"P={pipeline} N={dwdp} {name}: layer-wise vs whole {e1:.1e}, vs one device {e2:.1e}")
        assert e1 <= 1e-5 and e2 <= 1e-5, name


@pytest.mark.devices(2)
def test_ffi_backend_without_gpu_is_a_clear_error(setup):
    from jax_dwdp.parallel.dwdp_ffi import FfiUnavailable

    model, tokens, lengths, *_ = setup
    with pytest.raises(FfiUnavailable, match="needs CUDA GPUs; these devices are \\['cpu'\\]"):
        Pipeline.from_model(model, 1, dwdp=2, experts="ffi")
    with pytest.raises(ValueError, match="needs DWDP ranks > 1"):
        Pipeline.from_model(model, 1, experts="ffi")
    with pytest.raises(FfiUnavailable, match="needs CUDA GPUs"):
        IndependentRanks(model, jax.devices()[:2], experts="ffi")


@pytest.mark.devices(2)
def test_prefill_all_threads_map_results_and_errors(setup, monkeypatch):
    """The threaded branch of prefill_all with each rank's prefill stubbed (to fail one rank on purpose): results
    come back per rank, inputs are checked before any rank starts, a failing rank's error is
    raised after the others finish, and the expert source (the FFI store) is aborted once, not by the failing rank
    itself."""
    import threading
    import time

    model, tokens, lengths, *_ = setup
    ranks = IndependentRanks(model, jax.devices()[:2])
    seen, finished = [], []

    def fake(rank, t, n, logits, cache_len, *, sync_on_error):
        seen.append((rank, threading.current_thread().name, t.shape, sync_on_error))
        if rank == 0 and t.shape[0] == 3:
            raise RuntimeError("rank 0 failed")
        time.sleep(0.05)
        finished.append(rank)
        return f"logits {rank}", f"cache {rank}"

    monkeypatch.setattr(ranks, "_prefill", fake)
    out = ranks.prefill_all({0: (tokens[:2], None), 1: (tokens[2:3, :30], None)}, threads=True)
    assert out == {0: ("logits 0", "cache 0"), 1: ("logits 1", "cache 1")}
    assert all(name.startswith("dwdp-rank") and not sync for _, name, _, sync in seen)

    class Source:
        aborts = 0

        def abort(self):
            Source.aborts += 1
    ranks.source, seen[:], finished[:] = Source(), [], []
    with pytest.raises(RuntimeError, match="rank 0 failed"):
        ranks.prefill_all({0: (tokens[:3], None), 1: (tokens[3:4], None)}, threads=True)
    assert finished == [1] and Source.aborts == 1  # rank 1 ran to the end, then one drain
    seen[:] = []
    with pytest.raises(ValueError, match="cache_len 40 is shorter than rank 1's prompt"):
        ranks.prefill_all({0: (tokens[:2, :30], None), 1: (tokens[2:3], None)}, cache_len=40, threads=True)
    with pytest.raises(ValueError, match="rank 5 is not one of"):
        ranks.prefill_all({0: (tokens[:2], None), 5: (tokens[:1], None)}, threads=True)
    assert not seen  # nothing started


def test_stage_runner_shares_its_programs_across_logits_modes_and_cache_lengths(setup):
    """A DWDP stage runner compiles its layer programs once: other logits modes and cache lengths reuse them (the
    head compiles per mode), with the same numbers as the one-device prefill."""
    from jax.sharding import Mesh

    from jax_dwdp.parallel.placement import expert_blocks, place_model
    from jax_dwdp.sources import XlaGatherSource
    from jax_dwdp.runner import StageRunner

    model, tokens, lengths, ref_logits, _ = setup
    mesh = Mesh(np.array(jax.devices()[:2]), ("dwdp",))
    placed = place_model(model, mesh)
    runner = StageRunner(placed, XlaGatherSource(expert_blocks(placed), mesh), mesh=mesh)
    runner(tokens, lengths, logits="all", cache_len=70, mode="layerwise")
    layer_programs = {k: v for k, v in runner._programs.items() if k[0] == "layer"}
    compiled = {k: v._cache_size() for k, v in layer_programs.items()}
    assert set(compiled) == {("layer", "linear_attention"), ("layer", "full_attention")}
    for logits, cache_len in [("last", None), ("none", 90), ("all", 70)]:
        out, cache = runner(tokens, lengths, logits=logits, cache_len=cache_len, mode="layerwise")
        assert cache.capacity == (cache_len or tokens.shape[1])
        if logits == "all":
            err = rel_err(out, ref_logits)
            print(f"runner logits vs one device {err:.1e}")
            assert err <= 1e-4
    assert {k: runner._programs[k]._cache_size() for k in compiled} == compiled
    assert {k for k in runner._programs if k[0] == "head"} == {("head", "all"), ("head", "last")}


@pytest.mark.devices(2)
def test_replicated_baseline_and_bad_expert_choices(setup):
    """experts="local" over DWDP ranks: every rank holds all experts (the baseline), same numbers; a backend that
    does not exist or cannot run is one clear error at construction."""
    model, tokens, lengths, *_ = setup
    pipe = Pipeline.from_model(model, 1, dwdp=2, experts="local")
    gate_up = pipe.models[0].layers[0].mlp.experts.gate_up_proj[...]
    assert all(s.data.shape[0] == CFG.num_experts for s in gate_up.addressable_shards)  # all experts everywhere
    got, _ = pipe.prefill(tokens, lengths, layerwise=True)
    want, _ = Pipeline.from_model(model, 1).prefill(tokens, lengths, microbatches=2)
    err = rel_err(got, want)
    print(f"replicated baseline vs one device (same per-rank batches) {err:.1e}")
    assert err <= 1e-5
    with pytest.raises(ValueError, match="experts 'nccl': choose one of local, xla, ffi"):
        Pipeline.from_model(model, 1, dwdp=2, experts="nccl")
    with pytest.raises(ValueError, match="experts 'xla' \\(DWDP\\) needs DWDP ranks > 1"):
        Pipeline.from_model(model, 1, experts="xla")

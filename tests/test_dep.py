"""DEP (experts="dep": tokens travel to the ranks holding their experts), any batch over any number of ranks, and
what a rank keeps in memory, on CPU devices. fp32 against one device: <= 1e-5 (printed)."""

from __future__ import annotations

import gc
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import Cache, init_model
from jax_dwdp.model.moe import routed_experts
from jax_dwdp.parallel import Pipeline
from jax_dwdp.parallel.dwdp import IndependentRanks
from jax_dwdp.parallel.placement import expert_blocks, place_model
from jax_dwdp.parallel.expert_layout import ExpertLayout
from jax_dwdp.sources import AXIS, DispatchedExperts, DepDispatchSource
from jax_dwdp.runner import StageRunner
from jax_dwdp.prefill import jit_prefill
from tests.hf_reference import rel_err

# 6 experts: 4 ranks hold 2 slots each, the last rank only padding; 4 layers: 3 linear + 1 full attention.
CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=4, vocab_size=90, num_experts=6, num_experts_per_tok=2)
T = 32
BOUND = 1e-5
FIELDS = ("key", "value", "conv", "recurrent", "lengths")


@pytest.fixture(scope="module")
def setup():
    model = init_model(CFG, dtype=jnp.float32, seed=int(np.random.default_rng(16).integers(1 << 30)))
    rng = np.random.default_rng(1616)
    tokens = rng.integers(0, CFG.vocab_size, (4, T)).astype(np.int32)
    lengths = np.array([T, 11, T, 3], np.int32)
    return model, tokens, lengths


def _compare(label, got, want, bound=BOUND):
    """got / want: (logits, list of per-stage caches or one cache)."""
    (g_logits, g_caches), (w_logits, w_caches) = got, want
    g = Cache.concat_layers(g_caches, jax.devices()[0]) if isinstance(g_caches, list) else g_caches
    w = Cache.concat_layers(w_caches, jax.devices()[0]) if isinstance(w_caches, list) else w_caches
    errs = {"logits": rel_err(g_logits, w_logits), **{f: rel_err(getattr(g, f), getattr(w, f)) for f in FIELDS}}
    print(f"{label}: " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()) + f" (bound {bound})")
    assert all(v <= bound for v in errs.values()), (label, errs)
    assert np.asarray(g_logits).shape == np.asarray(w_logits).shape


def _one_device(model, tokens, lengths, **kw):
    return jit_prefill(model, cache_len=T, **kw)(tokens, lengths)


# ---- the exchange alone --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("routing", ["random", "all to rank 0", "all to the last rank with experts"])
def test_dispatched_experts_equal_routed_experts(rng, ranks, routing):
    """Each rank's tokens through the exchange (all-gather, its own block, all-to-all back) against every token
    through all experts on one device; the skewed routings put every token-slot on one rank's experts, the worst
    case for the buffers: nothing may be dropped."""
    e, k, m, h, i = 6, 2, 10, 16, 8
    layout = ExpertLayout(e, ranks)
    gate_up = rng.standard_normal((e, 2 * i, h)).astype(np.float32)
    down = rng.standard_normal((e, h, i)).astype(np.float32)
    x = rng.standard_normal((ranks * m, h)).astype(np.float32)
    if routing == "random":
        ids = np.stack([rng.choice(e, k, replace=False) for _ in range(ranks * m)])
    else:
        owner = 0 if routing == "all to rank 0" else max(r for r in range(ranks) if len(layout.owned(r)))
        ids = np.tile(np.array(list(layout.owned(owner))[:k]), (ranks * m, 1))
    ids = ids.astype(np.int32)
    weights = rng.random((ranks * m, k)).astype(np.float32)
    want = routed_experts(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(weights), jnp.asarray(gate_up),
                          jnp.asarray(down))
    pad = [(0, layout.padded_experts - e)] + [(0, 0)] * 2
    mesh = Mesh(np.array(jax.devices()[:ranks]), (AXIS,))
    run = jax.jit(jax.shard_map(lambda x, ids, w, gu, dn: DispatchedExperts(gu, dn).routed(x, ids, w),
                                mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))
    got = run(x, ids, weights, np.pad(gate_up, pad), np.pad(down, pad))
    err = rel_err(got, want)
    print(f"N={ranks} {routing}: dispatched vs all experts on one device {err:.1e}")
    assert err <= 1e-6


# ---- DEP prefill equals one device ----------------------------------------------------------------------------------


@pytest.mark.parametrize("pipeline,ranks,layerwise", [pytest.param(*case, marks=pytest.mark.devices(case[0] * case[1]))
                                                      for case in [(1, 2, False), (1, 4, True), (2, 2, False)]])
def test_dep_equals_one_device(setup, pipeline, ranks, layerwise):
    """--dep 2, --dep 4 with 6 experts (the last rank holds only padding), --pipeline 2 --dep 2: logits and every
    cache against one device on the same batch."""
    model, tokens, lengths = setup
    pipe = Pipeline.from_model(model, pipeline, dwdp=ranks, experts="dep")
    assert all(isinstance(r.source, DepDispatchSource) for r in pipe.runners)
    got = pipe.prefill(tokens, lengths, cache_len=T, layerwise=layerwise)
    _compare(f"dep P={pipeline} N={ranks} layerwise={layerwise} vs one device", got,
             _one_device(model, tokens, lengths))


@pytest.mark.parametrize("experts", ["xla", "dep"])
@pytest.mark.parametrize("batch", [2, 3])
@pytest.mark.devices(4)
def test_any_batch_over_four_ranks(setup, experts, batch):
    """--dwdp 4 / --dep 4 with 2 and 3 sequences: the ranks without a sequence run rows of length 0, which the
    results leave out."""
    model, tokens, lengths = setup
    got = Pipeline.from_model(model, 1, dwdp=4, experts=experts).prefill(tokens[:batch], lengths[:batch],
                                                                         cache_len=T, layerwise=True)
    _compare(f"{experts} N=4 batch {batch} vs one device", got, _one_device(model, tokens[:batch], lengths[:batch]))


@pytest.mark.parametrize("ranks,experts,microbatches", [pytest.param(*case, marks=pytest.mark.devices(2 * case[0]))
                                                        for case in [(1, "local", 3), (2, "dep", 2), (1, "local", 8)]])
def test_any_batch_over_microbatches(setup, ranks, experts, microbatches):
    """Pipeline 2 with a batch of 3 in microbatches that do not divide it (3 in 2 of 2 rows over DEP ranks; 3 in
    3; 3 in 8, of which only 3 run): equal to one device."""
    model, tokens, lengths = setup
    pipe = Pipeline.from_model(model, 2, dwdp=ranks, experts=experts)
    got = pipe.prefill(tokens[:3], lengths[:3], cache_len=T, microbatches=microbatches)
    _compare(f"P=2 N={ranks} {experts} batch 3 in {microbatches} microbatches vs one device", got,
             _one_device(model, tokens[:3], lengths[:3]))


def test_rows_of_length_zero_are_finite_and_change_nothing(setup):
    """A row of length 0 among others (what padding adds): its logits and caches are finite (no NaN from an empty
    sequence, also for the last-position logits) and the other rows are what they are without it."""
    model, tokens, lengths = setup
    runner = StageRunner(model)
    with_empty = np.array([lengths[0], 0, lengths[2]], np.int32)
    for mode in ("all", "last"):
        logits, cache = runner(tokens[:3], with_empty, logits=mode, cache_len=T, mode="layerwise")
        assert np.isfinite(np.asarray(logits)).all(), mode
        assert all(np.isfinite(np.asarray(getattr(cache, f))).all() for f in FIELDS), mode
        want_logits, want_cache = runner(tokens[[0, 2]], lengths[[0, 2]], logits=mode, cache_len=T, mode="layerwise")
        _compare(f"rows 0, 2 beside a row of length 0 (logits {mode}) vs alone",
                 (logits[np.array([0, 2])], _rows(cache, [0, 2])), (want_logits, want_cache))


def _rows(cache: Cache, rows) -> Cache:
    rows = np.asarray(rows)
    return cache.replace(key=cache.key[:, rows], value=cache.value[:, rows], conv=cache.conv[:, rows],
                         recurrent=cache.recurrent[:, rows], lengths=cache.lengths[rows])


@pytest.mark.devices(4)
def test_no_token_dropped_when_every_token_goes_to_one_rank(setup):
    """Routers zeroed: every expert ties, top-k takes experts 0 and 1, all on rank 0. DEP over 2 and 4 ranks still
    equals one device (a capacity-limited exchange would drop most token-slots here)."""
    model, tokens, lengths = setup
    graphdef, state = nnx.split(model)
    flat = [(path, type(v)(jnp.zeros_like(v.get_value()) if path[-2:] == ("gate", "weight") else v.get_value()))
            for path, v in nnx.to_flat_state(state)]
    skewed = nnx.merge(graphdef, nnx.from_flat_state(flat))
    from jax_dwdp.model.moe import route

    ids, _ = route(jnp.asarray(np.random.default_rng(0).standard_normal((50, CFG.hidden_size)), jnp.float32),
                   skewed.layers[0].mlp.gate.weight[...], CFG.num_experts_per_tok)
    assert set(np.unique(np.asarray(ids))) == {0, 1}  # every token-slot on rank 0's experts
    want = _one_device(skewed, tokens, lengths)
    for ranks in (2, 4):
        got = Pipeline.from_model(skewed, 1, dwdp=ranks, experts="dep").prefill(tokens, lengths, cache_len=T)
        _compare(f"dep N={ranks}, every token to rank 0's experts, vs one device", got, want)


@pytest.mark.devices(2)
def test_profile_splits_each_layer_and_keeps_the_numbers(setup):
    """StageRunner.profile (DEP's per-layer wait): one row per layer with each rank's mixer time, the wait at the
    MoE = max over ranks of the mixer end minus the rank's own (so >= 0, and 0 for the last rank to arrive), and
    the split layers compute the same cache as the layer programs, also for a source that fetches the next layer
    inside the program (`XlaGatherSource`: its gather moves into the mixer's program)."""
    model, tokens, lengths = setup
    mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    placed = place_model(model, mesh)
    runner = StageRunner(placed, DepDispatchSource(expert_blocks(placed)), mesh=mesh)
    profile = runner.profile(tokens, lengths, cache_len=T)
    layers = CFG.num_hidden_layers
    assert np.asarray(profile["mixer_ms"]).shape == np.asarray(profile["wait_ms"]).shape == (layers, 2)
    assert len(profile["moe_ms"]) == len(profile["layer_ms"]) == layers
    wait = np.asarray(profile["wait_ms"])
    assert (wait >= 0).all() and (wait.min(axis=1) == 0).all()
    assert all(t > 0 for t in profile["layer_ms"])
    # the profiled loop's cache (mixer + MoE programs) equals the layer programs' cache
    from jax_dwdp.sources import XlaGatherSource

    gather = StageRunner(placed, XlaGatherSource(expert_blocks(placed), mesh), mesh=mesh)
    assert len(gather.profile(tokens, lengths, cache_len=T)["layer_ms"]) == layers
    for name, r in (("dep", runner), ("xla gather", gather)):
        ops_cache = r._run(_profiled(r), *r.place(tokens, lengths), "none", T, True)[1]
        _, want = r(tokens, lengths, logits="none", cache_len=T, mode="layerwise")
        for f in FIELDS:
            err = rel_err(getattr(ops_cache, f), getattr(want, f))
            print(f"{name}: profiled split layers vs layer programs, {f}: {err:.1e}")
            assert err <= 1e-6, f


def _profiled(runner):
    from jax_dwdp.runner import _Profiled

    return _Profiled(runner)


# ---- memory: what a rank keeps --------------------------------------------------------------------------------------


def _live_bytes_by_device() -> dict:
    gc.collect()
    out: dict = {}
    for a in jax.live_arrays():
        for shard in a.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


@pytest.mark.devices(2)
def test_ranks_hold_their_share_and_are_built_one_layer_at_a_time(monkeypatch):
    """Pipeline.random over 2 ranks (DWDP and DEP) and IndependentRanks.random make one layer at a time (so no
    device holds a whole stage's experts on the way), and afterwards each device holds no more than `plan`'s
    resident bytes: its expert block and the non-expert weights (the placed copies only: nothing of the unsplit
    model is left alive)."""
    from jax_dwdp.plan import plan_layout
    from jax_dwdp.parallel import pipeline as pipeline_module

    cfg = CFG.replace(hidden_size=128, moe_intermediate_size=256, num_experts=8)  # experts dominate the bytes
    made = []
    real_init = pipeline_module.init_model

    def spy(cfg_, **kw):
        made.append((kw["start_layer"], kw["end_layer"]))
        return real_init(cfg_, **kw)
    monkeypatch.setattr(pipeline_module, "init_model", spy)
    resident = [r["resident_bytes"] for r in plan_layout(cfg, 1, 2, jnp.float32)[0]["dwdp_ranks"]]
    before = _live_bytes_by_device()
    for experts in ("xla", "dep"):
        pipe = Pipeline.random(cfg, 1, dwdp=2, dtype=jnp.float32, seed=3, experts=experts)
        assert made == [(layer, layer + 1) for layer in range(cfg.num_hidden_layers)], made
        made.clear()
        now = _live_bytes_by_device()
        held = [now.get(d, 0) - before.get(d, 0) for d in pipe.mesh.devices.flat]
        print(f"Pipeline.random dwdp 2 {experts}: live bytes per device {held}, plan resident {resident}")
        assert all(h <= r * 1.01 for h, r in zip(held, resident)), (held, resident)
        del pipe
    ranks = IndependentRanks.random(cfg, jax.devices()[:2], dtype=jnp.float32, seed=3)
    now = _live_bytes_by_device()
    held = [now.get(d, 0) - before.get(d, 0) for d in jax.devices()[:2]]
    print(f"IndependentRanks.random: live bytes per device {held}, plan resident {resident}")
    assert all(h <= r * 1.01 for h, r in zip(held, resident)), (held, resident)
    full = (cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert not [a for a in jax.live_arrays() if a.shape == full], "a whole layer's experts is still alive"
    del ranks


@pytest.mark.devices(2)
def test_cli_dep(tmp_path, capsys):
    """jax-dwdp prefill --dep 2 (batch 3 over 2 ranks) writes the one-device logits (fp32); --dwdp with --dep, and
    an FFI backend with --dep, are one clear error line each."""
    from jax_dwdp.cli import main

    common = ["prefill", "--preset", "tiny", "--dtype", "float32", "--batch", "3", "--seq-len", "12", "--iters", "1",
              "--json", "--seed", "7"]
    assert main([*common, "--logits-out", str(tmp_path / "one.npy")]) == 0
    assert main([*common, "--dep", "2", "--logits-out", str(tmp_path / "dep.npy")]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    import json

    assert len(json.loads(out)["peak_device_memory_bytes_per_device"]) == 2
    err = rel_err(np.load(tmp_path / "dep.npy"), np.load(tmp_path / "one.npy"))
    print(f"CLI --dep 2 vs one device: logits {err:.1e}")
    assert err <= BOUND
    for argv, message in [(["--dwdp", "2", "--dep", "2"], "--dwdp 2 and --dep 2: choose one way"),
                          (["--dep", "2", "--dwdp-backend", "ffi"], "--experts ffi is for --dwdp")]:
        assert main([*common, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


@pytest.mark.devices(4)
def test_checkpoints_load_one_layer_at_a_time_onto_ranks(tmp_path, setup):
    """Pipeline.from_checkpoint over ranks (HF: pipeline 2 x DEP 2; Orbax: DWDP 2 over XLA) loads each layer, places
    it, then loads the next; the logits equal one device and each stage's report counts its own tensors once."""
    from jax_dwdp.weights import convert_hf_to_orbax
    from tests.checkpoint_helpers import write_hf

    model, tokens, lengths = setup
    seed = 5
    hf = write_hf(tmp_path / "hf", CFG, seed)
    orbax = tmp_path / "orbax"
    convert_hf_to_orbax(hf, orbax, progress=None)
    want = _one_device(init_model(CFG, dtype=jnp.float32, seed=seed), tokens, lengths)
    paths = [p for p, _ in nnx.to_flat_state(nnx.state(model))]
    per_layer = [sum(p[:2] == ("layers", i) for p in paths) for i in range(CFG.num_hidden_layers)]
    for ckpt, pipeline, experts in [(hf, 2, "dep"), (orbax, 1, "xla")]:
        pipe = Pipeline.from_checkpoint(ckpt, pipeline, dwdp=2, dtype=jnp.float32, experts=experts)
        got = pipe.prefill(tokens, lengths, cache_len=T)
        _compare(f"{ckpt.name} P={pipeline} {experts} 2 ranks vs one device", got, want)
        for st, report in zip(pipe.stages, pipe.load_reports):
            own = sum(per_layer[st.start_layer:st.end_layer]) + (st.start_layer == 0) + 2 * (st.end_layer == 4)
            print(f"{ckpt.name} stage {st.stage}: {report.line()}")
            assert report.tensors_loaded == own
            if ckpt is hf:
                assert report.skipped_other_layers == sum(per_layer) - sum(per_layer[st.start_layer:st.end_layer])


@pytest.mark.devices(4)
def test_store_placement_fills_each_ranks_block_one_layer_at_a_time(setup):
    """StorePlacement (the FFI path, here with a stand-in store): every (layer, weight, rank) block is
    filled once, on its rank's device, with that rank's experts (zero padding past E), layer by layer; the stage
    keeps scalar placeholders for the experts and the other weights replicated."""
    from jax_dwdp.parallel.placement import StorePlacement, build_placed, model_range

    model, *_ = setup
    devices = jax.devices()[:4]
    order = []

    class Store:
        num_ranks = 4

        def own_ranks(self):  # one process drives every rank, as an ExpertStore does
            return list(enumerate(devices))

        def fill(self, layer, weight, rank, block):
            assert block.devices() == {devices[rank]} and block.shape[0] == 2
            order.append((layer, weight, rank, np.asarray(block)))

    mesh = Mesh(np.array(devices), (AXIS,))
    stage = build_placed(CFG, 0, CFG.num_hidden_layers, lambda a, b: model_range(model, a, b),
                         StorePlacement(mesh, Store()), dtype=jnp.float32)
    filled = [o[:3] for o in order]
    assert sorted(filled) == [(layer, w, r) for layer in range(CFG.num_hidden_layers) for w in (0, 1) for r in range(4)]
    assert [f[0] for f in filled] == sorted(f[0] for f in filled)  # layer by layer
    for layer, w, rank, block in order:
        full = np.asarray(model.layers[layer].mlp.experts.gate_up_proj[...] if w == 0 else
                          model.layers[layer].mlp.experts.down_proj[...])
        padded = np.concatenate([full, np.zeros((2, *full.shape[1:]), full.dtype)])
        np.testing.assert_array_equal(block, padded[2 * rank:2 * rank + 2])
    experts = stage.layers[1].mlp.experts
    assert experts.gate_up_proj[...].shape == experts.down_proj[...].shape == ()
    router = stage.layers[1].mlp.gate.weight[...]
    assert len(router.addressable_shards) == 4 and router.sharding.is_fully_replicated


@pytest.mark.devices(4)
@pytest.mark.parametrize("case", ["order", "count", "process"])
def test_store_placement_refuses_a_store_not_over_the_mesh(case):
    """A store whose ranks are not the mesh's (other devices, another order, another count) would hand each rank
    another rank's experts: Placement refuses it up front, naming the rank and both devices."""
    from jax_dwdp.parallel.placement import StorePlacement

    devices = jax.devices()[:4]
    mesh = Mesh(np.array(devices), (AXIS,))

    class Store:
        num_ranks = 3 if case == "count" else 4

        def own_ranks(self):
            if case == "order":  # an ExpertStore over the mesh's devices, reversed
                return list(enumerate(devices[::-1]))
            if case == "process":  # one process per device: rank 2 on a device the mesh gives rank 1
                return [(2, devices[1])]
            return list(enumerate(devices))

    with pytest.raises(ValueError, match=re.escape("3 rank(s) for a 'dwdp' mesh of 4") if case == "count" else
                       "the 'dwdp' mesh puts rank"):
        StorePlacement(mesh, Store())

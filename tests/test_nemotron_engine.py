"""Nemotron-H through the engine, on CPU devices (fp32, the tiny preset: M E * - M E, every layer type): pipeline stages
cut anywhere, each stage's caches sized to its own layers; microbatches; DWDP over XLA (the all-gather, independent
ranks' peer copies) and DEP over the MoE layers only; the FFI backend's interfaces over a stand-in store; chunked
prefill continuing the caches; the scanned stack; Orbax convert / verify / restore per stage and per rank; `plan`,
the presets and the CLI. Each against the model's own prefill (one jitted program on one device): within 1e-5."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dwdp.cli import main
from jax_dwdp.config import ConfigError, ModelConfig
from jax_dwdp.driver import chunked_prefill, random_tokens
from jax_dwdp.families import config_from_preset, preset_names
from jax_dwdp.model import Cache, expert_slots, init_model, is_expert_weight
from jax_dwdp.model.nemotron_moe import routed_relu2_experts
from jax_dwdp.nemotron_h_config import ATTENTION, MAMBA, NemotronHConfig, parse_pattern
from jax_dwdp.parallel import Pipeline
from jax_dwdp.parallel.backends import FfiBackend
from jax_dwdp.parallel.dwdp import IndependentRanks
from jax_dwdp.parallel.expert_layout import ExpertLayout, expert_bytes_per_layer
from jax_dwdp.parallel.pipeline import cache_bytes_per_sequence, cache_bytes_per_token
from jax_dwdp.prefill import jit_prefill
from jax_dwdp.scan import ScannedModel, jit_prefill_scanned, period_of
from jax_dwdp.sources import AXIS, DispatchedExperts, XlaGatherSource
from jax_dwdp.weights import convert_hf_to_orbax, load_checkpoint, load_orbax_checkpoint, verify_checkpoint
from jax_dwdp.weights.hf_loader import load_config, load_hf_checkpoint
from jax_dwdp.weights.safetensors_reader import CheckpointError
from tests.host_views import HostViews

CFG = NemotronHConfig.preset("tiny")  # M E * - M E: 8 experts top-2 in 2 groups, SSD chunks of 16 tokens
T = 24
TOL = dict(rtol=1e-5, atol=1e-5)
LEAVES = ("key", "value", "conv", "recurrent")


def _reference(model, tokens, lengths, cache_len=T):
    """The model's own prefill, one jitted program on its device: (logits "all", cache)."""
    return nnx.jit(lambda m, x, n: m.prefill(x, n, logits="all", cache_len=cache_len))(model, tokens, lengths)


@pytest.fixture(scope="module")
def setup():
    model = init_model(CFG, dtype=jnp.float32, seed=5)
    rng = np.random.default_rng(55)
    tokens = rng.integers(0, CFG.vocab_size, (3, T)).astype(np.int32)
    lengths = np.array([T, 13, 4], np.int32)  # 3 rows: 2 ranks or 2 microbatches get a padding row
    return model, tokens, lengths, _reference(model, tokens, lengths)


def _compare(got_logits, got_caches, want):
    """Logits and the caches (one per stage, joined) equal the one-device prefill's."""
    want_logits, want_cache = want
    cache = Cache.concat_layers(list(got_caches), jax.devices()[0]) if isinstance(got_caches, list) else got_caches
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), **TOL)
    assert (cache.full_layer_ids, cache.linear_layer_ids) == (want_cache.full_layer_ids, want_cache.linear_layer_ids)
    for leaf in LEAVES:
        np.testing.assert_allclose(np.asarray(getattr(cache, leaf)), np.asarray(getattr(want_cache, leaf)), **TOL,
                                   err_msg=leaf)
    np.testing.assert_array_equal(cache.lengths, want_cache.lengths)


# ---- pipeline stages: cut anywhere, caches of their own layers only -------------------------------------------------

CUTS = [([1, 2, 3, 4, 5], 2),  # one layer per stage: M | E | * | - | M | E; 2 microbatches, the second padded
        ([3], 1)]  # M E * | - M E


@pytest.mark.parametrize("boundaries,microbatches", [pytest.param(*c, marks=pytest.mark.devices(len(c[0]) + 1))
                                                     for c in CUTS])
def test_stages_cut_anywhere_equal_one_device_and_allocate_only_their_own_caches(setup, boundaries, microbatches):
    """Every stage's cache has slots (and bytes) for its own Mamba-2 and attention layers only, on its own device:
    a stage that allocated another stage's Mamba or KV cache fails the slot, shape and byte checks. The stages hold
    only their own layers' weights, and together give the one-device logits and cache."""
    model, tokens, lengths, want = setup
    pipe = Pipeline.from_model(model, len(boundaries) + 1, boundaries=boundaries)
    logits, caches = pipe.prefill(tokens, lengths, microbatches=microbatches, logits="all", cache_len=T)
    for st, cache, stage, device in zip(pipe.stages, caches, pipe.models, pipe.devices):
        mamba, attention = CFG.layer_ids(MAMBA, st.start_layer, st.end_layer), CFG.layer_ids(ATTENTION, st.start_layer,
                                                                                               st.end_layer)
        assert (cache.linear_layer_ids, cache.full_layer_ids) == (mamba, attention)
        assert cache.conv.shape[:2] == cache.recurrent.shape[:2] == (len(mamba), 3)
        assert cache.key.shape[:3] == cache.value.shape[:3] == (len(attention), 3, T)
        assert cache.nbytes() == 3 * (cache_bytes_per_sequence(CFG, st, jnp.float32)
                                      + T * cache_bytes_per_token(CFG, st, jnp.float32)), st
        for leaf in (*LEAVES, "lengths"):
            assert getattr(cache, leaf).devices() == {device}, (st, leaf)
        assert [layer.layer_id for layer in stage.layers] == list(range(st.start_layer, st.end_layer))
        assert hasattr(stage, "embeddings") == (st.start_layer == 0)
        assert hasattr(stage, "lm_head") == (st.end_layer == 6)
    _compare(logits, caches, want)


# ---- DWDP and DEP over the MoE layers ------------------------------------------------------------------------------

LAYOUTS = [  # experts, stages, ranks per stage, boundaries, microbatches, mode
    ("xla", 1, 2, None, 1, "whole"),
    ("dep", 1, 2, None, 1, "whole"),
    ("xla", 2, 2, [1], 2, "layerwise"),  # stage 0 is one Mamba-2 layer: no experts to fetch
    ("dep", 2, 2, [3], 1, "layerwise"),
    ("xla", 1, 3, None, 1, "layerwise"),  # 8 experts over 3 ranks: 3 slots each, the last one padding
]


@pytest.mark.parametrize("experts,stages,ranks,boundaries,microbatches,mode",
                         [pytest.param(*c, marks=pytest.mark.devices(c[1] * c[2])) for c in LAYOUTS])
def test_dwdp_and_dep_over_the_moe_layers_equal_one_device(setup, experts, stages, ranks, boundaries, microbatches,
                                                           mode):
    """Each rank stores its block of every MoE layer's relu^2 experts (the other layers have none); DWDP gathers
    the next MoE layer's blocks under the layer before it, DEP sends the tokens (at the experts' width) to them."""
    model, tokens, lengths, want = setup
    pipe = Pipeline.from_model(model, stages, dwdp=ranks, boundaries=boundaries, experts=experts)
    logits, caches = pipe.prefill(tokens, lengths, microbatches=microbatches, logits="all", cache_len=T, mode=mode)
    _compare(logits, caches, want)
    slots = ExpertLayout(CFG.num_experts, ranks).slots_per_rank
    for st, stage, runner in zip(pipe.stages, pipe.models, pipe.runners):
        blocks = runner.source.blocks
        assert [b is not None for b in blocks] == [layer.has_experts for layer in stage.layers]
        for layer in stage.layers:
            if layer.has_experts:
                up = layer.mixer.experts.up_proj[...]
                assert {s.data.shape[0] for s in up.addressable_shards} == {slots}
        assert [i + st.start_layer for i, s in enumerate(expert_slots(stage)) if s is not None] == list(st.moe_layers)


@pytest.mark.devices(4)
def test_dep_exchange_runs_the_relu2_experts(rng):
    """DEP's exchange alone, with the relu^2 experts the Nemotron-H MoE hands it: every rank's tokens against every
    rank's block equal routed_relu2_experts over all experts."""
    ranks, e, i, d, m, k = 4, 8, 16, 12, 10, 2
    mesh = Mesh(np.array(jax.devices()[:ranks]), (AXIS,))
    x = jnp.asarray(rng.standard_normal((ranks * m, d)), jnp.float32)
    ids = jnp.asarray(np.stack([rng.choice(e, k, replace=False) for _ in range(ranks * m)]), jnp.int32)
    weights = jnp.asarray(rng.random((ranks * m, k)), jnp.float32)
    up = jnp.asarray(rng.standard_normal((e, i, d)) * d**-0.5, jnp.float32)
    down = jnp.asarray(rng.standard_normal((e, d, i)) * i**-0.5, jnp.float32)
    want = routed_relu2_experts(x, ids, weights, up, down)
    exchange = jax.jit(jax.shard_map(
        lambda x, ids, w, up, down: DispatchedExperts(up, down).routed(x, ids, w, experts_fn=routed_relu2_experts),
        mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))
    np.testing.assert_allclose(np.asarray(exchange(x, ids, weights, up, down)), np.asarray(want), **TOL)


@pytest.mark.devices(2)
def test_dep_profile_splits_each_block_at_its_experts(setup):
    """StageRunner.profile (DEP's per-layer wait) over the family's blocks: a MoE block is all experts (nothing
    before them), every other block all mixer (nothing after); the split blocks give the layers' own outputs."""
    model, tokens, lengths, _ = setup
    pipe = Pipeline.from_model(model, 1, dwdp=2, experts="dep")
    report = pipe.runners[0].profile(tokens[:2], lengths[:2], cache_len=T)
    assert len(report["mixer_ms"]) == len(report["moe_ms"]) == len(report["wait_ms"]) == CFG.num_hidden_layers
    assert all(len(ranks) == 2 for ranks in report["mixer_ms"])
    h = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, CFG.hidden_size)), jnp.float32)
    n = jnp.array([5, 3])
    for layer in model.layers:
        x, cache = layer.mix(h, None, n)
        np.testing.assert_allclose(np.asarray(layer.moe(x)), np.asarray(layer(h, None, n)[0]), **TOL)
        assert (x is h) == layer.has_experts and (cache is None) == (layer.layer_type not in (MAMBA, ATTENTION))


@pytest.mark.devices(2)
def test_independent_ranks_run_their_own_batches(setup):
    """Independent DWDP ranks (peer blocks copied device to device, MoE layers only): each rank's own batch and
    length equal those sequences on one device."""
    model, tokens, lengths, (want_logits, want_cache) = setup
    ranks = IndependentRanks(model, jax.devices()[:2], experts="xla")
    assert [layer is None for layer in ranks.source.blocks] == [not layer.has_experts for layer in model.layers]
    out = ranks.prefill_all({0: (tokens[:2], lengths[:2]), 1: (tokens[2:, :16], lengths[2:])}, cache_len=T)
    (logits0, cache0), (logits1, cache1) = out[0], out[1]
    np.testing.assert_allclose(np.asarray(logits0), np.asarray(want_logits[:2]), **TOL)
    np.testing.assert_allclose(np.asarray(logits1)[0, :4], np.asarray(want_logits[2, :4]), **TOL)
    np.testing.assert_allclose(np.asarray(cache1.recurrent[:, 0]), np.asarray(want_cache.recurrent[:, 2]), **TOL)
    np.testing.assert_allclose(np.asarray(cache0.key), np.asarray(want_cache.key[:, :2]), **TOL)


# ---- the FFI backend's interfaces, over a stand-in store ------------------------------------------------------------


class HostStore(HostViews):
    """What FfiBackend needs of an expert store, over host memory (no CUDA; tests/host_views.py): blocks filled per
    (layer, weight, rank), each device's in-place view of a layer poisoned until that layer is prefetched, a wait
    that is the identity. Its layers are the stage's expert layers only."""

    connected = True

    def __init__(self, devices, num_layers, num_experts, shapes, dtype):
        devices = list(devices)
        self.num_ranks, self.blocks = len(devices), {}
        self.layout = ExpertLayout(num_experts, self.num_ranks)
        super().__init__(devices, num_layers, num_experts, shapes, dtype, rows=self.layout.padded_experts)

    def own_ranks(self):
        return list(enumerate(self.devices))

    def fill(self, layer, weight, rank, block):
        assert 0 <= layer < self.num_layers and block.devices() == {self.devices[rank]}
        self.blocks[layer, weight, rank] = np.asarray(block)

    def layer_data(self, layer, w):
        return np.concatenate([self.blocks[layer, w, rank] for rank in range(self.num_ranks)])


class HostStoreBackend(FfiBackend):
    """experts="ffi" with HostStores: the backend's placement, stage sources and lifetime, without a GPU."""

    def check(self, devices, ranks):
        pass

    def _open(self, mesh, cfg, num_layers, dtype, *, name):
        return HostStore(mesh.devices.flat, num_layers, cfg.num_experts, cfg.expert_shapes, dtype)


@pytest.mark.devices(4)
def test_the_ffi_backend_stores_the_moe_layers_only(setup):
    """A stage without MoE layers opens no store; a stage's store holds its MoE layers (in order) and no other,
    is filled block by block through StorePlacement, and each MoE layer reads the store layer its slot names, after
    its prefetch: the logits equal one device. (The CUDA store takes the same calls: no GPU ran this.)"""
    model, tokens, lengths, want = setup
    backend = HostStoreBackend()
    with Pipeline.from_model(model, 2, dwdp=2, boundaries=[1], experts=backend) as pipe:  # M | E * - M E
        assert list(backend.stores) == [1]
        store = backend.stores[1]
        assert store.num_layers == 2 and store.shapes == CFG.expert_shapes
        assert sorted(store.blocks) == [(layer, w, r) for layer in range(2) for w in range(2) for r in range(2)]
        assert pipe.runners[1].source.layers == (0, None, None, None, 1)
        logits, caches = jax.block_until_ready(pipe.prefill(tokens, lengths, logits="all", cache_len=T))
        assert sorted(store.prefetched) == [0, 0, 1, 1]  # each layer once on each of the row's devices
        _compare(logits, caches, want)
    assert store.closed


# ---- chunked prefill ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["whole", "layerwise"])
def test_chunked_prefill_continues_the_caches(setup, mode):
    """Pieces of 10 tokens (10, 10, 4; the shortest sequence adds nothing after its first piece): the logits and the
    cache (conv and SSM states, K/V at the held positions) of one prefill of the whole prompt."""
    model, tokens, lengths, (want_logits, want_cache) = setup
    logits, (cache,) = chunked_prefill(model, "all", 10, mode=mode)(tokens, lengths)
    held = np.arange(T)[None, :] < lengths[:, None]
    np.testing.assert_allclose(np.asarray(logits)[held], np.asarray(want_logits)[held], **TOL)
    np.testing.assert_array_equal(cache.lengths, lengths)
    for leaf in ("conv", "recurrent"):
        np.testing.assert_allclose(np.asarray(getattr(cache, leaf)), np.asarray(getattr(want_cache, leaf)), **TOL)
    for leaf in ("key", "value"):
        np.testing.assert_allclose(np.asarray(getattr(cache, leaf))[:, held],
                                   np.asarray(getattr(want_cache, leaf))[:, held], **TOL)
    if mode == "layerwise":  # (the layer programs do not depend on the logits mode: no compile more)
        last, _ = chunked_prefill(model, "last", 10, mode=mode)(tokens, lengths)
        np.testing.assert_allclose(np.asarray(last), np.asarray(want_logits)[np.arange(3), lengths - 1], **TOL)


# ---- the scanned stack ----------------------------------------------------------------------------------------------

PERIODIC = CFG.replace(layer_types=parse_pattern("MEM*EMEM*EM-E"))  # "MEM*E" twice, then 3 layers


@pytest.fixture(scope="module")
def periodic(setup):
    _, tokens, lengths, _ = setup
    model = init_model(PERIODIC, dtype=jnp.float32, seed=9)
    return model, _reference(model, tokens, lengths)


def test_the_scanned_stack_equals_the_model(setup, periodic):
    """The family's pattern repeats (Nano 30B-A3B: "MEMEM*E" five times, 17 layers after; Super 120B-A12B: 9 layers
    three times): the scanned program stacks the period's blocks, unrolls the rest, and equals the model."""
    nano, sup = NemotronHConfig.preset("nano-30b-a3b"), NemotronHConfig.preset("super-120b-a12b")
    assert period_of(nano.layer_types, nano.scan_period()) == (parse_pattern("MEMEM*E"), 5)
    assert period_of(sup.layer_types, sup.scan_period()) == (parse_pattern("MEMEMEM*E"), 3)
    _, tokens, lengths, _ = setup
    model, want = periodic
    scanned = ScannedModel.from_model(model, consume=False)
    assert scanned.describe() == "scanned: 2 blocks of 5 layers + 3"
    logits, cache = jit_prefill_scanned(scanned, cache_len=T)(tokens, lengths)
    _compare(logits, cache, want)


@pytest.mark.devices(2)
def test_scanned_stages_cut_inside_the_period_equal_the_model(setup, periodic):
    _, tokens, lengths, _ = setup
    model, want = periodic
    pipe = Pipeline.from_model(model, 2, boundaries=[7], scan=True)
    logits, caches = pipe.prefill(tokens, lengths, logits="all", cache_len=T, microbatches=2)
    _compare(logits, caches, want)


# ---- Orbax: convert, verify, restore per stage and per rank ---------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A Nemotron-H checkpoint as transformers saves it (`backbone.`, per-expert pieces) and its Orbax conversion."""
    from tests.nemotron_reference import random_hf_model

    root = tmp_path_factory.mktemp("nemotron")
    random_hf_model(CFG, 23).save_pretrained(root / "hf", safe_serialization=True)
    summary = convert_hf_to_orbax(root / "hf", root / "orbax", progress=None)
    return root / "hf", root / "orbax", summary


def _flat(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.devices(2)
def test_orbax_convert_verify_and_restore_per_stage_and_rank(checkpoints, tmp_path):
    """The conversion keeps every tensor bit for bit and verifies; a stage restores from its own layers' items alone
    (the others deleted); a DWDP rank restores its slice of each MoE layer's experts, which are stored one expert
    per chunk."""
    hf, orbax, summary = checkpoints
    assert load_config(orbax) == load_config(hf) == CFG
    assert verify_checkpoint(orbax)["tensors"] == summary["tensors"]
    reference, _ = load_hf_checkpoint(hf, dtype=jnp.float32)
    restored, report = load_orbax_checkpoint(orbax, dtype=jnp.float32)
    a, b = _flat(reference), _flat(restored)
    assert a.keys() == b.keys() and report.tensors_loaded == summary["tensors"] == len(a)
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))
    damaged = tmp_path / "stage"
    shutil.copytree(orbax, damaged)
    for name in ("embed", "layers/000", "layers/001", "layers/002"):
        shutil.rmtree(damaged / name)
    stage, _ = load_orbax_checkpoint(damaged, dtype=jnp.float32, start_layer=3)
    assert all(np.array_equal(v, a[("layers", p[1] + 3, *p[2:]) if p[0] == "layers" else p])
               for p, v in _flat(stage).items())
    with pytest.raises(CheckpointError, match="layers/002: missing"):
        load_orbax_checkpoint(damaged, dtype=jnp.float32, start_layer=2)
    devices = jax.devices()[:2]
    mesh = Mesh(np.array(devices), (AXIS,))
    split = lambda path, shape, dtype: NamedSharding(mesh, P(AXIS) if is_expert_weight(path) else P())  # noqa: E731
    rank, _ = load_orbax_checkpoint(orbax, dtype=jnp.float32, start_layer=5, placement=split)
    up = rank.layers[0].mixer.experts.up_proj[...]
    for shard in up.addressable_shards:
        r = devices.index(shard.device)
        full = a[("layers", 5, "mixer", "experts", "up_proj")]
        np.testing.assert_array_equal(np.asarray(shard.data), full[4 * r:4 * r + 4])
    import orbax.checkpoint as ocp

    meta = ocp.PyTreeCheckpointer().metadata(orbax / "layers" / "005").item_metadata
    for name in ("up_proj", "down_proj"):
        array = meta["mixer"]["experts"][name]
        assert array.storage.chunk_shape == (1, *array.shape[1:]), array.storage


def test_hf_export_writes_the_family(tmp_path):
    """`python -m jax_dwdp.weights.hf_export --preset nemotron-h:tiny` writes an HF folder (`backbone.` names, fused
    experts) that loads back bit for bit as the family's model."""
    from jax_dwdp.weights.hf_export import main as export

    assert export([str(tmp_path / "hf"), "--preset", "nemotron-h:tiny", "--seed", "3"]) == 0
    assert load_config(tmp_path / "hf") == CFG
    loaded, _ = load_hf_checkpoint(tmp_path / "hf", dtype=jnp.float32)
    a, b = _flat(init_model(CFG, dtype=jnp.float32, seed=3)), _flat(loaded)
    assert a.keys() == b.keys() and all(np.array_equal(a[p], b[p]) for p in a)


@pytest.mark.devices(4)
def test_a_pipeline_of_dwdp_ranks_loads_its_layers_from_orbax(checkpoints, setup):
    """Each stage restores only its layers (the report's tensors) and places its experts on its ranks: the logits
    equal the HF checkpoint's model on one device."""
    hf, orbax, _ = checkpoints
    _, tokens, lengths, _ = setup
    model, _ = load_checkpoint(hf, dtype=jnp.float32)
    want = _reference(model, tokens, lengths)
    with Pipeline.from_checkpoint(orbax, 2, dwdp=2, dtype=jnp.float32, boundaries=[2]) as pipe:
        logits, caches = pipe.prefill(tokens, lengths, logits="all", cache_len=T)
        counts = {i: sum(1 for p in _flat(model) if p[0] == "layers" and p[1] == i) for i in range(6)}
        for st, report in zip(pipe.stages, pipe.load_reports):
            own = sum(counts[i] for i in range(st.start_layer, st.end_layer))
            assert report.tensors_loaded == own + (st.start_layer == 0) + 2 * (st.end_layer == 6), st
    _compare(logits, caches, want)


# ---- presets, plan and the command line -----------------------------------------------------------------------------


def test_presets_are_named_by_family():
    """FAMILY:NAME for every family; the bare names stay Qwen3.5-MoE's; an unknown name lists them all."""
    assert config_from_preset("nemotron-h:tiny") == CFG
    assert config_from_preset("tiny") == config_from_preset("qwen3.5:tiny") == ModelConfig.preset("tiny")
    assert config_from_preset("nemotron-h:nano-30b-a3b") == NemotronHConfig.preset("nano-30b-a3b")
    assert {"qwen3.5:35b-a3b", "nemotron-h:super-120b-a12b"} <= set(preset_names())
    for name in ("nano-30b-a3b", "nemotron-h:35b-a3b", "llama:tiny"):
        with pytest.raises(ConfigError, match="nemotron-h:nano-30b-a3b"):
            config_from_preset(name)


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_counts_the_moe_layers_of_each_stage(capsys):
    """Per stage: its MoE layers, attention and Mamba-2 layers, KV bytes per token and state bytes per sequence
    from the family's shapes, resident experts for its MoE layers only; the stages' weights add up to the model's."""
    nano = NemotronHConfig.preset("nano-30b-a3b")
    code, out, err = run_cli(capsys, "plan", "--preset", "nemotron-h:nano-30b-a3b", "--pipeline", "2", "--dwdp", "4",
                             "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["model"] == nano.summary()
    per_expert = expert_bytes_per_layer(nano, 2)
    assert per_expert == 2 * 2 * 1856 * 2688
    for s in plan["stages"]:
        ids = range(s["start_layer"], s["end_layer"])
        assert s["moe_layers"] == [i for i in ids if nano.layer_types[i] == "moe"]
        assert s["linear_attention_layers"] == [i for i in ids if nano.layer_types[i] == MAMBA]
        assert s["cache_bytes_per_token"] == 2 * len(s["full_attention_layers"]) * 2 * 128 * 2
        mamba = (64 * 64 + 2 * 8 * 128) * 3 * 2 + 64 * 64 * 128 * 4  # conv state (bf16) + SSM state (fp32)
        assert s["cache_bytes_per_sequence"] == len(s["linear_attention_layers"]) * mamba
        for r in s["dwdp_ranks"]:
            assert r["resident_expert_bytes"] == len(s["moe_layers"]) * 32 * per_expert
    fp32 = len(nano.layer_ids(MAMBA)) * 64 + len(nano.moe_layer_ids()) * 128  # A_log, the correction bias
    assert sum(s["weight_bytes"] for s in plan["stages"]) == 2 * nano.param_counts()["total"] + 2 * fp32
    code, out, err = run_cli(capsys, "plan", "--preset", "nemotron-h:tiny", "--pipeline", "2")
    assert code == 0 and "2 Mamba-2, 1 attention, 2 MoE, 1 MLP" in out, err
    code, out, err = run_cli(capsys, "plan", "--preset", "nemotron-h:tiny", "--dwdp", "2", "--profile", "h200")
    assert code == 2 and "Nemotron-H has no GPU profile yet" in err and len(err.strip().splitlines()) == 1, err


def test_cli_prefill_of_the_preset_equals_the_python_api(tmp_path, capsys):
    """`prefill --preset nemotron-h:tiny` writes the logits of init_model's model (seed 0) on the same random
    tokens; refusals are one line."""
    _cli_logits_equal_the_api(tmp_path, capsys, {"one device": ()})
    for argv, message in [(["prefill", "--fused-swiglu"], "no SwiGLU to fuse"),
                          (["plan", "--dwdp", "16"], "16 DWDP ranks for 8 experts")]:
        code, out, err = run_cli(capsys, argv[0], "--preset", "nemotron-h:tiny", *argv[1:])
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)


@pytest.mark.devices(4)
def test_cli_prefill_over_stages_ranks_and_pieces(tmp_path, capsys):
    """The same logits over 2 stages x 2 DWDP ranks, over 2 DEP ranks, and in pieces (--prefill-chunk)."""
    _cli_logits_equal_the_api(tmp_path, capsys, {
        "spread": ("--pipeline", "2", "--dwdp", "2", "--stage-boundaries", "3"),
        "dep": ("--dep", "2", "--layerwise"),
        "chunked": ("--prefill-chunk", "8"),
    })


def _cli_logits_equal_the_api(tmp_path, capsys, runs: dict):
    cfg = config_from_preset("nemotron-h:tiny")
    tokens = random_tokens(cfg.vocab_size, 2, 20, seed=0)
    want, _ = jit_prefill(init_model(cfg, dtype=jnp.float32, seed=0))(tokens)
    for name, extra in runs.items():
        out_file = tmp_path / f"{name.replace(' ', '_')}.npy"
        code, out, err = run_cli(capsys, "prefill", "--preset", "nemotron-h:tiny", "--batch", "2", "--seq-len", "20",
                                 "--dtype", "float32", "--iters", "1", "--logits-out", str(out_file), *extra)
        assert code == 0, (name, err)
        assert "2 Mamba-2, 1 attention, 2 MoE, 1 MLP" in out
        np.testing.assert_allclose(np.load(out_file), np.asarray(want), **TOL, err_msg=name)

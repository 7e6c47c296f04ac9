"""Nemotron-H against transformers 5.17 (fp32, the PyTorch paths): logits, every cache and one decode step on tiny
random models, with and without the latent MoE; the SSD chunked scan against a float64 sequential recurrence; the
config read from HF's config.json forms; a layer range (pipeline stage) and a prompt in pieces.

Inputs are fresh random each run (the seed is printed: a failure reproduces with NEMOTRON_TEST_SEED=<seed>)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from jax_dwdp.config import ConfigError, ModelConfig
from jax_dwdp.families import config_from_hf_dict
from jax_dwdp.kernels.ssd import ssd_chunked, ssd_step
from jax_dwdp.model import NemotronHForCausalLM, init_model
from jax_dwdp.nemotron_h_config import ATTENTION, MAMBA, NemotronHConfig, parse_pattern, pattern_of
from jax_dwdp.prefill import jit_decode_step, jit_prefill
from jax_dwdp.weights.hf_loader import load_hf_checkpoint
from jax_dwdp.weights.safetensors_reader import CheckpointError
from tests.nemotron_reference import (hf_config, hf_prefill_and_step, jit_prefill_and_step, random_hf_model, rel_err,
                                      to_jax)
from tests.ssd_cases import ssd_float64

TOLERANCE = 1e-4
# Chunks of 8 tokens so that every prompt spans several; time_step_min 0.05 so that the lower clamp of the time
# step bites on some steps (the random dt_bias puts softplus(dt) around it).
TINY = NemotronHConfig.preset("tiny").replace(chunk_size=8, time_step_min=0.05)
CONFIGS = {
    "plain": TINY,
    # LatentMoE: the routed experts at width 24 between fc1 / fc2; 4 expert groups of which 2 are kept.
    "latent": TINY.replace(layer_types=parse_pattern("MEM*E-"), moe_latent_size=24, n_group=4, topk_group=2,
                           num_experts_per_tok=3, routed_scaling_factor=2.5),
}


@pytest.fixture
def fresh_rng():
    seed = int(os.environ.get("NEMOTRON_TEST_SEED") or np.random.SeedSequence().entropy % (1 << 32))
    print(f"seed {seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
def test_ssd_chunked_scan_matches_a_float64_sequential_recurrence(fresh_rng, chunk_size):
    """Chunks shorter than, dividing and longer than the sequence; 3 heads per B/C group; a starting state; padded
    steps (dt = 0) at the end of one sequence leave its state at its own length."""
    bsz, t, h, p, g, n = 2, 37, 6, 4, 2, 5
    x = fresh_rng.standard_normal((bsz, t, h, p))
    dt = np.log1p(np.exp(fresh_rng.standard_normal((bsz, t, h)) - 1.0))
    dt[1, 23:] = 0.0
    a = -fresh_rng.uniform(0.2, 3.0, h)
    b, c = fresh_rng.standard_normal((2, bsz, t, g, n))
    state0 = fresh_rng.standard_normal((bsz, h, p, n))
    y_ref, final_ref = ssd_float64(x, dt, a, b, c, state0)
    _, final_at_23 = ssd_float64(x[1:, :23], dt[1:, :23], a, b[1:, :23], c[1:, :23], state0[1:])
    f32 = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    y, final = jax.jit(ssd_chunked, static_argnames="chunk_size")(f32(x), f32(dt), f32(a), f32(b), f32(c),
                                                                  chunk_size=chunk_size, initial_state=f32(state0))
    y_step, state_step = jax.jit(ssd_step)(f32(state0), f32(x[:, 0]), f32(dt[:, 0]), f32(a), f32(b[:, 0]),
                                           f32(c[:, 0]))
    _, step_ref = ssd_float64(x[:, :1], dt[:, :1], a, b[:, :1], c[:, :1], state0)
    errors = {"y": rel_err(y, y_ref), "state": rel_err(final, final_ref),
              "state at length": rel_err(final[1], final_at_23[0]), "step y": rel_err(y_step, y_ref[:, 0]),
              "step state": rel_err(state_step, step_ref)}
    print(f"chunk {chunk_size}: relative errors vs float64:", " ".join(f"{k}={v:.1e}" for k, v in errors.items()))
    assert y.dtype == final.dtype == jnp.float32
    for key, err in errors.items():
        assert err <= 1e-5, (key, err)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_caches_and_decode_step_match_transformers(fresh_rng, name):
    """A right-padded batch of unequal lengths: each sequence's logits and caches (K, V, conv state, SSM state) are
    those transformers computes for that sequence alone, and one decode step from the caches gives transformers'
    next-token logits."""
    cfg = CONFIGS[name]
    hf = random_hf_model(cfg, int(fresh_rng.integers(1 << 30)))
    model = to_jax(hf, cfg)
    t = int(fresh_rng.integers(20, 45))
    lengths = np.array([t, int(fresh_rng.integers(9, t)), int(fresh_rng.integers(1, 9))], np.int32)
    tokens = fresh_rng.integers(0, cfg.vocab_size, (3, t)).astype(np.int32)
    next_tokens = fresh_rng.integers(0, cfg.vocab_size, 3).astype(np.int32)
    prefill, step = jit_prefill_and_step(model)
    logits, cache = prefill(tokens, lengths)
    next_logits, next_cache = step(next_tokens, cache)
    assert cache.recurrent.dtype == jnp.float32
    assert cache.full_layer_ids == cfg.layer_ids(ATTENTION) and cache.linear_layer_ids == cfg.layer_ids(MAMBA)
    np.testing.assert_array_equal(next_cache.lengths, lengths + 1)
    worst: dict[str, float] = {}
    for i, n in enumerate(lengths):
        ref = hf_prefill_and_step(hf, tokens[i, :n], int(next_tokens[i]))
        errors = {"logits": rel_err(logits[i, :n], ref["logits"]), "key": rel_err(cache.key[:, i, :n], ref["key"]),
                  "value": rel_err(cache.value[:, i, :n], ref["value"]),
                  "conv": rel_err(cache.conv[:, i], ref["conv"]),
                  "ssm": rel_err(cache.recurrent[:, i], ref["recurrent"]),
                  "next logits": rel_err(next_logits[i], ref["next_logits"]),
                  "max |logits diff|": float(np.max(np.abs(np.asarray(logits[i, :n]) - ref["logits"])))}
        worst = {k: max(v, worst.get(k, 0.0)) for k, v in errors.items()}
    print(f"{name} {pattern_of(cfg.layer_types)} lengths {lengths.tolist()}: worst relative errors vs transformers:",
          " ".join(f"{k}={v:.1e}" for k, v in worst.items()))
    for key, err in worst.items():
        assert err <= TOLERANCE, f"{key}: {err:.3e} > {TOLERANCE}"


def test_the_time_step_clamp_is_exercised(fresh_rng):
    """The parity above would see a missing lower clamp of the time step: without it the logits move far past the
    tolerance (a negative control of the reference setup)."""
    hf = random_hf_model(TINY, int(fresh_rng.integers(1 << 30)))
    tokens = fresh_rng.integers(0, TINY.vocab_size, (1, 40)).astype(np.int32)
    ref = hf_prefill_and_step(hf, tokens[0], 0)["logits"]
    logits, _ = jit_prefill_and_step(to_jax(hf, TINY.replace(time_step_min=0.0)))[0](tokens, np.array([40]))
    err = rel_err(logits[0], ref)
    print(f"without the clamp: relative error {err:.1e}")
    assert err > 100 * TOLERANCE


def test_a_stage_holds_and_caches_only_its_own_layers():
    """Layers [0, 3) and [3, 6) of one seed are the whole model cut in two: the first stage's hidden states through
    the second give the whole model's logits, and each stage's cache has slots for its own Mamba-2 and attention
    layers only (the concatenation is the whole model's cache)."""
    cfg = NemotronHConfig.preset("tiny")  # M E * - M E
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 19)).astype(np.int32)
    lengths = jnp.array([19, 11])
    whole = init_model(cfg, dtype=jnp.float32, seed=3)
    first = init_model(cfg, dtype=jnp.float32, seed=3, end_layer=3)
    second = init_model(cfg, dtype=jnp.float32, seed=3, start_layer=3)
    logits, cache = nnx.jit(lambda m, x, n: m.prefill(x, n))(whole, tokens, lengths)
    h, cache0 = nnx.jit(lambda m, x, n: m.forward(x, n))(first, tokens, lengths)
    staged, cache1 = nnx.jit(lambda m, x, n: m.forward(x, n))(second, h, lengths)
    assert (cache0.linear_layer_ids, cache0.full_layer_ids) == ((0,), (2,))
    assert (cache1.linear_layer_ids, cache1.full_layer_ids) == ((4,), ())
    assert cache0.conv.shape[0] == cache0.recurrent.shape[0] == 1 and cache1.key.shape[0] == 0
    assert not hasattr(second, "embeddings") and not hasattr(first, "lm_head")
    joined = type(cache).concat_layers([cache0, cache1])
    np.testing.assert_allclose(staged, logits, rtol=1e-6, atol=1e-6)
    for leaf in ("key", "value", "conv", "recurrent"):
        np.testing.assert_allclose(getattr(joined, leaf), getattr(cache, leaf), rtol=1e-6, atol=1e-6)


def test_a_prompt_in_pieces_equals_one_prefill(fresh_rng):
    """Prefilling 13 + 16 tokens through the caches (conv state, SSM state, K/V) gives the logits and cache of one
    prefill of 29 tokens, with unequal piece lengths per sequence (one sequence adds nothing in the second piece)."""
    cfg = CONFIGS["latent"]
    model = init_model(cfg, dtype=jnp.float32, seed=int(fresh_rng.integers(1 << 30)))
    tokens = fresh_rng.integers(0, cfg.vocab_size, (2, 29)).astype(np.int32)
    run = nnx.jit(lambda m, x, n, c: m.prefill(x, n, cache=c))
    whole_logits, whole = nnx.jit(lambda m, x: m.prefill(x, cache_len=29))(model, tokens)
    first_logits, cache = nnx.jit(lambda m, x, n: m.prefill(x, n, cache_len=29))(
        model, tokens[:, :13], jnp.array([13, 13]))
    second = np.stack([tokens[0, 13:], np.zeros(16, np.int32)])
    second_logits, cache = run(model, second, jnp.array([16, 0]), cache)
    np.testing.assert_allclose(first_logits, whole_logits[:, :13], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(second_logits[0], whole_logits[0, 13:], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, [29, 13])
    np.testing.assert_allclose(cache.recurrent[:, 0], whole.recurrent[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cache.conv[:, 0], whole.conv[:, 0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cache.key[:, 0], whole.key[:, 0], rtol=1e-5, atol=1e-5)


def test_config_reads_what_transformers_writes_and_the_older_forms():
    """transformers' own config (as save_pretrained writes it) rebuilds the config; so do the pattern string and
    the names of older configs; the family is chosen by model_type."""
    for cfg in (*CONFIGS.values(), NemotronHConfig.preset("super-120b-a12b")):
        written = hf_config(cfg).to_dict()
        assert config_from_hf_dict(written) == cfg
    nano = NemotronHConfig.preset("nano-30b-a3b")
    legacy = {k: v for k, v in nano.to_hf_dict().items() if k != "layers_block_type"}
    legacy.update(hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
                  mamba_n_groups=legacy.pop("n_groups"), norm_eps=legacy.pop("layer_norm_epsilon"))
    assert config_from_hf_dict(legacy) == nano
    assert config_from_hf_dict({**nano.to_hf_dict(), "layers_block_type": ["mamba", "moe", "attention"]}).layer_types \
        == (MAMBA, "moe", ATTENTION)
    assert isinstance(config_from_hf_dict(ModelConfig.preset("tiny").to_hf_dict()), ModelConfig)


@pytest.mark.parametrize("change,message", [
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act"),
    ({"mamba_proj_bias": True}, "mamba_proj_bias"),
    ({"layers_block_type": None, "hybrid_override_pattern": "MEX"}, "unknown symbols"),
    ({"n_groups": 3}, "n_groups"),
    ({"n_group": 3}, "n_group"),
    ({"model_type": "nemotron"}, "unknown model_type"),
])
def test_config_refuses_what_it_cannot_run(change, message):
    raw = {**NemotronHConfig.preset("tiny").to_hf_dict(), **change}
    with pytest.raises(ConfigError, match=message):
        config_from_hf_dict({k: v for k, v in raw.items() if v is not None})


def test_presets_have_the_published_sizes():
    """Super 120B-A12B's parameter count equals its release's safetensors headers (docs/nemotron_h_spec.md):
    120,668,687,360 bf16 weights outside the MTP head, plus the fp32 correction bias of each of its 40 MoE layers.
    Nano 30B-A3B: its card's 31.6B total."""
    sup, nano = NemotronHConfig.preset("super-120b-a12b"), NemotronHConfig.preset("nano-30b-a3b")
    assert sup.param_counts()["total"] == 120_668_687_360 + 40 * 512
    assert (sup.num_hidden_layers, len(sup.layer_ids(ATTENTION)), len(sup.layer_ids(MAMBA))) == (88, 8, 40)
    assert [i for i, t in enumerate(sup.layer_types) if t == ATTENTION] == [7, 16, 25, 36, 47, 58, 69, 78]
    assert (nano.num_hidden_layers, len(nano.layer_ids(ATTENTION)), len(nano.layer_ids(MAMBA))) == (52, 6, 23)
    assert round(nano.param_counts()["total"] / 1e9, 1) == 31.6
    assert isinstance(init_model(NemotronHConfig.preset("tiny"), dtype=jnp.float32), NemotronHForCausalLM)


def test_prefill_flops_equal_a_hand_count_of_the_tiny_preset():
    """prefill_flops (the benchmarks' MFU) against the tiny preset's products counted by hand, 2 FLOPs a
    multiply-add: "ME*-ME", hidden 64; Mamba 8 heads x 8 dims, state 16, 2 groups, conv 4 over 64 + 2*2*16 = 128
    channels, in_proj to 64 + 128 + 8 = 200, chunks of 16; attention 4 heads (2 KV) of 16; MLP 96; MoE: 8 experts,
    top-2 of width 32, shared 48. Then the latent MoE (the routed experts at width 16) and a prompt shorter than a
    chunk."""
    tiny = NemotronHConfig.preset("tiny")
    t = 64  # 4 chunks: 8 positions of causal context inside a chunk on average
    ssd = 8 * (2 * 16 + 8 * 8) + 2 * 8 * 8 * 16  # C B^T per group, its product with dt x per head; states in / out
    mamba = 2 * (64 * 200 + 4 * 128 + ssd + 64 * 64)
    attention = 2 * (64 * (4 + 2 * 2) * 16 + 64 * 64 + 2 * 64 * (t / 2))  # projections; QK^T and PV
    mlp = 2 * (2 * 64 * 96)
    moe = 2 * (8 * 64 + 2 * (2 * 64 * 32) + 2 * 64 * 48)  # router, 2 routed experts, shared expert
    head = 2 * 512 * 64
    per_token = 2 * mamba + 2 * moe + attention + mlp
    assert tiny.prefill_flops(2, t, 2) == 2 * t * per_token + 2 * head == 25_427_968
    latent = tiny.replace(moe_latent_size=16)
    latent_moe = 2 * (8 * 64 + 2 * (2 * 16 * 32) + 2 * 64 * 16 + 2 * 64 * 48)  # + fc1 / fc2 latent projections
    assert latent.prefill_flops(1, t, 1) == t * (per_token + 2 * (latent_moe - moe)) + head
    short = 2 * (64 * 200 + 4 * 128 + 4 * (2 * 16 + 8 * 8) + 2 * 8 * 8 * 16 + 64 * 64)  # 4 positions on average
    assert tiny.layer_flops(MAMBA, 8) == short
    with pytest.raises(ConfigError, match="layer type"):
        tiny.layer_flops("mamba", 8)


def test_hf_checkpoint_loads_through_the_name_map(tmp_path, fresh_rng):
    """What transformers saves (the released layout: `backbone.`, per-expert pieces) loads into the model the name
    map builds, bit for bit; a stage's load reads only its layers; a missing expert piece is named."""
    cfg = CONFIGS["latent"]
    hf = random_hf_model(cfg, int(fresh_rng.integers(1 << 30)))
    hf.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    model, report = load_hf_checkpoint(tmp_path / "ckpt", dtype=jnp.float32)
    reference = to_jax(hf, cfg)
    assert isinstance(model, NemotronHForCausalLM) and report.tensors_loaded == len(hf.state_dict())
    for (path, got), (_, want) in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(reference))):
        np.testing.assert_array_equal(got[...], want[...], err_msg=str(path))
    stage, stage_report = load_hf_checkpoint(tmp_path / "ckpt", dtype=jnp.float32, start_layer=3)
    assert stage.start_layer == 3 and stage_report.skipped_other_layers > 0
    np.testing.assert_array_equal(stage.layers[1].mixer.experts.up_proj[...], model.layers[4].mixer.experts.up_proj[...])
    with safe_open(tmp_path / "ckpt" / "model.safetensors", "np") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    del tensors["backbone.layers.4.mixer.experts.5.up_proj.weight"]
    (tmp_path / "broken").mkdir()
    save_file(tensors, tmp_path / "broken" / "model.safetensors")
    (tmp_path / "broken" / "config.json").write_text((tmp_path / "ckpt" / "config.json").read_text())
    with pytest.raises(CheckpointError, match=r"missing tensor backbone\.layers\.4\.mixer\.experts\.5\.up_proj"):
        load_hf_checkpoint(tmp_path / "broken", dtype=jnp.float32)


@pytest.mark.parametrize("mode", ["whole", "layerwise"])
def test_jit_prefill_runs_the_family(fresh_rng, mode):
    """The engine's jit_prefill (one program, or one per layer type through the StageRunner) and jit_decode_step
    give the model's own prefill and decode on a right-padded batch."""
    cfg = CONFIGS["plain"]
    model = init_model(cfg, dtype=jnp.float32, seed=int(fresh_rng.integers(1 << 30)))
    tokens = fresh_rng.integers(0, cfg.vocab_size, (2, 21)).astype(np.int32)
    lengths = np.array([21, 12], np.int32)
    logits, cache = jit_prefill(model, logits="last", cache_len=22, mode=mode)(tokens, lengths)
    next_logits, _ = jit_decode_step(model)(np.argmax(logits, -1).astype(np.int32), cache)
    ref_logits, ref_cache = nnx.jit(lambda m, x, n: m.prefill(x, n, logits="last", cache_len=22))(
        model, tokens, lengths)
    ref_next, _ = nnx.jit(lambda m, x, c: m.decode_step(x, c))(model, np.argmax(ref_logits, -1).astype(np.int32),
                                                               ref_cache)
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(next_logits, ref_next, rtol=1e-5, atol=1e-5)
    for leaf in ("key", "value", "conv", "recurrent"):
        np.testing.assert_allclose(getattr(cache, leaf), getattr(ref_cache, leaf), rtol=1e-5, atol=1e-5)

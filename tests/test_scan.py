"""The scanned layer stack (jax_dwdp.scan): one program over stacked weights equals the layer-wise prefill, consumes
the model without a second copy, and refuses what it does not run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.prefill import InputError, jit_prefill
from jax_dwdp.scan import ScannedModel, jit_prefill_scanned, period_of
from tests.hf_reference import rel_err

CACHE_FIELDS = ("key", "value", "conv", "recurrent", "lengths")


@pytest.mark.parametrize("layers", [8, 10, 3])
def test_scanned_equals_layerwise(rng, layers):
    """fp32. 8 layers: two whole periods; 10: two periods and a tail of two linear layers; 3: one period of three
    linear layers. Variable lengths, every position's logits and a cache longer than the prompt: the same logits and
    caches as the layer-wise prefill of the same model (same seed) within 1e-6 (measured: equal)."""
    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=layers)
    tokens = rng.integers(0, cfg.vocab_size, (3, 70)).astype(np.int32)
    lengths = np.array([70, 1, 41], np.int32)
    want, want_cache = jit_prefill(init_model(cfg, dtype=jnp.float32, seed=3), layerwise=True, cache_len=80)(
        tokens, lengths)
    scanned = ScannedModel.from_model(init_model(cfg, dtype=jnp.float32, seed=3))
    period, blocks = period_of(cfg.layer_types, cfg.full_attention_interval)
    assert (scanned.blocks, len(scanned.tail)) == (blocks, layers - blocks * len(period))
    got, cache = jit_prefill_scanned(scanned, cache_len=80)(tokens, lengths)
    err = rel_err(got, want)
    print(f"{layers} layers ({blocks} blocks of {len(period)} + {len(scanned.tail)}): scanned vs layer-wise logits "
          f"{err:.1e}")
    assert err <= 1e-6
    assert (cache.full_layer_ids, cache.linear_layer_ids) == (want_cache.full_layer_ids, want_cache.linear_layer_ids)
    for field in CACHE_FIELDS:
        a, b = np.asarray(getattr(cache, field), np.float32), np.asarray(getattr(want_cache, field), np.float32)
        assert a.shape == b.shape, field
        assert a.size == 0 or np.abs(a - b).max() <= 1e-6 * max(np.abs(b).max(), 1.0), field


def test_scanned_bf16_within_the_bf16_bound(rng):
    """bf16, 9 layers: within the project's bf16 bound (2e-2) of the fp32 layer-wise prefill, residual branches
    damped as in the model's bf16 test. (Scanned and whole-program bf16 programs round differently from the
    layer-wise one by the same amount: 1.4e-2 / 1.3e-2 here, 0.17 for both undamped.)"""
    from tests.test_model import _damp_residual_branches

    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=9)
    tokens = rng.integers(0, cfg.vocab_size, (3, 70)).astype(np.int32)
    lengths = np.array([70, 1, 41], np.int32)
    want, _ = jit_prefill(_damp_residual_branches(init_model(cfg, dtype=jnp.float32, seed=3), 0.2),
                          layerwise=True)(tokens, lengths)
    scanned = ScannedModel.from_model(_damp_residual_branches(init_model(cfg, dtype=jnp.bfloat16, seed=3), 0.2))
    got, _ = jit_prefill_scanned(scanned)(tokens, lengths)
    err = rel_err(np.asarray(got, np.float32), want)
    print(f"scanned bf16 vs layer-wise fp32: {err:.1e}")
    assert err <= 2e-2


def test_last_logits_and_the_program_is_one(rng):
    """logits="last" equals the layer-wise prefill's; the compiled program holds one while loop (the scan) whatever
    the depth: 8 and 16 layers lower to the same number of layer bodies."""
    bodies = []
    for layers in (8, 16):
        cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=layers)
        tokens = rng.integers(0, cfg.vocab_size, (2, 24)).astype(np.int32)
        want, _ = jit_prefill(init_model(cfg, dtype=jnp.float32, seed=1), logits="last", layerwise=True)(tokens)
        prefill = jit_prefill_scanned(ScannedModel.from_model(init_model(cfg, dtype=jnp.float32, seed=1)),
                                      logits="last")
        got, _ = prefill(tokens)
        assert got.shape == want.shape and rel_err(got, want) <= 1e-6
        text = prefill.compile(tokens, None).as_text()
        bodies.append(text.count("while("))
    assert bodies[0] == bodies[1] >= 1


def live_bytes_while(monkeypatch, build):
    """(build()'s result, the live device bytes before, after every write into a stack, and after)."""
    from jax_dwdp import scan

    before = sum(a.nbytes for a in jax.live_arrays())
    peaks, put = [], scan._put

    def recording_put(stack, value, index):
        out = put(stack, value, index)
        peaks.append(sum(a.nbytes for a in jax.live_arrays()))
        return out

    monkeypatch.setattr(scan, "_put", recording_put)
    try:
        result = build()
    finally:
        monkeypatch.setattr(scan, "_put", put)
    return result, before, peaks, sum(a.nbytes for a in jax.live_arrays())


def test_the_model_is_consumed_without_a_second_copy(monkeypatch):
    """While restacking, the live device bytes never exceed the model plus one stacked weight (recorded after every
    write into a stack); afterwards they are those of one model, and the consumed model's layer weights are
    deleted."""
    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=8)
    model = init_model(cfg, dtype=jnp.float32, seed=0)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    scanned, before, peaks, after = live_bytes_while(monkeypatch, lambda: ScannedModel.from_model(model))
    largest = max(x.nbytes for x in jax.tree.leaves(scanned.stacked))
    print(f"model {model_bytes} B; live before {before}, peak while stacking {max(peaks)}, after {after}; largest "
          f"stacked weight {largest} B")
    assert max(peaks) <= before + largest  # never a second copy of the model
    assert after <= before  # nothing left twice (the shell shares the embedding and head arrays)
    assert sum(x.nbytes for x in jax.tree.leaves((scanned.stacked, scanned.tail, scanned.model_state))) == model_bytes
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(model.layers[0].mlp.experts.down_proj[...])


def test_refusals(rng):
    cfg = ModelConfig.preset("tiny")
    stage = init_model(cfg, dtype=jnp.float32, seed=0, start_layer=0, end_layer=2)
    with pytest.raises(ValueError, match="whole model"):
        jit_prefill_scanned(ScannedModel.from_model(stage))
    prefill = jit_prefill_scanned(ScannedModel.from_model(init_model(cfg, dtype=jnp.float32, seed=0)), cache_len=8)
    with pytest.raises(ValueError, match="shorter than the prompt"):
        prefill(rng.integers(0, cfg.vocab_size, (1, 16)).astype(np.int32))
    with pytest.raises(InputError, match="outside the vocabulary"):
        prefill(np.full((1, 4), cfg.vocab_size, np.int32))


def test_cli_scan_equals_layerwise(tmp_path):
    """`jax-dwdp prefill --scan` writes the same logits as --layerwise; --scan with --pipeline is one error line."""
    from jax_dwdp.cli import main

    base = ["prefill", "--preset", "tiny", "--batch", "2", "--seq-len", "20", "--dtype", "float32", "--iters", "1"]
    assert main(base + ["--layerwise", "--logits-out", str(tmp_path / "a.npy")]) == 0
    assert main(base + ["--scan", "--logits-out", str(tmp_path / "b.npy")]) == 0
    a, b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
    assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max()
    assert main(base + ["--scan", "--dwdp", "2"]) == 2
    assert main(base + ["--scan", "--layerwise"]) == 2


# --- pipeline stages, each one scanned program ------------------------------------------------------------------

PIPELINE_CASES = [  # (layers, stages, microbatches, boundaries): stages that start inside the 3 + 1 pattern
    (10, 2, 2, [5]),  # stage 1 = layers 5-9: period (linear, linear, full, linear), one block and a tail of one
    (10, 3, 4, [2, 7]),  # [0, 2): a period of two linear layers; [2, 7): (L, F, L, L) + a tail; [7, 10): (F, L, L)
    (10, 1, 2, None),  # one stage, two microbatches: two blocks and a tail of two
    (9, 2, 1, [4]),  # [4, 9): a stage that starts on the pattern's first layer, one block and a tail of one
]
PIPELINE_CASES = [pytest.param(*case, marks=pytest.mark.devices(case[1])) for case in PIPELINE_CASES]


@pytest.mark.parametrize("layers,stages,microbatches,boundaries", PIPELINE_CASES)
def test_scanned_pipeline_equals_layerwise_pipeline(rng, layers, stages, microbatches, boundaries):
    """fp32, stages on their own CPU devices: a pipeline whose stages are scanned programs gives the logits and
    per-stage caches of the layer-wise pipeline of the same layout (1e-6; measured equal or ~1e-7), each stage
    compiles one program for all its microbatches, and the caller's model is left usable (consume=False)."""
    from jax_dwdp.model.qwen35_moe import Cache
    from jax_dwdp.parallel import Pipeline

    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=layers)
    tokens = rng.integers(0, cfg.vocab_size, (4, 40)).astype(np.int32)
    lengths = np.array([40, 17, 1, 33], np.int32)
    model = init_model(cfg, dtype=jnp.float32, seed=5)
    want, want_caches = Pipeline.from_model(model, stages, boundaries=boundaries).prefill(
        tokens, lengths, microbatches=microbatches, cache_len=48, layerwise=True)
    pipe = Pipeline.from_model(model, stages, boundaries=boundaries, scan=True)
    got, caches = pipe.prefill(tokens, lengths, microbatches=microbatches, cache_len=48)
    assert got.devices() == {pipe.devices[-1]}
    shapes = [f"[{r.start_layer},{r.end_layer}) {r.describe()}" for r in pipe.runners]
    err = rel_err(got, want)
    print(f"{layers} layers, P={stages}, M={microbatches}, stages {shapes}: scanned vs layer-wise pipeline logits "
          f"{err:.1e}")
    assert err <= 1e-6
    for stage, (cache, want_cache) in enumerate(zip(caches, want_caches)):
        assert (cache.full_layer_ids, cache.linear_layer_ids) == (want_cache.full_layer_ids,
                                                                    want_cache.linear_layer_ids)
        for field in CACHE_FIELDS:
            a, b = np.asarray(getattr(cache, field), np.float32), np.asarray(getattr(want_cache, field), np.float32)
            assert a.shape == b.shape, (stage, field)
            assert a.size == 0 or np.abs(a - b).max() <= 1e-6 * max(np.abs(b).max(), 1.0), (stage, field)
        assert set(cache.key.devices()) == {pipe.devices[stage]}
    assert all(len(r._executables) == 1 for r in pipe.runners)  # one program per stage, every microbatch
    merged = Cache.concat_layers(caches, jax.devices()[0])
    assert merged.linear_layer_ids == cfg.layer_ids("linear_attention")
    again, _ = jit_prefill(model, layerwise=True, cache_len=48)(tokens, lengths)  # the model is still whole
    # (the whole batch at once against microbatches of one sequence: other GEMM shapes on the CPU, so other fp32
    # sums: 8.7e-6 with the MoE block's token projections apart, as at this size by default, 1.17e-5 with them
    # forced into one GEMM, whose other shape sums in another order)
    assert rel_err(again, want) <= 2e-5


@pytest.mark.devices(2)
def test_scanned_pipeline_refusals():
    from jax_dwdp.parallel import Pipeline

    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=4)
    model = init_model(cfg, dtype=jnp.float32, seed=0)
    with pytest.raises(ValueError, match="run layer-wise"):
        Pipeline.from_model(model, 1, dwdp=2, scan=True)
    pipe = Pipeline.from_model(model, 2, scan=True)
    with pytest.raises(ValueError, match="scanned programs"):
        pipe.prefill(np.zeros((1, 4), np.int32) + 1, layerwise=True)


@pytest.mark.devices(2)
def test_cli_scanned_pipeline_equals_layerwise(tmp_path):
    """`jax-dwdp prefill --pipeline 2 --microbatches 2 --scan` writes the layer-wise pipeline's logits."""
    from jax_dwdp.cli import main

    base = ["prefill", "--preset", "tiny", "--batch", "2", "--seq-len", "20", "--dtype", "float32", "--iters", "1",
            "--pipeline", "2", "--microbatches", "2"]
    assert main(base + ["--layerwise", "--logits-out", str(tmp_path / "a.npy")]) == 0
    assert main(base + ["--scan", "--logits-out", str(tmp_path / "b.npy")]) == 0
    a, b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
    assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max()


# --- built one layer at a time straight into the stacks ----------------------------------------------------------

def test_from_layers_equals_from_model_with_one_layer_beside_the_stacks(monkeypatch):
    """`ScannedModel.from_layers` (one layer made at a time, written into its stacks, then freed) gives from_model's
    stacks bit for bit, for the whole model and for a stage starting inside the pattern; while it builds, the live
    device bytes never exceed the range's weights plus one layer's (recorded after every write), and afterwards
    they are the range's weights: no layer was ever held twice."""
    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=10)

    def make(a, b):
        return init_model(cfg, dtype=jnp.float32, seed=3, start_layer=a, end_layer=b)

    for start, end in ((0, 10), (3, 9)):
        want = ScannedModel.from_model(make(start, end))
        layer_bytes = max(sum(x.nbytes for x in jax.tree.leaves(nnx.state(make(i, i + 1).layers[0])))
                          for i in range(start, end))
        range_bytes = sum(x.nbytes for x in jax.tree.leaves((want.stacked, want.tail, want.model_state)))
        got, before, peaks, after = live_bytes_while(monkeypatch, lambda: ScannedModel.from_layers(cfg, make, start,
                                                                                                    end))
        print(f"[{start}, {end}) {got.describe()}: range {range_bytes} B, one layer <= {layer_bytes} B; live bytes "
              f"added while building: peak {max(peaks) - before}, after {after - before}")
        assert max(peaks) - before <= range_bytes + layer_bytes
        assert after - before <= range_bytes
        assert (got.period, got.blocks, got.tail_types) == (want.period, want.blocks, want.tail_types)
        assert (got.full_layer_ids, got.linear_layer_ids, got.is_first, got.is_last) == (
            want.full_layer_ids, want.linear_layer_ids, want.is_first, want.is_last)
        assert got.model_graph == want.model_graph and got.graphs == want.graphs
        for a, b in zip(jax.tree.leaves((want.stacked, want.tail, want.model_state)),
                        jax.tree.leaves((got.stacked, got.tail, got.model_state)), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        del want, got


@pytest.mark.devices(2)
def test_scanned_from_an_hf_checkpoint_cli_and_pipeline(tmp_path, rng):
    """A real (random) HF checkpoint: `prefill --checkpoint DIR --scan` (the model loaded layer by layer into its
    stacks) writes the layer-wise command's logits, and a scanned pipeline loaded from it equals the layer-wise
    pipeline, each stage's load report counting its own tensors once."""
    from jax_dwdp.cli import main
    from jax_dwdp.parallel import Pipeline
    from tests.hf_reference import random_hf_model, save_hf

    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=6)
    hf = random_hf_model(cfg, int(rng.integers(1 << 30)))
    ckpt = save_hf(hf, tmp_path / "hf")
    base = ["prefill", "--checkpoint", str(ckpt), "--batch", "2", "--seq-len", "20", "--dtype", "float32",
            "--iters", "1"]
    assert main(base + ["--layerwise", "--logits-out", str(tmp_path / "a.npy")]) == 0
    assert main(base + ["--scan", "--logits-out", str(tmp_path / "b.npy")]) == 0
    a, b = np.load(tmp_path / "a.npy"), np.load(tmp_path / "b.npy")
    assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max()

    tokens = rng.integers(0, cfg.vocab_size, (2, 20)).astype(np.int32)
    want, _ = Pipeline.from_checkpoint(ckpt, 2, dtype=jnp.float32, boundaries=[3]).prefill(tokens, layerwise=True)
    pipe = Pipeline.from_checkpoint(ckpt, 2, dtype=jnp.float32, boundaries=[3], scan=True)
    got, _ = pipe.prefill(tokens, microbatches=2)
    assert rel_err(got, want) <= 1e-5
    state = hf.state_dict()
    for spec, report in zip(pipe.stages, pipe.load_reports, strict=True):
        own = [k for k in state if any(k.startswith(f"model.layers.{i}.") for i in range(spec.start_layer,
                                                                                            spec.end_layer))]
        own += ["model.embed_tokens.weight"] if spec.start_layer == 0 else ["model.norm.weight", "lm_head.weight"]
        assert report.tensors_loaded == len(own) and report.bytes_read == sum(state[k].numel() * 4 for k in own)

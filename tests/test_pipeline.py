"""Pipeline parallelism on CPU devices: stage layout, stage-local weights and caches, equality with one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.model.qwen35_moe import Cache
from jax_dwdp.parallel import Pipeline, make_mesh, plan_stages
from jax_dwdp.prefill import jit_prefill
from tests.hf_reference import random_hf_model, rel_err, save_hf

BASE = ModelConfig.preset("tiny").replace(vocab_size=90, hidden_size=32, num_experts=6, num_experts_per_tok=2)


def model_with_layers(n: int) -> ModelConfig:
    return BASE.replace(num_hidden_layers=n)


@pytest.fixture(scope="module")
def references():
    """One-device fp32 prefill of a 6- and a 10-layer model on the same batch: the ground truth."""
    out = {}
    tokens = np.random.default_rng(123).integers(0, BASE.vocab_size, (4, 70)).astype(np.int32)
    lengths = np.array([70, 52, 70, 9], np.int32)
    for n in (6, 10):
        model = init_model(model_with_layers(n), dtype=jnp.float32, seed=n)
        logits, cache = jit_prefill(model, logits="all", cache_len=72)(tokens, lengths)
        out[n] = (model, logits, cache)
    return tokens, lengths, out


def test_even_split_gives_remainder_to_earlier_stages():
    stages = plan_stages(model_with_layers(10), 4)
    assert [(s.start_layer, s.end_layer) for s in stages] == [(0, 3), (3, 6), (6, 8), (8, 10)]
    # Layer 3 is the first full-attention layer: stage 1 starts on it, inside the 3 + 1 pattern.
    assert stages[0].linear_attention_layers == (0, 1, 2) and stages[0].full_attention_layers == ()
    assert stages[1].full_attention_layers == (3,) and stages[1].linear_attention_layers == (4, 5)
    assert stages[2].full_attention_layers == (7,) and stages[3].linear_attention_layers == (8, 9)


def test_explicit_boundaries_and_bad_layouts():
    cfg = model_with_layers(6)
    assert [(s.start_layer, s.end_layer) for s in plan_stages(cfg, 3, [1, 5])] == [(0, 1), (1, 5), (5, 6)]
    with pytest.raises(ValueError, match="7 pipeline stages for 6 layers"):
        plan_stages(cfg, 7)
    with pytest.raises(ValueError, match="empty stage"):
        plan_stages(cfg, 3, [2, 2])
    with pytest.raises(ValueError, match="need 2 boundaries"):
        plan_stages(cfg, 3, [2])
    with pytest.raises(ValueError, match="empty stage"):
        plan_stages(cfg, 2, [6])
    with pytest.raises(ValueError, match="needs 16 devices"):
        make_mesh(4, 4)


CASES = [  # (layers, stages, microbatches, boundaries)
    (6, 2, 1, None),
    (6, 2, 2, None),
    (6, 3, 4, [1, 4]),
    (10, 3, 2, None),
    (10, 4, 4, None),
    (6, 4, 1, [1, 2, 5]),
]


def errors(logits, merged, ref_logits, ref_cache) -> dict[str, float]:
    errs = {"logits": rel_err(logits, ref_logits)}
    for name in ("key", "value", "conv", "recurrent"):
        errs[name] = rel_err(getattr(merged, name), getattr(ref_cache, name))
    return errs


@pytest.mark.parametrize("layers,stages,microbatches,boundaries",
                         [pytest.param(*case, marks=pytest.mark.devices(case[1])) for case in CASES])
def test_pipeline_equals_one_device(references, layers, stages, microbatches, boundaries):
    """Against P = 1 with the same microbatches: 1e-5. Against the unsplit one-device batch: 1e-4, since a
    microbatch of another batch size changes fp32 summation order (1e-7..3e-5 seen), nothing else."""
    tokens, lengths, refs = references
    model, ref_logits, ref_cache = refs[layers]
    pipe = Pipeline.from_model(model, stages, boundaries=boundaries)
    logits, caches = pipe.prefill(tokens, lengths, microbatches=microbatches, cache_len=72)
    assert logits.devices() == {pipe.devices[-1]}
    merged = Cache.concat_layers(caches, jax.devices()[0])
    assert merged.full_layer_ids == ref_cache.full_layer_ids
    assert merged.linear_layer_ids == ref_cache.linear_layer_ids
    np.testing.assert_array_equal(merged.lengths, lengths)
    one_logits, one_caches = Pipeline.from_model(model, 1).prefill(tokens, lengths, microbatches=microbatches,
                                                                   cache_len=72)
    vs_p1 = errors(logits, merged, one_logits, one_caches[0])
    vs_unsplit = errors(logits, merged, ref_logits, ref_cache)
    print(f"P={stages} M={microbatches} layers={layers} vs P=1:", " ".join(f"{k}={v:.1e}" for k, v in vs_p1.items()),
          "| vs unsplit batch:", " ".join(f"{k}={v:.1e}" for k, v in vs_unsplit.items()))
    for name in vs_p1:
        assert vs_p1[name] <= 1e-5, (name, vs_p1[name])
        assert vs_unsplit[name] <= 1e-4, (name, vs_unsplit[name])


@pytest.mark.devices(2)
@pytest.mark.parametrize("stages,dwdp", [(2, 1), (1, 2)])
def test_pipeline_keeps_the_fused_swiglu_layout(references, stages, dwdp):
    """Stages cut from a model in the fused-SwiGLU layout carry the layout with the weights (not re-permuted), also
    with the experts split over DWDP ranks (the split is along experts, the permutation within each)."""
    from jax_dwdp.model import fused_swiglu_enabled

    tokens, lengths, refs = references
    _, ref_logits, _ = refs[6]
    model = init_model(model_with_layers(6), dtype=jnp.float32, seed=6, fused_swiglu=True)  # refs[6], permuted
    pipe = Pipeline.from_model(model, stages, dwdp=dwdp)
    assert all(fused_swiglu_enabled(m) for m in pipe.models)
    for layerwise in (False, True):
        logits, _ = pipe.prefill(tokens, lengths, cache_len=72, layerwise=layerwise)
        err = rel_err(logits, ref_logits)
        print(f"P={stages} N={dwdp} layerwise={layerwise} from a fused-SwiGLU-layout model vs the unsplit "
              f"checkpoint-layout model: {err:.1e}")
        assert err <= 1e-4


@pytest.mark.devices(3)
def test_stage_cache_has_one_slot_per_own_linear_layer(references):
    """Regression for the seed bug: a stage's linear-attention cache is sized by its own linear layers (not the
    model's), and slot i holds the state of the stage's i-th linear layer."""
    tokens, lengths, refs = references
    model, _, ref_cache = refs[10]
    pipe = Pipeline.from_model(model, 3)
    _, caches = pipe.prefill(tokens, lengths, cache_len=72)
    for spec, cache, stage_model in zip(pipe.stages, caches, pipe.models):
        assert cache.linear_layer_ids == spec.linear_attention_layers
        assert cache.conv.shape[0] == cache.recurrent.shape[0] == len(spec.linear_attention_layers)
        assert cache.key.shape[0] == len(spec.full_attention_layers)
        assert [layer.layer_id for layer in stage_model.layers] == list(range(spec.start_layer, spec.end_layer))
        for slot, layer_id in enumerate(spec.linear_attention_layers):
            global_slot = ref_cache.linear_layer_ids.index(layer_id)
            assert rel_err(cache.recurrent[slot], ref_cache.recurrent[global_slot]) <= 1e-5
            # ... and not any other layer's state.
            for other in range(ref_cache.recurrent.shape[0]):
                if other != global_slot:
                    assert rel_err(cache.recurrent[slot], ref_cache.recurrent[other]) > 1e-2
        for slot, layer_id in enumerate(spec.full_attention_layers):
            assert rel_err(cache.key[slot], ref_cache.key[ref_cache.full_layer_ids.index(layer_id)]) <= 1e-5


@pytest.mark.devices(3)
def test_stages_hold_only_their_weights_and_read_only_their_tensors(tmp_path, rng):
    cfg = model_with_layers(6)
    hf = random_hf_model(cfg, int(rng.integers(1 << 30)))
    ckpt = save_hf(hf, tmp_path / "hf")
    pipe = Pipeline.from_checkpoint(ckpt, 3, dtype=jnp.float32, boundaries=[1, 4])
    state = hf.state_dict()
    for spec, report, model in zip(pipe.stages, pipe.load_reports, pipe.models):
        own = [k for k in state if any(k.startswith(f"model.layers.{i}.") for i in range(spec.start_layer, spec.end_layer))]
        if spec.start_layer == 0:
            own.append("model.embed_tokens.weight")
        if spec.end_layer == cfg.num_hidden_layers:
            own += ["model.norm.weight", "lm_head.weight"]
        assert report.bytes_read == sum(state[k].numel() * 4 for k in own), spec
        assert report.tensors_loaded == len(own)
        leaves = jax.tree.leaves(nnx_state(model))
        assert {d for x in leaves for d in x.devices()} == {pipe.devices[spec.stage]}
    tokens = rng.integers(0, cfg.vocab_size, (2, 20)).astype(np.int32)
    logits, _ = pipe.prefill(tokens, microbatches=2)
    whole, _ = Pipeline.from_checkpoint(ckpt, 1, dtype=jnp.float32).prefill(tokens)
    assert rel_err(logits, whole) <= 1e-5


def nnx_state(model):
    from flax import nnx

    return nnx.state(model)


@pytest.mark.devices(4)
def test_random_weights_depend_on_the_global_layer_not_the_layout():
    """One --seed is one model: every pipeline / DWDP layout of random weights gives the one-device logits (the
    stages used to be seeded seed + stage, a different model per layout)."""
    cfg = model_with_layers(6)
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, (4, 24)).astype(np.int32)
    want, _ = Pipeline.random(cfg, 1, dtype=jnp.float32, seed=3).prefill(tokens)
    for pipeline, dwdp, boundaries in [(2, 1, None), (3, 1, [1, 4]), (1, 2, None), (2, 2, None)]:
        got, _ = Pipeline.random(cfg, pipeline, dwdp=dwdp, dtype=jnp.float32, seed=3,
                                 boundaries=boundaries).prefill(tokens, microbatches=2 if dwdp == 1 else 1)
        err = rel_err(got, want)
        print(f"random weights, seed 3, P={pipeline} N={dwdp} boundaries={boundaries}: vs one device {err:.1e}")
        assert err <= 1e-4, (pipeline, dwdp, err)
    other, _ = Pipeline.random(cfg, 1, dtype=jnp.float32, seed=4).prefill(tokens)
    assert rel_err(other, want) > 0.1  # the seed still matters


def test_cli_refuses_impossible_layouts_before_building_the_model(capsys, monkeypatch):
    from jax_dwdp.cli import main
    from jax_dwdp.parallel import pipeline

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the layout was checked")
    monkeypatch.setattr(pipeline, "init_model", no_model)
    for argv, message in [
        (["--pipeline", "2", "--dwdp", "2", "--microbatches", "0", "--batch", "2"],
         "--microbatches must be >= 1, got 0"),
        (["--dwdp", "9", "--batch", "9"], "9 DWDP ranks for 8 experts: a rank would own none"),
        (["--stage-boundaries", "2"], "--stage-boundaries needs --pipeline P with P >= 2 stages"),
    ]:
        code = main(["prefill", "--preset", "tiny", *argv])
        out, err = capsys.readouterr()
        assert code == 2 and err.strip() == f"error: {message}" and out == "", (argv, err)


@pytest.mark.devices(2)
def test_cli_closes_the_pipeline_it_opens(capsys, monkeypatch):
    """On success and on a failure after the pipeline was built, the CLI closes it (an FFI pipeline's stores)."""
    from jax_dwdp.cli import main

    closed = []
    original = Pipeline.close
    monkeypatch.setattr(Pipeline, "close", lambda self, exc=None: closed.append(exc) or original(self, exc))
    argv = ["prefill", "--preset", "tiny", "--dwdp", "2", "--batch", "2", "--seq-len", "8", "--iters", "1", "--json"]
    assert main(argv) == 0 and closed == [None]
    monkeypatch.setattr(Pipeline, "prefill", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost")))
    assert main(argv) == 1 and len(closed) == 2 and isinstance(closed[1], RuntimeError)
    assert "error: RuntimeError: device lost" in capsys.readouterr().err


@pytest.mark.devices(3)
def test_stage_threads_give_the_one_thread_results(references, monkeypatch):
    """Each stage enqueued from its own host thread (the default with several stages in one process) gives the same
    logits and caches, bit for bit, as one thread going stage by stage; both for layer-wise and whole-stage
    programs."""
    from jax_dwdp.parallel import pipeline

    tokens, lengths, refs = references
    model, _, _ = refs[10]
    pipe = Pipeline.from_model(model, 3, boundaries=[2, 7])
    threaded = []
    real = pipeline._stages_in_threads
    monkeypatch.setattr(pipeline, "_stages_in_threads", lambda *a: threaded.append(1) or real(*a))
    for layerwise in (False, True):
        a, ca = pipe.prefill(tokens, lengths, microbatches=4, cache_len=72, layerwise=layerwise, stage_threads=True)
        b, cb = pipe.prefill(tokens, lengths, microbatches=4, cache_len=72, layerwise=layerwise, stage_threads=False)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for x, y in zip(ca, cb):
            for name in ("key", "value", "conv", "recurrent", "lengths"):
                np.testing.assert_array_equal(np.asarray(getattr(x, name)), np.asarray(getattr(y, name)))
    assert len(threaded) == 2  # the default took the threads, stage_threads=False did not


@pytest.mark.devices(3)
def test_stage_threads_run_stages_at_once_on_the_cpu(references, monkeypatch):
    """On CPU devices, as on GPUs, the stage threads run several stages' programs at once and get the one-thread
    result: nothing left in a stage's program waits on XLA's CPU thread pool for work that needs another of its
    threads (see gated_delta_rule.unit_lower_inverse). Each stage's call is held for a moment so that the threads
    overlap."""
    import threading
    import time

    tokens, lengths, refs = references
    model, _, _ = refs[6]
    pipe = Pipeline.from_model(model, 3)
    assert pipe.devices[0].platform == "cpu"
    inside, most, lock = [0], [0], threading.Lock()

    def held(runner):
        def run(*args, **kw):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.05)
            try:
                return runner(*args, **kw)
            finally:
                with lock:
                    inside[0] -= 1
        return run

    want, _ = pipe.prefill(tokens, lengths, microbatches=4, cache_len=72, stage_threads=False)
    monkeypatch.setattr(pipe, "runners", [held(r) for r in pipe.runners])
    got, _ = pipe.prefill(tokens, lengths, microbatches=4, cache_len=72, stage_threads=True)
    assert most[0] > 1, "the stage threads never overlapped"
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.devices(3)
def test_a_failing_stage_stops_every_stage_thread(references, monkeypatch):
    """A stage that raises on its second microbatch: prefill raises that error, the later stages stop without
    waiting forever for its output, and no stage thread is left running."""
    import threading

    tokens, lengths, refs = references
    model, _, _ = refs[6]
    pipe = Pipeline.from_model(model, 3)
    calls = []
    runner = pipe.runners[1]

    def failing(x, lens, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("stage 1 broke on microbatch 1")
        return runner(x, lens, **kw)

    monkeypatch.setattr(pipe, "runners", [pipe.runners[0], failing, pipe.runners[2]])
    with pytest.raises(RuntimeError, match="stage 1 broke on microbatch 1"):
        pipe.prefill(tokens, lengths, microbatches=4, cache_len=72)
    assert not [t for t in threading.enumerate() if t.name.startswith("pipeline-stage")]
    assert len(calls) == 2  # stage 1 took no microbatch after its failure


@pytest.mark.devices(3)
def test_ctrl_c_while_the_stage_threads_run_stops_and_waits_for_them(references, monkeypatch):
    """Ctrl-C while prefill waits for its stage threads: KeyboardInterrupt comes out of prefill only once every stage
    thread has finished its current step and stopped (none left running with a pipeline that its caller is about to
    close), and the stages take no further microbatch."""
    import threading

    tokens, lengths, refs = references
    model, _, _ = refs[6]
    pipe = Pipeline.from_model(model, 3)
    calls = []

    def counted(runner):
        def run(*args, **kw):
            calls.append(1)
            return runner(*args, **kw)
        return run

    monkeypatch.setattr(pipe, "runners", [counted(r) for r in pipe.runners])
    real_join, interrupted = threading.Thread.join, []

    def join_interrupted_once(self, *args, **kw):
        if not interrupted:
            interrupted.append(1)
            raise KeyboardInterrupt
        return real_join(self, *args, **kw)

    monkeypatch.setattr(threading.Thread, "join", join_interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        pipe.prefill(tokens, lengths, microbatches=4, cache_len=72)
    monkeypatch.setattr(threading.Thread, "join", real_join)
    assert not [t for t in threading.enumerate() if t.name.startswith("pipeline-stage")]
    assert len(calls) < 3 * 4  # stopped before every stage had run every microbatch

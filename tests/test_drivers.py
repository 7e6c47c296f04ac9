"""The engine's one vocabulary: a driver built from a spec runs what the CLI runs (its inputs made and checked by
`prefill_inputs`, built and measured by `run_prefill`), the expert backend is one object looked up by its word, the
execution mode one value checked in one place, and a model's kernel choices survive every way a driver builds its
stages (placed on ranks, restacked for a scan, loaded one layer at a time)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp import driver as driver_module
from jax_dwdp.config import ModelConfig
from jax_dwdp.driver import (Driver, PrefillSpec, SpecError, build_driver, not_finite, prefill_bytes_lower_bound,
                             prefill_inputs, random_tokens, read_tokens, run_prefill)
from jax_dwdp.kernels.choices import KernelChoices
from jax_dwdp.model import init_model
from jax_dwdp.parallel import BACKENDS, ExpertBackend, IndependentRanks, Pipeline, expert_backend
from jax_dwdp.parallel.backends import DepBackend, FfiBackend, LocalBackend, XlaBackend
from jax_dwdp.plan import plan_layout
from jax_dwdp.prefill import InputError, jit_prefill
from jax_dwdp.runner import DEFAULT_MODE, MODES, execution_mode
from jax_dwdp.scan import ScannedModel

CFG = ModelConfig.preset("tiny")


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, CFG.vocab_size, (2, 24)).astype(np.int32)
    return tokens, np.array([24, 17], np.int32)


@pytest.fixture(scope="module")
def reference(inputs):
    """float32 logits of every position, one device, the model PrefillSpec(preset="tiny", seed=0) names."""
    with jax.default_matmul_precision("highest"):
        logits, _ = jit_prefill(init_model(CFG, dtype=jnp.float32, seed=0), logits="all")(*inputs)
    return np.asarray(logits)


def _close(name, got, want, bound=1e-5):
    err = float(np.max(np.abs(np.asarray(got) - want)) / np.max(np.abs(want)))
    print(f"{name}: max relative error vs one device {err:.1e} (bound {bound:g})")
    assert err <= bound, name


@pytest.mark.parametrize("fields", [
    dict(),                                              # jit_prefill, whole program
    dict(mode="layerwise"),
    dict(mode="scanned"),                                # ScannedModel on one device
    dict(prefill_chunk=10),                              # pieces continuing the cache
    pytest.param(dict(pipeline=2, mode="scanned"), marks=pytest.mark.devices(2)),
    pytest.param(dict(ranks=2, experts="xla", microbatches=2), marks=pytest.mark.devices(2)),
    pytest.param(dict(ranks=2, experts="dep"), marks=pytest.mark.devices(2)),
], ids=["whole", "layerwise", "scanned", "chunked", "pipeline-scanned", "xla-microbatches", "dep"])
def test_a_driver_from_a_spec_equals_one_device(inputs, reference, fields):
    spec = PrefillSpec(preset="tiny", dtype="float32", logits="all", **fields)
    with jax.default_matmul_precision("highest"), build_driver(spec, batch=2) as driver:
        logits, caches = driver.run(*inputs)
    assert len(caches) == spec.pipeline
    lengths = inputs[1]
    valid = np.arange(reference.shape[1])[None, :] < lengths[:, None]  # (padding positions: no prefill defines them)
    _close(driver.description, np.asarray(logits)[valid], reference[valid])


def test_a_spec_names_one_source_of_weights_and_a_known_mode():
    with pytest.raises(ValueError, match="checkpoint or a preset"):
        PrefillSpec()
    with pytest.raises(ValueError, match="checkpoint or a preset"):
        PrefillSpec(preset="tiny", checkpoint="somewhere")
    with pytest.raises(ValueError, match="mode 'fast': choose one of whole, layerwise, scanned"):
        PrefillSpec(preset="tiny", mode="fast")
    with pytest.raises(ValueError, match=r"num_layers must lie in \[1, 4\]"):
        PrefillSpec(preset="tiny", num_layers=9).config()
    assert PrefillSpec(preset="tiny", num_layers=2).config().num_hidden_layers == 2


def test_prefill_inputs_draw_or_check_the_tokens():
    spec = PrefillSpec(preset="tiny", seed=5)
    tokens, lengths = prefill_inputs(spec, CFG, batch=2, seq_len=7)
    want = np.random.default_rng(5).integers(0, CFG.vocab_size, (2, 7))
    assert tokens.dtype == np.int32 and (tokens == want).all() and (tokens == random_tokens(CFG.vocab_size, 2, 7, 5)).all()
    assert lengths.tolist() == [7, 7]
    tokens, lengths = prefill_inputs(spec, CFG, [[1, 2, 3], [4, 5, 0]], [3, 2])
    assert tokens.dtype == np.int32 and tokens.shape == (2, 3) and lengths.tolist() == [3, 2]
    with pytest.raises(InputError, match=f"token id {CFG.vocab_size} is outside the vocabulary"):
        prefill_inputs(spec, CFG, [[1, CFG.vocab_size]])
    with pytest.raises(InputError, match=r"lengths must lie in \[1, 2\]"):
        prefill_inputs(spec, CFG, [[1, 2]], [3])
    with pytest.raises(ValueError, match="9 DWDP ranks for 8 experts: a rank would own none"):
        prefill_inputs(PrefillSpec(preset="tiny", ranks=9), CFG, batch=9, seq_len=4)


def test_prefill_inputs_refuse_what_exceeds_the_hosts_memory_before_drawing(monkeypatch):
    """The bound counts the tokens, caches, hidden states and the logits asked for (all positions' or the last's);
    random ids are not drawn when it is exceeded, given ones are measured by their shape."""
    need = prefill_bytes_lower_bound(CFG, "bfloat16", 3, 16, all_logits=False)
    assert need["total"] < prefill_bytes_lower_bound(CFG, "bfloat16", 3, 16, all_logits=True)["total"]
    monkeypatch.setattr(driver_module, "host_memory_bytes", lambda: need["total"])
    spec = PrefillSpec(preset="tiny")
    assert prefill_inputs(spec, CFG, batch=3, seq_len=16)[0].shape == (3, 16)  # exactly fits
    monkeypatch.setattr(driver_module, "random_tokens", lambda *a: pytest.fail("drew the ids before the check"))
    with pytest.raises(InputError, match=r"^a batch of 3 x 17 tokens needs at least .*, more than this machine's "):
        prefill_inputs(spec, CFG, batch=3, seq_len=17)
    with pytest.raises(InputError, match="a batch of 3 x 16 tokens needs at least"):
        prefill_inputs(PrefillSpec(preset="tiny", logits="all"), CFG, np.zeros((3, 16), np.int32))


def test_read_tokens_names_the_file_it_cannot_read(tmp_path):
    np.save(tmp_path / "ok.npy", np.arange(6, dtype=np.int64).reshape(2, 3))
    assert read_tokens(tmp_path / "ok.npy").tolist() == [[0, 1, 2], [3, 4, 5]]
    (tmp_path / "garbage.npy").write_bytes(b"not numpy")
    np.save(tmp_path / "objects.npy", np.array([[1, "a"]], dtype=object), allow_pickle=True)
    for name, message in [("missing.npy", "no such file"), ("", "is not a regular file"),
                          ("garbage.npy", "not a readable .npy file"), ("objects.npy", "not a readable .npy file")]:
        with pytest.raises(InputError, match=f"^{tmp_path / name if name else tmp_path}: {message}"):
            read_tokens(tmp_path / name if name else tmp_path)


def test_run_prefill_builds_measures_and_says_so(inputs):
    said = []
    result = run_prefill(PrefillSpec(preset="tiny", dtype="float32"), CFG, *inputs, iters=1, status=said.append)
    assert said == ["making random weights", "compiling", "running 1 warm-up and 1 timed prefills"]
    assert result["batch"] == 2 and result["seq_len"] == 24 and result["dtype"] == "float32"
    assert np.asarray(result["logits"]).shape == (2, CFG.vocab_size) and len(result["caches"]) == 1
    assert not_finite(result["logits"], result["caches"]) is None
    assert "(2 of 2 values NaN or Inf); every layer's cache is finite, so they arose in the final norm or the head" \
        in not_finite(np.full((1, 2), np.nan), result["caches"])


def test_run_prefill_runs_float32_at_full_precision_and_restores_it(inputs, monkeypatch):
    seen = []
    monkeypatch.setattr(driver_module, "measure", lambda *a, **k: seen.append(jax.config.jax_default_matmul_precision)
                        or {"numbers": 1})
    before = jax.config.jax_default_matmul_precision
    assert run_prefill(PrefillSpec(preset="tiny", dtype="float32"), CFG, *inputs) == {"numbers": 1}
    assert run_prefill(PrefillSpec(preset="tiny"), CFG, *inputs) == {"numbers": 1}
    assert seen == ["highest", before] and jax.config.jax_default_matmul_precision == before


def test_run_prefill_refuses_a_spec_it_cannot_build_and_skips_a_process_that_does_not_report(inputs, monkeypatch):
    with pytest.raises(SpecError, match="^5 pipeline stages for 4 layers: every stage needs at least one layer$"):
        run_prefill(PrefillSpec(preset="tiny", pipeline=5), CFG, *inputs)
    monkeypatch.setattr(driver_module, "measure", lambda *a, **k: {"numbers": 1})
    closed = []
    monkeypatch.setattr(driver_module, "build_driver", lambda spec, cfg, batch: Driver(
        spec, cfg, None, None, "not the reporter", close=closed.append, reports=False))
    assert run_prefill(PrefillSpec(preset="tiny"), CFG, *inputs) is None and closed == [None]


def test_a_plan_takes_a_dtype_or_its_name():
    assert plan_layout(CFG, 2, 2, "float32") == plan_layout(CFG, 2, 2, jnp.float32)


def test_the_execution_mode_is_one_value_checked_in_one_place():
    assert MODES == ("whole", "layerwise", "scanned") and DEFAULT_MODE == "whole"
    assert execution_mode() == "whole"
    assert execution_mode(layerwise=True) == "layerwise" == execution_mode("layerwise", layerwise=True)
    assert execution_mode(scan=True) == "scanned"
    with pytest.raises(ValueError, match="one execution mode at a time"):
        execution_mode(layerwise=True, scan=True)
    with pytest.raises(ValueError, match="give one of them"):
        execution_mode("whole", layerwise=True)
    model = init_model(CFG, dtype=jnp.float32)
    with pytest.raises(ValueError, match="jit_prefill_scanned"):
        jit_prefill(model, mode="scanned")


def test_the_backend_word_is_looked_up_once_in_one_registry():
    assert BACKENDS == {"local": LocalBackend, "xla": XlaBackend, "ffi": FfiBackend, "dep": DepBackend}
    assert all(issubclass(b, ExpertBackend) and b.name == word for word, b in BACKENDS.items())
    a, b = expert_backend("xla"), expert_backend("xla")
    assert isinstance(a, XlaBackend) and a is not b  # each driver owns its backend (the FFI one, its stores)
    assert expert_backend(a) is a
    with pytest.raises(ValueError, match="experts 'nccl': choose one of local, xla, ffi, dep"):
        expert_backend("nccl")
    with pytest.raises(ValueError, match="independent ranks run local, xla, ffi"):
        expert_backend("dep", independent=True)
    with pytest.raises(ValueError, match="needs DWDP ranks > 1"):
        expert_backend("xla").check(jax.devices()[:1], 1)
    with pytest.raises(ValueError, match="needs DEP ranks > 1"):
        expert_backend("dep").check(jax.devices()[:1], 1)
    expert_backend("local").check(jax.devices()[:1], 1)


@pytest.mark.devices(2)
def test_a_pipeline_and_independent_ranks_keep_their_backend_object(inputs):
    backend = XlaBackend()
    pipe = Pipeline.random(CFG, 1, dwdp=2, dtype=jnp.float32, experts=backend)
    assert pipe.backend is backend and pipe.experts == "xla" and pipe.stores == []
    ranks = IndependentRanks.random(CFG, jax.devices()[:2], experts="local", dtype=jnp.float32)
    assert isinstance(ranks.backend, LocalBackend) and ranks.store is None
    with pytest.raises(ValueError, match="store_options are for experts 'ffi'"):
        IndependentRanks.random(CFG, jax.devices()[:2], experts="xla", store_options={"timing": True})


@pytest.mark.devices(4)
def test_kernel_choices_survive_placement_restacking_and_the_driver(inputs):
    """A model built with choices other than the process's keeps them on every path a driver builds its stages:
    split over ranks (build_placed), restacked (ScannedModel), and through a PrefillSpec."""
    other = KernelChoices.defaults("cpu").replace(conv_silu="tanh")
    assert other != KernelChoices.from_environment()
    pipe = Pipeline.random(CFG, 2, dwdp=2, dtype=jnp.float32, kernels=other)
    assert all(m.kernels == other for m in pipe.models)
    assert all(layer.mlp.kernels == other for m in pipe.models for layer in m.layers)
    scanned = ScannedModel.random(CFG, dtype=jnp.float32, kernels=other)
    assert _kernels_of(scanned) == {other}
    for fields in (dict(), dict(ranks=2), dict(mode="scanned")):
        with build_driver(PrefillSpec(preset="tiny", dtype="float32", kernels=other, **fields)) as driver:
            driver.run(*inputs)  # (built and run with them; the placed / scanned checks above cover where they go)


def _kernels_of(scanned) -> set:
    """The kernel choices of the scanned model's shell and of each layer graph (merged with its first block)."""
    from flax import nnx

    found = {nnx.merge(scanned.model_graph.value, scanned.model_state).kernels}
    for typ, state in zip(scanned.period, scanned.stacked):
        layer = nnx.merge(scanned.graphs[typ].value, jax.tree.map(lambda x: x[0], state))
        found |= {m.kernels for _, m in nnx.iter_modules(layer) if "kernels" in vars(m)}
    return found


@pytest.mark.parametrize("fields, message", [
    (dict(dtype="float16"), "dtype 'float16' is not supported; choose one of bfloat16, float32"),
    (dict(seed=-1), "seed must lie in [0, 4294967295], got -1"),
    (dict(microbatches=0), "microbatches must be >= 1, got 0"),
    (dict(ranks=0), "ranks must be >= 1, got 0"),
    (dict(stage_boundaries=(2,)), "stage_boundaries needs pipeline P with P >= 2 stages"),
    (dict(ranks=2, experts="nccl"), "experts 'nccl': choose one of local, xla, ffi, dep"),
    (dict(prefill_chunk=0), "prefill_chunk must be >= 1, got 0"),
    (dict(prefill_chunk=8, pipeline=2), "prefill_chunk runs on one device: it does not combine with pipeline, "
                                        "ranks or microbatches"),
    (dict(prefill_chunk=8, mode="scanned"), "prefill_chunk continues a cache layer by layer: not with mode 'scanned'"),
    (dict(ranks=2, mode="scanned"), "mode 'scanned' runs the model (or each pipeline stage) on one device as one "
                                    "program: not with ranks > 1"),
], ids=lambda v: ",".join(v) if isinstance(v, dict) else None)
def test_a_spec_refuses_its_own_fields_when_made_naming_them(fields, message):
    """The checks `jax-dwdp prefill` makes of its layout options live in the spec: a notebook hears them in field
    names, the CLI (test_cli*) in its flags, from the one message."""
    with pytest.raises(SpecError) as e:
        PrefillSpec(preset="tiny", **fields)
    assert str(e.value).startswith(message), str(e.value)
    flags = e.value.named(lambda name: "--" + name.replace("_", "-"))
    assert "$" not in flags and ("--" in flags), flags


def test_prefill_inputs_refuse_an_empty_random_shape():
    with pytest.raises(SpecError, match=r"^batch and seq_len must be >= 1, got 0 and 8$"):
        prefill_inputs(PrefillSpec(preset="tiny"), CFG, batch=0, seq_len=8)

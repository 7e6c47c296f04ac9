"""The benchmark scripts run on the CPU in their smallest mode and write the JSON their readers expect.

Timings are never checked (only that they are there, and the ratios computed from them); each test runs one
subcommand in-process on the tiny preset with a few tokens. Also: every script and subcommand the GPU scripts
(benchmarks/gpu/*.sh) call exists, and `kernels report` attributes an Nsight Compute log correctly. The
stage benchmark's FFI variants (the store needs GPUs) run over FakeStore, an XLA stand-in with the store's interface.
"""

import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
TINY = ["--preset", "tiny", "--iters", "1"]


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ratio(a, b, places: int = 2):
    """a / b as the scripts compute it: from the unrounded times, which they save rounded to `places` (2 for most
    times: 0.01 ms), then rounded to 3 places. The tolerance is what those roundings allow: half a unit of each
    saved time, relative to it, plus half a unit of the ratio's own rounding (a fixed 2e-3 was too tight for
    times near 1 ms)."""
    half = 0.5 * 10.0**-places
    return pytest.approx(a / b, rel=0, abs=(a / b) * (half / a + half / b) * 1.01 + 5e-4 + 1e-9)


def run(name, argv, out: Path):
    """Runs a script's main(argv + --out out); returns (what main returned, the JSON written)."""
    result = load(name).main([*argv, "--out", str(out)])
    return result, json.loads(out.read_text())


@pytest.mark.devices(2)
def test_dwdp_stage_without_a_subcommand_compares_xla_and_replicated(tmp_path):
    """`bench_dwdp.py ARGS` (the recorded form) runs `stage`: per sequence length, each variant's time and the ratios
    computed from them, the MoE block alone; no FFI keys without the FFI variant."""
    rows, saved = run("bench_dwdp", [*TINY, "--num-layers", "1", "--seq-lens", "8", "--variants", "xla", "replicated"],
                      tmp_path / "stage.json")
    assert saved["what"] == "stage" and saved["args"]["command"] == "stage" and saved["rows"] == rows
    (row,) = rows
    assert (row["seq_len_per_rank"], row["ranks"], row["layers"]) == (8, 2, 1)
    assert row["xla_ms"] > 0 and row["replicated_ms"] > 0 and row["moe_ms_per_layer"] > 0
    assert row["xla_vs_replicated"] == ratio(row["xla_ms"], row["replicated_ms"])
    assert row["layer_ms_replicated"] == round(row["replicated_ms"], 3)
    assert not any(k.startswith("ffi") for k in row)


class FakeStore:
    """What the stage benchmark uses of an ExpertStore, over XLA on the CPU (the store itself needs GPUs): a
    prefetch returns the layer's full experts (constants of its program), a wait returns them as they are. It
    copies out (the probes' stores do; the in-place views need a GPU)."""

    in_place = False

    def __init__(self, blocks, num_experts):
        self.full = [tuple(np.asarray(w)[:num_experts] for w in layer) for layer in blocks]
        self.num_layers, self.dtype = len(blocks), blocks[0][0].dtype
        self.ranks = len(blocks[0][0].addressable_shards)
        self.syncs, self.closed = 0, False

    def prefetch(self, dep, layer):
        return tuple(jnp.asarray(w) for w in self.full[layer])

    def wait(self, experts, after):
        return experts, after

    def sync(self):
        self.syncs += 1

    def check_open(self):
        assert not self.closed

    def copy_ms(self):
        return np.ones((self.ranks, self.num_layers))

    def info(self):
        return {"fake": True}

    def close(self):
        self.closed = True


def fake_stores(monkeypatch):
    """bench_dwdp with its stores made by FakeStore; returns (the module, the stores it made)."""
    from jax_dwdp.parallel.placement import expert_blocks

    bench, made = load("bench_dwdp"), []

    def make_store(placed, cfg, *, delete=True, in_place=True, slot_sets=2):
        made.append(FakeStore(expert_blocks(placed), cfg.num_experts))
        return made[-1]
    monkeypatch.setattr(bench, "make_store", make_store)
    return bench, made


@pytest.mark.devices(2)
def test_dwdp_stage_probe_variants_run_on_the_cpu(tmp_path, monkeypatch):
    """`stage --variants ffi ffi-nowait ffi-unused replicated` (the FFI store replaced by FakeStore): every variant
    timed, the probes marked timing-only with finite logits, their ratios and the per-layer stall and contention
    computed from the times, each store closed; unknown variant names refused. (ffi-depth2 shares the probes' row
    code; its source is checked in the next test.)"""
    bench, made = fake_stores(monkeypatch)
    variants = ["ffi", "ffi-nowait", "ffi-unused", "replicated"]
    out = tmp_path / "probes.json"
    rows = bench.main(["stage", *TINY, "--num-layers", "1", "--seq-lens", "8", "--variants", *variants,
                       "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == rows
    (row,) = rows
    rep, ffi = row["replicated_ms"], row["ffi_ms"]
    for key in ("ffi_nowait", "ffi_unused"):
        assert row[f"{key}_ms"] > 0 and row[f"{key}_copy_ms_per_layer"] == 1.0, key
        assert row[f"{key}_vs_replicated"] == ratio(row[f"{key}_ms"], rep)
        assert row[f"{key}_vs_ffi"] == ratio(row[f"{key}_ms"], ffi)
    assert row["timing_only"] == ["ffi-nowait", "ffi-unused"]
    assert row["ffi_nowait_logits_finite"] is row["ffi_unused_logits_finite"] is True
    assert not any(k.startswith("ffi_depth2") for k in row)
    assert row["ffi_stall_ms_per_layer"] == pytest.approx(ffi - row["ffi_nowait_ms"], abs=2e-3)
    assert row["ffi_contention_ms_per_layer"] == pytest.approx(row["ffi_unused_ms"] - rep, abs=2e-3)
    assert row["ffi_copy_ms_per_layer"] == 1.0 and row["ffi_vs_replicated"] == ratio(ffi, rep)
    assert len(made) == 3 and all(store.closed for store in made)
    assert made[1].syncs >= 2 and made[2].syncs >= 2  # the probes settle after every prefill
    with pytest.raises(SystemExit):
        bench.parser().parse_args(["stage", "--variants", "ffi-later"])


@pytest.mark.devices(2)
def test_dwdp_stage_probe_sources_order_and_results(monkeypatch):
    """The benchmark's sources over FakeStore, 3 layers, fp32: depth 2 starts layer i+2's fetch before layer i is
    enqueued (layers 0 and 1 at the start) and gives the replicated model's logits; the probes (whose stand-in
    copies are complete at once) too, holding every prefetch output until settle."""
    from jax_dwdp.config import ModelConfig
    from jax_dwdp.sources import FfiStoreSource
    from jax_dwdp.devices import make_mesh

    bench, _ = fake_stores(monkeypatch)
    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=3)
    devices = jax.devices()[:2]
    mesh = jax.sharding.Mesh(make_mesh(1, 2, devices).devices[0], ("dwdp",))
    tokens, lengths = bench.random_tokens(cfg, 2, 16, seed=0), np.array([16, 11], np.int32)
    reference, _ = bench.stage_program(cfg, "replicated", mesh, jnp.float32)
    want = np.asarray(reference(tokens, lengths, logits="all")[0])

    events = []
    issue = FfiStoreSource.fetch_now
    monkeypatch.setattr(FfiStoreSource, "fetch_now",
                        lambda self, i, h: (events.append(("fetch", i)), issue(self, i, h))[1])
    for variant in ("ffi-depth2", "ffi-nowait", "ffi-unused"):
        runner, store = bench.stage_program(cfg, variant, mesh, jnp.float32)
        source = runner.source
        asked = source.prefetch
        monkeypatch.setattr(source, "prefetch",
                            lambda i, h, asked=asked: (events.append(("layer", i - 1)), asked(i, h))[1])
        events.clear()
        got = np.asarray(runner(tokens, lengths, logits="all")[0])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=variant)
        if variant == "ffi-depth2":  # ("layer", i): right before layer i is enqueued
            assert events == [("fetch", 0), ("fetch", 1), ("layer", 0), ("fetch", 2), ("layer", 1)]
            assert source.started == {}
        else:
            assert events == [("fetch", 0), ("layer", 0), ("fetch", 1), ("layer", 1), ("fetch", 2)]
            assert len(source.held) == 3 and store.syncs == 0
            source.settle()
            assert source.held == [] and store.syncs == 1
        assert (variant == "ffi-unused") == (not source.replaces_experts)


@pytest.mark.devices(2)
def test_dwdp_ranks_writes_the_keys_the_notebook_reads(tmp_path):
    """`ranks`: one rank alone, in turn, threads, the dispatch time, XLA DWDP and the replicated bound (the notebook
    reads the independent_* and dispatch keys from the saved GPU run)."""
    rows, saved = run("bench_dwdp", ["ranks", *TINY, "--num-layers", "1", "--seq-len", "8"], tmp_path / "ranks.json")
    assert saved["what"] == "ranks" and saved["rows"] == rows
    (row,) = rows
    for key in ("replicated_ms", "independent_one_rank_ms", "independent_ms", "independent_threads_ms",
                "dispatch_one_rank_ms", "xla_dwdp_ms"):
        assert row[key] > 0, key
    threads, one = row["independent_threads_ms"], row["independent_one_rank_ms"]
    assert row["independent_threads_vs_one_rank"] == ratio(threads, one)
    assert row["xla_vs_replicated"] == ratio(row["xla_dwdp_ms"], row["replicated_ms"])
    assert "independent_ffi_ms" not in row  # only with --ffi


@pytest.mark.devices(2)
def test_dwdp_dispatch_accounts_for_the_layers(tmp_path):
    """`dispatch` (host time of a layer-wise prefill by call) sees one layer program and one prefetch per layer,
    accounts for no more than the whole dispatch, and puts the module functions it wrapped back."""
    from jax_dwdp import prefill

    device_put, check = jax.device_put, prefill.check_tokens
    result, saved = run("bench_dwdp", ["dispatch", *TINY, "--num-layers", "3", "--seq-len", "16", "--iters", "2",
                                       "--dtype", "float32"], tmp_path / "dispatch.json")
    assert saved == json.loads(json.dumps(result))
    assert result["calls"]["layer program"]["calls_per_prefill"] == 3
    assert result["calls"]["expert prefetch (peer copies or store program)"]["calls_per_prefill"] == 3
    assert 0 < sum(c["host_ms_per_prefill"] for c in result["calls"].values()) <= result["dispatch_ms"] * 1.05
    assert jax.device_put is device_put and prefill.check_tokens is check


@pytest.mark.devices(2)
def test_dwdp_layouts_runs_what_fits_and_skips_the_rest(tmp_path):
    """`layouts`: a layout that fits the devices is timed (tokens/s per GPU from tokens/s), one that does not is
    recorded as skipped."""
    rows, saved = run("bench_dwdp", ["layouts", *TINY, "--num-layers", "1", "--seq-len", "8", "--sequences", "2",
                                     "--layouts", "1x2", "4x4"], tmp_path / "layouts.json")
    assert saved["what"] == "layouts" and saved["rows"] == rows
    timed, skipped = rows
    assert (timed["pipeline"], timed["dwdp"], timed["backend"], timed["gpus"], timed["microbatches"]) == (1, 2, "xla",
                                                                                                          2, 1)
    assert abs(timed["tokens_per_s_per_gpu"] - timed["tokens_per_s"] / 2) <= 1  # (each rounded from one rate)
    assert skipped == {"layout": "4x4", "skipped": f"needs 16 devices, {jax.device_count()} present"}


# Two stages on two devices; with --same-device both stages (and the one-device run) on device 0.
@pytest.mark.parametrize("scan,same", [pytest.param(False, False, marks=pytest.mark.devices(2)),
                                       pytest.param(True, False, marks=pytest.mark.devices(2)), (True, True)])
def test_pipeline_reports_speedup_and_idle_fractions(tmp_path, monkeypatch, scan, same):
    """bench_pipeline.py: one device vs two stages (layer-wise or scanned; with --same-device both on the first
    device), each stage's time and idle fraction, the GPipe bubble; the one-device model is freed before the stages
    are built (the live device bytes when the stages' build starts are those before the one-device model's)."""
    from jax_dwdp.parallel import Pipeline

    built, random = [], Pipeline.random.__func__

    def recording_random(cls, cfg, pipeline, **kw):
        built.append((pipeline, sum(a.nbytes for a in jax.live_arrays())))
        return random(cls, cfg, pipeline, **kw)

    monkeypatch.setattr(Pipeline, "random", classmethod(recording_random))
    rows, saved = run("bench_pipeline", [*TINY, "--num-layers", "2", "--seq-len", "8", "--microbatches", "2",
                                         *(["--scan"] if scan else []), *(["--same-device"] if same else [])],
                      tmp_path / "pipeline.json")
    assert saved["what"] == "pipeline" and saved["rows"] == rows
    (row,) = rows
    assert (row["scan"], row["same_device"], row["microbatches"], row["tokens"], row["gpipe_ideal_bubble"]) == (
        scan, same, 2, 16, 0.333)
    assert len(row["stage_ms"]) == len(row["idle_fraction"]) == 2
    assert row["speedup"] == ratio(row["one_device_ms"], row["pipeline_ms"])
    assert row["one_thread_speedup"] == ratio(row["one_device_ms"], row["one_thread_pipeline_ms"])
    for t, idle in zip(row["stage_ms"], row["idle_fraction"]):
        assert abs(idle - (1 - 2 * t / row["pipeline_ms"])) < 0.01
    (one, before_one), (two, before_stages) = built
    assert (one, two) == (1, 2) and before_stages <= before_one


def check_implementations(row, names):
    """Each implementation is either timed or has a note saying why not (no library, no GPU, ...)."""
    for name in names:
        assert (name in row["times_ms"]) != (name in row["notes"]), (name, row["times_ms"], row["notes"])


def test_grouped_matmul_calls_without_a_subcommand(tmp_path):
    """`bench_grouped_matmul.py ARGS` (the recorded form) runs `calls`: one row per (shape, tokens, routing); the
    dense matmul is timed everywhere; CUTLASS, Mosaic and torch are timed or say why not."""
    result, saved = run("bench_grouped_matmul", ["--presets", "tiny", "--tokens", "16", "--routing", "uniform",
                                                 "--iters", "1", "--no-mosaic-sweep"], tmp_path / "calls.json")
    assert saved == json.loads(json.dumps(result))
    assert [(r["model"], r["proj"], r["tokens"], r["routing"]) for r in saved["rows"]] == [
        ("tiny", "gate_up", 16, "uniform"), ("tiny", "down", 16, "uniform")]
    for row in saved["rows"]:
        assert row["times_ms"]["dense"] > 0 and row["tflops"]["dense"] > 0
        check_implementations(row, ("cutlass", "mosaic", "torch"))
    assert saved["rows"][0]["rows"] == 16 * 2  # tokens x top-k of the tiny preset


def test_grouped_matmul_fusion_times_the_block_and_its_parts(tmp_path):
    """`fusion --breakdown`: the routed-expert block (XLA grouped matmul on a CPU) and each of its parts."""
    result, saved = run("bench_grouped_matmul", ["fusion", "--presets", "tiny", "--tokens", "16", "--routing",
                                                 "uniform", "--iters", "1", "--breakdown"], tmp_path / "fusion.json")
    assert saved == json.loads(json.dumps(result))
    (row,) = saved["rows"]
    assert (row["model"], row["tokens"], row["routing"]) == ("tiny", 16, "uniform")
    for part in ("sort", "inverse argsort", "inverse scatter", "gather", "gather in-bounds", "gather u32", "down",
                 "unpermute"):
        assert row["times_ms"][f"part {part}"] > 0, part
    check_implementations(row, ("fused", "unfused", "torch", "block fused", "block unfused"))


def test_layer_parts_times_layers_moe_passes_and_fusions(tmp_path):
    """bench_layer_parts on the tiny preset: every part is timed or says why not (the Pallas kernels cannot run on
    the CPU); the MoE floor is the GEMMs plus the shared expert."""
    result, saved = run("bench_layer_parts", ["--preset", "tiny", "--tokens", "16", "--fusions"],
                        tmp_path / "parts.json")
    assert saved == json.loads(json.dumps(result))
    parts = {r["part"]: r for r in saved["rows"]}
    for part in ("linear-attention layer", "full-attention layer", "MoE block", "MoE block (XLA routing)",
                 "GDN mixer (with input norm) (Pallas conv)", "router (matmul, softmax, top-k), xla", "sort by expert and inverse, xla", "gate_up grouped "
                 "GEMM", "GDN: causal conv + SiLU, xla", "attention core: the model's (cuDNN)",
                 "fusion: GDN input matmuls as one", "MoE block (XLA dispatch)", "dispatch rows, xla (row gather)",
                 "un-permute, weighted sum + shared add, xla", "full-attention layer (XLA norm+RoPE)",
                 "attention mixer (with input norm) (XLA norm+RoPE)",
                 "MoE block (router, shared expert, its gate apart)"):
        assert parts[part]["ms"] > 0, part
    assert parts["router (matmul, softmax, top-k), pallas"]["error"]  # a Pallas kernel on the CPU: says why
    assert parts["dispatch rows, pallas (scatter)"]["error"]
    floor = parts["floor: GEMMs + shared expert"]
    want = sum(parts[p]["ms"] for p in ("gate_up grouped GEMM", "down grouped GEMM", "shared expert with its gate"))
    assert floor["ms"] == pytest.approx(want) and floor["block_over_floor"] == ratio(parts["MoE block"]["ms"], want)


def test_attention_bench_reference_and_rows(tmp_path):
    """bench_attention.py on the CPU: its float64 reference rows equal XLA's fp32 attention on random GQA inputs; the
    model's core (XLA here) gets a row with its error; the Mosaic GPU rows fail with their reason and the run goes
    on."""
    import jax

    bench = load("bench_attention")
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((40, h, 16)) for h in (4, 2, 2))
    rows = [0, 7, 39]
    want = jax.nn.dot_product_attention(*(jnp.asarray(a[None], jnp.float32) for a in (q, k, v)), scale=0.25,
                                        is_causal=True, implementation="xla")[0]
    np.testing.assert_allclose(bench.reference_rows(q, k, v, rows, 0.25), np.asarray(want)[rows], atol=1e-5)
    result, saved = run("bench_attention", ["--tokens", "128", "--heads", "4/2", "--head-dim", "64",
                                            "--ref-rows", "16", "--trace"], tmp_path / "attn.json")
    model = [r for r in saved["rows"] if r["impl"].startswith("cuDNN")]
    assert len(model) == 1 and model[0]["ms"] > 0 and model[0]["max_abs_err_vs_fp64"] < 2e-2
    assert model[0]["span_ms"] > 0 and model[0]["kernel_ms"] > 0  # --trace: host events on the CPU
    mgpu = [r for r in saved["rows"] if r["impl"].startswith("mgpu")]
    assert len(mgpu) == 4 and all("error" in r for r in mgpu)  # no GPU here


def test_layer_parts_without_variants(tmp_path):
    """--no-variants (the notebook's fresh run): the defaults' layers and passes, none of the one-change variants."""
    result = load("bench_layer_parts").main(["--preset", "tiny", "--tokens", "16", "--no-variants",
                                             "--no-attention-alternatives"])
    parts = {r["part"] for r in result["rows"]}
    assert {"linear-attention layer", "full-attention layer", "MoE block", "gate_up grouped GEMM"} <= parts
    assert not [p for p in parts if p.endswith(("(XLA routing)", "(XLA dispatch)", "(Pallas combine)", "(Pallas conv)",
                                                "(XLA norm+RoPE)"))]


def test_layer_parts_chosen_variants_and_conv_configs(tmp_path):
    """--variants picks one-change variants by name (the norm + RoPE one times only the full-attention layer and
    its mixer); --conv-configs times the conv alone and in the GDN mixer at each of CONV_CONFIGS' (rows, warps,
    channel block) tiles, two rows per tile named by it (on the CPU the lowering takes XLA's conv, so each row is a
    time); an unknown variant is refused."""
    bench = load("bench_layer_parts")
    result = bench.main(["--preset", "tiny", "--tokens", "16", "--variants", "norm_rope",
                         "--no-attention-alternatives", "--conv-configs"])
    parts = {r["part"]: r for r in result["rows"]}
    assert "full-attention layer (XLA norm+RoPE)" in parts and "MoE block (XLA routing)" not in parts
    assert "linear-attention layer (XLA norm+RoPE)" not in parts
    conv_rows = [r for r in result["rows"] if r["group"] == "conv"]
    assert len(conv_rows) == 2 * len(bench.CONV_CONFIGS) and all(r["ms"] > 0 for r in conv_rows)
    for bt, nw, bc in bench.CONV_CONFIGS:
        tile = f"{bt} rows w{nw} c{bc}"
        assert {r["part"] for r in conv_rows if r["part"].endswith(" " + tile)} == {
            f"Pallas conv (3 splits) {tile}", f"GDN mixer, Pallas conv {tile}"}
    with pytest.raises(SystemExit):
        bench.main(["--preset", "tiny", "--tokens", "16", "--variants", "norm-rope"])


@pytest.mark.parametrize("mode", ["--layerwise", "--scan"])
def test_prefill_bench_rows(tmp_path, capsys, mode):
    """bench_prefill on the tiny preset: one row per length with its timings, the host time of one more call, the
    mode it ran, finite logits; --host-profile prints the profiled call's functions; --dense-rate adds the dense
    matmul rate measured after the prefills and each row's MFU against it."""
    trace = ["--trace", str(tmp_path / "trace")] if mode == "--layerwise" else ["--host-profile", "5"]
    result, saved = run("bench_prefill", ["--preset", "tiny", "--seq-lens", "8", "16", "--iters", "2", "--dtype",
                                          "float32", mode, *trace, "--dense-rate", "3", "--dense-n", "96"],
                        tmp_path / "prefill.json")
    printed = capsys.readouterr().out
    dense = saved["dense"]
    assert (dense["n"], dense["calls"]) == (96, 3) and dense["tflops"] > 0 and dense["seconds"] > 0
    assert "dense bf16 96^3 x 3" in printed
    for r in saved["rows"]:
        assert r["mfu_dense"] == round(r["tflops"] / dense["tflops"], 6)
    assert (printed.count("Ordered by: cumulative time") == 2) == (mode == "--scan")
    assert saved == json.loads(json.dumps(result))
    assert [r["seq_len"] for r in saved["rows"]] == [8, 16]
    for r in saved["rows"]:
        assert r["logits_finite"] and r["prefill_ms"] > 0 and r["host_ms"] > 0 and len(r["times_ms"]) == 2
        assert r["scan"] == (mode == "--scan") and r["layerwise"] == (mode == "--layerwise")
        if mode == "--layerwise":  # the CPU trace has no device events: host events, and it says so
            assert r["trace"]["events"] > 0 and not r["trace"]["device"] and r["trace"]["kernels"]


def test_moe_fusion_probe_runs_every_variant(tmp_path):
    """probe_moe_fusion on the tiny preset: every variant timed at each length, the default's optimized HLO
    written."""
    result = load("probe_moe_fusion").main(["--preset", "tiny", "--tokens", "16", "--out-dir", str(tmp_path)])
    assert set(result) == {"default", "barrier before combine", "XLA dispatch"}
    assert all(set(v) == {16} and v[16] > 0 for v in result.values())
    assert "HloModule" in (tmp_path / "moe_16.hlo.txt").read_text()


def test_conv_probe_checks_each_variant_against_xla(tmp_path, monkeypatch):
    """probe_conv at 64 tokens with the kernel in interpret mode (two variants, the floors, the mixer both ways):
    every variant's difference from XLA's conv recorded in bf16 steps (each SiLU form's exact formula in interpret
    mode: at most a rounding step), the mixer timed with each SiLU form at the default tile (the fastest variant is
    the first of equal times here, one of those, so it is not timed twice)."""
    import functools

    from jax_dwdp.kernels import conv

    probe = load("probe_conv")
    monkeypatch.setattr(probe, "CONFIGS", (("tanh", 1, 32, 4), ("ex2", 3, 16, 4)))
    monkeypatch.setattr(conv, "causal_conv_silu_pallas", functools.partial(conv.causal_conv_silu_pallas,
                                                                            interpret=True))
    sys.path.insert(0, str(BENCHMARKS))
    import bench_gdn

    monkeypatch.setattr(bench_gdn, "wall_ms", lambda fn, sync, **_: (sync(fn()), 1.0)[1])
    rows = probe.main(["--tokens", "64", "--mixer", "--out", str(tmp_path / "conv.json")])
    assert json.loads((tmp_path / "conv.json").read_text()) == rows
    parts = [r["part"] for r in rows]
    assert parts[:3] == ["XLA conv", "floor: XLA element-wise pass, same bytes",
                         "floor-ish: kernel, one tap (still SiLU)"]
    kernels = [r for r in rows if "ulps" in r]
    assert [(r["silu"], r["rows_per_program"]) for r in kernels] == [("tanh", 1), ("ex2", 3)]
    assert all(0 <= r["ulps"] <= 1.0 for r in kernels)
    assert parts[-2:] == [f"GDN mixer, conv with {f} SiLU" for f in conv.SILU_FORMS]
    assert "GDN mixer, conv with fastest variant" not in parts


def test_ssd_bench_smoke_runs_the_jax_forms_against_the_reference(tmp_path):
    """bench_ssd --smoke on the CPU (tiny heads, the Pallas kernels interpreted): the XLA reference row, the kernel's
    rows (fp32 and bf16 y) and two Tuning variants, each with its errors against the reference (bf16 rounding: below
    1e-2); mamba_ssm and transformers skipped, saying why."""
    results, written = run("bench_ssd", ["--smoke", "--variants", "--seq-lens", "70"], tmp_path / "ssd.json")
    assert written["rows"] == results["rows"] and set(written["skipped"]) == {"mamba_ssm", "transformers"}
    assert [r["impl"] for r in written["rows"]] == ["xla (fp32 reference)", "pallas (fp32 y)", "pallas, bf16 y"]
    assert written["rows"][0]["y_rel_err"] == 0.0
    assert len(written["variants"]) == 2
    for r in written["rows"][1:] + written["variants"]:
        assert r["ms"] > 0 and 0 < r["y_rel_err"] <= 1e-2 and 0 < r["state_rel_err"] <= 1e-2, r


def test_trace_summary_sums_device_kernels_by_name():
    """Device processes' complete events are summed by name, largest first; host events are left out."""
    ts = load("trace_summary")
    events = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0")),
              dict(ph="M", name="process_name", pid=2, args=dict(name="/host:CPU")),
              dict(ph="X", pid=1, name="gemm", ts=0.0, dur=300.0), dict(ph="X", pid=1, name="gemm", ts=400.0, dur=500.0),
              dict(ph="X", pid=1, name="copy", ts=900.0, dur=100.0), dict(ph="X", pid=2, name="python", ts=0.0, dur=9e6),
              dict(ph="i", pid=1, name="marker", ts=5.0)]
    s = ts.summarize(dict(traceEvents=events))
    assert s["device"] and s["events"] == 3 and s["kernels"] == [("gemm", 2, 0.8), ("copy", 1, 0.1)]
    assert s["total_ms"] == pytest.approx(0.9) and s["span_ms"] == pytest.approx(1.0)
    assert "gemm" in ts.render(s)
    # the idle time between the union of busy intervals, each gap on the kernels either side of it
    assert s["gaps"]["idle_ms"] == pytest.approx(0.1) and s["gaps"]["count"] == 1
    assert s["gaps"]["pairs"] == [("gemm", "gemm", 1, 0.1)]
    overlapping = [dict(ph="X", pid=1, name="a", ts=0.0, dur=100.0), dict(ph="X", pid=1, name="b", ts=50.0, dur=20.0),
                   dict(ph="X", pid=1, name="c", ts=103.0, dur=10.0), dict(ph="X", pid=1, name="d", ts=130.0, dur=5.0)]
    g = ts.gaps(overlapping, min_us=5.0)
    assert g["idle_ms"] == pytest.approx(0.02) and g["count"] == 1 and g["pairs"] == [("c", "d", 1, 0.017)]
    assert g["largest"] == [(0.113, 0.017, "c", "d")]
    assert "c  ->  d" in ts.render(dict(s, gaps=g))


def test_trace_call_traces_one_call_and_summarises_it(tmp_path):
    """trace_call runs the call once under jax.profiler into its directory and summarises that trace (on the CPU:
    the host events, said so); a directory with no trace is named in the error."""
    import jax.numpy as jnp

    ts = load("trace_summary")
    calls = []
    s = ts.trace_call(lambda: calls.append(1) or jnp.arange(8.0) * 2, tmp_path / "t", None)
    assert calls == [1] and s["events"] > 0 and not s["device"] and s["span_ms"] > 0
    assert list((tmp_path / "t").rglob("perfetto_trace.json.gz"))
    with pytest.raises(FileNotFoundError, match="no perfetto_trace.json.gz"):
        ts.load(tmp_path / "empty")


def test_trace_summary_compares_two_traces_kernel_by_kernel(tmp_path, capsys):
    """--versus: every kernel name of either trace with its calls and ms in each, the largest difference first;
    names in only one trace count 0 in the other."""
    import gzip

    ts = load("trace_summary")
    gpu = dict(ph="M", name="process_name", pid=1, args=dict(name="/device:GPU:0"))
    a = [gpu, dict(ph="X", pid=1, name="gemm", ts=0.0, dur=1000.0), dict(ph="X", pid=1, name="norm", ts=1000.0,
                                                                          dur=100.0)]
    b = [gpu, dict(ph="X", pid=1, name="gemm", ts=0.0, dur=1100.0), dict(ph="X", pid=1, name="copy", ts=1200.0,
                                                                          dur=400.0)]
    for name, events in (("a", a), ("b", b)):
        (tmp_path / name / "4096").mkdir(parents=True)
        with gzip.open(tmp_path / name / "4096" / "perfetto_trace.json.gz", "wt") as f:
            json.dump(dict(traceEvents=events), f)
    out = ts.main([str(tmp_path / "a" / "4096"), "--versus", str(tmp_path / "b" / "4096")])
    assert out["rows"] == [("copy", 0, 0.0, 1, 0.4), ("gemm", 1, 1.0, 1, 1.1), ("norm", 1, 0.1, 0, 0.0)]
    assert out["b"]["gaps"]["idle_ms"] == pytest.approx(0.1)
    printed = capsys.readouterr().out
    assert "+0.400  copy" in printed and "-0.100  norm" in printed
    assert "a/4096 ms" in printed and "b/4096 ms" in printed  # each side named by where the paths differ
    assert ts.labels("x/t/4096", "y/t/4096") == ("x/t/4096", "y/t/4096") and ts.labels("a", "b") == ("a", "b")


def test_transformers_reference_runs_the_same_rows(tmp_path):
    """bench_transformers on the tiny preset (fp32 eager paths on the CPU): bench_prefill's row fields."""
    result, saved = run("bench_transformers", ["--preset", "tiny", "--seq-lens", "32", "--iters", "1"],
                        tmp_path / "hf.json")
    (row,) = saved["rows"]
    assert (row["seq_len"], row["layers"], row["impl"], row["logits_finite"]) == (32, 4, "transformers", True)
    assert row["prefill_ms"] > 0 and row["tokens_per_s"] > 0


def test_prefill_bench_runs_nemotron_h_with_its_own_flop_count(tmp_path, monkeypatch):
    """bench_prefill on nemotron-h:tiny (layer-wise, as the GPU script runs it): the Qwen rows' fields, MFU from
    NemotronHConfig.prefill_flops; --num-layers keeps the first layers of the pattern; an unknown preset and
    --fused-swiglu (relu^2 experts have no gate) are usage errors."""
    from jax_dwdp.nemotron_h_config import NemotronHConfig

    counted, flops = [], NemotronHConfig.prefill_flops
    monkeypatch.setattr(NemotronHConfig, "prefill_flops", lambda cfg, *a: (counted.append(a), flops(cfg, *a))[1])
    result, saved = run("bench_prefill", ["--preset", "nemotron-h:tiny", "--seq-lens", "32", "--iters", "1",
                                          "--dtype", "float32", "--layerwise", "--num-layers", "5"],
                        tmp_path / "prefill.json")
    (row,) = saved["rows"]
    assert list(row) == ["preset", "grouped_matmul", "ssd", "fused_swiglu", "layerwise", "scan", "layers", "batch",
                         "seq_len", "dtype", "compile_s", "prefill_ms", "tokens_per_s", "tflops", "mfu", "peak_gib",
                         "logits_finite", "times_ms", "host_ms", "trace"]
    assert (row["preset"], row["layers"], row["seq_len"], row["logits_finite"]) == ("nemotron-h:tiny", 5, 32, True)
    assert counted == [(1, 32, 1)]
    for bad in (["--preset", "nemotron-h:nano"], ["--preset", "nemotron-h:tiny", "--fused-swiglu"],
                ["--preset", "nemotron-h:tiny", "--num-layers", "7"]):
        with pytest.raises(SystemExit):
            load("bench_prefill").main(bad)


def test_transformers_reference_runs_nemotron_h_and_says_which_mamba_kernels_ran(tmp_path):
    """bench_transformers on nemotron-h:tiny: the rows' fields with `mamba_path` (here transformers' PyTorch forms:
    no mamba_ssm on the CPU) and how often the first call ran the chunked scan and the conv (once per Mamba-2
    layer)."""
    result, saved = run("bench_transformers", ["--preset", "nemotron-h:tiny", "--seq-lens", "40", "--iters", "1"],
                        tmp_path / "hf.json")
    (row,) = saved["rows"]
    assert (row["seq_len"], row["layers"], row["impl"], row["logits_finite"]) == (40, 6, "transformers", True)
    assert row["prefill_ms"] > 0 and row["mamba_path"] == saved["mamba"]["mamba_path"] == "torch"
    assert saved["mamba"]["ssd_scan"] == "transformers.models.nemotron_h.modeling_nemotron_h.mamba2_chunk_scan"
    assert row["mamba_calls_first_call"] == {"ssd_scan": 2, "conv1d": 2}


FAKE_MAMBA_SSM = '''
def mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                              seq_idx=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                              return_final_states=False):
    """The released function's signature, transformers' own PyTorch form inside (the Triton kernel needs a GPU)."""
    import inspect
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    return inspect.unwrap(m.mamba2_chunk_scan)(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                                               initial_states=initial_states, dt_softplus=dt_softplus,
                                               dt_limit=dt_limit, return_final_states=return_final_states)
'''


def test_transformers_reference_binds_mamba_ssm_without_its_cuda_extension(tmp_path):
    """A mamba_ssm whose package imports the Mamba-1 CUDA extension `selective_scan_cuda` it was built without (as
    the wheel on the GPU machine does): bench_transformers puts a stand-in there, transformers then binds mamba_ssm's
    mamba_chunk_scan_combined, and the rows say so (a fake package on the CPU, in a process of its own: transformers
    binds its kernels once per process). The stand-in refuses any use."""
    import subprocess

    package = tmp_path / "site" / "mamba_ssm"
    (package / "ops" / "triton").mkdir(parents=True)
    (package / "__init__.py").write_text("import selective_scan_cuda  # noqa: F401 (Mamba-1's CUDA scan)\n")
    (package / "ops" / "__init__.py").write_text("")
    (package / "ops" / "triton" / "__init__.py").write_text("")
    (package / "ops" / "triton" / "ssd_combined.py").write_text(FAKE_MAMBA_SSM)
    out = tmp_path / "hf.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(BENCHMARKS.parent)]))
    done = subprocess.run([sys.executable, str(BENCHMARKS / "bench_transformers.py"), "--preset", "nemotron-h:tiny",
                           "--seq-lens", "40", "--iters", "1", "--out", str(out)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads(out.read_text())
    assert saved["mamba"]["mamba_path"] == saved["rows"][0]["mamba_path"] == "mamba_ssm"
    assert saved["mamba"]["ssd_scan"] == "mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined"
    note = saved["mamba"]["note"]
    assert "selective_scan_cuda" in note and "stand-in" in note and "causal_conv1d is not installed" in note
    assert saved["rows"][0]["mamba_calls_first_call"] == {"ssd_scan": 2, "conv1d": 2}
    assert saved["rows"][0]["logits_finite"] and "Mamba-2 path mamba_ssm" in done.stdout
    with pytest.raises(AttributeError, match="stand-in"):
        load("mamba_kernels").MissingExtension("selective_scan_cuda").fwd


def test_probe_power_summarizes_loaded_samples_and_runs_without_nvidia_smi(tmp_path, monkeypatch):
    """probe_power: the samples under --min-watts (idle) and unparsable ones are left out, the median / min / max and
    the throttle-reason counts come from the rest; without nvidia-smi the matmul and the command still run, with no
    samples."""
    probe = load("probe_power")
    rows = [["1980", "120.5", "40", "0x0000000000000000"],  # idle: under 300 W
            ["1700", "650.0", "60", "0x0000000000000004"], ["1500", "699.0", "64", "0x0000000000000004"],
            ["1900", "[N/A]", "61", "0x0000000000000000"],  # unparsable power
            ["1800", "600.0", "62", "0x0000000000000000"]]
    got = probe.summarize(rows, 300.0)
    assert got["samples"] == 3 and got["clock_mhz_median"] == 1700 and got["clock_mhz_min"] == 1500
    assert got["power_w_max"] == 699.0 and got["temp_c_max"] == 64.0
    assert got["throttle_reasons"] == {"0x0000000000000004": 2, "0x0000000000000000": 1}
    assert probe.summarize(rows[:1], 300.0) == {"samples": 0}
    monkeypatch.setattr(probe.shutil, "which", lambda name: None)
    result, saved = run("probe_power", ["--n", "64", "--calls", "2", "--cmd", f"{sys.executable} -c pass"],
                        tmp_path / "power.json")
    dense, cmd = saved["rows"]
    assert dense["calls"] == 2 and dense["tflops"] > 0 and dense["gpu"] == {"samples": 0}
    assert cmd["rc"] == 0 and cmd["gpu"] == {"samples": 0}


def test_probe_power_sampler_stops_nvidia_smi_and_removes_its_file_on_every_path(tmp_path, monkeypatch):
    """The sampler's process is stopped and its temporary file removed when the block ends, and when it raises; the
    samples are read before the file goes (a fake nvidia-smi on PATH prints a line every 20 ms)."""
    probe = load("probe_power")
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nwhile true; do echo '1700, 650.0, 60, 0x0000000000000004'; sleep 0.02; done\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    with probe.Sampler(20) as s:
        time.sleep(0.3)
    assert s.proc.poll() is not None and not Path(s.file.name).exists()
    assert s.rows and probe.summarize(s.rows, 300.0)["throttle_reasons"] == {"0x0000000000000004": len(s.rows)}
    with pytest.raises(RuntimeError, match="inside"):
        with probe.Sampler(20) as s2:
            raise RuntimeError("inside the block")
    assert s2.proc.poll() is not None and not Path(s2.file.name).exists()
    with pytest.raises(ValueError, match="at least one call"):
        probe.dense_rate(64, 0)


def test_limits_cut_each_command_to_the_deadline_and_never_to_no_limit():
    """gpu/_limits.sh: `limit N` is N while time is left, what is left when less, and 1 (never 0, which `timeout`
    takes as no limit) past the deadline; `time_for` says a command is skipped once under MIN_LEFT seconds remain;
    `by_memory` picks the H200 or the H100 default by the card's memory; `quiet` drops XLA's frames and log lines."""
    import subprocess

    def sh(script):
        return subprocess.run(["bash", "-c", f'source "{BENCHMARKS}/gpu/_limits.sh"; {script}'], capture_output=True,
                              text=True).stdout.split()

    assert sh("DEADLINE=100; SECONDS=0; limit 30; limit 300; SECONDS=100; limit 30; SECONDS=200; limit 30") == [
        "30", "100", "1", "1"]
    assert sh("DEADLINE=100; SECONDS=50; time_for a && echo run; SECONDS=70; time_for b || echo skip")[-1] == "skip"
    assert sh("DEADLINE=100; SECONDS=50; time_for a && echo run") == ["run"]
    # by_memory: the card's memory (MiB, from a stand-in nvidia-smi) picks the default; no answer: the smaller one
    for answer, want in (("echo 143771", "40"), ("echo 81559", "32"), ("return 127", "32")):
        assert sh(f"nvidia-smi() {{ {answer}; }}; by_memory 40 32") == [want]
    assert sh('printf "kept\\n  @ 0x7f frame\\nE1206 log line\\n" | quiet') == ["kept"]


def test_bundle_out_tars_the_top_level_files_only_past_eight(tmp_path):
    """gpu/_bundle_out.sh: a folder of at most 8 files is left alone; past 8 its top-level files go into logs.tgz
    (the originals removed), a subfolder stays."""
    import subprocess
    import tarfile

    def bundle(d):
        subprocess.run(["bash", "-c", f'source "{BENCHMARKS}/gpu/_bundle_out.sh" && bundle_out "{d}"'], check=True)

    few, many = tmp_path / "few", tmp_path / "many"
    for d, n in ((few, 8), (many, 9)):
        d.mkdir()
        for i in range(n):
            (d / f"log{i}.txt").write_text(f"line {i}\n")
    (many / "trace").mkdir()
    (many / "trace" / "t.json").write_text("{}")
    bundle(few)
    bundle(many)
    assert sorted(p.name for p in few.iterdir()) == [f"log{i}.txt" for i in range(8)]
    assert sorted(p.name for p in many.iterdir()) == ["logs.tgz", "trace"]
    with tarfile.open(many / "logs.tgz") as tar:
        assert sorted(m.name.removeprefix("./") for m in tar.getmembers()) == [f"log{i}.txt" for i in range(9)]
        assert tar.extractfile("./log3.txt").read() == b"line 3\n"


NCU_HEADER = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'


def ncu_csv(path: Path, nanoseconds):
    lines = [f'"{i}","device_kernel","gpu__time_duration.sum","ns","{ns:,}"\n' for i, ns in enumerate(nanoseconds)]
    path.write_text("==PROF== Connected to process\n" + NCU_HEADER + "".join(lines))


def test_kernels_report_attributes_ncu_kernels_in_launch_order(tmp_path):
    """`kernels report` maps ncu's kernels onto the plan in launch order, drops each first (warm-up) launch, takes
    the median of the rest in microseconds, and attributes nothing when the counts do not match."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps([dict(case="c", impl="cutlass[a]", launches=4),
                                dict(case="c", impl="torch._grouped_mm", launches=4)]))
    ncu_csv(tmp_path / "ncu.csv", [9000, 100, 300, 200, 9000, 1500, 400, 400])
    out, saved = run("bench_grouped_matmul", ["kernels", "report", "--plan", str(plan), "--csv",
                                              str(tmp_path / "ncu.csv")], tmp_path / "kernels.json")
    assert saved == out == {"c": {"cutlass[a]": pytest.approx(0.2), "torch._grouped_mm": pytest.approx(0.4)}}
    ncu_csv(tmp_path / "short.csv", [100] * 7)
    bench = load("bench_grouped_matmul")
    assert bench.main(["kernels", "report", "--plan", str(plan), "--csv", str(tmp_path / "short.csv")]) == {}


def test_gpu_session_scripts_call_scripts_and_subcommands_that_exist():
    """Every `benchmarks/NAME.py [SUBCOMMAND]` in benchmarks/gpu/*.sh names a script here and, for the scripts with
    subcommands, one of them (or a flag: the default subcommand)."""
    commands = {"bench_dwdp": set(load("bench_dwdp").COMMANDS), "bench_grouped_matmul":
                set(load("bench_grouped_matmul").COMMANDS)}
    seen = set()
    for script in sorted((BENCHMARKS / "gpu").glob("*.sh")):
        text = "\n".join(line for line in script.read_text().splitlines() if not line.lstrip().startswith("#"))
        for name, word in re.findall(r"benchmarks/(\w+)\.py\b[ \t]*([^\s\\]*)", text):
            assert (BENCHMARKS / f"{name}.py").is_file(), (script.name, name)
            if name in commands and not word.startswith(("-", '"$', "$")):
                assert word in commands[name], (script.name, name, word)
            seen.add(name)
        for word in re.findall(r"^\s*bench \w+ \S+ (\w+) ", text, flags=re.M):  # grouped_matmul_h200.sh's helper
            assert word in commands["bench_grouped_matmul"], (script.name, word)
            seen.add(word)
    assert {"bench_dwdp", "bench_pipeline", "bench_grouped_matmul", "calls", "fusion"} <= seen


def test_gmm_configs_summary_orders_each_case_fastest_first():
    """benchmarks/gpu/gmm_configs_summary.py on a committed run (seven tiles, H200, 2026-12-02): one line per case, the
    automatic choice named, the configs in increasing time."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gmm_configs_summary", BENCHMARKS / "gpu" / "gmm_configs_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    results = json.loads((BENCHMARKS / "results" / "grouped_matmul_h200_2026-12-02_fifteenth_c.json").read_text())
    lines = mod.lines(results)
    assert len(lines) == len(results["rows"]) == 12
    for line, row in zip(lines, results["rows"]):
        assert line.startswith(f"{row['model']:9} {row['proj']:7}") and f"({row['cutlass_auto_config']})" in line
        times = [float(cell.split("=")[1]) for cell in line.split("| ")[1].split()]
        assert times == sorted(times) and len(times) == 7


def test_prefill_ratio_puts_both_sides_by_length_and_shows_what_did_not_finish(tmp_path):
    """gpu/prefill_ratio.py: per length jax_dwdp's and transformers' ms and MFU and transformers ms / jax_dwdp ms; a
    length one side did not run is "-", one that ran out of memory shows the error; a missing file reads as no rows;
    transformers' Mamba-2 path is named; MFU against the measured dense rate, where the rows carry it."""
    spec = importlib.util.spec_from_file_location("prefill_ratio", BENCHMARKS / "gpu" / "prefill_ratio.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    same = dict(preset="nemotron-h:nano-30b-a3b", layers=52, batch=1, logits_finite=True)
    ours = tmp_path / "prefill.json"
    ours.write_text(json.dumps({"rows": [dict(seq_len=4096, prefill_ms=80.0, mfu=0.4, **same),
                                         dict(seq_len=16384, prefill_ms=300.0, mfu=0.5, **same),
                                         dict(seq_len=32768, prefill_ms=700.0, mfu=0.5, **same)]}))
    theirs = tmp_path / "hf.json"
    theirs.write_text(json.dumps({"rows": [
        dict(seq_len=4096, prefill_ms=200.0, mfu=0.16, mamba_path="mamba_ssm", **same),
        dict(seq_len=16384, error="out of device memory: CUDA", mamba_path="torch")]}))
    header, *rows, path = mod.lines(mod.read(ours), mod.read(theirs))
    assert header.split() == ["tokens", "jax_dwdp", "ms", "MFU", "transformers", "ms", "MFU", "ratio"]
    assert rows[0].split() == ["4096", "80.0", "40.0%", "200.0", "16.0%", "2.50x"]
    assert "out of device memory" in rows[1] and rows[1].endswith("-")
    assert rows[2].split() == ["32768", "700.0", "50.0%", "-", "-"]
    assert path == "transformers' Mamba-2 path: mamba_ssm, torch"
    assert mod.read(tmp_path / "missing.json") == {} and len(mod.lines(mod.read(ours), {})) == 4
    # a stale file of another depth, or logits that are not finite: no ratio, and why
    theirs.write_text(json.dumps({"rows": [dict(seq_len=4096, prefill_ms=200.0, mfu=0.16, **{**same, "layers": 8})]}))
    assert mod.lines(mod.read(ours), mod.read(theirs))[1].endswith("-  (no ratio: layers 52 vs 8)")
    theirs.write_text(json.dumps({"rows": [dict(seq_len=4096, prefill_ms=200.0, mfu=0.16,
                                                **{**same, "logits_finite": False})]}))
    assert mod.lines(mod.read(ours), mod.read(theirs))[1].endswith("(no ratio: logits not finite)")
    # with --dense-rate's MFU in jax_dwdp's rows, a line of them
    ours.write_text(json.dumps({"rows": [dict(seq_len=4096, prefill_ms=80.0, mfu=0.4, mfu_dense=0.52, **same)]}))
    assert mod.lines(mod.read(ours), {})[-1] == ("jax_dwdp's MFU against the dense matmul rate measured in its run: "
                                                 "4096 tokens 52.0%")


def test_layer_kernel_probe_names_each_fusion(tmp_path):
    """probe_layer_kernels on the tiny preset: both layer types traced (host events on the CPU), their optimized HLO
    written, and every fusion of the HLO described by its ops (a multi-output fusion's tuple shape too)."""
    mod = load("probe_layer_kernels")
    result = mod.main(["--preset", "tiny", "--tokens", "16", "--calls", "1", "--out-dir", str(tmp_path)])
    assert [r["layer"] for r in result["rows"]] == ["linear_attention", "full_attention"]
    assert all(r["kernel_ms"] > 0 and r["kernels"] for r in result["rows"])
    hlo = (tmp_path / "linear_attention_16.hlo.txt").read_text()
    ops = mod.fusion_ops(hlo)
    assert ops and all(v.startswith("-> ") and "root " in v for v in ops.values())
    assert json.loads((tmp_path / "kernels.json").read_text())["rows"][0]["tokens"] == 16
    assert all(0 < r["kernel_ms"] for r in result["rows"]) and all("span_ms" in r for r in result["rows"])
    moe = mod.main(["--preset", "tiny", "--tokens", "16", "--calls", "1", "--parts", "moe", "--out-dir",
                    str(tmp_path / "moe")])
    assert [r["layer"] for r in moe["rows"]] == ["moe"] and moe["rows"][0]["kernels"]
    assert "sort" in (tmp_path / "moe" / "moe_16.hlo.txt").read_text()  # the CPU's routing: an argsort
    text = """%fused_pair (p0: f32[4], p1: f32[4]) -> (f32[4], f32[4]) {
  %p0 = f32[4]{0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %a = f32[4]{0} add(%p0, %p1)
  %m = f32[4]{0} multiply(%p0, %p1)
  ROOT %t = (f32[4]{0}, f32[4]{0}) tuple(%a, %m)
}

ENTRY %main (x: f32[4], y: f32[4]) -> (f32[4], f32[4]) {
  %x = f32[4]{0} parameter(0)
  %y = f32[4]{0} parameter(1)
  ROOT %loop_fusion.3 = (f32[4]{0}, f32[4]{0}) fusion(%x, %y), kind=kLoop, calls=%fused_pair
}
"""
    assert mod.fusion_ops(text) == {"loop_fusion.3": "-> (f32[4]{0}, f32[4]{0}); root tuple; add x1, multiply x1, tuple x1"}


def test_gpu_profile_runs_on_the_cpu_and_plan_reads_what_it_writes(tmp_path, capsys):
    """benchmarks/profile_gpu.py is meant for a GPU; on the CPU it runs at tiny sizes with a host thread standing in
    for the copy stream, every source saying so, and `jax-dwdp plan --profile FILE` predicts from the file."""
    from jax_dwdp.cli import main as cli
    from jax_dwdp.planner import load_profile

    out = tmp_path / "cpu_profile.json"
    written = load("profile_gpu").main(["--preset", "tiny", "--tokens", "32", "64", "--gemm-size", "64",
                                        "--copy-layers", "2", "--calls", "1", "--reps", "1", "--link", "nvlink4",
                                        "--out", str(out)])
    profile = load_profile(out)
    assert profile.model_name == "tiny" and profile.link.kind == "spec sheet"
    assert [t for t, *_ in profile.moe.points] == [32, 64] and len(profile.contention.tokens) == 2
    sources = [p["source"] for pts in written["layers"].values() for p in pts]
    sources += [p["source"] for p in written["copy"]["under_compute"]] + [written["copy"]["alone_gib_s"]["source"]]
    assert all("cpu stand-in" in s and "profile_gpu.py" in s for s in sources), sources
    capsys.readouterr()
    assert cli(["plan", "--preset", "tiny", "--dwdp", "2", "--profile", str(out), "--stream", "normal:48,8,16,64",
                "--bucket", "16", "--requests", "3"]) == 0
    text = capsys.readouterr().out
    assert "prediction (a model, not a measurement): profile cpu" in text and "DWDP / DEP:" in text

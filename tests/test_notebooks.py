"""Every notebook under notebooks/ runs top to bottom (its cells assert what they show), leaves no temporary files
behind and keeps its outputs small; the plotting helpers they share read the committed results correctly."""

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # a test extra; absent on the GPU image
NotebookClient = pytest.importorskip("nbclient").NotebookClient
pytest.importorskip("matplotlib")

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
OUTPUT_LIMIT = 400_000  # bytes of outputs per executed notebook (small PNGs and short tables)

sys.path.insert(0, str(ROOT / "notebooks"))
import results_plots as rp  # noqa: E402


def _output_bytes(nb) -> int:
    return sum(len(json.dumps(o)) for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


DEVICES = {"02_pipeline_and_dwdp.ipynb": 4}  # pipeline 2 x DWDP 2 (its kernel inherits XLA_FLAGS)


@pytest.mark.parametrize("path", [pytest.param(p, marks=[pytest.mark.devices(DEVICES[p.name])] if p.name in DEVICES
                                               else []) for p in NOTEBOOKS], ids=lambda p: p.name)
def test_notebook_runs_and_leaves_nothing_behind(path, tmp_path, monkeypatch):
    temp = tmp_path / "tmpdir"  # the kernel's temporary directory: whatever a notebook leaves there is a leak
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setenv("JAX_DWDP_FRESH_RUNS", "0")  # a GPU machine would otherwise re-run the benchmarks (minutes)
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "matplotlib"))  # its font cache (else in TMPDIR if no home)
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, "\n".join(errors[0].get("traceback", []))
    # torch keeps one compile cache per user there (torchinductor_<user>), reused by every run: not a leak
    left = sorted(p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_"))
    print(f"{path.name}: outputs {_output_bytes(nb)} bytes, left in TMPDIR: {left}")
    assert not left, f"{path.name} left {left} in its temporary directory"
    assert _output_bytes(nb) <= OUTPUT_LIMIT


def test_there_are_notebooks_with_plots():
    assert NOTEBOOKS
    sources = [nbformat.read(p, as_version=4) for p in NOTEBOOKS]
    assert sum("rp.plot_" in c.source for nb in sources for c in nb.cells) >= 6


def test_committed_notebook_outputs_are_small():
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        assert _output_bytes(nb) <= OUTPUT_LIMIT, path.name


# ---- the helpers -------------------------------------------------------------------------------------------------


def test_summary_files_name_their_source():
    """Numbers copied from RESULTS.md or logs into JSON say where they came from."""
    for name in ("layer_parts_h200_2026-11-30_02897cb.json", "gdn_h200_2026-12-01_seventh.json"):
        data = rp.load(name)
        assert "RESULTS.md" in data["source"] or ".log" in data["source"], name
        assert data["rows"]


def test_gdn_summary_equals_the_logs_rows():
    rows = rp.load("gdn_h200_2026-12-01_seventh.json")["rows"]
    logged = []
    for run in ("a", "b"):
        text = (rp.RESULTS / f"gdn_h200_2026-12-01_seventh_{run}.log").read_text()
        logged += [dict(json.loads(line), run=run.upper()) for line in text.splitlines() if line.startswith("{")]
    assert rows == logged


def test_pipeline_schedule():
    bars = rp.pipeline_schedule([2.0, 3.0, 1.0], 3)
    end = {(s, j): stop for s, j, _, stop in bars}
    for s, j, start, stop in bars:
        assert start == max(end.get((s, j - 1), 0.0), end.get((s - 1, j), 0.0))
        assert stop - start == [2.0, 3.0, 1.0][s]
    assert max(end.values()) == 2 + 3 * 3 + 1  # the slowest stage runs back to back once it starts
    assert rp.pipeline_schedule([5.0], 1) == [(0, 0, 0.0, 5.0)]


def test_dep_points_only_from_dep_measurements(tmp_path):
    assert rp.dep_points(tmp_path) == []
    (tmp_path / "stage.json").write_text(json.dumps({"rows": [{"seq_len_per_rank": 4096, "ffi_ms": 1.0,
                                                              "replicated_ms": 1.0}]}))
    (tmp_path / "notes.txt.json").write_text("not json")
    assert rp.dep_points(tmp_path) == []  # DWDP rows alone give no DEP series
    (tmp_path / "dep.json").write_text(json.dumps({"rows": [{"tokens_per_rank": 8192, "dep_ms": 3.0,
                                                            "replicated_ms": 2.0}]}))
    (tmp_path / "stream.json").write_text(json.dumps({"args": {"mean": 16384}, "rows": [
        {"scheme": "dep", "stream": "balanced", "tokens_per_s_per_gpu": 50.0},
        {"scheme": "replicated", "stream": "balanced", "tokens_per_s_per_gpu": 60.0},
        {"scheme": "dep", "stream": "uneven", "tokens_per_s_per_gpu": 10.0}]}))
    points = {p["label"]: (p["tokens_per_rank"], p["vs_replicated"]) for p in rp.dep_points(tmp_path)}
    assert points == {"dep": (8192, 1.5), "stream (balanced stream)": (16384, 1.2)}


def test_gemm_rows_are_the_results_tables():
    rows = {(r["model"], r["proj"], r["tokens"], r["routing"]): r["speedup"] for r in rp.committed_gemm_rows()}
    assert len(rows) == 24
    # RESULTS.md, "MoE grouped GEMM", current numbers
    assert round(rows["35b-a3b", "gate_up", 16384, "skewed"], 2) == 0.98
    assert round(rows["122b-a10b", "gate_up", 4096, "uniform"], 2) == 1.37
    assert round(rows["397b-a17b", "down", 4096, "skewed"], 2) == 1.34


def test_fresh_runs_are_off_without_gpus_or_when_asked(monkeypatch):
    monkeypatch.setenv("JAX_DWDP_FRESH_RUNS", "0")
    assert not rp.fresh_runs_wanted(0)
    monkeypatch.delenv("JAX_DWDP_FRESH_RUNS")
    assert rp.fresh_runs_wanted(0)
    assert rp.fresh_runs_wanted(1) == (rp.gpu_count() >= 1)


def test_layer_part_rows_read_bench_layer_parts():
    """The committed H200 run of 2026-12-01 through the converter the notebook uses: one row per token count with every
    plotted key, equal to the JSON's own parts (the default variant, not "(XLA routing)")."""
    result = rp.load("layer_parts_h200_2026-12-01_tenth_a.json")
    rows = rp.layer_part_rows(result)
    assert [r["tokens"] for r in rows] == [4096, 16384, 32768]
    parts = {(r["tokens"], r["part"]): r["ms"] for r in result["rows"]}
    for r in rows:
        assert set(r) == {"tokens", *rp.LAYER_PART_NAMES}
        for key, part in rp.LAYER_PART_NAMES.items():
            assert r[key] == round(parts[(r["tokens"], part)], 3)
    assert rows[1]["moe_block_ms"] < parts[(16384, "MoE block (XLA routing)")]
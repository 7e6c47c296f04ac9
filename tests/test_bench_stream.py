"""benchmarks/bench_stream.py (DWDP vs DEP vs replicated on request streams) on the CPU: tiny model, few short
requests, all schemes in this process; checks the streams and the JSON, not the timings."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_stream.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_stream", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_streams_come_from_the_seed_and_respect_their_bounds():
    bench = _bench()
    kw = dict(mean=16384, std=4096, lo=2048, hi=32768, seed=0)
    uneven = bench.stream_lengths("uneven", 2, 400, **kw)
    assert uneven == bench.stream_lengths("uneven", 2, 400, **kw)  # fixed seed
    assert uneven != bench.stream_lengths("uneven", 2, 400, **{**kw, "seed": 1})
    flat = np.array(uneven).ravel()
    assert flat.min() >= 2048 and flat.max() <= 32768 and abs(flat.mean() - 16384) < 600 and 3500 < flat.std() < 4600
    assert uneven[0] != uneven[1]  # each rank its own stream
    assert bench.stream_lengths("balanced", 2, 3, **kw) == [[16384] * 3] * 2
    clipped = np.array(bench.stream_lengths("uneven", 1, 200, **{**kw, "std": 40000})).ravel()
    assert clipped.min() == 2048 and clipped.max() == 32768


@pytest.mark.devices(2)
def test_stream_benchmark_runs_every_scheme_on_the_cpu(tmp_path):
    bench = _bench()
    out = tmp_path / "stream.json"
    result = bench.main(["--preset", "tiny", "--num-layers", "2", "--requests", "2", "--mean", "40", "--std", "16",
                         "--min", "8", "--max", "80", "--bucket", "32", "--dtype", "float32", "--in-process",
                         "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == result["rows"]
    rows = {(r["scheme"], r["stream"]): r for r in result["rows"]}
    assert set(rows) == {(s, t) for s in ("dwdp", "dep", "replicated") for t in ("balanced", "uneven")}
    uneven = rows["dwdp", "uneven"]["prompt_lengths"]
    for (scheme, stream), r in rows.items():
        assert r["requests"] == 4 and r["real_tokens"] == sum(r["prompt_lengths"])
        assert r["prompt_lengths"] == ([40] * 4 if stream == "balanced" else uneven)  # the same stream for all
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["makespan_s"] + 1e-9 and r["tokens_per_s_per_gpu"] > 0
        assert 0 <= r["padding_fraction"] < 1
        assert len(r["peak_device_bytes"]) == len(r["plan_weights_and_buffers_bytes"]) == 2
    assert len(set(uneven)) > 1
    # DEP pads each step to its longest prompt: at least the padding of the independent ranks.
    assert rows["dep", "uneven"]["padding_fraction"] >= rows["dwdp", "uneven"]["padding_fraction"]
    dep = rows["dep", "uneven"]
    assert dep["dep_profiled_steps"] == 1 and 0 <= dep["dep_wait_ms_per_layer"] <= dep["dep_wait_ms_per_layer_max"]
    assert rows["dwdp", "balanced"]["experts"] == "xla" and rows["replicated", "balanced"]["experts"] == "local"
    # plan: a DWDP rank holds about half the experts of a replicated one, DEP no expert buffers
    rep = rows["replicated", "balanced"]["plan_weights_and_buffers_bytes"][0]
    assert rows["dep", "balanced"]["plan_weights_and_buffers_bytes"][0] < rep
    assert {s["stream"] for s in result["summary"]} == {"balanced", "uneven"}
    assert all(s["dwdp_vs_dep"] > 0 and s["dwdp_vs_replicated"] > 0 for s in result["summary"])
    # runs made one scheme at a time join into the same summary
    for scheme in ("dwdp", "dep", "replicated"):
        part = dict(result, rows=[r for r in result["rows"] if r["scheme"] == scheme])
        (tmp_path / f"{scheme}.json").write_text(json.dumps(part))
    merged = bench.main(["--merge", *(str(tmp_path / f"{s}.json") for s in ("dwdp", "dep", "replicated"))])
    assert merged["summary"] == result["summary"] and merged["rows"] == result["rows"]

"""Where a traced call's device time goes: the kernels of a `jax.profiler` Perfetto trace, summed by name.

    python benchmarks/trace_summary.py TRACE_DIR [--top 25]

TRACE_DIR is what `jax.profiler.trace(TRACE_DIR, create_perfetto_trace=True)` wrote (the newest
perfetto_trace.json.gz under it is read). Device events are those of processes whose name names a GPU or device;
when the trace has none (no CUPTI), the host events are summarised instead and the output says so.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib


def load(trace_dir: str | pathlib.Path) -> dict:
    files = sorted(pathlib.Path(trace_dir).rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not files:
        raise FileNotFoundError(f"{trace_dir}: no perfetto_trace.json.gz under it")
    with gzip.open(files[-1], "rt") as f:
        return json.load(f)


def summarize(trace: dict, top: int = 25) -> dict:
    """{'device': bool, 'total_ms', 'span_ms', 'kernels': [(name, calls, total ms)] by total, descending}."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {p for p, n in names.items() if "gpu" in n.lower() or "device" in n.lower()}
    chosen = [e for e in events if e.get("ph") == "X" and "dur" in e
              and (e["pid"] in device_pids if device_pids else True)]
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in chosen:
        s = by_name[e.get("name", "?")]
        s[0] += 1
        s[1] += e["dur"] / 1e3  # microseconds -> ms
    rows = sorted(((n, c, round(ms, 3)) for n, (c, ms) in by_name.items()), key=lambda r: -r[2])
    start = min((e["ts"] for e in chosen), default=0.0)
    end = max((e["ts"] + e["dur"] for e in chosen), default=0.0)
    return dict(device=bool(device_pids), processes=sorted(names.values()), events=len(chosen),
                total_ms=round(sum(r[2] for r in rows), 3), span_ms=round((end - start) / 1e3, 3), kernels=rows[:top])


def render(summary: dict) -> str:
    kind = "device" if summary["device"] else "host (no device events in the trace)"
    lines = [f"{kind} events: {summary['events']}, summed {summary['total_ms']:.2f} ms over a span of "
             f"{summary['span_ms']:.2f} ms", f"{'ms':>9} {'calls':>6}  name"]
    lines += [f"{ms:>9.3f} {calls:>6}  {name[:110]}" for name, calls, ms in summary["kernels"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    summary = summarize(load(args.trace_dir), args.top)
    print(render(summary))
    return summary


if __name__ == "__main__":
    main()

"""Where a traced call's device time goes: the kernels of a `jax.profiler` Perfetto trace, summed by name.

    python benchmarks/trace_summary.py TRACE_DIR [--top 25] [--gap-us 5] [--versus OTHER_DIR]

TRACE_DIR is what `jax.profiler.trace(TRACE_DIR, create_perfetto_trace=True)` wrote (the newest
perfetto_trace.json.gz under it is read). Device events are those of processes whose name names a GPU or device;
when the trace has none (no CUPTI), the host events are summarised instead and the output says so.

Gaps: the idle time between the device's busy intervals (the union of every device event, whatever its stream),
each gap of at least --gap-us microseconds put on the pair (kernel that ended last before it, kernel that starts
after it), pairs summed and listed by total: where the span's time outside the kernels goes (launch gaps inside a
program, or the boundary between two programs).
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


def trace_call(run, where: str | pathlib.Path, top: int | None = 25, gap_us: float = 5.0) -> dict:
    """`run()` once under `jax.profiler.trace` (its Perfetto trace written in `where`), waited for, and the trace
    summarised (`summarize`)."""
    import jax

    with jax.profiler.trace(str(where), create_perfetto_trace=True):
        jax.block_until_ready(run())
    return summarize(load(where), top, gap_us)


def gaps(chosen: list[dict], min_us: float = 5.0, top: int = 15) -> dict:
    """The idle time between the union of the events' intervals: {'idle_ms' (all of it), 'counted_ms' / 'count'
    (gaps >= min_us), 'pairs': [(before, after, count, total ms)] by total, descending, 'largest': [(ms from the
    first event's start, gap ms, before, after)] of the `top` longest gaps, in time order}."""
    spans = sorted((e["ts"], e["ts"] + e["dur"], e.get("name", "?")) for e in chosen)
    idle = counted = 0.0
    count = 0
    pairs: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    every = []
    if spans:
        end, last = spans[0][1], spans[0][2]
        for start, stop, name in spans[1:]:
            if start > end:
                gap = start - end
                idle += gap
                if gap >= min_us:
                    counted += gap
                    count += 1
                    pair = pairs[last[:60], name[:60]]
                    pair[0] += 1
                    pair[1] += gap / 1e3
                    every.append((round((end - spans[0][0]) / 1e3, 3), round(gap / 1e3, 3), last[:60], name[:60]))
            if stop >= end:
                end, last = stop, name
    rows = sorted(((b, a, c, round(ms, 3)) for (b, a), (c, ms) in pairs.items()), key=lambda r: -r[3])
    largest = sorted(sorted(every, key=lambda r: -r[1])[:top])
    return dict(idle_ms=round(idle / 1e3, 3), counted_ms=round(counted / 1e3, 3), count=count, min_us=min_us,
                pairs=rows[:top], largest=largest)


def summarize(trace: dict, top: int | None = 25, gap_us: float = 5.0) -> dict:
    """{'device': bool, 'total_ms', 'span_ms', 'kernels': [(name, calls, total ms)] by total, descending (the first
    `top`, None: all), 'gaps':
    `gaps(...)` of the chosen events}."""
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
                total_ms=round(sum(r[2] for r in rows), 3), span_ms=round((end - start) / 1e3, 3),
                kernels=rows if top is None else rows[:top],
                gaps=gaps(chosen, gap_us))


def render(summary: dict) -> str:
    kind = "device" if summary["device"] else "host (no device events in the trace)"
    lines = [f"{kind} events: {summary['events']}, summed {summary['total_ms']:.2f} ms over a span of "
             f"{summary['span_ms']:.2f} ms", f"{'ms':>9} {'calls':>6}  name"]
    lines += [f"{ms:>9.3f} {calls:>6}  {name[:110]}" for name, calls, ms in summary["kernels"]]
    g = summary.get("gaps")
    if g:
        lines.append(f"idle between busy intervals: {g['idle_ms']:.3f} ms, of it {g['counted_ms']:.3f} ms in "
                     f"{g['count']} gaps of >= {g['min_us']:g} us, by the kernels on either side:")
        lines += [f"{ms:>9.3f} {c:>6}  {b}  ->  {a}" for b, a, c, ms in g["pairs"]]
        lines.append("the longest gaps, at ms from the first event's start:")
        lines += [f"{at:>9.3f} {ms:>7.3f} ms  {b}  ->  {a}" for at, ms, b, a in g.get("largest", [])]
    return "\n".join(lines)


def compare(a: dict, b: dict, top: int = 25) -> list[tuple[str, int, float, int, float]]:
    """Two `summarize(..., top=None)` results: [(name, calls in a, ms in a, calls in b, ms in b)] for every kernel
    name in either, by |ms in b - ms in a|, largest first (the first `top`)."""
    left = {n: (c, ms) for n, c, ms in a["kernels"]}
    right = {n: (c, ms) for n, c, ms in b["kernels"]}
    rows = [(n, *left.get(n, (0, 0.0)), *right.get(n, (0, 0.0))) for n in left.keys() | right.keys()]
    return sorted(rows, key=lambda r: (-abs(r[4] - r[2]), r[0]))[:top]


def labels(a: str, b: str) -> tuple[str, str]:
    """Short names for two trace directories: their paths from the last folder in which they differ on (so
    `traces/layerwise/4096` and `traces/scan/4096` read `layerwise/4096` and `scan/4096`)."""
    pa, pb = pathlib.Path(a).parts, pathlib.Path(b).parts
    tail = 0
    while tail < min(len(pa), len(pb)) and pa[len(pa) - 1 - tail] == pb[len(pb) - 1 - tail]:
        tail += 1
    keep = tail + 1
    return "/".join(pa[-keep:]), "/".join(pb[-keep:])


def render_compare(a: dict, b: dict, rows, names=("A", "B")) -> str:
    lines = [f"{names[0]}: {a['total_ms']:.3f} ms of kernels in a {a['span_ms']:.3f} ms span; {names[1]}: "
             f"{b['total_ms']:.3f} ms in {b['span_ms']:.3f} ms (idle {a['gaps']['idle_ms']:.3f} / "
             f"{b['gaps']['idle_ms']:.3f} ms)",
             f"{'calls':>6} {names[0] + ' ms':>10} {'calls':>6} {names[1] + ' ms':>10} {'diff':>9}  name"]
    lines += [f"{ca:>6} {ma:>10.3f} {cb:>6} {mb:>10.3f} {mb - ma:>+9.3f}  {n[:100]}" for n, ca, ma, cb, mb in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace_dir")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--gap-us", type=float, default=5.0, help="the shortest idle gap put on its kernel pair")
    ap.add_argument("--versus", metavar="OTHER_DIR", help="compare with this trace, kernel name by kernel name")
    args = ap.parse_args(argv)
    if args.versus:
        a, b = (summarize(load(d), None, args.gap_us) for d in (args.trace_dir, args.versus))
        rows = compare(a, b, args.top)
        print(render_compare(a, b, rows, labels(args.trace_dir, args.versus)))
        return dict(a=a, b=b, rows=rows)
    summary = summarize(load(args.trace_dir), args.top, args.gap_us)
    print(render(summary))
    return summary


if __name__ == "__main__":
    main()

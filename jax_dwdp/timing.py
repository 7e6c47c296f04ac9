"""Wall-clock timing of asynchronous JAX work, for the CLI and the benchmarks (never for tests)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax


def median_seconds(fn: Callable[[], object], iters: int) -> tuple[float, list[float]]:
    """Runs fn() `iters` times, each waited for; returns (median, all times) in seconds. Warm up before."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def wall_ms(fn: Callable[[], object], sync: Callable[[object], object], calls: int = 10, reps: int = 5) -> float:
    """Median over `reps` of the wall time per call, in ms, of `calls` back-to-back fn() calls waited for once at
    the end by `sync` (jax.block_until_ready, torch.cuda.synchronize, ...): a kernel's time with launches pipelined,
    for comparing frameworks on the same device. Three warm-up calls first (compilation, autotuning)."""
    for _ in range(3):
        sync(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn()
        sync(out)
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(times)


def save_rows(path: str | Path | None, rows: list[dict], args=None, **extra) -> None:
    """Writes a benchmark's rows as JSON {**extra, "args": vars(args), "device": ..., "rows": rows} (no path: no-op)."""
    if not path:
        return
    record = {**extra, "args": vars(args) if args is not None else None, "device": jax.devices()[0].device_kind,
              "rows": rows}
    Path(path).write_text(json.dumps(record, indent=1))

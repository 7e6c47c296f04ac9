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


def save_rows(path: str | Path | None, rows: list[dict], args=None, **extra) -> None:
    """Writes a benchmark's rows as JSON {**extra, "args": vars(args), "device": ..., "rows": rows} (no path: no-op)."""
    if not path:
        return
    record = {**extra, "args": vars(args) if args is not None else None, "device": jax.devices()[0].device_kind,
              "rows": rows}
    Path(path).write_text(json.dumps(record, indent=1))

"""Wall-clock timing of asynchronous JAX work, for the CLI and the benchmarks (never for tests)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def median_seconds(fn: Callable[[], object], iters: int) -> tuple[float, list[float]]:
    """Runs fn() `iters` times, each waited for; returns (median, all times) in seconds. Warm up before."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times

"""The GPU's clock and power while it works: a sustained dense bf16 matmul, and optionally another command, each
run with `nvidia-smi` sampling the SM clock, power draw, temperature and throttle reasons in the background.

    python3 benchmarks/probe_power.py [--n 8192] [--calls 50 400] [--cmd "python3 benchmarks/bench_prefill.py ..."]
        [--out power.json]

The dense rate (2 n^3 FLOP a call, back-to-back calls, one wait) answers what an H200 sustains at its power cap,
the denominator an MFU figure needs besides the 781 TFLOP/s of shared/docs/gpu_facts.md; the samples say whether a
workload runs power-capped (throttle reason 0x4, the software power cap). Samples under --min-watts count as idle.
Without nvidia-smi (a CPU machine) the matmul still runs and the samples are empty.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"


class Sampler:
    """nvidia-smi every `period_ms` into a temporary file while the block runs (nothing without nvidia-smi); the
    process is stopped and the file read and removed on every exit from the block, `rows` then holds the samples."""

    def __init__(self, period_ms: int):
        self.period_ms, self.proc, self.rows = period_ms, None, []

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self.file = tempfile.NamedTemporaryFile("w+", suffix=".csv")
            try:
                self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                              f"-lms={self.period_ms}"], stdout=self.file, stderr=subprocess.DEVNULL)
            except BaseException:
                self.file.close()
                raise
        return self

    def __exit__(self, *exc):
        if self.proc is None:
            return
        try:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.file.seek(0)
            lines = self.file.read().splitlines()
            self.rows = [r for r in (line.split(", ") for line in lines if line.strip()) if len(r) == 4]
        finally:
            self.file.close()  # a NamedTemporaryFile: closing removes it


def summarize(rows: list[list[str]], min_watts: float) -> dict:
    """Median / min / max SM clock (MHz) and power (W) of the samples drawing at least min_watts, and how often each
    throttle-reason mask appears among them."""
    loaded = []
    for r in rows:
        try:
            loaded.append((float(r[0]), float(r[1]), float(r[2]), r[3].strip()))
        except ValueError:  # "[N/A]" fields
            continue
    loaded = [r for r in loaded if r[1] >= min_watts]
    if not loaded:
        return dict(samples=0)
    clk, pw = [r[0] for r in loaded], [r[1] for r in loaded]
    reasons: dict[str, int] = {}
    for r in loaded:
        reasons[r[3]] = reasons.get(r[3], 0) + 1
    return dict(samples=len(loaded), clock_mhz_median=statistics.median(clk), clock_mhz_min=min(clk),
                clock_mhz_max=max(clk), power_w_median=statistics.median(pw), power_w_max=max(pw),
                temp_c_max=max(r[2] for r in loaded), throttle_reasons=reasons)


def dense_rate(n: int, calls: int) -> dict:
    if calls < 1:
        raise ValueError(f"--calls: at least one call, got {calls}")
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    f = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(f(a, b))
    t = time.perf_counter()
    for _ in range(calls):
        c = f(a, b)
    jax.block_until_ready(c)
    dt = time.perf_counter() - t
    return dict(n=n, calls=calls, seconds=dt, tflops=2 * n**3 * calls / dt / 1e12)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=8192, help="matrix size of the dense bf16 matmul")
    ap.add_argument("--calls", type=int, nargs="+", default=[50, 400], help="back-to-back calls per measurement")
    ap.add_argument("--cmd", help="also sample the GPU while this command runs (its output passes through)")
    ap.add_argument("--period-ms", type=int, default=100)
    ap.add_argument("--min-watts", type=float, default=300.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    # This process keeps its JAX client while --cmd runs: it must not hold the GPU memory the command needs.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    result: dict = dict(query=QUERY, rows=[])
    for calls in args.calls:
        with Sampler(args.period_ms) as s:
            rate = dense_rate(args.n, calls)
        row = dict(what=f"dense {args.n}^3 bf16 x {calls}", **rate, gpu=summarize(s.rows, args.min_watts))
        result["rows"].append(row)
        print(f"{row['what']}: {rate['tflops']:.1f} TFLOP/s over {rate['seconds']:.2f} s; {row['gpu']}", flush=True)
    if args.cmd:
        with Sampler(args.period_ms) as s:
            t = time.perf_counter()
            rc = subprocess.call(shlex.split(args.cmd))
            dt = time.perf_counter() - t
        row = dict(what=args.cmd, rc=rc, seconds=dt, gpu=summarize(s.rows, args.min_watts))
        result["rows"].append(row)
        print(f"command (rc {rc}, {dt:.1f} s): {row['gpu']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    rows = main()["rows"]
    sys.exit(max([r.get("rc", 0) for r in rows], default=0))  # the command's exit status, if one ran

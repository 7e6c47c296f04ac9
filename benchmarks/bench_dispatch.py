"""Host time of one rank's layer-wise prefill, split by call: where the dispatch of the layers goes.

    python benchmarks/bench_dispatch.py --preset 35b-a3b --num-layers 8 --seq-len 16384 [--backend xla|ffi]

`IndependentRanks.prefill` returns before the device is done; on two H200s it took 63.6 ms of host time for 8
layers of 35B-A3B at 16K tokens (benchmarks/RESULTS.md), far more than the Python work measured on a CPU. This
wraps the calls the driver makes (jitted programs, device_put, eager jnp ops, the FFI store's programs) with
host timers (no device sync inside a timer), runs warm-up plus --iters prefills, and prints, per call, how many
times it ran per prefill and its host milliseconds per prefill, next to the whole dispatch and the wall time
until the result is ready. A call that blocks on the device shows up as large host time on few calls.
The module functions it wraps are put back at the end (the driver's own methods stay wrapped until it is closed).
One rank at a time: the timers are not thread-safe, so this does not time prefill_all.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_dwdp.prefill as prefill_module
from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.parallel.dwdp import IndependentRanks

TIMES: dict[str, list[float]] = collections.defaultdict(list)
_depth = [0]  # time only the outermost wrapped call (device_put inside a timed call is part of that call)


def timed_call(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _depth[0]:
            return fn(*args, **kwargs)
        _depth[0] += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name].append(time.perf_counter() - t0)
            _depth[0] -= 1
    return wrapper


def instrument(ranks: IndependentRanks) -> list:
    """Wraps every call IndependentRanks.prefill makes that can take host time; returns the module functions to
    restore (the driver's own attributes stay wrapped until it is closed)."""
    undo = []
    for module, name in [(prefill_module, "check_tokens"), (jax, "device_put"), (jnp, "pad"), (jnp, "stack"),
                         (jnp, "zeros")]:
        undo.append((module, name, getattr(module, name)))
        setattr(module, name, timed_call(name, getattr(module, name)))
    for runner in ranks.runners:
        runner._barrier = timed_call("cpu_barrier wait (identity on GPUs)", runner._barrier)
        program = runner.program

        def timed_program(kind, *key, program=program):
            return timed_call(f"{kind} program", program(kind, *key))
        runner.program = timed_program
    ranks.source.prefetch = timed_call("expert prefetch (peer copies or store program)", ranks.source.prefetch)
    return undo


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="35b-a3b")
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--backend", default="xla", choices=["xla", "ffi"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    cfg = ModelConfig.preset(args.preset).replace(num_hidden_layers=args.num_layers)
    devices = jax.devices()[:2]
    if len(devices) < 2:
        raise SystemExit("needs two devices (on the CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    print(f"{cfg.summary()} on {devices[0].device_kind} x 2, backend {args.backend}", flush=True)
    model = init_model(cfg, dtype=jnp.dtype(args.dtype), seed=0, device=devices[0])
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, args.seq_len)).astype(np.int32)
    with IndependentRanks(model, devices, experts=args.backend) as ranks:
        jax.block_until_ready(ranks.prefill(0, tokens, logits="last"))  # compile and warm up
        undo = instrument(ranks)
        TIMES.clear()
        dispatch, wall = [], []
        try:
            for _ in range(args.iters):
                t0 = time.perf_counter()
                out = ranks.prefill(0, tokens, logits="last")
                dispatch.append(time.perf_counter() - t0)
                jax.block_until_ready(out)
                wall.append(time.perf_counter() - t0)
        finally:
            for module, name, original in undo:
                setattr(module, name, original)
    rows = sorted(((name, len(t) / args.iters, sum(t) * 1e3 / args.iters) for name, t in TIMES.items()),
                  key=lambda r: -r[2])
    d_ms, w_ms = float(np.mean(dispatch)) * 1e3, float(np.mean(wall)) * 1e3  # means, like the per-call sums
    print(f"dispatch (host, until prefill returns) {d_ms:.2f} ms; wall until ready {w_ms:.2f} ms "
          f"({cfg.num_hidden_layers} layers, {args.seq_len} tokens)")
    print(f"{'call':40} {'calls/prefill':>13} {'host ms/prefill':>16}")
    for name, n, ms in rows:
        print(f"{name:40} {n:13.1f} {ms:16.3f}")
    accounted = sum(ms for _, _, ms in rows)
    print(f"{'(rest: Python between calls)':40} {'':13} {d_ms - accounted:16.3f}")
    result = dict(args=vars(args), device=devices[0].device_kind, dispatch_ms=d_ms, wall_ms=w_ms,
                  calls={name: dict(calls_per_prefill=n, host_ms_per_prefill=ms) for name, n, ms in rows})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

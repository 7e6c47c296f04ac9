"""Prefill throughput of one model on one device: tokens/s, TFLOP/s, MFU, compile time, peak memory.

    python benchmarks/bench_prefill.py --preset 35b-a3b --seq-lens 4096 16384 --out results.json
    python benchmarks/bench_prefill.py --preset nemotron-h:nano-30b-a3b --seq-lens 4096 16384 --layerwise

A preset of either family, named as the CLI names them (jax_dwdp.families: FAMILY:NAME, a bare name is
Qwen3.5-MoE's); each family's own config, model and FLOP count (`prefill_flops`). Random weights are generated on the
device once; each sequence length is compiled and timed in turn (shortest first, so the peak-memory reading after
each run belongs to the largest run so far; with --scan it also covers the building: the model made one layer at a
time into its stacks, `ScannedModel.from_layers`, the model plus one layer). MFU is against 781 TFLOP/s, the dense
bf16 matmul rate measured on the H200 (shared/docs/gpu_facts.md), and with --dense-rate also against the dense bf16
matmul rate this GPU sustains in the same process right after the prefills (probe_power.dense_rate: 2 n^3 FLOP a
call, back-to-back calls, with nvidia-smi's clock, power and throttle reasons sampled meanwhile, so that the figure
says whether it ran at the power cap): "MFU (dense)". "host ms" is one more call's host time (until it
returns, before the device is waited for): near "prefill ms", the prefill is bound by the host's dispatch, not the
GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_dwdp.config import ModelConfig
from jax_dwdp.kernels.choices import resolve
from jax_dwdp.kernels.grouped_matmul import default_implementation
from jax_dwdp.model import fused_swiglu_enabled, init_model
from jax_dwdp.prefill import jit_prefill
from jax_dwdp.scan import ScannedModel, jit_prefill_scanned
from jax_dwdp.timing import median_seconds

sys.path.insert(0, str(Path(__file__).resolve().parent))  # presets, trace_summary, when loaded by path (tests)
from presets import add_model_args, model_config  # noqa: E402

PEAK_TFLOPS = 781.0


def host_profile(call, top: int) -> None:
    """One call under cProfile (its host time only: the device is waited for after the profile stops); prints the
    `top` functions by cumulative time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    out = call()
    prof.disable()
    jax.block_until_ready(out)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip()), flush=True)


def save(out: str | None, device, rows: list[dict], extra: dict | None = None) -> None:
    """The results so far as JSON at `out` (after every length, whole files only: a run cut by its time limit keeps
    the lengths it finished)."""
    if out:
        tmp = f"{out}.tmp"
        with open(tmp, "w") as f:
            json.dump({"device": device.device_kind, "jax": jax.__version__, "rows": rows, **(extra or {})}, f,
                      indent=1)
        os.replace(tmp, out)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--layerwise", action="store_true", help="one compiled program per layer type (fast compile)")
    ap.add_argument("--scan", action="store_true", help="the layer stack as one scanned program (jax_dwdp.scan)")
    ap.add_argument("--trace", metavar="DIR",
                    help="after timing, trace one more call per length with jax.profiler into DIR/<tokens> and "
                         "print its kernels by total time (benchmarks/trace_summary.py)")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="after timing, profile one more call per length on the host (cProfile, the GPU not waited "
                         "for inside it) and print its N costliest functions: where the GPU's idle start goes")
    ap.add_argument("--fused-swiglu", action="store_true",
                    help="expert gate_up weights in the fused SwiGLU epilogue's layout (CUTLASS only; default: off)")
    ap.add_argument("--dense-rate", type=int, default=0, metavar="CALLS",
                    help="after the prefills, time CALLS back-to-back dense bf16 matmuls of --dense-n and report MFU "
                         "against that rate too (0: off)")
    ap.add_argument("--dense-n", type=int, default=8192)
    args = ap.parse_args(argv)
    if args.dense_rate < 0 or args.dense_n < 1:
        ap.error(f"--dense-rate {args.dense_rate} / --dense-n {args.dense_n}: a number of calls >= 0 and a size >= 1")

    cfg = model_config(ap, args)
    if args.fused_swiglu and not isinstance(cfg, ModelConfig):
        ap.error(f"--fused-swiglu: {args.preset}'s experts have no gate (relu^2), there is no SwiGLU to fuse")
    t0 = time.perf_counter()
    dtype = jnp.dtype(args.dtype)
    scanned = model = None
    if args.scan:  # built one layer at a time into the stacks: the peak is the model plus one layer
        scanned = ScannedModel.random(cfg, dtype=dtype, seed=0, fused_swiglu=args.fused_swiglu)
        jax.block_until_ready(jax.tree.leaves(scanned.stacked))
        fused = args.fused_swiglu  # (init_model puts each layer in the layout asked for)
    else:
        model = init_model(cfg, dtype=dtype, seed=0, fused_swiglu=args.fused_swiglu)
        jax.block_until_ready(jax.tree.leaves(model))
        fused = fused_swiglu_enabled(model)
    init_s = time.perf_counter() - t0
    device = jax.devices()[0]
    rows = []
    impl = default_implementation(dtype)
    if fused and impl != "cutlass":
        print(f"note: --fused-swiglu with the {impl!r} grouped matmul runs the unfused activation on interleaved weights")
    print(f"{cfg.summary()}; random init {init_s:.1f} s on {device.device_kind}; grouped matmul {impl}, "
          f"fused SwiGLU {fused}")
    print(f"{'tokens':>8} {'compile s':>9} {'prefill ms':>10} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8}"
          f" {'host ms':>8}")
    for t in sorted(args.seq_lens):
        tokens = np.random.default_rng(t).integers(0, cfg.vocab_size, (args.batch, t)).astype(np.int32)
        lengths = np.full((args.batch,), t, np.int32)
        if args.scan:
            prefill = jit_prefill_scanned(scanned, logits="last")
        else:
            prefill = jit_prefill(model, logits="last", layerwise=args.layerwise)
        t0 = time.perf_counter()
        prefill.compile(tokens, lengths)
        compile_s = time.perf_counter() - t0
        logits, _ = prefill(tokens, lengths)
        finite = bool(np.isfinite(np.asarray(logits)).all())
        sec, times = median_seconds(lambda: prefill(tokens, lengths), args.iters)
        t0 = time.perf_counter()  # host time: until the call returns, before the GPU is waited for
        out = prefill(tokens, lengths)
        host_ms = (time.perf_counter() - t0) * 1e3
        jax.block_until_ready(out)
        kernels = None
        if args.trace:
            import trace_summary

            kernels = trace_summary.trace_call(lambda: prefill(tokens, lengths), f"{args.trace}/{t}")
            print(trace_summary.render(kernels), flush=True)
        if args.host_profile:
            host_profile(lambda: prefill(tokens, lengths), args.host_profile)
        n = args.batch * t
        tflops = cfg.prefill_flops(args.batch, t, args.batch) / sec / 1e12
        peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
        row = dict(preset=args.preset, grouped_matmul=impl, ssd=resolve(None).ssd, fused_swiglu=fused, layerwise=args.layerwise, scan=args.scan, layers=cfg.num_hidden_layers, batch=args.batch, seq_len=t, dtype=args.dtype,
                   compile_s=round(compile_s, 2), prefill_ms=round(sec * 1e3, 2), tokens_per_s=round(n / sec),
                   tflops=round(tflops, 1), mfu=round(tflops / PEAK_TFLOPS, 4),
                   peak_gib=round(peak / 2**30, 2) if peak else None, logits_finite=finite,
                   times_ms=[round(x * 1e3, 2) for x in times], host_ms=round(host_ms, 2), trace=kernels)
        rows.append(row)
        print(f"{t:>8} {compile_s:>9.1f} {sec * 1e3:>10.1f} {n / sec:>10.0f} {tflops:>8.1f} {tflops / PEAK_TFLOPS:>6.1%} "
              f"{row['peak_gib'] or float('nan'):>8.2f} {host_ms:>8.1f}  finite={finite}", flush=True)
        save(args.out, device, rows)
    extra = {}
    if args.dense_rate:
        extra["dense"] = measured_dense_rate(args.dense_n, args.dense_rate)
        rate = extra["dense"]["tflops"]
        for row in rows:
            row["mfu_dense"] = round(row["tflops"] / rate, 6)
        print(f"dense bf16 {args.dense_n}^3 x {args.dense_rate}: {rate:.1f} TFLOP/s ({rate / PEAK_TFLOPS:.1%} of "
              f"{PEAK_TFLOPS:.0f}; GPU while it ran: {extra['dense']['gpu']}); MFU against it: "
              + ", ".join(f"{r['seq_len']} tokens {r['mfu_dense']:.1%}" for r in rows), flush=True)
        save(args.out, device, rows, extra)
    return {"device": device.device_kind, "jax": jax.__version__, "rows": rows, **extra}


def measured_dense_rate(n: int, calls: int) -> dict:
    """probe_power's dense bf16 matmul rate, with the GPU's clock / power / throttle reasons sampled while it runs
    (empty without nvidia-smi)."""
    from probe_power import Sampler, dense_rate, summarize

    with Sampler(100) as sampler:
        rate = dense_rate(n, calls)
    return dict(rate, gpu=summarize(sampler.rows, 300.0))


if __name__ == "__main__":
    main()

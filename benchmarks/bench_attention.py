"""The prefill attention core, one GPU: cuDNN (the model's) against Pallas Mosaic GPU's FA3-style `attention_mgpu`.

    python benchmarks/bench_attention.py --tokens 4096 16384 32768 [--heads 16/2] [--head-dim 256] --out R.json

Shapes: batch 1, causal, GQA (query/kv heads), the model's [B, T, H, D] layout. `attention_mgpu` computes
softmax(q k^T) v without a scale and keeps its shared-memory tiles in fp16, so it runs on fp16 inputs with q
pre-scaled (d^-0.5 is a power of two for d = 64 / 256: exact); the "with casts" row adds the bf16 -> fp16 casts of
q, k, v and the fp16 -> bf16 cast of the output, what a drop-in replacement would cost. A bf16 call is tried too (the
kernel's bf16 path fails on jax 0.10.2 and 0.11.2: its tiles are fp16; an implementation that fails prints why and
the run goes on).

Accuracy: every implementation's output against a float64 numpy reference on a sample of query rows (the last
`--ref-rows` of the sequence plus the first 64, where the causal window is longest and shortest), and against cuDNN
over the whole output; both printed before any timing. Times: 10 back-to-back calls / 10, median of 5
(jax_dwdp.timing.wall_ms); TF/s counts the causal FLOPs, 4 T^2 Hq D / 2. `--trace` adds each implementation's kernel time
and span per call from a profiler trace (an H200, 2026-12-03: cuDNN's 16K call, 3.484 ms of wall time, is 3.277 ms
of kernels in a 3.334 ms span, benchmarks/RESULTS.md, "Attention"; a probe of the kernel alone timed it at 3.14 ms
on a higher clock).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def reference_rows(q, k, v, rows, scale):
    """float64 causal GQA attention for the query rows `rows` of q [T, Hq, D] (numpy), k, v [T, Hkv, D]."""
    hq, hkv = q.shape[1], k.shape[1]
    rep = hq // hkv
    out = np.empty((len(rows), hq, q.shape[2]))
    for i, t in enumerate(rows):
        for g in range(hkv):
            logits = q[t, g * rep:(g + 1) * rep] @ k[: t + 1, g].T * scale  # [rep, t + 1]
            p = np.exp(logits - logits.max(axis=1, keepdims=True))
            out[i, g * rep:(g + 1) * rep] = (p / p.sum(axis=1, keepdims=True)) @ v[: t + 1, g]
    return out


def _traced(call, sync, calls: int = 5) -> dict:
    """Kernel time per call and the span per call of `calls` back-to-back calls, from a jax.profiler trace."""
    import tempfile

    import jax
    import trace_summary

    sync(call())
    with tempfile.TemporaryDirectory() as where:
        with jax.profiler.trace(where, create_perfetto_trace=True):
            for _ in range(calls):
                out = call()
            sync(out)
        summary = trace_summary.summarize(trace_summary.load(where))
    return {"kernel_ms": summary["total_ms"] / calls, "span_ms": summary["span_ms"] / calls,
            "device_events": summary["device"]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--heads", default="16/2", help="query/kv heads")
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--ref-rows", type=int, default=64)
    ap.add_argument("--configs", nargs="+", default=["64,64,2"],
                    help="attention_mgpu tunings block_q,block_kv,max_concurrent_steps (shared memory: 2 block_q "
                         "+ 2 steps block_kv rows of D fp16 must fit in 227 KiB)")
    ap.add_argument("--trace", action="store_true",
                    help="also trace 5 calls of each implementation (jax.profiler) and report its kernels' time per "
                         "call and the call's span beside the wall time: what of the call is not kernel time")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jax_dwdp.timing import wall_ms
    from jax_dwdp import kernels

    hq, hkv = map(int, args.heads.split("/"))
    d = args.head_dim
    scale = d**-0.5
    sync = jax.block_until_ready
    report = {"device": jax.devices()[0].device_kind, "heads": args.heads, "head_dim": d, "rows": []}
    print(f"{report['device']}; heads {hq}/{hkv}, head_dim {d}, causal, batch 1", flush=True)

    def mgpu(config, dtype):
        from jax.experimental.pallas.ops.gpu import attention_mgpu as am

        bq, bkv, steps = map(int, config.split(","))
        tuning = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=steps, causal=True)

        def core(q, k, v):  # inputs already in `dtype`, q already scaled
            return am.attention(q, k, v, tuning)

        def with_casts(q, k, v):
            out = am.attention((q * scale).astype(dtype), k.astype(dtype), v.astype(dtype), tuning)
            return out.astype(q.dtype)

        return jax.jit(core), jax.jit(with_casts)

    rng = np.random.default_rng(0)
    for t in args.tokens:
        print(f"tokens {t}:", flush=True)
        # Activations of the model's scale: q, k RMS-normed (unit RMS), v of RMS ~1.
        q64 = rng.standard_normal((t, hq, d))
        k64 = rng.standard_normal((t, hkv, d))
        v64 = rng.standard_normal((t, hkv, d))
        q, k, v = (jnp.asarray(a[None], jnp.bfloat16) for a in (q64, k64, v64))
        # The reference sees the bf16-rounded inputs every implementation sees.
        qr, kr, vr = (np.asarray(a[0].astype(jnp.float32), np.float64) for a in (q, k, v))
        rows = sorted(set(range(min(64, t))) | set(range(max(0, t - args.ref_rows), t)))
        ref = reference_rows(qr, kr, vr, rows, scale)

        impls = {"cuDNN (the model's)": (jax.jit(lambda q, k, v: kernels.causal_attention(q, k, v, scale=scale)),
                                         (q, k, v))}
        for config in args.configs:
            for dtype in (jnp.float16, jnp.bfloat16):
                core, cast = mgpu(config, dtype)
                name = f"mgpu {config} {jnp.dtype(dtype).name}"
                impls[f"{name} core"] = (core, ((q * scale).astype(dtype), k.astype(dtype), v.astype(dtype)))
                impls[f"{name} with casts"] = (cast, (q, k, v))
        cudnn_out = None
        for name, (fn, inputs) in impls.items():
            row = {"tokens": t, "impl": name}
            try:
                out = np.asarray(fn(*inputs).astype(jnp.float32))
            except Exception as e:  # say why, go on
                msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__
                print(f"  {name:<34} failed: {msg}", flush=True)
                report["rows"].append({**row, "error": msg})
                continue
            if not np.isfinite(out).all():
                print(f"  {name:<34} non-finite output", flush=True)
            err = float(np.max(np.abs(out[0, rows] - ref)))
            row["max_abs_err_vs_fp64"] = err
            if cudnn_out is None:
                cudnn_out = out
            else:
                row["max_abs_diff_vs_cudnn"] = float(np.max(np.abs(out - cudnn_out)))
            ms = wall_ms(lambda: fn(*inputs), sync)
            flops = 4 * t * t * hq * d / 2
            row.update(ms=ms, tflops=flops / ms / 1e9)
            if args.trace:
                row.update(_traced(lambda: fn(*inputs), sync))
                print(f"  {'':<34} traced: {row['kernel_ms']:.3f} ms of kernels a call over a span of "
                      f"{row['span_ms']:.3f} ms ({'device' if row['device_events'] else 'HOST'} events)", flush=True)
            report["rows"].append(row)
            extra = f", vs cuDNN {row['max_abs_diff_vs_cudnn']:.2e}" if "max_abs_diff_vs_cudnn" in row else ""
            print(f"  {name:<34} {ms:8.3f} ms  {row['tflops']:6.1f} TF/s   max |err| vs fp64 {err:.2e}{extra}",
                  flush=True)
        base = next((r for r in report["rows"] if r["tokens"] == t and r["impl"].startswith("cuDNN") and "ms" in r),
                    None)
        if base:
            for r in report["rows"]:
                if r["tokens"] == t and "ms" in r and r is not base:
                    print(f"  cuDNN / {r['impl']:<27} {base['ms'] / r['ms']:.3f}x", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

"""Device layouts side by side: pipeline P x DWDP N (FFI or XLA backend) on the same sequences.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_layouts.py --num-layers 16 --seq-len 16384 \
        --sequences 8 --layouts 2x2:ffi 2x1 1x4:ffi 1x4:xla

Each layout prefills the same `--sequences` sequences of `--seq-len` tokens (layer-wise programs; microbatches of
N sequences, so every DWDP rank gets one sequence per microbatch). Reports ms per prefill, tokens/s and tokens/s
per GPU: for issue 7, pipeline 2 x DWDP 2 against pipeline 2 alone and DWDP 4 alone.
"""

from __future__ import annotations

import argparse
import gc

import jax
import jax.numpy as jnp
import numpy as np

from jax_dwdp.config import ModelConfig
from jax_dwdp.parallel import Pipeline
from jax_dwdp.timing import median_seconds, save_rows


def parse(layout: str):
    shape, _, backend = layout.partition(":")
    p, n = (int(v) for v in shape.split("x"))
    return p, n, backend or "xla"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="35b-a3b")
    ap.add_argument("--num-layers", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--layouts", nargs="+", default=["2x2:ffi", "2x1", "1x4:ffi", "1x4:xla"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = ModelConfig.preset(args.preset).replace(num_hidden_layers=args.num_layers)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (args.sequences, args.seq_len)).astype(np.int32)
    rows = []
    for layout in args.layouts:
        p, n, backend = parse(layout)
        if p * n > jax.device_count():
            rows.append({"layout": layout, "skipped": f"needs {p * n} devices, {jax.device_count()} present"})
            continue
        with Pipeline.random(cfg, p, dwdp=n, dtype=jnp.bfloat16, seed=1,
                             experts=backend if n > 1 else "local") as pipe:
            micro = args.sequences // n

            def run():
                return pipe.prefill(tokens, microbatches=micro, logits="last", layerwise=True)
            jax.block_until_ready(run())
            seconds, _ = median_seconds(run, args.iters)
        gpus = p * n
        tok_s = tokens.size / seconds
        rows.append({"layout": layout, "pipeline": p, "dwdp": n, "backend": backend, "gpus": gpus,
                     "microbatches": micro, "ms": round(seconds * 1e3, 2), "tokens_per_s": round(tok_s),
                     "tokens_per_s_per_gpu": round(tok_s / gpus)})
        print(rows[-1], flush=True)
        pipe = None
        gc.collect()
    print(f"\n{args.preset}, {args.num_layers} layers, {args.sequences} x {args.seq_len} tokens, "
          f"{jax.devices()[0].device_kind}")
    print("| layout (P x N:backend) | GPUs | microbatches | ms | tokens/s | tokens/s per GPU |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['layout']} | skipped: {r['skipped']} |")
        else:
            print(f"| {r['layout']} | {r['gpus']} | {r['microbatches']} | {r['ms']} | {r['tokens_per_s']} | "
                  f"{r['tokens_per_s_per_gpu']} |")
    save_rows(args.out, rows, args)


if __name__ == "__main__":
    main()

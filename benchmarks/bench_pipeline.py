"""Pipeline stages vs one device: the speedup, and each stage's idle fraction (the bubble), measured.

    python benchmarks/bench_pipeline.py --preset 35b-a3b --num-layers 8 --seq-len 4096 --microbatches 1 2 4 8

One device vs `--pipeline` stages (layer-wise compiled stage programs; with --scan, both sides scanned: one program
per stage, `Pipeline(..., scan=True)`), one sequence of --seq-len tokens per
microbatch, M microbatches; the one-device baseline runs the same microbatches one after another (timed for every M
first, then freed, so that the device of stage 0 never holds both models). The pipeline is
timed with each stage enqueued from its own host thread (the default) and from one thread (`one_thread_*`). Each stage is
timed alone on one microbatch (t_s); the pipeline's wall time W for M microbatches gives stage s an idle fraction
1 - M t_s / W, printed beside the GPipe bubble (P-1)/(M+P-1). JSON with --out: {"what": "pipeline", "args",
"device", "rows"}. Pipeline x DWDP layouts: `bench_dwdp.py layouts`.

--same-device puts every stage on the first device: a rehearsal of a multi-GPU run on one GPU (the stage threads,
the stage programs and the cache merge run on it; the hand-off between stages is a no-op). Its "speedup" is then
the pipeline driver's cost against the one-device run of the same microbatches (ideal 1.0), not a pipeline gain;
its idle fractions mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json

import jax
import jax.numpy as jnp
import numpy as np

from jax_dwdp.config import ModelConfig
from jax_dwdp.parallel import Pipeline
from jax_dwdp.timing import median_seconds, save_rows


def timed(fn, iters: int) -> float:
    jax.block_until_ready(fn())  # compile + warm-up
    return median_seconds(fn, iters)[0]


def bench_pipeline(cfg, args) -> list[dict]:
    rows = []
    dtype = jnp.dtype(args.dtype)
    tokens_all = np.random.default_rng(0).integers(0, cfg.vocab_size, (max(args.microbatches), args.seq_len))
    tokens_all = tokens_all.astype(np.int32)
    layerwise = not args.scan
    # The one-device model first, for every M, then freed before the stages are built: the device holding stage 0
    # never holds both (40 layers of 35b-a3b are ~66 GB: with both, the bar's run would need an H200's memory).
    one = Pipeline.random(cfg, 1, dtype=dtype, seed=0, scan=args.scan)
    t_ones = {m: timed(lambda m=m: one.prefill(tokens_all[:m], microbatches=m, logits="last", layerwise=layerwise),
                       args.iters) for m in args.microbatches}
    del one
    gc.collect()
    devices = [jax.devices()[0]] * args.pipeline if args.same_device else None
    pipe = Pipeline.random(cfg, args.pipeline, dtype=dtype, seed=0, scan=args.scan, devices=devices)
    for m in args.microbatches:
        tokens = tokens_all[:m]
        t_one = t_ones[m]
        t_pipe = timed(lambda: pipe.prefill(tokens, microbatches=m, logits="last", layerwise=layerwise), args.iters)
        t_turn = timed(lambda: pipe.prefill(tokens, microbatches=m, logits="last", layerwise=layerwise,
                                            stage_threads=False), args.iters)
        stage_t = []
        x = jnp.asarray(tokens[:1])
        lens = jnp.full((1,), args.seq_len, jnp.int32)
        for s, runner in enumerate(pipe.runners):
            x = jax.device_put(x, pipe.input_shardings[s])
            ln = jax.device_put(lens, pipe.input_shardings[s])
            stage_t.append(timed(lambda runner=runner, x=x, ln=ln: runner(x, ln, logits="last"), args.iters))
            x, _ = runner(x, ln, logits="last")
        idle = [round(1 - m * t / t_pipe, 3) for t in stage_t]
        row = dict(scan=args.scan, same_device=args.same_device, microbatches=m, tokens=m * args.seq_len,
                   one_device_ms=round(t_one * 1e3, 2), pipeline_ms=round(t_pipe * 1e3, 2),
                   speedup=round(t_one / t_pipe, 3),
                   one_thread_pipeline_ms=round(t_turn * 1e3, 2), one_thread_speedup=round(t_one / t_turn, 3),
                   stage_ms=[round(t * 1e3, 2) for t in stage_t], idle_fraction=idle,
                   gpipe_ideal_bubble=round((args.pipeline - 1) / (m + args.pipeline - 1), 3),
                   tokens_per_s_one=round(m * args.seq_len / t_one),
                   tokens_per_s_pipeline=round(m * args.seq_len / t_pipe))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="35b-a3b")
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--pipeline", type=int, default=2)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--scan", action="store_true", help="every stage (and the one device) as one scanned program")
    ap.add_argument("--same-device", action="store_true",
                    help="every stage on the first device: the multi-GPU code on one GPU (speedup = driver cost)")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out", help="JSON results path")
    args = ap.parse_args(argv)
    cfg = ModelConfig.preset(args.preset).replace(num_hidden_layers=args.num_layers)
    print(f"{cfg.summary()} on {jax.devices()[0].device_kind} x {len(jax.devices())}", flush=True)
    rows = bench_pipeline(cfg, args)
    save_rows(args.out, rows, args, what="pipeline")
    return rows


if __name__ == "__main__":
    main()

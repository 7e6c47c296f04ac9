"""Pipeline and DWDP (XLA path) on several devices, measured side by side in one process.

    python benchmarks/bench_parallel.py pipeline --preset 35b-a3b --num-layers 8 --seq-len 4096 --microbatches 1 2 4 8
    python benchmarks/bench_parallel.py dwdp --preset 35b-a3b --num-layers 2 --seq-len 16384

pipeline: one device vs `--pipeline` stages (layer-wise compiled stage programs), one sequence of --seq-len
tokens per microbatch, M microbatches. The bubble is measured: each stage is timed alone on one microbatch (t_s),
the pipeline's wall time W for M microbatches gives stage s an idle fraction 1 - M t_s / W.

dwdp: per-rank sequences of --seq-len tokens on N = 2 devices: (b) DWDP over XLA (all-gather of each layer's
experts inside one shard_map program), (i) independent DWDP ranks (device-to-device copies of peer expert blocks,
layer-wise programs), and (c) replicated weights on one device (the no-communication bound).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.parallel import Pipeline
from jax_dwdp.parallel.dwdp import IndependentRanks
from jax_dwdp.timing import median_seconds, save_rows


def timed(fn, iters: int) -> float:
    jax.block_until_ready(fn())  # compile + warm-up
    return median_seconds(fn, iters)[0]


def bench_pipeline(cfg, args) -> list[dict]:
    rows = []
    tokens_all = np.random.default_rng(0).integers(0, cfg.vocab_size, (max(args.microbatches), args.seq_len))
    tokens_all = tokens_all.astype(np.int32)
    one = Pipeline.random(cfg, 1, dtype=jnp.bfloat16, seed=0)
    pipe = Pipeline.random(cfg, args.pipeline, dtype=jnp.bfloat16, seed=0)
    for m in args.microbatches:
        tokens = tokens_all[:m]
        t_one = timed(lambda: one.prefill(tokens, microbatches=m, logits="last", layerwise=True), args.iters)
        t_pipe = timed(lambda: pipe.prefill(tokens, microbatches=m, logits="last", layerwise=True), args.iters)
        stage_t = []
        x = jnp.asarray(tokens[:1])
        lens = jnp.full((1,), args.seq_len, jnp.int32)
        for s, runner in enumerate(pipe.runners):
            x = jax.device_put(x, pipe.input_shardings[s])
            ln = jax.device_put(lens, pipe.input_shardings[s])
            stage_t.append(timed(lambda runner=runner, x=x, ln=ln: runner(x, ln, logits="last"), args.iters))
            x, _ = runner(x, ln, logits="last")
        idle = [round(1 - m * t / t_pipe, 3) for t in stage_t]
        row = dict(microbatches=m, tokens=m * args.seq_len, one_device_ms=round(t_one * 1e3, 2),
                   pipeline_ms=round(t_pipe * 1e3, 2), speedup=round(t_one / t_pipe, 3),
                   stage_ms=[round(t * 1e3, 2) for t in stage_t], idle_fraction=idle,
                   gpipe_ideal_bubble=round((args.pipeline - 1) / (m + args.pipeline - 1), 3),
                   tokens_per_s_one=round(m * args.seq_len / t_one), tokens_per_s_pipeline=round(m * args.seq_len / t_pipe))
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def bench_dwdp(cfg, args) -> list[dict]:
    n = args.dwdp
    devices = jax.devices()[:n]
    model = init_model(cfg, dtype=jnp.bfloat16, seed=0, device=devices[0])
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (n, args.seq_len)).astype(np.int32)
    lens = np.full((n,), args.seq_len, np.int32)
    replicated = Pipeline.from_model(model, 1, devices=devices[:1])
    t_rep = timed(lambda: replicated.prefill(tokens[:1], lens[:1], logits="last"), args.iters)
    row = dict(tokens_per_rank=args.seq_len, layers=cfg.num_hidden_layers, replicated_ms=round(t_rep * 1e3, 2))
    print(json.dumps(row), flush=True)
    ranks = IndependentRanks(model, devices)
    t_one = timed(lambda: ranks.prefill(0, tokens[:1], lens[:1], logits="last"), args.iters)
    row.update(independent_one_rank_ms=round(t_one * 1e3, 2))
    t_ind = timed(lambda: [ranks.prefill(r, tokens[r:r + 1], lens[r:r + 1], logits="last") for r in range(n)],
                  args.iters)
    # ~1.0 when the ranks run concurrently, ~N when they run one after the other.
    row.update(independent_ms=round(t_ind * 1e3, 2), independent_vs_one_rank=round(t_ind / t_one, 3))
    # Host time to enqueue one rank's whole prefill (the call returns before the GPU is done).
    dispatch = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        out = ranks.prefill(0, tokens[:1], lens[:1], logits="last")
        dispatch.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    work = {r: (tokens[r:r + 1], lens[r:r + 1]) for r in range(n)}
    t_thr = timed(lambda: ranks.prefill_all(work, logits="last"), args.iters)
    row.update(dispatch_one_rank_ms=round(float(np.median(dispatch)) * 1e3, 2),
               independent_threads_ms=round(t_thr * 1e3, 2), independent_threads_vs_one_rank=round(t_thr / t_one, 3))
    print(json.dumps(row), flush=True)
    if args.ffi:  # the same independent ranks with peer experts read through the CUDA VMM store
        with IndependentRanks(model, devices, experts="ffi") as ffi_ranks:
            t_ffi = timed(lambda: [ffi_ranks.prefill(r, tokens[r:r + 1], lens[r:r + 1], logits="last")
                                   for r in range(n)], args.iters)
            t_ffi_thr = timed(lambda: ffi_ranks.prefill_all(work, logits="last"), args.iters)
        row.update(independent_ffi_ms=round(t_ffi * 1e3, 2), independent_ffi_vs_replicated=round(t_ffi / t_rep, 3),
                   independent_ffi_threads_ms=round(t_ffi_thr * 1e3, 2),
                   independent_ffi_threads_vs_replicated=round(t_ffi_thr / t_rep, 3))
        print(json.dumps(row), flush=True)
    if args.skip_xla_dwdp:
        return [row]
    dw = Pipeline.from_model(model, 1, dwdp=n, devices=devices)
    t_xla = timed(lambda: dw.prefill(tokens, lens, logits="last"), args.iters)
    row.update(xla_dwdp_ms=round(t_xla * 1e3, 2), xla_vs_replicated=round(t_xla / t_rep, 3),
               independent_vs_replicated=round(t_ind / t_rep, 3))
    print(json.dumps(row), flush=True)
    return [row]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["pipeline", "dwdp"])
    ap.add_argument("--preset", default="35b-a3b")
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--pipeline", type=int, default=2)
    ap.add_argument("--dwdp", type=int, default=2)
    ap.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--ffi", action="store_true", help="dwdp: also time independent ranks on the FFI store")
    ap.add_argument("--skip-xla-dwdp", action="store_true", help="dwdp: skip the whole-model XLA DWDP program")
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = ModelConfig.preset(args.preset).replace(num_hidden_layers=args.num_layers)
    print(f"{cfg.summary()} on {jax.devices()[0].device_kind} x {len(jax.devices())}", flush=True)
    rows = bench_pipeline(cfg, args) if args.what == "pipeline" else bench_dwdp(cfg, args)
    save_rows(args.out, rows, args, what=args.what)


if __name__ == "__main__":
    main()

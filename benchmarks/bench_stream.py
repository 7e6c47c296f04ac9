"""Request streams: DWDP against DEP and replicated weights, on balanced and uneven prompt lengths (issue 16).

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_stream.py --preset 35b-a3b --num-layers 8 \
        --requests 8 --out stream.json

Each of N ranks (GPUs) has a queue of `--requests` prompts, all there at t = 0 (a saturated server); prompt lengths
come from a fixed seed: `balanced` (all --mean tokens, 16K) and `uneven` (normal around --mean with --std 4096,
clipped to [--min, --max] = [2K, 32K]). Three ways to serve them:
- dwdp: independent DWDP ranks (`IndependentRanks`, experts through the CUDA VMM store on GPUs, device-to-device
  copies elsewhere): each rank takes its next request as soon as it finishes one, never waiting for another rank.
- dep: DEP (`Pipeline(..., experts="dep")`): the ranks run in lockstep, one request per rank per step, the step's
  prompts padded to the longest; every MoE exchanges tokens between all ranks.
- replicated: independent ranks that each hold every expert (`IndependentRanks(..., experts="local")`): nothing
  moves; the bound DWDP is measured against.
Prompts are padded to a multiple of --bucket tokens (one compiled program set per padded length; the real lengths
are passed along, and only real tokens count). Each rank enqueues its next request before it waits for the one
running, so the device never idles while the host dispatches; a request's finish time is when the host sees it done.

Reported per scheme and stream: tokens/s per GPU (real tokens / makespan / N), time to first token (= the
request's prefill finish time, all requests queued at 0: mean, p50, p90), the fraction of computed tokens that are
padding, for DEP the per-layer wait at the MoE exchange (`StageRunner.profile` on the first --profile-steps steps:
how long a rank waits for the slowest rank there), for DWDP over the store its per-layer copy time and the fraction
hidden (1 - max(0, dwdp makespan - replicated makespan) / copy time per rank), and each rank's peak device memory
(XLA's peak plus the store's VMM bytes) next to `jax-dwdp plan`'s estimate (resident weights plus expert buffers;
the difference is activations). Each scheme runs in its own process (peak memory is per process) unless
--in-process. Writes {"args", "device", "rows", "summary"} to --out. `--merge A.json B.json ...` joins the rows of
runs made separately (one scheme per run, to stay inside a time limit per command) and summarizes them.

Compilation dominates a short run: every padded length is one set of layer programs per scheme (about 25 s at
35B-A3B shapes on an H200); the persistent compilation cache (--compile-cache) lets the second rank load the first
rank's programs (XLA strips the device from the GPU cache key). Fewer --requests or a larger --bucket mean fewer
lengths. CPU (smoke test): XLA_FLAGS=--xla_force_host_platform_device_count=N (N >= the ranks) and a tiny preset; numbers
mean nothing there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_dwdp.config import ModelConfig

SCHEMES = ("dwdp", "dep", "replicated")
STREAMS = ("balanced", "uneven")


# ---- the streams -------------------------------------------------------------------------------------------------

def stream_lengths(kind: str, ranks: int, requests: int, *, mean: int, std: int, lo: int, hi: int,
                   seed: int) -> list[list[int]]:
    """Prompt lengths per rank: `requests` each, from a seed fixed per (stream, rank)."""
    if kind == "balanced":
        return [[mean] * requests for _ in range(ranks)]
    if kind != "uneven":
        raise ValueError(f"stream {kind!r}: choose one of {', '.join(STREAMS)}")
    out = []
    for r in range(ranks):
        rng = np.random.default_rng([seed, r])
        out.append([int(x) for x in np.clip(np.rint(rng.normal(mean, std, requests)), lo, hi)])
    return out


def padded(length: int, bucket: int) -> int:
    return -(-length // bucket) * bucket


def prompt(cfg: ModelConfig, length: int, width: int, seed) -> np.ndarray:
    """[1, width] random tokens, the first `length` real."""
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :length] = np.random.default_rng(seed).integers(0, cfg.vocab_size, length)
    return tokens


# ---- serving -----------------------------------------------------------------------------------------------------

def serve_independent(ranks, cfg, queues, bucket, stream_seed) -> tuple[list, float]:
    """Each rank works through its queue alone; returns ([(rank, index, length, padded, finish s)], makespan)."""
    def rank_loop(r, t0):
        done, running = [], None
        for i, n in enumerate(queues[r]):
            width = padded(n, bucket)
            out = ranks.prefill(r, prompt(cfg, n, width, [*stream_seed, r, i]), np.array([n], np.int32),
                                logits="last")
            if running is not None:  # the next request is enqueued: now wait for the one running
                jax.block_until_ready(running[1])
                done.append((*running[0], time.perf_counter() - t0))
            running = ((r, i, n, width), out)
        jax.block_until_ready(running[1])
        done.append((*running[0], time.perf_counter() - t0))
        return done

    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(queues), thread_name_prefix="stream-rank") as pool:
        results = list(pool.map(lambda r: rank_loop(r, t0), range(len(queues))))
    done = [row for rows in results for row in rows]
    return done, max(row[-1] for row in done)


def lockstep_steps(cfg, queues, bucket, stream_seed):
    """DEP's steps: step s = request s of every rank, padded to the longest: [(tokens [N, W], lengths [N])]."""
    steps = []
    for s in range(len(queues[0])):
        lengths = np.array([q[s] for q in queues], np.int32)
        width = padded(int(lengths.max()), bucket)
        tokens = np.concatenate([prompt(cfg, int(n), width, [*stream_seed, r, s]) for r, n in enumerate(lengths)])
        steps.append((tokens, lengths))
    return steps


def serve_lockstep(pipe, steps) -> tuple[list, float]:
    done, running = [], None
    t0 = time.perf_counter()
    for s, (tokens, lengths) in enumerate(steps):
        out = pipe.prefill(tokens, lengths, logits="last", layerwise=True)
        if running is not None:
            jax.block_until_ready(running[1])
            done.append((running[0], time.perf_counter() - t0))
        running = (s, out)
    jax.block_until_ready(running[1])
    done.append((running[0], time.perf_counter() - t0))
    rows = [(r, s, int(steps[s][1][r]), steps[s][0].shape[1], t) for s, t in done for r in range(len(steps[s][1]))]
    return rows, max(t for _, t in done)


# ---- one scheme --------------------------------------------------------------------------------------------------

def dwdp_experts(choice: str, devices) -> str:
    if choice != "auto":
        return choice
    if devices[0].platform != "gpu":
        return "xla"
    from jax_dwdp.parallel.dwdp_ffi import FfiUnavailable, load_library

    try:
        load_library()
        return "ffi"
    except FfiUnavailable as e:
        print(f"DWDP over XLA copies: the FFI store is unavailable ({e})", flush=True)
        return "xla"


def run_scheme(args, scheme: str) -> list[dict]:
    from jax_dwdp.parallel import Pipeline
    from jax_dwdp.parallel.dwdp import IndependentRanks

    cfg = config(args)
    dtype = jnp.dtype(args.dtype)
    devices = jax.devices()[:args.ranks]
    if len(devices) < args.ranks:
        raise SystemExit(f"error: {args.ranks} ranks need {args.ranks} devices, found {len(jax.devices())}")
    t0 = time.perf_counter()
    backend = None
    if scheme == "dep":
        driver = Pipeline.random(cfg, 1, dwdp=args.ranks, dtype=dtype, seed=args.seed, devices=devices,
                                 experts="dep")
    else:
        backend = dwdp_experts(args.dwdp_experts, devices) if scheme == "dwdp" else "local"
        driver = IndependentRanks.random(cfg, devices, experts=backend, dtype=dtype, seed=args.seed,
                                         store_options={"timing": True} if backend == "ffi" else None)
    build_s = time.perf_counter() - t0
    rows = []
    with driver:
        for stream in args.streams:
            queues = stream_lengths(stream, args.ranks, args.requests, mean=args.mean, std=args.std, lo=args.min,
                                    hi=args.max, seed=args.seed)
            stream_seed = [args.seed, STREAMS.index(stream)]
            t0 = time.perf_counter()
            if scheme == "dep":
                steps = lockstep_steps(cfg, queues, args.bucket, stream_seed)
                for width in sorted({t.shape[1] for t, _ in steps}):  # compile each padded length once
                    jax.block_until_ready(driver.prefill(np.zeros((args.ranks, width), np.int32),
                                                         np.full((args.ranks,), width, np.int32), logits="last",
                                                         layerwise=True))
                warm_s = time.perf_counter() - t0
                done, makespan = serve_lockstep(driver, steps)
            else:
                for r in range(args.ranks):
                    for width in sorted({padded(n, args.bucket) for n in queues[r]}):
                        jax.block_until_ready(driver.prefill(r, np.zeros((1, width), np.int32), logits="last"))
                warm_s = time.perf_counter() - t0
                done, makespan = serve_independent(driver, cfg, queues, args.bucket, stream_seed)
            row = metrics(scheme, stream, done, makespan, args.ranks)
            row.update(experts=backend or "dep", build_s=round(build_s, 1), compile_s=round(warm_s, 1))
            if scheme == "dep":
                row.update(dep_wait(driver, steps[:args.profile_steps]))
            if backend == "ffi":
                copy = driver.store.copy_ms()  # [ranks, layers], each layer's last copy
                row.update(copy_ms_per_layer=round(float(np.nanmean(copy)), 3),
                           copy_ms_per_rank=round(float(np.nanmean(copy)) * cfg.num_hidden_layers * args.requests, 1))
            rows.append(row)
            print(json.dumps(row), flush=True)
    memory = memory_rows(args, cfg, scheme, backend, devices)
    for row in rows:
        row.update(memory)
    return rows


def metrics(scheme, stream, done, makespan, ranks) -> dict:
    finish = np.array([row[-1] for row in done])
    real = sum(row[2] for row in done)
    computed = sum(row[3] for row in done)
    return dict(scheme=scheme, stream=stream, requests=len(done), real_tokens=real,
                padding_fraction=round(1 - real / computed, 4), makespan_s=round(makespan, 4),
                tokens_per_s_per_gpu=round(real / makespan / ranks, 1),
                ttft_mean_s=round(float(finish.mean()), 4), ttft_p50_s=round(float(np.percentile(finish, 50)), 4),
                ttft_p90_s=round(float(np.percentile(finish, 90)), 4),
                prompt_lengths=[row[2] for row in sorted(done, key=lambda row: (row[0], row[1]))])


def dep_wait(pipe, steps) -> dict:
    """Per-layer wait at DEP's exchange (StageRunner.profile) on the given steps: mean and max over ranks, layers
    and steps, and the split layer's parts. Each step is profiled twice and the second kept (the first compiles
    the split programs)."""
    profiles = [[pipe.runners[0].profile(tokens, lengths) for _ in range(2)][1] for tokens, lengths in steps]
    wait = np.concatenate([np.asarray(p["wait_ms"]) for p in profiles])
    mixer = np.concatenate([np.asarray(p["mixer_ms"]) for p in profiles])
    moe = np.concatenate([p["moe_ms"] for p in profiles])
    return dict(dep_wait_ms_per_layer=round(float(wait.mean()), 3),
                dep_wait_ms_per_layer_max=round(float(wait.max()), 3),
                dep_mixer_ms_per_layer=round(float(mixer.mean()), 3), dep_moe_ms_per_layer=round(float(moe.mean()), 3),
                dep_profiled_steps=len(profiles))


def memory_rows(args, cfg, scheme, backend, devices) -> dict:
    """Each rank's peak device memory (XLA's peak since this process started, plus an FFI store's bytes, which XLA
    does not see) and plan's estimate of what it must hold besides activations."""
    from jax_dwdp.plan import plan_layout

    ranks = plan_layout(cfg, 1, args.ranks, jnp.dtype(args.dtype), dep=scheme == "dep")[0]
    if scheme == "replicated":
        plan = [ranks["weight_bytes"]] * args.ranks
    else:
        plan = [r["resident_bytes"] + r["prefetch_buffer_bytes"] for r in ranks["dwdp_ranks"]]
    store = [r["resident_expert_bytes"] if backend == "ffi" else 0 for r in ranks["dwdp_ranks"]]
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    total = [None if p is None else p + s for p, s in zip(peaks, store)]
    return dict(peak_device_bytes=total, xla_peak_bytes=peaks, store_bytes=store, plan_weights_and_buffers_bytes=plan)


# ---- the whole comparison ----------------------------------------------------------------------------------------

def config(args) -> ModelConfig:
    cfg = ModelConfig.preset(args.preset)
    return cfg.replace(num_hidden_layers=args.num_layers) if args.num_layers else cfg


def child(args, scheme: str) -> list[dict]:
    """`scheme` in a process of its own, so that its peak memory is its own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        argv = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--only", scheme, "--out", str(out)]
        proc = subprocess.run(argv, env=dict(os.environ), timeout=args.scheme_timeout)
        if proc.returncode != 0:
            print(f"{scheme}: exit status {proc.returncode}", flush=True)
            return [dict(scheme=scheme, error=f"exit status {proc.returncode}")]
        return json.loads(out.read_text())["rows"]


def summarize(rows: list[dict]) -> list[dict]:
    """Per stream: DWDP / DEP and DWDP / replicated tokens/s per GPU, and the DWDP copy time hidden."""
    by = {(r["scheme"], r.get("stream")): r for r in rows if "error" not in r}
    out = []
    for stream in STREAMS:
        dwdp, dep, rep = (by.get((s, stream)) for s in SCHEMES)
        if dwdp is None:
            continue
        row = dict(stream=stream)
        if dep is not None:
            row["dwdp_vs_dep"] = round(dwdp["tokens_per_s_per_gpu"] / dep["tokens_per_s_per_gpu"], 3)
        if rep is not None:
            row["dwdp_vs_replicated"] = round(dwdp["tokens_per_s_per_gpu"] / rep["tokens_per_s_per_gpu"], 3)
            if dwdp.get("copy_ms_per_rank"):
                exposed = max(0.0, dwdp["makespan_s"] - rep["makespan_s"]) * 1e3
                row["dwdp_copy_hidden_fraction"] = round(1 - min(1.0, exposed / dwdp["copy_ms_per_rank"]), 3)
        out.append(row)
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="35b-a3b")
    ap.add_argument("--num-layers", type=int, default=8, help="first N layers of the preset (default 8)")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8, help="requests per rank and stream (default 8)")
    ap.add_argument("--streams", nargs="+", default=list(STREAMS), choices=STREAMS)
    ap.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    ap.add_argument("--mean", type=int, default=16384, help="prompt length of the balanced stream, mean of the uneven")
    ap.add_argument("--std", type=int, default=4096)
    ap.add_argument("--min", type=int, default=2048)
    ap.add_argument("--max", type=int, default=32768)
    ap.add_argument("--bucket", type=int, default=4096, help="prompts padded to a multiple of this (compiled shapes)")
    ap.add_argument("--profile-steps", type=int, default=1, help="DEP steps profiled per stream for the wait")
    ap.add_argument("--dwdp-experts", default="auto", choices=("auto", "ffi", "xla"),
                    help="DWDP's experts: the VMM store (ffi, GPUs), device-to-device copies (xla); auto: ffi on GPUs")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--in-process", action="store_true", help="all schemes in this process (peaks then shared)")
    ap.add_argument("--compile-cache", default="/tmp/jax_dwdp_compile_cache",
                    help="persistent compilation cache folder ('' for none)")
    ap.add_argument("--merge", nargs="+", metavar="JSON", help="join the rows of these runs' --out files")
    ap.add_argument("--scheme-timeout", type=int, default=600, help="seconds per scheme's process")
    ap.add_argument("--only", choices=SCHEMES, help=argparse.SUPPRESS)  # a child process: this scheme
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    raw, own = list(sys.argv[1:] if argv is None else argv), ("--out", "--only")
    args.argv = [a for i, a in enumerate(raw) if a not in own and (i == 0 or raw[i - 1] not in own)]  # for children
    return args


def main(argv=None) -> dict:
    args = parse(argv)
    device = jax.devices()[0].device_kind
    if args.merge:
        runs = [json.loads(Path(f).read_text()) for f in args.merge]
        rows, device = [row for run in runs for row in run["rows"]], runs[0]["device"]
        args.preset, args.num_layers, args.ranks, args.requests, args.bucket = (
            runs[0]["args"][k] for k in ("preset", "num_layers", "ranks", "requests", "bucket"))
    elif args.only:
        if args.compile_cache:
            jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        rows = run_scheme(args, args.only)
    else:
        rows = []
        for scheme in args.schemes:
            rows += run_scheme(args, scheme) if args.in_process else child(args, scheme)
    summary = summarize(rows)
    result = dict(args={k: v for k, v in vars(args).items() if k != "argv"}, device=device, rows=rows,
                  summary=summary)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if not args.only:
        report(args, rows, summary, device)
    return result


def report(args, rows, summary, device) -> None:
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f}"  # noqa: E731
    print(f"\n{args.preset}, {args.num_layers} layers, {args.ranks} x {device}, {args.requests} requests per rank, "
          f"bucket {args.bucket}")
    print("| stream | scheme | tokens/s/GPU | TTFT mean s | p50 | p90 | padding | DEP wait ms/layer | copy ms/layer "
          "| peak GiB per rank | plan weights+buffers GiB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| | {r['scheme']} | {r['error']} |")
            continue
        print(f"| {r['stream']} | {r['scheme']} ({r['experts']}) | {r['tokens_per_s_per_gpu']} | {r['ttft_mean_s']} | "
              f"{r['ttft_p50_s']} | {r['ttft_p90_s']} | {r['padding_fraction']} | "
              f"{r.get('dep_wait_ms_per_layer', '')} | "
              f"{r.get('copy_ms_per_layer', '')} | {', '.join(gib(b) for b in r['peak_device_bytes'])} | "
              f"{', '.join(gib(b) for b in r['plan_weights_and_buffers_bytes'])} |")
    for s in summary:
        print(json.dumps(s))


if __name__ == "__main__":
    main()

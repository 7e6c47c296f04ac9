"""DWDP measurements: what moving the experts to the tokens costs, one subcommand per question.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_dwdp.py stage --num-layers 16 --seq-lens 16384 32768
    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_dwdp.py ranks --num-layers 8 --seq-len 16384 --ffi
    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_dwdp.py dispatch --num-layers 8 --seq-len 16384
    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_dwdp.py layouts --num-layers 16 --seq-len 16384 \
        --sequences 8 --layouts 2x2:ffi 2x1 1x4:ffi 1x4:xla

stage: one stage's N ranks in one SPMD program, every rank prefilling its own sequence of T tokens (batch 1 per
  rank): (a) `Store` experts (FFI): each rank stores 1/N of every layer's experts in CUDA VMM memory, layer l+1's
  copied from the peers over NVLink on a side stream while layer l computes; (b) `Gather` experts (XLA): layer
  l+1's experts all-gathered inside layer l's program; (c) replicated, `Local` experts: every GPU holds all of them
  (no communication: the bound). All three are one StageRunner over the 'dwdp' mesh, layer-wise. Per layer it
  reports the FFI copy time (CUDA events on the copy stream) under compute and on an idle GPU, the MoE block alone
  on the same tokens, and the fraction of copy time hidden: 1 - max(0, t_ffi - t_replicated) / total copy time.
ranks: independent ranks (each its own programs on its own device): one rank alone, all ranks dispatched in turn
  from one thread and from one thread each (`prefill_all`; ~1.0x one rank when they run concurrently), the host
  time to enqueue one rank's prefill; --ffi: the same ranks on the FFI store; then one whole-model SPMD program
  over XLA (all-gathered experts) and the replicated bound on one device.
dispatch: host time of one independent rank's layer-wise prefill, split by call (jitted programs, device_put, eager
  jnp ops, the expert source's prefetch), each call wrapped in a host timer with no device sync inside. A call that
  blocks on the device shows as large host time on few calls. The module functions it wraps are put back at the
  end. One rank at a time: the timers are not thread-safe.
layouts: pipeline P x DWDP N side by side (issue 7) on the same sequences, microbatches of N sequences (one per
  rank): ms per prefill, tokens/s and tokens/s per GPU.

Without a subcommand the arguments go to `stage` (the command lines recorded in RESULTS.md before the merge). Each
subcommand writes JSON with --out: {"what", "args", "device", "rows"}; dispatch writes {"args", "device",
"dispatch_ms", "wall_ms", "calls"}. On a GPU, XLA_PYTHON_CLIENT_PREALLOCATE=false: the store allocates outside
XLA's pool. On a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N, without the FFI variants.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_dwdp.prefill as prefill_module
from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.parallel import Pipeline
from jax_dwdp.parallel.dwdp import IndependentRanks, expert_blocks, place_model
from jax_dwdp.parallel.expert_layout import ExpertLayout, rank_memory
from jax_dwdp.parallel.experts import AXIS, Gather, Local, Store
from jax_dwdp.parallel.mesh import make_mesh
from jax_dwdp.parallel.runner import StageRunner
from jax_dwdp.timing import median_seconds, save_rows


def random_tokens(cfg, rows, seq, seed):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (rows, seq)).astype(np.int32)


def timed(fn, iters):
    """Median seconds of fn() after one warm-up call (the first call compiles)."""
    jax.block_until_ready(fn())
    return median_seconds(fn, iters)[0]


# --- stage: FFI vs XLA vs replicated on one stage's N ranks -----------------------------------------------------

def moe_ms(cfg, seq, device, dtype, iters):
    """The MoE block alone (router, routed experts, shared expert) on `seq` tokens of one device."""
    from flax import nnx

    model = init_model(cfg.replace(num_hidden_layers=1), dtype=dtype, seed=7, device=device)
    graphdef, state = nnx.split(model.layers[0].mlp)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (1, seq, cfg.hidden_size), dtype), device)
    run = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    t = timed(lambda: run(state, x), iters)
    del model
    return t * 1e3


def copy_only(runner: StageRunner, store, tokens) -> None:
    """Every layer's prefetch with no compute around it; store.copy_ms() then holds the copy times of an idle GPU."""
    h = runner.program("embed")(runner.state, runner.place(tokens))
    for i in range(store.num_layers):
        jax.block_until_ready(runner.source.prefetch(i, h))
        store.sync()  # nobody waits for these copies: finish them before their outputs are freed


def bench_stage(cfg, args) -> list[dict]:
    ranks, seqs, iters, dtype = args.ranks, args.seq_lens, args.iters, jnp.dtype(args.dtype)
    devices = jax.devices()[:ranks]
    mesh = jax.sharding.Mesh(make_mesh(1, ranks, devices).devices[0], (AXIS,))
    rows = {seq: {"seq_len_per_rank": seq, "ranks": ranks, "layers": cfg.num_hidden_layers} for seq in seqs}

    def inputs(seq):
        return random_tokens(cfg, ranks, seq, seed=0), np.full((ranks,), seq, np.int32)

    for variant in args.variants:
        t0 = time.perf_counter()
        model = init_model(cfg, dtype=dtype, seed=1, device=devices[0])
        placed = place_model(model, mesh, split_experts=variant != "replicated")
        del model
        gc.collect()
        store = None
        if variant == "ffi":  # timed copies: store.copy_ms() reads each layer's copy time
            from jax_dwdp.parallel.dwdp_ffi import ExpertStore

            store = ExpertStore.from_sharded(expert_blocks(placed), cfg.num_experts, timing=True)
            source = Store(store, mesh)
        else:
            source = Gather(expert_blocks(placed), mesh) if variant == "xla" else Local()
        program = StageRunner(placed, source, mesh=mesh)
        del placed, source
        setup_s = time.perf_counter() - t0
        for seq in seqs:
            tokens, lengths = inputs(seq)

            def run():
                return program(tokens, lengths, logits="last")
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            first_s = time.perf_counter() - t0
            ms = timed(run, iters) * 1e3
            row = rows[seq]
            row[f"{variant}_ms"] = round(ms, 2)
            row[f"{variant}_first_call_s"] = round(first_s, 1)
            row[f"{variant}_setup_s"] = round(setup_s, 1)
            if store is not None:
                copy = store.copy_ms()  # [ranks, layers], of the last timed run
                row["ffi_copy_ms_per_layer"] = round(float(np.nanmean(copy)), 3)
                row["ffi_copy_ms_total"] = round(float(np.nanmean(copy.sum(axis=1))), 2)
                row["store"] = store.info()
                copy_only(program, store, tokens)
                idle = store.copy_ms()
                row["ffi_copy_ms_per_layer_idle"] = round(float(np.nanmean(idle)), 3)
                peer = rank_memory(cfg, ExpertLayout(cfg.num_experts, ranks), 0, 1,
                                   store.dtype.itemsize)["peer_bytes_per_layer"]  # rank 0's
                row["ffi_peer_gib_per_layer"] = round(peer / 2**30, 3)
            print(f"{variant:>10} T={seq:>6}: {ms:9.2f} ms (first call {first_s:.1f} s)", flush=True)
        if store is not None:
            store.close()
        program = store = None
        gc.collect()

    for seq in seqs:
        row = rows[seq]
        row["moe_ms_per_layer"] = round(moe_ms(cfg, seq, devices[0], dtype, iters), 3)
        if "replicated_ms" in row:
            rep = row["replicated_ms"]
            row["layer_ms_replicated"] = round(rep / cfg.num_hidden_layers, 3)
            row["tokens_per_s_replicated"] = round(ranks * seq / rep * 1e3)
            for v in ("ffi", "xla"):
                if f"{v}_ms" in row:
                    row[f"{v}_vs_replicated"] = round(row[f"{v}_ms"] / rep, 3)
            if "ffi_ms" in row:
                exposed = max(0.0, row["ffi_ms"] - rep)
                row["ffi_copy_hidden_fraction"] = round(1 - min(1.0, exposed / row["ffi_copy_ms_total"]), 3)
        if "ffi_ms" in row and "xla_ms" in row:
            row["ffi_vs_xla"] = round(row["ffi_ms"] / row["xla_ms"], 3)
    rows = list(rows.values())
    print(f"\n{args.preset}, {cfg.num_hidden_layers} layers, {ranks} x {devices[0].device_kind}, one sequence "
          "per rank (ms per prefill; ratios vs replicated weights)")
    print("| tokens/rank | (a) FFI | (b) XLA | (c) replicated | a/c | b/c | a/b | copy ms/layer (under compute) "
          "| copy ms/layer (idle GPU) | MoE ms/layer | layer ms (c) | copy hidden |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        g = r.get
        print(f"| {r['seq_len_per_rank']} | {g('ffi_ms')} | {g('xla_ms')} | {g('replicated_ms')} | "
              f"{g('ffi_vs_replicated')} | {g('xla_vs_replicated')} | {g('ffi_vs_xla')} | {g('ffi_copy_ms_per_layer')} "
              f"| {g('ffi_copy_ms_per_layer_idle')} | {g('moe_ms_per_layer')} | {g('layer_ms_replicated')} "
              f"| {g('ffi_copy_hidden_fraction')} |")
    return rows


# --- ranks: independent ranks, concurrency, the FFI store, XLA DWDP ---------------------------------------------

def bench_ranks(cfg, args) -> list[dict]:
    n, iters = args.ranks, args.iters
    devices = jax.devices()[:n]
    model = init_model(cfg, dtype=jnp.dtype(args.dtype), seed=0, device=devices[0])
    tokens = random_tokens(cfg, n, args.seq_len, seed=1)
    lens = np.full((n,), args.seq_len, np.int32)
    replicated = Pipeline.from_model(model, 1, devices=devices[:1])
    t_rep = timed(lambda: replicated.prefill(tokens[:1], lens[:1], logits="last"), iters)
    row = dict(tokens_per_rank=args.seq_len, layers=cfg.num_hidden_layers, replicated_ms=round(t_rep * 1e3, 2))
    print(json.dumps(row), flush=True)
    work = {r: (tokens[r:r + 1], lens[r:r + 1]) for r in range(n)}
    with IndependentRanks(model, devices) as ranks:
        t_one = timed(lambda: ranks.prefill(0, *work[0], logits="last"), iters)
        row.update(independent_one_rank_ms=round(t_one * 1e3, 2))
        t_ind = timed(lambda: [ranks.prefill(r, *work[r], logits="last") for r in range(n)], iters)
        # ~1.0 when the ranks run concurrently, ~N when they run one after the other.
        row.update(independent_ms=round(t_ind * 1e3, 2), independent_vs_one_rank=round(t_ind / t_one, 3))
        dispatch = []  # host time to enqueue one rank's whole prefill (the call returns before the device is done)
        for _ in range(iters):
            t0 = time.perf_counter()
            out = ranks.prefill(0, *work[0], logits="last")
            dispatch.append(time.perf_counter() - t0)
            jax.block_until_ready(out)
        t_thr = timed(lambda: ranks.prefill_all(work, logits="last"), iters)
    row.update(dispatch_one_rank_ms=round(float(np.median(dispatch)) * 1e3, 2),
               independent_threads_ms=round(t_thr * 1e3, 2), independent_threads_vs_one_rank=round(t_thr / t_one, 3))
    print(json.dumps(row), flush=True)
    if args.ffi:  # the same independent ranks with peer experts read through the CUDA VMM store
        with IndependentRanks(model, devices, experts="ffi") as ffi_ranks:
            t_ffi = timed(lambda: [ffi_ranks.prefill(r, *work[r], logits="last") for r in range(n)], iters)
            t_ffi_thr = timed(lambda: ffi_ranks.prefill_all(work, logits="last"), iters)
        row.update(independent_ffi_ms=round(t_ffi * 1e3, 2), independent_ffi_vs_replicated=round(t_ffi / t_rep, 3),
                   independent_ffi_threads_ms=round(t_ffi_thr * 1e3, 2),
                   independent_ffi_threads_vs_replicated=round(t_ffi_thr / t_rep, 3))
        print(json.dumps(row), flush=True)
    if not args.skip_xla_dwdp:
        dw = Pipeline.from_model(model, 1, dwdp=n, devices=devices)
        t_xla = timed(lambda: dw.prefill(tokens, lens, logits="last"), iters)
        row.update(xla_dwdp_ms=round(t_xla * 1e3, 2), xla_vs_replicated=round(t_xla / t_rep, 3),
                   independent_vs_replicated=round(t_ind / t_rep, 3))
        print(json.dumps(row), flush=True)
    return [row]


# --- dispatch: one rank's host time, by call ---------------------------------------------------------------------

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


def bench_dispatch(cfg, args) -> dict:
    devices = jax.devices()[:2]
    if len(devices) < 2:
        raise SystemExit("needs two devices (on the CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    model = init_model(cfg, dtype=jnp.dtype(args.dtype), seed=0, device=devices[0])
    tokens = random_tokens(cfg, 1, args.seq_len, seed=1)
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
    calls = sorted(((name, len(t) / args.iters, sum(t) * 1e3 / args.iters) for name, t in TIMES.items()),
                   key=lambda r: -r[2])
    d_ms, w_ms = float(np.mean(dispatch)) * 1e3, float(np.mean(wall)) * 1e3  # means, like the per-call sums
    print(f"dispatch (host, until prefill returns) {d_ms:.2f} ms; wall until ready {w_ms:.2f} ms "
          f"({cfg.num_hidden_layers} layers, {args.seq_len} tokens, backend {args.backend})")
    print(f"{'call':48} {'calls/prefill':>13} {'host ms/prefill':>16}")
    for name, n, ms in calls:
        print(f"{name:48} {n:13.1f} {ms:16.3f}")
    accounted = sum(ms for _, _, ms in calls)
    print(f"{'(rest: Python between calls)':48} {'':13} {d_ms - accounted:16.3f}")
    return dict(args=vars(args), device=devices[0].device_kind, dispatch_ms=d_ms, wall_ms=w_ms,
                calls={name: dict(calls_per_prefill=n, host_ms_per_prefill=ms) for name, n, ms in calls})


# --- layouts: pipeline P x DWDP N --------------------------------------------------------------------------------

def parse_layout(layout: str) -> tuple[int, int, str]:
    """'PxN[:backend]' -> (P, N, backend), backend xla unless given (with N = 1 the stage holds its own experts)."""
    shape, _, backend = layout.partition(":")
    p, n = (int(v) for v in shape.split("x"))
    return p, n, backend or "xla"


def bench_layouts(cfg, args) -> list[dict]:
    tokens = random_tokens(cfg, args.sequences, args.seq_len, seed=0)
    rows = []
    for layout in args.layouts:
        p, n, backend = parse_layout(layout)
        if p * n > jax.device_count():
            rows.append({"layout": layout, "skipped": f"needs {p * n} devices, {jax.device_count()} present"})
            continue
        with Pipeline.random(cfg, p, dwdp=n, dtype=jnp.dtype(args.dtype), seed=1,
                             experts=backend if n > 1 else "local") as pipe:
            micro = args.sequences // n
            seconds = timed(lambda: pipe.prefill(tokens, microbatches=micro, logits="last", layerwise=True),
                            args.iters)
        gpus = p * n
        tok_s = tokens.size / seconds
        rows.append({"layout": layout, "pipeline": p, "dwdp": n, "backend": backend, "gpus": gpus,
                     "microbatches": micro, "ms": round(seconds * 1e3, 2), "tokens_per_s": round(tok_s),
                     "tokens_per_s_per_gpu": round(tok_s / gpus)})
        print(rows[-1], flush=True)
        pipe = None
        gc.collect()
    print(f"\n{args.preset}, {cfg.num_hidden_layers} layers, {args.sequences} x {args.seq_len} tokens, "
          f"{jax.devices()[0].device_kind}")
    print("| layout (P x N:backend) | GPUs | microbatches | ms | tokens/s | tokens/s per GPU |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['layout']} | skipped: {r['skipped']} |")
        else:
            print(f"| {r['layout']} | {r['gpus']} | {r['microbatches']} | {r['ms']} | {r['tokens_per_s']} | "
                  f"{r['tokens_per_s_per_gpu']} |")
    return rows


# --- command line ----------------------------------------------------------------------------------------------

COMMANDS = {"stage": bench_stage, "ranks": bench_ranks, "dispatch": bench_dispatch, "layouts": bench_layouts}


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--preset", default="35b-a3b")
    common.add_argument("--num-layers", type=int, help="the preset's first N layers")
    common.add_argument("--dtype", default="bfloat16")
    common.add_argument("--iters", type=int, default=3)
    common.add_argument("--out", help="JSON results path")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Without a subcommand, the arguments go to 'stage'.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("stage", parents=[common], help="FFI vs XLA vs replicated experts on one stage's N ranks")
    p.set_defaults(num_layers=16)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--variants", nargs="+", default=["ffi", "xla", "replicated"], choices=["ffi", "xla", "replicated"])

    p = sub.add_parser("ranks", parents=[common], help="independent ranks: concurrency, FFI store, XLA DWDP")
    p.set_defaults(num_layers=8)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--ffi", action="store_true", help="also time independent ranks on the FFI store")
    p.add_argument("--skip-xla-dwdp", action="store_true", help="skip the whole-model XLA DWDP program")

    p = sub.add_parser("dispatch", parents=[common], help="host time of one rank's layer-wise prefill, by call")
    p.set_defaults(num_layers=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--backend", default="xla", choices=["xla", "ffi"])

    p = sub.add_parser("layouts", parents=[common], help="pipeline P x DWDP N side by side")
    p.set_defaults(num_layers=16)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--layouts", nargs="+", default=["2x2:ffi", "2x1", "1x4:ffi", "1x4:xla"],
                   help="PxN[:xla|ffi]: P pipeline stages of N DWDP ranks")
    return ap


def main(argv=None):
    """Runs one subcommand; returns its rows (dispatch: its result dict), as written to --out."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv.insert(0, "stage")
    args = parser().parse_args(argv)
    cfg = ModelConfig.preset(args.preset).replace(num_hidden_layers=args.num_layers)
    print(f"{args.command}: {cfg.summary()} on {jax.devices()[0].device_kind} x {jax.device_count()}", flush=True)
    result = COMMANDS[args.command](cfg, args)
    if args.command == "dispatch":
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    else:
        save_rows(args.out, result, args, what=args.command)
    return result


if __name__ == "__main__":
    main()

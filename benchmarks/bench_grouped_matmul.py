"""The MoE grouped matmul on one GPU (issue 6), one subcommand per question:

    python3 benchmarks/bench_grouped_matmul.py calls --out calls.json [--presets 35b-a3b ...] [--tokens 16384 4096]
    ncu --clock-control none --kernel-name regex:device_kernel --metrics gpu__time_duration.sum --csv \\
        --print-units base --log-file ncu.csv python3 benchmarks/bench_grouped_matmul.py kernels run --plan plan.json
    python3 benchmarks/bench_grouped_matmul.py kernels report --plan plan.json --csv ncu.csv [--out kernels.json]
    python3 benchmarks/bench_grouped_matmul.py fusion --out fusion.json [--breakdown] [--no-block]
    python3 benchmarks/bench_grouped_matmul.py gather --out gather.json [--presets ...] [--tokens ...]

calls: whole calls of the CUTLASS FFI kernel (the automatic config and every config) vs Mosaic (ragged_dot_mgpu,
  its default and a small sweep), torch._grouped_mm and a dense matmul of the same FLOPs, on the Qwen3.5-MoE expert
  shapes. Times are medians of --iters samples after warm-up; each sample launches a batch of back-to-back calls
  (about 20 ms of GPU work) and waits once, so launch overhead does not hide short kernels. The same method times
  every implementation, torch included; inputs are shared with torch through DLPack (no copy).
kernels: the GEMM kernel alone (Nsight Compute), each CUTLASS config vs torch's kernel, so that a gap to torch can
  be placed in the kernel or in the launch path (setup kernel, tail zero-fill, per-call host work). `run` makes
  CALLS launches of every (case, implementation) in a fixed order and writes that order to the plan; `report` maps
  ncu's kernels onto it in launch order (only CUTLASS `device_kernel`s are profiled: ours and torch's are both
  CUTLASS GEMMs) and prints the median of each (the first launch of each is a warm-up and is dropped).
fusion: the fused SwiGLU epilogue: the gate_up projection + SiLU(gate) * up, "fused" (CUTLASS, activation in the
  epilogue, [rows, I] written) vs "unfused" (the same CUTLASS GEMM writing [rows, 2I], then XLA's SiLU * up) vs
  "torch" (torch._grouped_mm, then F.silu(gate) * up, eager); and the whole routed-expert block (`routed_experts`:
  permute, two grouped matmuls, un-permute) with the interleaved weights and the fused kernel vs the Hugging Face
  layout and the unfused path. Also the relative error of fused vs unfused (they differ by the bf16 rounding of
  gate and up, which the fused kernel skips). --breakdown also times the block's parts alone: the sort by expert;
  the inverse permutation, a second argsort (before) vs the scatter of iota `routed_experts` uses; the row gather
  as bf16 elements, with promise_in_bounds, and as 32-bit words (what `routed_experts` uses); the down projection;
  the un-permute (gather, routing-weight scale, top-k sum). (Candidates measured and dropped, RESULTS.md, MoE
  block: a keys-only sort of packed keys, a 32-bit un-permute gather, the gather inside the GEMM's A loads.)

gather: the gate_up projection reading the tokens itself (`grouped_matmul_gather`, the CUTLASS gather kernel:
  cp.async from a producer warpgroup) vs the two steps it replaces (the 32-bit row gather `gather_rows`, then the
  TMA grouped GEMM) and vs that GEMM alone on pre-gathered rows (its floor); and the whole routed-expert block
  (`routed_experts`, routing permutation to weighted un-permute) with gather=True (gather + fused SwiGLU kernel) vs gather=False (the Pallas
  dispatch, then the GEMM). The gather kernel's output is checked against the two-step result before timing. Also
  the gather kernel with SiLU(gate) * up in its epilogue vs the gather kernel then XLA's activation.

A missing implementation (no library, no torch, no GPU, a kernel that fails) is reported as 'n/a' with the reason in
the row's "notes", and the run goes on: on a CPU only the dense matmul and the XLA paths are timed. Without a
subcommand the arguments go to `calls` (the command lines recorded in RESULTS.md before the merge). JSON with --out:
calls and fusion {"device", "jax", "torch", ..., "rows": [{..., "times_ms": {name: ms}, "notes": {name: why}}]},
rewritten after every row; kernels report {case: {implementation: microseconds}}.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jax_dwdp.config import ModelConfig
from jax_dwdp.kernels.permute import gather_rows
from jax_dwdp.model.moe import routed_experts, sort_by_expert
from jax_dwdp.timing import median_seconds

gm = importlib.import_module("jax_dwdp.kernels.grouped_matmul")  # the module (the package re-exports the function)

MOSAIC_SWEEP = [  # (block_m, block_n, block_k, max_concurrent_steps)
    (128, 128, 64, 4),
    (128, 256, 64, 4),
    (128, 256, 64, 2),
    (64, 256, 64, 4),
    (64, 128, 64, 4),
    (128, 128, 64, 2),
]


def shapes(presets):
    out = []
    for name in presets:
        cfg = ModelConfig.preset(name)
        h, i, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
        out.append(dict(model=name, proj="gate_up", experts=e, top_k=k, n=2 * i, k=h))
        out.append(dict(model=name, proj="down", experts=e, top_k=k, n=h, k=i))
    return out


def group_sizes(rng, rows, experts, routing):
    p = np.full(experts, 1.0 / experts) if routing == "uniform" else rng.dirichlet(np.full(experts, 0.3))
    return rng.multinomial(rows, p).astype(np.int32)


def timed(fn, iters, target_s=20e-3):
    """Median seconds per call of fn (which returns something to wait for)."""
    jax.block_until_ready(fn())  # compile / warm-up
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    one = max(time.perf_counter() - t0, 1e-6)
    batch = max(1, min(200, math.ceil(target_s / one)))
    med, _ = median_seconds(lambda: [fn() for _ in range(batch)], iters)
    return med / batch


def torch_timed(fn, iters, target_s=20e-3):
    import torch

    fn()
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    batch = max(1, min(200, math.ceil(target_s / one)))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / batch


def mosaic_fn(n, k, bm, bn, bk, steps):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    if n % bn or k % bk:
        raise ValueError(f"N={n} or K={k} is not a multiple of the block ({bn}, {bk})")
    grid_block_n = next(g for g in (8, 4, 2, 1) if n % (g * bn) == 0)

    @jax.jit
    def f(x, w, gs):
        return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=gs, block_m=bm, block_n=bn, block_k=bk,
                                          max_concurrent_steps=steps, grid_block_n=grid_block_n, transpose_rhs=True)

    return f


def reason(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return msg[:300]


def case_args(ap: argparse.ArgumentParser, iters: int) -> None:
    """The MoE cases `calls` and `fusion` sweep: presets x token counts x routings, samples per case."""
    ap.add_argument("--presets", nargs="+", default=["35b-a3b", "122b-a10b", "397b-a17b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[16384, 4096])
    ap.add_argument("--routing", nargs="+", default=["uniform", "skewed"])
    ap.add_argument("--iters", type=int, default=iters)


# --- calls: whole calls of every implementation ------------------------------------------------------------------

def bench_calls(args) -> dict:
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}", flush=True)

    try:
        import torch

        grouped_mm = torch._grouped_mm
        torch_note = f"torch {torch.__version__}"
    except Exception as e:  # noqa: BLE001
        torch, grouped_mm, torch_note = None, None, f"n/a ({reason(e)})"
    print(f"torch: {torch_note}", flush=True)

    from jax_dwdp.kernels import _cutlass

    cutlass_note, cutlass_configs = "ok", []
    try:
        cutlass_configs = _cutlass.config_names()
        cutlass_note = f"{_cutlass.library_path()} configs {cutlass_configs}"
    except Exception as e:  # noqa: BLE001
        cutlass_note = f"n/a ({reason(e)})"
    print(f"cutlass: {cutlass_note}", flush=True)

    rng = np.random.default_rng(0)
    results = dict(device=dev.device_kind, jax=jax.__version__, torch=torch_note, cutlass=cutlass_note, rows=[])
    best_mosaic: dict[tuple, tuple] = {}
    best_cutlass: dict[tuple, int] = {}

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    header = (f"{'model':10} {'proj':7} {'rows':>7} {'routing':8} | {'cutlass':>13} {'cutlass best':>22} "
              f"{'mosaic':>13} {'mosaic tuned':>24} {'torch':>13} {'dense':>13} | {'cut/torch':>9} "
              f"{'best/torch':>10} {'rel err vs torch':>16}")
    print(header)
    print("-" * len(header), flush=True)

    for s in shapes(args.presets):
        e, n, k = s["experts"], s["n"], s["k"]
        for tokens in args.tokens:
            m = tokens * s["top_k"]
            flops = 2.0 * m * n * k
            key = (s["model"], s["proj"], tokens)
            kx = jax.random.key(1)
            x = jax.random.normal(kx, (m, k), jnp.bfloat16)
            w = (jax.random.normal(jax.random.key(2), (e, n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
            w0 = w[0]
            dense = jax.jit(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ()))))
            for routing in args.routing:
                sizes = group_sizes(rng, m, e, routing)
                gs = jnp.asarray(sizes)
                jax.block_until_ready((x, w, w0, gs))
                row = dict(s, rows=m, tokens=tokens, routing=routing, gflop=flops / 1e9, max_group=int(sizes.max()),
                           empty_groups=int((sizes == 0).sum()), times_ms={}, notes={})
                over_budget = time.perf_counter() - t_start > args.budget_s

                def record(name, fn, timer=timed):
                    try:
                        t = timer(fn, args.iters)
                        row["times_ms"][name] = t * 1e3
                        return t
                    except Exception as ex:  # noqa: BLE001
                        row["notes"][name] = reason(ex)
                        if os.environ.get("BENCH_TRACEBACK"):
                            traceback.print_exc()
                        return None

                # Ours: the auto-picked config, then every config (best reported).
                ours = None
                if cutlass_configs:
                    f_auto = jax.jit(lambda a, b, c: _cutlass.grouped_matmul(a, b, c))
                    record("cutlass", lambda: f_auto(x, w, gs))
                    try:
                        row["cutlass_auto_config"] = cutlass_configs[_cutlass.pick_config(m, n, e)]
                        ours = jax.block_until_ready(f_auto(x, w, gs))
                    except Exception as ex:  # noqa: BLE001
                        row["notes"]["cutlass"] = reason(ex)
                    cfgs = ([best_cutlass[key]] if key in best_cutlass and routing != args.routing[0]
                            else range(len(cutlass_configs)))
                    if over_budget:
                        cfgs = []
                    best = None
                    for ci in cfgs:
                        f_c = jax.jit(lambda a, b, c, ci=ci: _cutlass.grouped_matmul(a, b, c, config=ci))
                        t = record(f"cutlass[{cutlass_configs[ci]}]", lambda f_c=f_c: f_c(x, w, gs))
                        if t is not None and (best is None or t < best[0]):
                            best = (t, ci)
                    if best is not None:
                        best_cutlass.setdefault(key, best[1])
                        row["cutlass_best"] = cutlass_configs[best[1]]
                        row["times_ms"]["cutlass best"] = best[0] * 1e3
                else:
                    row["notes"]["cutlass"] = cutlass_note

                # Mosaic: the project's default config, then a small sweep (on the first routing of each shape).
                f_m = jax.jit(lambda a, b, c: gm.grouped_matmul(a, b, c, implementation="mosaic"))
                if not args.no_mosaic:
                    record("mosaic", lambda: f_m(x, w, gs))
                if not (args.no_mosaic or args.no_mosaic_sweep) and not over_budget:
                    # Swept once per shape (first token count, first routing); later cases reuse the winner.
                    sweep = [best_mosaic[key[:2]][1]] if key[:2] in best_mosaic else MOSAIC_SWEEP
                    best = None
                    for cfg in sweep:
                        name = "mosaic[bm{} bn{} bk{} s{}]".format(*cfg)
                        try:
                            f_t = mosaic_fn(n, k, *cfg)
                        except Exception as ex:  # noqa: BLE001
                            row["notes"][name] = reason(ex)
                            continue
                        t = record(name, lambda f_t=f_t: f_t(x, w, gs))
                        if t is not None and (best is None or t < best[0]):
                            best = (t, cfg)
                    if best is not None:
                        best_mosaic.setdefault(key[:2], best)
                        row["mosaic_tuned"] = "bm{} bn{} bk{} s{}".format(*best[1])
                        row["times_ms"]["mosaic tuned"] = min(best[0], row["times_ms"].get("mosaic", 1e9) / 1e3) * 1e3

                # torch._grouped_mm on the same buffers (DLPack, no copy): x [M, K], w^T view [G, K, N], offs int32.
                theirs = None
                if grouped_mm is not None:
                    try:
                        tx = torch.from_dlpack(x)
                        tw = torch.from_dlpack(w).transpose(-2, -1)
                        offs = torch.from_dlpack(jax.block_until_ready(jnp.cumsum(gs).astype(jnp.int32)))
                        record("torch", lambda: grouped_mm(tx, tw, offs=offs), timer=torch_timed)
                        theirs = grouped_mm(tx, tw, offs=offs)
                    except Exception as ex:  # noqa: BLE001
                        row["notes"]["torch"] = reason(ex)
                else:
                    row["notes"]["torch"] = torch_note

                record("dense", lambda: dense(x, w0))

                if ours is not None and theirs is not None:
                    try:
                        a = torch.from_dlpack(ours).float()
                        b = theirs.float()
                        total = int(sizes.sum())
                        a, b = a[:total], b[:total]
                        row["rel_err_vs_torch"] = float((a - b).norm() / b.norm())
                        row["max_abs_err_vs_torch"] = float((a - b).abs().max() / b.abs().max())
                    except Exception as ex:  # noqa: BLE001
                        row["notes"]["compare"] = reason(ex)

                tm = row["times_ms"]
                row["tflops"] = {name: flops / (t * 1e-3) / 1e12 for name, t in tm.items()}

                def cell(name, label=None):
                    if name in tm:
                        txt = f"{tm[name]:.3f}ms {row['tflops'][name]:.0f}T"
                        return f"{txt} {label}" if label else txt
                    return "n/a"

                torch_t = tm.get("torch")
                ratio = f"{torch_t / tm['cutlass']:.2f}x" if torch_t and "cutlass" in tm else "n/a"
                best_t = tm.get("cutlass best", tm.get("cutlass"))
                ratio_best = f"{torch_t / best_t:.2f}x" if torch_t and best_t else "n/a"
                err = f"{row['rel_err_vs_torch']:.1e}" if "rel_err_vs_torch" in row else "n/a"
                print(f"{s['model']:10} {s['proj']:7} {m:>7} {routing:8} | {cell('cutlass'):>13} "
                      f"{cell('cutlass best', row.get('cutlass_best', '')[:8]):>22} {cell('mosaic'):>13} "
                      f"{cell('mosaic tuned', row.get('mosaic_tuned', '')):>24} {cell('torch'):>13} "
                      f"{cell('dense'):>13} | {ratio:>9} {ratio_best:>10} {err:>16}", flush=True)
                for name, note in row["notes"].items():
                    print(f"    n/a {name}: {note}", flush=True)
                results["rows"].append(row)
                save()
                del ours, theirs
            del x, w, w0
    results["elapsed_s"] = time.perf_counter() - t_start
    save()
    print(f"done in {results['elapsed_s']:.0f} s" + (f"; results in {args.out}" if args.out else ""))
    return results


# --- kernels: the GEMM kernel alone, under Nsight Compute --------------------------------------------------------

CASES = [  # (label, experts, N, K, rows)
    ("35b-a3b gate_up 16K", 256, 1024, 2048, 131072),
    ("35b-a3b down 4K", 256, 2048, 512, 32768),
    ("397b-a17b gate_up 4K", 512, 2048, 4096, 40960),
]
CALLS = 4


def kernels_run(plan_path: str) -> None:
    """CALLS launches of every CUTLASS config and of torch._grouped_mm per case, their order written to the plan."""
    import torch

    from jax_dwdp.kernels import _cutlass

    names = _cutlass.config_names()
    plan = []
    rng = np.random.default_rng(0)
    for label, e, n, k, m in CASES:
        sizes = rng.multinomial(m, np.full(e, 1.0 / e)).astype(np.int32)
        x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
        w = (jax.random.normal(jax.random.key(2), (e, n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        gs = jnp.asarray(sizes)
        for ci, name in enumerate(names):
            f = jax.jit(lambda a, b, c, ci=ci: _cutlass.grouped_matmul(a, b, c, config=ci))
            jax.block_until_ready(f(x, w, gs))  # compile outside the counted launches (its GEMM launch counts too)
            for _ in range(CALLS - 1):
                jax.block_until_ready(f(x, w, gs))
            plan.append(dict(case=label, impl=f"cutlass[{name}]", launches=CALLS))
        tx, tw = torch.from_dlpack(x), torch.from_dlpack(w).transpose(-2, -1)
        offs = torch.from_dlpack(jax.block_until_ready(jnp.cumsum(gs).astype(jnp.int32)))
        for _ in range(CALLS):
            torch._grouped_mm(tx, tw, offs=offs)
        torch.cuda.synchronize()
        plan.append(dict(case=label, impl="torch._grouped_mm", launches=CALLS))
        with open(plan_path, "w") as fh:  # after every case: a run cut short still leaves a usable plan
            json.dump(plan, fh, indent=1)


def kernels_report(plan_path: str, csv_path: str) -> dict:
    """{case: {implementation: median kernel microseconds}} from ncu's CSV, in the plan's launch order."""
    plan = json.load(open(plan_path))
    with open(csv_path) as fh:
        lines = [ln for ln in fh if ln.startswith('"')]  # ncu's own messages are not quoted CSV
    rows = [r for r in csv.DictReader(lines) if r.get("Metric Name") == "gpu__time_duration.sum"]
    to_us = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    units = {r.get("Metric Unit", "ns") for r in rows}
    if not units <= set(to_us):
        raise SystemExit(f"unknown time unit(s) {units - set(to_us)} in {csv_path}")
    times = [float(r["Metric Value"].replace(",", "")) * to_us[r.get("Metric Unit", "ns")] for r in rows]
    want = sum(p["launches"] for p in plan)
    print(f"{len(times)} GEMM kernels profiled, plan expects {want}")
    if len(times) < want or len(times) > want and len(times) - want >= CALLS:
        print("kernel count does not match the plan; not attributing")
        return {}
    times = times[:want]
    at, out = 0, {}
    for p in plan:
        t = times[at:at + p["launches"]]
        at += p["launches"]
        out.setdefault(p["case"], {})[p["impl"]] = float(np.median(t[1:]))
    for case, impls in out.items():
        ref = impls.get("torch._grouped_mm")
        print(f"{case}:")
        for impl, us in sorted(impls.items(), key=lambda kv: kv[1]):
            print(f"  {impl:36} {us:9.1f} us" + (f"   torch/this {ref / us:5.3f}" if ref else ""))
    print(json.dumps(out))
    return out


# --- fusion: the fused SwiGLU epilogue, the routed-expert block and its parts ------------------------------------

def routing_for(rng, tokens, experts, top_k, routing):
    """Expert ids [tokens, top_k] whose per-expert counts follow the uniform or skewed distribution, and weights."""
    counts = group_sizes(rng, tokens * top_k, experts, routing)
    ids = np.repeat(np.arange(experts, dtype=np.int32), counts)
    rng.shuffle(ids)
    weights = rng.dirichlet(np.ones(top_k), size=tokens).astype(np.float32)
    return ids.reshape(tokens, top_k), weights, counts


def breakdown(record, ids, weights, xt, down, experts, top_k, gs):
    """Times the routed-expert block's parts alone, as `routed_experts` runs them."""
    m = ids.shape[0]
    sort = jax.jit(lambda i: sort_by_expert(i, experts))
    order, _ = sort(ids)
    n = order.shape[0]
    inv_sort = jax.jit(jnp.argsort)
    inv_scatter = jax.jit(lambda o: jnp.zeros_like(o).at[o].set(jnp.arange(o.shape[0], dtype=o.dtype),
                                                               unique_indices=True))
    gather = jax.jit(lambda x, o: x[o // top_k])
    gather_pib = jax.jit(lambda x, o: x.at[o // top_k].get(mode="promise_in_bounds"))
    gather_u32 = jax.jit(lambda x, o: gather_rows(x, o // top_k))  # rows as 32-bit words (what the model uses)
    act = jax.random.normal(jax.random.key(5), (n, down.shape[2]), jnp.bfloat16)
    down_mm = jax.jit(lambda a, w, g: gm.grouped_matmul(a, w, g))
    y = jax.random.normal(jax.random.key(6), (n, down.shape[1]), jnp.bfloat16)
    inverse = inv_scatter(order)

    @jax.jit
    def unpermute(y, inv, w):
        out = y[inv] * w.reshape(-1)[:, None]
        return jnp.sum(out.reshape(m, top_k, -1).astype(jnp.float32), axis=1).astype(y.dtype)

    record("part sort", lambda: sort(ids))
    record("part inverse argsort", lambda: inv_sort(order))
    record("part inverse scatter", lambda: inv_scatter(order))
    record("part gather", lambda: gather(xt, order))
    record("part gather in-bounds", lambda: gather_pib(xt, order))
    record("part gather u32", lambda: gather_u32(xt, order))
    if not np.array_equal(np.asarray(gather_u32(xt, order)), np.asarray(gather(xt, order))):
        raise AssertionError("the u32 row gather differs from the plain one")
    record("part down", lambda: down_mm(act, down, gs))
    record("part unpermute", lambda: unpermute(y, inverse, weights))


def bench_fusion(args) -> dict:
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}, jax {jax.__version__}", flush=True)
    try:
        import torch
        import torch.nn.functional as F

        torch_note = f"torch {torch.__version__}"
    except Exception as e:  # noqa: BLE001
        torch, F, torch_note = None, None, f"n/a ({reason(e)})"
    from jax_dwdp.kernels import _cutlass

    try:
        cutlass_note = f"fused configs {_cutlass.swiglu_config_names()}"
    except Exception as e:  # noqa: BLE001
        cutlass_note = f"n/a ({reason(e)})"
    print(f"{torch_note}; cutlass {cutlass_note}", flush=True)
    results = dict(device=dev.device_kind, jax=jax.__version__, torch=torch_note, cutlass=cutlass_note, rows=[])
    rng = np.random.default_rng(0)
    header = (f"{'model':10} {'tokens':>6} {'routing':8} | {'fused':>9} {'unfused':>9} {'torch':>9} | {'unf/fused':>9} "
              f"{'torch/fused':>11} {'err':>8} | {'block fused':>11} {'block unf':>10} {'unf/fused':>9}")
    print(header)
    print("-" * len(header), flush=True)
    for preset in args.presets:
        cfg = ModelConfig.preset(preset)
        h, i, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
        w_hf = (jax.random.normal(jax.random.key(2), (e, 2 * i, h), jnp.float32) * h**-0.5).astype(jnp.bfloat16)
        w_il = jax.jit(gm.interleave_gate_up)(w_hf)
        down = (jax.random.normal(jax.random.key(3), (e, h, i), jnp.float32) * i**-0.5).astype(jnp.bfloat16)
        for tokens in args.tokens:
            m = tokens * k
            x = jax.random.normal(jax.random.key(1), (m, h), jnp.bfloat16)
            xt = jax.random.normal(jax.random.key(4), (tokens, h), jnp.bfloat16)
            for routing in args.routing:
                ids, weights, counts = routing_for(rng, tokens, e, k, routing)
                gs = jnp.asarray(counts)
                row = dict(model=preset, tokens=tokens, rows=m, routing=routing, times_ms={}, notes={})

                def record(name, fn, timer=timed):
                    try:
                        row["times_ms"][name] = timer(fn, args.iters) * 1e3
                    except Exception as ex:  # noqa: BLE001
                        row["notes"][name] = reason(ex)

                fused = jax.jit(lambda a, b, c: gm.grouped_matmul_swiglu(a, b, c, implementation="cutlass"))
                unfused = jax.jit(lambda a, b, c: gm.grouped_matmul_swiglu(a, b, c, implementation="cutlass",
                                                                           fused=False))
                record("fused", lambda: fused(x, w_il, gs))
                record("unfused", lambda: unfused(x, w_il, gs))
                try:
                    total = int(counts.sum())
                    a = np.asarray(fused(x, w_il, gs)[:total], np.float32)
                    b = np.asarray(unfused(x, w_il, gs)[:total], np.float32)
                    row["rel_err_fused_vs_unfused"] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
                    del a, b
                except Exception as ex:  # noqa: BLE001
                    row["notes"]["compare"] = reason(ex)
                if torch is not None:
                    try:
                        tx = torch.from_dlpack(x)
                        tw = torch.from_dlpack(w_hf).transpose(-2, -1)
                        offs = torch.from_dlpack(jax.block_until_ready(jnp.cumsum(gs).astype(jnp.int32)))

                        def torch_swiglu():
                            y = torch._grouped_mm(tx, tw, offs=offs)
                            return F.silu(y[:, :i]) * y[:, i:]

                        record("torch", torch_swiglu, timer=torch_timed)
                    except Exception as ex:  # noqa: BLE001
                        row["notes"]["torch"] = reason(ex)
                if not args.no_block:
                    jids, jw = jnp.asarray(ids), jnp.asarray(weights, jnp.bfloat16)
                    blk_f = jax.jit(lambda t, a, b, c, d: routed_experts(t, a, b, c, d, gate_up_interleaved=True))
                    blk_u = jax.jit(lambda t, a, b, c, d: routed_experts(t, a, b, c, d))
                    record("block fused", lambda: blk_f(xt, jids, jw, w_il, down))
                    record("block unfused", lambda: blk_u(xt, jids, jw, w_hf, down))
                    try:
                        a = np.asarray(blk_f(xt, jids, jw, w_il, down), np.float32)
                        b = np.asarray(blk_u(xt, jids, jw, w_hf, down), np.float32)
                        row["block_rel_err_fused_vs_unfused"] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
                    except Exception as ex:  # noqa: BLE001
                        row["notes"]["block compare"] = reason(ex)
                if args.breakdown:
                    breakdown(record, jnp.asarray(ids), jnp.asarray(weights, jnp.bfloat16), xt, down, e, k, gs)
                tm = row["times_ms"]

                def c(name):
                    return f"{tm[name]:.3f}" if name in tm else "n/a"

                def r(num, den):
                    return f"{tm[num] / tm[den]:.2f}x" if num in tm and den in tm else "n/a"

                err = row.get("rel_err_fused_vs_unfused")
                print(f"{preset:10} {tokens:>6} {routing:8} | {c('fused'):>9} {c('unfused'):>9} {c('torch'):>9} | "
                      f"{r('unfused', 'fused'):>9} {r('torch', 'fused'):>11} "
                      f"{(f'{err:.1e}' if err is not None else 'n/a'):>8} | {c('block fused'):>11} "
                      f"{c('block unfused'):>10} {r('block unfused', 'block fused'):>9}", flush=True)
                parts = [n for n in tm if n.startswith("part ")]
                if parts:
                    print("    parts (ms): " + ", ".join(f"{n[5:]} {tm[n]:.3f}" for n in parts), flush=True)
                for name, note in row["notes"].items():
                    print(f"    n/a {name}: {note}", flush=True)
                results["rows"].append(row)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(results, f, indent=1)
    print(f"done in {time.perf_counter() - t_start:.0f} s (times in ms)")
    return results


def half_tiles_ab(fn, want, rounds: int) -> dict:
    """`fn` with $JAX_DWDP_GATHER_HALF_TILES on and off in alternating rounds (each a `timed` median), the same bits
    checked once each way: median ms of each and full / half."""
    before = os.environ.get("JAX_DWDP_GATHER_HALF_TILES")
    times = {"half": [], "full": []}
    try:
        for r in range(2 * rounds):
            mode = ("half", "full")[(r % 2) ^ ((r // 2) % 2)]  # ABBA order: half, full, full, half, ...
            os.environ["JAX_DWDP_GATHER_HALF_TILES"] = "1" if mode == "half" else "0"
            if r < 2 and not np.array_equal(np.asarray(fn(), np.float32), want):
                raise AssertionError(f"the {mode}-tile output differs from the default's")
            times[mode].append(timed(fn, 3) * 1e3)
    finally:
        os.environ.pop("JAX_DWDP_GATHER_HALF_TILES", None)
        if before is not None:
            os.environ["JAX_DWDP_GATHER_HALF_TILES"] = before
    half, full = float(np.median(times["half"])), float(np.median(times["full"]))
    print(f"    half tiles on / off ({rounds} rounds each, ABBA): {half:.3f} / {full:.3f} ms, off / on "
          f"{full / half:.3f}x", flush=True)
    return dict(half_ms=half, full_ms=full, full_over_half=full / half, rounds=times)


def bench_gather(args) -> dict:
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind}, jax {jax.__version__}", flush=True)
    results = dict(device=dev.device_kind, jax=jax.__version__, rows=[])
    rng = np.random.default_rng(0)
    header = (f"{'model':10} {'tokens':>6} {'routing':8} | {'gather':>8} {'2-step':>8} {'gemm':>8} | "
              f"{'2-step/g':>8} {'g/gemm':>7} {'diff':>8} | {'block g':>8} {'block d':>8} {'d/g':>6}")
    print(header)
    print("-" * len(header), flush=True)
    from jax_dwdp.kernels import _cutlass

    try:
        configs = _cutlass.gather_config_names()
    except Exception as e:  # noqa: BLE001
        configs, results["notes"] = [], f"n/a ({reason(e)})"
    print(f"gather configs: {configs}", flush=True)
    gather_k = jax.jit(lambda x, t, w, s: gm.grouped_matmul_gather(x, t, w, s, implementation="cutlass"))
    gather_cfg = jax.jit(lambda x, t, w, s, c: _cutlass.grouped_matmul_gather(x, t, w, s, config=c),
                         static_argnums=4)
    fused_act = jax.jit(lambda x, t, w, s: _cutlass.grouped_matmul_gather_swiglu(x, t, w, s))
    unfused_act = jax.jit(lambda x, t, w, s: gm.swiglu(*jnp.split(_cutlass.grouped_matmul_gather(x, t, w, s), 2, 1),
                                                       x.dtype))
    two_step = jax.jit(lambda x, t, w, s: gm.grouped_matmul(gather_rows(x, t), w, s, implementation="cutlass"))
    gemm = jax.jit(lambda a, w, s: gm.grouped_matmul(a, w, s, implementation="cutlass"))
    blk = jax.jit(lambda t, a, b, c, d, g: routed_experts(t, a, b, c, d, gather=g), static_argnums=5)
    for preset in args.presets:
        cfg = ModelConfig.preset(preset)
        h, i, e, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok
        w = (jax.random.normal(jax.random.key(2), (e, 2 * i, h), jnp.float32) * h**-0.5).astype(jnp.bfloat16)
        down = (jax.random.normal(jax.random.key(3), (e, h, i), jnp.float32) * i**-0.5).astype(jnp.bfloat16)
        for tokens in args.tokens:
            xt = jax.random.normal(jax.random.key(4), (tokens, h), jnp.bfloat16)
            for routing in args.routing:
                ids, weights, counts = routing_for(rng, tokens, e, k, routing)
                gs = jnp.asarray(counts)
                tok = jnp.asarray((np.argsort(ids.reshape(-1), kind="stable") // k).astype(np.int32))
                rows_x = jax.block_until_ready(gather_rows(xt, tok))
                row = dict(model=preset, tokens=tokens, rows=tokens * k, routing=routing, times_ms={}, notes={})

                def record(name, fn):
                    try:
                        row["times_ms"][name] = timed(fn, args.iters) * 1e3
                    except Exception as ex:  # noqa: BLE001
                        row["notes"][name] = reason(ex)

                try:
                    a = np.asarray(gather_k(xt, tok, w, gs), np.float32)
                    b = np.asarray(two_step(xt, tok, w, gs), np.float32)
                    row["rel_diff_gather_vs_two_step"] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
                    row["identical"] = bool(np.array_equal(a, b))
                    del a, b
                    if row["rel_diff_gather_vs_two_step"] > 1e-3:
                        raise AssertionError(f"gather kernel differs: {row['rel_diff_gather_vs_two_step']:.2e}")
                except Exception as ex:  # noqa: BLE001
                    row["notes"]["compare"] = reason(ex)
                if "compare" not in row["notes"]:
                    record("gather", lambda: gather_k(xt, tok, w, gs))
                    for cfg_name in configs[1:]:  # the others (the default, index 0, is "gather")
                        try:
                            a = np.asarray(gather_cfg(xt, tok, w, gs, cfg_name), np.float32)
                            if not np.array_equal(a, np.asarray(two_step(xt, tok, w, gs), np.float32)):
                                raise AssertionError(f"{cfg_name} differs from the two-step result")
                            record(f"gather {cfg_name}", lambda: gather_cfg(xt, tok, w, gs, cfg_name))
                        except Exception as ex:  # noqa: BLE001
                            row["notes"][f"gather {cfg_name}"] = reason(ex)
                    try:  # SiLU(gate) * up in the gather kernel's epilogue vs the gather kernel, then XLA's
                        a = np.asarray(fused_act(xt, tok, w, gs), np.float32)
                        b = np.asarray(unfused_act(xt, tok, w, gs), np.float32)
                        row["rel_diff_swiglu_fused_vs_unfused"] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
                        del a, b
                        record("gather swiglu-fused", lambda: fused_act(xt, tok, w, gs))
                        record("gather swiglu-unfused", lambda: unfused_act(xt, tok, w, gs))
                        # the half-tile skip on and off, interleaved (the library reads the switch at each call)
                        if args.half_tiles_rounds:
                            try:
                                want = np.asarray(fused_act(xt, tok, w, gs), np.float32)
                                row["half_tiles"] = half_tiles_ab(lambda: fused_act(xt, tok, w, gs), want,
                                                                  args.half_tiles_rounds)
                                del want
                            except Exception as ex:  # noqa: BLE001
                                row["notes"]["half tiles a/b"] = reason(ex)
                    except Exception as ex:  # noqa: BLE001
                        row["notes"]["gather swiglu"] = reason(ex)
                record("two-step", lambda: two_step(xt, tok, w, gs))
                record("gemm", lambda: gemm(rows_x, w, gs))
                if not args.no_block:
                    jids, jw = jnp.asarray(ids), jnp.asarray(weights, jnp.bfloat16)
                    if "compare" not in row["notes"]:
                        record("block gather", lambda: blk(xt, jids, jw, w, down, True))
                    record("block dispatch", lambda: blk(xt, jids, jw, w, down, False))
                tm = row["times_ms"]

                def c(name):
                    return f"{tm[name]:.3f}" if name in tm else "n/a"

                def r(num, den):
                    return f"{tm[num] / tm[den]:.2f}x" if num in tm and den in tm else "n/a"

                diff = row.get("rel_diff_gather_vs_two_step")
                print(f"{preset:10} {tokens:>6} {routing:8} | {c('gather'):>8} {c('two-step'):>8} {c('gemm'):>8} | "
                      f"{r('two-step', 'gather'):>8} {r('gather', 'gemm'):>7} "
                      f"{(f'{diff:.1e}' if diff is not None else 'n/a'):>8} | {c('block gather'):>8} "
                      f"{c('block dispatch'):>8} {r('block dispatch', 'block gather'):>6}", flush=True)
                others = [n for n in tm if n.startswith("gather ")]
                if others:
                    print("    other configs (ms): " + ", ".join(f"{n[7:]} {tm[n]:.3f}" for n in others), flush=True)
                for name, note in row["notes"].items():
                    print(f"    n/a {name}: {note}", flush=True)
                results["rows"].append(row)
                if args.out:
                    with open(args.out, "w") as f:
                        json.dump(results, f, indent=1)
    print(f"done in {time.perf_counter() - t_start:.0f} s (times in ms)")
    return results


COMMANDS = ("calls", "kernels", "fusion", "gather")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Without a subcommand, the arguments go to 'calls'.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("calls", help="whole calls: CUTLASS vs Mosaic vs torch vs dense")
    case_args(p, iters=20)
    p.add_argument("--no-mosaic-sweep", action="store_true", help="time only the default Mosaic config")
    p.add_argument("--no-mosaic", action="store_true", help="skip Mosaic altogether")
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="after this many seconds, skip the Mosaic sweep and the extra CUTLASS configs")
    p.add_argument("--out", default=None, help="JSON results path")
    p = sub.add_parser("kernels", help="the GEMM kernel alone under Nsight Compute: run (under ncu), then report")
    p.add_argument("step", choices=["run", "report"])
    p.add_argument("--plan", required=True, help="launch order, written by run, read by report")
    p.add_argument("--csv", help="report: ncu's --csv log")
    p.add_argument("--out", default=None, help="report: JSON results path")
    p = sub.add_parser("fusion", help="the fused SwiGLU epilogue, the routed-expert block and its parts")
    case_args(p, iters=10)
    p.add_argument("--no-block", action="store_true", help="skip the whole routed-expert block")
    p.add_argument("--breakdown", action="store_true", help="also time the block's parts alone")
    p.add_argument("--out", default=None, help="JSON results path")
    p = sub.add_parser("gather", help="the gate_up GEMM gathering the tokens itself vs gather + GEMM; the block")
    case_args(p, iters=10)
    p.add_argument("--no-block", action="store_true", help="skip the whole routed-expert block")
    p.add_argument("--half-tiles-rounds", type=int, default=0,
                   help="also time the fused kernel with the half-tile skip on and off in this many rounds each")
    p.add_argument("--out", default=None, help="JSON results path")
    return ap


def main(argv=None):
    """Runs one subcommand; returns what it wrote to --out (kernels run: None)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv.insert(0, "calls")
    ap = parser()
    args = ap.parse_args(argv)
    if args.command == "calls":
        return bench_calls(args)
    if args.command == "fusion":
        return bench_fusion(args)
    if args.command == "gather":
        return bench_gather(args)
    if args.step == "run":
        return kernels_run(args.plan)
    if not args.csv:
        ap.error("kernels report needs --csv (the ncu log)")
    out = kernels_report(args.plan, args.csv)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()

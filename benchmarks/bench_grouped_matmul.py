"""MoE grouped matmul on one GPU: the CUTLASS FFI kernel vs Mosaic (ragged_dot_mgpu), torch._grouped_mm and a dense
matmul of the same FLOPs, on the Qwen3.5-MoE expert shapes (issue 6).

    python3 benchmarks/bench_grouped_matmul.py --out results.json [--tokens 16384 4096] [--iters 20]

Times are medians of --iters samples after warm-up; each sample launches a batch of back-to-back calls (enough for
about 20 ms of GPU work) and waits once, so launch overhead does not hide short kernels. The same method times every
implementation, torch included. Inputs are shared with torch through DLPack (no copy). A missing implementation
(no library, no torch, a kernel that fails) is reported as 'n/a' with the reason, and the run goes on.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from jax_dwdp.config import ModelConfig
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
    """The MoE cases both grouped-matmul benchmarks sweep: presets x token counts x routings, samples per case."""
    ap.add_argument("--presets", nargs="+", default=["35b-a3b", "122b-a10b", "397b-a17b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[16384, 4096])
    ap.add_argument("--routing", nargs="+", default=["uniform", "skewed"])
    ap.add_argument("--iters", type=int, default=iters)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    case_args(ap, iters=20)
    ap.add_argument("--no-mosaic-sweep", action="store_true", help="time only the default Mosaic config")
    ap.add_argument("--no-mosaic", action="store_true", help="skip Mosaic altogether")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="after this many seconds, skip the Mosaic sweep and the extra CUTLASS configs")
    ap.add_argument("--out", default=None, help="JSON results path")
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    main()

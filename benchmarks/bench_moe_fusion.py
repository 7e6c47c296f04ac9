"""The fused SwiGLU epilogue on one GPU (issue 6): the gate_up projection + SiLU(gate) * up, fused vs unfused, and
the whole routed-expert block (permute, two grouped matmuls, un-permute) with each, next to torch.

    python3 benchmarks/bench_moe_fusion.py --out results.json [--presets 35b-a3b ...] [--tokens 16384 4096]

Per (model, tokens, routing), side by side in one process, medians of --iters samples of ~20 ms batches:
- gate_up stage: "fused" (CUTLASS, activation in the epilogue, [rows, I] written), "unfused" (the same CUTLASS
  GEMM writing [rows, 2I], then XLA's SiLU * up), "torch" (torch._grouped_mm, then F.silu(gate) * up, eager);
- MoE block: `routed_experts` with the interleaved weights and the fused kernel vs the Hugging Face layout and the
  unfused path, same routing, same inputs.
Also the relative error of fused vs unfused outputs (they differ by the bf16 rounding of gate and up before the
activation, which the fused kernel skips).

--breakdown also times the block's parts alone:
- the sort by expert;
- the inverse permutation: a second argsort (before) vs the scatter of iota `routed_experts` now uses;
- the row gather: plain bf16 elements, with promise_in_bounds, and as 32-bit words (what `routed_experts` uses);
- the down projection, and the un-permute (gather, routing-weight scale, top-k sum).
(Candidates measured and dropped, benchmarks/RESULTS.md, fifth session: a keys-only sort of packed keys, a 32-bit
un-permute gather, and the gather inside the GEMM's A loads.)
"""

from __future__ import annotations

import argparse
import importlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench_grouped_matmul import case_args, group_sizes, reason, timed, torch_timed  # noqa: E402 (same folder)
from jax_dwdp.config import ModelConfig
from jax_dwdp.kernels.grouped_matmul import gather_rows
from jax_dwdp.model.moe import routed_experts, sort_by_expert

gm = importlib.import_module("jax_dwdp.kernels.grouped_matmul")


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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    case_args(ap, iters=10)
    ap.add_argument("--no-block", action="store_true", help="skip the whole routed-expert block")
    ap.add_argument("--breakdown", action="store_true", help="also time the block's parts alone")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
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

    print(f"{torch_note}; cutlass fused configs {_cutlass.swiglu_config_names()}", flush=True)
    results = dict(device=dev.device_kind, jax=jax.__version__, torch=torch_note, rows=[])
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


if __name__ == "__main__":
    main()

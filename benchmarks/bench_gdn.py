"""Gated DeltaNet prefill core on one GPU: jax_dwdp's Pallas kernels vs flash-linear-attention, side by side.

Both run in this process on identical inputs (bf16 q, k, v; fp32 g, beta; l2 norm of q and k inside the kernels;
the final state returned). fla's `chunk_gated_delta_rule` takes the key heads as they are (its grouped-value
layout, HV > HK, is its native one) and packs the variable-length batch with `cu_seqlens`; jax_dwdp runs the same
sequences as a right-padded batch with lengths. Times are the wall time of 10 back-to-back calls divided by 10
(median of 5), for both frameworks, so launch overheads count the same way; fla's own `do_bench` figure (CUDA
events, L2 flushed) is printed beside it.

    python benchmarks/bench_gdn.py --out results/gdn.json [--variants] [--mixer]

--variants times the kernels' variants (Tuning: triangular inverse, state layout, block and warps) at 16K tokens
first, with each kernel alone, and uses the fastest per head layout;
--mixer times the parts of a whole Gated DeltaNet mixer (35b-a3b) at 16K, to decide which fusions around the core
would pay.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jax_dwdp.timing import wall_ms  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--heads", nargs="+", default=["16/32", "16/64"], help="key/value heads")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--mixer", action="store_true")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-xla", action="store_true", help="skip timing the XLA reference path")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tuning", nargs="+", default=[""], metavar="KWARGS",
                    help="one or more Tuning keyword lists, e.g. \"fused_output=True\" (\"\" = the default); each "
                         "runs the whole table")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from jax_dwdp.kernels import gdn_pallas
    from jax_dwdp.kernels.gated_delta_rule import chunk_gated_delta_rule
    from tests.gdn_cases import gdn_inputs, rel_err

    torch = fla = None
    if not args.no_fla:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla

    dk = dv = 128
    rng = np.random.default_rng(0)
    jsync = jax.block_until_ready
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": [], "variants": [], "mixer": {}}

    def to_torch(x):
        return torch.from_dlpack(x) if x is not None else None

    def run_fla(q, k, v, g, beta, cu=None):
        return fla(q, k, v, g, beta, scale=dk**-0.5, output_final_state=True, use_qk_l2norm_in_kernel=True,
                   cu_seqlens=cu)

    def tsync(out):
        torch.cuda.synchronize()

    def stages(q, k, v, g, beta, lengths, hk, hv, tuning) -> dict:
        """The three kernels timed alone (inputs prepared once)."""
        qp, kp, vp, gp, bp, lp = gdn_pallas.pad_inputs(q, k, v, g, beta, lengths)
        rep = hv // hk
        if tuning.fused_output:  # two kernels: prep (with the scores) and the recurrence that writes the output
            prep = jax.jit(lambda *a: gdn_pallas.prepare(*a, rep=rep, tuning=tuning))
            w, u, kg, cum, scores, qs = prep(lp, kp, vp, gp, bp, qp)
            rec = jax.jit(lambda *a: gdn_pallas.fused_recurrence(*a, rep=rep, tuning=tuning))
            return {"prep_ms": wall_ms(lambda: prep(lp, kp, vp, gp, bp, qp), jsync),
                    "recurrence_ms": wall_ms(lambda: rec(lp, qp, qs, scores, w, u, kg, cum), jsync),
                    "output_ms": 0.0}
        prep = jax.jit(lambda *a: gdn_pallas.prepare(*a, rep=rep, tuning=tuning))
        w, u, kg, cum = prep(lp, kp, vp, gp, bp)
        rec = jax.jit(lambda *a: gdn_pallas.recurrence(*a, tuning=tuning))
        states, v_new, _ = rec(lp, w, u, kg, cum)
        outk = jax.jit(lambda *a: gdn_pallas.output(*a, rep=rep, tuning=tuning))
        return {"prep_ms": wall_ms(lambda: prep(lp, kp, vp, gp, bp), jsync),
                "recurrence_ms": wall_ms(lambda: rec(lp, w, u, kg, cum), jsync),
                "output_ms": wall_ms(lambda: outk(lp, qp, kp, cum, states, v_new),
                                     jsync)}

    chosen = [eval(f"gdn_pallas.Tuning({kw})") for kw in args.tuning]  # noqa: S307 (a command-line benchmark)
    tunings = {heads: chosen[0] for heads in args.heads}
    for heads in args.heads[:1] if args.variants else []:  # the fastest variant of the first layout serves all
        hk, hv = map(int, heads.split("/"))
        t = 16384
        q, k, v, g, beta, _ = gdn_inputs(rng, 1, t, hk, hv, dk, dv, initial=False)
        lengths = jnp.array([t], jnp.int32)
        ref_o, ref_s = jax.jit(lambda *a: chunk_gated_delta_rule(*a, implementation="xla"))(q, k, v, g, beta)
        best = None
        # Variants of the prep kernel, which took half the core's time (the recurrence is settled: block_v by
        # _block_v, 4 warps, 3 stages, the state not transposed; H200, 2026-11-30): the 64-wide prep on 4 warps with
        # the inverse's products in TF32, with bf16 operands ("bf16") or bf16 for the merge only ("mixed"), each with
        # the output by a third kernel or fused into the recurrence (fused_output; its recurrence capped at 64 state
        # columns). The defaults and their numbers: gdn_pallas.Tuning.
        cases = [("wide", 4, precision, fused, 4) for fused in (False, True) for precision in ("tf32", "bf16", "mixed")]
        for inverse, w1, precision, fused, w2 in cases:
            tuning = gdn_pallas.Tuning(num_warps=(w1, w2, 4), inverse=inverse, merge_precision=precision,
                                       fused_output=fused)
            try:
                kernel = jax.jit(lambda *a, tuning=tuning: gdn_pallas.chunk_gated_delta_rule_pallas(*a, tuning=tuning))
                ms = wall_ms(lambda: kernel(q, k, v, g, beta, lengths), jsync)
                o, s = kernel(q, k, v, g, beta, lengths)
                errors = {"output_rel_err": rel_err(o.astype(jnp.float32), ref_o.astype(jnp.float32)),
                          "state_rel_err": rel_err(s, ref_s)}
                parts = stages(q, k, v, g, beta, lengths, hk, hv, tuning)
                row = {"heads": heads, "tuning": str(tuning), "ms": ms, **errors, **parts}
            except Exception as e:  # a variant Triton cannot compile is skipped, and said so
                print(f"variant {heads} {tuning}: failed ({type(e).__name__}: {str(e)[:300]})", flush=True)
                continue
            results["variants"].append(row)
            print(f"variant {json.dumps(row)}", flush=True)
            if errors["output_rel_err"] <= 1e-2 and errors["state_rel_err"] <= 1e-2 and (best is None or ms < best[0]):
                best = (ms, tuning)
        tunings = {h: best[1] for h in args.heads}
        print(f"best {heads}: {best[1]} {best[0]:.3f} ms", flush=True)

    for heads, tuning in [(h, t) for t in (chosen if len(chosen) > 1 else [None]) for h in args.heads]:
        hk, hv = map(int, heads.split("/"))
        tuning = tuning or tunings[heads]
        for t in args.seq_lens:
            q, k, v, g, beta, _ = gdn_inputs(rng, 1, t, hk, hv, dk, dv, initial=False)
            lengths = jnp.array([t], jnp.int32)
            row = {"heads": heads, "tokens": t, "batch": 1, "tuning": str(tuning)}
            kernel = jax.jit(lambda *a: gdn_pallas.chunk_gated_delta_rule_pallas(*a, tuning=tuning))
            row["pallas_ms"] = wall_ms(lambda: kernel(q, k, v, g, beta, lengths), jsync)
            row.update(stages(q, k, v, g, beta, lengths, hk, hv, tuning))
            if t <= 16384 and not args.no_xla:  # the XLA reference path (the old default): the before/after ratio
                xla = jax.jit(lambda *a: chunk_gated_delta_rule(*a, implementation="xla"))
                row["xla_ms"] = wall_ms(lambda: xla(q, k, v, g, beta), jsync, calls=3, reps=3)
            o, s = kernel(q, k, v, g, beta, lengths)
            if fla is not None:
                tq, tk, tv, tg, tb = (to_torch(x) for x in (q, k, v, g, beta))
                row["fla_ms"] = wall_ms(lambda: run_fla(tq, tk, tv, tg, tb), tsync)
                from triton.testing import do_bench

                row["fla_do_bench_ms"] = do_bench(lambda: run_fla(tq, tk, tv, tg, tb), return_mode="median")
                fo, fs = run_fla(tq, tk, tv, tg, tb)
                row["vs_fla_output_rel_diff"] = rel_err(np.asarray(o.astype(jnp.float32)),
                                                        fo.float().cpu().numpy())
                row["vs_fla_state_rel_diff"] = rel_err(np.asarray(s), fs.float().cpu().numpy())
                row["speedup_vs_fla"] = row["fla_ms"] / row["pallas_ms"]
                del tq, tk, tv, tg, tb, fo, fs
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
            del q, k, v, g, beta, o, s

        # Variable lengths: 4 sequences of 1K-8K tokens (fixed seed).
        lens = np.random.default_rng(7).integers(1024, 8193, 4).astype(np.int32)
        tmax, total = int(lens.max()), int(lens.sum())
        q, k, v, g, beta, _ = gdn_inputs(rng, 4, tmax, hk, hv, dk, dv, initial=False)
        lengths = jnp.asarray(lens)
        kernel = jax.jit(lambda *a: gdn_pallas.chunk_gated_delta_rule_pallas(*a, tuning=tuning))
        row = {"heads": heads, "tokens": total, "batch": 4, "lengths": lens.tolist(), "tuning": str(tuning),
               "pallas_ms": wall_ms(lambda: kernel(q, k, v, g, beta, lengths), jsync)}
        if fla is not None:
            packed = [jnp.concatenate([x[i, : lens[i]] for i in range(4)])[None] for x in (q, k, v, g, beta)]
            tq, tk, tv, tg, tb = (to_torch(x) for x in packed)
            cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.long, device=tq.device)
            row["fla_ms"] = wall_ms(lambda: run_fla(tq, tk, tv, tg, tb, cu), tsync)
            row["speedup_vs_fla"] = row["fla_ms"] / row["pallas_ms"]
        # The recurrence's state columns per program: _block_v counts every sequence of the batch, so a batch of 4
        # gets all 128 columns in one program, and the longest sequence's 32 programs set the time. Smaller
        # blocks give the longest sequence more programs: these rows time 32 and 64 columns per program.
        for bv in (32, 64):
            variant = dataclasses.replace(tuning, block_v=bv)
            fn = jax.jit(lambda *a, variant=variant: gdn_pallas.chunk_gated_delta_rule_pallas(*a, tuning=variant))
            row[f"pallas_block_v{bv}_ms"] = wall_ms(lambda: fn(q, k, v, g, beta, lengths), jsync)
        results["rows"].append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, g, beta

    if args.mixer:
        results["mixer"] = mixer_parts(jsync, rng)
        print(json.dumps(results["mixer"]), flush=True)

    print("\n| heads | tokens | batch | pallas ms | fla ms | vs fla | xla ms | prep | recurrence | output | tuning |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results["rows"]:
        f = lambda key: f"{r[key]:.3f}" if key in r else "-"  # noqa: E731
        ratio = f"{r['speedup_vs_fla']:.2f}x" if "speedup_vs_fla" in r else "-"
        print(f"| {r['heads']} | {r['tokens']} | {r['batch']} | {f('pallas_ms')} | {f('fla_ms')} | {ratio} | "
              f"{f('xla_ms')} | {f('prep_ms')} | {f('recurrence_ms')} | {f('output_ms')} | "
              f"{r['tuning'].replace('Tuning', '').replace('num_stages=(2, 3, 2), ', '')} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


def mixer_parts(jsync, rng, t: int = 16384) -> dict:
    """The Gated DeltaNet mixer of 35b-a3b at t tokens, and its parts each jitted alone (ms)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_dwdp import kernels
    from jax_dwdp.config import ModelConfig
    from jax_dwdp.kernels.conv import causal_conv_silu
    from jax_dwdp.model.gated_deltanet import GatedDeltaNet

    cfg = ModelConfig.preset("35b-a3b")
    mixer = GatedDeltaNet(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((1, t, cfg.hidden_size)) * 0.5, jnp.bfloat16)
    lengths = jnp.array([t], jnp.int32)
    graph, state = nnx.split(mixer)

    def call(method):
        return jax.jit(lambda s, *a: method(nnx.merge(graph, s), *a))

    whole = call(lambda m, x, n: m(x, n))
    proj = call(lambda m, x: m.in_proj_qkv(x))
    conv = call(lambda m, mixed: causal_conv_silu(mixed, m.conv1d.weight[...]))
    gates = call(lambda m, x: m._gates(x))
    core = jax.jit(lambda q, k, v, g, b, n: kernels.chunk_gated_delta_rule(q, k, v, g, b, lengths=n))
    out = call(lambda m, core, x: m._output(core, x))
    z_proj = call(lambda m, x: m.in_proj_z(x).reshape(1, t, m.num_v_heads, m.head_v_dim))
    norm = call(lambda m, core, z: m.norm(core, z))
    mixed = proj(state, x)
    conv_out = conv(state, mixed)
    q, k, v = mixer._split_heads(conv_out)
    g, beta = gates(state, x)
    o, _ = core(q, k, v, g, beta, lengths)
    z = z_proj(state, x)
    parts = {
        "tokens": t,
        "mixer_ms": wall_ms(lambda: whole(state, x, lengths), jsync),
        "in_proj_qkv_ms": wall_ms(lambda: proj(state, x), jsync),
        "conv_silu_ms": wall_ms(lambda: conv(state, mixed), jsync),
        "gates_ms": wall_ms(lambda: gates(state, x), jsync),
        "core_ms": wall_ms(lambda: core(q, k, v, g, beta, lengths), jsync),
        "z_norm_out_proj_ms": wall_ms(lambda: out(state, o, x), jsync),
        "gated_norm_ms": wall_ms(lambda: norm(state, o, z), jsync),
    }
    return parts


if __name__ == "__main__":
    main()

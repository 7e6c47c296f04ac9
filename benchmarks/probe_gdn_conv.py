"""The gated delta rule with the causal conv inside its prep kernel against the separate conv kernel + the same
gated delta rule, at 35b-a3b's head shapes, bf16, one sequence: the whole (conv + core) and the prep kernel alone,
over the conv prep kernel's warps x pipeline stages. Its H200 numbers (2026-12-01: conv + core 1.87 vs 1.23 ms at
16K): benchmarks/RESULTS.md, "Variants measured slower".

    python3 benchmarks/probe_gdn_conv.py --tokens 4096 16384 [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIGS = ((8, 2), (8, 1), (4, 2), (4, 1), (2, 1))  # the conv prep kernel's (warps, stages); (8, 2): the default


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--heads", type=int, nargs=2, default=[16, 32])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench_gdn import wall_ms
    from jax_dwdp.kernels import conv
    from jax_dwdp.kernels import gdn_pallas as gp

    (hk, hv), dk, dv = args.heads, 128, 128
    rows = []

    def record(t, name, fn):
        ms = wall_ms(fn, jax.block_until_ready)
        rows.append({"tokens": t, "part": name, "ms": ms})
        print(f"  {name:<52} {ms:8.3f} ms", flush=True)

    rng = np.random.default_rng(0)
    for t in args.tokens:
        print(f"tokens {t}:", flush=True)
        c = 2 * hk * dk + hv * dv
        mixed = jnp.asarray(rng.standard_normal((1, t, c)), jnp.bfloat16)
        weight = jnp.asarray(rng.standard_normal((c, 1, 4)) * 0.5, jnp.bfloat16)
        g = jnp.asarray(-rng.uniform(0.01, 0.5, (1, t, hv)), jnp.float32)
        beta = jnp.asarray(rng.uniform(0.1, 0.9, (1, t, hv)), jnp.float32)
        n = jnp.array([t], jnp.int32)
        splits = (hk * dk, 2 * hk * dk)

        @jax.jit
        def separate(mixed, weight, g, beta, n):
            q, k, v = (conv.causal_conv_silu_pallas(mixed, weight, channels=r)
                       for r in zip((0, *splits), (*splits, c)))
            return gp.chunk_gated_delta_rule_pallas(q.reshape(1, t, hk, dk), k.reshape(1, t, hk, dk),
                                                    v.reshape(1, t, hv, dv), g, beta, n)

        record(t, "separate: split conv kernel + gated delta rule", lambda: separate(mixed, weight, g, beta, n))
        q, k, v = (x.reshape(1, t, -1, d) for x, d in zip(jnp.split(conv.causal_conv_silu_xla(mixed, weight),
                                                                      splits, axis=-1), (dk, dk, dv)))
        gg, bb, nn = gp._pad_gates(g, beta, n)
        prep = jax.jit(lambda q, k, v: gp.prepare(nn, k, v, gg, bb, q, rep=hv // hk))
        record(t, "separate: prep kernel alone", lambda: prep(q, k, v))
        for warps, stages in CONFIGS:
            tuning = gp.Tuning(conv_prep_warps=warps, num_stages=(stages, 3, 2))
            whole = jax.jit(functools.partial(gp.chunk_gated_delta_rule_conv_pallas, heads=(hk, hv),
                                              head_dims=(dk, dv), tuning=tuning))
            try:
                record(t, f"conv in prep, {warps} warps {stages} stages", lambda: whole(mixed, weight, g, beta, n))
                cprep = jax.jit(lambda m, w: gp.prepare_conv(nn, m, w, gg, bb, heads=(hk, hv), head_dims=(dk, dv),
                                                             tuning=tuning))
                record(t, f"conv prep kernel alone, {warps} warps {stages} stages", lambda: cprep(mixed, weight))
            except Exception as ex:  # a configuration Triton cannot compile: say so, go on
                print(f"  {warps} warps {stages} stages failed: {type(ex).__name__}: {str(ex)[:200]}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()

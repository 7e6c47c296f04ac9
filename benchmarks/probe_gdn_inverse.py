"""The Gated DeltaNet chunk's unit lower-triangular solve, two ways, side by side on identical shapes: what
`chunk_gated_delta_rule_xla` does (`unit_lower_inverse`: log2(C) levels of batched matmuls, then one matmul with the
right-hand side) against `lax.linalg.triangular_solve` (LAPACK's trsm on the CPU, cuBLAS's on the GPU), which it
replaced because the CPU's trsm deadlocks XLA's intra-op pool when every host device runs it at once.

    python benchmarks/probe_gdn_inverse.py [--seq-lens 4096 16384] [--heads 32] [--out FILE.json]

Prints one row per shape: milliseconds of each (median of --iters) and their ratio, and the largest difference
between the two solutions relative to their size (fp32).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_dwdp.kernels.gated_delta_rule import unit_lower_inverse
from jax_dwdp.timing import median_seconds

HI = jax.lax.Precision.HIGHEST


@jax.jit
def by_inverse(lower, rhs):
    return jnp.einsum("...ij,...jd->...id", unit_lower_inverse(lower), rhs, precision=HI)


@jax.jit
def by_trsm(lower, rhs):
    system = lower + jnp.eye(lower.shape[-1], dtype=lower.dtype)
    return jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--heads", type=int, default=32, help="value heads")
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--width", type=int, default=256, help="right-hand side columns (dv + dk)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    print(f"{jax.devices()[0].device_kind}: [1, {args.heads}, T/{args.chunk}, {args.chunk}, {args.chunk}] systems, "
          f"{args.width} right-hand columns, fp32")
    print("| tokens | inverse (ms) | trsm (ms) | trsm / inverse | max rel diff |")
    print("|---|---|---|---|---|")
    for t in args.seq_lens:
        shape = (1, args.heads, t // args.chunk, args.chunk)
        # As in the chunk: |entries| <= 1 (unit keys, beta and decays in (0, 1]).
        lower = jnp.asarray(np.tril(rng.uniform(-1, 1, (*shape, args.chunk)), -1) * 0.5, jnp.float32)
        rhs = jnp.asarray(rng.standard_normal((*shape, args.width)), jnp.float32)
        a, b = by_inverse(lower, rhs), by_trsm(lower, rhs)
        diff = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        inv_s, _ = median_seconds(lambda: by_inverse(lower, rhs), args.iters)
        trsm_s, _ = median_seconds(lambda: by_trsm(lower, rhs), args.iters)
        row = dict(tokens=t, inverse_ms=round(inv_s * 1e3, 3), trsm_ms=round(trsm_s * 1e3, 3),
                   trsm_over_inverse=round(trsm_s / inv_s, 2), max_rel_diff=diff)
        rows.append(row)
        print(f"| {t} | {row['inverse_ms']} | {row['trsm_ms']} | {row['trsm_over_inverse']} | {diff:.1e} |")
    if args.out:
        args.out.write_text(json.dumps({"device": jax.devices()[0].device_kind, "args": vars(args) | {"out": str(args.out)},
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()

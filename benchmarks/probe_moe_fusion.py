"""Probe: the MoE block's XLA fusions at 4K/16K tokens with the Pallas dispatch (the 4K 'loop_add_fusion' a trace
found on an H200 on 2026-12-01: 1.22 ms a layer at 4K, 0.17 at 16K). Times the block with one change each, and writes
the optimized HLO of the default block so the slow fusion's body can be read. The fix (the inverse permutation
materialised in routing.expert_permutation_pallas) is in the default block, so the 4K default is the fixed block.

    python benchmarks/probe_moe_fusion.py --tokens 4096 16384 --out-dir DIR
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gdn import wall_ms  # noqa: E402
from bench_layer_parts import _patched  # noqa: E402
from jax_dwdp.config import ModelConfig  # noqa: E402
from jax_dwdp.model import init_model, with_kernels  # noqa: E402
from jax_dwdp.model import moe as moe_mod  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--out-dir", default="/tmp/probe")
    ap.add_argument("--preset", default="35b-a3b")
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    cfg = ModelConfig.preset(args.preset)
    cfg = cfg.replace(num_hidden_layers=cfg.full_attention_interval)
    model = init_model(cfg, dtype=jnp.bfloat16, seed=0)
    layer = next(lay for lay in model.layers if lay.layer_type == "linear_attention")
    comb = moe_mod.combine_rows
    barrier_combine = lambda y, i, w, add=None: comb(*lax.optimization_barrier((y, i, w, add)))  # noqa: E731
    # name -> (KernelChoices changes, a context around the trace)
    variants = {
        "default": ({}, contextlib.nullcontext),
        "barrier before combine": ({}, lambda: _patched(moe_mod, combine_rows=barrier_combine)),
        "XLA dispatch": ({"dispatch": "xla"}, contextlib.nullcontext),
    }
    rng = np.random.default_rng(0)
    print(f"{'variant':<26}" + "".join(f"{t:>10}" for t in args.tokens), flush=True)
    results = {}
    for name, (changes, ctx) in variants.items():
        graph, state = nnx.split(with_kernels(layer.mlp, model.kernels.replace(**changes)))
        row = []
        for t in args.tokens:
            x = jnp.asarray(rng.standard_normal((1, t, cfg.hidden_size)) * 0.5, jnp.bfloat16)
            with ctx():
                fn = jax.jit(lambda s, x: nnx.merge(graph, s)(x))
                compiled = fn.lower(state, x).compile()
                if name == "default":
                    text = compiled.as_text()
                    Path(args.out_dir, f"moe_{t}.hlo.txt").write_text(text)
                ms = wall_ms(lambda: compiled(state, x), jax.block_until_ready)
            row.append(ms)
            results.setdefault(name, {})[t] = ms
        print(f"{name:<26}" + "".join(f"{ms:>10.3f}" for ms in row), flush=True)
    return results


if __name__ == "__main__":
    main()

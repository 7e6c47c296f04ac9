"""Probe: the kernels of one decoder layer (linear-attention and full-attention) on the GPU, by name, with what each
XLA fusion computes. For each layer type and token count: one jit-compiled layer call traced with jax.profiler,
its kernels summed by name (per call), and for every XLA fusion among them the ops of its computation (from the
optimized HLO, also written to OUT_DIR), so that a costly fusion can be named ("the conv", "a transpose of q").

    python benchmarks/probe_layer_kernels.py --tokens 16384 --out-dir DIR [--preset 35b-a3b] [--calls 5]
        [--parts linear_attention full_attention moe]

Each row also gives the span of the traced calls per call (first kernel's start to last kernel's end over the calls
run back to back, divided by their count): the span less the kernels is the time the GPU stood idle between them.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def fusion_ops(hlo: str) -> dict[str, str]:
    """{fusion instruction name: 'its computation's op counts, root op and output shape'} of an optimized HLO
    module's text."""
    computations: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        head = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$", line)
        if head:
            current = head.group(1)
            computations[current] = []
        elif line.strip() == "}":
            current = None
        elif current is not None:
            computations[current].append(line)
    out = {}
    for lines in computations.values():
        for line in lines:
            m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+fusion\(.*calls=%?([\w.\-]+)", line)
            if not m:
                continue
            name, shape, called = m.groups()
            body = computations.get(called, [])
            ops = collections.Counter()
            root = ""
            for b in body:
                op = re.match(r"^\s*(ROOT\s+)?%?[\w.\-]+\s*=\s*(?:\(.*?\)|\S+)\s+([\w\-]+)\(", b)
                if op:
                    ops[op.group(2)] += 1
                    if op.group(1):
                        root = op.group(2)
            common = ", ".join(f"{k} x{v}" for k, v in ops.most_common(8) if k != "parameter")
            out[name] = f"-> {shape}; root {root}; {common}"
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="35b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--parts", nargs="+", default=["linear_attention", "full_attention"],
                    choices=["linear_attention", "full_attention", "moe"],
                    help="what to trace: a whole layer of either kind, or the MoE block alone (the linear layer's)")
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/probe_layers"))
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jax_dwdp.config import ModelConfig
    from jax_dwdp.model import init_model
    from trace_summary import load, summarize

    args.out_dir.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.preset(args.preset)
    cfg = cfg.replace(num_hidden_layers=cfg.full_attention_interval)
    model = init_model(cfg, dtype=jnp.bfloat16, seed=0)
    layers = {kind: next(layer for layer in model.layers if layer.layer_type == kind)
              for kind in ("linear_attention", "full_attention")}
    layers["moe"] = layers["linear_attention"].mlp
    layers = {kind: layers[kind] for kind in args.parts}
    rng = np.random.default_rng(0)
    report = {"device": jax.devices()[0].device_kind, "preset": args.preset, "rows": []}
    for t in args.tokens:
        x = jnp.asarray(rng.standard_normal((1, t, cfg.hidden_size)) * 0.5, jnp.bfloat16)
        lengths = jnp.array([t], jnp.int32)
        positions = jnp.arange(t, dtype=jnp.int32)[None]
        for kind, layer in layers.items():
            graph, state = nnx.split(layer)
            if kind == "moe":  # the block alone, on [T, H] tokens
                fn = jax.jit(lambda s, x, p, n, graph=graph: nnx.merge(graph, s)(x[0]))
            else:
                fn = jax.jit(lambda s, x, p, n, graph=graph: nnx.merge(graph, s)(x, p, n))
            compiled = fn.lower(state, x, positions, lengths).compile()
            hlo = compiled.as_text()
            (args.out_dir / f"{kind}_{t}.hlo.txt").write_text(hlo)
            ops = fusion_ops(hlo)
            jax.block_until_ready(compiled(state, x, positions, lengths))
            with tempfile.TemporaryDirectory() as trace_dir:
                with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                    for _ in range(args.calls):
                        out = compiled(state, x, positions, lengths)
                    jax.block_until_ready(out)
                summary = summarize(load(trace_dir), top=40)
            print(f"\n{kind}, {t} tokens: {summary['total_ms'] / args.calls:.3f} ms of kernels per call over a "
                  f"span of {summary['span_ms'] / args.calls:.3f} ms per call (the {args.calls} calls back to back) "
                  f"({'device' if summary['device'] else 'HOST'} events)")
            kernels = []
            for name, calls, ms in summary["kernels"]:
                per = ms / args.calls
                if per < 0.004:
                    continue
                what = ops.get(name) or ops.get(re.sub(r"_(\d+)$", r".\1", name), "")  # (the trace's "fusion_54")
                kernels.append({"name": name, "calls": calls // args.calls, "ms": round(per, 4), "ops": what})
                print(f"  {per:8.4f} ms  x{calls // args.calls:<2} {name[:60]:<60} {what[:150]}")
            report["rows"].append({"layer": kind, "tokens": t, "kernel_ms": summary["total_ms"] / args.calls,
                                   "span_ms": summary["span_ms"] / args.calls, "kernels": kernels})
    (args.out_dir / "kernels.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

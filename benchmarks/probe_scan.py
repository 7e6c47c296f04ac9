"""Probe: what the scanned layer stack's program (jax_dwdp.scan) allocates beyond the weights, and where.

    python benchmarks/probe_scan.py --preset 35b-a3b --num-layers 8 --tokens 16384 --out-dir DIR [--time]

Compiles `jit_prefill_scanned` for one length and prints the compiled program's memory analysis (arguments,
outputs, temporaries) and the largest instructions of its entry computation (outside the scan's loop body) by
output size, with their operands: a copy of a stacked weight there (a layout change of the whole stack that XLA
placed before the loop) shows up as an entry instruction the size of a stacked weight. The optimized HLO goes to
DIR/scan_<tokens>.hlo.txt. With --time, the scanned prefill and the layer-wise one are timed in turn (median of 5).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_SIZES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string such as 'bf16[10,256,1024,2048]{3,2,1,0}' or a tuple of them."""
    total = 0
    for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", shape):
        if dtype in _SIZES:
            total += _SIZES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


def entry_instructions(hlo: str) -> list[tuple[int, str, str, str]]:
    """[(bytes, name, op, the line)] of the ENTRY computation's instructions, largest first."""
    rows, inside = [], False
    for line in hlo.splitlines():
        if line.startswith("ENTRY"):
            inside = True
            continue
        if inside and line.strip() == "}":
            break
        if inside:
            m = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\(", line)
            if m:
                name, shape, op = m.groups()
                rows.append((shape_bytes(shape), name, op, line.strip()))
    return sorted(rows, key=lambda r: -r[0])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="35b-a3b")
    ap.add_argument("--num-layers", type=int)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out-dir", default=".")
    ap.add_argument("--time", action="store_true", help="also time the scanned and the layer-wise prefill")
    ap.add_argument("--run", action="store_true",
                    help="run the scanned prefill once and report whether it ran (an out-of-memory error is caught)")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jax_dwdp.config import ModelConfig
    from jax_dwdp.model import init_model
    from jax_dwdp.prefill import jit_prefill
    from jax_dwdp.scan import ScannedModel, jit_prefill_scanned
    from jax_dwdp.timing import median_seconds

    cfg = ModelConfig.preset(args.preset)
    if args.num_layers:
        cfg = cfg.replace(num_hidden_layers=args.num_layers)
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.tokens)).astype(np.int32)
    lengths = np.full((1,), args.tokens, np.int32)
    model = init_model(cfg, dtype=jnp.dtype(args.dtype))
    result: dict = dict(preset=args.preset, layers=cfg.num_hidden_layers, tokens=args.tokens)
    if args.time:
        layerwise = jit_prefill(model, logits="last", layerwise=True)
        layerwise.compile(tokens, lengths)
        result["layerwise_ms"] = round(median_seconds(lambda: layerwise(tokens, lengths), 5)[0] * 1e3, 2)
        del layerwise
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx_state(model)))
    scanned = ScannedModel.from_model(model)
    del model
    stats = jax.devices()[0].memory_stats() or {}
    result["after_restack_gib"] = {k: round(stats[k] / 2**30, 3) for k in ("bytes_in_use", "peak_bytes_in_use",
                                                                         "bytes_limit") if k in stats}
    exe = jit_prefill_scanned(scanned, logits="last").compile(tokens, lengths)
    mem = exe.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
              "generated_code_size_in_bytes")
    result["memory_gib"] = {f.replace("_size_in_bytes", ""): round(getattr(mem, f, 0) / 2**30, 3) for f in fields
                            if mem is not None}
    result["weights_gib"] = round(weights / 2**30, 3)
    hlo = exe.as_text()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"scan_{args.tokens}.hlo.txt").write_text(hlo)
    big = [r for r in entry_instructions(hlo) if r[2] not in ("parameter", "get-tuple-element", "tuple", "bitcast")]
    result["largest_entry_instructions"] = [dict(gib=round(b / 2**30, 3), name=n, op=op, line=line[:400])
                                            for b, n, op, line in big[:args.top]]
    print(f"{args.preset}, {cfg.num_hidden_layers} layers, {args.tokens} tokens: weights {result['weights_gib']} GiB;"
          f" compiled program {result['memory_gib']}")
    for r in result["largest_entry_instructions"]:
        print(f"  {r['gib']:>8.3f} GiB  {r['op']:<14} {r['line'][:300]}")
    if args.run and not args.time:
        try:
            jax.block_until_ready(jit_prefill_scanned(scanned, logits="last")(tokens, lengths))
            result["ran"] = "ok"
        except jax.errors.JaxRuntimeError as e:
            result["ran"] = str(e).splitlines()[0][:300]
        stats = jax.devices()[0].memory_stats() or {}
        result["peak_gib"] = round(stats.get("peak_bytes_in_use", 0) / 2**30, 3)
        print(f"  after restacking {result['after_restack_gib']}; one run: {result['ran']}; peak {result['peak_gib']} GiB")
    if args.time:
        prefill = jit_prefill_scanned(scanned, logits="last")
        result["scan_ms"] = round(median_seconds(lambda: prefill(tokens, lengths), 5)[0] * 1e3, 2)
        print(f"  layer-wise {result['layerwise_ms']} ms, scanned {result['scan_ms']} ms")
    (out / "scan.json").write_text(json.dumps(result, indent=1))
    return result


def nnx_state(model):
    from flax import nnx

    return nnx.state(model)


if __name__ == "__main__":
    main()

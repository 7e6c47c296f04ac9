"""jax_dwdp's prefill (bench_prefill.py's JSON) beside transformers' (bench_transformers.py's) on the same lengths:
one line per length with each side's ms and MFU, and the ratio transformers ms / jax_dwdp ms (> 1: jax_dwdp faster).
A missing file or a length that one side did not finish is shown as such, not left out.

    python3 benchmarks/gpu/prefill_ratio.py prefill.json transformers.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def read(path: str) -> dict:
    """The JSON's rows by length ({} when the file is missing or not JSON: that run did not get as far)."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {r["seq_len"]: r for r in rows}


def cell(row: dict | None, width: int) -> str:
    """ms and MFU in width + 7 characters; "-" for a length not run, the start of the error for one that failed."""
    if row is None:
        return f"{'-':>{width}} {'':>6}"
    if "error" in row:
        return f"{row['error'][:width + 7]:>{width + 7}}"
    return f"{row['prefill_ms']:>{width}.1f} {row['mfu']:>6.1%}"


def mismatch(a: dict, b: dict) -> str:
    """Why two rows of one length are not the same prefill ("" when they are): another preset, depth or batch (a
    stale file of another run), or logits that are not finite on either side."""
    for key in ("preset", "layers", "batch"):
        if a.get(key) != b.get(key):
            return f"{key} {a.get(key)} vs {b.get(key)}"
    if not (a.get("logits_finite") and b.get("logits_finite")):
        return "logits not finite"
    return ""


def lines(ours: dict, theirs: dict) -> list[str]:
    out = [f"{'tokens':>8} {'jax_dwdp ms':>11} {'MFU':>6} {'transformers ms':>15} {'MFU':>6} {'ratio':>7}"]
    for t in sorted(set(ours) | set(theirs)):
        a, b = ours.get(t), theirs.get(t)
        why = mismatch(a, b) if a and b and "error" not in a and "error" not in b else None
        ratio = f"{b['prefill_ms'] / a['prefill_ms']:>6.2f}x" if why == "" else f"{'-':>7}"
        out.append(f"{t:>8} {cell(a, 11)} {cell(b, 15)} {ratio}" + (f"  (no ratio: {why})" if why else ""))
    dense = [f"{t} tokens {r['mfu_dense']:.1%}" for t, r in sorted(ours.items()) if "mfu_dense" in r]
    if dense:
        out.append(f"jax_dwdp's MFU against the dense matmul rate measured in its run: {', '.join(dense)}")
    mamba = {r.get("mamba_path") for r in theirs.values()} - {None}
    if mamba:
        out.append(f"transformers' Mamba-2 path: {', '.join(sorted(mamba))}")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} BENCH_PREFILL.json BENCH_TRANSFORMERS.json")
    print("\n".join(lines(read(sys.argv[1]), read(sys.argv[2]))))

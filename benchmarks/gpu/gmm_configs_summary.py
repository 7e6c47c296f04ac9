"""One line per case of a `bench_grouped_matmul.py calls` JSON: the automatic config, torch, the dense matmul of the
same FLOPs, then every CUTLASS config, fastest first (ms).

    python3 benchmarks/gpu/gmm_configs_summary.py calls.json
"""

from __future__ import annotations

import json
import sys


def lines(results: dict) -> list[str]:
    out = []
    for r in results["rows"]:
        t = r["times_ms"]
        configs = sorted(((k[len("cutlass["):-1], v) for k, v in t.items() if k.startswith("cutlass[")),
                         key=lambda kv: kv[1])
        head = (f"{r['model']:9} {r['proj']:7} {r['tokens']:>6} auto {t.get('cutlass', float('nan')):.3f} "
                f"({r.get('cutlass_auto_config', '?')}) torch {t.get('torch', float('nan')):.3f} "
                f"dense {t.get('dense', float('nan')):.3f} |")
        out.append(" ".join([head, *(f"{name}={ms:.3f}" for name, ms in configs)]))
    return out


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print("\n".join(lines(json.load(f))))

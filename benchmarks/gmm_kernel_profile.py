"""Kernel-only GPU time of each CUTLASS grouped-GEMM config vs torch._grouped_mm's GEMM kernel (Nsight Compute).

End-to-end timings (bench_grouped_matmul.py) include the launch path: the setup kernel, the tail zero-fill, and
per-call host work. This isolates the GEMM kernel itself, so a gap to torch can be placed in one or the other:

    ncu --clock-control none --kernel-name regex:device_kernel --metrics gpu__time_duration.sum --csv \\
        --print-units base --log-file ncu.csv python3 benchmarks/gmm_kernel_profile.py run --plan plan.json
    python3 benchmarks/gmm_kernel_profile.py report --plan plan.json --csv ncu.csv

`run` makes CALLS launches of every (case, implementation) in a fixed order and writes that order to the plan;
`report` maps ncu's kernels onto it in launch order (only CUTLASS `device_kernel`s are profiled: ours and torch's
are both CUTLASS GEMMs), and prints the median of each (the first launch of each is a warm-up and is dropped).
"""

from __future__ import annotations

import argparse
import csv
import json

import numpy as np

CASES = [  # (label, experts, N, K, rows)
    ("35b-a3b gate_up 16K", 256, 1024, 2048, 131072),
    ("35b-a3b down 4K", 256, 2048, 512, 32768),
    ("397b-a17b gate_up 4K", 512, 2048, 4096, 40960),
]
CALLS = 4


def run(plan_path: str) -> None:
    import jax
    import jax.numpy as jnp
    import torch

    from jax_dwdp.kernels import _cutlass

    names = _cutlass.config_names()
    plan = []
    rng = np.random.default_rng(0)
    for label, e, n, k, m in CASES:
        sizes = rng.multinomial(m, np.full(e, 1.0 / e)).astype(np.int32)
        x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
        w = (jax.random.normal(jax.random.key(2), (e, n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        gs = jnp.asarray(sizes)
        for ci, name in enumerate(names):
            f = jax.jit(lambda a, b, c, ci=ci: _cutlass.grouped_matmul(a, b, c, config=ci))
            jax.block_until_ready(f(x, w, gs))  # compile outside the counted launches (its GEMM launch counts too)
            for _ in range(CALLS - 1):
                jax.block_until_ready(f(x, w, gs))
            plan.append(dict(case=label, impl=f"cutlass[{name}]", launches=CALLS))
        tx, tw = torch.from_dlpack(x), torch.from_dlpack(w).transpose(-2, -1)
        offs = torch.from_dlpack(jax.block_until_ready(jnp.cumsum(gs).astype(jnp.int32)))
        for _ in range(CALLS):
            torch._grouped_mm(tx, tw, offs=offs)
        torch.cuda.synchronize()
        plan.append(dict(case=label, impl="torch._grouped_mm", launches=CALLS))
        with open(plan_path, "w") as fh:  # after every case: a run cut short still leaves a usable plan
            json.dump(plan, fh, indent=1)


def report(plan_path: str, csv_path: str) -> None:
    plan = json.load(open(plan_path))
    with open(csv_path) as fh:
        lines = [ln for ln in fh if ln.startswith('"')]  # ncu's own messages are not quoted CSV
    rows = [r for r in csv.DictReader(lines) if r.get("Metric Name") == "gpu__time_duration.sum"]
    to_us = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    units = {r.get("Metric Unit", "ns") for r in rows}
    if not units <= set(to_us):
        raise SystemExit(f"unknown time unit(s) {units - set(to_us)} in {csv_path}")
    times = [float(r["Metric Value"].replace(",", "")) * to_us[r.get("Metric Unit", "ns")] for r in rows]
    want = sum(p["launches"] for p in plan)
    print(f"{len(times)} GEMM kernels profiled, plan expects {want}")
    if len(times) < want or len(times) > want and len(times) - want >= CALLS:
        print("kernel count does not match the plan; not attributing")
        return
    times = times[:want]
    at, out = 0, {}
    for p in plan:
        t = times[at:at + p["launches"]]
        at += p["launches"]
        out.setdefault(p["case"], {})[p["impl"]] = float(np.median(t[1:]))
    for case, impls in out.items():
        ref = impls.get("torch._grouped_mm")
        print(f"{case}:")
        for impl, us in sorted(impls.items(), key=lambda kv: kv[1]):
            print(f"  {impl:36} {us:9.1f} us" + (f"   torch/this {ref / us:5.3f}" if ref else ""))
    print(json.dumps(out))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["run", "report"])
    ap.add_argument("--plan", required=True)
    ap.add_argument("--csv")
    a = ap.parse_args()
    if a.what == "report" and not a.csv:
        ap.error("report needs --csv (the ncu log)")
    run(a.plan) if a.what == "run" else report(a.plan, a.csv)

"""HF -> Orbax conversion speed and memory on a checkpoint of >= 1 GB that this script writes itself.

    python benchmarks/bench_convert.py --workdir /tmp/convert_bench [--layers 8] [--reps 3]

Writes a random bf16 Qwen3.5-MoE checkpoint (two safetensors shards with an index), reads it twice with
`cat FILES > /dev/null` (raw read rate; the second read is the page-cache rate the converter also sees), writes the
same number of bytes twice with `dd ... conv=fsync` (raw durable write rate: a conversion writes as much as it
reads; the first write lands in memory the VM has to back afresh, the second reuses the first's pages), then runs
`jax-dwdp convert` in a subprocess --reps times, each after a --pause (freed pages go back to the VM's host) and
followed by `sync` (counted) and by deleting its output, and reports the median GB/s with every run, the ratios to
the raw rates, and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import abstract_model
from jax_dwdp.weights.hf_names import hf_name


def write_safetensors(path: Path, tensors: dict[str, tuple[tuple[int, ...], str]], rng) -> int:
    """Streams random tensors into one safetensors file, one tensor in memory at a time; returns bytes."""
    dtypes = {"BF16": (ml_dtypes.bfloat16, 2), "F32": (np.float32, 4)}
    header, offset = {}, 0
    for name, (shape, dt) in tensors.items():
        n = math.prod(shape) * dtypes[dt][1]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * ((-len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, (shape, dt) in tensors.items():
            f.write((rng.standard_normal(shape, np.float32) * 0.02).astype(dtypes[dt][0]).tobytes())
    return offset


def make_checkpoint(directory: Path, cfg: ModelConfig) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    state = abstract_model(cfg, dtype=ml_dtypes.bfloat16)
    from flax import nnx

    tensors = {}
    for path, var in nnx.to_flat_state(nnx.state(state)):
        dt = "F32" if path[-1] == "A_log" else "BF16"
        tensors[hf_name(path, 0)] = (tuple(var.shape), dt)
    names = sorted(tensors)
    half = len(names) // 2
    weight_map, total = {}, 0
    for i, part in enumerate((names[:half], names[half:])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        total += write_safetensors(directory / fname, {n: tensors[n] for n in part}, rng)
        weight_map.update({n: fname for n in part})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    raw = cfg.to_hf_dict()
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": raw}))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/jax_dwdp_convert_bench"))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--reps", type=int, default=3, help="conversions")
    ap.add_argument("--pause", type=float, default=4.0, help="seconds to wait before each conversion")
    args = ap.parse_args()
    cfg = ModelConfig(vocab_size=32000, hidden_size=1024, num_hidden_layers=args.layers, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
                      linear_key_head_dim=64, linear_value_head_dim=64, num_experts=64, num_experts_per_tok=4,
                      moe_intermediate_size=512, shared_expert_intermediate_size=512)
    shutil.rmtree(args.workdir, ignore_errors=True)
    hf = args.workdir / "hf"
    nbytes = make_checkpoint(hf, cfg)
    files = sorted(str(p) for p in hf.glob("*.safetensors"))
    reads = []
    for _ in range(2):
        t0 = time.perf_counter()
        subprocess.run(f"cat {' '.join(files)} > /dev/null", shell=True, check=True)
        reads.append(nbytes / 1e9 / (time.perf_counter() - t0))
    # Raw durable write, twice: this VM backs guest memory lazily, so the first write into pages the guest has not
    # used lately runs at the host's page-allocation rate; the second reuses the pages the first one freed.
    scratch = args.workdir / "dd.bin"
    writes = []
    for _ in range(2):
        t0 = time.perf_counter()
        subprocess.run(["dd", "if=/dev/zero", f"of={scratch}", "bs=16M", f"count={math.ceil(nbytes / 2**24)}",
                        "conv=fsync"], check=True, capture_output=True)
        writes.append(nbytes / 1e9 / (time.perf_counter() - t0))
        scratch.unlink()
    runs = []
    for _ in range(args.reps):
        out = args.workdir / "orbax"
        time.sleep(args.pause)  # freed pages go back to the host, as before a conversion on a quiet machine
        proc = subprocess.run([sys.executable, "-m", "jax_dwdp.cli", "convert", str(hf), str(out), "--json"],
                              capture_output=True, text=True, check=True)
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        t0 = time.perf_counter()
        os.sync()  # count what the converter left unflushed
        summary["gb_per_s_synced"] = summary["bytes"] / 1e9 / (summary["seconds"] + time.perf_counter() - t0)
        runs.append(summary)
        print(f"convert: {summary['gb_per_s_synced']:.3f} GB/s, peak RSS "
              f"{summary['peak_rss_bytes'] / 2**20:.0f} MiB", file=sys.stderr, flush=True)
        shutil.rmtree(out)
    med = statistics.median(s["gb_per_s_synced"] for s in runs)
    result = {"checkpoint_gb": round(nbytes / 1e9, 3), "raw_read_gb_per_s_first": round(reads[0], 3),
              "raw_read_gb_per_s_second": round(reads[1], 3),
              "raw_write_fsync_gb_per_s_first": round(writes[0], 3),
              "raw_write_fsync_gb_per_s_second": round(writes[1], 3),
              "pause_s": args.pause,
              "convert": {"gb_per_s_median": round(med, 3),
                          "gb_per_s_runs": [round(s["gb_per_s_synced"], 3) for s in runs],
                          "seconds_runs": [s["seconds"] for s in runs],
                          "peak_rss_mib_runs": [round(s["peak_rss_bytes"] / 2**20) for s in runs]},
              "convert_gb_per_s": round(med, 3),
              "convert_vs_raw_read_second": round(med / reads[1], 3),
              "convert_vs_raw_write_second": round(med / writes[1], 3),
              "peak_rss_mib": max(round(s["peak_rss_bytes"] / 2**20) for s in runs),
              "largest_tensor_mib": round(max(math.prod(s) * 2 for s in [(cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size), (cfg.vocab_size, cfg.hidden_size)]) / 2**20)}
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Writes the committed GPU profiles (jax_dwdp/profiles/h200.json, h100.json) from measurements already in
benchmarks/RESULTS.md and its raw files: no GPU. Every value carries its source (the RESULTS.md section and row,
the date, the machine, the raw file); values derived from two-GPU rows are computed here from the raw JSON with the
planner's own model, so that the derivation can be read and rerun.

    python benchmarks/profiles_from_results.py            # rewrite jax_dwdp/profiles/*.json
    python benchmarks/profiles_from_results.py --check    # exit 1 if the committed files differ from a rebuild

What was never measured is said in the value's source: the H100's link (no two-GPU H100 machine was lent: NVLink
4's spec sheet, derated by what the H200 pair measured) and the H100's contention between copy and compute (the
H200's). A profile measured on one GPU by benchmarks/profile_gpu.py replaces these guesses for that GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jax_dwdp.config import FULL_ATTENTION, LINEAR_ATTENTION, REQUIRED_KEYS, ModelConfig  # noqa: E402
from jax_dwdp.parallel.expert_layout import ExpertLayout, expert_bytes_per_layer  # noqa: E402
from jax_dwdp.planner import (GIB, PROFILE_FORMAT, PROFILES_DIR, SPEC_COLLECTIVE_EFFICIENCY,  # noqa: E402
                              SPEC_PEER_EFFICIENCY, calibrate_compute_loss)

RESULTS = ROOT / "benchmarks" / "results"
TWO_GPU_XLA = "dwdp_h200x2_2026-11-30_seventh_xla_gdn.json"
TWO_GPU_PALLAS = "dwdp_h200x2_2026-11-30_seventh_pallas_gdn.json"
MODEL = "35b-a3b"
NVLINK4_GB_S = 450  # per direction per GPU (NVIDIA's H100 / H200 SXM spec: 900 GB/s both ways)


def model_config(name: str) -> dict:
    cfg = ModelConfig.preset(name)
    return {k: getattr(cfg, k) for k in REQUIRED_KEYS if k != "num_hidden_layers"}


def layer_points(rows: dict, source: str) -> dict:
    """rows: tokens -> (linear layer, full layer, MoE block) ms. The mixers are the layer minus the MoE block (so
    that a layer is mixer + MoE, the post-attention norm counted in the mixer)."""
    out = {f"{LINEAR_ATTENTION}_mixer_ms": [], f"{FULL_ATTENTION}_mixer_ms": [], "moe_ms": []}
    for t, (lin, full, moe) in sorted(rows.items()):
        out[f"{LINEAR_ATTENTION}_mixer_ms"].append(
            {"tokens": t, "ms": round(lin - moe, 3), "source": f"{source}: linear-attention layer {lin} - MoE block "
                                                              f"{moe} at {t} tokens"})
        out[f"{FULL_ATTENTION}_mixer_ms"].append(
            {"tokens": t, "ms": round(full - moe, 3), "source": f"{source}: full-attention layer {full} - MoE block "
                                                                f"{moe} at {t} tokens"})
        out["moe_ms"].append({"tokens": t, "ms": moe, "source": f"{source}: MoE block at {t} tokens"})
    return out


def two_gpu_rows(name: str) -> list[dict]:
    return json.loads((RESULTS / name).read_text())["rows"]


def h200_copy_rate() -> dict:
    tb_s = 4.3  # "HBM copy about 4.3 TB/s" (bytes read + written)
    return {"value": round(tb_s / 2 * 1e12 / GIB, 1),
            "source": "shared/docs/gpu_facts.md, One H200 (2026-11-30): 'HBM copy about 4.3 TB/s', read as bytes "
                      "read + written: 2.15 TB/s copied"}


def h200_link(copy_gib_s: float) -> dict:
    """The peer copy rate from the store's copies on an idle GPU (2x H200, 2026-11-30): 0.75 GiB from the peer plus
    the own 0.75 GiB HBM to HBM per layer (the store of then copied its own block), the own part at the one-GPU
    copy rate."""
    cfg = ModelConfig.preset(MODEL)
    per = expert_bytes_per_layer(cfg, 2)
    layout = ExpertLayout(cfg.num_experts, 2)
    peer = (cfg.num_experts - len(layout.owned(0))) * per
    own = len(layout.owned(0)) * per
    idle = [r["ffi_copy_ms_per_layer_idle"] for name in (TWO_GPU_PALLAS, TWO_GPU_XLA) for r in two_gpu_rows(name)]
    idle_ms = sum(idle) / len(idle)
    own_ms = own / (copy_gib_s * GIB) * 1e3
    peer_gib_s = peer / GIB / ((idle_ms - own_ms) / 1e3)
    spec = NVLINK4_GB_S * 1e9 / GIB
    return {
        "name": "h200-nv18", "kind": "measured",
        "peer_gib_s": round(peer_gib_s, 1),
        "collective_gib_s": 239.0,
        "latency_us": 20.0,
        "source": (f"peer: RESULTS.md, DWDP vs replicated weights (two GPUs), 2x H200 (NV18), 2026-11-30, the "
                   f"'copy ms/layer idle' column ({', '.join(f'{x:.3f}' for x in idle)} ms; raw {TWO_GPU_PALLAS}, "
                   f"{TWO_GPU_XLA}): 0.75 GiB from the peer + 0.75 GiB own block HBM to HBM ({own_ms:.3f} ms at "
                   f"the one-GPU copy rate) in {idle_ms:.3f} ms -> {peer_gib_s:.1f} GiB/s "
                   f"({peer_gib_s / spec:.3f} of NVLink 4's {NVLINK4_GB_S} GB/s per direction); collective: "
                   f"shared/docs/gpu_facts.md, Two-GPU host (2026-11-30): jax.lax.all_gather of 512 MiB per shard, "
                   f"239 GiB/s received per GPU ({239 / spec:.3f} of the spec); latency: assumed 20 us per "
                   "collective (no DEP measurement yet)"),
    }


def h200_contention() -> list[dict]:
    """Copy slowdown and compute loss from the two-GPU rows with the XLA Gated DeltaNet (2x H200, 2026-11-30, the
    stage-runner code ea0b9bd): the copy's time under compute over its idle time, and the compute loss at which the
    planner's two-stream model gives the measured FFI time from the same row's replicated layer (mixer = layer - MoE
    block, every layer alike: the row has no split by layer kind)."""
    out = []
    for r in two_gpu_rows(TWO_GPU_XLA):
        layers, t = r["layers"], r["seq_len_per_rank"]
        moe = r["moe_ms_per_layer"]
        mixer = r["layer_ms_replicated"] - moe
        slow = r["ffi_copy_ms_per_layer"] / r["ffi_copy_ms_per_layer_idle"]
        loss = calibrate_compute_loss([mixer] * layers, [moe] * layers, r["ffi_copy_ms_per_layer_idle"], slow,
                                      r["ffi_ms"])
        out.append({"tokens": t, "copy_slowdown": round(slow, 4), "compute_loss": round(loss, 4),
                    "source": (f"RESULTS.md, DWDP vs replicated weights (two GPUs), row 'XLA | {t:,}', 2x H200, "
                               f"2026-11-30, commit ea0b9bd (raw {TWO_GPU_XLA}): copy {r['ffi_copy_ms_per_layer']} "
                               f"ms under compute / {r['ffi_copy_ms_per_layer_idle']} ms idle; FFI {r['ffi_ms']} ms "
                               f"vs replicated {r['replicated_ms']} ms over {layers} layers (MoE {moe} ms of "
                               f"{r['layer_ms_replicated']} ms per layer); the own block was copied too")})
    return out


def h200() -> dict:
    src = ("RESULTS.md, Where a layer's time goes, 'On an H200' (2026-12-04 04:50 UTC, commit 016d3db, one H200; raw "
           "results/parts_35b_a3b_2026-12-04_twentysecond_d.log)")
    copy = h200_copy_rate()
    return {
        "format": PROFILE_FORMAT, "name": "h200", "device": "NVIDIA H200", "date": "2026-12-04",
        "code": "016d3db (layers); ea0b9bd (copy under compute, two GPUs)",
        "machine": "nvidia-h200 (143,771 MiB) and nvidia-h200-x2 (NV18), driver 580.159.04, jax 0.11.2",
        "model": {"name": MODEL, "config": model_config(MODEL)}, "dtype": "bfloat16",
        "memory_gib": {"value": round(143771 / 1024, 1), "source": "RESULTS.md (read 2026-12-07), Machines: H200, nvidia-h200, 143,771 MiB"},
        "layers": layer_points({4096: (1.560, 1.441, 0.778), 16384: (5.124, 7.374, 2.198),
                                32768: (9.963, 21.234, 4.255)}, src),
        "gemm": {
            "dense_tflops": {"value": 781.0, "source": "shared/docs/gpu_facts.md, One H200 (2026-11-30): dense bf16 "
                             "matmul 8192^3 through jax; 691-712 sustained over 400 calls at the 700 W cap "
                             "(RESULTS.md, End-to-end prefill, 2026-12-04)"},
            "grouped_tflops": {"value": 518.0, "source": "RESULTS.md, MoE grouped GEMM (2026-12-02 13:22 UTC, commit "
                               "4f07acf, H200): 35b-a3b gate_up 0.958 ms + down 0.635 ms at 16K tokens (top-8): "
                               "0.825 TFLOP in 1.593 ms"},
        },
        "copy": {"alone_gib_s": copy, "under_compute": h200_contention()},
        "link": h200_link(copy["value"]),
        "notes": [
            "The layer times are the current kernels' (2026-12-04); the contention was measured on the code of "
            "2026-11-30 (XLA Gated DeltaNet, Mosaic grouped matmul, the store copying its own block too) and is "
            "applied per ms of copy.",
            "No one-GPU measurement of a copy under compute yet: benchmarks/profile_gpu.py on a GPU writes one.",
        ],
    }


def h100() -> dict:
    src = ("RESULTS.md, Where a layer's time goes (2026-12-06 01:31 UTC, commit 5930a00, one H100 80GB HBM3; raw "
           "results/parts_35b_a3b_2026-12-06_twentyeighth_a.json)")
    h200_profile = h200()
    contention = [dict(p, source=f"assumed: the H200's ({p['source']}); no two-GPU H100 measurement")
                  for p in h200_profile["copy"]["under_compute"]]
    bytes_in_out = 2 * 16384 * 8192 * 2
    copy_gib_s = bytes_in_out / 2 / 0.194e-3 / GIB
    spec = NVLINK4_GB_S * 1e9 / GIB
    return {
        "format": PROFILE_FORMAT, "name": "h100", "device": "NVIDIA H100 80GB HBM3", "date": "2026-12-06",
        "code": "5930a00 (layers)",
        "machine": "nvidia-h100-x1 (81,559 MiB), driver 580.159.04, jax 0.11.2",
        "model": {"name": MODEL, "config": model_config(MODEL)}, "dtype": "bfloat16",
        "memory_gib": {"value": round(81559 / 1024, 1), "source": "RESULTS.md (read 2026-12-07), Machines: H100 80GB HBM3, nvidia-h100-x1, 81,559 MiB"},
        "layers": layer_points({1024: (0.988, 0.897, 0.725), 4096: (1.741, 1.588, 0.913),
                                16384: (5.018, 7.111, 2.145), 32768: (9.891, 20.646, 4.087)}, src),
        "gemm": {
            "dense_tflops": {"value": 780.0, "source": "RESULTS.md, The 16K prefill by kernel (2026-12-06 05:00 UTC, "
                             "commit 23ee5a9, H100): cuBLAS nvjet 176x128, the GDN in_proj_qkv and attention q / "
                             "gate projections"},
            "grouped_tflops": {"value": 488.0, "source": "RESULTS.md, The 16K prefill by kernel (H100, 2026-12-06): "
                               "gather + SwiGLU gate_up 42.07 ms (523 TFLOP/s) + down 25.51 ms (431) over 40 layers: "
                               "33.0 TFLOP in 67.58 ms"},
        },
        "copy": {
            "alone_gib_s": {"value": round(copy_gib_s, 1), "source": "RESULTS.md, Gated DeltaNet kernels, the causal "
                            "conv table (2026-12-05 16:17 UTC, commit 75cde25, H100): 'floor: an XLA element-wise "
                            "pass over the same bytes' 0.194 ms at 16K over 16384 x 8192 bf16 read and written"},
            "under_compute": contention,
        },
        "link": {"name": "nvlink4", "kind": "spec sheet", "peer_gib_s": round(spec * SPEC_PEER_EFFICIENCY, 1),
                 "collective_gib_s": round(spec * SPEC_COLLECTIVE_EFFICIENCY, 1), "latency_us": 20.0,
                 "source": f"NVLink 4 spec sheet, {NVLINK4_GB_S} GB/s per direction per H100 SXM GPU, derated by "
                           f"the H200 pair's measured ratios (peer copy x{SPEC_PEER_EFFICIENCY}, XLA all-gather "
                           f"x{SPEC_COLLECTIVE_EFFICIENCY}; h200.json's link); no two-GPU H100 measurement"},
        "notes": ["No two-GPU H100 machine has been lent: the link is the spec sheet's and the contention the H200's."],
    }


PROFILES = {"h200": h200, "h100": h100}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    ap.add_argument("--out-dir", type=Path, default=PROFILES_DIR)
    args = ap.parse_args(argv)
    differ = []
    for name, build in PROFILES.items():
        text = json.dumps(build(), indent=1) + "\n"
        path = args.out_dir / f"{name}.json"
        if args.check:
            if not path.is_file() or path.read_text() != text:
                differ.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if differ:
        print("differ from a rebuild: " + ", ".join(differ))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

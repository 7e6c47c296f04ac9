"""The reference prefill: transformers' Qwen3.5-MoE in PyTorch on the same shapes as bench_prefill.py.

    python benchmarks/bench_transformers.py --preset 35b-a3b --seq-lens 4096 16384 --out results/hf.json

Random bf16 weights drawn on the device, batch 1, logits of the last position (`logits_to_keep=1`) with the cache
built (`use_cache=True`), as jax_dwdp's prefill does. transformers picks its fastest kernels available here: SDPA
attention, `torch._grouped_mm` experts (`experts_implementation="grouped_mm"`), flash-linear-attention's
`chunk_gated_delta_rule` when fla is importable (carried as wheels on the GPU machine) and its PyTorch causal conv
(causal-conv1d is not on the image). Same table and JSON fields as bench_prefill.py; MFU against the same 781
TFLOP/s and the same FLOP count (`ModelConfig.prefill_flops`). On the CPU it runs fp32 with the eager paths (a smoke
test of the script only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_TFLOPS = 781.0


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="35b-a3b")
    ap.add_argument("--num-layers", type=int)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import Qwen3_5MoeForCausalLM

    from jax_dwdp.config import ModelConfig
    from tests.hf_reference import hf_text_config

    cfg = ModelConfig.preset(args.preset)
    if args.num_layers:
        cfg = cfg.replace(num_hidden_layers=args.num_layers)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    try:
        import fla  # noqa: F401

        gdn = "fla"
    except ImportError:
        gdn = "torch"
    hf_cfg = hf_text_config(cfg)
    hf_cfg._attn_implementation = "sdpa"
    hf_cfg._experts_implementation = "grouped_mm" if cuda else "eager"
    t0 = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device, torch.no_grad():
            torch.manual_seed(0)
            model = Qwen3_5MoeForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    init_s = time.perf_counter() - t0
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{cfg.summary()}; transformers {transformers.__version__}, torch {torch.__version__}, {dtype}; random init "
          f"{init_s:.1f} s on {name}; attention sdpa, experts {hf_cfg._experts_implementation}, gated delta rule "
          f"{gdn}", flush=True)
    result = {"device": name, "transformers": transformers.__version__, "torch": torch.__version__}
    print(f"{'tokens':>8} {'first s':>9} {'prefill ms':>10} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8}")
    rows = []
    for t in sorted(args.seq_lens):
        tokens = torch.as_tensor(np.random.default_rng(t).integers(0, cfg.vocab_size, (1, t)), device=device)

        def run():
            with torch.no_grad():
                out = model(tokens, use_cache=True, logits_to_keep=1)
            sync()
            return out

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = run()  # the first call (kernel autotuning, Triton compiles)
        first_s = time.perf_counter() - t0
        finite = bool(torch.isfinite(out.logits).all())
        del out
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        sec = statistics.median(times)
        tflops = cfg.prefill_flops(1, t, 1) / sec / 1e12
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        row = dict(preset=args.preset, impl="transformers", layers=cfg.num_hidden_layers, batch=1, seq_len=t,
                   dtype=str(dtype), gated_delta_rule=gdn, first_call_s=round(first_s, 2),
                   prefill_ms=round(sec * 1e3, 2), tokens_per_s=round(t / sec), tflops=round(tflops, 1),
                   mfu=round(tflops / PEAK_TFLOPS, 4), peak_gib=round(peak, 2) if peak else None,
                   logits_finite=finite, times_ms=[round(x * 1e3, 2) for x in times])
        rows.append(row)
        print(f"{t:>8} {first_s:>9.1f} {sec * 1e3:>10.1f} {t / sec:>10.0f} {tflops:>8.1f} {tflops / PEAK_TFLOPS:>6.1%} "
              f"{peak or float('nan'):>8.2f}  finite={finite}", flush=True)
        if args.out:  # after every row (whole files only): a run cut by its time limit keeps the rows it finished
            tmp = args.out.with_name(args.out.name + ".tmp")
            tmp.write_text(json.dumps(dict(result, rows=rows), indent=1))
            os.replace(tmp, args.out)
    return dict(result, rows=rows)


if __name__ == "__main__":
    main()

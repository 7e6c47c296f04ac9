"""The reference prefill: transformers' own model in PyTorch on the same shapes as bench_prefill.py.

    python benchmarks/bench_transformers.py --preset 35b-a3b --seq-lens 4096 16384 --out results/hf.json
    python benchmarks/bench_transformers.py --preset nemotron-h:nano-30b-a3b --seq-lens 4096 16384

The preset's family picks the model, Qwen3_5MoeForCausalLM or NemotronHForCausalLM, built from the config that
jax_dwdp runs (`to_hf_dict`). Random bf16 weights drawn on the device, batch 1, logits of the last position
(`logits_to_keep=1`) with the cache built (`use_cache=True`), as jax_dwdp's prefill does. transformers picks its
fastest kernels available here: SDPA attention, `torch._grouped_mm` experts (`experts_implementation="grouped_mm"`,
both families); for Qwen3.5 flash-linear-attention's `chunk_gated_delta_rule` when fla is importable (carried as
wheels on the GPU machine) and its PyTorch causal conv (causal-conv1d is not on the image).

Nemotron-H's Mamba-2 layers: transformers 5.17 binds each kernel once, when modeling_nemotron_h is imported, by
trying to import its package (no `is_*_available` gate, and the config's `use_mamba_kernels` is not read): the
chunked scan is mamba_ssm's Triton `mamba_chunk_scan_combined` if `import mamba_ssm` succeeds, the conv
causal-conv1d's `causal_conv1d_fn` if `import causal_conv1d` does; otherwise its own PyTorch forms (F.conv1d; a
chunked scan in torch ops that materialises [chunks, L, L, heads, state] products). Its fused
`mamba_split_conv1d_scan_combined` runs only in training without a cache, never here. mamba_ssm's package imports
its Mamba-1 CUDA extension `selective_scan_cuda` at the top, which a wheel built without CUDA extensions lacks: with
`--mamba-kernels auto` (the default) a stand-in module takes its place (Nemotron-H never calls Mamba-1's scan; the
stand-in refuses any use), so the Triton scan runs wherever mamba_ssm and triton import; `--mamba-kernels torch`
keeps transformers' PyTorch forms. The output says which functions ran (`mamba_path`: "mamba_ssm", "torch", or
"unknown" where it cannot tell; `ssd_scan` and `conv1d` by name; how often the first call ran each).

Same table and JSON fields as bench_prefill.py; MFU against the same 781 TFLOP/s and the same FLOP count (the
family's `prefill_flops`). A length that runs out of device memory is a row with `error`, and the longer ones are
not tried. On the CPU it runs fp32 with the eager paths (a smoke test of the script only).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # presets, when loaded by path (tests)
from mamba_kernels import import_mamba_ssm  # noqa: E402
from presets import add_model_args, model_config  # noqa: E402

PEAK_TFLOPS = 781.0
NEMOTRON_MODELING = "transformers.models.nemotron_h.modeling_nemotron_h"
# modeling_nemotron_h's module-level functions that its Mamba-2 prefill calls, by the name this script reports.
MAMBA_FUNCTIONS = {"ssd_scan": "mamba2_chunk_scan", "conv1d": "causal_conv1d_fn"}


def prepare_mamba_kernels(choice: str) -> str:
    """Before modeling_nemotron_h is imported: makes transformers bind the Mamba-2 kernels `choice` asks for
    ("auto": mamba_ssm's where it imports; "torch": transformers' own). Returns what it found or did, in words."""
    if NEMOTRON_MODELING in sys.modules:
        return "modeling_nemotron_h was imported before: its kernels are those bound then"
    if choice == "torch":
        for name in ("mamba_ssm", "causal_conv1d"):
            if name not in sys.modules:
                sys.modules[name] = None  # importing it raises ImportError: transformers takes its PyTorch forms
        return "mamba_ssm and causal_conv1d kept from transformers (--mamba-kernels torch)"
    notes = import_mamba_ssm()
    if importlib.util.find_spec("causal_conv1d") is None:
        notes.append("causal_conv1d is not installed")
    return "; ".join(notes) or "mamba_ssm and causal_conv1d import"


def bound_function(wrapper) -> str:
    """module.name of the function that transformers' kernel wrapper calls: the package's (mamba_ssm,
    causal_conv1d) or its own PyTorch form. The wrapper holds it in its closure as `implementation`."""
    cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or ()))
    if "implementation" not in cells:
        return f"unknown (the wrapper of {wrapper.__qualname__} holds no implementation)"
    fn = cells["implementation"].cell_contents
    return f"{fn.__module__}.{fn.__qualname__}"


def mamba_functions() -> dict[str, str]:
    """What Nemotron-H's Mamba-2 prefill calls: per MAMBA_FUNCTIONS name, the bound function; and `mamba_path`,
    "mamba_ssm" when the chunked scan is mamba_ssm's (Triton) kernel, "torch" when it is transformers' own, else
    "unknown"."""
    modeling = sys.modules[NEMOTRON_MODELING]
    bound = {key: bound_function(getattr(modeling, name)) for key, name in MAMBA_FUNCTIONS.items()}
    scan = bound["ssd_scan"]
    path = "mamba_ssm" if scan.startswith("mamba_ssm.") else "torch" if scan.startswith("transformers.") else "unknown"
    return dict(mamba_path=path, **bound)


@contextlib.contextmanager
def counting_mamba_calls(calls: Counter):
    """Counts the calls of modeling_nemotron_h's MAMBA_FUNCTIONS inside the block (its mixer looks them up as module
    globals at each call); puts them back after."""
    modeling = sys.modules[NEMOTRON_MODELING]
    saved = {name: getattr(modeling, name) for name in MAMBA_FUNCTIONS.values()}

    def counted(key, fn):
        @functools.wraps(fn)  # (inspect.unwrap still reaches transformers' PyTorch form through it)
        def call(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return call

    try:
        for key, name in MAMBA_FUNCTIONS.items():
            setattr(modeling, name, counted(key, saved[name]))
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(modeling, name, fn)


def hf_model_class_and_config(cfg):
    """transformers' causal LM class of cfg's family and its config, built from cfg's HF config.json form."""
    from jax_dwdp.config import ModelConfig

    if isinstance(cfg, ModelConfig):
        from transformers import Qwen3_5MoeForCausalLM

        from tests.hf_reference import hf_text_config

        return Qwen3_5MoeForCausalLM, hf_text_config(cfg)
    from transformers import NemotronHConfig, NemotronHForCausalLM

    fields = {k: v for k, v in cfg.to_hf_dict().items() if k != "model_type"}
    return NemotronHForCausalLM, NemotronHConfig(**fields)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--mamba-kernels", choices=("auto", "torch"), default="auto",
                    help="Nemotron-H's Mamba-2 kernels: auto (mamba_ssm's Triton chunked scan and causal-conv1d "
                         "where they import, else transformers' PyTorch forms) or torch (transformers' PyTorch forms)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    cfg = model_config(ap, args)

    from jax_dwdp.config import ModelConfig

    nemotron = not isinstance(cfg, ModelConfig)
    mamba_note = prepare_mamba_kernels(args.mamba_kernels) if nemotron else None

    import torch
    import transformers

    model_class, hf_cfg = hf_model_class_and_config(cfg)  # (imports the modeling module: binds its kernels)
    if nemotron:
        mamba = mamba_functions()
        if args.mamba_kernels == "torch" and mamba["mamba_path"] != "torch":
            ap.error(f"--mamba-kernels torch: {mamba_note}, with {mamba['ssd_scan']}")
        mixer = f"Mamba-2 path {mamba['mamba_path']} (scan {mamba['ssd_scan']}, conv {mamba['conv1d']}; {mamba_note})"
        per_row = dict(mamba_path=mamba["mamba_path"])
        extra = dict(mamba=dict(mamba, note=mamba_note))
    else:
        try:
            import fla  # noqa: F401

            gdn = "fla"
        except ImportError:
            gdn = "torch"
        mixer = f"gated delta rule {gdn}"
        per_row, extra = dict(gated_delta_rule=gdn), {}
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    hf_cfg._attn_implementation = "sdpa"
    hf_cfg._experts_implementation = "grouped_mm" if cuda else "eager"
    t0 = time.perf_counter()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device, torch.no_grad():
            torch.manual_seed(0)
            model = model_class(hf_cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    init_s = time.perf_counter() - t0
    name = torch.cuda.get_device_name() if cuda else "cpu"
    result = {"device": name, "transformers": transformers.__version__, "torch": torch.__version__, **extra}
    print(f"{cfg.summary()}; transformers {transformers.__version__}, torch {torch.__version__}, {dtype}; random init "
          f"{init_s:.1f} s on {name}; attention sdpa, experts {hf_cfg._experts_implementation}, {mixer}", flush=True)
    print(f"{'tokens':>8} {'first s':>9} {'prefill ms':>10} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>8}")
    rows = []

    def save():  # after every row (whole files only): a run cut by its time limit keeps the rows it finished
        if args.out:
            tmp = args.out.with_name(args.out.name + ".tmp")
            tmp.write_text(json.dumps(dict(result, rows=rows), indent=1))
            os.replace(tmp, args.out)

    for t in sorted(args.seq_lens):
        tokens = torch.as_tensor(np.random.default_rng(t).integers(0, cfg.vocab_size, (1, t)), device=device)

        def run():
            with torch.no_grad():
                out = model(tokens, use_cache=True, logits_to_keep=1)
            sync()
            return out

        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            calls = Counter()
            t0 = time.perf_counter()
            with counting_mamba_calls(calls) if nemotron else contextlib.nullcontext():
                out = run()  # the first call (kernel autotuning, Triton compiles)
            first_s = time.perf_counter() - t0
            finite = bool(torch.isfinite(out.logits).all())
            del out
            times = []
            for _ in range(args.iters):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            rows.append(dict(preset=args.preset, impl="transformers", layers=cfg.num_hidden_layers, batch=1,
                             seq_len=t, dtype=str(dtype), **per_row, error=f"out of device memory: {e}".split("\n")[0]))
            print(f"{t:>8} out of device memory: the longer lengths are not tried", flush=True)
            save()
            break
        sec = statistics.median(times)
        tflops = cfg.prefill_flops(1, t, 1) / sec / 1e12
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
        row = dict(preset=args.preset, impl="transformers", layers=cfg.num_hidden_layers, batch=1, seq_len=t,
                   dtype=str(dtype), **per_row, first_call_s=round(first_s, 2),
                   prefill_ms=round(sec * 1e3, 2), tokens_per_s=round(t / sec), tflops=round(tflops, 1),
                   mfu=round(tflops / PEAK_TFLOPS, 4), peak_gib=round(peak, 2) if peak else None,
                   logits_finite=finite, times_ms=[round(x * 1e3, 2) for x in times])
        if nemotron:
            row["mamba_calls_first_call"] = dict(calls)
        rows.append(row)
        print(f"{t:>8} {first_s:>9.1f} {sec * 1e3:>10.1f} {t / sec:>10.0f} {tflops:>8.1f} {tflops / PEAK_TFLOPS:>6.1%} "
              f"{peak or float('nan'):>8.2f}  finite={finite}", flush=True)
        save()
    return dict(result, rows=rows)


if __name__ == "__main__":
    main()

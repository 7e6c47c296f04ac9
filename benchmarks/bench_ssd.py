"""Mamba-2's chunked SSD scan (prefill, forward) on one GPU: jax_dwdp's Pallas kernels beside the XLA scan,
mamba_ssm's Triton kernels (`mamba_chunk_scan_combined`, the established implementation) and transformers' torch
chunked path, side by side on identical inputs.

The inputs are those the Nemotron-H mixer feeds the scan (`tests.ssd_cases.ssd_inputs`): bf16 x, B, C, fp32 dt
(softplus'd and clamped), fp32 A, batch 1, Nemotron-3 Nano 30B-A3B's heads (64 heads of 64, 8 groups, state 128,
chunks of 128) unless --smoke. torch reads the same device buffers through DLPack (no copies). Each result is
checked against one reference, the XLA scan in fp32 with exact products (`ssd_chunked_xla`, within 1e-5 of a
float64 recurrence in tests/test_nemotron_h.py), and its relative error (norm) and largest absolute error printed.

Times are the wall time of --calls back-to-back calls divided by --calls, median of --reps, after three warm-up calls,
for every implementation alike (so launch and host overheads count the same way); torch's rows also carry
triton.testing.do_bench's median (CUDA events, L2 flushed). TFLOP/s counts the chunked form's products (C B^T per
group and chunk; per head and chunk the intra-chunk product, the chunk's state and the state's output); GB/s the
bytes that must move at least (inputs read once, y and the final state written once).

    python benchmarks/bench_ssd.py --out results/ssd.json [--seq-lens 4096 16384 32768] [--variants]
    python benchmarks/bench_ssd.py --seq-lens --variants --out results/ssd_variants.json   # the variants alone
    python benchmarks/bench_ssd.py --smoke --out /tmp/ssd.json     # CPU: tiny heads, JAX variants (interpret mode)

mamba_ssm is imported lazily: carried as a wheel built without its CUDA extensions (`MAMBA_SKIP_CUDA_BUILD=TRUE`),
whose package __init__ imports one (`selective_scan_cuda`): benchmarks/mamba_kernels.py puts in a stand-in (the SSD
ops are Triton only); absent, its rows are skipped and the reason printed. transformers' torch path
(`modeling_nemotron_h.mamba2_chunk_scan`, unwrapped from its kernel-hub decorator so that it is the torch code and
not mamba_ssm's) materialises fp32 products of [chunks, L, L, heads, state] (17 GB at 4K tokens) and [chunks, L,
L, heads, head_dim] / [chunks, L, heads, head_dim, state] (8.6 GB each): it runs up to --torch-max-tokens (default 4096).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # mamba_kernels, when loaded by path (tests)

from jax_dwdp.timing import wall_ms  # noqa: E402
from mamba_kernels import import_mamba_ssm  # noqa: E402
# JAX and torch share the GPU here: JAX takes memory as it needs it instead of 75% at start.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

HEADS_30B = dict(h=64, p=64, g=8, n=128, chunk=128)  # NemotronHConfig.preset("nano-30b-a3b")
HEADS_SMOKE = dict(h=4, p=32, g=2, n=16, chunk=32)


def load_mamba():
    """(mamba_chunk_scan_combined, version) or (None, why not)."""
    notes = import_mamba_ssm()
    if "mamba_ssm" not in sys.modules:
        return None, "; ".join(notes)
    try:
        from importlib.metadata import version

        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as e:  # noqa: BLE001 (any import failure is reported as the reason for the skipped rows)
        return None, f"mamba_ssm's Triton SSD ops do not import: {type(e).__name__}: {e}"
    return mamba_chunk_scan_combined, version("mamba_ssm")


def load_transformers_scan():
    """(the torch chunked scan of transformers' Nemotron-H, version) or (None, why not)."""
    try:
        import transformers
        from transformers.models.nemotron_h import modeling_nemotron_h
    except Exception as e:  # noqa: BLE001
        return None, f"transformers' nemotron_h does not import: {type(e).__name__}: {e}"
    scan = inspect.unwrap(getattr(modeling_nemotron_h, "mamba2_chunk_scan", None) or (lambda: None))
    if getattr(scan, "__name__", "") != "mamba2_chunk_scan":
        return None, f"transformers {transformers.__version__} has no function mamba2_chunk_scan to call"
    return scan, transformers.__version__


def flops(t: int, h: int, p: int, g: int, n: int, chunk: int) -> float:
    """The scan's matrix products, counted as NemotronHConfig.layer_flops counts them (the causal half of each
    chunk's C B^T and its product with dt x, plus building and reading the states)."""
    nc = -(-t // chunk)
    return nc * (g * chunk * chunk * n + h * (chunk * chunk * p + 4 * chunk * n * p))


def min_bytes(t: int, h: int, p: int, g: int, n: int, y_bytes: int) -> float:
    return t * h * p * 2 + 2 * t * g * n * 2 + t * h * 4 + t * h * p * y_bytes + h * p * n * 4


def errors(y, state, ref_y, ref_state) -> dict:
    y, state = np.asarray(y, np.float64), np.asarray(state, np.float64)
    return {"y_rel_err": float(np.linalg.norm(y - ref_y) / np.linalg.norm(ref_y)),
            "y_max_abs_err": float(np.abs(y - ref_y).max()),
            "state_rel_err": float(np.linalg.norm(state - ref_state) / np.linalg.norm(ref_state))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", type=int, nargs="*", default=None,
                    help="default 4096 16384 32768 (smoke: 100); none: only --variants")
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny heads, JAX variants only, kernels interpreted")
    ap.add_argument("--variants", action="store_true", help="time the kernel's Tuning variants at --variants-tokens")
    ap.add_argument("--variants-tokens", type=int, nargs="+", default=[16384])
    ap.add_argument("--parts", action="store_true",
                    help="also time each of the kernel's pallas_calls alone at every length (where a form's time goes)")
    ap.add_argument("--no-mamba", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--torch-max-tokens", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from jax_dwdp.kernels.ssd import ssd_chunked_xla
    from jax_dwdp.kernels.ssd_pallas import Tuning, ssd_chunked_pallas
    from tests.ssd_cases import ssd_inputs

    gpu = jax.default_backend() == "gpu"
    if not gpu and not args.smoke:
        ap.error("no GPU: run with --smoke (tiny heads, JAX variants only)")
    heads = HEADS_SMOKE if args.smoke else HEADS_30B
    h, p, g, n, chunk = (heads[k] for k in ("h", "p", "g", "n", "chunk"))
    seq_lens = args.seq_lens if args.seq_lens is not None else ([100] if args.smoke else [4096, 16384, 32768])
    calls, reps = (1, 1) if args.smoke else (args.calls, args.reps)
    jsync = jax.block_until_ready
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "heads": heads, "rows": [],
               "variants": [], "skipped": {}}

    torch = mamba = hf_scan = None
    if not gpu or args.no_mamba:
        results["skipped"]["mamba_ssm"] = "no GPU" if not gpu else "--no-mamba"
    else:
        mamba, why = load_mamba()
        if mamba is None:
            results["skipped"]["mamba_ssm"] = why
        else:
            results["mamba_ssm"] = why
    if not gpu or args.no_torch:
        results["skipped"]["transformers"] = "no GPU" if not gpu else "--no-torch"
    else:
        hf_scan, why = load_transformers_scan()
        if hf_scan is None:
            results["skipped"]["transformers"] = why
        else:
            results["transformers"] = why
    for name, why in results["skipped"].items():
        print(f"{name}: skipped ({why})", flush=True)
    if mamba is not None or hf_scan is not None:
        import torch

        results["torch"] = torch.__version__

    def tsync(_):
        torch.cuda.synchronize()

    def save():  # after every length too: a run stopped by its time limit keeps what it measured
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=1))

    def pallas(tuning=Tuning(), y_dtype=jnp.float32):
        return jax.jit(lambda *v: ssd_chunked_pallas(*v, chunk_size=chunk, y_dtype=y_dtype, tuning=tuning,
                                                     interpret=not gpu))

    xla = jax.jit(lambda *v: ssd_chunked_xla(*v, chunk_size=chunk))
    rng = np.random.default_rng(0)
    for t in seq_lens:
        x, dt, a, b, c, _ = ssd_inputs(rng, 1, t, h, p, g, n, initial=False)
        args_j = (x, dt, a, b, c)
        ref_y, ref_s = (np.asarray(v, np.float64) for v in xla(*args_j))
        work = flops(t, h, p, g, n, chunk)
        rows = []

        def record(name, ms, y, state, y_bytes, **extra):
            row = {"tokens": t, "impl": name, "ms": ms, "tflops": work / ms / 1e9,
                   "gbps": min_bytes(t, h, p, g, n, y_bytes) / ms / 1e6, **errors(y, state, ref_y, ref_s), **extra}
            rows.append(row)
            print(json.dumps(row), flush=True)

        record("xla (fp32 reference)", wall_ms(lambda: xla(*args_j), jsync, calls, reps), ref_y, ref_s, 4)
        for label, fn, y_bytes in (("pallas (fp32 y)", pallas(), 4),
                                   ("pallas, bf16 y", pallas(y_dtype=jnp.bfloat16), 2)):
            try:  # a form that does not compile here leaves its row with the error, and the baselines still run
                y, s = fn(*args_j)
                record(label, wall_ms(lambda fn=fn: fn(*args_j), jsync, calls, reps), jnp.asarray(y, jnp.float32), s,
                       y_bytes)
            except Exception as e:  # noqa: BLE001
                row = {"tokens": t, "impl": label, "error": f"{type(e).__name__}: {str(e)[:300]}"}
                rows.append(row)
                print(json.dumps(row), flush=True)
        if mamba is not None or hf_scan is not None:
            from triton.testing import do_bench

            tx, tdt, ta, tb, tc = (torch.from_dlpack(v) for v in args_j)
            with torch.inference_mode():
                if mamba is not None:
                    def run_mamba():
                        return mamba(tx, tdt, ta, tb, tc, chunk, return_final_states=True)

                    my, ms_ = run_mamba()  # (the first call autotunes mamba_ssm's kernels)
                    wall = wall_ms(run_mamba, tsync, calls, reps)
                    record(f"mamba_ssm {results['mamba_ssm']} (bf16 y, bf16 chunk states, fp32 final state)", wall, my.float().cpu().numpy(),
                           ms_.float().cpu().numpy(), 2, do_bench_ms=do_bench(run_mamba, return_mode="median"))
                    del my, ms_
                if hf_scan is not None and t <= args.torch_max_tokens:
                    def run_hf():
                        return hf_scan(tx, tdt, ta, tb, tc, chunk, return_final_states=True)

                    hy, hs = run_hf()
                    wall = wall_ms(run_hf, tsync, min(calls, 3), min(reps, 3))
                    record(f"transformers {results['transformers']} torch path (fp32)", wall, hy.cpu().numpy(),
                           hs.cpu().numpy(), 4, do_bench_ms=do_bench(run_hf, rep=200, return_mode="median"))
                    del hy, hs
                    torch.cuda.empty_cache()
            del tx, tdt, ta, tb, tc
        if args.parts:
            results.setdefault("parts", []).extend(parts(args_j, chunk, gpu, jsync, calls, reps))
        base = next((r["ms"] for r in rows if r["impl"].startswith("mamba_ssm")), None)
        for r in rows:
            if base is not None and "ms" in r:
                r["vs_mamba_ssm"] = base / r["ms"]
        results["rows"].extend(rows)
        save()

    if args.variants:
        results["variants"] = variants(args, pallas, xla, heads, rng, jsync, calls, reps)

    print("\n| tokens | implementation | ms | TFLOP/s | GB/s | vs mamba_ssm | y rel err | y max abs err "
          "| state rel err |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results["rows"]:
        if "error" in r:
            print(f"| {r['tokens']} | {r['impl']} | failed: {r['error'][:120]} | | | | | | |")
            continue
        ratio = f"{r['vs_mamba_ssm']:.2f}x" if "vs_mamba_ssm" in r else "-"
        ms = f"{r['ms']:.3f}" + (f" ({r['do_bench_ms']:.3f})" if "do_bench_ms" in r else "")
        print(f"| {r['tokens']} | {r['impl']} | {ms} | {r['tflops']:.1f} | {r['gbps']:.0f} | {ratio} | "
              f"{r['y_rel_err']:.2e} | {r['y_max_abs_err']:.2e} | {r['state_rel_err']:.2e} |")
    if results["rows"] and any("do_bench_ms" in r for r in results["rows"]):
        print("(torch rows: wall-clock ms, do_bench's median in parentheses)")
    save()
    return results


def parts(args_j, chunk, gpu, jsync, calls, reps) -> list[dict]:
    """Each pallas_call of the kernel alone (default Tuning), on the inputs the scan gives it."""
    import jax
    import jax.numpy as jnp

    from jax_dwdp.kernels import ssd_pallas as sp

    x, dt, a, b, c = args_j
    t = x.shape[1]
    dtp = jnp.pad(dt.astype(jnp.float32), ((0, 0), (0, (-t) % chunk), (0, 0))).transpose(0, 2, 1)
    a = a.astype(jnp.float32)
    kw = dict(chunk=chunk, interpret=not gpu)
    cb = jax.jit(lambda c, b: sp.scores(c, b, **kw))(c, b)
    entering, _ = jax.jit(lambda *v: sp.states(*v, **kw))(a, dtp, x, b)
    calls_ = {
        "scores (C B^T)": (lambda c, b: sp.scores(c, b, **kw), (c, b)),
        "states loop": (lambda *v: sp.states(*v, **kw), (a, dtp, x, b)),
        "output, fp32 y": (lambda *v: sp.output(*v, y_dtype=jnp.float32, **kw), (a, dtp, x, c, cb, entering)),
        "output, bf16 y": (lambda *v: sp.output(*v, y_dtype=jnp.bfloat16, **kw), (a, dtp, x, c, cb, entering)),
    }
    out = []
    for name, (fn, v) in calls_.items():
        fn = jax.jit(fn)
        row = {"tokens": t, "part": name, "ms": wall_ms(lambda fn=fn, v=v: fn(*v), jsync, calls, reps)}
        out.append(row)
        print(f"part {json.dumps(row)}", flush=True)
    return out


def variants(args, pallas, xla, heads, rng, jsync, calls, reps) -> list[dict]:
    """The kernel's Tuning variants at each of --variants-tokens (bf16 y): the states loop's blocks of the state and
    warps, stages and segments, the output's warps, row blocks and heads per program. A variant that fails to
    compile is reported and skipped."""
    import jax.numpy as jnp

    from jax_dwdp.kernels.ssd_pallas import Tuning
    from tests.ssd_cases import ssd_inputs

    h, p, g, n = (heads[k] for k in ("h", "p", "g", "n"))
    if args.smoke:  # the default and one other of each knob
        cases = [Tuning(), Tuning(block_p=16, block_n=16, row_blocks=1, num_warps=(4, 8, 8), output_heads=2,
                                  segments=3)]
    else:  # the untimed knobs first (a run cut by its time limit keeps them); those measured slower are in RESULTS
        cases = [Tuning()]
        cases += [Tuning(segments=sg) for sg in (2, 4, 8)]
        cases += [Tuning(segments=4, block_n=64)]
        cases += [Tuning(output_heads=hb) for hb in (2, 4, 8)]
        cases += [Tuning(output_heads=8, num_warps=(4, 4, 8))]
        cases += [Tuning(row_blocks=1), Tuning(row_blocks=1, segments=4, output_heads=4)]
        cases += [Tuning(num_stages=(2, 2, 2)), Tuning(num_stages=(2, 4, 2)), Tuning(block_p=64, block_n=64),
                  Tuning(num_warps=(4, 4, 8))]
    out = []
    for t in [256] if args.smoke else args.variants_tokens:
        x, dt, a, b, c, _ = ssd_inputs(rng, 1, t, h, p, g, n, initial=False)
        ref_y, ref_s = (np.asarray(v, np.float64) for v in xla(x, dt, a, b, c))
        rows = []
        for tuning in cases:
            fn = pallas(tuning, jnp.bfloat16)
            try:
                y, s = fn(x, dt, a, b, c)
                row = {"tokens": t, "tuning": str(tuning),
                       "ms": wall_ms(lambda fn=fn: fn(x, dt, a, b, c), jsync, calls, reps),
                       **errors(jnp.asarray(y, jnp.float32), s, ref_y, ref_s)}
            except Exception as e:  # noqa: BLE001 (a variant Triton cannot compile is skipped, and said so)
                print(f"variant {tuning}: failed ({type(e).__name__}: {str(e)[:300]})", flush=True)
                continue
            rows.append(row)
            print(f"variant {json.dumps(row)}", flush=True)
        if rows:
            best = min((r for r in rows if r["y_rel_err"] <= 1e-2), key=lambda r: r["ms"], default=None)
            print(f"best variant at {t} tokens: {best['tuning'] if best else 'none within 1e-2'}"
                  + (f" {best['ms']:.3f} ms (default {rows[0]['ms']:.3f})" if best else ""), flush=True)
        out += rows
    return out


if __name__ == "__main__":
    main()

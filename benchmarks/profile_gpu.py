"""Measures one GPU and writes a GPU profile for the planner (`jax-dwdp plan --profile FILE`).

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/profile_gpu.py --preset 35b-a3b \
        --tokens 1024 4096 16384 32768 --link nvlink4 --out h100_mine.json

What it measures, on the first device (batch 1, random weights of the preset's first layers, bf16 by default):
- per token count: a linear-attention layer, a full-attention layer and the MoE block, each jitted and timed alone
  (10 back-to-back calls / 10, median of 5, as bench_layer_parts.py): the mixer is the layer minus the MoE block;
- the dense GEMM rate (an n x n x n matmul, --gemm-size) and the grouped GEMM rate (the MoE's gate_up and down
  grouped matmuls at the largest token count, uniform routing);
- a device-to-device copy alone and under compute. On a GPU: ranks 0 and 1 of one CUDA VMM expert store live on
  this GPU (its "peer" copy is HBM to HBM, on the store's copy stream, as in `bench_dwdp.py in-place`): the copy of
  a layer's peer block on an idle GPU, then a layer-wise prefill of --copy-layers layers reading the store in place
  while the next layer's block is copied, against the same prefill with the layers' own experts. The copy slowdown
  is the copy under compute over the idle copy; the compute loss is what the planner's two-stream model needs to
  give the measured prefill (`planner.calibrate_compute_loss`). A one-GPU copy moves HBM to HBM, so it contends more
  than a peer copy over NVLink (which writes this GPU's HBM at the link's rate): a two-GPU measurement is better
  where one exists.
- The link between GPUs cannot be measured on one GPU: --link names a spec-sheet link (labelled so in the profile)
  or --link none leaves it out (then `plan` needs --link).

On a CPU (the test suite runs it at tiny sizes so that the script is known to work) the copy is a host thread's
numpy copies beside the jitted compute: a stand-in, labelled `cpu stand-in` in every source; the numbers mean nothing
for a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _rate(value: float) -> float:
    """A rate kept to four significant digits: the planner refuses a zero rate, and the CPU stand-in's rates are
    far below one TFLOP/s, so rounding to fixed decimals would write 0."""
    return float(f"{value:.4g}")


def _git_head() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="35b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gemm-size", type=int, default=8192, help="n of the dense n x n x n matmul")
    ap.add_argument("--copy-layers", type=int, default=8, help="layers of the prefill the copies run under")
    ap.add_argument("--calls", type=int, default=10, help="back-to-back calls per timing")
    ap.add_argument("--reps", type=int, default=5, help="timings per part (the median is kept)")
    ap.add_argument("--link", default="none", help="a spec-sheet link for the profile: nvlink4, nvlink5, or none")
    ap.add_argument("--name", help="the profile's name (default: from the device)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench_gdn import wall_ms
    from jax_dwdp import kernels
    from jax_dwdp.config import REQUIRED_KEYS, ModelConfig
    from jax_dwdp.kernels import routing
    from jax_dwdp.model import init_model
    from jax_dwdp.model.moe import route
    from jax_dwdp.planner import LINKS, PROFILE_FORMAT, GpuProfile, calibrate_compute_loss

    if args.link not in ("none", *LINKS):
        ap.error(f"--link {args.link!r}: none or one of {', '.join(LINKS)}")
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    dtype = jnp.dtype(args.dtype)
    cfg = ModelConfig.preset(args.preset)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    where = (f"benchmarks/profile_gpu.py, {date}, {dev.device_kind}, commit {_git_head() or 'unknown'}"
             + ("" if gpu else ", cpu stand-in"))
    sync = jax.block_until_ready
    timing = dict(calls=args.calls, reps=args.reps)

    def jit_method(module, fn):
        graph, state = nnx.split(module)
        compiled = jax.jit(lambda s, *a: fn(nnx.merge(graph, s), *a))
        return lambda *a: compiled(state, *a)

    # Layers: one of each kind, and the MoE block, per token count.
    period = cfg.replace(num_hidden_layers=cfg.full_attention_interval)
    model = init_model(period, dtype=dtype, seed=0, device=dev)
    linear = next(layer for layer in model.layers if layer.layer_type == "linear_attention")
    full = next(layer for layer in model.layers if layer.layer_type == "full_attention")
    rng = np.random.default_rng(0)
    layers = {"linear_attention_mixer_ms": [], "full_attention_mixer_ms": [], "moe_ms": []}
    measured = {}
    for t in args.tokens:
        x = jax.device_put(jnp.asarray(rng.standard_normal((1, t, cfg.hidden_size)) * 0.5, dtype), dev)
        lengths = jax.device_put(jnp.array([t], jnp.int32), dev)
        positions = jax.device_put(jnp.arange(t, dtype=jnp.int32)[None], dev)
        lin = jit_method(linear, lambda m, x, p, n: m(x, p, n))
        fl = jit_method(full, lambda m, x, p, n: m(x, p, n))
        moe = jit_method(linear, lambda m, x: m.mlp(x))
        lin_ms = wall_ms(lambda: lin(x, positions, lengths), sync, **timing)
        full_ms = wall_ms(lambda: fl(x, positions, lengths), sync, **timing)
        moe_ms = wall_ms(lambda: moe(x), sync, **timing)
        measured[t] = (lin_ms, full_ms, moe_ms)
        for kind, layer_ms in (("linear_attention", lin_ms), ("full_attention", full_ms)):
            layers[f"{kind}_mixer_ms"].append({"tokens": t, "ms": round(max(layer_ms - moe_ms, 1e-3), 4),
                                               "source": f"{where}: {kind} layer {layer_ms:.4f} - MoE block "
                                                         f"{moe_ms:.4f} ms at {t} tokens"})
        layers["moe_ms"].append({"tokens": t, "ms": round(moe_ms, 4), "source": f"{where}: MoE block at {t} tokens"})
        print(f"tokens {t}: linear layer {lin_ms:.3f} ms, full layer {full_ms:.3f} ms, MoE block {moe_ms:.3f} ms",
              flush=True)

    # GEMM rates.
    n = args.gemm_size
    a = jax.device_put(jnp.asarray(rng.standard_normal((n, n)), dtype), dev)
    b = jax.device_put(jnp.asarray(rng.standard_normal((n, n)), dtype), dev)
    matmul = jax.jit(jnp.matmul)
    dense_ms = wall_ms(lambda: matmul(a, b), sync, **timing)
    dense_tflops = 2 * n**3 / (dense_ms * 1e-3) / 1e12
    t = max(args.tokens)
    mlp = linear.mlp
    flat = jax.device_put(jnp.asarray(rng.standard_normal((t, cfg.hidden_size)) * 0.5, dtype), dev)
    ids, _ = route(flat, mlp.gate.weight[...], cfg.num_experts_per_tok)
    order, inverse, sizes = jax.jit(lambda i: routing.expert_permutation(i, cfg.num_experts))(ids)
    k = cfg.num_experts_per_tok
    rows = t * k + (-t * k) % kernels.GROUPED_MATMUL_ROW_MULTIPLE
    sorted_rows = jax.jit(lambda f, o, i: kernels.dispatch_rows(f, o, i, k, rows))(flat, order, inverse)
    gemm = jax.jit(kernels.grouped_matmul)
    gate_up_w, down_w = mlp.experts.gate_up_proj[...], mlp.experts.down_proj[...]
    gate_up = gemm(sorted_rows, gate_up_w, sizes)
    act = gate_up[:, : gate_up.shape[1] // 2]
    gemm_ms = (wall_ms(lambda: gemm(sorted_rows, gate_up_w, sizes), sync, **timing)
               + wall_ms(lambda: gemm(act, down_w, sizes), sync, **timing))
    gemm_flops = 2 * t * k * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    grouped_tflops = gemm_flops / (gemm_ms * 1e-3) / 1e12
    print(f"dense {dense_tflops:.1f} TFLOP/s ({n}^3), grouped {grouped_tflops:.1f} TFLOP/s ({t} tokens)", flush=True)
    del model

    # The copy, alone and under compute.
    copy_cfg = cfg.first_layers(min(args.copy_layers, cfg.num_hidden_layers))
    copy = (gpu_copy if gpu else cpu_copy)(copy_cfg, dtype, dev, args)
    per_layer = {t: measured[t] for t in args.tokens}
    under = []
    for t in args.tokens:
        lin_ms, full_ms, moe_ms = per_layer[t]
        mixer = [(full_ms if kind == "full_attention" else lin_ms) - moe_ms for kind in copy_cfg.layer_types]
        mixer = [max(m, 1e-3) for m in mixer]
        c = copy["under"][t]
        slow = max(1.0, c["copy_under_ms"] / copy["idle_ms"])
        if gpu:  # the prefill with the copies, through the same two-stream model the planner predicts with
            scale = c["alone_ms"] / (sum(mixer) + moe_ms * len(mixer))  # this prefill's compute vs the parts'
            loss = calibrate_compute_loss([m * scale for m in mixer], [moe_ms * scale] * len(mixer),
                                          copy["idle_ms"], slow, c["with_copy_ms"])
        else:  # a copy thread running through the whole prefill
            loss = min(0.95, max(0.0, (c["with_copy_ms"] - c["alone_ms"]) / c["with_copy_ms"]))
        under.append({"tokens": t, "copy_slowdown": round(slow, 4), "compute_loss": round(loss, 4),
                      "source": (f"{where}: {copy['how']}; copy {c['copy_under_ms']:.4f} ms under compute / "
                                 f"{copy['idle_ms']:.4f} ms idle; prefill of {len(mixer)} layers {c['alone_ms']:.3f} "
                                 f"ms alone, {c['with_copy_ms']:.3f} ms with the copies")})
        print(f"tokens {t}: copy {copy['idle_ms']:.3f} ms idle, {c['copy_under_ms']:.3f} under compute; prefill "
              f"{c['alone_ms']:.3f} -> {c['with_copy_ms']:.3f} ms", flush=True)

    memory = dev.memory_stats().get("bytes_limit") if gpu and dev.memory_stats() else None
    if memory is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    link = None
    if args.link != "none":
        link = {k: v for k, v in LINKS[args.link].to_json().items()}
    profile = {
        "format": PROFILE_FORMAT, "name": args.name or dev.device_kind.lower().replace(" ", "-"),
        "device": dev.device_kind, "date": date, "code": _git_head(),
        "machine": f"{dev.platform}, {jax.device_count()} device(s), jax {jax.__version__}",
        "model": {"name": args.preset, "config": {k: getattr(cfg, k) for k in REQUIRED_KEYS
                                                  if k != "num_hidden_layers"}},
        "dtype": dtype.name,
        "memory_gib": {"value": round(memory / 2**30, 1),
                       "source": f"{where}: " + ("XLA's bytes_limit" if gpu else "the host's memory (cpu stand-in)")},
        "layers": layers,
        "gemm": {"dense_tflops": {"value": _rate(dense_tflops), "source": f"{where}: {n}^3 matmul, {dense_ms:.4f} ms"},
                 "grouped_tflops": {"value": _rate(grouped_tflops),
                                    "source": f"{where}: gate_up + down grouped GEMMs at {t} tokens, {gemm_ms:.4f} ms"}},
        "copy": {"alone_gib_s": {"value": _rate(copy["bytes"] / 2**30 / (copy["idle_ms"] * 1e-3)),
                                 "source": f"{where}: {copy['how']}, {copy['bytes']} bytes in {copy['idle_ms']:.4f} ms"},
                 "under_compute": under},
        "link": link,
        "notes": ["Written by benchmarks/profile_gpu.py on one device" + ("" if gpu else " (CPU: a stand-in)") + "; "
                  + ("the link is the spec sheet's (one GPU cannot measure it)" if link else "no link: give --link")],
    }
    GpuProfile.from_json(profile, str(args.out))  # the planner reads what was written
    args.out.write_text(json.dumps(profile, indent=1) + "\n")
    print(f"wrote {args.out}")
    return profile


def _prefill_ms(runner, tokens, lengths, reps: int) -> float:
    import jax

    run = lambda: runner(tokens, lengths, logits="last", mode="layerwise")  # noqa: E731
    jax.block_until_ready(run())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def gpu_copy(cfg, dtype, dev, args) -> dict:
    """The store's copy on one GPU (ranks 0 and 1 of one store on this device), idle and under a layer-wise prefill
    that reads the store in place, against the same prefill with the layers' own experts."""
    from bench_dwdp import copy_only, store_pair

    from jax_dwdp.model import init_model
    from jax_dwdp.parallel.expert_layout import ExpertLayout, rank_memory
    from jax_dwdp.runner import StageRunner
    from jax_dwdp.sources import FfiStoreSource, LocalSource

    model = init_model(cfg, dtype=dtype, seed=1, device=dev)
    peer = rank_memory(cfg, ExpertLayout(cfg.num_experts, 2), 0, 1, dtype.itemsize)["peer_bytes_per_layer"]
    stores, _ = store_pair(model, cfg, dtype, in_place=True)
    out = {"under": {}, "bytes": peer, "how": "the VMM store's copy of a layer's peer block, HBM to HBM on one GPU"}
    try:
        local = StageRunner(model, LocalSource(), device=dev)
        store_runner = StageRunner(model, FfiStoreSource(stores[0]), device=dev)
        rng = np.random.default_rng(0)
        for t in args.tokens:
            tokens = rng.integers(0, cfg.vocab_size, (1, t)).astype(np.int32)
            lengths = np.full((1,), t, np.int32)
            alone = _prefill_ms(local, tokens, lengths, args.reps)
            with_copy = _prefill_ms(store_runner, tokens, lengths, args.reps)
            under = float(np.nanmean(stores[0].copy_ms()))
            copy_only(store_runner, stores[0], tokens)
            out["idle_ms"] = float(np.nanmean(stores[0].copy_ms()))
            out["under"][t] = {"alone_ms": alone, "with_copy_ms": with_copy, "copy_under_ms": under}
    finally:
        for store in stores:
            store.close()
    return out


def cpu_copy(cfg, dtype, dev, args) -> dict:
    """CPU stand-in: a host thread copying a layer's peer bytes over and over (numpy) while a layer-wise prefill
    runs, against the copies alone and the prefill alone."""
    from jax_dwdp.model import init_model
    from jax_dwdp.parallel.expert_layout import ExpertLayout, rank_memory
    from jax_dwdp.runner import StageRunner
    from jax_dwdp.sources import LocalSource

    model = init_model(cfg, dtype=dtype, seed=1, device=dev)
    peer = rank_memory(cfg, ExpertLayout(cfg.num_experts, 2), 0, 1, dtype.itemsize)["peer_bytes_per_layer"]
    src = np.ones(max(peer, 1 << 20), np.uint8)
    dst = np.empty_like(src)

    def copies(n: int) -> list[float]:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    idle = float(np.median(copies(20)))
    out = {"under": {}, "bytes": src.nbytes, "idle_ms": idle,
           "how": "cpu stand-in: a host thread's numpy copy of a layer's peer bytes"}
    runner = StageRunner(model, LocalSource(), device=dev)
    rng = np.random.default_rng(0)
    for t in args.tokens:
        tokens = rng.integers(0, cfg.vocab_size, (1, t)).astype(np.int32)
        lengths = np.full((1,), t, np.int32)
        alone = _prefill_ms(runner, tokens, lengths, args.reps)
        stop, seen = threading.Event(), []

        def loop():
            while not stop.is_set():
                seen.extend(copies(1))

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        try:
            with_copy = _prefill_ms(runner, tokens, lengths, args.reps)
        finally:
            stop.set()
            thread.join()
        out["under"][t] = {"alone_ms": alone, "with_copy_ms": with_copy,
                           "copy_under_ms": float(np.median(seen)) if seen else idle}
    return out


if __name__ == "__main__":
    main()

"""DWDP side by side on N GPUs, one process: (a) FFI DWDP, (b) XLA all-gather DWDP, (c) replicated weights.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_dwdp.py --num-layers 16 --seq-lens 16384 32768

Every rank prefills its own sequence of T tokens (batch 1 per rank; the ranks share no tokens):
- (a) `Store` experts: each rank stores 1/N of every layer's experts in CUDA VMM memory; layer l+1's experts are
  copied from the peers over NVLink on a side stream while layer l computes.
- (b) `Gather` experts: the same program structure, layer l+1's experts all-gathered inside layer l's program.
- (c) replicated: `Local` experts, every GPU holding all of them and running its own sequence in the same SPMD
  program structure (no communication: the bound).
All three are one StageRunner over the 'dwdp' mesh, layer-wise (one compiled program per layer type). Per layer it reports the FFI copy time (CUDA events on the copy
stream), the MoE compute time (the MoE block alone, same tokens), and the fraction of copy time hidden:
1 - max(0, t_ffi - t_replicated) / total copy time. The XLA allocator must not preallocate (the store allocates
outside XLA's pool), hence XLA_PYTHON_CLIENT_PREALLOCATE=false for all three.
"""

from __future__ import annotations

import argparse
import gc
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.parallel.dwdp import expert_blocks, place_model
from jax_dwdp.parallel.expert_layout import ExpertLayout, rank_memory
from jax_dwdp.parallel.experts import AXIS, Gather, Local, Store
from jax_dwdp.parallel.mesh import make_mesh
from jax_dwdp.parallel.runner import StageRunner
from jax_dwdp.timing import median_seconds, save_rows


def _tokens(cfg, ranks, seq, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab_size, (ranks, seq)).astype(np.int32), np.full((ranks,), seq, np.int32))


def _time(fn, iters):
    jax.block_until_ready(fn())  # warm-up (the first call compiles)
    seconds, _ = median_seconds(fn, iters)
    return seconds


def _moe_ms(cfg, seq, device, iters):
    """The MoE block alone (router, routed experts, shared expert) on `seq` tokens of one GPU."""
    from flax import nnx

    model = init_model(cfg.replace(num_hidden_layers=1), dtype=jnp.bfloat16, seed=7, device=device)
    graphdef, state = nnx.split(model.layers[0].mlp)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (1, seq, cfg.hidden_size), jnp.bfloat16), device)
    run = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    t = _time(lambda: run(state, x), iters)
    del model
    return t * 1e3


def bench(cfg, ranks, seqs, iters, variants):
    devices = jax.devices()[:ranks]
    mesh = jax.sharding.Mesh(make_mesh(1, ranks, devices).devices[0], (AXIS,))
    rows = {seq: {"seq_len_per_rank": seq, "ranks": ranks, "layers": cfg.num_hidden_layers} for seq in seqs}

    for variant in variants:
        t0 = time.perf_counter()
        model = init_model(cfg, dtype=jnp.bfloat16, seed=1, device=devices[0])
        placed = place_model(model, mesh, split_experts=variant != "replicated")
        del model
        gc.collect()
        store = None
        if variant == "ffi":  # timed copies: store.copy_ms() reads each layer's copy time
            from jax_dwdp.parallel.dwdp_ffi import ExpertStore

            store = ExpertStore.from_sharded(expert_blocks(placed), cfg.num_experts, timing=True)
            source = Store(store, mesh)
        else:
            source = Gather(expert_blocks(placed), mesh) if variant == "xla" else Local()
        program = StageRunner(placed, source, mesh=mesh)
        del placed, source

        def make_run(seq):
            tokens, lengths = _tokens(cfg, ranks, seq)
            return lambda: program(tokens, lengths, logits="last")
        setup_s = time.perf_counter() - t0
        for seq in seqs:
            run = make_run(seq)
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            first_s = time.perf_counter() - t0
            ms = _time(run, iters) * 1e3
            row = rows[seq]
            row[f"{variant}_ms"] = round(ms, 2)
            row[f"{variant}_first_call_s"] = round(first_s, 1)
            row[f"{variant}_setup_s"] = round(setup_s, 1)
            if store is not None:
                copy = store.copy_ms()  # [ranks, layers], of the last timed run
                row["ffi_copy_ms_per_layer"] = round(float(np.nanmean(copy)), 3)
                row["ffi_copy_ms_total"] = round(float(np.nanmean(copy.sum(axis=1))), 2)
                row["store"] = store.info()
                copy_only(program, store, _tokens(cfg, ranks, seq)[0])
                idle = store.copy_ms()
                row["ffi_copy_ms_per_layer_idle"] = round(float(np.nanmean(idle)), 3)
                peer = rank_memory(cfg, ExpertLayout(cfg.num_experts, ranks), 0, 1,
                                   store.dtype.itemsize)["peer_bytes_per_layer"]  # rank 0's
                row["ffi_peer_gib_per_layer"] = round(peer / 2**30, 3)
            print(f"{variant:>10} T={seq:>6}: {ms:9.2f} ms (first call {first_s:.1f} s)", flush=True)
        if store is not None:
            store.close()
        del make_run
        program = store = None
        gc.collect()

    for seq in seqs:
        row = rows[seq]
        row["moe_ms_per_layer"] = round(_moe_ms(cfg, seq, devices[0], iters), 3)
        if "replicated_ms" in row:
            rep = row["replicated_ms"]
            row["layer_ms_replicated"] = round(rep / cfg.num_hidden_layers, 3)
            row["tokens_per_s_replicated"] = round(ranks * seq / rep * 1e3)
            for v in ("ffi", "xla"):
                if f"{v}_ms" in row:
                    row[f"{v}_vs_replicated"] = round(row[f"{v}_ms"] / rep, 3)
            if "ffi_ms" in row:
                exposed = max(0.0, row["ffi_ms"] - rep)
                row["ffi_copy_hidden_fraction"] = round(1 - min(1.0, exposed / row["ffi_copy_ms_total"]), 3)
        if "ffi_ms" in row and "xla_ms" in row:
            row["ffi_vs_xla"] = round(row["ffi_ms"] / row["xla_ms"], 3)
    return list(rows.values())


def copy_only(runner: StageRunner, store, tokens) -> None:
    """Every layer's prefetch with no compute around it; store.copy_ms() then holds the copy times of an idle GPU."""
    h = runner.program("embed")(runner.state, runner.place(tokens))
    for i in range(store.num_layers):
        jax.block_until_ready(runner.source.prefetch(i, h))
        store.sync()  # nobody waits for these copies: finish them before their outputs are freed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="35b-a3b")
    ap.add_argument("--num-layers", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--variants", nargs="+", default=["ffi", "xla", "replicated"],
                    choices=["ffi", "xla", "replicated"])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    cfg = ModelConfig.preset(args.preset).replace(num_hidden_layers=args.num_layers)
    rows = bench(cfg, args.ranks, args.seq_lens, args.iters, args.variants)
    print(f"\n{args.preset}, {args.num_layers} layers, {args.ranks} x {jax.devices()[0].device_kind}, one sequence "
          "per rank (ms per prefill; ratios vs replicated weights)")
    print("| tokens/rank | (a) FFI | (b) XLA | (c) replicated | a/c | b/c | a/b | copy ms/layer (under compute) "
          "| copy ms/layer (idle GPU) | MoE ms/layer | layer ms (c) | copy hidden |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        g = r.get
        print(f"| {r['seq_len_per_rank']} | {g('ffi_ms')} | {g('xla_ms')} | {g('replicated_ms')} | "
              f"{g('ffi_vs_replicated')} | {g('xla_vs_replicated')} | {g('ffi_vs_xla')} | {g('ffi_copy_ms_per_layer')} "
              f"| {g('ffi_copy_ms_per_layer_idle')} | {g('moe_ms_per_layer')} | {g('layer_ms_replicated')} | {g('ffi_copy_hidden_fraction')} |")
    save_rows(args.out, rows, args)


if __name__ == "__main__":
    main()

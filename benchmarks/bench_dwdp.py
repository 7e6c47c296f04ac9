"""DWDP measurements: what moving the experts to the tokens costs, one subcommand per question.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_dwdp.py stage --num-layers 16 --seq-lens 16384 32768
    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_dwdp.py ranks --num-layers 8 --seq-len 16384 --ffi
    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_dwdp.py dispatch --num-layers 8 --seq-len 16384
    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_dwdp.py layouts --num-layers 16 --seq-len 16384 \
        --sequences 8 --layouts 2x2:ffi 2x1 1x4:ffi 1x4:xla
    XLA_PYTHON_CLIENT_PREALLOCATE=false python benchmarks/bench_dwdp.py in-place --num-layers 8 \
        --seq-lens 4096 16384 32768

stage: one stage's N ranks in one SPMD program, every rank prefilling its own sequence of T tokens (batch 1 per
  rank): (a) `FfiStoreSource` experts (FFI): each rank stores 1/N of every layer's experts in CUDA VMM memory, layer l+1's
  copied from the peers over NVLink on a side stream while layer l computes; (b) `XlaGatherSource` experts (XLA): layer
  l+1's experts all-gathered inside layer l's program; (c) replicated, `LocalSource` experts: every GPU holds all of them
  (no communication: the bound). All three are one StageRunner over the 'dwdp' mesh, layer-wise. Per layer it
  reports the FFI copy time (CUDA events on the copy stream) under compute and on an idle GPU, the MoE block alone
  on the same tokens, and the fraction of copy time hidden: 1 - max(0, t_ffi - t_replicated) / total copy time.
  Where FFI's time over (c) goes, three more `--variants`, each its own ExpertSource over the same store (defined
  here, not in jax_dwdp; on GPUs only):
    ffi-nowait  TIMING-ONLY PROBE, WRONG NUMBERS ON PURPOSE: the copies run exactly as in (a), but the MoE takes
                the prefetch outputs without the wait custom call, so it may read experts still being copied. Its
                results are never checked (only whether the logits are finite: NaN routing would make its timing
                meaningless). Every prefetch output is kept alive until the prefill has ended and store.sync() has
                waited for the copies (inside the timed call), so no copy outlives its buffer. After the warm-up
                a buffer most likely holds an earlier run's copy of the same layer (the allocations repeat run to
                run), so the routing stays that of real weights.
    ffi-unused  TIMING-ONLY PROBE: the MoE computes on replicated weights (as in (c)) while the store's copies of
                every layer still run, with no wait: the copies' cost to the compute (HBM and NVLink contention)
                alone. Outputs kept alive and synced as for ffi-nowait.
    ffi-depth2  a correct variant: prefetch depth 2, layer l+2's copy enqueued before layer l (three layers'
                experts in buffers), by a source wrapper that runs one layer ahead of the runner's l+1 prefetch.
  Reading them (per layer = difference / layers): stall = ffi - ffi-nowait, the time the MoE waits for its
  experts; contention = ffi-unused - (c), the copies slowing the compute. ffi-nowait ~ (c) => the gap is the wait
  stalling (the copy starts late or runs long: depth 2 should then close it); ffi-unused ~ ffi => the gap is
  contention (no schedule helps; only fewer bytes: ffi/README.md, "Next: not copying the rank's own block").
  ffi-nowait and ffi-unused are both wait-free and differ only in which buffers the MoE reads, so they should
  agree; ffi-depth2 ~ ffi-nowait => starting the copy a layer earlier removes the stall.
ranks: independent ranks (each its own programs on its own device): one rank alone, all ranks dispatched in turn
  from one thread and from one thread each (`prefill_all`; ~1.0x one rank when they run concurrently), the host
  time to enqueue one rank's prefill; --ffi: the same ranks on the FFI store; then one whole-model SPMD program
  over XLA (all-gathered experts) and the replicated bound on one device.
dispatch: host time of one independent rank's layer-wise prefill, split by call (jitted programs, device_put, eager
  jnp ops, the expert source's prefetch), each call wrapped in a host timer with no device sync inside. A call that
  blocks on the device shows as large host time on few calls. The module functions it wraps are put back at the
  end. One rank at a time: the timers are not thread-safe.
layouts: pipeline P x DWDP N side by side (issue 7) on the same sequences, microbatches of N sequences (one per
  rank): ms per prefill, tokens/s and tokens/s per GPU.
in-place: ONE GPU, rank 0 of a two-rank store whose rank 1 lives in the same process on the same device (its
  "peer" copy is HBM to HBM): the layer-wise prefill of one sequence with the layers' own experts (local), through
  the store read in place with its copy stream recording events but copying nothing (in-place-nolink: the store's
  cost with the link hop taken away; slots filled by one earlier prefill), read in place with the peer copy
  (in-place: each layer's prefetch inside the program of the layer before; in-place-own-program: each a program
  of its own, launched before the layer before is enqueued), and copied out as the store did before it read in place (copy-out: both blocks copied into XLA
  buffers, the own one HBM to HBM). Per row ms and ratios to local, the copy time per layer, and the device memory:
  each store's bytes (the driver's) and XLA's peak after the in-place variants and after copy-out.

Without a subcommand the arguments go to `stage` (the command lines recorded in RESULTS.md before the merge). Each
subcommand writes JSON with --out: {"what", "args", "device", "rows"}; dispatch writes {"args", "device",
"dispatch_ms", "wall_ms", "calls"}. On a GPU, XLA_PYTHON_CLIENT_PREALLOCATE=false: the store allocates outside
XLA's pool. On a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N, without the FFI variants.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_dwdp.prefill as prefill_module
from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.parallel import Pipeline
from jax_dwdp.parallel.dwdp import IndependentRanks
from jax_dwdp.parallel.placement import expert_blocks, place_model
from jax_dwdp.parallel.expert_layout import ExpertLayout, rank_memory
from jax_dwdp.sources import AXIS, XlaGatherSource, LocalSource, FfiStoreSource
from jax_dwdp.devices import make_mesh
from jax_dwdp.runner import StageRunner
from jax_dwdp.timing import median_seconds, save_rows


def random_tokens(cfg, rows, seq, seed):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (rows, seq)).astype(np.int32)


def timed(fn, iters):
    """Median seconds of fn() after one warm-up call (the first call compiles)."""
    jax.block_until_ready(fn())
    return median_seconds(fn, iters)[0]


# --- stage: FFI vs XLA vs replicated on one stage's N ranks -----------------------------------------------------

def moe_ms(cfg, seq, device, dtype, iters):
    """The MoE block alone (router, routed experts, shared expert) on `seq` tokens of one device."""
    from flax import nnx

    model = init_model(cfg.replace(num_hidden_layers=1), dtype=dtype, seed=7, device=device)
    graphdef, state = nnx.split(model.layers[0].mlp)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (1, seq, cfg.hidden_size), dtype), device)
    run = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    t = timed(lambda: run(state, x), iters)
    del model
    return t * 1e3


def copy_only(runner: StageRunner, store, tokens) -> None:
    """Every layer's prefetch with no compute around it; store.copy_ms() then holds the copy times of an idle GPU."""
    h = runner.program("embed")(runner.shell_state, *runner.place(tokens))
    for i in range(store.num_layers):
        jax.block_until_ready(runner.source.fetch_now(i, h))
        store.sync()  # nobody waits for these copies: finish them before their outputs are freed


# The probes of the FFI path (see the module doc): sources over the same store, local to this benchmark.

class NoWait(FfiStoreSource):
    """ffi-nowait, a TIMING-ONLY probe whose numbers are wrong on purpose: the copies run as in `FfiStoreSource`, but the
    MoE takes the prefetch outputs without the wait custom call. Every output is held until `settle` (after the
    prefill), which waits for the copies first: a copy must never write into a buffer XLA has freed."""

    timing_only = True

    def __init__(self, store, mesh=None):
        super().__init__(store, mesh)
        self.held = []

    def fetch_now(self, index, h):
        out = super().fetch_now(index, h)
        self.held.append(out)
        return out

    def experts(self, pending):
        return pending  # no dwdp_wait: the MoE may read experts still being copied

    def settle(self):
        """After a prefill (its outputs ready): wait for every copy, forget the unwaited prefetches, free them."""
        self.store.sync()
        self.held.clear()

    def abort(self):
        self.settle()


class Unused(NoWait):
    """ffi-unused, a TIMING-ONLY probe: the MoE computes on the layers' own (replicated) experts while the store
    still copies every layer's experts, unwaited: the copies' contention with the compute, alone."""

    replaces_experts = False  # the runner keeps the model's replicated experts, which the MoE reads

    def experts(self, pending):
        return None


class Ahead(FfiStoreSource):
    """ffi-depth2: prefetch depth `depth`. The runner asks for layer l+1 right before enqueuing layer l; this
    source then starts layer l + depth's copy and hands over layer l+1's, started depth - 1 layers earlier. Each
    copy still waits (the write-after-read guard) for everything enqueued before it, and the MoE waits for its copy
    as in `FfiStoreSource`; depth + 1 layers' experts are in slots at a time. Each prefetch is a program of its own
    (not inside the layer before's). Needs no change to the runner."""

    def __init__(self, store, mesh=None, depth: int = 2):
        super().__init__(store, mesh)
        self.depth, self.started, self.gathers = depth, {}, False

    def first(self, h):
        self.started = {i: self.fetch_now(i, h) for i in range(min(self.depth, self.store.num_layers))}
        return self.started.pop(0)

    def prefetch(self, index, h):
        start = index + self.depth - 1
        if start < self.store.num_layers:
            self.started[start] = self.fetch_now(start, h)
        return self.started.pop(index)

    def abort(self):
        super().abort()
        self.started = {}


STORE_SOURCES = {"ffi": FfiStoreSource, "ffi-copy": FfiStoreSource, "ffi-nowait": NoWait, "ffi-unused": Unused,
                 "ffi-depth2": Ahead}
VARIANTS = ("ffi", "xla", "replicated", *list(STORE_SOURCES)[1:])


# The store each variant needs: the probes never wait for their prefetches, which only a store copying out allows (in
# place, a prefetch refuses to refill a slot set whose layer is not waited for); depth 2 holds three layers in flight.
STORE_OPTIONS = {"ffi-copy": dict(in_place=False), "ffi-nowait": dict(in_place=False),
                 "ffi-unused": dict(in_place=False), "ffi-depth2": dict(slot_sets=3)}


def make_store(placed, cfg, *, delete: bool = True, **options):
    """A CUDA VMM store of a placed model's split experts, each layer's copy timed (delete: the model's expert
    arrays are moved into it). A function of its own so that the CPU test can put a stand-in here."""
    from jax_dwdp.parallel.dwdp_ffi import ExpertStore

    return ExpertStore.from_sharded(expert_blocks(placed), cfg.num_experts, delete=delete, timing=True, **options)


def stage_program(cfg, variant, mesh, dtype):
    """(StageRunner, store or None) for one variant, the model made afresh (seed 1: every variant's weights)."""
    model = init_model(cfg, dtype=dtype, seed=1, device=mesh.devices.flat[0])
    store = None
    if variant == "ffi-unused":  # the runner's model keeps all experts; the store gets a split copy of them
        placed = place_model(model, mesh, split_experts=False)
        split = place_model(model, mesh, split_experts=True)
        # (a shard may share the model's buffers: drop, not delete)
        store = make_store(split, cfg, delete=False, **STORE_OPTIONS[variant])
        del split
    else:
        placed = place_model(model, mesh, split_experts=variant != "replicated")
        if variant in STORE_SOURCES:
            store = make_store(placed, cfg, **STORE_OPTIONS.get(variant, {}))
    del model
    gc.collect()
    if store is not None:
        source = STORE_SOURCES[variant](store, mesh)
    else:
        source = XlaGatherSource(expert_blocks(placed), mesh) if variant == "xla" else LocalSource()
    return StageRunner(placed, source, mesh=mesh), store


def bench_stage(cfg, args) -> list[dict]:
    ranks, seqs, iters, dtype = args.ranks, args.seq_lens, args.iters, jnp.dtype(args.dtype)
    devices = jax.devices()[:ranks]
    mesh = jax.sharding.Mesh(make_mesh(1, ranks, devices).devices[0], (AXIS,))
    rows = {seq: {"seq_len_per_rank": seq, "ranks": ranks, "layers": cfg.num_hidden_layers} for seq in seqs}

    def inputs(seq):
        return random_tokens(cfg, ranks, seq, seed=0), np.full((ranks,), seq, np.int32)

    for variant in args.variants:
        key = variant.replace("-", "_")  # JSON keys: ffi_nowait_ms, ...
        t0 = time.perf_counter()
        program, store = stage_program(cfg, variant, mesh, dtype)
        settle = getattr(program.source, "settle", None)
        setup_s = time.perf_counter() - t0
        for seq in seqs:
            tokens, lengths = inputs(seq)

            def run():
                out = program(tokens, lengths, logits="last", mode="layerwise")
                if settle is not None:  # the probes: the prefill ends when its copies have (timed)
                    jax.block_until_ready(out)
                    settle()
                return out
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            first_s = time.perf_counter() - t0
            ms = timed(run, iters) * 1e3
            row = rows[seq]
            row[f"{key}_ms"] = round(ms, 2)
            row[f"{key}_first_call_s"] = round(first_s, 1)
            row[f"{key}_setup_s"] = round(setup_s, 1)
            if getattr(program.source, "timing_only", False):
                logits = np.asarray(run()[0], np.float32)
                row[f"{key}_logits_finite"] = bool(np.isfinite(logits).all())  # not a check: NaN would skew routing
                row.setdefault("timing_only", []).append(variant)
            if store is not None and variant != "ffi":
                row[f"{key}_copy_ms_per_layer"] = round(float(np.nanmean(store.copy_ms())), 3)
            if variant == "ffi":
                copy = store.copy_ms()  # [ranks, layers], of the last timed run
                row["ffi_copy_ms_per_layer"] = round(float(np.nanmean(copy)), 3)
                row["ffi_copy_ms_total"] = round(float(np.nanmean(copy.sum(axis=1))), 2)
                row["store"] = store.info()
                copy_only(program, store, tokens)
                idle = store.copy_ms()
                row["ffi_copy_ms_per_layer_idle"] = round(float(np.nanmean(idle)), 3)
                peer = rank_memory(cfg, ExpertLayout(cfg.num_experts, ranks), 0, 1,
                                   store.dtype.itemsize)["peer_bytes_per_layer"]  # rank 0's
                row["ffi_peer_gib_per_layer"] = round(peer / 2**30, 3)
            print(f"{variant:>10} T={seq:>6}: {ms:9.2f} ms (first call {first_s:.1f} s)", flush=True)
        if store is not None:
            store.close()
        program = store = None
        gc.collect()

    for seq in seqs:
        row = rows[seq]
        row["moe_ms_per_layer"] = round(moe_ms(cfg, seq, devices[0], dtype, iters), 3)
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
        attribute(row, cfg.num_hidden_layers)
    rows = list(rows.values())
    print(f"\n{args.preset}, {cfg.num_hidden_layers} layers, {ranks} x {devices[0].device_kind}, one sequence "
          "per rank (ms per prefill; ratios vs replicated weights)")
    print("| tokens/rank | (a) FFI | (b) XLA | (c) replicated | a/c | b/c | a/b | copy ms/layer (under compute) "
          "| copy ms/layer (idle GPU) | MoE ms/layer | layer ms (c) | copy hidden |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        g = r.get
        print(f"| {r['seq_len_per_rank']} | {g('ffi_ms')} | {g('xla_ms')} | {g('replicated_ms')} | "
              f"{g('ffi_vs_replicated')} | {g('xla_vs_replicated')} | {g('ffi_vs_xla')} | {g('ffi_copy_ms_per_layer')} "
              f"| {g('ffi_copy_ms_per_layer_idle')} | {g('moe_ms_per_layer')} | {g('layer_ms_replicated')} "
              f"| {g('ffi_copy_hidden_fraction')} |")
    if any(f"{v.replace('-', '_')}_ms" in r for r in rows for v in PROBES):
        print_attribution(rows)
    return rows


PROBES = ("ffi-nowait", "ffi-unused", "ffi-depth2")


def attribute(row: dict, layers: int) -> None:
    """The probes' ratios to (c) and to (a), and the per-layer stall and contention (see the module doc)."""
    rep, ffi = row.get("replicated_ms"), row.get("ffi_ms")
    for v in PROBES:
        key = v.replace("-", "_")
        if f"{key}_ms" not in row:
            continue
        if rep:
            row[f"{key}_vs_replicated"] = round(row[f"{key}_ms"] / rep, 3)
        if ffi:
            row[f"{key}_vs_ffi"] = round(row[f"{key}_ms"] / ffi, 3)
    if ffi and "ffi_nowait_ms" in row:
        row["ffi_stall_ms_per_layer"] = round((ffi - row["ffi_nowait_ms"]) / layers, 3)
    if rep and "ffi_unused_ms" in row:
        row["ffi_contention_ms_per_layer"] = round((row["ffi_unused_ms"] - rep) / layers, 3)
    if rep and ffi:
        row["ffi_over_replicated_ms_per_layer"] = round((ffi - rep) / layers, 3)


def print_attribution(rows) -> None:
    print("\nWhere (a)'s time over (c) goes (ms per prefill; ratios vs (c); per layer: difference / layers). "
          "ffi-nowait and ffi-unused are timing-only probes (wrong results on purpose, never checked).")
    print("| tokens/rank | (a) ffi | nowait | unused | depth2 | (c) | a/c | nowait/c | unused/c | depth2/c "
          "| a - c ms/layer | stall (a - nowait) ms/layer | contention (unused - c) ms/layer "
          "| copy ms/layer a, nowait, unused, depth2 | probe logits finite |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in rows:
        g = r.get
        copies = ", ".join(str(g(f"{k}_copy_ms_per_layer")) for k in ("ffi", "ffi_nowait", "ffi_unused", "ffi_depth2"))
        finite = ", ".join(f"{k}: {g(f'{k}_logits_finite')}" for k in ("ffi_nowait", "ffi_unused")
                           if f"{k}_logits_finite" in r)
        print(f"| {r['seq_len_per_rank']} | {g('ffi_ms')} | {g('ffi_nowait_ms')} | {g('ffi_unused_ms')} "
              f"| {g('ffi_depth2_ms')} | {g('replicated_ms')} | {g('ffi_vs_replicated')} "
              f"| {g('ffi_nowait_vs_replicated')} | {g('ffi_unused_vs_replicated')} | {g('ffi_depth2_vs_replicated')} "
              f"| {g('ffi_over_replicated_ms_per_layer')} | {g('ffi_stall_ms_per_layer')} "
              f"| {g('ffi_contention_ms_per_layer')} | {copies} | {finite} |")


# --- ranks: independent ranks, concurrency, the FFI store, XLA DWDP ---------------------------------------------

def bench_ranks(cfg, args) -> list[dict]:
    n, iters = args.ranks, args.iters
    devices = jax.devices()[:n]
    model = init_model(cfg, dtype=jnp.dtype(args.dtype), seed=0, device=devices[0])
    tokens = random_tokens(cfg, n, args.seq_len, seed=1)
    lens = np.full((n,), args.seq_len, np.int32)
    replicated = Pipeline.from_model(model, 1, devices=devices[:1])
    t_rep = timed(lambda: replicated.prefill(tokens[:1], lens[:1], logits="last"), iters)
    row = dict(tokens_per_rank=args.seq_len, layers=cfg.num_hidden_layers, replicated_ms=round(t_rep * 1e3, 2))
    print(json.dumps(row), flush=True)
    work = {r: (tokens[r:r + 1], lens[r:r + 1]) for r in range(n)}
    with IndependentRanks(model, devices) as ranks:
        t_one = timed(lambda: ranks.prefill(0, *work[0], logits="last"), iters)
        row.update(independent_one_rank_ms=round(t_one * 1e3, 2))
        t_ind = timed(lambda: [ranks.prefill(r, *work[r], logits="last") for r in range(n)], iters)
        # ~1.0 when the ranks run concurrently, ~N when they run one after the other.
        row.update(independent_ms=round(t_ind * 1e3, 2), independent_vs_one_rank=round(t_ind / t_one, 3))
        dispatch = []  # host time to enqueue one rank's whole prefill (the call returns before the device is done)
        for _ in range(iters):
            t0 = time.perf_counter()
            out = ranks.prefill(0, *work[0], logits="last")
            dispatch.append(time.perf_counter() - t0)
            jax.block_until_ready(out)
        t_thr = timed(lambda: ranks.prefill_all(work, logits="last"), iters)
    row.update(dispatch_one_rank_ms=round(float(np.median(dispatch)) * 1e3, 2),
               independent_threads_ms=round(t_thr * 1e3, 2), independent_threads_vs_one_rank=round(t_thr / t_one, 3))
    print(json.dumps(row), flush=True)
    if args.ffi:  # the same independent ranks with peer experts read through the CUDA VMM store
        with IndependentRanks(model, devices, experts="ffi") as ffi_ranks:
            t_ffi = timed(lambda: [ffi_ranks.prefill(r, *work[r], logits="last") for r in range(n)], iters)
            t_ffi_thr = timed(lambda: ffi_ranks.prefill_all(work, logits="last"), iters)
        row.update(independent_ffi_ms=round(t_ffi * 1e3, 2), independent_ffi_vs_replicated=round(t_ffi / t_rep, 3),
                   independent_ffi_threads_ms=round(t_ffi_thr * 1e3, 2),
                   independent_ffi_threads_vs_replicated=round(t_ffi_thr / t_rep, 3))
        print(json.dumps(row), flush=True)
    if not args.skip_xla_dwdp:
        dw = Pipeline.from_model(model, 1, dwdp=n, devices=devices)
        t_xla = timed(lambda: dw.prefill(tokens, lens, logits="last"), iters)
        row.update(xla_dwdp_ms=round(t_xla * 1e3, 2), xla_vs_replicated=round(t_xla / t_rep, 3),
                   independent_vs_replicated=round(t_ind / t_rep, 3))
        print(json.dumps(row), flush=True)
    return [row]


# --- dispatch: one rank's host time, by call ---------------------------------------------------------------------

TIMES: dict[str, list[float]] = collections.defaultdict(list)
_depth = [0]  # time only the outermost wrapped call (device_put inside a timed call is part of that call)


def timed_call(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _depth[0]:
            return fn(*args, **kwargs)
        _depth[0] += 1
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name].append(time.perf_counter() - t0)
            _depth[0] -= 1
    return wrapper


def instrument(ranks: IndependentRanks) -> list:
    """Wraps every call IndependentRanks.prefill makes that can take host time; returns the module functions to
    restore (the driver's own attributes stay wrapped until it is closed)."""
    undo = []
    for module, name in [(prefill_module, "check_tokens"), (jax, "device_put"), (jnp, "pad"), (jnp, "stack"),
                         (jnp, "zeros")]:
        undo.append((module, name, getattr(module, name)))
        setattr(module, name, timed_call(name, getattr(module, name)))
    for runner in ranks.runners:
        program = runner.program

        def timed_program(kind, *key, program=program):
            return timed_call(f"{kind} program", program(kind, *key))
        runner.program = timed_program
    ranks.source.prefetch = timed_call("expert prefetch (peer copies or store program)", ranks.source.prefetch)
    return undo


def bench_dispatch(cfg, args) -> dict:
    devices = jax.devices()[:2]
    if len(devices) < 2:
        raise SystemExit("needs two devices (on the CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    model = init_model(cfg, dtype=jnp.dtype(args.dtype), seed=0, device=devices[0])
    tokens = random_tokens(cfg, 1, args.seq_len, seed=1)
    with IndependentRanks(model, devices, experts=args.backend) as ranks:
        jax.block_until_ready(ranks.prefill(0, tokens, logits="last"))  # compile and warm up
        undo = instrument(ranks)
        TIMES.clear()
        dispatch, wall = [], []
        try:
            for _ in range(args.iters):
                t0 = time.perf_counter()
                out = ranks.prefill(0, tokens, logits="last")
                dispatch.append(time.perf_counter() - t0)
                jax.block_until_ready(out)
                wall.append(time.perf_counter() - t0)
        finally:
            for module, name, original in undo:
                setattr(module, name, original)
    calls = sorted(((name, len(t) / args.iters, sum(t) * 1e3 / args.iters) for name, t in TIMES.items()),
                   key=lambda r: -r[2])
    d_ms, w_ms = float(np.mean(dispatch)) * 1e3, float(np.mean(wall)) * 1e3  # means, like the per-call sums
    print(f"dispatch (host, until prefill returns) {d_ms:.2f} ms; wall until ready {w_ms:.2f} ms "
          f"({cfg.num_hidden_layers} layers, {args.seq_len} tokens, backend {args.backend})")
    print(f"{'call':48} {'calls/prefill':>13} {'host ms/prefill':>16}")
    for name, n, ms in calls:
        print(f"{name:48} {n:13.1f} {ms:16.3f}")
    accounted = sum(ms for _, _, ms in calls)
    print(f"{'(rest: Python between calls)':48} {'':13} {d_ms - accounted:16.3f}")
    return dict(args=vars(args), device=devices[0].device_kind, dispatch_ms=d_ms, wall_ms=w_ms,
                calls={name: dict(calls_per_prefill=n, host_ms_per_prefill=ms) for name, n, ms in calls})


# --- layouts: pipeline P x DWDP N --------------------------------------------------------------------------------

def parse_layout(layout: str) -> tuple[int, int, str]:
    """'PxN[:backend]' -> (P, N, backend), backend xla unless given (with N = 1 the stage holds its own experts)."""
    shape, _, backend = layout.partition(":")
    p, n = (int(v) for v in shape.split("x"))
    return p, n, backend or "xla"


def bench_layouts(cfg, args) -> list[dict]:
    tokens = random_tokens(cfg, args.sequences, args.seq_len, seed=0)
    rows = []
    for layout in args.layouts:
        p, n, backend = parse_layout(layout)
        if p * n > jax.device_count():
            rows.append({"layout": layout, "skipped": f"needs {p * n} devices, {jax.device_count()} present"})
            continue
        with Pipeline.random(cfg, p, dwdp=n, dtype=jnp.dtype(args.dtype), seed=1,
                             experts=backend if n > 1 else "local") as pipe:
            micro = args.sequences // n
            seconds = timed(lambda: pipe.prefill(tokens, microbatches=micro, logits="last", layerwise=True),
                            args.iters)
        gpus = p * n
        tok_s = tokens.size / seconds
        rows.append({"layout": layout, "pipeline": p, "dwdp": n, "backend": backend, "gpus": gpus,
                     "microbatches": micro, "ms": round(seconds * 1e3, 2), "tokens_per_s": round(tok_s),
                     "tokens_per_s_per_gpu": round(tok_s / gpus)})
        print(rows[-1], flush=True)
        pipe = None
        gc.collect()
    print(f"\n{args.preset}, {cfg.num_hidden_layers} layers, {args.sequences} x {args.seq_len} tokens, "
          f"{jax.devices()[0].device_kind}")
    print("| layout (P x N:backend) | GPUs | microbatches | ms | tokens/s | tokens/s per GPU |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "skipped" in r:
            print(f"| {r['layout']} | skipped: {r['skipped']} |")
        else:
            print(f"| {r['layout']} | {r['gpus']} | {r['microbatches']} | {r['ms']} | {r['tokens_per_s']} | "
                  f"{r['tokens_per_s_per_gpu']} |")
    return rows


# --- in-place: the store read in place against local experts, one GPU ---------------------------------------------

def store_pair(model, cfg, dtype, *, in_place: bool, skip_peers: bool = False):
    """Ranks 0 and 1 of one store on device 0, filled with the model's experts and connected in process (the test
    library's stores: skip_peers is a probe of the events alone)."""
    from tests.store_testing import FaultyProcessExpertStore, connect_in_process
    from jax_dwdp.parallel.dwdp_ffi import device_memory

    dev = jax.devices()[0]
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    stores, used = [], []
    for r in range(2):
        free = device_memory(dev)[0]
        stores.append(FaultyProcessExpertStore(dev, r, 2, cfg.num_hidden_layers, cfg.num_experts,
                                               ((2 * i, h), (h, i)), dtype, timing=True, in_place=in_place,
                                               skip_peers=skip_peers))
        used.append(free - device_memory(dev)[0])
    s = stores[0].layout.slots_per_rank
    for layer in range(cfg.num_hidden_layers):
        experts = model.layers[layer].mlp.experts
        for w, weight in enumerate((experts.gate_up_proj[...], experts.down_proj[...])):
            for r, store in enumerate(stores):
                store.fill(layer, w, r, weight[r * s:(r + 1) * s])
    connect_in_process(stores)
    return stores, used


def bench_in_place(cfg, args) -> list[dict]:
    dev = jax.devices()[0]
    dtype = jnp.dtype(args.dtype)
    model = init_model(cfg, dtype=dtype, seed=1, device=dev)
    rows = {seq: {"seq_len": seq, "layers": cfg.num_hidden_layers} for seq in args.seq_lens}
    inputs = {seq: (random_tokens(cfg, 1, seq, seed=0), np.full((1,), seq, np.int32)) for seq in args.seq_lens}

    def measure(name, runner, store=None):
        for seq, (tokens, lengths) in inputs.items():
            def run():
                return runner(tokens, lengths, logits="last", mode="layerwise")
            out = jax.block_until_ready(run())
            assert np.isfinite(np.asarray(out[0], np.float32)).all(), (name, seq)
            rows[seq][f"{name}_ms"] = round(timed(run, args.iters) * 1e3, 2)
            if store is not None:
                rows[seq][f"{name}_copy_ms_per_layer"] = round(float(np.nanmean(store.copy_ms())), 3)
            print(json.dumps({"variant": name, **rows[seq]}), flush=True)

    measure("local", StageRunner(model, LocalSource(), device=dev))
    memory = {}
    stores, memory["in_place_store_bytes"] = store_pair(model, cfg, dtype, in_place=True)
    try:
        measure("in_place", StageRunner(model, FfiStoreSource(stores[0]), device=dev), stores[0])
        own = FfiStoreSource(stores[0])
        own.gathers = False  # every layer's prefetch a one-call program of its own (fetch_now)
        measure("in_place_own_program", StageRunner(model, own, device=dev), stores[0])
        # The same store, its prefetch now copying nothing (slots keep the experts the runs above copied).
        stores[0].skip_peers = True
        measure("in_place_nolink", StageRunner(model, FfiStoreSource(stores[0]), device=dev), stores[0])
    finally:
        for store in stores:
            store.close()
    memory["xla_peak_after_in_place"] = dev.memory_stats().get("peak_bytes_in_use")
    stores, memory["copy_out_store_bytes"] = store_pair(model, cfg, dtype, in_place=False)
    try:
        measure("copy_out", StageRunner(model, FfiStoreSource(stores[0]), device=dev), stores[0])
    finally:
        for store in stores:
            store.close()
    memory["xla_peak_after_copy_out"] = dev.memory_stats().get("peak_bytes_in_use")
    plan = rank_memory(cfg, ExpertLayout(cfg.num_experts, 2), 0, cfg.num_hidden_layers, dtype.itemsize)
    memory["plan"] = {k: plan[k] for k in ("resident_expert_bytes", "store_slot_bytes", "prefetch_buffer_bytes")}
    out = []
    for row in rows.values():
        for name in ("in_place_nolink", "in_place", "in_place_own_program", "copy_out"):
            row[f"{name}_vs_local"] = round(row[f"{name}_ms"] / row["local_ms"], 4)
        row["memory"] = memory
        out.append(row)
    gib = 2**30
    print(f"| tokens | local ms | in place, no link | in place | in place, own programs | copy out | "
          f"copy ms/layer in place / copy out |")
    print("|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r['seq_len']} | {r['local_ms']} | {r['in_place_nolink_ms']} ({r['in_place_nolink_vs_local']}x) | "
              f"{r['in_place_ms']} ({r['in_place_vs_local']}x) | {r['in_place_own_program_ms']} "
              f"({r['in_place_own_program_vs_local']}x) | {r['copy_out_ms']} ({r['copy_out_vs_local']}x) | "
              f"{r['in_place_copy_ms_per_layer']} / {r['copy_out_copy_ms_per_layer']} |")
    print(f"store bytes per rank (GiB): in place {[round(b / gib, 3) for b in memory['in_place_store_bytes']]}, "
          f"copy out {[round(b / gib, 3) for b in memory['copy_out_store_bytes']]}; plan: blocks "
          f"{plan['resident_expert_bytes'] / gib:.3f} + slots {plan['store_slot_bytes'] / gib:.3f} in place, "
          f"+ {2 * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * dtype.itemsize / gib:.3f} "
          f"XLA buffers copying out; XLA peak after in place {memory['xla_peak_after_in_place'] / gib:.3f}, after "
          f"copy out {memory['xla_peak_after_copy_out'] / gib:.3f}")
    return out


# --- command line ----------------------------------------------------------------------------------------------

COMMANDS = {"stage": bench_stage, "ranks": bench_ranks, "dispatch": bench_dispatch, "layouts": bench_layouts,
            "in-place": bench_in_place}


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--preset", default="35b-a3b")
    common.add_argument("--num-layers", type=int, help="the preset's first N layers")
    common.add_argument("--dtype", default="bfloat16")
    common.add_argument("--iters", type=int, default=3)
    common.add_argument("--out", help="JSON results path")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="Without a subcommand, the arguments go to 'stage'.")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("stage", parents=[common], help="FFI vs XLA vs replicated experts on one stage's N ranks")
    p.set_defaults(num_layers=16)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--variants", nargs="+", default=["ffi", "xla", "replicated"], choices=VARIANTS,
                   help="ffi-nowait / ffi-unused: timing-only probes (wrong results); ffi-depth2: prefetch depth 2")

    p = sub.add_parser("ranks", parents=[common], help="independent ranks: concurrency, FFI store, XLA DWDP")
    p.set_defaults(num_layers=8)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--ffi", action="store_true", help="also time independent ranks on the FFI store")
    p.add_argument("--skip-xla-dwdp", action="store_true", help="skip the whole-model XLA DWDP program")

    p = sub.add_parser("dispatch", parents=[common], help="host time of one rank's layer-wise prefill, by call")
    p.set_defaults(num_layers=8)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--backend", default="xla", choices=["xla", "ffi"])

    p = sub.add_parser("in-place", parents=[common], help="one GPU: the store read in place vs local experts")
    p.set_defaults(num_layers=8)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384, 32768])

    p = sub.add_parser("layouts", parents=[common], help="pipeline P x DWDP N side by side")
    p.set_defaults(num_layers=16)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--layouts", nargs="+", default=["2x2:ffi", "2x1", "1x4:ffi", "1x4:xla"],
                   help="PxN[:xla|ffi]: P pipeline stages of N DWDP ranks")
    return ap


def main(argv=None):
    """Runs one subcommand; returns its rows (dispatch: its result dict), as written to --out."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv.insert(0, "stage")
    args = parser().parse_args(argv)
    cfg = ModelConfig.preset(args.preset).replace(num_hidden_layers=args.num_layers)
    print(f"{args.command}: {cfg.summary()} on {jax.devices()[0].device_kind} x {jax.device_count()}", flush=True)
    result = COMMANDS[args.command](cfg, args)
    if args.command == "dispatch":
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    else:
        save_rows(args.out, result, args, what=args.command)
    return result


if __name__ == "__main__":
    main()

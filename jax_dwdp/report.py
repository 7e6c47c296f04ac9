"""The human-readable lines of `jax-dwdp`'s results (with --json it prints the result dicts as they are)."""

from __future__ import annotations

import json

from jax_dwdp.weights.hf_loader import cast_line


def print_result(result: dict, *, as_json: bool = False) -> None:
    """Prints a command's result dict for a person, or (as_json) as one JSON object."""
    command = result["command"]
    if as_json:
        print(json.dumps(result))
    elif command == "plan":
        _print_plan(result)
    elif command == "verify":
        print(f"ok: {result['directory']}: {result['files']} files ({result['bytes'] / 1e9:.3f} GB) match their "
              f"checksums and {result['tensors']} tensors hold no NaN or Inf ({result['seconds']:.2f} s)")
    elif command == "convert":
        stored = ", ".join(f"{n} {name}" for name, n in sorted(result["dtypes"].items()))
        print(f"converted {result['tensors']} tensors ({result['bytes'] / 1e9:.3f} GB, {result['layers']} layers) "
              f"to {result['output']} in {result['seconds']:.2f} s ({result['gb_per_s']:.3f} GB/s); stored {stored}; "
              f"{cast_line(result['cast'])}; skipped {result['skipped_non_text']} vision/MTP tensors; "
              f"peak RSS {result['peak_rss_bytes'] / 2**20:.0f} MiB")
    else:
        _print_human(result)


def _print_human(result: dict) -> None:
    peak = result.get("peak_device_memory_bytes")
    peak_s = f"{peak / 2**30:.2f} GiB" if peak is not None else "n/a on this platform"
    print(f"model: {result['model']}")
    print(f"{result['platform']} ({result['device']}), {result['dtype']}, batch {result['batch']} x {result['seq_len']} tokens")
    print(f"compile: {result['compile_s']:.2f} s; prefill: {result['prefill_s'] * 1e3:.2f} ms")
    print(f"tokens/s: {result['tokens_per_s']:.1f}  ({result['tflops_per_s']} TFLOP/s)")
    per_device = result.get("peak_device_memory_bytes_per_device") or []
    if len(per_device) > 1 and all(p is not None for p in per_device):
        peak_s = ", ".join(f"{p / 2**30:.2f}" for p in per_device) + " GiB (per device)"
    print(f"peak device memory: {peak_s}")
    if result.get("logits_out"):
        print(f"logits written to {result['logits_out']}")
    print(result["ffi_libraries"])


def _print_plan(result: dict) -> None:
    gib = 2**30
    scheme = "DEP" if result["dep"] > 1 else "DWDP"
    ranks = max(result["dwdp"], result["dep"])
    print(f"model: {result['model']}; {result['dtype']}")
    print(f"{result['pipeline']} stage(s) x {ranks} {scheme} rank(s)")
    print("| stage | layers | full-attn layers | weights GiB | KV cache per token | state per sequence MiB | device "
          "| experts | resident GiB | buffers GiB | peer GiB per layer | MoE layers |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for st in result["stages"]:
        for r in st["dwdp_ranks"]:
            buffers = r["prefetch_buffer_bytes"] + r["store_slot_bytes"] if scheme == "DWDP" else 0
            print(f"| {st['stage']} | [{st['start_layer']}, {st['end_layer']}) | {len(st['full_attention_layers'])} "
                  f"| {st['weight_bytes'] / gib:.2f} | {st['cache_bytes_per_token'] / 1024:.1f} KiB "
                  f"| {st['cache_bytes_per_sequence'] / 2**20:.1f} | {r['device']} "
                  f"| [{r['experts_owned'][0]}, {r['experts_owned'][1]}) | {r['resident_bytes'] / gib:.2f} "
                  f"| {buffers / gib:.2f} | {r['peer_bytes_per_layer'] / gib:.3f} | {len(st['moe_layers'])} |")
    if scheme == "DWDP" and ranks > 1:
        modes = {r["store_mode"] for st in result["stages"] for r in st["dwdp_ranks"]}
        if modes == {"in_place"}:
            print("buffers: the FFI store's slots for two layers of the peers' experts (read in place: the rank's own "
                  "experts never move); the XLA all-gather's two gathered layers in --json as xla_gather_buffer_bytes")
        else:
            print("buffers: two layers' full expert sets for the FFI store's prefetch (its blocks are not multiples of "
                  "the 2 MiB VMM granularity, so it copies them out); the XLA all-gather's, with padding slots, in "
                  "--json as xla_gather_buffer_bytes")

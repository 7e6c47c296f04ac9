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
    for i, item in enumerate(result.get("text") or []):
        print(f"prompt {i + 1}: {item['prompt']!r}")
        print("  next: " + ", ".join(f"{t['text']!r} {t['p']:.3f}" for t in item["next_tokens"]))
        if "generated_text" in item:
            print(f"  generated: {item['generated_text']!r}")
    for i, ids in enumerate(result.get("generated_ids") or []):
        print(f"sequence {i + 1} generated ids: {ids}")
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
    if "performance" in result:
        _print_performance(result["performance"])


SCHEMES = (("dwdp", "DWDP"), ("dep", "DEP"), ("replicated", "replicated"))


def _crossing_line(name: str, c: dict, unit, suffix: str = "") -> str:
    grid, r = c["grid"], c["dwdp_over_dep"]
    span = f"{unit(grid[0])}-{unit(grid[-1])}{suffix}"
    if c["crossing"] is None:
        who = "DWDP" if r[0] > 1 else "DEP"
        return f"{name}: {who} ahead at every value tried ({span}; DWDP / DEP {min(r):.2f}-{max(r):.2f})"
    above = "DWDP" if r[-1] > 1 else "DEP"
    return f"{name}: DWDP / DEP = 1 at {unit(c['crossing'])}{suffix} ({above} ahead above it; tried {span})"


def _print_performance(perf: dict) -> None:
    gib = 2**30
    prof, link, stream = perf["profile"], perf["link"], perf["stream"]
    print()
    print(f"prediction (a model, not a measurement): profile {prof['name']} ({prof['device']}, {prof['date']}, "
          f"model {prof['model']}); link {link['name']} ({link['kind']}: peer copy {link['peer_gib_s']:.1f} GiB/s, "
          f"collective {link['collective_gib_s']:.1f} GiB/s, {link['latency_us']:g} us per collective)")
    print(f"stream: {stream['description']}; {perf['requests_per_rank']} request(s) per rank (seed {perf['seed']}), "
          f"computed padded to {perf['bucket']} tokens; {perf['pipeline']} stage(s) x {perf['ranks']} rank(s); DEP "
          f"exchange: {perf['dep_exchange']}")
    if perf["compute_scaled_from_profile_model"]:
        print(f"compute: the profile measured {prof['model']}; this model's layer times are scaled by FLOPs (not "
              "measured)")
    print("| scheme | tokens/s per GPU | vs replicated | makespan ms | memory per rank GiB | fits |")
    print("|---|---:|---:|---:|---:|---|")
    for key, name in SCHEMES:
        s = perf["schemes"][key]
        print(f"| {name} | {s['tokens_per_s_per_gpu']:,.0f} | {s['vs_replicated']:.3f} | {s['makespan_ms']:.1f} "
              f"| {s['memory_bytes'] / gib:.1f} | {'yes' if s['fits'] else 'no'} |")
    print(f"DWDP / DEP: {perf['dwdp_over_dep']:.3f} (tokens/s per GPU)")
    copy = perf["dwdp_copy"]
    hidden = perf["schemes"]["dwdp"]["hidden_fraction"]
    if copy["peer_bytes_per_layer"]:
        how = ("read in place: the rank's own experts never move" if copy["store_mode"] == "in_place" else
               f"its own block copied too, {copy['own_bytes_per_layer'] / gib:.3f} GiB HBM to HBM")
        print(f"DWDP copies {copy['peer_bytes_per_layer'] / gib:.3f} GiB per layer from its peers ((N-1)/N of the "
              f"layer's experts; {how}): {copy['idle_ms_per_layer']:.2f} ms on an idle GPU; "
              f"{'' if hidden is None else f'{hidden:.0%} of the copy time hidden (1 - DWDP over replicated / copy time)'}")
    rows = perf["per_layer"]
    print("per layer (stage 0, the stream's first step; layer 0 alone, then the mean per kind):")
    print("| layers | mixer ms | MoE ms | DWDP copy ms | DWDP stall ms | DWDP contention ms | DEP exchange ms (MiB) "
          "| DEP wait ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    groups = [("layer 0 (" + rows[0]["kind"] + ")", rows[:1])]
    for kind in ("linear_attention", "full_attention"):
        same = [r for r in rows[1:] if r["kind"] == kind]
        if same:
            groups.append((f"{len(same)} {kind}", same))
    for label, group in groups:
        m = lambda key: sum(r[key] for r in group) / len(group)  # noqa: E731
        print(f"| {label} | {m('mixer_ms'):.3f} | {m('moe_ms'):.3f} | {m('dwdp_copy_ms'):.3f} | "
              f"{m('dwdp_stall_ms'):.3f} | {m('dwdp_contention_ms'):.3f} | {m('dep_exchange_ms'):.3f} "
              f"({m('dep_exchange_bytes') / 2**20:.0f}) | {m('dep_wait_ms'):.3f} |")
    print(f"the first layer's exposed prefetch: {rows[0]['dwdp_stall_ms']:.3f} ms")
    if "crossover" in perf:
        c = perf["crossover"]
        print("crossover (DWDP / DEP = 1, the rest of the stream's shape kept):")
        print("  " + _crossing_line("prompt length", c["prompt_tokens"], lambda x: f"{x:,.0f}", " tokens"))
        print("  " + _crossing_line("imbalance (deviation / mean)", c["imbalance"], lambda x: f"{x:.2f}"))
        print("  " + _crossing_line("ranks N", c["ranks"], lambda x: f"{x:.0f}"))
    print("leaves out: " + "; ".join(perf["leaves_out"]))

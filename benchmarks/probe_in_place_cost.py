"""Where the store's fixed per-layer cost goes when its experts are read in place (ONE GPU; a probe of issue 46).

`bench_dwdp.py in-place` measured the store with its copies switched off ("no link") at 1.08x / 1.02x / 1.01x the
layers' own experts at 4K / 16K / 32K tokens: about 0.15 ms a layer whatever the length. This probe takes that
difference apart, one piece at a time, all on one GPU in one run (rank 0 of a two-rank store whose rank 1 lives in
the same process, as in bench_dwdp.py in-place), each a layer-wise prefill of one sequence, median of --iters:

  local          the layers' own experts (the model's arrays: XLA buffers, part of the layer's weights)
  buffers        the same experts handed to each layer as its source's arrays (XLA buffers, not the layer's
                 weights): what passing the experts from a source costs
  views          the store's views of the same experts, no custom call at all (the slots hold the peers' experts
                 from one prefill with copies): what reading VMM-mapped memory costs
  nolink         the views with layer l+1's prefetch call inside layer l's program, its copies skipped, and the
                 wait right before each MoE's first grouped matmul (the store with its copies off: bench_dwdp's
                 column): what the two custom calls cost (a prefetch that is not waited for is refused, so they
                 come as a pair)
Each variant also reports its host dispatch time: how long the layer-wise prefill call takes to return, before
its outputs are ready (a prefill whose dispatch nears its total time is bound by the host).

With --trace DIR each variant's prefill at each length is also traced once (DIR/VARIANT/TOKENS, Perfetto) and
summarised with trace_summary: the kernels each variant runs against local's, and where its idle time between
kernels goes (the kernel pairs around the gaps), so that a fixed cost shows as kernels or as gaps, and which.

Timings only: with the copies off, a layer's slots hold the peers' experts of the last layer that used the same
slot set (from one prefill with copies), so "views" and "nolink" read the rank's own experts right and the peers'
wrong (their max relative difference to local, printed, is O(1)); the routing, and so the work, is the same.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import numpy as np
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trace_summary  # noqa: E402
from bench_dwdp import random_tokens, store_pair, timed  # noqa: E402
from jax_dwdp.config import ModelConfig  # noqa: E402
from jax_dwdp.model import init_model  # noqa: E402
from jax_dwdp.runner import StageRunner  # noqa: E402
from jax_dwdp.sources import ExpertSource, FfiStoreSource, LocalSource  # noqa: E402


class Buffers(ExpertSource):
    """Each layer's experts as XLA arrays the source holds."""

    def __init__(self, model):
        self.layers = [(layer.mlp.experts.gate_up_proj[...], layer.mlp.experts.down_proj[...])
                       for layer in model.layers]

    def prefetch(self, index, h):
        return self.layers[index]


class Views(FfiStoreSource):
    """The store's views, no prefetch, no wait."""

    def __init__(self, store):
        super().__init__(store)
        self.gathers = False

    def first(self, h):
        return self.prefetch(0, h)

    def prefetch(self, index, h):
        device, = h.devices()
        return self.store.layer_experts(index, device)

    def experts(self, pending):
        return pending


def dispatch_ms(run, iters) -> float:
    """Median host time for `run()` to return (its outputs not waited for), each call after the last one's
    outputs are ready."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    return float(np.median(times)) * 1e3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="35b-a3b")
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out")
    ap.add_argument("--trace", metavar="DIR", help="trace one prefill of each variant and length under DIR")
    args = ap.parse_args(argv)
    cfg = ModelConfig.preset(args.preset).replace(num_hidden_layers=args.num_layers)
    dev, dtype = jax.devices()[0], jnp.bfloat16
    model = init_model(cfg, dtype=dtype, seed=1, device=dev)
    inputs = {seq: (random_tokens(cfg, 1, seq, seed=0), np.full((1,), seq, np.int32)) for seq in args.seq_lens}
    stores, _ = store_pair(model, cfg, dtype, in_place=True)
    rows = {seq: {"seq_len": seq, "layers": args.num_layers} for seq in args.seq_lens}
    traces = {seq: {} for seq in args.seq_lens}
    try:
        filled = StageRunner(model, FfiStoreSource(stores[0]), device=dev)
        for tokens, lengths in inputs.values():
            jax.block_until_ready(filled(tokens, lengths, logits="last", mode="layerwise"))  # the slots filled
        stores[0].skip_peers = True  # from here on the prefetches copy nothing
        variants = {"local": LocalSource(), "buffers": Buffers(model), "views": Views(stores[0]),
                    "nolink": FfiStoreSource(stores[0])}
        want = {}
        for name, source in variants.items():
            runner = StageRunner(model, source, device=dev)
            for seq, (tokens, lengths) in inputs.items():
                def run():
                    return runner(tokens, lengths, logits="last", mode="layerwise")
                got = np.asarray(jax.block_until_ready(run())[0], np.float32)
                want.setdefault(seq, got)
                diff = float(np.abs(got - want[seq]).max() / max(np.abs(want[seq]).max(), 1e-30))
                t = timed(run, args.iters) * 1e3
                host = dispatch_ms(run, args.iters)
                rows[seq][f"{name}_ms"] = round(t, 3)
                rows[seq][f"{name}_dispatch_ms"] = round(host, 3)
                rows[seq][f"{name}_max_rel_diff"] = diff
                if args.trace:
                    summary = traces[seq][name] = trace_summary.trace_call(run, f"{args.trace}/{name}/{seq}", None)
                    rows[seq][f"{name}_trace"] = dict(total_ms=round(summary["total_ms"], 3),
                                                      span_ms=round(summary["span_ms"], 3),
                                                      idle_ms=round(summary["gaps"]["idle_ms"], 3))
                print(json.dumps({"variant": name, "seq_len": seq, "ms": round(t, 3), "dispatch_ms": round(host, 3),
                                  "max_rel_diff": diff}), flush=True)
    finally:
        for store in stores:
            store.close()
    names = list(variants)
    print("| tokens | " + " | ".join(names) + " | ms per layer over local |")
    print("|---" * (len(names) + 2) + "|")
    for seq, row in rows.items():
        cells = [f"{row[f'{n}_ms']:.2f}" for n in names]
        per_layer = [f"{(row[f'{n}_ms'] - row['local_ms']) / args.num_layers:+.3f}" for n in names[1:]]
        print(f"| {seq} | " + " | ".join(cells) + " | " + " / ".join(per_layer) + " |")
        dispatch = [f"{row[f'{n}_dispatch_ms']:.2f}" for n in names]
        print(f"| {seq} dispatch | " + " | ".join(dispatch) + " | host time to return |")
    for seq, by_name in traces.items():
        for name in [n for n in names[1:] if n in by_name]:
            print(f"\n== traces at {seq} tokens, local vs {name}")
            rows_ = trace_summary.compare(by_name["local"], by_name[name], 12)
            print(trace_summary.render_compare(by_name["local"], by_name[name], rows_, ("local", name)))
        if "nolink" in by_name:
            print(f"\n== nolink at {seq} tokens: its kernels and gaps")
            print(trace_summary.render({**by_name["nolink"], "kernels": by_name["nolink"]["kernels"][:12]}))
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "device": str(dev), "rows": list(rows.values())},
                                             indent=1))


if __name__ == "__main__":
    main()

"""Where a prefill layer's time goes, one GPU: each layer, mixer and MoE pass jitted and timed alone.

    python benchmarks/bench_layer_parts.py --preset 35b-a3b --tokens 4096 16384 32768 --out results/parts.json

For each token count (batch 1, random bf16 weights of one linear-attention and one full-attention layer):
- the two layers, their mixers, the MoE block (post-attention norm excluded) and its floor: the two grouped GEMMs
  plus the shared expert, the figure issue 15's MoE target (<= 1.25x of it) is measured against;
- the MoE block's passes: router (matmul, softmax, top-k), shared expert with its gate, sort by expert, dispatch
  into expert order (XLA row gather / Pallas scatter), gate_up GEMM, SwiGLU, down GEMM, un-permute with the
  weighted top-k sum (and with the shared expert's add), each by XLA and the Pallas kernel; with
  `--permute-configs` the permutation kernels' block shapes;
- the attention mixer's parts and its core by cuDNN (the model's, through `jax.nn.dot_product_attention`) and
  Pallas Triton `ops.gpu.attention.mha` (an implementation that fails prints why). Pallas Mosaic GPU's
  `attention_mgpu` takes only fp16 and jax's default implementation picks XLA's for head_dim 256 (out of memory at
  32K): both left out (benchmarks/RESULTS.md, "Attention");
- the routing kernels and the dispatch kernel against the XLA passes they replaced, the conv kernel and XLA's conv
  (each forced), the norm + RoPE kernel against XLA's passes, as whole layers and as parts: each variant is the
  same weights with one `KernelChoices` change (`--variants`);
- candidate fusions beside what they would replace (`--fusions`): the four GDN input projections as one matmul,
  the router, shared-expert gate and shared gate/up projections as one matmul.
Times: 10 back-to-back calls / 10, median of 5 (bench_gdn.wall_ms), so launch overheads count as in a model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="35b-a3b")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--no-attention-alternatives", action="store_true")
    ap.add_argument("--fusions", action="store_true", help="also time the candidate fusions")
    ap.add_argument("--no-variants", action="store_true",
                    help="today's defaults only: no one-change variants")
    ap.add_argument("--variants", help="comma-separated one-change variants to time (default: all of "
                    "routing, no_gather, dispatch, conv, xla_conv, norm_rope, separate_projection)")
    ap.add_argument("--permute-configs", action="store_true",
                    help="also time the permutation kernels' block shapes")
    ap.add_argument("--routing-configs", action="store_true",
                    help="also time the routing kernels (top-k softmax, counting sort) at other tile rows x warps")
    ap.add_argument("--conv-configs", action="store_true",
                    help="also time the Pallas conv (alone and in the GDN mixer) at other tiles: CONV_CONFIGS")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench_gdn import wall_ms
    from jax_dwdp import kernels
    from jax_dwdp.config import ModelConfig
    from jax_dwdp.kernels.grouped_matmul import default_implementation, swiglu
    from jax_dwdp.model import init_model, with_kernels
    from jax_dwdp.kernels import conv as conv_mod
    from jax_dwdp.kernels import permute, routing
    from jax_dwdp.model.moe import route

    cfg = ModelConfig.preset(args.preset)
    cfg = cfg.replace(num_hidden_layers=cfg.full_attention_interval)
    model = init_model(cfg, dtype=jnp.bfloat16, seed=0)
    linear = next(layer for layer in model.layers if layer.layer_type == "linear_attention")
    full = next(layer for layer in model.layers if layer.layer_type == "full_attention")
    base = model.kernels  # the process's choices (the environment's, read once)
    sync = jax.block_until_ready
    rows = []
    print(f"{cfg.summary()}; {jax.devices()[0].device_kind}; grouped matmul "
          f"{default_implementation(jnp.bfloat16)}", flush=True)

    def jit_method(module, fn):
        graph, state = nnx.split(module)
        compiled = jax.jit(lambda s, *a: fn(nnx.merge(graph, s), *a))
        return lambda *a: compiled(state, *a)

    def record(tokens, part, fn, group):
        try:
            ms = wall_ms(fn, sync)
        except Exception as e:  # an implementation that does not compile for these shapes: say why, go on
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}" if str(e) else type(e).__name__
            print(f"  {part:<38} failed: {msg}", flush=True)
            if "--traceback" in sys.argv:
                traceback.print_exc()
            rows.append({"tokens": tokens, "group": group, "part": part, "ms": None, "error": msg})
            return None
        rows.append({"tokens": tokens, "group": group, "part": part, "ms": ms})
        print(f"  {part:<38} {ms:8.3f} ms", flush=True)
        return ms

    rng = np.random.default_rng(0)
    for t in args.tokens:
        print(f"tokens {t}:", flush=True)
        x = jnp.asarray(rng.standard_normal((1, t, cfg.hidden_size)) * 0.5, jnp.bfloat16)
        lengths = jnp.array([t], jnp.int32)
        positions = jnp.arange(t, dtype=jnp.int32)[None]
        flat = x.reshape(t, -1)

        # Layers and mixers with today's defaults; then each chosen variant: the same weights with one kernel
        # choice changed (`with_kernels`).
        moe_ms = None
        wanted = set(VARIANTS) if args.variants is None else set(args.variants.split(","))
        if wanted - set(VARIANTS):
            ap.error(f"--variants: {', '.join(sorted(wanted - set(VARIANTS)))} not among {', '.join(VARIANTS)}")
        chosen = [("", {})] + ([] if args.no_variants else [v for k, v in VARIANTS.items() if k in wanted])
        for suffix, changes in chosen:
            parts = VARIANT_PARTS.get(suffix, DEFAULT_PARTS)  # the layers and blocks the variant can change
            lin_v, full_v = (with_kernels(layer, base.replace(**changes)) for layer in (linear, full))
            if "linear" in parts:
                lin_layer = jit_method(lin_v, lambda m, x, p, n: m(x, p, n))
                record(t, "linear-attention layer" + suffix, lambda: lin_layer(x, positions, lengths), "layer")
            if "gdn" in parts:
                gdn = jit_method(lin_v, lambda m, x, n: m.linear_attn(m.input_layernorm(x), n))
                record(t, "GDN mixer (with input norm)" + suffix, lambda: gdn(x, lengths), "layer")
            if "full" in parts:
                full_layer = jit_method(full_v, lambda m, x, p, n: m(x, p, n))
                record(t, "full-attention layer" + suffix, lambda: full_layer(x, positions, lengths), "layer")
            if "attention" in parts:
                attn = jit_method(full_v, lambda m, x, p: m.self_attn(m.input_layernorm(x), p))
                record(t, "attention mixer (with input norm)" + suffix, lambda: attn(x, positions), "layer")
            if "moe" in parts:
                moe = jit_method(lin_v, lambda m, x: m.mlp(x))
                ms = record(t, "MoE block" + suffix, lambda: moe(x), "layer")
                moe_ms = moe_ms if suffix else ms

        # The MoE block's passes.
        mlp = linear.mlp
        k, e = mlp.top_k, cfg.num_experts
        for impl in routing.IMPLEMENTATIONS:
            router = jit_method(mlp, lambda m, f, impl=impl: routing.topk_softmax(
                jnp.einsum("mh,eh->me", f, m.gate.weight[...]), k, implementation=impl))
            record(t, f"router (matmul, softmax, top-k), {impl}", lambda: router(flat), "moe")
        ids, weights = route(flat, mlp.gate.weight[...], k)
        shared = jit_method(mlp, lambda m, f: jax.nn.sigmoid(m.shared_expert_gate(f).astype(jnp.float32)).astype(
            f.dtype) * m.shared_expert(f))
        shared_ms = record(t, "shared expert with its gate", lambda: shared(flat), "moe")
        for impl in routing.IMPLEMENTATIONS:
            sort = jax.jit(lambda i, impl=impl: routing.expert_permutation(i, e, implementation=impl))
            record(t, f"sort by expert and inverse, {impl}", lambda: sort(ids), "moe")
        order, inverse, sizes = jax.jit(lambda i: routing.expert_permutation(i, e))(ids)
        rows_out = t * k + (-t * k) % kernels.GROUPED_MATMUL_ROW_MULTIPLE
        for impl in permute.IMPLEMENTATIONS:
            dispatch = jax.jit(lambda f, o, i, impl=impl: kernels.dispatch_rows(f, o, i, k, rows_out,
                                                                                implementation=impl))
            record(t, f"dispatch rows, {impl}" + (" (row gather)" if impl == "xla" else " (scatter)"),
                   lambda: dispatch(flat, order, inverse), "moe")
        sorted_rows = jax.jit(lambda f, o, i: kernels.dispatch_rows(f, o, i, k, rows_out))(flat, order, inverse)
        gate_up_w, down_w = mlp.experts.gate_up_proj[...], mlp.experts.down_proj[...]
        gemm = jax.jit(kernels.grouped_matmul)
        gate_up = gemm(sorted_rows, gate_up_w, sizes)
        gate_up_ms = record(t, "gate_up grouped GEMM", lambda: gemm(sorted_rows, gate_up_w, sizes), "moe")
        row_token = jnp.pad((order // k).astype(jnp.int32), (0, rows_out - t * k))
        gemm_gather = jax.jit(kernels.grouped_matmul_gather)
        record(t, "gate_up GEMM gathering its rows", lambda: gemm_gather(flat, row_token, gate_up_w, sizes), "moe")
        i2 = gate_up.shape[1] // 2
        act_fn = jax.jit(lambda y: swiglu(y[:, :i2], y[:, i2:], y.dtype))
        act = act_fn(gate_up)
        record(t, "SwiGLU", lambda: act_fn(gate_up), "moe")
        down = gemm(act, down_w, sizes)
        down_ms = record(t, "down grouped GEMM", lambda: gemm(act, down_w, sizes), "moe")
        w_bf16 = weights.astype(flat.dtype)
        shared_out = shared(flat)
        combine = jax.jit(lambda y, i, w: kernels.combine_rows(y, i, w))  # (XLA's fusion on every platform)
        record(t, "un-permute and weighted sum, xla", lambda: combine(down, inverse, w_bf16), "moe")
        combine_add = jax.jit(lambda y, i, w, a: kernels.combine_rows(y, i, w, a))
        record(t, "un-permute, weighted sum + shared add, xla",
               lambda: combine_add(down, inverse, w_bf16, shared_out), "moe")
        if args.conv_configs:  # the Pallas conv's tile rows and warps, inside the GDN mixer
            conv_in = jit_method(linear, lambda m, x: m.linear_attn.in_proj_qkv(m.input_layernorm(x)))(x)
            pallas_conv = with_kernels(linear, base.replace(conv="pallas"))
            # (rows, warps, widest channel block); the conv alone (its three split calls) and inside the mixer
            for bt, nw, bc in CONV_CONFIGS:
                with _patched(conv_mod, BLOCK_T=bt, NUM_WARPS=nw, MAX_BLOCK_C=bc):
                    key_dim = linear.linear_attn.key_dim
                    conv_alone = jit_method(pallas_conv, lambda m, y: conv_mod.causal_conv_silu(
                        y, m.linear_attn.conv1d.weight[...], splits=(key_dim, 2 * key_dim),
                        kernels=m.linear_attn.kernels))
                    record(t, f"Pallas conv (3 splits) {bt} rows w{nw} c{bc}", lambda: conv_alone(conv_in), "conv")
                    gdn = jit_method(pallas_conv, lambda m, x, n: m.linear_attn(m.input_layernorm(x), n))
                    record(t, f"GDN mixer, Pallas conv {bt} rows w{nw} c{bc}", lambda: gdn(x, lengths), "conv")
        if args.permute_configs:  # the dispatch kernel's block shapes (tokens x columns per program, warps)
            for bt, bw, nw in ((16, 512, 4), (8, 1024, 4), (32, 256, 4), (16, 512, 8), (8, 512, 4), (32, 512, 8)):
                cfg_kw = dict(block_tokens=bt, block_columns=bw, num_warps=nw)
                d = jax.jit(lambda f, o, i, kw=cfg_kw: permute.dispatch_rows_pallas(f, o, i, k=k, rows=rows_out,
                                                                                    **kw))
                record(t, f"dispatch pallas {bt}x{bw} w{nw}", lambda: d(flat, order, inverse), "permute")
        if args.routing_configs:  # the routing kernels' tokens per program and warps; each checked against default
            logits = jax.jit(lambda f: jnp.einsum("mh,eh->me", f, mlp.gate.weight[...]))(flat)
            want_topk = jax.jit(lambda g: routing.topk_softmax_pallas(g, k))(logits)
            want_perm = jax.jit(lambda i: routing.expert_permutation_pallas(i, e))(want_topk[0])
            for bm, nw in ((None, None), (16, 4), (64, 4), (64, 8), (128, 8), (128, 16), (16, 2), (32, 8)):
                tile = dict(block_rows=bm, num_warps=nw)
                name = "default" if bm is None else f"{bm} rows w{nw}"
                topk = jax.jit(lambda g, kw=tile: routing.topk_softmax_pallas(g, k, **kw))
                perm = jax.jit(lambda i, kw=tile: routing.expert_permutation_pallas(i, e, **kw))
                try:
                    same = all(bool(jnp.array_equal(a, b)) for a, b in zip(topk(logits), want_topk)) and all(
                        bool(jnp.array_equal(a, b)) for a, b in zip(perm(want_topk[0]), want_perm))
                except Exception as exc:  # noqa: BLE001 (a tile Triton cannot compile: say so, go on)
                    print(f"  routing {name}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
                    continue
                if not same:
                    print(f"  routing {name}: OUTPUTS DIFFER from the default tile's (not timed)", flush=True)
                    rows.append({"tokens": t, "group": "routing", "part": f"routing {name}", "ms": None,
                                 "error": "outputs differ"})
                    continue
                record(t, f"top-k softmax kernel, {name}", lambda: topk(logits), "routing")
                record(t, f"counting sort + inverse, {name}", lambda: perm(want_topk[0]), "routing")
        if None not in (moe_ms, gate_up_ms, down_ms, shared_ms):
            floor = gate_up_ms + down_ms + shared_ms
            ratio = moe_ms / floor
            rows.append({"tokens": t, "group": "moe", "part": "floor: GEMMs + shared expert", "ms": floor,
                         "block_over_floor": ratio})
            print(f"  {'floor: GEMMs + shared expert':<38} {floor:8.3f} ms; block / floor {ratio:.2f}x", flush=True)

        # The attention mixer's parts and its core by each implementation.
        sa = full.self_attn
        project = jit_method(full, lambda m, x, p: m.self_attn._project(m.input_layernorm(x), p))
        q, gate, kk, vv = project(x, positions)
        record(t, "attention: norm, q/k/v proj, q/k norm, RoPE", lambda: project(x, positions), "attention")
        scale = sa.head_dim**-0.5
        cudnn = jax.jit(lambda q, k, v: kernels.causal_attention(q, k, v, scale=scale))
        reference = cudnn(q, kk, vv)
        record(t, "attention core: the model's (cuDNN)", lambda: cudnn(q, kk, vv), "attention")
        out_gate = jit_method(full, lambda m, a, g: m.self_attn.o_proj(
            a.reshape(1, t, -1) * jax.nn.sigmoid(g.astype(jnp.float32)).astype(a.dtype)))
        record(t, "attention: output gate, o_proj", lambda: out_gate(reference, gate), "attention")
        if not args.no_attention_alternatives:
            for name, fn in _attention_alternatives(scale).items():
                try:
                    compiled = jax.jit(fn)
                    got = compiled(q, kk, vv)
                    err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - reference.astype(jnp.float32))))
                except Exception as ex:
                    msg = f"{type(ex).__name__}: {str(ex).splitlines()[0][:160]}" if str(ex) else type(ex).__name__
                    print(f"  attention core: {name:<22} failed: {msg}", flush=True)
                    rows.append({"tokens": t, "group": "attention", "part": f"attention core: {name}", "ms": None,
                                 "error": msg})
                    continue
                record(t, f"attention core: {name}", lambda: compiled(q, kk, vv), "attention")
                rows[-1]["max_abs_diff_vs_cudnn"] = err
                print(f"  {'':<38} max |diff| vs cuDNN {err:.2e}", flush=True)

        # The GDN mixer's parts (the core's own benchmark: bench_gdn.py).
        ga = linear.linear_attn
        proj = jit_method(linear, lambda m, x: m.linear_attn.in_proj_qkv(m.input_layernorm(x)))
        mixed = proj(x)
        record(t, "GDN: input norm, in_proj_qkv", lambda: proj(x), "gdn")
        for impl in conv_mod.IMPLEMENTATIONS:
            conv = jit_method(linear, lambda m, y, impl=impl: conv_mod.causal_conv_silu(
                y, m.linear_attn.conv1d.weight[...], implementation=impl))
            record(t, f"GDN: causal conv + SiLU, {impl}", lambda: conv(mixed), "gdn")
        conv_out = conv_mod.causal_conv_silu_xla(mixed, ga.conv1d.weight[...])
        gates = jit_method(linear, lambda m, x: m.linear_attn._gates(x))
        g, beta = gates(x)
        record(t, "GDN: b/a projections, gate math", lambda: gates(x), "gdn")
        qg, kg, vg = ga._split_heads(conv_out)
        core = jax.jit(lambda q, k, v, g, b, n: kernels.chunk_gated_delta_rule(q, k, v, g, b, lengths=n))
        o, _ = core(qg, kg, vg, g, beta, lengths)
        record(t, "GDN: core (gated delta rule)", lambda: core(qg, kg, vg, g, beta, lengths), "gdn")
        output = jit_method(linear, lambda m, o, x: m.linear_attn._output(o, x))
        record(t, "GDN: z proj, gated norm, out_proj", lambda: output(o, x), "gdn")

        if args.fusions:
            ws = [ga.in_proj_qkv.weight[...], ga.in_proj_z.weight[...], ga.in_proj_b.weight[...],
                  ga.in_proj_a.weight[...]]
            four = jax.jit(lambda x, *w: tuple(jnp.einsum("mi,oi->mo", x, wi) for wi in w))
            record(t, "fusion: GDN 4 input matmuls", lambda: four(flat, *ws), "fusion")
            cat = jnp.concatenate(ws)
            one = jax.jit(lambda x, w: jnp.einsum("mi,oi->mo", x, w))
            record(t, "fusion: GDN input matmuls as one", lambda: one(flat, cat), "fusion")
            small = [mlp.gate.weight[...], mlp.shared_expert_gate.weight[...],
                     mlp.shared_expert.gate_proj.weight[...], mlp.shared_expert.up_proj.weight[...]]
            record(t, "fusion: router+shared 4 matmuls", lambda: four(flat, *small), "fusion")
            cat_small = jnp.concatenate(small)
            record(t, "fusion: router+shared as one", lambda: one(flat, cat_small), "fusion")

    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "preset": args.preset, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


XLA_ROUTING, PALLAS_CONV, XLA_CONV, XLA_DISPATCH, XLA_NORM_ROPE = (
    " (XLA routing)", " (Pallas conv)", " (XLA conv)", " (XLA dispatch)", " (XLA norm+RoPE)")
# --conv-configs: (rows, warps, widest channel block) of the Pallas conv's tile; the first is the default
CONV_CONFIGS = ((32, 4, 128), (32, 4, 256), (32, 4, 512), (64, 4, 256), (32, 8, 256), (64, 8, 512), (16, 4, 256))
NO_GATHER = " (dispatch, then GEMM)"
SEPARATE_PROJECTION = " (router, shared expert, its gate apart)"
DEFAULT_PARTS = ("linear", "gdn", "full", "attention", "moe")
# What each variant's change can reach (the rest would time the defaults again): the routing every MoE layer, the
# dispatch the MoE (timed in the linear-attention layer), the conv the GDN mixer, the norm + RoPE the attention
# mixer.
VARIANT_PARTS = {XLA_ROUTING: ("linear", "gdn", "full", "moe"), XLA_DISPATCH: ("linear", "moe"),
                 NO_GATHER: ("linear", "moe"), PALLAS_CONV: ("linear", "gdn"), XLA_CONV: ("linear", "gdn"),
                 XLA_NORM_ROPE: ("full", "attention"), SEPARATE_PROJECTION: ("linear", "moe")}
# name -> (row suffix, KernelChoices changes): each changes one choice of the defaults
VARIANTS = {"routing": (XLA_ROUTING, {"routing": "xla"}),
            "no_gather": (NO_GATHER, {"moe_gather": False}),  # the Pallas dispatch, then the TMA GEMM
            "dispatch": (XLA_DISPATCH, {"dispatch": "xla", "moe_gather": False}),
            "conv": (PALLAS_CONV, {"conv": "pallas"}),  # (the default from 8,192 tokens: a no-op there)
            "xla_conv": (XLA_CONV, {"conv": "xla"}),  # (the default below 8,192 tokens)
            "norm_rope": (XLA_NORM_ROPE, {"norm_rope": "xla"}),
            # the MoE block's token projections as XLA merges them (router + shared gate / up; the gate a GEMV)
            "separate_projection": (SEPARATE_PROJECTION, {"moe_merged_projection": False})}


@contextlib.contextmanager
def _patched(module, **values):
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def _attention_alternatives(scale: float) -> dict:
    """Other causal GQA flash attentions on the image, as f(q, k, v) over [B, T, H, D] inputs."""
    import jax
    import jax.numpy as jnp

    def pallas_triton(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention

        rep = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        return attention.mha(q, k, v, segment_ids=None, sm_scale=scale, causal=True, block_sizes=attention.BlockSizes(
            block_q=64, block_k=32))

    return {"Pallas Triton mha": pallas_triton}


if __name__ == "__main__":
    main()

"""GPU kernels and the model on one GPU (skipped without a GPU; run with JAX_DWDP_TEST_GPU=1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.hf_reference import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)"),
]


def grouped_reference(x, w, sizes):
    out = np.full((x.shape[0], w.shape[1]), np.nan)
    start = 0
    for g, n in enumerate(sizes):
        out[start : start + n] = x[start : start + n].astype(np.float64) @ w[g].astype(np.float64).T
        start += n
    return out


@pytest.mark.parametrize("n,k", [(1024, 2048), (2048, 512)])
def test_mosaic_grouped_matmul_matches_fp64(rng, n, k):
    from jax_dwdp.kernels.grouped_matmul import grouped_matmul

    g = 16
    # Uneven groups, empty groups, groups larger than one 128-row tile.
    sizes = rng.multinomial(3000, rng.dirichlet(np.full(g, 0.3)))
    sizes[[2, 7]] = 0
    m = int(sizes.sum())
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((g, n, k)) * k**-0.5).astype(np.float32)
    out = grouped_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), jnp.asarray(sizes, jnp.int32),
                         implementation="mosaic")
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    wb = np.asarray(jnp.asarray(w, jnp.bfloat16), np.float64)
    err = rel_err(np.asarray(out, np.float64), grouped_reference(xb, wb, sizes))
    print(f"mosaic grouped matmul n={n} k={k}: bf16 rel err {err:.2e}")
    assert np.isfinite(np.asarray(out, np.float32)).all() and err <= 1e-2


def test_cudnn_attention_matches_xla(rng):
    from jax_dwdp.kernels import causal_attention

    q = jnp.asarray(rng.standard_normal((2, 700, 8, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 700, 2, 128)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, 700, 2, 128)), jnp.bfloat16)
    got = causal_attention(q, k, v, scale=128**-0.5)
    ref = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
                                       scale=128**-0.5, is_causal=True, implementation="xla")
    err = rel_err(got, ref)
    print(f"cudnn attention vs fp32 xla: {err:.2e}")
    assert err <= 2e-2


def _bf16_and_fp32_models(rng, t: int):
    """A small model whose GPU kernels all apply (head widths 128 / 64, expert widths 128), in bf16 and fp32 from one
    seed (residual branches damped so that 4 layers of bf16 stay comparable), and t random tokens."""
    from jax_dwdp.config import ModelConfig
    from jax_dwdp.model import init_model
    from tests.test_model import _damp_residual_branches

    cfg = ModelConfig.preset("tiny").replace(hidden_size=256, head_dim=128, moe_intermediate_size=128,
                                             shared_expert_intermediate_size=128, linear_key_head_dim=64,
                                             linear_value_head_dim=64)
    tokens = rng.integers(0, cfg.vocab_size, (1, t)).astype(np.int32)
    m16 = _damp_residual_branches(init_model(cfg, dtype=jnp.bfloat16, seed=2), 0.2)
    m32 = _damp_residual_branches(init_model(cfg, dtype=jnp.float32, seed=2), 0.2)
    return cfg, tokens, m16, m32


def test_attention_projections_are_not_merged_into_one_gemm(rng):
    """q, k and v share their input, so XLA's dot merger would make them one GEMM (concatenating the weights each
    call, then copying q out of the merged output for the norm + RoPE kernel); the module keeps them apart. The
    same three projections without the module's barrier do merge (the merged shape the check looks for shows up)."""
    import re

    from flax import nnx

    cfg, _, m16, _ = _bf16_and_fp32_models(rng, 8)
    sa = next(layer for layer in m16.layers if layer.layer_type == "full_attention").self_attn
    graph, state = nnx.split(sa)
    x = jnp.asarray(rng.standard_normal((1, 1024, cfg.hidden_size)), jnp.bfloat16)
    positions = jnp.arange(1024, dtype=jnp.int32)[None]
    merged = re.compile(rf"bf16\[(?:\d+,)*{sa.num_heads * sa.head_dim * 2 + 2 * sa.num_kv_heads * sa.head_dim}[,\]]")
    module = jax.jit(lambda s, x, p: nnx.merge(graph, s)._project(x, p)).lower(state, x, positions).compile().as_text()
    assert not merged.search(module), "the attention module's q, k, v projections were merged into one GEMM"
    weights = [p.weight[...] for p in (sa.q_proj, sa.k_proj, sa.v_proj)]
    plain = jax.jit(lambda x, *ws: tuple(jnp.einsum("bti,oi->bto", x, w) for w in ws)).lower(x, *weights)
    assert merged.search(plain.compile().as_text()), "XLA did not merge three plain projections of one input"


def test_gpu_prefill_matches_cpu_fp32(rng):
    from jax_dwdp.config import ModelConfig
    from jax_dwdp.model import init_model
    from jax_dwdp.prefill import jit_prefill

    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=4)
    tokens = rng.integers(0, cfg.vocab_size, (2, 150)).astype(np.int32)
    gpu_model = init_model(cfg, dtype=jnp.float32, seed=1, device=jax.devices("gpu")[0])
    cpu_model = init_model(cfg, dtype=jnp.float32, seed=1, device=jax.devices("cpu")[0])
    gpu_logits, gpu_cache = jit_prefill(gpu_model)(tokens)
    with jax.default_device(jax.devices("cpu")[0]):
        cpu_logits, cpu_cache = jit_prefill(cpu_model)(tokens)
    err = rel_err(gpu_logits, cpu_logits)
    print(f"GPU vs CPU fp32 prefill: logits {err:.2e}, recurrent {rel_err(gpu_cache.recurrent, cpu_cache.recurrent):.2e}")
    assert err <= 1e-4


def test_gpu_nemotron_h_prefill_matches_cpu_fp32(rng):
    """The Nemotron-H family (Mamba-2 SSD, relu^2 MoE, attention) on the GPU: the tiny preset's prefill of two
    sequences of different lengths (150 and 97 tokens: several SSD chunks, a partial last one) equals the CPU's in
    fp32 (logits and every cache leaf), and the GPU's bf16 prefill is as far from its fp32 one as the CPU's bf16 is
    from the CPU's fp32 (this random, undamped tiny model: 5-15% on the CPU), within 1.5x + 1e-2."""
    from flax import nnx

    from jax_dwdp.model import init_model
    from jax_dwdp.nemotron_h_config import NemotronHConfig
    from jax_dwdp.programs import precision_scope

    cfg = NemotronHConfig.preset("tiny")
    tokens = rng.integers(0, cfg.vocab_size, (2, 150)).astype(np.int32)
    lengths = np.array([150, 97], np.int32)

    def prefill(model):  # fp32 a reference run: every matmul in full fp32 (the GPU's default would be TF32)
        with precision_scope(model.dtype):
            return nnx.jit(lambda m, x, n: m.prefill(x, n, logits="all", cache_len=150))(model, tokens, lengths)

    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    seed = int(rng.integers(1 << 30))
    gpu_logits, gpu_cache = prefill(init_model(cfg, dtype=jnp.float32, seed=seed, device=gpu))
    with jax.default_device(cpu):
        cpu_logits, cpu_cache = prefill(init_model(cfg, dtype=jnp.float32, seed=seed, device=cpu))
    held = np.arange(150)[None, :] < lengths[:, None]
    errors = {"logits": rel_err(np.asarray(gpu_logits)[held], np.asarray(cpu_logits)[held])}
    for leaf in ("conv", "recurrent", "key", "value"):
        errors[leaf] = rel_err(getattr(gpu_cache, leaf), getattr(cpu_cache, leaf))
    bf16_logits, _ = prefill(init_model(cfg, dtype=jnp.bfloat16, seed=seed, device=gpu))
    with jax.default_device(cpu):
        cpu_bf16, _ = prefill(init_model(cfg, dtype=jnp.bfloat16, seed=seed, device=cpu))
    errors["bf16 vs fp32, GPU"] = rel_err(np.asarray(bf16_logits, np.float32)[held], np.asarray(gpu_logits)[held])
    errors["bf16 vs fp32, CPU"] = rel_err(np.asarray(cpu_bf16, np.float32)[held], np.asarray(cpu_logits)[held])
    print(f"Nemotron-H tiny, GPU vs CPU fp32: {errors}")
    assert np.isfinite(np.asarray(gpu_logits)[held]).all()
    assert max(v for k, v in errors.items() if not k.startswith("bf16")) <= 1e-4, errors
    assert errors["bf16 vs fp32, GPU"] <= 1.5 * errors["bf16 vs fp32, CPU"] + 1e-2, errors


@pytest.mark.parametrize("dtype,bound", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_gpu_scanned_stage_equals_the_layerwise_stage(rng, dtype, bound):
    """A pipeline stage in the middle of the model, starting inside the 3 + 1 pattern ([3, 10) of 12 layers: period
    (full, linear, linear, linear), one block and a tail of three), run on the GPU as one scanned program
    (`ScannedModel`, as `Pipeline(..., scan=True)` runs it) gives the layer-wise StageRunner's hidden states and
    cache: fp32 1e-5, bf16 within the project's bf16 bound (the two round differently; residual branches damped as
    in the model's bf16 test). Also the whole model's scanned prefill against its layer-wise prefill."""
    from jax_dwdp.config import ModelConfig
    from jax_dwdp.model import init_model
    from jax_dwdp.runner import StageRunner
    from jax_dwdp.prefill import jit_prefill
    from jax_dwdp.scan import ScannedModel, jit_prefill_scanned
    from tests.test_model import _damp_residual_branches

    gpu = jax.devices("gpu")[0]
    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=12)
    stage = _damp_residual_branches(init_model(cfg, dtype=dtype, seed=4, start_layer=3, end_layer=10, device=gpu),
                                    0.2)
    h = jax.device_put(jnp.asarray(rng.standard_normal((2, 150, cfg.hidden_size)), dtype), gpu)
    lengths = jax.device_put(np.array([150, 77], np.int32), gpu)
    want, want_cache = StageRunner(stage)(h, lengths, cache_len=160, mode="layerwise")
    scanned = ScannedModel.from_model(stage, consume=False)
    got, cache = scanned(h, lengths, cache_len=160)
    errs = {"hidden": rel_err(got, want), **{name: rel_err(getattr(cache, name), getattr(want_cache, name))
                                             for name in ("key", "value", "conv", "recurrent")}}
    print(f"GPU {jnp.dtype(dtype).name} stage [3, 10) {scanned.describe()} vs layer-wise:",
          " ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert got.devices() == {gpu} and all(v <= bound for v in errs.values()), errs
    assert cache.linear_layer_ids == want_cache.linear_layer_ids == (4, 5, 6, 8, 9)

    tokens = rng.integers(0, cfg.vocab_size, (2, 150)).astype(np.int32)
    model = _damp_residual_branches(init_model(cfg, dtype=dtype, seed=4, device=gpu), 0.2)
    want_logits, _ = jit_prefill(model, layerwise=True)(tokens)
    whole = jit_prefill_scanned(ScannedModel.from_model(model))
    got_logits, _ = whole(tokens)
    err = rel_err(got_logits, want_logits)
    print(f"GPU {jnp.dtype(dtype).name} whole model scanned vs layer-wise logits: {err:.1e}")
    assert err <= bound


@pytest.mark.parametrize("scan", [False, True], ids=["layerwise", "scanned"])
def test_gpu_pipeline_stages_on_one_gpu_equal_the_one_device_prefill(rng, scan):
    """The pipeline's GPU path on one GPU: two stages (the second starting inside the 3 + 1 pattern) both on GPU 0,
    each enqueued from its own host thread, over 3 microbatches of a batch of 5 (one padding row), as layer-wise
    StageRunners or as scanned programs. fp32: the logits and the stages' caches (merged) equal the one-device
    layer-wise prefill of the whole batch within 1e-5 (other GEMM shapes per microbatch: other fp32 sums). The
    residual branches are damped as in the other GPU tests: undamped, this random model amplified those sums'
    differences to 4.4e-5 in the logits on an H100. On two GPUs the same code also hands stage 0's output to the
    other device; here that hand-off is a no-op, so this checks the stage threads, the stage programs and the cache
    merge on a GPU, not the transfer."""
    from jax_dwdp.config import ModelConfig
    from jax_dwdp.model import init_model
    from jax_dwdp.model.qwen35_moe import Cache
    from jax_dwdp.parallel import Pipeline
    from jax_dwdp.prefill import jit_prefill
    from tests.test_model import _damp_residual_branches

    gpu = jax.devices("gpu")[0]
    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=10)
    model = _damp_residual_branches(init_model(cfg, dtype=jnp.float32, seed=6, device=gpu), 0.2)
    tokens = rng.integers(0, cfg.vocab_size, (5, 60)).astype(np.int32)
    lengths = np.array([60, 13, 1, 44, 60], np.int32)
    want, want_cache = jit_prefill(model, layerwise=True, cache_len=64)(tokens, lengths)
    pipe = Pipeline.from_model(model, 2, boundaries=[5], devices=[gpu, gpu], scan=scan)
    got, caches = pipe.prefill(tokens, lengths, microbatches=3, cache_len=64)
    merged = Cache.concat_layers(caches, gpu)
    errs = {"logits": rel_err(got, want), **{name: rel_err(getattr(merged, name), getattr(want_cache, name))
                                             for name in ("key", "value", "conv", "recurrent")}}
    print(f"GPU fp32 pipeline of 2 stages on one GPU ({'scanned' if scan else 'layer-wise'}, threads, 3 "
          "microbatches) vs one device:", " ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert got.shape == want.shape and got.devices() == {gpu}
    assert all(v <= 1e-5 for v in errs.values()), errs
    assert (merged.full_layer_ids, merged.linear_layer_ids) == (want_cache.full_layer_ids, want_cache.linear_layer_ids)
    np.testing.assert_array_equal(np.asarray(merged.lengths), np.asarray(want_cache.lengths))


@pytest.mark.parametrize("grouped_matmul", ["default", "mosaic"])
def test_gpu_bf16_prefill_runs_the_fast_kernels(rng, grouped_matmul):
    """bf16 on the GPU takes cuDNN attention, the Pallas gated delta rule and routing kernels (the conv kernel when
    chosen) and the GPU grouped matmul (the CUTLASS kernel when its library is built, else Mosaic; then Mosaic
    chosen); compare with GPU fp32 (XLA paths but the routing kernels)."""
    from jax_dwdp.kernels import KernelChoices, _cutlass, norm_rope
    from jax_dwdp.model import init_model, with_kernels
    from jax_dwdp.prefill import jit_prefill
    from tests.test_model import _damp_residual_branches

    kernels = KernelChoices.defaults("gpu")
    if grouped_matmul == "mosaic":
        kernels = kernels.replace(grouped_matmul="mosaic")
    want = _cutlass.TARGET if grouped_matmul == "default" and _cutlass.available() else "mosaic"

    cfg, tokens, m16, m32 = _bf16_and_fp32_models(rng, 1000)
    m16, m32 = with_kernels(m16, kernels), with_kernels(m32, kernels)
    text = jit_prefill(m16).lower(tokens, np.array([1000], np.int32)).as_text()
    assert want.lower() in text.lower(), f"bf16 GPU prefill did not use the expected grouped matmul ({want})"
    assert "gdn_recurrence" in text, "bf16 GPU prefill did not use the Pallas gated delta rule"
    for kernel in ("moe_topk_softmax", "moe_expert_ranks"):
        assert kernel in text, f"bf16 GPU prefill did not use the Pallas kernel {kernel}"
    assert norm_rope.supported(cfg.head_dim, cfg.rotary_dim) and "attention_norm_rope" in text
    assert "gdn_causal_conv_silu" not in text  # 1000 tokens: below conv.PALLAS_MIN_TOKENS, XLA's conv
    # The same weights with the conv kernel chosen at any size.
    m16c = with_kernels(m16, kernels.replace(conv="pallas"))
    short = tokens[:, :999]
    opted = jit_prefill(m16c).lower(short, np.array([999], np.int32)).as_text()
    assert "gdn_causal_conv_silu" in opted
    conv_err = rel_err(jit_prefill(m16c)(short)[0].astype(jnp.float32), jit_prefill(m32)(short)[0])
    print(f"GPU bf16 with the Pallas conv (chosen) vs fp32 logits: {conv_err:.2e}")
    assert conv_err <= 2e-2
    from jax_dwdp.model import fused_swiglu_enabled

    # Models keep the checkpoint layout by default (the fused SwiGLU kernel is opt-in); with the CUTLASS kernel, the
    # opt-in layout (same seed: the same weights, permuted) calls the fused kernel and matches fp32 too.
    assert not fused_swiglu_enabled(m16) and _cutlass.SWIGLU_TARGET not in text
    fused = want == _cutlass.TARGET
    if fused:
        m16f = _damp_residual_branches(init_model(cfg, dtype=jnp.bfloat16, seed=2, fused_swiglu=True,
                                                  kernels=kernels), 0.2)
        assert _cutlass.SWIGLU_TARGET in jit_prefill(m16f).lower(tokens, np.array([1000], np.int32)).as_text()
        err = rel_err(jit_prefill(m16f)(tokens)[0].astype(jnp.float32), jit_prefill(m32)(tokens)[0])
        print(f"GPU bf16 (fused SwiGLU kernel) vs fp32 logits: {err:.2e}")
        assert err <= 2e-2
    l16, _ = jit_prefill(m16)(tokens)
    l32, _ = jit_prefill(m32)(tokens)
    err = rel_err(l16.astype(jnp.float32), l32)
    print(f"GPU bf16 ({want} grouped matmul) vs fp32 logits: {err:.2e}")
    assert err <= 2e-2

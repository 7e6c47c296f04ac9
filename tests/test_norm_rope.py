"""Gated attention's q/k head norm + partial RoPE (`kernels.norm_rope`): the Pallas kernel (interpret mode on the CPU,
compiled on the GPU) against a float64 numpy reference and the XLA path, reading q where it sits in the interleaved
q/gate projection; the implementation switch at lowering; the model's attention on the GPU with and without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.kernels import norm_rope as nr
from jax_dwdp.kernels.choices import KernelChoices
from jax_dwdp.model.layers import rope_cos_sin

on_gpu = jax.default_backend() == "gpu"
EPS = 1e-6


def _inputs(rng, b, t, h, d, w, rd, dtype):
    x = jnp.asarray(rng.standard_normal((b, t, h, w)) * 2.0, dtype)
    weight = jnp.asarray(rng.standard_normal((d,)) * 0.1, dtype)
    positions = jnp.asarray(rng.integers(0, 5000, (b, t)), jnp.int32)
    cos, sin = rope_cos_sin(positions, rd, 1e7)
    return x, weight, cos, sin


def _reference_f64(x, weight, cos, sin, d):
    """The model's math in float64, without its intermediate rounding."""
    x = np.asarray(x, np.float64)[..., :d]
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPS) * (1 + np.asarray(weight, np.float64))
    rd = cos.shape[-1]
    c, s = np.asarray(cos, np.float64)[..., None, :], np.asarray(sin, np.float64)[..., None, :]
    rot = y[..., :rd]
    rotated = np.concatenate([-rot[..., rd // 2:], rot[..., :rd // 2]], axis=-1)
    return np.concatenate([rot * c + rotated * s, y[..., rd:]], axis=-1)


def _err(got, want) -> float:
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), "non-finite output (an unwritten element?)"
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("t", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("interleaved", [False, True])
def test_kernel_matches_float64(rng, t, interleaved):
    """Lengths around the 64-row block, q read from a [.., 2D] interleaved projection or a plain [.., D] k; head
    256 with rotary 64 (35B-A3B's pieces 32 + 32 + 128 + 64); fp32: within fp32 rounding of float64."""
    d, rd = 256, 64
    x, weight, cos, sin = _inputs(rng, 2, t, 3, d, 2 * d if interleaved else d, rd, jnp.float32)
    poison = jnp.full((2, t, 3, d), jnp.nan, jnp.float32)
    got = nr.norm_rope_pallas(x, weight, cos, sin, eps=EPS, head_dim=d, out=poison, interpret=not on_gpu)
    assert got.shape == (2, t, 3, d) and got.dtype == x.dtype
    want = _reference_f64(x, weight, cos, sin, d)
    err, err_xla = _err(got, want), _err(nr.norm_rope_xla(x, weight, cos, sin, eps=EPS, head_dim=d), want)
    print(f"T={t} interleaved={interleaved}: kernel {err:.2e}, xla {err_xla:.2e} vs float64 (bound 1e-5)")
    assert err <= 1e-5 and err_xla <= 1e-5


@pytest.mark.parametrize("d, rd", [(128, 32), (64, 64)])
def test_bf16_matches_the_xla_path(rng, d, rd):
    """bf16: the kernel rounds where the model does (after the norm, after the rotation), so it is within one bf16
    rounding of the XLA path; other head / rotary widths (pieces 16 + 16 + 64 + 32; all rotary)."""
    x, weight, cos, sin = _inputs(rng, 1, 100, 4, d, 2 * d, rd, jnp.bfloat16)
    got = nr.norm_rope_pallas(x, weight, cos, sin, eps=EPS, head_dim=d, interpret=not on_gpu)
    want = nr.norm_rope_xla(x, weight, cos, sin, eps=EPS, head_dim=d)
    diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    scale = np.abs(np.asarray(want, np.float32))
    print(f"bf16 d={d} rd={rd}: max |kernel - xla| {diff.max():.3e}, max relative to the element "
          f"{float(np.max(diff / np.maximum(scale, 1e-3))):.2e}")
    assert np.all(diff <= 2 ** -7 * np.maximum(scale, 2 ** -6)), "more than one bf16 rounding apart"
    assert _err(got, _reference_f64(x, weight, cos, sin, d)) <= 1e-2


def test_unsupported_widths_take_the_xla_path_or_fail_clearly(rng):
    assert nr.supported(256, 64) and nr.supported(128, 128)
    assert not nr.supported(256, 16) and not nr.supported(192, 64) and not nr.supported(256, 48)
    x, weight, cos, sin = _inputs(rng, 1, 8, 2, 24, 48, 8, jnp.bfloat16)
    got = nr.norm_rope(x, weight, cos, sin, eps=EPS, head_dim=24)  # not supported: XLA, whatever the platform
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(nr.norm_rope_xla(x, weight, cos, sin, eps=EPS, head_dim=24), np.float32))
    with pytest.raises(ValueError, match="head_dim 24"):
        nr.norm_rope_pallas(x, weight, cos, sin, eps=EPS, head_dim=24, interpret=True)


def test_implementation_switch(rng):
    """Lowered for CUDA the attention projection holds the kernel, for the CPU it does not;
    `KernelChoices.norm_rope="xla"` removes it from the CUDA lowering; fp32 inputs never take it; a bad forced
    form is named."""
    x, weight, cos, sin = _inputs(rng, 1, 16, 2, 256, 512, 64, jnp.bfloat16)
    pallas = KernelChoices.defaults("cpu")
    assert pallas.norm_rope == "pallas"

    def lowered(platform, args=(x, weight, cos, sin), kernels=pallas, **kw):
        traced = jax.jit(lambda *a: nr.norm_rope(*a, eps=EPS, head_dim=256, kernels=kernels, **kw)).trace(*args)
        return traced.lower(lowering_platforms=(platform,)).as_text()

    assert "attention_norm_rope" in lowered("cuda") and "attention_norm_rope" not in lowered("cpu")
    assert "attention_norm_rope" not in lowered("cuda", (x.astype(jnp.float32), weight, cos, sin))
    assert "attention_norm_rope" not in lowered("cuda", kernels=pallas.replace(norm_rope="xla"))
    with pytest.raises(ValueError, match="norm_rope: implementation='nope'"):
        lowered("cuda", implementation="nope")


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)")
def test_gpu_attention_layer_with_the_kernel_equals_xla(rng):
    """A 35B-A3B full-attention mixer at 1000 tokens, bf16, with the kernel and with XLA's passes: within bf16
    rounding of each other (the attention output, whose scale is set by v)."""
    from flax import nnx

    from jax_dwdp.config import ModelConfig
    from jax_dwdp.model.attention import GatedAttention

    cfg = ModelConfig.preset("35b-a3b")
    x = jnp.asarray(rng.standard_normal((1, 1000, cfg.hidden_size)), jnp.bfloat16)
    positions = jnp.arange(1000, dtype=jnp.int32)[None]
    outs = {}
    for impl in ("pallas", "xla"):
        kernels = KernelChoices.defaults("gpu").replace(norm_rope=impl)
        attn = GatedAttention(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), kernels=kernels)  # (the same weights)
        graph, state = nnx.split(attn)
        fn = jax.jit(lambda s, x, p: nnx.merge(graph, s)(x, p)[0])
        text = fn.lower(state, x, positions).as_text()
        assert ("attention_norm_rope" in text) == (impl == "pallas")
        outs[impl] = np.asarray(fn(state, x, positions), np.float32)
    err = float(np.abs(outs["pallas"] - outs["xla"]).max() / np.abs(outs["xla"]).max())
    print(f"attention mixer, kernel vs XLA norm + RoPE: {err:.2e} (bound 2e-2)")
    assert np.isfinite(outs["pallas"]).all() and err <= 2e-2

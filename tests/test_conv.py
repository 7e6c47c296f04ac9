"""Gated DeltaNet's causal depthwise conv + SiLU: the Pallas kernel (interpret mode on the CPU, compiled on the GPU)
against a float64 numpy reference, with and without cached inputs (history)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.kernels import conv

on_gpu = jax.default_backend() == "gpu"


def _reference_f64(x, weight, history=None):
    x = np.asarray(x, np.float64)
    b, t, c = x.shape
    k = weight.shape[-1]
    h = np.zeros((b, k - 1, c)) if history is None else np.asarray(history, np.float64)
    padded = np.concatenate([h, x], axis=1)
    w = np.asarray(weight, np.float64)[:, 0, :]
    out = sum(padded[:, j:j + t, :] * w[:, j] for j in range(k))
    return out / (1 + np.exp(-out))


def _inputs(rng, b, t, c, k, dtype):
    x = jnp.asarray(rng.standard_normal((b, t, c)), dtype)
    weight = jnp.asarray(rng.standard_normal((c, 1, k)) * k**-0.5, dtype)
    history = jnp.asarray(rng.standard_normal((b, k - 1, c)), dtype)
    return x, weight, history


def _check(got, want, what, bound):
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), f"{what}: non-finite output (an unwritten element?)"
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    print(f"{what}: max |err| / max |ref| = {err:.2e} (bound {bound:.0e})")
    assert err <= bound


@pytest.mark.parametrize("t", [1, 2, 31, 32, 33, 70])
@pytest.mark.parametrize("with_history", [False, True])
def test_kernel_matches_float64(rng, t, with_history):
    """Lengths around the kernel's 32-row block (1, 2 shorter than the conv's reach), channels not a multiple of the
    128-wide block (48 -> blocks of 16), fp32 inputs: within fp32 rounding of the float64 reference."""
    x, weight, history = _inputs(rng, 2, t, 48, 4, jnp.float32)
    history = history if with_history else None
    poison = jnp.full(x.shape, jnp.nan, x.dtype)
    got = conv.causal_conv_silu_pallas(x, weight, history, out=poison, interpret=not on_gpu)
    assert got.shape == x.shape and got.dtype == x.dtype
    _check(got, _reference_f64(x, weight, history), f"pallas T={t} history={with_history}", 1e-5)
    _check(conv.causal_conv_silu_xla(x, weight, history), _reference_f64(x, weight, history), "xla", 1e-5)


def test_bf16_matches_the_xla_path(rng):
    """bf16 in and out: the kernel and the XLA path round the same fp32 result (at most one bf16 ulp apart)."""
    x, weight, history = _inputs(rng, 1, 100, 256, 4, jnp.bfloat16)
    got = conv.causal_conv_silu_pallas(x, weight, history, interpret=not on_gpu)
    want = conv.causal_conv_silu_xla(x, weight, history)
    _check(got, _reference_f64(x, weight, history), "pallas bf16", 1e-2)
    diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    assert np.all(diff <= np.abs(np.asarray(want, np.float32)) * 2**-7 + 1e-6)


@pytest.mark.parametrize("silu", conv.SILU_FORMS)
@pytest.mark.parametrize("rows_per_program", [1, 3])
def test_silu_forms_and_rows_per_program(rng, silu, rows_per_program):
    """Each SiLU form and a program computing several row tiles in turn (70 rows: 3 tiles of 32 a program leave a
    partial program), into a NaN-poisoned buffer with history: within a bf16 step of the float64 reference in fp32
    (interpret mode on the CPU runs each form's exact formula; on the GPU the approximate instructions) and within
    one bf16 ulp of the XLA path in bf16."""
    x, weight, history = _inputs(rng, 2, 70, 48, 4, jnp.float32)
    poison = jnp.full(x.shape, jnp.nan, x.dtype)
    got = conv.causal_conv_silu_pallas(x, weight, history, out=poison, silu=silu, rows_per_program=rows_per_program,
                                       interpret=not on_gpu)
    bound = 1e-5 if silu == "exact" or not on_gpu else 2e-3
    _check(got, _reference_f64(x, weight, history), f"pallas {silu} x{rows_per_program}", bound)
    xb, wb, hb = (a.astype(jnp.bfloat16) for a in (x, weight, history))
    gotb = conv.causal_conv_silu_pallas(xb, wb, hb, silu=silu, rows_per_program=rows_per_program,
                                        interpret=not on_gpu)
    want = np.asarray(conv.causal_conv_silu_xla(xb, wb, hb), np.float32)
    assert np.all(np.abs(np.asarray(gotb, np.float32) - want) <= np.abs(want) * 2**-7 + 1e-6)
    with pytest.raises(ValueError, match="silu 'fast'"):
        conv.causal_conv_silu_pallas(x, weight, silu="fast", interpret=True)


def test_silu_form_from_the_environment(rng, monkeypatch):
    """$JAX_DWDP_CONV_SILU picks the form where the argument does not (the same output as the argument's), and a
    value that is no form is refused by name."""
    x, weight, history = _inputs(rng, 1, 40, 32, 4, jnp.float32)
    monkeypatch.setenv(conv.ENV_SILU, "exact")
    from_env = conv.causal_conv_silu_pallas(x, weight, history, interpret=not on_gpu)
    np.testing.assert_array_equal(from_env, conv.causal_conv_silu_pallas(x, weight, history, silu="exact",
                                                                         interpret=not on_gpu))
    monkeypatch.setenv(conv.ENV_SILU, "fast")
    with pytest.raises(ValueError, match="JAX_DWDP_CONV_SILU"):
        conv.causal_conv_silu_pallas(x, weight, interpret=True)


def test_channel_block_is_the_widest_power_of_two_up_to_max_block_c(rng, monkeypatch):
    """MAX_BLOCK_C, read at each call, caps the channel block (the benchmark's tile sweep sets it): the widest power
    of two dividing C, 0 below 16; a 512-wide block computes the same output as the default 128 (interpret mode on
    the CPU)."""
    assert [conv._block_c(c) for c in (8192, 384, 48, 24)] == [128, 128, 16, 0]
    monkeypatch.setattr(conv, "MAX_BLOCK_C", 512)
    assert [conv._block_c(c) for c in (8192, 768, 384)] == [512, 256, 128]
    x, weight, history = _inputs(rng, 1, 40, 512, 4, jnp.float32)
    wide = conv.causal_conv_silu_pallas(x, weight, history, out=jnp.full(x.shape, jnp.nan), interpret=not on_gpu)
    monkeypatch.setattr(conv, "MAX_BLOCK_C", 128)
    default = conv.causal_conv_silu_pallas(x, weight, history, interpret=not on_gpu)
    _check(wide, _reference_f64(x, weight, history), "pallas 512-wide block", 1e-5)
    np.testing.assert_allclose(np.asarray(wide), np.asarray(default), rtol=1e-6, atol=1e-6)


def test_dispatch_and_unsupported_shapes(rng, monkeypatch):
    monkeypatch.delenv(conv.ENV_IMPLEMENTATION, raising=False)
    xb, wb, _ = _inputs(rng, 1, 8, 32, 4, jnp.bfloat16)
    assert "gdn_causal_conv_silu" not in jax.jit(conv.causal_conv_silu).lower(xb, wb).as_text()  # XLA by default
    x, weight, _ = _inputs(rng, 1, 8, 24, 4, jnp.float32)  # 24 channels: no power-of-two block >= 16 divides them
    assert not conv.supported(24, 4) and conv.supported(48, 4) and not conv.supported(48, 3)
    np.testing.assert_array_equal(conv.causal_conv_silu(x, weight), conv.causal_conv_silu_xla(x, weight))
    with pytest.raises(ValueError, match="channels 24"):
        conv.causal_conv_silu_pallas(x, weight, interpret=True)
    monkeypatch.setenv(conv.ENV_IMPLEMENTATION, "cudnn")
    with pytest.raises(ValueError, match="'cudnn' is none of"):
        conv.causal_conv_silu(x, weight)


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)")
def test_gpu_model_sizes(rng):
    """35b-a3b's 8192 channels, 4099 tokens (a partial last block), bf16, in a jit with history, NaN-poisoned
    neighbours: the output equals the XLA path within one bf16 ulp and matches float64."""
    x, weight, history = _inputs(rng, 2, 4099, 8192, 4, jnp.bfloat16)
    got = jax.jit(lambda a, w, h: conv.causal_conv_silu_pallas(a, w, h, out=jnp.full(a.shape, jnp.nan, a.dtype)))(
        x, weight, history)
    want = conv.causal_conv_silu_xla(x, weight, history)
    _check(got, _reference_f64(x, weight, history), "pallas bf16 8192 channels", 1e-2)
    diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
    assert np.all(diff <= np.abs(np.asarray(want, np.float32)) * 2**-7 + 1e-6)


@pytest.mark.parametrize("with_history", [False, True])
def test_split_outputs_are_the_channel_ranges(rng, with_history):
    """`splits` (Gated DeltaNet's q, k, v): the kernel reads each channel range of x in place and writes it as its
    own array, equal to the pieces of the whole conv (ranges of 32, 32 and 64 channels, blocks of 32 and 64)."""
    x, weight, history = _inputs(rng, 2, 45, 128, 4, jnp.bfloat16)
    history = history if with_history else None
    whole = conv.causal_conv_silu_xla(x, weight, history)
    pieces = [conv.causal_conv_silu_pallas(x, weight, history, channels=r, interpret=not on_gpu)
              for r in ((0, 32), (32, 64), (64, 128))]
    for got, want in zip(pieces, jnp.split(whole, [32, 64], axis=-1)):
        assert got.shape == want.shape
        diff = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32))
        assert np.all(diff <= np.abs(np.asarray(want, np.float32)) * 2**-7 + 1e-6)
    xla = conv.causal_conv_silu(x, weight, history, splits=(32, 64), implementation="xla")
    assert len(xla) == 3 and all(np.array_equal(a, b) for a, b in zip(xla, jnp.split(whole, [32, 64], axis=-1)))
    with pytest.raises(ValueError, match="from 16"):
        conv.causal_conv_silu_pallas(x, weight, channels=(16, 80), interpret=True)  # 64 wide: start not aligned


def test_default_takes_the_kernel_from_the_token_threshold(rng, monkeypatch):
    """Lowered for CUDA: XLA's conv below PALLAS_MIN_TOKENS tokens, the kernel (one call per split) from there on;
    the CPU lowering never holds it; $JAX_DWDP_CONV=xla keeps XLA at any size."""
    monkeypatch.delenv(conv.ENV_IMPLEMENTATION, raising=False)
    weight = jnp.asarray(rng.standard_normal((64, 1, 4)), jnp.bfloat16)

    def lowered(t, platform="cuda"):
        x = jax.ShapeDtypeStruct((1, t, 64), jnp.bfloat16)
        fn = jax.jit(lambda x, w: conv.causal_conv_silu(x, w, splits=(16, 32)))
        return fn.trace(x, weight).lower(lowering_platforms=(platform,)).as_text()

    assert "gdn_causal_conv_silu" not in lowered(conv.PALLAS_MIN_TOKENS - 1)
    assert lowered(conv.PALLAS_MIN_TOKENS).count("gdn_causal_conv_silu") >= 3
    assert "gdn_causal_conv_silu" not in lowered(conv.PALLAS_MIN_TOKENS, "cpu")
    monkeypatch.setenv(conv.ENV_IMPLEMENTATION, "xla")
    assert "gdn_causal_conv_silu" not in lowered(conv.PALLAS_MIN_TOKENS)


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)")
def test_gpu_gdn_mixer_takes_the_split_kernel_and_equals_xla(rng, monkeypatch):
    """A 35B-A3B Gated DeltaNet mixer at 2 x 4100 tokens (past the threshold), bf16: the default lowers to the split
    conv kernel, and its output is within bf16 rounding of the mixer with XLA's conv."""
    from flax import nnx

    from jax_dwdp.config import ModelConfig
    from jax_dwdp.model.gated_deltanet import GatedDeltaNet

    cfg = ModelConfig.preset("35b-a3b")
    mixer = GatedDeltaNet(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(1))
    x = jnp.asarray(rng.standard_normal((2, 4100, cfg.hidden_size)), jnp.bfloat16)
    lengths = jnp.array([4100, 3000], jnp.int32)
    outs = {}
    for impl in (None, "xla"):
        if impl is None:
            monkeypatch.delenv(conv.ENV_IMPLEMENTATION, raising=False)
        else:
            monkeypatch.setenv(conv.ENV_IMPLEMENTATION, impl)
        graph, state = nnx.split(mixer)
        fn = jax.jit(lambda s, x, n: nnx.merge(graph, s)(x, n)[0])
        assert ("gdn_causal_conv_silu" in fn.lower(state, x, lengths).as_text()) == (impl is None)
        outs[impl] = np.asarray(fn(state, x, lengths), np.float32)
    err = float(np.abs(outs[None] - outs["xla"]).max() / np.abs(outs["xla"]).max())
    print(f"GDN mixer, split conv kernel vs XLA's conv: {err:.2e} (bound 2e-2)")
    assert np.isfinite(outs[None]).all() and err <= 2e-2

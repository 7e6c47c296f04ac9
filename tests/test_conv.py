"""Gated DeltaNet's causal depthwise conv + SiLU: the Pallas kernel (interpret mode on the CPU, compiled on the GPU)
against a float64 numpy reference, with and without cached inputs (history)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.kernels import conv
from jax_dwdp.kernels.choices import KernelChoices

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


SILU_BOUNDS = {"ex2": 1e-6, "tanh": 1e-5}  # fp32 vs float64 on the GPU (measured 1e-7, 2e-6)


@pytest.mark.parametrize("silu", conv.SILU_FORMS)
@pytest.mark.parametrize("rows_per_program", [1, 3])
def test_silu_forms_and_rows_per_program(rng, silu, rows_per_program):
    """Each SiLU form and a program computing several row tiles in turn (200 rows: with 3 tiles of 32 a program,
    three programs, the last one partial), into a NaN-poisoned buffer with history: fp32 against the float64
    reference (interpret mode on the CPU runs each form's exact formula; on the GPU the approximate instructions,
    each within its measured error), and bf16 within one bf16 step of the XLA path."""
    x, weight, history = _inputs(rng, 2, 200, 48, 4, jnp.float32)
    poison = jnp.full(x.shape, jnp.nan, x.dtype)
    got = conv.causal_conv_silu_pallas(x, weight, history, out=poison, silu=silu, rows_per_program=rows_per_program,
                                       interpret=not on_gpu)
    _check(got, _reference_f64(x, weight, history), f"pallas {silu} x{rows_per_program}", SILU_BOUNDS[silu])
    xb, wb, hb = (a.astype(jnp.bfloat16) for a in (x, weight, history))
    gotb = conv.causal_conv_silu_pallas(xb, wb, hb, silu=silu, rows_per_program=rows_per_program,
                                        interpret=not on_gpu)
    want = np.asarray(conv.causal_conv_silu_xla(xb, wb, hb), np.float32)
    assert np.all(np.abs(np.asarray(gotb, np.float32) - want) <= np.abs(want) * 2**-7 + 1e-6)
    with pytest.raises(ValueError, match="silu='fast'"):
        conv.causal_conv_silu_pallas(x, weight, silu="fast", interpret=True)
    with pytest.raises(ValueError, match="rows_per_program 0"):
        conv.causal_conv_silu_pallas(x, weight, rows_per_program=0, interpret=True)


@pytest.mark.parametrize("silu", conv.SILU_FORMS)
def test_silu_forms_at_extreme_values(silu):
    """Each form at 0, +-20, +-87.5, +-100 (fp32; a conv with one tap on, so the conv is the input; width 4 and width
    1, which has no left padding in interpret mode): silu(x) within the form's error (ex2 2e-5 relative, the rounding of x log2 e scaled by ex2; tanh 2^-10 |x| absolute: tanh.approx's error, and at negative
    x the cancellation in x/2 (1 + tanh(x/2)) leaves no relative accuracy), or 1e-30 absolute where silu(x) is about
    0; with width 1, inf at inf and NaN at -inf and NaN, as x * sigmoid(x) gives (width 4 would spread 0 * inf to the
    next rows)."""
    finite = np.array([0.0, 20.0, -20.0, 87.5, -87.5, 100.0, -100.0], np.float32)
    special = np.array([1.0, np.inf, -np.inf, np.nan], np.float32)
    for taps, values in (([0.0, 0.0, 0.0, 1.0], finite), ([1.0], np.concatenate([finite, special]))):
        v = np.tile(values, 4)
        x = jnp.asarray(v[None, :, None] * np.ones((1, 1, 16), np.float32))
        w = jnp.asarray(np.broadcast_to(np.array(taps), (16, 1, len(taps))), jnp.float32)
        got = np.asarray(conv.causal_conv_silu_pallas(x, w, silu=silu, interpret=not on_gpu), np.float64)[0, :, 0]
        v = v.astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            want = v / (1 + np.exp(-v))
        ok = np.isfinite(want)
        rel, scaled = {"ex2": (2e-5, 0.0), "tanh": (0.0, 2.0**-10)}[silu]
        bound = rel * np.abs(want[ok]) + scaled * np.abs(v[ok]) + 1e-30
        assert np.all(np.abs(got[ok] - want[ok]) <= bound), (silu, taps, got, want)
        assert np.all(got[v == np.inf] == np.inf) and np.all(np.isnan(got[~ok & (v != np.inf)])), (silu, got)


def test_silu_form_reaches_the_kernel(rng):
    """The kernel as traced for the GPU (no interpret mode) computes the form chosen by the argument, else the
    process's `KernelChoices.conv_silu` (ex2 by default); through `causal_conv_silu`, the form of the choices it is
    given: ex2.approx or tanh.approx in its jaxpr. A form that is not one of SILU_FORMS is refused."""
    x, weight, _ = _inputs(rng, 1, 40, 32, 4, jnp.bfloat16)
    marks = {"ex2": "ex2.approx", "tanh": "tanh.approx"}

    def found(fn):
        text = str(jax.make_jaxpr(fn)(x, weight))
        forms = [form for form, mark in marks.items() if mark in text]
        assert len(forms) == 1, forms
        return forms[0]

    assert found(lambda a, w: conv.causal_conv_silu_pallas(a, w)) == KernelChoices.from_environment().conv_silu
    assert KernelChoices.defaults().conv_silu == "ex2"
    assert all(found(lambda a, w, f=form: conv.causal_conv_silu_pallas(a, w, silu=f)) == form
               for form in conv.SILU_FORMS)
    for form in conv.SILU_FORMS:  # the model's path: the kernel chosen for every size, the choices' SiLU
        kernels = KernelChoices.defaults().replace(conv="pallas", conv_silu=form)
        assert found(lambda a, w, k=kernels: conv.causal_conv_silu(a, w, kernels=k)) == form
    with pytest.raises(ValueError, match="silu='exact' is none of"):
        conv.causal_conv_silu_pallas(x, weight, silu="exact", interpret=True)


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


def test_dispatch_and_unsupported_shapes(rng):
    xb, wb, _ = _inputs(rng, 1, 8, 32, 4, jnp.bfloat16)
    assert "gdn_causal_conv_silu" not in jax.jit(conv.causal_conv_silu).lower(xb, wb).as_text()  # XLA by default
    x, weight, _ = _inputs(rng, 1, 8, 24, 4, jnp.float32)  # 24 channels: no power-of-two block >= 16 divides them
    assert not conv.supported(24, 4) and conv.supported(48, 4) and not conv.supported(48, 3)
    np.testing.assert_array_equal(conv.causal_conv_silu(x, weight), conv.causal_conv_silu_xla(x, weight))
    with pytest.raises(ValueError, match="channels 24"):
        conv.causal_conv_silu_pallas(x, weight, interpret=True)
    with pytest.raises(ValueError, match="implementation='cudnn' is none of"):
        conv.causal_conv_silu(x, weight, implementation="cudnn")


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


def test_default_takes_the_kernel_from_the_token_threshold(rng):
    """Lowered for CUDA: XLA's conv below PALLAS_MIN_TOKENS tokens, the kernel (one call per split) from there on;
    the CPU lowering never holds it; `KernelChoices.conv="xla"` keeps XLA at any size, "pallas" takes the kernel
    below the threshold too."""
    weight = jnp.asarray(rng.standard_normal((64, 1, 4)), jnp.bfloat16)
    default = KernelChoices.defaults("cpu")
    assert default.conv is None

    def lowered(t, platform="cuda", kernels=default):
        x = jax.ShapeDtypeStruct((1, t, 64), jnp.bfloat16)
        fn = jax.jit(lambda x, w: conv.causal_conv_silu(x, w, splits=(16, 32), kernels=kernels))
        return fn.trace(x, weight).lower(lowering_platforms=(platform,)).as_text()

    assert "gdn_causal_conv_silu" not in lowered(conv.PALLAS_MIN_TOKENS - 1)
    assert lowered(conv.PALLAS_MIN_TOKENS).count("gdn_causal_conv_silu") >= 3
    assert "gdn_causal_conv_silu" not in lowered(conv.PALLAS_MIN_TOKENS, "cpu")
    assert "gdn_causal_conv_silu" not in lowered(conv.PALLAS_MIN_TOKENS, kernels=default.replace(conv="xla"))
    assert "gdn_causal_conv_silu" in lowered(64, kernels=default.replace(conv="pallas"))


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)")
def test_gpu_gdn_mixer_takes_the_split_kernel_and_equals_xla(rng):
    """A 35B-A3B Gated DeltaNet mixer at 2 x 4100 tokens (past the threshold), bf16: the default lowers to the split
    conv kernel, and its output is within bf16 rounding of the mixer with XLA's conv."""
    from flax import nnx

    from jax_dwdp.config import ModelConfig
    from jax_dwdp.model.gated_deltanet import GatedDeltaNet

    cfg = ModelConfig.preset("35b-a3b")
    x = jnp.asarray(rng.standard_normal((2, 4100, cfg.hidden_size)), jnp.bfloat16)
    lengths = jnp.array([4100, 3000], jnp.int32)
    outs = {}
    for impl in (None, "xla"):
        kernels = KernelChoices.defaults("gpu").replace(conv=impl)
        mixer = GatedDeltaNet(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(1), kernels=kernels)  # (the same weights)
        graph, state = nnx.split(mixer)
        fn = jax.jit(lambda s, x, n: nnx.merge(graph, s)(x, n)[0])
        assert ("gdn_causal_conv_silu" in fn.lower(state, x, lengths).as_text()) == (impl is None)
        outs[impl] = np.asarray(fn(state, x, lengths), np.float32)
    err = float(np.abs(outs[None] - outs["xla"]).max() / np.abs(outs["xla"]).max())
    print(f"GDN mixer, split conv kernel vs XLA's conv: {err:.2e} (bound 2e-2)")
    assert np.isfinite(outs[None]).all() and err <= 2e-2

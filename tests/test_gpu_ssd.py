"""The Pallas SSD scan on the GPU at Nemotron-3 Nano 30B-A3B's heads (64 heads of 64, 8 B/C groups, state 128,
chunks of 128) against a float64 reference and against the XLA scan (`ssd_chunked_xla`, fp32) in the same process
(skipped without a GPU; JAX_DWDP_TEST_GPU=1)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.nemotron_h_config import NemotronHConfig
from tests.ssd_cases import (BOUND, BOUND_FP32, check_against_reference, poisoned, reference_per_sequence, rel_err,
                             ssd_inputs)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)"),
]

CFG = NemotronHConfig.preset("nano-30b-a3b")
H, P, G, N, CHUNK = CFG.mamba_num_heads, CFG.mamba_head_dim, CFG.n_groups, CFG.ssm_state_size, CFG.chunk_size
LENGTHS = np.array([4000, 1, 63, 64, 65, 1000])  # the longest off the chunk: the batch's masked stores run


@functools.lru_cache(maxsize=2)
def _mixed_batch(initial: bool):
    """The right-padded batch of LENGTHS (dt = 0 past each), its per-sequence float64 reference (by chunks,
    `ssd_float64_chunked`, which the CPU tests prove equal to the recurrence) and the XLA scan's output; built
    once per initial state for all the variants."""
    from jax_dwdp.kernels.ssd import ssd_chunked_xla

    rng = np.random.default_rng(48 + initial)
    args = ssd_inputs(rng, len(LENGTHS), int(LENGTHS.max()), H, P, G, N, initial=initial, lengths=LENGTHS)
    ref = reference_per_sequence(*args, LENGTHS, chunked=True)
    x, dt, a, b, c, h0 = args
    xla = jax.jit(functools.partial(ssd_chunked_xla, chunk_size=CHUNK))(x, dt, a, b, c, initial_state=h0)
    return args, ref, jax.device_get(xla)


@pytest.mark.parametrize("form", [{}, {"block_p": 32, "block_n": 64, "row_blocks": 1, "num_warps": (4, 4, 8),
                                   "num_stages": (2, 2, 2)}],
                         ids=["default", "other-blocks"])
@pytest.mark.parametrize("initial", [False, True])
def test_kernel_matches_float64_and_xla_at_30b_a3b_heads(form, initial):
    """Lengths 4000, 1, 63, 64, 65 and 1000 in one right-padded batch, bf16 inputs, y into a NaN-filled buffer:
    each sequence's y and final state within BOUND of float64 alone, and of the XLA scan on the same batch."""
    from jax_dwdp.kernels.ssd_pallas import Tuning, ssd_chunked_pallas

    (x, dt, a, b, c, h0), ref, (y_xla, s_xla) = _mixed_batch(initial)
    y, state = ssd_chunked_pallas(x, dt, a, b, c, h0, poisoned(x.shape), chunk_size=CHUNK,
                                  tuning=Tuning(**form))
    label = f"GPU {form or 'default'} initial={initial}"
    check_against_reference(y, state, ref, LENGTHS, f"{label} vs float64", BOUND)
    xla_ref = [(np.asarray(y_xla[i, :n]), np.asarray(s_xla[i])) for i, n in enumerate(LENGTHS)]
    check_against_reference(y, state, xla_ref, LENGTHS, f"{label} vs XLA", BOUND)
    xla_err = max(max(rel_err(y_xla[i, :n], ry), rel_err(s_xla[i], rs)) for i, (n, (ry, rs)) in
                  enumerate(zip(LENGTHS, ref)))
    print(f"{label}: the XLA scan vs float64 {xla_err:.2e}")


@pytest.mark.parametrize("t", [1, 63, 64, 65, 1000, 4096])
def test_chosen_kernel_single_lengths(rng, t):
    """`ssd_chunked` with `KernelChoices.ssd="pallas"` (the model's call) runs the kernel on the GPU (at 1000
    tokens: the same bits as calling it by name), within BOUND of float64, for lengths off and on the chunk."""
    from jax_dwdp.kernels.choices import KernelChoices
    from jax_dwdp.kernels.ssd import ssd_chunked
    from jax_dwdp.kernels.ssd_pallas import ssd_chunked_pallas

    x, dt, a, b, c, h0 = ssd_inputs(rng, 1, t, H, P, G, N, initial=True)
    kernels = KernelChoices.defaults("gpu").replace(ssd="pallas")
    y, state = jax.jit(functools.partial(ssd_chunked, chunk_size=CHUNK, kernels=kernels))(x, dt, a, b, c,
                                                                                           initial_state=h0)
    if t == 1000:
        y_named, s_named = ssd_chunked_pallas(x, dt, a, b, c, h0, chunk_size=CHUNK)
        assert np.array_equal(np.asarray(y), np.asarray(y_named)) and np.array_equal(np.asarray(state),
                                                                                     np.asarray(s_named))
    ref = reference_per_sequence(x, dt, a, b, c, h0, [t], chunked=True)
    check_against_reference(y, state, ref, [t], f"GPU chosen T={t}", BOUND)


def test_fp32_inputs_compile_and_match_float64(rng):
    """fp32 inputs (fp32 operands, IEEE products: twice the bf16 loop's shared memory) compile for this GPU and
    stay within the fp32 bound of float64, off the chunk."""
    from jax_dwdp.kernels.ssd_pallas import ssd_chunked_pallas

    x, dt, a, b, c, h0 = ssd_inputs(rng, 1, 1000, H, P, G, N, initial=True, dtype=jnp.float32)
    y, state = ssd_chunked_pallas(x, dt, a, b, c, h0, poisoned(x.shape), chunk_size=CHUNK)
    ref = reference_per_sequence(x, dt, a, b, c, h0, [1000], chunked=True)
    check_against_reference(y, state, ref, [1000], "GPU fp32 T=1000", BOUND_FP32)


def test_kernel_in_two_pieces_equals_one(rng):
    """A prompt prefilled in two pieces (the second from the first's state) equals one call, within bf16 rounding."""
    from jax_dwdp.kernels.ssd_pallas import ssd_chunked_pallas

    x, dt, a, b, c, _ = ssd_inputs(rng, 2, 3000, H, P, G, N, initial=False)
    run = functools.partial(ssd_chunked_pallas, chunk_size=CHUNK)
    y, state = run(x, dt, a, b, c)
    cut = 1234
    y1, s1 = run(*(v[:, :cut] for v in (x, dt)), a, *(v[:, :cut] for v in (b, c)))
    y2, s2 = run(*(v[:, cut:] for v in (x, dt)), a, *(v[:, cut:] for v in (b, c)), s1)
    err_y, err_s = rel_err(jnp.concatenate([y1, y2], axis=1), y), rel_err(s2, state)
    print(f"GPU two pieces vs one: y {err_y:.2e}, state {err_s:.2e}")
    assert err_y <= BOUND and err_s <= BOUND


def test_bf16_model_mixer_runs_the_kernel_and_matches_xla(rng):
    """The bf16 Mamba-2 mixer of 30B-A3B with `ssd="pallas"` against the same weights with `ssd="xla"` on a batch
    of unequal lengths: outputs and both caches within bf16 rounding (the mixer's output is bf16)."""
    from flax import nnx

    from jax_dwdp.kernels.choices import KernelChoices
    from jax_dwdp.model.mamba2 import Mamba2Mixer

    gpu = KernelChoices.defaults("gpu")
    mixer = Mamba2Mixer(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), kernels=gpu.replace(ssd="pallas"))
    graph, weights = nnx.split(mixer)
    graph_xla, _ = nnx.split(Mamba2Mixer(CFG, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), kernels=gpu.replace(ssd="xla")))
    x = jnp.asarray(rng.standard_normal((2, 2000, CFG.hidden_size)) * 0.5, jnp.bfloat16)
    lengths = jnp.array([2000, 777], jnp.int32)
    out = {}
    for name, g in (("pallas", graph), ("xla", graph_xla)):
        fn = jax.jit(lambda w, x, n, g=g: nnx.merge(g, w)(x, n))
        out[name] = jax.device_get(fn(weights, x, lengths))
    (y_k, (conv_k, s_k)), (y_x, (conv_x, s_x)) = out["pallas"], out["xla"]
    errors = {"y": max(rel_err(y_k[i, :n], y_x[i, :n].astype(np.float64)) for i, n in enumerate([2000, 777])),
              "ssm state": rel_err(s_k, s_x), "conv state": rel_err(conv_k, conv_x.astype(np.float64))}
    print("GPU mixer pallas vs xla:", " ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    assert errors["conv state"] == 0.0 and errors["y"] <= 2e-2 and errors["ssm state"] <= BOUND

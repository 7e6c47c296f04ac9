"""The MoE token permutation (dispatch into expert order, combine back with the weighted top-k sum): the Pallas
dispatch against the XLA reference, in interpret mode on the CPU and compiled on the GPU (JAX_DWDP_TEST_GPU=1); the
Triton lowering for CUDA checked on any machine; the combine (XLA's) against float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp import kernels
from jax_dwdp.kernels import permute, routing
from jax_dwdp.kernels.choices import KernelChoices

on_gpu = jax.default_backend() == "gpu"
# tokens, width, top-k, experts, block_columns (None: the default; small blocks exercise the masked last block)
SHAPES = [(1, 12, 2, 8, None), (5, 40, 3, 6, 16), (50, 12, 2, 8, None), (37, 40, 3, 6, 16), (64, 256, 8, 32, 64),
          (33, 96, 10, 64, 64)]  # fewer tokens than a block (decode sizes), a partial last block, several blocks


def _routing(rng, m, k, e):
    logits = jnp.asarray(rng.standard_normal((m, e)), jnp.float32)
    ids, weights = routing.topk_softmax_xla(logits, k)
    order, inverse, _ = routing.expert_permutation_xla(ids, e)
    return order, inverse, weights


def test_gather_rows_is_bit_identical(rng):
    """The XLA dispatch moves 2-byte rows as 32-bit words: bit-identical to x[index] (NaN payloads and -0 too),
    and the plain path for other dtypes or odd widths."""
    x = rng.standard_normal((50, 12)).astype(np.float32)
    x[3, 5], x[7, 0] = np.nan, -0.0
    index = jnp.asarray(rng.integers(0, 50, 120), jnp.int32)
    for dtype, width in ((jnp.bfloat16, 12), (jnp.float16, 12), (jnp.float32, 12), (jnp.bfloat16, 11)):
        a = jnp.asarray(x[:, :width], dtype)
        got, want = jax.jit(kernels.gather_rows)(a, index), a[index]
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))


@pytest.mark.parametrize("m,h,k,e,bw", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dispatch_kernel_places_every_row(rng, m, h, k, e, bw, dtype):
    """Every (token, slot) pair's row lands at its expert-order row, bit for bit (fresh random rows, NaN and -0
    included: a scatter moves bits); the padding rows are zeros; the XLA path agrees on the M*k rows."""
    x = rng.standard_normal((m, h)).astype(np.float32)
    x[0, 2], x[-1, 0] = np.nan, -0.0
    x = jnp.asarray(x, dtype)
    order, inverse, _ = _routing(rng, m, k, e)
    rows = m * k + 5
    got = permute.dispatch_rows_pallas(x, order, inverse, k=k, rows=rows, block_columns=bw, interpret=not on_gpu)
    want = x[np.asarray(order) // k]
    print(f"dispatch {dtype.__name__} M={m} H={h} k={k}: rows bit-identical to x[order // k]")
    assert got.shape == (rows, h) and got.dtype == dtype
    bits = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    np.testing.assert_array_equal(bits(got[: m * k]), bits(want))
    np.testing.assert_array_equal(np.asarray(got[m * k :], np.float32), 0)
    xla = permute.dispatch_rows_xla(x, order, inverse, k=k, rows=rows)
    np.testing.assert_array_equal(bits(xla[: m * k]), bits(want))


@pytest.mark.parametrize("m,h,k,e,bw", SHAPES[:4])
@pytest.mark.parametrize("with_add", [False, True])
def test_combine_matches_reference(rng, m, h, k, e, bw, with_add):
    """out[t] = sum_j w[t, j] * y[inverse[t*k + j]] (+ add): fp32 against float64 within 1e-5; bf16 (each product
    rounded to bf16, the sum in fp32) within a few bf16 steps of it."""
    del bw
    order, inverse, weights = _routing(rng, m, k, e)
    y64 = rng.standard_normal((m * k + 3, h))
    add64 = rng.standard_normal((m, h))
    want64 = np.einsum("mkh,mk->mh", y64[np.asarray(inverse).reshape(m, k)], np.asarray(weights, np.float64))
    want64 = want64 + (add64 if with_add else 0)
    for dtype, bound in ((jnp.float32, 1e-5), (jnp.bfloat16, 0.1)):
        y, w = jnp.asarray(y64, dtype), weights.astype(dtype)
        add = jnp.asarray(add64, dtype) if with_add else None
        got = kernels.combine_rows(y, inverse, w, add)
        assert got.shape == (m, h) and got.dtype == dtype
        err = float(np.max(np.abs(np.asarray(got, np.float64) - want64)))
        print(f"combine {dtype.__name__} M={m} H={h} k={k} add={with_add}: max |err| vs float64 {err:.2e}")
        assert err <= bound


def test_dispatch_and_combine_round_trip_through_the_moe_block(rng, monkeypatch):
    """`moe.routed_experts` with the Pallas dispatch (interpret mode) equals it with the XLA one: the kernel is
    wired with the right order / inverse (a swapped pair would scramble the tokens)."""
    from jax_dwdp.model.moe import routed_experts

    m, h, i, e, k = 24, 32, 16, 8, 2
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((m, e)), jnp.float32)
    ids, weights = routing.topk_softmax_xla(logits, k)
    gate_up = jnp.asarray(rng.standard_normal((e, 2 * i, h)) * h**-0.5, jnp.float32)
    down = jnp.asarray(rng.standard_normal((e, h, i)) * i**-0.5, jnp.float32)
    add = jnp.asarray(rng.standard_normal((m, h)), jnp.float32)
    want = routed_experts(x, ids, weights, gate_up, down, add=add)
    interp = dict(interpret=True)
    monkeypatch.setattr(permute, "dispatch_rows_xla",
                        lambda *a, **kw: permute.dispatch_rows_pallas(*a, **kw, **interp))
    got = routed_experts(x, ids, weights, gate_up, down, add=add)
    err = float(jnp.max(jnp.abs(got - want)))
    print(f"routed experts, Pallas dispatch (interpret) vs XLA: max |diff| {err:.2e}")
    assert err <= 1e-5


def test_implementation_switch_and_bad_input(rng):
    """A CPU computation takes XLA by default (the kernel is chosen at lowering, so also on a GPU host);
    `KernelChoices.dispatch="pallas"` keeps that guard, "xla" keeps the kernel out of a CUDA lowering; the combine
    is XLA's fusion on every platform; bad names and shapes are clear errors."""
    m, h, k, e = 20, 8, 2, 4
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16), cpu)
    order, inverse, weights = (jax.device_put(a, cpu) for a in _routing(rng, m, k, e))
    pallas = KernelChoices.defaults("cpu")
    assert pallas.dispatch == "pallas"
    with jax.default_device(cpu):
        text = jax.jit(lambda *a: kernels.dispatch_rows(*a, k, m * k, kernels=pallas)).lower(x, order, inverse)
        assert "moe_dispatch_rows" not in text.as_text()
        got = kernels.dispatch_rows(x, order, inverse, k, m * k, kernels=pallas)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(x[np.asarray(order) // k], np.float32))
    y = jnp.asarray(rng.standard_normal((m * k, h)), jnp.bfloat16)
    cuda = jax.jit(lambda *a: kernels.combine_rows(*a)).trace(y, inverse, weights).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" not in cuda.as_text()  # XLA's, on the GPU too

    def dispatch_for_cuda(choices):
        return jax.jit(lambda *a: kernels.dispatch_rows(*a, k, m * k, kernels=choices)).trace(x, order, inverse).lower(
            lowering_platforms=("cuda",)).as_text()

    assert "moe_dispatch_rows" not in dispatch_for_cuda(pallas.replace(dispatch="xla"))
    assert "moe_dispatch_rows" in dispatch_for_cuda(pallas)
    with pytest.raises(ValueError, match="implementation='cub'"):
        kernels.dispatch_rows(x, order, inverse, k, m * k, implementation="cub")
    with pytest.raises(ValueError, match="40 <= rows < 168"):
        kernels.dispatch_rows(x, order, inverse, k, m * k - 1)
    with pytest.raises(ValueError, match="40 <= rows < 168"):
        kernels.dispatch_rows(x, order, inverse, k, m * k + 500)
    with pytest.raises(ValueError, match="of y's dtype bfloat16"):
        kernels.combine_rows(y, inverse, weights, x.astype(jnp.float32))
    with pytest.raises(ValueError, match="y with >= 40 rows"):
        kernels.combine_rows(y[:30], inverse, weights)
    with pytest.raises(ValueError, match="block_tokens=12 is not a power of two"):
        permute.dispatch_rows_pallas(x, order, inverse, k=k, rows=m * k, block_tokens=12, interpret=True)
    with pytest.raises(ValueError, match=r"add \(20, 8\)"):
        kernels.combine_rows(y, inverse, weights, x[:3])


def test_kernels_lower_for_cuda_with_triton():
    """The Triton lowering (to TTIR) of the dispatch kernel and of the routing kernels succeeds for CUDA on any
    machine: a lowering error surfaces in CI, not first on a GPU."""
    choices = KernelChoices.defaults("cpu")
    m, h, k, e = 300, 2048, 8, 256
    x = jax.ShapeDtypeStruct((m, h), jnp.bfloat16)
    idx = jax.ShapeDtypeStruct((m * k,), jnp.int32)
    logits = jax.ShapeDtypeStruct((m, e), jnp.float32)
    ids = jax.ShapeDtypeStruct((m, k), jnp.int32)
    programs = {
        "moe_dispatch_rows": (lambda x, o, i: kernels.dispatch_rows(x, o, i, k, m * k + 4, kernels=choices),
                              (x, idx, idx)),
        "moe_topk_softmax": (lambda l: routing.topk_softmax(l, k, kernels=choices), (logits,)),
        "moe_expert_ranks": (lambda i: routing.expert_permutation(i, e, kernels=choices), (ids,)),
    }
    for name, (fn, args) in programs.items():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text and name in text, name


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)")
@pytest.mark.parametrize("h,e,k", [(2048, 256, 8), (3072, 256, 8), (4096, 512, 10)])  # 35b / 122b / 397b
def test_gpu_permutation_at_model_sizes(rng, h, e, k):
    """16K tokens (plus an odd tail) at the presets' widths, the dispatch kernel inside a jit as the model calls
    it: bit-identical to the XLA gather, the padding rows zero although the memory they land in held NaN (a freed
    NaN buffer of the same size is allocated and dropped first)."""
    m = 16384 + 5
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    order, inverse, _ = _routing(rng, m, k, e)
    rows = m * k + 5  # padding rows for every k (the model's row multiple of 8 leaves none at k = 8)
    poison = jnp.full((rows, h), jnp.nan, jnp.bfloat16).block_until_ready()
    del poison
    got = jax.jit(lambda *a: permute.dispatch_rows(*a, k, rows, implementation="pallas"))(x, order, inverse)
    want = jax.jit(lambda *a: permute.dispatch_rows_xla(*a, k=k, rows=rows))(x, order, inverse)
    bits = lambda a: np.asarray(a).view(np.uint16)  # noqa: E731
    np.testing.assert_array_equal(bits(got[: m * k]), bits(want[: m * k]))
    np.testing.assert_array_equal(np.asarray(got[m * k :], np.float32), 0)
    print(f"H={h} k={k}: dispatch bit-identical, padding rows zero")

"""MoE routing kernels (top-k softmax, counting sort by expert) against the XLA reference: in interpret mode on the
CPU, compiled on the GPU (JAX_DWDP_TEST_GPU=1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.kernels import routing
from jax_dwdp.kernels.choices import KernelChoices

SHAPES = [(100, 8, 2), (37, 6, 3), (64, 256, 8), (130, 512, 10)]  # tokens, experts, top-k (odd sizes padded)
on_gpu = jax.default_backend() == "gpu"


def _topk_reference_f64(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(p, ids, axis=1)
    return ids, top / top.sum(axis=1, keepdims=True)


def _check_topk(ids, weights, logits, k, what):
    want_ids, want_w = _topk_reference_f64(np.asarray(logits, np.float32), k)
    xla_ids, xla_w = routing.topk_softmax_xla(logits, k)
    err = float(np.max(np.abs(np.asarray(weights, np.float64) - want_w)))
    print(f"{what}: {logits.shape} top-{k}: weights max |err| vs float64 {err:.2e}")
    assert ids.shape == (logits.shape[0], k) and ids.dtype == jnp.int32 and weights.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(xla_ids))
    assert err <= 1e-6
    np.testing.assert_allclose(np.asarray(weights), np.asarray(xla_w), rtol=1e-6, atol=1e-7)


def _check_permutation(got, ids, e, what):
    order, inverse, sizes = (np.asarray(a) for a in got)
    flat = np.asarray(ids).reshape(-1)
    want = np.argsort(flat, kind="stable")
    print(f"{what}: {ids.shape} over {e} experts: order == stable argsort {np.array_equal(order, want)}")
    np.testing.assert_array_equal(order, want)
    np.testing.assert_array_equal(inverse[order], np.arange(flat.size))
    np.testing.assert_array_equal(sizes, np.bincount(flat, minlength=e))
    assert order.dtype == inverse.dtype == sizes.dtype == np.int32


@pytest.mark.parametrize("m,e,k", SHAPES)
def test_topk_kernel_matches_reference(rng, m, e, k):
    """Fresh random bf16 logits; the kernel chooses exactly the float64 reference's experts, in its order; weights
    within 1e-6. (bf16 logits tie often: the ties go to the lower id in both.)"""
    logits = jnp.asarray(rng.standard_normal((m, e)) * 2, jnp.bfloat16)
    ids, weights = routing.topk_softmax_pallas(logits, k, interpret=not on_gpu)
    _check_topk(ids, weights, logits, k, "pallas" if on_gpu else "pallas (interpret)")


@pytest.mark.parametrize("m,e,k", SHAPES)
def test_counting_sort_is_the_stable_argsort(rng, m, e, k):
    """Top-k ids (distinct per token) and arbitrary ids with repeats: the same order, inverse and group sizes as the
    stable argsort, bit for bit."""
    logits = jnp.asarray(rng.standard_normal((m, e)), jnp.float32)
    top_ids, _ = routing.topk_softmax_xla(logits, k)
    repeats = jnp.asarray(rng.integers(0, e, (m, k)), jnp.int32)
    skewed = jnp.asarray(np.minimum(rng.geometric(0.5, (m, k)) - 1, e - 1), jnp.int32)  # a few experts take most
    for what, ids in (("top-k ids", top_ids), ("repeated ids", repeats), ("skewed ids", skewed)):
        got = routing.expert_permutation_pallas(ids, e, interpret=not on_gpu)
        _check_permutation(got, ids, e, what)
        _check_permutation(routing.expert_permutation_xla(ids, e), ids, e, what + " (xla)")


@pytest.mark.parametrize("block_rows,num_warps", [(16, 2), (64, 8), (128, 8)])
def test_other_tiles_give_the_same_routing(rng, block_rows, num_warps):
    """The tiles a benchmark sweeps (tokens per program, warps): the same experts, weights and permutation as the
    references, on a token count that is no multiple of the tile (the last program's rows are padding)."""
    m, e, k = 200, 256, 8
    logits = jnp.asarray(rng.standard_normal((m, e)) * 2, jnp.bfloat16)
    tile = dict(block_rows=block_rows, num_warps=num_warps)
    ids, weights = routing.topk_softmax_pallas(logits, k, interpret=not on_gpu, **tile)
    _check_topk(ids, weights, logits, k, f"pallas {block_rows} rows w{num_warps}")
    skewed = jnp.asarray(np.minimum(rng.geometric(0.3, (m, k)) - 1, e - 1), jnp.int32)
    for what, i in (("top-k ids", ids), ("skewed ids", skewed)):
        got = routing.expert_permutation_pallas(i, e, interpret=not on_gpu, **tile)
        _check_permutation(got, i, e, f"{what}, {block_rows} rows w{num_warps}")


def test_a_tile_that_is_no_power_of_two_is_refused():
    for rows in (8, 48):
        with pytest.raises(ValueError, match=f"block_rows={rows} is not a power of two >= 16"):
            routing.topk_softmax_pallas(jnp.ones((4, 8)), 2, interpret=True, block_rows=rows)
        with pytest.raises(ValueError, match=f"block_rows={rows} is not a power of two >= 16"):
            routing.expert_permutation_pallas(jnp.ones((4, 2), jnp.int32), 8, interpret=True, block_rows=rows)


def test_implementation_switch(rng):
    """By default the platform decides when lowering: lowered for CUDA the program holds the kernels, lowered for
    the CPU it does not (a computation for the CPU device of a GPU host must not take the kernels), and it runs
    there.
    `KernelChoices.routing="xla"` removes the kernels from a CUDA lowering; "pallas" keeps the CPU guard; bad names
    are clear errors."""
    logits = jnp.asarray(rng.standard_normal((40, 8)), jnp.float32)
    ids_in = jax.ShapeDtypeStruct((40, 2), jnp.int32)
    pallas = KernelChoices.defaults("cpu")
    assert pallas.routing == "pallas"

    def lowered(platform, kernels=pallas):
        t = jax.jit(lambda x: routing.topk_softmax(x, 2, kernels=kernels)).trace(logits)
        p = jax.jit(lambda i: routing.expert_permutation(i, 8, kernels=kernels)).trace(ids_in)
        return t.lower(lowering_platforms=(platform,)).as_text() + p.lower(lowering_platforms=(platform,)).as_text()

    cuda, cpu_text = lowered("cuda"), lowered("cpu")
    assert "moe_topk_softmax" in cuda and "moe_expert_ranks" in cuda
    assert "moe_topk_softmax" not in cpu_text and "moe_expert_ranks" not in cpu_text
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        ids, _ = jax.jit(lambda x: routing.topk_softmax(x, 2, kernels=pallas))(jax.device_put(logits, cpu))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(routing.topk_softmax_xla(logits, 2)[0]))
    cuda = lowered("cuda", pallas.replace(routing="xla"))
    assert "moe_topk_softmax" not in cuda and "moe_expert_ranks" not in cuda
    with pytest.raises(ValueError, match="routing: implementation='cub'"):
        routing.topk_softmax(logits, 2, implementation="cub")
    with pytest.raises(ValueError, match="implementation='cub'"):
        routing.expert_permutation(ids, 8, implementation="cub")


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)")
@pytest.mark.parametrize("e,k", [(256, 8), (512, 10)])  # 35b-a3b / 122b-a10b; 397b-a17b
def test_gpu_routing_at_model_sizes(rng, e, k):
    """16K tokens through both kernels inside one jit, as the model calls them: same experts as lax.top_k, the
    same permutation as the stable argsort."""
    m = 16384
    logits = jnp.asarray(rng.standard_normal((m, e)) * 2, jnp.bfloat16)
    ids, weights = jax.jit(lambda x: routing.topk_softmax(x, k, implementation="pallas"))(logits)
    _check_topk(ids, weights, logits, k, "pallas, jit")
    got = jax.jit(lambda i: routing.expert_permutation(i, e, implementation="pallas"))(ids)
    _check_permutation(got, ids, e, "pallas, jit")


def test_a_nan_token_stays_in_its_own_row(rng):
    """A token whose router logits hold a NaN: the kernel keeps its ids in [0, E) (the lowest, as lax.top_k), so
    the counting sort stays a permutation and, through the routed experts, only that token's output is NaN."""
    from jax_dwdp.model.moe import routed_experts

    m, e, k, h = 64, 16, 2, 8
    logits = rng.standard_normal((m, e)).astype(np.float32)
    logits[63, 0] = np.nan
    logits[10, :] = np.nan
    ids, weights = routing.topk_softmax_pallas(jnp.asarray(logits), k, interpret=not on_gpu)
    ids = np.asarray(ids)
    assert ids.min() >= 0 and ids.max() < e
    assert set(ids[10]) == {0, 1}
    clean = np.setdiff1d(np.arange(m), [10, 63])
    want_ids, _ = _topk_reference_f64(logits[clean], k)
    np.testing.assert_array_equal(ids[clean], want_ids)
    order, inverse, _ = (np.asarray(a) for a in routing.expert_permutation_pallas(jnp.asarray(ids), e,
                                                                                   interpret=not on_gpu))
    assert sorted(order) == list(range(m * k)) and np.array_equal(inverse[order], np.arange(m * k))
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.float32)
    gate_up = jnp.asarray(rng.standard_normal((e, 2 * h, h)), jnp.float32)
    down = jnp.asarray(rng.standard_normal((e, h, h)), jnp.float32)
    out = np.asarray(routed_experts(x, jnp.asarray(ids), weights, gate_up, down))
    assert np.isnan(out[[10, 63]]).all(axis=1).all() and np.isfinite(out[clean]).all()


def test_empty_and_impossible_inputs():
    ids, weights = routing.topk_softmax_pallas(jnp.zeros((0, 8)), 2, interpret=True)
    assert ids.shape == weights.shape == (0, 2)
    order, inverse, sizes = routing.expert_permutation_pallas(jnp.zeros((0, 2), jnp.int32), 8, interpret=True)
    assert order.shape == inverse.shape == (0,) and np.array_equal(sizes, np.zeros(8))
    with pytest.raises(ValueError, match="top-9 of 8 experts"):
        routing.topk_softmax_pallas(jnp.zeros((4, 8)), 9, interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not on_gpu, reason="needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)")
def test_gpu_moe_block_keeps_the_permutation_out_of_the_combine(rng):
    """The routed experts at 35b-a3b shapes and 4K tokens, compiled for the GPU: no fused computation that writes
    the [M, H] output recomputes the counting sort's scans (reduce-window). Before the optimization barrier XLA
    fused them into the combine's loop, 1.2 ms a layer (an H200, 2026-12-01)."""
    import re

    from jax_dwdp.model.moe import routed_experts

    m, h, e, k, i = 4096, 2048, 256, 8, 512
    x = jnp.asarray(rng.standard_normal((m, h)), jnp.bfloat16)
    logits = jnp.asarray(rng.standard_normal((m, e)), jnp.float32)
    gate_up = jax.ShapeDtypeStruct((e, 2 * i, h), jnp.bfloat16)
    down = jax.ShapeDtypeStruct((e, h, i), jnp.bfloat16)

    def block(x, logits, gate_up, down):
        ids, weights = routing.topk_softmax(logits, k)
        return routed_experts(x, ids, weights, gate_up, down, add=x)

    text = jax.jit(block).lower(x, logits, gate_up, down).compile().as_text()
    computations = re.split(r"\n(?=%|ENTRY)", text)
    assert any("reduce-window" in c for c in computations), "the counting sort's scans are not in the program"
    bad = [c.split(" ", 1)[0] for c in computations if "reduce-window" in c and f"[{m},{h}]" in c]
    assert not bad, f"the permutation's scans are fused into a computation of the [M, H] output: {bad}"

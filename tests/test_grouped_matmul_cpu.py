"""The CPU grouped matmul (the "xla" implementation off the GPU): a loop over the non-empty groups whose work and
memory scale with the rows, not with rows x groups like ragged_dot_general's CPU lowering."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gm = importlib.import_module("jax_dwdp.kernels.grouped_matmul")

pytestmark = pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU path")

CHUNK = gm.CPU_CHUNK
BOUNDS = {jnp.bfloat16: 1e-2, jnp.float32: 1e-5}


def reference(x, w, sizes):
    """float64 numpy: rows of group g times w[g]^T; rows past sum(sizes) are zero."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.zeros((x.shape[0], w.shape[1]))
    start = 0
    for g, n in enumerate(sizes):
        out[start : start + n] = x[start : start + n] @ w[g].T
        start += n
    return out


# group sizes that hit every branch: empty groups, exact buckets (8, CHUNK), one past a bucket, one row, several
# whole chunks plus a remainder, a chunk multiple (no remainder), and rows past the sum
SIZES = [
    [0, 8, CHUNK, CHUNK + 1, 1, 0, 3 * CHUNK + 37, 2 * CHUNK, 9, 0],
    [5 * CHUNK + 3, 0, 0, 0],  # one group takes (almost) every row
    [0, 0, 0],  # no rows at all
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("sizes", SIZES, ids=["mixed", "one_group", "empty"])
def test_cpu_loop_matches_fp64_and_ragged_dot(rng, dtype, sizes):
    m, n, k = sum(sizes) + 11, 40, 48
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((len(sizes), n, k)) * k**-0.5, dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    out = jax.jit(lambda a, b, s: gm.grouped_matmul(a, b, s, implementation="xla"))(x, w, gs)
    ref = reference(x, w, sizes)
    ragged = np.asarray(gm._ragged_dot(x, w, gs), np.float64)
    got = np.asarray(out, np.float64)
    scale = max(np.linalg.norm(ref), 1e-30)
    err, err_ragged = np.linalg.norm(got - ref) / scale, np.linalg.norm(got - ragged) / scale
    print(f"CPU loop {jnp.dtype(dtype).name} sizes={sizes}: rel err vs fp64 {err:.2e}, vs ragged_dot_general "
          f"{err_ragged:.2e} (bound {BOUNDS[dtype]})")
    assert out.shape == (m, n) and out.dtype == dtype
    assert err <= BOUNDS[dtype] and err_ragged <= BOUNDS[dtype]
    assert np.all(got[sum(sizes):] == 0)  # rows past the sum are zeros


def test_cpu_default_runs_the_loop_not_ragged_dot(rng):
    x, w = jnp.ones((64, 16), jnp.bfloat16), jnp.ones((4, 8, 16), jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda a, b, s: gm.grouped_matmul(a, b, s))(x, w, jnp.zeros((4,), jnp.int32)))
    assert "while" in jaxpr and "ragged_dot" not in jaxpr


def _temp_bytes(fn, m, g, n, k):
    spec = jax.ShapeDtypeStruct
    compiled = jax.jit(fn).lower(spec((m, k), jnp.bfloat16), spec((g, n, k), jnp.bfloat16),
                                 spec((g,), jnp.int32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_cpu_loop_memory_scales_with_rows_not_groups():
    """XLA's own temporary memory: the loop needs a few row-sized buffers and no copy of the weights; the dense
    expansion of ragged_dot_general needs [G, M, K]."""
    m, g, n, k = 2048, 128, 256, 512
    row_bytes = (m + CHUNK) * (k + n) * 2
    loop = _temp_bytes(gm._group_loop, m, g, n, k)
    dense = _temp_bytes(gm._ragged_dot, m, g, n, k)
    print(f"temporary bytes, M={m} G={g} N={n} K={k}: loop {loop / 2**20:.1f} MiB (rows {row_bytes / 2**20:.1f} "
          f"MiB, weights {g * n * k * 2 / 2**20:.1f} MiB), ragged_dot_general {dense / 2**20:.1f} MiB")
    assert loop <= 4 * row_bytes
    assert loop < g * n * k * 2  # no whole-weight copy (the CPU upcasts bf16 slices in loops unless kept apart)
    assert dense > g * m * k  # what the loop avoids: the check above can tell the two apart

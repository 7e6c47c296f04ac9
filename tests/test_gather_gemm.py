"""The gate_up grouped matmul that gathers the tokens itself (`kernels.grouped_matmul_gather`): the portable path
against float64 numpy on the CPU, and on a GPU the CUTLASS kernel (the gather inside its cp.async loads) against
float64, against gather-then-grouped-matmul, with poisoned outputs and edge sizes; then the MoE block both ways."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_grouped_matmul import BF16_BOUND, _extreme_rows, _gpu_only, _require_library, check_extreme_swiglu, rel_err
from test_grouped_matmul import _check as _check_rows

gm = importlib.import_module("jax_dwdp.kernels.grouped_matmul")
moe = importlib.import_module("jax_dwdp.model.moe")


def reference(x, row_token, w, sizes):
    """float64: row r of group g is x[row_token[r]] @ w[g]^T (zeros for a token outside [0, T)); rows past the sum
    are zeros."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    t = x.shape[0]
    tok = np.asarray(row_token)
    rows = np.where(((tok >= 0) & (tok < t))[:, None], x[np.clip(tok, 0, t - 1)], 0.0)
    out = np.zeros((tok.shape[0], w.shape[1]))
    start = 0
    for g, n in enumerate(sizes):
        out[start : start + n] = rows[start : start + n] @ w[g].T
        start += n
    return out


def make_case(rng, t, m, g, n, k, *, empty=(), skew=0.3, slack=0, bad=0):
    """T tokens, M sorted rows reading random tokens (`bad` of them out of range), uneven group sizes summing to
    m - slack with some groups empty; bf16-rounded inputs."""
    p = rng.dirichlet(np.full(g, skew))
    p[list(empty)] = 0
    sizes = rng.multinomial(m - slack, p / p.sum())
    row_token = rng.integers(0, t, m).astype(np.int32)
    if bad:
        at = rng.choice(m - slack, bad, replace=False)
        row_token[at] = rng.choice([-1, t, t + 7, -(2**31)], bad)
    x = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, n, k)) * k**-0.5, jnp.bfloat16)
    return x, jnp.asarray(row_token), w, sizes


# --- CPU: the portable path's semantics --------------------------------------------------------------------------


@pytest.mark.parametrize("t,m,g,n,k,empty,slack,bad", [
    (90, 300, 5, 48, 64, (1,), 0, 0),
    (40, 700, 4, 40, 32, (0, 3), 37, 9),  # empty first / last group, rows past the sum, bad token indices
])
def test_xla_path_matches_fp64(rng, t, m, g, n, k, empty, slack, bad):
    x, row_token, w, sizes = make_case(rng, t, m, g, n, k, empty=empty, slack=slack, bad=bad)
    for dtype, bound in ((jnp.float32, 1e-6), (jnp.bfloat16, BF16_BOUND)):
        out = gm.grouped_matmul_gather(x.astype(dtype), row_token, w.astype(dtype), jnp.asarray(sizes, jnp.int32),
                                       implementation="xla")
        ref = reference(x, row_token, w, sizes)
        err = rel_err(np.asarray(out, np.float64), ref)
        print(f"xla gather path {jnp.dtype(dtype).name}: rel err {err:.2e} (bound {bound})")
        assert err <= bound
        assert np.all(np.asarray(out[int(sizes.sum()):]) == 0)


def swiglu_reference(x, row_token, w, sizes):
    """float64 silu(gate) * up of `reference`, w's rows per expert: I gate rows, then I up rows."""
    y = reference(x, row_token, w, sizes)
    i = y.shape[1] // 2
    g, u = y[:, :i], y[:, i:]
    return g / (1 + np.exp(-g)) * u


def test_swiglu_xla_path_matches_fp64(rng):
    x, row_token, w, sizes = make_case(rng, 50, 400, 6, 48, 32, empty=(2,), slack=13, bad=4)
    gs = jnp.asarray(sizes, jnp.int32)
    ref = swiglu_reference(x, row_token, w, sizes)
    for dtype, bound in ((jnp.float32, 1e-6), (jnp.bfloat16, BF16_BOUND)):
        out = gm.grouped_matmul_gather_swiglu(x.astype(dtype), row_token, w.astype(dtype), gs, implementation="xla")
        assert out.shape == (400, 24) and out.dtype == dtype
        err = rel_err(np.asarray(out, np.float64), ref)
        print(f"xla gather + SwiGLU path {jnp.dtype(dtype).name}: rel err {err:.2e} (bound {bound})")
        assert err <= bound
    with pytest.raises(ValueError, match="multiple of 16"):
        gm.grouped_matmul_gather_swiglu(x, row_token, w[:, :40], gs)


def test_bad_shapes_and_index_dtype(rng):
    x, row_token, w, sizes = make_case(rng, 10, 32, 2, 16, 8)
    gs = jnp.asarray(sizes, jnp.int32)
    with pytest.raises(ValueError, match="do not fit"):
        gm.grouped_matmul_gather(x[:, :4], row_token, w, gs)
    with pytest.raises(ValueError, match="do not fit"):
        gm.grouped_matmul_gather(x, row_token[:, None], w, gs)
    with pytest.raises(ValueError, match="must be integer"):
        gm.grouped_matmul_gather(x, row_token.astype(jnp.float32), w, gs)


def test_moe_gather_switch():
    """`gather_in_gemm`: the argument, else `KernelChoices.moe_gather` when set, else by default only where the
    grouped matmul is the CUTLASS kernel (the one that fuses the gather), on the shapes it measured faster."""
    from jax_dwdp.kernels.choices import KernelChoices

    default = KernelChoices.defaults("cpu")
    assert default.moe_gather is None
    assert moe.gather_in_gemm(None, "cutlass", kernels=default) is moe.GATHER_DEFAULT
    assert not moe.gather_in_gemm(None, "xla", kernels=default) and not moe.gather_in_gemm(None, "mosaic",
                                                                                          kernels=default)
    assert not moe.gather_in_gemm(kernels=default)  # the CPU's grouped matmul: XLA's
    assert moe.gather_in_gemm(kernels=default.replace(grouped_matmul="cutlass")) is moe.GATHER_DEFAULT
    assert moe.gather_in_gemm(True) and not moe.gather_in_gemm(False, "cutlass")
    # ... on the shapes it measured faster: any row count at hidden 2048, wider hidden only up to 40,960 rows
    wide = moe.GATHER_MAX_HIDDEN + 1024
    fits = dict(hidden=moe.GATHER_MAX_HIDDEN, rows=10**6, kernels=default)
    assert moe.gather_in_gemm(None, "cutlass", **fits) is moe.GATHER_DEFAULT
    assert moe.gather_in_gemm(None, "cutlass", hidden=wide, rows=moe.GATHER_MAX_WIDE_ROWS,
                              kernels=default) is moe.GATHER_DEFAULT
    assert not moe.gather_in_gemm(None, "cutlass", hidden=wide, rows=moe.GATHER_MAX_WIDE_ROWS + 1, kernels=default)
    assert moe.gather_in_gemm(True, "cutlass", hidden=wide, rows=10**6, kernels=default)
    on, off = default.replace(moe_gather=True), default.replace(moe_gather=False)
    assert moe.gather_in_gemm(None, "cutlass", hidden=wide, rows=10**6, kernels=on)
    assert moe.gather_in_gemm(kernels=on) and moe.gather_in_gemm(None, "xla", kernels=on)
    assert not moe.gather_in_gemm(False, kernels=on)
    assert not moe.gather_in_gemm(None, "cutlass", kernels=off) and moe.gather_in_gemm(True, kernels=off)


def _routed_case(rng, t, h, e, i, k, dtype):
    x = jnp.asarray(rng.standard_normal((t, h)), dtype)
    logits = rng.standard_normal((t, e))
    ids = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
    wts = jnp.asarray(rng.dirichlet(np.ones(k), t), dtype)
    gate_up = jnp.asarray(rng.standard_normal((e, 2 * i, h)) * h**-0.5, dtype)
    down = jnp.asarray(rng.standard_normal((e, h, i)) * i**-0.5, dtype)
    add = jnp.asarray(rng.standard_normal((t, h)), dtype)
    return x, jnp.asarray(ids), wts, gate_up, down, add


def test_routed_experts_same_with_and_without_gather_cpu(rng):
    """The MoE block's routed experts: the same function whether the gate_up matmul gathers the tokens or reads the
    dispatched copy (fp32: the same rows meet the same weights, so the results agree to rounding)."""
    x, ids, wts, gate_up, down, add = _routed_case(rng, 37, 32, 8, 16, 3, jnp.float32)
    a = moe.routed_experts(x, ids, wts, gate_up, down, add=add, gather=True)
    b = moe.routed_experts(x, ids, wts, gate_up, down, add=add, gather=False)
    err = rel_err(np.asarray(a), np.asarray(b))
    print(f"routed experts, gather vs dispatch (CPU fp32): {err:.2e}")
    assert err <= 1e-6
    # DEP's masked form (valid slots only; the others carry an id >= E)
    valid = jnp.asarray(rng.random(ids.shape) < 0.7)
    masked = jnp.where(valid, ids, 8)
    a = moe.routed_experts(x, masked, wts, gate_up, down, valid=valid, gather=True)
    b = moe.routed_experts(x, masked, wts, gate_up, down, valid=valid, gather=False)
    assert rel_err(np.asarray(a), np.asarray(b)) <= 1e-6


# --- GPU: the CUTLASS gather kernel --------------------------------------------------------------------------------


def _check(out, x, row_token, w, sizes, label):
    """test_grouped_matmul's check (float64 bound, zeros past the groups, finite) against this kernel's reference."""
    _check_rows(out, x, w, sizes, f"gather {label}", ref_fn=lambda x, w, s: reference(x, row_token, w, s))


GATHER_CONFIGS = ["gather_tmab_128x256x64", "gather_coop_128x256x64"]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GATHER_CONFIGS)
@pytest.mark.parametrize("n,k", [(1024, 2048), (2048, 512), (264, 136), (136, 72)])  # N, K not tile multiples too
def test_cutlass_gather_matches_fp64_and_gather_then_gemm(rng, n, k, config):
    _gpu_only()
    cutlass = _require_library()
    assert cutlass.gather_config_names() == GATHER_CONFIGS
    g, t = 16, 700
    x, row_token, w, sizes = make_case(rng, t, 3000, g, n, k, empty=(0, 7, g - 1), slack=61, bad=5)
    assert sizes.max() > 256
    gs = jnp.asarray(sizes, jnp.int32)
    out = jax.jit(lambda *a: cutlass.grouped_matmul_gather(*a, config=config))(x, row_token, w, gs)
    _check(out, x, row_token, w, sizes, f"{config} n={n} k={k}")
    # The same rows through the TMA grouped GEMM: the same tile's wgmma sums, so equal to bf16 rounding at most.
    two_step = cutlass.grouped_matmul(gm.gather_token_rows(x, row_token), w, gs, config="coop_128x256x64_c1x1")
    total = int(sizes.sum())
    a, b = np.asarray(out[:total], np.float32), np.asarray(two_step[:total], np.float32)
    diff = rel_err(a, b)
    print(f"gather kernel vs gather + TMA grouped GEMM: rel diff {diff:.2e}, identical {np.array_equal(a, b)}")
    assert diff <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("config", GATHER_CONFIGS)
def test_cutlass_gather_poisoned_output_and_edge_sizes(rng, config):
    """Output buffers reused from NaN-filled arrays: rows past the sum must come back zeros, not garbage."""
    _gpu_only()
    cutlass = _require_library()
    g, n, k, m, t = 8, 256, 128, 1000, 333
    x, row_token, w, _ = make_case(rng, t, m, g, n, k)
    cases = {
        "all empty": np.zeros(g, np.int64),
        "one group": np.eye(g, dtype=np.int64)[3] * 999,
        "single rows": np.ones(g, np.int64),
        "full": np.array([0, 129, 1, 0, 500, 127, 243, 0]),
        "oversubscribed (sum > M) is clipped": np.array([600, 600, 0, 0, 0, 0, 0, 0]),
    }
    f = jax.jit(lambda *a: cutlass.grouped_matmul_gather(*a, config=config))
    for label, sizes in cases.items():
        poison = [jnp.full((m, n), jnp.nan, jnp.bfloat16) for _ in range(4)]
        jax.block_until_ready(poison)
        del poison
        out = f(x, row_token, w, jnp.asarray(sizes, jnp.int32))
        if "clipped" in label:
            sizes = np.minimum(np.cumsum(sizes), m) - np.minimum(np.cumsum(sizes) - sizes, m)
        _check(out, x, row_token, w, sizes, f"{config} {label}")
    with pytest.raises(ValueError, match="none of"):
        cutlass.grouped_matmul_gather(x, row_token, w, jnp.asarray(sizes, jnp.int32), config="nope")


GATHER_SWIGLU_CONFIGS = ["gather_swiglu_128x256x64"]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GATHER_SWIGLU_CONFIGS)
@pytest.mark.parametrize("i,k", [(512, 2048), (1024, 4096), (136, 72)])  # 35B, 397B shapes; I, K not tile multiples
def test_cutlass_gather_swiglu_matches_fp64_and_the_unfused_order(rng, i, k, config):
    """The fused kernel against float64 and against its own unfused order (the gather kernel's bf16 [M, 2I], then
    SiLU(gate) * up in fp32): the same bf16 gate and up go in, so they differ by at most the activation's last bit."""
    _gpu_only()
    cutlass = _require_library()
    assert cutlass.gather_swiglu_config_names() == GATHER_SWIGLU_CONFIGS
    g, t = 16, 700
    x, row_token, w, sizes = make_case(rng, t, 3000, g, 2 * i, k, empty=(0, 7, g - 1), slack=61, bad=5)
    gs = jnp.asarray(sizes, jnp.int32)
    total = int(sizes.sum())
    out = jax.jit(lambda *a: cutlass.grouped_matmul_gather_swiglu(*a, config=config))(x, row_token, w, gs)
    assert out.shape == (3000, i)
    o = np.asarray(out.astype(jnp.float32), np.float64)
    ref = swiglu_reference(x, row_token, w, sizes)
    err = rel_err(o[:total], ref[:total])
    unfused = jax.jit(lambda *a: gm.swiglu(*jnp.split(cutlass.grouped_matmul_gather(*a), 2, axis=1), jnp.bfloat16))(
        x, row_token, w, gs)
    u = np.asarray(unfused.astype(jnp.float32), np.float64)
    diff = rel_err(o[:total], u[:total])
    same = float(np.mean(o[:total] == u[:total]))
    print(f"{config} i={i} k={k}: vs fp64 {err:.2e} (bound {BF16_BOUND}); vs unfused order {diff:.2e}, "
          f"{same:.4%} of values identical; tail zeros {bool(np.all(o[total:] == 0))}")
    assert np.isfinite(o).all() and np.all(o[total:] == 0)
    assert err <= BF16_BOUND and diff <= 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("config", GATHER_SWIGLU_CONFIGS)
def test_cutlass_gather_swiglu_poisoned_output_and_edge_sizes(rng, config):
    _gpu_only()
    cutlass = _require_library()
    g, i, k, m, t = 8, 128, 128, 1000, 333
    x, row_token, w, _ = make_case(rng, t, m, g, 2 * i, k)
    f = jax.jit(lambda *a: cutlass.grouped_matmul_gather_swiglu(*a, config=config))
    for label, sizes in {"all empty": np.zeros(g, np.int64), "single rows": np.ones(g, np.int64),
                         "full": np.array([0, 129, 1, 0, 500, 127, 243, 0])}.items():
        poison = [jnp.full((m, i), jnp.nan, jnp.bfloat16) for _ in range(4)]
        jax.block_until_ready(poison)
        del poison
        o = np.asarray(f(x, row_token, w, jnp.asarray(sizes, jnp.int32)).astype(jnp.float32), np.float64)
        total = int(sizes.sum())
        ref = swiglu_reference(x, row_token, w, sizes)
        err = rel_err(o[:total], ref[:total]) if total else 0.0
        print(f"{config} {label}: rel err {err:.2e}, tail zeros {bool(np.all(o[total:] == 0))}")
        assert np.isfinite(o).all() and np.all(o[total:] == 0) and err <= BF16_BOUND
    with pytest.raises(ValueError, match="none of"):
        cutlass.grouped_matmul_gather_swiglu(x, row_token, w, jnp.asarray(sizes, jnp.int32), config="nope")


@pytest.mark.gpu
@pytest.mark.parametrize("config", GATHER_SWIGLU_CONFIGS)
def test_cutlass_gather_swiglu_extreme_gates(rng, config):
    """The gather kernel's fused SwiGLU epilogue (__expf / __fdividef) at gates of hundreds, either sign."""
    _gpu_only()
    cutlass = _require_library()
    g, i, k, t, m = 4, 128, 128, 300, 1024
    x, row_token, w, sizes = make_case(rng, t, m, g, 2 * i, k)
    x = _extreme_rows(x, rng)
    out = cutlass.grouped_matmul_gather_swiglu(x, row_token, w, jnp.asarray(sizes, jnp.int32), config=config)
    total = int(sizes.sum())
    o = np.asarray(out.astype(jnp.float32), np.float64)[:total]
    y = reference(x, row_token, w, sizes)[:total]
    check_extreme_swiglu(o, swiglu_reference(x, row_token, w, sizes)[:total], y[:, :i], y[:, i:],
                         f"{config}, extreme gates", roundings=3)  # gate, up rounded to bf16 first, as unfused


@pytest.mark.gpu
def test_half_tiles_change_no_bit(rng, monkeypatch):
    """A group's last M tile of <= 64 rows runs on one consumer warpgroup (the other skips its wgmma): every gather
    kernel's output is the same bits with the skip turned off ($JAX_DWDP_GATHER_HALF_TILES=0, read at each call), on
    groups sized so that most end in such a tile."""
    _gpu_only()
    cutlass = _require_library()
    g, i, k, t = 24, 256, 512, 4096
    sizes = np.asarray(rng.integers(0, 4, g) * 128 + rng.integers(1, 65, g))  # tails of 1-64 rows
    sizes[[3, 11]] = [0, 128]  # an empty group, a group of whole tiles
    m = int(sizes.sum()) + 40
    x, row_token, w, _ = make_case(rng, t, m, g, 2 * i, k)
    gs = jnp.asarray(sizes, jnp.int32)
    calls = {name: jax.jit(lambda *a, name=name: cutlass.grouped_matmul_gather(*a, config=name))
             for name in cutlass.gather_config_names()}
    calls.update({name: jax.jit(lambda *a, name=name: cutlass.grouped_matmul_gather_swiglu(*a, config=name))
                  for name in cutlass.gather_swiglu_config_names()})
    total = int(sizes.sum())
    for name, f in calls.items():
        monkeypatch.setenv("JAX_DWDP_GATHER_HALF_TILES", "0")
        full = np.asarray(f(x, row_token, w, gs).astype(jnp.float32))
        monkeypatch.delenv("JAX_DWDP_GATHER_HALF_TILES")
        half = np.asarray(f(x, row_token, w, gs).astype(jnp.float32))
        ref = (swiglu_reference if "swiglu" in name else reference)(x, row_token, w, sizes)
        err = rel_err(half[:total].astype(np.float64), ref[:total])
        print(f"half tiles {name}: identical to full tiles {np.array_equal(full, half)}, vs fp64 {err:.2e}")
        assert np.array_equal(full, half) and np.all(half[total:] == 0) and err <= BF16_BOUND


@pytest.mark.gpu
def test_routed_experts_gather_on_gpu(rng):
    """The MoE block's routed experts on the GPU (bf16, CUTLASS): gather inside the gate_up GEMM against the
    dispatch + GEMM path and against the float32 reference on the CPU."""
    _gpu_only()
    _require_library()
    x, ids, wts, gate_up, down, add = _routed_case(rng, 1500, 256, 32, 128, 4, jnp.bfloat16)
    f = jax.jit(moe.routed_experts, static_argnames=("gather",))
    a = f(x, ids, wts, gate_up, down, add=add, gather=True)
    b = f(x, ids, wts, gate_up, down, add=add, gather=False)
    diff = rel_err(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with jax.default_device(jax.devices("cpu")[0]):
        cpu = [jax.device_put(v, jax.devices("cpu")[0]).astype(jnp.float32) for v in (x, wts, gate_up, down, add)]
        ref = moe.routed_experts(cpu[0], jax.device_put(ids, jax.devices("cpu")[0]), cpu[1], cpu[2], cpu[3],
                                 add=cpu[4], gather=False)
    err = rel_err(np.asarray(a, np.float32), np.asarray(ref))
    print(f"routed experts on the GPU: gather vs dispatch {diff:.2e}; gather vs CPU fp32 {err:.2e} (bound {BF16_BOUND})")
    assert diff <= 1e-3 and err <= BF16_BOUND


@pytest.mark.gpu
def test_routed_experts_default_gathers_on_the_shapes_it_measured_faster():
    """With the GPU's default choices, the block gathers inside the gate_up GEMM at hidden 2048 whatever the row
    count, and at a wider hidden only up to GATHER_MAX_WIDE_ROWS rows; past that it dispatches first (lowered, not
    run)."""
    import functools

    _gpu_only()
    _require_library()
    from jax_dwdp.kernels import _cutlass
    from jax_dwdp.kernels.choices import KernelChoices

    block = functools.partial(moe.routed_experts, kernels=KernelChoices.defaults("gpu"))

    def lowered(t, h, k, e=16, i=128):
        bf16 = jnp.bfloat16
        shapes = [((t, h), bf16), ((t, k), jnp.int32), ((t, k), bf16), ((e, 2 * i, h), bf16), ((e, h, i), bf16)]
        args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
        return jax.jit(block).lower(*args).as_text()

    def gathers(text):
        assert (_cutlass.GATHER_SWIGLU_TARGET in text) != ("moe_dispatch_rows" in text)
        return _cutlass.GATHER_SWIGLU_TARGET in text

    wide = moe.GATHER_MAX_HIDDEN + 1024
    assert gathers(lowered(8192, moe.GATHER_MAX_HIDDEN, 8))  # 65,536 rows at hidden 2048
    assert gathers(lowered(moe.GATHER_MAX_WIDE_ROWS // 10, wide, 10))  # at the limit
    assert not gathers(lowered(moe.GATHER_MAX_WIDE_ROWS // 10 + 1, wide, 10))  # past it

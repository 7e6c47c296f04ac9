"""Grouped matmul: the portable path's semantics on the CPU, the CUTLASS FFI kernel on the GPU.

GPU tests run only with JAX_DWDP_TEST_GPU=1 on a machine with a CUDA GPU (and the library built for "cutlass").
"""

from __future__ import annotations

import contextlib
import importlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gm = importlib.import_module("jax_dwdp.kernels.grouped_matmul")  # the module (the package re-exports the function)

BF16_BOUND = 1e-2


def reference(x, w, sizes, fill=0.0):
    """float64 numpy: rows of group g times w[g]^T; rows past sum(sizes) get `fill`."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out = np.full((x.shape[0], w.shape[1]), fill)
    start = 0
    for g, n in enumerate(sizes):
        out[start : start + n] = x[start : start + n] @ w[g].T
        start += n
    return out


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def make_case(rng, m, g, n, k, *, empty=(), skew=0.3, slack=0):
    """Uneven (Dirichlet) group sizes summing to m - slack, some forced empty; bf16-rounded inputs."""
    p = rng.dirichlet(np.full(g, skew))
    p[list(empty)] = 0
    sizes = rng.multinomial(m - slack, p / p.sum())
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, n, k)) * k**-0.5, jnp.bfloat16)
    return x, w, sizes


# --- CPU: the portable path's semantics (what the GPU kernels must reproduce) -------------------------------------


@pytest.mark.parametrize("m,g,n,k,empty,slack", [
    (300, 5, 48, 64, (1,), 0),         # uneven groups, one empty
    (700, 4, 40, 32, (0, 3), 37),      # empty first and last group, rows past the sum
    (520, 3, 16, 24, (), 0),           # one group larger than a 128-row tile
])
def test_xla_path_matches_fp64(rng, m, g, n, k, empty, slack):
    x, w, sizes = make_case(rng, m, g, n, k, empty=empty, slack=slack)
    assert sizes.max() > 128 or m < 600
    out = gm.grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), implementation="xla")
    ref = reference(x, w, sizes)
    err = rel_err(out, ref)
    print(f"xla grouped matmul m={m} g={g} n={n} k={k} sizes={sizes.tolist()}: bf16 rel err {err:.2e} "
          f"(bound {BF16_BOUND})")
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert err <= BF16_BOUND
    assert np.all(np.asarray(out[sizes.sum():], np.float32) == 0)  # rows past the sum are zeros


def test_xla_path_jit_and_all_groups_empty(rng):
    x, w, _ = make_case(rng, 64, 4, 16, 32)
    sizes = jnp.zeros((4,), jnp.int32)
    out = jax.jit(lambda a, b, s: gm.grouped_matmul(a, b, s, implementation="xla"))(x, w, sizes)
    assert out.shape == (64, 16) and np.all(np.asarray(out, np.float32) == 0)


def _in_shard_map(impl, devices, x, w, gs):
    """Experts sharded over a 1-device mesh axis, rows replicated: the layout the MoE layer uses per rank."""
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(devices), ("e",))
    f = jax.shard_map(lambda a, b, s: gm.grouped_matmul(a, b, s, implementation=impl),
                      mesh=mesh, in_specs=(P(), P("e"), P("e")), out_specs=P(), check_vma=False)
    return jax.jit(f)(x, w, gs)


def test_xla_path_inside_shard_map(rng):
    x, w, sizes = make_case(rng, 200, 4, 16, 32, empty=(2,), slack=5)
    out = _in_shard_map("xla", jax.devices()[:1], x, w, jnp.asarray(sizes, jnp.int32))
    err = rel_err(out, reference(x, w, sizes))
    print(f"xla grouped matmul inside shard_map: {err:.2e}")
    assert err <= BF16_BOUND


def test_default_follows_the_choices_for_half_types_only():
    """The form without `implementation=`: the choices' for half types (XLA on the CPU's defaults), "mosaic" for
    fp16 where the choices name CUTLASS (bf16 only); fp32 inputs, the reference run beside a bf16 one, stay on "xla"
    (the Mosaic kernel on fp32 tiles asked for 256 KiB of shared memory on an H200, more than the 227 KiB there are;
    2026-12-01)."""
    from jax_dwdp.kernels.choices import KernelChoices

    cpu = KernelChoices.defaults("cpu")
    assert gm.default_implementation(jnp.bfloat16, cpu) == "xla"
    assert gm.default_implementation(jnp.bfloat16) == gm.default_implementation(
        jnp.bfloat16, KernelChoices.from_environment())
    mosaic, cutlass = cpu.replace(grouped_matmul="mosaic"), cpu.replace(grouped_matmul="cutlass")
    assert gm.default_implementation(jnp.bfloat16, mosaic) == gm.default_implementation(jnp.float16, mosaic) == "mosaic"
    assert gm.default_implementation(jnp.float32, mosaic) == gm.default_implementation(jnp.float32, cutlass) == "xla"
    assert gm.default_implementation(jnp.bfloat16, cutlass) == "cutlass"
    assert gm.default_implementation(jnp.float16, cutlass) == "mosaic"


def test_bad_implementation_and_shapes(rng):
    x, w, sizes = make_case(rng, 32, 2, 16, 16)
    with pytest.raises(ValueError, match="grouped matmul implementation='nope' is none of"):
        gm.grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), implementation="nope")
    with pytest.raises(ValueError, match="do not fit"):
        gm.grouped_matmul(x, w[:, :, :8], jnp.asarray(sizes, jnp.int32), implementation="xla")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="checks the error without a GPU")
@contextlib.contextmanager
def gmm_library_at(path, monkeypatch):
    """$JAX_DWDP_GMM_LIB pointed at `path`, with the loaded-library cache cleared on entry and exit."""
    from jax_dwdp.kernels import _cutlass

    monkeypatch.setenv("JAX_DWDP_GMM_LIB", str(path))
    _cutlass._lib.cache_clear()
    try:
        yield _cutlass
    finally:
        _cutlass._lib.cache_clear()


def test_cutlass_without_gpu_fails_clearly(rng, tmp_path, monkeypatch):
    x, w, sizes = make_case(rng, 32, 2, 16, 16)
    with gmm_library_at(tmp_path / "missing.so", monkeypatch) as _cutlass:
        assert not _cutlass.available()
        with pytest.raises(_cutlass.CutlassUnavailable, match="not built|needs a CUDA GPU"):
            gm.grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), implementation="cutlass")


def test_stale_cutlass_library_is_a_clear_error(tmp_path, monkeypatch):
    """A library built from older sources (here: a shared library with only the oldest entry points) is refused
    with a 'rebuild it' error, not a ctypes AttributeError from deep inside."""
    import shutil
    import subprocess

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in library")
    src = tmp_path / "old.c"
    src.write_text("int JaxDwdpGroupedGemmNumConfigs(void) { return 0; }\n"
                   "const char* JaxDwdpGroupedGemmConfigName(int i) { return 0; }\n"
                   "unsigned long JaxDwdpGroupedGemmWorkspaceBytes(int g, int s) { return 0; }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp_path / "old.so"), str(src)], check=True)
    with gmm_library_at(tmp_path / "old.so", monkeypatch) as _cutlass:
        with pytest.raises(_cutlass.CutlassUnavailable, match="lacks a symbol .* rebuild it"):
            _cutlass.config_names()


def test_cutlass_config_choice(monkeypatch):
    """pick_config (no library needed): the no-cluster cooperative 128x256 tile from 64 rows per group (measured
    fastest at 80-512), the no-cluster 64x128 ping-pong below it and for narrow N; a preferred tile
    (`KernelChoices.gmm_config`: a name, or an index into config_names()) wins."""
    from jax_dwdp.kernels import _cutlass

    names = ["coop_128x256x64_c2x1", "pingpong_64x128x128_c2x1", "pingpong_128x128x64_c2x1",
             "coop_128x256x64_c1x1", "pingpong_64x128x128_c1x1"]
    monkeypatch.setattr(_cutlass, "config_names", lambda: names)
    pick = lambda m, n, g, preferred=None: names[_cutlass.pick_config(m, n, g, preferred=preferred)]  # noqa: E731
    assert pick(16384 * 8, 1024, 256) == "coop_128x256x64_c1x1"  # 512 rows per expert
    assert pick(4096 * 10, 2048, 512) == "coop_128x256x64_c1x1"  # 80
    assert pick(64 * 256, 2048, 256) == "coop_128x256x64_c1x1"
    assert pick(63 * 256, 2048, 256) == "pingpong_64x128x128_c1x1"
    assert pick(8 * 256, 2048, 256) == "pingpong_64x128x128_c1x1"  # decode-like
    assert pick(16384 * 8, 128, 256) == "pingpong_64x128x128_c1x1"
    assert pick(16384 * 8, 1024, 256, "pingpong_128x128x64_c2x1") == "pingpong_128x128x64_c2x1"
    assert pick(16384 * 8, 1024, 256, "1") == "pingpong_64x128x128_c2x1"
    # The fused SwiGLU kernel has a subset of the tiles: a preferred name it has is taken, one it lacks is ignored.
    fused = ["coop_128x256x64_c1x1", "pingpong_64x128x128_c1x1"]
    pick_fused = lambda m, n, g, p=None: fused[_cutlass.pick_config(m, n, g, fused, p)]  # noqa: E731
    with pytest.warns(UserWarning, match="no fused SwiGLU build"):  # "1": pingpong_64x128x128_c2x1, not fused
        assert pick_fused(16384 * 8, 1024, 256, "1") == "coop_128x256x64_c1x1"
    assert pick_fused(16384 * 8, 1024, 256, "pingpong_64x128x128_c1x1") == "pingpong_64x128x128_c1x1"
    assert pick_fused(8 * 256, 1024, 256) == "pingpong_64x128x128_c1x1"
    with pytest.raises(ValueError, match=r"KernelChoices\.gmm_config / \$JAX_DWDP_GMM_CONFIG='nonsense' is none of"):
        _cutlass.pick_config(1024, 1024, 8, preferred="nonsense")


def test_import_does_not_load_the_library():
    import subprocess
    import sys

    code = ("import sys, jax_dwdp, jax_dwdp.kernels, jax_dwdp.model; "
            "assert 'jax_dwdp.kernels._cutlass' not in sys.modules; "
            "assert 'libjax_dwdp_gmm' not in open('/proc/self/maps').read()")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})


# --- GPU: the CUTLASS kernel ---------------------------------------------------------------------------------------


def _gpu_only():
    if os.environ.get("JAX_DWDP_TEST_GPU") != "1" or jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)")


def _require_library():
    from jax_dwdp.kernels import _cutlass

    if not _cutlass.available():
        pytest.fail(f"libjax_dwdp_gmm.so not built at {_cutlass.library_path()}")
    return _cutlass


def _check(out, x, w, sizes, label, ref_fn=reference):
    out = np.asarray(out.astype(jnp.float32), np.float64)
    total = int(sizes.sum())
    ref = ref_fn(x, w, sizes)
    err = rel_err(out[:total], ref[:total]) if total else 0.0
    tail_ok = bool(np.all(out[total:] == 0))
    finite = bool(np.isfinite(out).all())
    print(f"cutlass {label}: sizes[:8]={sizes[:8].tolist()} total={total}/{out.shape[0]}: bf16 rel err {err:.2e} "
          f"(bound {BF16_BOUND}), tail zeros {tail_ok}, finite {finite}")
    assert finite and tail_ok and err <= BF16_BOUND


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, *range(5)])  # the automatic choice, then every built configuration
@pytest.mark.parametrize("n,k", [(1024, 2048), (2048, 512), (264, 136)])
def test_cutlass_matches_fp64(rng, n, k, config):
    _gpu_only()
    cutlass = _require_library()
    assert len(cutlass.config_names()) == 5, f"the library's configs changed: {cutlass.config_names()}"
    g = 16
    # Uneven groups, empty groups (first, middle, last), groups larger than one 256-row tile, rows past the sum.
    x, w, sizes = make_case(rng, 3000, g, n, k, empty=(0, 7, g - 1), slack=61)
    assert sizes.max() > 256
    names = cutlass.config_names()
    out = cutlass.grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), config=config)
    _check(out, x, w, sizes, f"n={n} k={k} config={names[config] if config is not None else 'auto'}")


@pytest.mark.gpu
def test_cutlass_poisoned_output_and_edge_sizes(rng):
    """Output buffers reused from a NaN-filled array: rows past the sum must come back as zeros, not garbage."""
    _gpu_only()
    cutlass = _require_library()
    g, n, k, m = 8, 256, 128, 1000
    x, w, _ = make_case(rng, m, g, n, k)
    cases = {
        "all empty": np.zeros(g, np.int64),
        "one group": np.eye(g, dtype=np.int64)[3] * 999,
        "single rows": np.ones(g, np.int64),
        "full": np.array([0, 129, 1, 0, 500, 127, 243, 0]),
        "oversubscribed (sum > M) is clipped": np.array([600, 600, 0, 0, 0, 0, 0, 0]),
    }
    f = jax.jit(lambda a, b, s: cutlass.grouped_matmul(a, b, s))
    for label, sizes in cases.items():
        # Fill the allocator with NaN buffers of the output's size and free them, so the output likely reuses one.
        poison = [jnp.full((m, n), jnp.nan, jnp.bfloat16) for _ in range(4)]
        jax.block_until_ready(poison)
        del poison
        out = f(x, w, jnp.asarray(sizes, jnp.int32))
        if "clipped" in label:
            clipped = np.minimum(np.cumsum(sizes), m) - np.minimum(np.cumsum(sizes) - sizes, m)
            _check(out, x, w, clipped, label)
        else:
            _check(out, x, w, sizes, label)


@pytest.mark.gpu
def test_cutlass_default_and_inside_jit_and_shard_map(rng):
    _gpu_only()
    _require_library()
    g, n, k, m = 32, 512, 256, 2048
    x, w, sizes = make_case(rng, m, g, n, k, empty=(5,), slack=9)
    gs = jnp.asarray(sizes, jnp.int32)
    from jax_dwdp.kernels.choices import KernelChoices

    assert KernelChoices.defaults("gpu").grouped_matmul == "cutlass"  # (the library is built)
    out = jax.jit(lambda a, b, s: gm.grouped_matmul(a, b, s, implementation="cutlass"))(x, w, gs)
    _check(out, x, w, sizes, "inside jit")

    out = _in_shard_map("cutlass", jax.devices("gpu")[:1], x, w, gs)
    _check(out, x, w, sizes, "inside shard_map (1 device)")

    # Against the GPU's own fp32 path on a small case (xla lowering is dense but fine at this size).
    ref = gm.grouped_matmul(x.astype(jnp.float32), w.astype(jnp.float32), gs, implementation="xla")
    total = int(sizes.sum())
    err = rel_err(np.asarray(out[:total], np.float32), np.asarray(ref[:total]))
    print(f"cutlass vs GPU fp32 xla path: {err:.2e}")
    assert err <= BF16_BOUND


@pytest.mark.gpu
def test_cutlass_in_a_graph_of_many_ops_repeated(rng):
    """Two chained grouped matmuls among other ops in one jit (enough for XLA to form command buffers; the handler is
    registered without the command-buffer trait unless `cmd_buffer=True`, `KernelChoices.gmm_cmd_buffer`, so by
    default XLA runs it outside them), called repeatedly with new sizes. The bound is doubled: the first matmul's bf16 rounding, which the
    reference does not share, feeds the second."""
    _gpu_only()
    cutlass = _require_library()
    g, n, k, m = 16, 256, 256, 1024
    x, w, _ = make_case(rng, m, g, n, k)

    @jax.jit
    def f(a, b, s):
        h = jnp.tanh(a.astype(jnp.float32)).astype(jnp.bfloat16) * 2
        y = cutlass.grouped_matmul(h, b, s)  # n == k: the output feeds the next grouped matmul
        y = y * 0.5 + 1.0
        return cutlass.grouped_matmul(y, b, s), h

    for trial in range(3):
        sizes = rng.multinomial(m - 3 * trial, rng.dirichlet(np.full(g, 0.3)))
        out, h = f(x, w, jnp.asarray(sizes, jnp.int32))
        y = jnp.asarray(reference(h, w, sizes), jnp.bfloat16).astype(jnp.float32)  # bf16 output of the first matmul
        y = jnp.asarray(y * 0.5 + 1.0, jnp.bfloat16)
        ref = reference(y, w, sizes)
        total = int(sizes.sum())
        err = rel_err(np.asarray(out[:total], np.float32), ref[:total])
        print(f"cutlass twice in one jit, trial {trial}: rel err {err:.2e}")
        assert err <= 2 * BF16_BOUND and np.all(np.asarray(out[total:], np.float32) == 0)


# --- The gate_up projection with SiLU(gate) * up (fused into the CUTLASS epilogue on the GPU) ---------------------


def swiglu_reference(x, w_hf, sizes):
    """float64: silu(x @ gate^T) * (x @ up^T) per group, from the Hugging Face layout (gate rows, then up rows)."""
    y = reference(x, w_hf, sizes)
    i = y.shape[1] // 2
    gate, up = y[:, :i], y[:, i:]
    return gate / (1.0 + np.exp(-gate)) * up


def test_interleave_gate_up_layout_and_inverse(rng):
    e, i, k = 3, 24, 5
    w = rng.standard_normal((e, 2 * i, k))
    wi = gm.interleave_gate_up(w)
    for b in range(i // 8):
        for r in range(8):
            np.testing.assert_array_equal(wi[:, 16 * b + r], w[:, 8 * b + r])          # gate row 8b + r
            np.testing.assert_array_equal(wi[:, 16 * b + 8 + r], w[:, i + 8 * b + r])  # up row 8b + r
    np.testing.assert_array_equal(gm.deinterleave_gate_up(wi), w)
    wj = gm.interleave_gate_up(jnp.asarray(w, jnp.float32))  # the same permutation on jax arrays
    np.testing.assert_array_equal(np.asarray(wj), wi.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(gm.deinterleave_gate_up(wj)), w.astype(np.float32))
    with pytest.raises(ValueError, match=r"shape \(3, 20, 5\) needs 2I .* multiple of 16"):
        gm.interleave_gate_up(w[:, :20])


@pytest.mark.parametrize("m,g,i,k,empty,slack", [
    (300, 5, 24, 64, (1,), 0),     # uneven groups, one empty
    (520, 3, 16, 40, (0, 2), 23),  # empty first and last group, rows past the sum, one group > 128 rows
])
def test_swiglu_xla_path_matches_fp64(rng, m, g, i, k, empty, slack):
    x, w, sizes = make_case(rng, m, g, 2 * i, k, empty=empty, slack=slack)
    out = gm.grouped_matmul_swiglu(x, gm.interleave_gate_up(w), jnp.asarray(sizes, jnp.int32), implementation="xla")
    ref = swiglu_reference(x, w, sizes)
    total = int(sizes.sum())
    err = rel_err(out[:total], ref[:total])
    print(f"xla grouped matmul + SwiGLU m={m} g={g} I={i} k={k}: bf16 rel err {err:.2e} (bound {BF16_BOUND})")
    assert out.shape == (m, i) and out.dtype == jnp.bfloat16
    assert err <= BF16_BOUND
    assert np.all(np.asarray(out[total:], np.float32) == 0)


def test_swiglu_bad_shapes(rng):
    x, w, sizes = make_case(rng, 64, 4, 24, 32)  # 2I = 24: not whole 8-row gate / up blocks
    with pytest.raises(ValueError, match="multiple of 16"):
        gm.grouped_matmul_swiglu(x, w, jnp.asarray(sizes, jnp.int32), implementation="xla")
    with pytest.raises(ValueError, match="do not fit"):
        gm.grouped_matmul_swiglu(x[:, :16], w, jnp.asarray(sizes, jnp.int32), implementation="xla")


def _check_swiglu(out, x, w_hf, sizes, label):
    assert out.shape == (x.shape[0], w_hf.shape[1] // 2)
    _check(out, x, w_hf, sizes, f"fused SwiGLU {label}", ref_fn=swiglu_reference)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [None, 0, 1])
@pytest.mark.parametrize("i,k", [(512, 2048), (1024, 512), (136, 136)])  # 35B shape; 2I = 2048; 2I not a tile multiple
def test_cutlass_swiglu_matches_fp64(rng, i, k, config):
    _gpu_only()
    cutlass = _require_library()
    g = 16
    x, w, sizes = make_case(rng, 3000, g, 2 * i, k, empty=(0, 7, g - 1), slack=61)
    assert sizes.max() > 256
    names = cutlass.swiglu_config_names()
    # Poison: NaN buffers of the output's size freed just before, so the output likely reuses one.
    poison = [jnp.full((3000, i), jnp.nan, jnp.bfloat16) for _ in range(4)]
    jax.block_until_ready(poison)
    del poison
    out = cutlass.grouped_matmul_swiglu(x, gm.interleave_gate_up(w), jnp.asarray(sizes, jnp.int32), config=config)
    _check_swiglu(out, x, w, sizes, f"I={i} k={k} config={names[config] if config is not None else 'auto'}")


@pytest.mark.gpu
def test_cutlass_swiglu_edge_sizes_and_unfused_agreement(rng):
    """Edge group sizes through the public function inside jit, and agreement with the unfused cutlass path (which
    rounds gate and up to bf16 before the activation: the two differ by that rounding only)."""
    _gpu_only()
    _require_library()
    g, i, k, m = 8, 128, 256, 1000
    x, w, _ = make_case(rng, m, g, 2 * i, k)
    wi = gm.interleave_gate_up(w)
    fused = jax.jit(lambda a, b, s: gm.grouped_matmul_swiglu(a, b, s, implementation="cutlass"))
    unfused = jax.jit(lambda a, b, s: gm.grouped_matmul_swiglu(a, b, s, implementation="cutlass", fused=False))
    for label, sizes in {
        "all empty": np.zeros(g, np.int64),
        "one group": np.eye(g, dtype=np.int64)[3] * 999,
        "single rows": np.ones(g, np.int64),
        "full": np.array([0, 129, 1, 0, 500, 127, 243, 0]),
        "oversubscribed (sum > M) and negative sizes": np.array([600, -5, 600, 0, 0, 0, 0, 0]),
    }.items():
        gs = jnp.asarray(sizes, jnp.int32)
        out = fused(x, wi, gs)
        if "oversubscribed" in label:  # negative sizes count as 0, groups are clipped to the M rows
            sizes = np.maximum(sizes, 0)
            sizes = np.minimum(np.cumsum(sizes), m) - np.minimum(np.cumsum(sizes) - sizes, m)
        _check_swiglu(out, x, w, sizes, label)
        ref = np.asarray(unfused(x, wi, gs), np.float32)
        total = int(sizes.sum())
        err = rel_err(np.asarray(out[:total], np.float32), ref[:total]) if total else 0.0
        print(f"  fused vs unfused cutlass ({label}): {err:.2e}")
        assert err <= BF16_BOUND


def _extreme_rows(x, rng):
    """x with its rows scaled by 1 to 400 (bf16): the projections reach |gate| of hundreds, past where exp(-gate)
    overflows fp32 (gate < -88.7) and where 1 + exp(-gate) lies in (2^126, 2^128), __fdividef's zero range."""
    scale = rng.choice([1.0, 30.0, 100.0, 400.0], x.shape[0])[:, None]
    return (x.astype(jnp.float32) * scale).astype(jnp.bfloat16)


def check_extreme_swiglu(o, ref, gate, up, label, *, roundings):
    """Finite everywhere; within the bf16 bound of float64 overall; where the gate is below -87 (SiLU's exp
    overflows) the output is within 1e-30 of zero; where it is above 20, SiLU(gate) * up = gate * up within
    `roundings` bf16 half-steps (2^-8 relative each: 1 where only the output is rounded, 3 where gate and up are
    rounded to bf16 before the activation), element by element (where |up| > 1% of its rms: smaller ones are fp32
    sums that cancelled)."""
    err = rel_err(o, ref)
    low = gate < -87.0
    high = (gate > 20.0) & (np.abs(up) > 0.01 * np.sqrt(np.mean(up * up)))
    high_err = float(np.max(np.abs(o[high] - ref[high]) / np.abs(ref[high]).clip(1e-30))) if high.any() else 0.0
    print(f"{label}: vs fp64 {err:.2e} (bound {BF16_BOUND}); {int(low.sum())} values with gate < -87, max |out| "
          f"{np.abs(o[low]).max() if low.any() else 0.0:.1e}; {int(high.sum())} with gate > 20, worst rel {high_err:.1e}")
    assert low.sum() > 100 and high.sum() > 100, "the case must reach both ends"
    assert np.isfinite(o).all() and err <= BF16_BOUND
    assert np.all(np.abs(o[low]) <= 1e-30)
    assert high_err <= roundings * 2.0**-8 * 1.05 + 1e-4


@pytest.mark.gpu
def test_cutlass_swiglu_extreme_gates(rng):
    """The interleaved fused SwiGLU epilogue (__expf / __fdividef) at gates of hundreds, either sign."""
    _gpu_only()
    cutlass = _require_library()
    g, i, k, m = 4, 128, 128, 1024
    x, w, sizes = make_case(rng, m, g, 2 * i, k)
    x = _extreme_rows(x, rng)
    out = cutlass.grouped_matmul_swiglu(x, gm.interleave_gate_up(w), jnp.asarray(sizes, jnp.int32))
    total = int(sizes.sum())
    o = np.asarray(out.astype(jnp.float32), np.float64)[:total]
    y = reference(x, w, sizes)[:total]
    check_extreme_swiglu(o, swiglu_reference(x, w, sizes)[:total], y[:, :i], y[:, i:],
                         "interleaved fused SwiGLU, extreme gates", roundings=1)  # from the fp32 accumulators

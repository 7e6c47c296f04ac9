"""Grouped matmul for MoE: rows sorted by expert, one weight matrix per expert.

`grouped_matmul(x, w, group_sizes)` computes, for each group g, x[rows of g] @ w[g].T, with w in the Hugging
Face layout [G, N, K] (both operands K-contiguous, the layout grouped GEMMs on tensor cores want).
Group sizes live on the device: no host sync, usable inside jit and shard_map.
`grouped_matmul_swiglu(x, w, group_sizes)` is the gate_up projection with silu(gate) * up, fused into the CUTLASS
epilogue on the GPU, for weights interleaved by `interleave_gate_up` (opt-in: measured at parity with the unfused
path on an H200, 0.95-1.07x, 2026-11-30: benchmarks/RESULTS.md, "Variants measured slower").
`grouped_matmul_gather(x, row_token, w, group_sizes)` reads row r as x[row_token[r]] (the tokens in their own order;
on the GPU the gather is inside the CUTLASS kernel's loads), and `grouped_matmul_gather_swiglu` adds silu(gate) * up
in that kernel's epilogue for weights in the checkpoint's layout: the MoE block's gate_up projection (issue 15).

Implementations:
- "xla": portable XLA. On the GPU `jax.lax.ragged_dot_general`, which XLA lowers to a dense masked expansion
  that allocates [M, G, N]-sized buffers and fails at prefill sizes (gpu_facts.md), so it is never the GPU
  default. Everywhere else a loop over the non-empty groups (`_group_loop`): each group's weight matrix is read
  once and its rows go through dense matmuls in chunks of `CPU_CHUNK` rows plus one power-of-two bucket for the
  remainder, so work and memory scale with M (ragged_dot_general's CPU lowering is the same expansion over all
  G groups: G times the FLOPs and a [G, M, K] buffer).
- "mosaic": jax's Pallas Mosaic GPU kernel `ragged_dot_mgpu` (Hopper wgmma; 216-237 TF/s on 35B-A3B gate_up,
  about 0.4x of torch._grouped_mm).
- "cutlass": the project's CUTLASS sm90 grouped GEMM (ffi/grouped_gemm, issue 6) behind an XLA FFI custom call,
  the kind of kernel behind torch._grouped_mm (1.04-1.37x its speed in 23 of 24 MoE measurements, one at 0.98x).
  bf16 only; rows past sum(group_sizes) are zeros. Its library (jax_dwdp/_lib/libjax_dwdp_gmm.so) is loaded on
  first use, never at import.

The form for half types is `KernelChoices.grouped_matmul` (GPU default: "cutlass" when its library is built, else
"mosaic"; elsewhere "xla"), where the computation is lowered for a CUDA GPU; the CPU and fp32 inputs always take
"xla". `implementation=` forces one.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_dwdp.kernels._backend import check, on_cuda
from jax_dwdp.kernels.choices import GROUPED_MATMUL_FORMS, KernelChoices, resolve

_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())),
    lhs_ragged_dimensions=(0,),
    rhs_group_dimensions=(0,),
)


def _ragged_dot(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot_general(
        x, w, group_sizes, _DIMS, preferred_element_type=jnp.float32
    ).astype(x.dtype)


CPU_CHUNK = 128  # rows per dense matmul of the CPU loop (buckets of 8, 16, ... CPU_CHUNK rows for the remainder)
_MIN_BUCKET = 8


def _group_loop(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """The CPU's grouped matmul: for each non-empty group g (in row order), w[g] is sliced once, then its rows run
    as dense [CPU_CHUNK, K] x [K, N] matmuls and one remainder matmul of the smallest power-of-two bucket that
    holds them. A matmul may write up to a chunk of rows past its group; those belong to later groups (rewritten
    when their turn comes) or lie past sum(group_sizes) (zeroed at the end).

    Two things keep XLA's CPU backend from copying whole operands (measured: 1-2 GB and 5x the time at 35B-A3B
    shapes): 2-byte floats are sliced and carried as uint16 (the CPU upcasts bf16 slices and loop-carried
    buffers to fp32), and every slice reads its operand through an optimization_barrier together with its
    index, so the conversion cannot be hoisted out of the loop onto the whole array.
    """
    m, _ = x.shape
    g, n, _ = w.shape
    dtype = x.dtype
    store = jnp.dtype(jnp.uint16) if jnp.dtype(dtype).itemsize == 2 else jnp.dtype(dtype)

    def bits(a):
        return jax.lax.bitcast_convert_type(a, store) if store != dtype else a

    def unbits(a):
        return jax.lax.bitcast_convert_type(a, dtype) if store != dtype else a

    def matmul(rows, weight):
        return bits(jax.lax.dot_general(rows, weight, (((1,), (1,)), ((), ())),
                                        preferred_element_type=jnp.float32).astype(dtype))

    def rows_at(xs, start, count):
        xs, start = jax.lax.optimization_barrier((xs, start))
        return unbits(jax.lax.dynamic_slice_in_dim(bits(xs), start, count))

    buckets = [CPU_CHUNK >> i for i in range(CPU_CHUNK.bit_length()) if CPU_CHUNK >> i >= _MIN_BUCKET][::-1]

    def bucket(rows):
        def run(xs, start, weight):
            y = matmul(rows_at(xs, start, rows), weight)
            return jnp.pad(y, ((0, CPU_CHUNK - rows), (0, 0)))
        return run

    # branch 0: no remainder; branch i: buckets[i - 1] rows
    branches = [lambda xs, start, weight: jnp.zeros((CPU_CHUNK, n), store)] + [bucket(b) for b in buckets]
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    nonempty = jnp.nonzero(sizes > 0, size=g, fill_value=0)[0].astype(jnp.int32)
    x_padded = jnp.pad(x, ((0, CPU_CHUNK), (0, 0)))  # a chunk read at the last row stays in bounds

    def one_group(i, out):
        xs, ws, e = jax.lax.optimization_barrier((x_padded, w, nonempty[i]))
        weight = unbits(jax.lax.dynamic_index_in_dim(bits(ws), e, keepdims=False))
        start, count = starts[e], sizes[e]

        def chunk(j, out):
            row = start + j * CPU_CHUNK
            return jax.lax.dynamic_update_slice_in_dim(out, matmul(rows_at(xs, row, CPU_CHUNK), weight), row, 0)

        full = count // CPU_CHUNK
        out = jax.lax.fori_loop(0, full, chunk, out)
        rest, row = count - full * CPU_CHUNK, start + full * CPU_CHUNK
        which = jnp.where(rest > 0, 1 + jnp.sum(jnp.asarray(buckets, jnp.int32) < rest), 0)
        return jax.lax.dynamic_update_slice_in_dim(out, jax.lax.switch(which, branches, xs, row, weight), row, 0)

    out = jax.lax.fori_loop(0, jnp.sum(sizes > 0), one_group, jnp.zeros((m + CPU_CHUNK, n), store))[:m]
    out = jnp.where((jnp.arange(m) < jnp.sum(sizes))[:, None], out, jnp.zeros((), store))
    return unbits(out)


def _xla(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    return on_cuda(_ragged_dot, _group_loop, x, w, group_sizes)


def _mosaic_config(n: int, k: int) -> dict[str, int]:
    block_k = 64
    if k % block_k:
        raise ValueError(f"mosaic grouped matmul needs K % {block_k} == 0, got K={k}")
    block_n = 128 if n % 128 == 0 else 64
    if n % block_n:
        raise ValueError(f"mosaic grouped matmul needs N % 64 == 0, got N={n}")
    grid_block_n = next(g for g in (8, 4, 2, 1) if n % (g * block_n) == 0)
    return dict(block_m=128, block_n=block_n, block_k=block_k, max_concurrent_steps=4, grid_block_n=grid_block_n)


ROW_MULTIPLE = 8  # the Mosaic kernel's TMA tiling needs M % 8 == 0; callers can pre-pad to avoid a copy


def _mosaic(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    # Imported lazily: Pallas Mosaic GPU pulls in GPU-only lowering code.
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    m = x.shape[0]
    pad = (-m) % ROW_MULTIPLE
    if pad:
        x = jnp.pad(x, ((0, pad), (0, 0)))
    n, k = w.shape[1], w.shape[2]
    out = ragged_dot_mgpu.ragged_dot(
        x, w, group_sizes=group_sizes.astype(jnp.int32), transpose_rhs=True, **_mosaic_config(n, k)
    )
    return out[:m] if pad else out


def _cutlass(x: jax.Array, w: jax.Array, group_sizes: jax.Array, kernels: KernelChoices) -> jax.Array:
    from jax_dwdp.kernels import _cutlass as cutlass  # ctypes loading happens on first call, not at import

    return cutlass.grouped_matmul(x, w, group_sizes, preferred=kernels.gmm_config, cmd_buffer=kernels.gmm_cmd_buffer)


IMPLEMENTATIONS = {"xla": _xla, "mosaic": _mosaic, "cutlass": _cutlass}


def default_implementation(dtype, kernels: KernelChoices | None = None) -> str:
    """The form without `implementation=`: "xla" for fp32 inputs (the reference precision; the GPU kernels are
    half-type kernels: the Mosaic one runs out of shared memory on fp32 tiles); for half types
    `kernels.grouped_matmul` (default: the process's `KernelChoices`), but "mosaic" for fp16 where that is "cutlass"
    (the CUTLASS kernel takes bf16 only). A GPU form runs where the computation is lowered for a CUDA GPU."""
    if dtype not in (jnp.bfloat16, jnp.float16):
        return "xla"
    impl = resolve(kernels).grouped_matmul
    return "mosaic" if impl == "cutlass" and dtype != jnp.bfloat16 else impl


def grouped_matmul(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, implementation: str | None = None,
    kernels: KernelChoices | None = None,
) -> jax.Array:
    """x: [M, K] rows sorted by group; w: [G, N, K]; group_sizes: [G] int32 summing to <= M. Returns [M, N].

    Rows past sum(group_sizes) are unspecified (zero for "xla" and "cutlass"). The form: `implementation` (wherever
    lowered), else `default_implementation(x.dtype, kernels)` (where lowered for a CUDA GPU); `kernels` also holds
    the CUTLASS kernel's tile and command-buffer choices.
    """
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2] or group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"grouped_matmul: x {x.shape}, w {w.shape}, group_sizes {group_sizes.shape} do not fit "
            "x [M, K], w [G, N, K], group_sizes [G]"
        )
    kernels = resolve(kernels)
    impl = check(implementation or default_implementation(x.dtype, kernels), GROUPED_MATMUL_FORMS,
                 "grouped matmul implementation")
    fn = IMPLEMENTATIONS[impl]
    if impl == "cutlass":
        fn = functools.partial(_cutlass, kernels=kernels)
    with jax.named_scope(f"grouped_matmul_{impl}"):
        if implementation is None and impl != "xla":
            # a GPU kernel chosen by the choices: where lowered for a CUDA GPU (XLA's loop where a half-type model
            # is placed on the CPU of a GPU host)
            return on_cuda(fn, _group_loop, x, w.astype(x.dtype), group_sizes)
        return fn(x, w.astype(x.dtype), group_sizes)


# --- The gate_up projection with SiLU(gate) * up: fused into the CUTLASS epilogue on the GPU ---------------------

SWIGLU_BLOCK = 8  # gate / up rows per block of the interleaved layout: one wgmma accumulator column chunk


def _check_gate_up(w, what: str) -> tuple[int, int]:
    two_i = w.shape[-2] if w.ndim >= 2 else 1
    if two_i % (2 * SWIGLU_BLOCK):
        raise ValueError(
            f"{what}: gate_up weight of shape {tuple(w.shape)} needs 2I = shape[-2] to be a multiple of "
            f"{2 * SWIGLU_BLOCK} (I a multiple of {SWIGLU_BLOCK}), got 2I={two_i}"
        )
    return two_i // 2, w.shape[-1]


def interleave_gate_up(w):
    """[..., 2I, K] with gate rows then up rows (the Hugging Face layout) -> rows in blocks of 8: row 16b + r is
    gate row 8b + r, row 16b + 8 + r is up row 8b + r. numpy or jax arrays; a pure permutation of rows."""
    i, k = _check_gate_up(w, "interleave_gate_up")
    lead = tuple(w.shape[:-2])
    b = SWIGLU_BLOCK
    return w.reshape(*lead, 2, i // b, b, k).swapaxes(-4, -3).reshape(*lead, 2 * i, k)


def deinterleave_gate_up(w):
    """The inverse of `interleave_gate_up`."""
    i, k = _check_gate_up(w, "deinterleave_gate_up")
    lead = tuple(w.shape[:-2])
    b = SWIGLU_BLOCK
    return w.reshape(*lead, i // b, 2, b, k).swapaxes(-4, -3).reshape(*lead, 2 * i, k)


def swiglu(gate: jax.Array, up: jax.Array, dtype) -> jax.Array:
    """silu(gate) * up in fp32, cast to dtype (the MoE experts' and the shared expert's activation)."""
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dtype)


def swiglu_of_interleaved(y: jax.Array, dtype) -> jax.Array:
    """[M, 2I] outputs of an interleaved gate_up projection -> silu(gate) * up [M, I] in fp32, cast to dtype."""
    m, two_i = y.shape
    y = y.reshape(m, two_i // (2 * SWIGLU_BLOCK), 2, SWIGLU_BLOCK)
    return swiglu(y[:, :, 0].reshape(m, -1), y[:, :, 1].reshape(m, -1), dtype)


def grouped_matmul_swiglu(
    x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, implementation: str | None = None, fused: bool = True,
    kernels: KernelChoices | None = None,
) -> jax.Array:
    """silu(x @ gate_g^T) * (x @ up_g^T) per group: x [M, K] rows sorted by group; w [G, 2I, K] gate_up weights
    interleaved by `interleave_gate_up`; group_sizes [G]. Returns [M, I] in x's dtype.

    "cutlass" fuses the activation into the GEMM epilogue (from the fp32 accumulators; the [M, 2I] projection is
    never written) unless `fused=False`. Other implementations run `grouped_matmul` and the activation in XLA,
    rounding gate and up to x's dtype first. Rows past sum(group_sizes) are zeros for "cutlass" and "xla". The
    form: as `grouped_matmul`'s.
    """
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2] or group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"grouped_matmul_swiglu: x {x.shape}, w {w.shape}, group_sizes {group_sizes.shape} do not fit "
            "x [M, K], w [G, 2I, K], group_sizes [G]"
        )
    _check_gate_up(w, "grouped_matmul_swiglu")
    kernels = resolve(kernels)
    impl = implementation or default_implementation(x.dtype, kernels)
    if impl == "cutlass" and fused:
        from jax_dwdp.kernels import _cutlass as cutlass

        fn = functools.partial(cutlass.grouped_matmul_swiglu, preferred=kernels.gmm_config,
                               cmd_buffer=kernels.gmm_cmd_buffer)
        with jax.named_scope("grouped_matmul_swiglu_cutlass"):
            if implementation is None:  # chosen by the choices: where lowered for a CUDA GPU (as in grouped_matmul)
                unfused = lambda x, w, s: swiglu_of_interleaved(_group_loop(x, w, s), x.dtype)  # noqa: E731
                return on_cuda(fn, unfused, x, w.astype(x.dtype), group_sizes)
            return fn(x, w.astype(x.dtype), group_sizes)
    return swiglu_of_interleaved(grouped_matmul(x, w, group_sizes, implementation=implementation, kernels=kernels),
                                 x.dtype)


# --- The gate_up projection reading the tokens where they are: the gather inside the GEMM's loads on the GPU -------


def gather_token_rows(x: jax.Array, row_token: jax.Array) -> jax.Array:
    """x[row_token] with rows whose index is outside [0, T) as zeros (`grouped_matmul_gather`'s contract)."""
    t = x.shape[0]
    ok = (row_token >= 0) & (row_token < t)
    rows = x[jnp.clip(row_token, 0, max(t - 1, 0))]
    return jnp.where(ok[:, None], rows, jnp.zeros((), x.dtype))


def grouped_matmul_gather(
    x: jax.Array, row_token: jax.Array, w: jax.Array, group_sizes: jax.Array, *, implementation: str | None = None,
    kernels: KernelChoices | None = None,
) -> jax.Array:
    """grouped_matmul(x[row_token], w, group_sizes) without the gathered copy: x [T, K] the tokens in their own
    order; row_token [M] int32, the token each row (sorted by group) reads; w [G, N, K]; group_sizes [G]. Returns
    [M, N]. Rows whose token index is outside [0, T) read zeros; rows past sum(group_sizes) are zeros for
    "cutlass" and "xla".

    "cutlass" gathers inside the GEMM's loads (ffi/grouped_gemm/gather_gemm.cuh: cp.async from a producer
    warpgroup, CUTLASS's wgmma mainloop): the [M, K] permuted copy is never written. Every other implementation
    gathers the rows first (`gather_token_rows`) and runs `grouped_matmul`. The form: as `grouped_matmul`'s; the
    gather kernel's tile: `kernels.gather_config`.
    """
    if (x.ndim != 2 or row_token.ndim != 1 or w.ndim != 3 or x.shape[1] != w.shape[2]
            or group_sizes.shape != (w.shape[0],)):
        raise ValueError(
            f"grouped_matmul_gather: x {x.shape}, row_token {row_token.shape}, w {w.shape}, group_sizes "
            f"{group_sizes.shape} do not fit x [T, K], row_token [M], w [G, N, K], group_sizes [G]"
        )
    if not jnp.issubdtype(row_token.dtype, jnp.integer):
        raise ValueError(f"grouped_matmul_gather: row_token must be integer, got {row_token.dtype}")
    kernels = resolve(kernels)
    impl = implementation or default_implementation(x.dtype, kernels)
    if impl == "cutlass":
        from jax_dwdp.kernels import _cutlass as cutlass

        def gathered(x, row_token, w, s):
            return _group_loop(gather_token_rows(x, row_token), w, s)

        fn = functools.partial(cutlass.grouped_matmul_gather, config=kernels.gather_config)
        with jax.named_scope("grouped_matmul_gather_cutlass"):
            if implementation is None:  # chosen by the choices: where lowered for a CUDA GPU (as in grouped_matmul)
                return on_cuda(fn, gathered, x, row_token.astype(jnp.int32), w.astype(x.dtype), group_sizes)
            return fn(x, row_token, w.astype(x.dtype), group_sizes)
    return grouped_matmul(gather_token_rows(x, row_token), w, group_sizes, implementation=implementation,
                          kernels=kernels)


def grouped_matmul_gather_swiglu(
    x: jax.Array, row_token: jax.Array, w: jax.Array, group_sizes: jax.Array, *, implementation: str | None = None,
    kernels: KernelChoices | None = None,
) -> jax.Array:
    """silu(gate) * up of `grouped_matmul_gather(x, row_token, w, group_sizes)` for w [G, 2I, K] in the checkpoint's
    layout (gate rows, then up rows). Returns [M, I] in x's dtype, from gate and up rounded to x's dtype (the
    unfused order). "cutlass" computes the activation in the gather kernel's epilogue: the [M, 2I] projection is
    never written. Rows past sum(group_sizes) are zeros for "cutlass" and "xla". The form: as `grouped_matmul`'s;
    the kernel's tile: `kernels.gather_swiglu_config`."""
    if (x.ndim != 2 or row_token.ndim != 1 or w.ndim != 3 or x.shape[1] != w.shape[2]
            or group_sizes.shape != (w.shape[0],)):
        raise ValueError(
            f"grouped_matmul_gather_swiglu: x {x.shape}, row_token {row_token.shape}, w {w.shape}, group_sizes "
            f"{group_sizes.shape} do not fit x [T, K], row_token [M], w [G, 2I, K], group_sizes [G]"
        )
    i, _ = _check_gate_up(w, "grouped_matmul_gather_swiglu")
    kernels = resolve(kernels)

    def unfused(x, row_token, w, s, implementation=implementation):
        y = grouped_matmul_gather(x, row_token, w, s, implementation=implementation, kernels=kernels)
        return swiglu(y[:, :i], y[:, i:], x.dtype)

    impl = implementation or default_implementation(x.dtype, kernels)
    if impl == "cutlass":
        from jax_dwdp.kernels import _cutlass as cutlass

        fn = functools.partial(cutlass.grouped_matmul_gather_swiglu, config=kernels.gather_swiglu_config)
        with jax.named_scope("grouped_matmul_gather_swiglu_cutlass"):
            if implementation is None:  # chosen by the choices: where lowered for a CUDA GPU (as in grouped_matmul)
                return on_cuda(fn, lambda *a: unfused(*a, implementation="xla"), x, row_token.astype(jnp.int32),
                               w.astype(x.dtype), group_sizes)
            return fn(x, row_token, w.astype(x.dtype), group_sizes)
    return unfused(x, row_token, w, group_sizes)

"""Mamba-2's chunked SSD scan on the GPU: Pallas (Triton) kernels, two by default (three split).

The math and the contract are `ssd.ssd_chunked_xla`'s (the fp32 reference). Per sequence, head h (of group
g = h // R, R = H / G) and chunk of L = chunk_size tokens, with the in-chunk cumulative log decay
cum_i = sum_{j <= i} dt_j A_h and the state S [P, N]:

    y_i  = sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j  +  exp(cum_i) S C_i      (S: entering the chunk)
    S   <- exp(cum_L) S + sum_j exp(cum_L - cum_j) dt_j x_j B_j^T

1. `_scores_kernel`, one program per (sequence, chunk, group), all in parallel: the chunk's C B^T [L, L], which
   the group's R heads share (computed once instead of R times), in the operand dtype.
2. `_scan_kernel` (the default, `Tuning.fused`), one program per (sequence, head, block of P rows of the state):
   a loop over the chunks carrying S [BP, N] in fp32 and writing y as it goes. Only the state's update is on the
   loop's dependency chain (S -> S); the chunk's own output products depend on nothing carried, so they fill the
   chain's latency, and neither the per-chunk states nor partial outputs go through memory.
   Split instead (`Tuning(fused=False)`): `_states_kernel` runs the same loop without the output and writes the
   state entering each chunk (operand dtype), and `_output_kernel`, one program per (sequence, chunk, head), computes
   y from it in parallel: the states' round trip through memory against a loop with less work per step.

Why Pallas Triton and not Mosaic GPU: the other kernels of this package are Triton ones (the same tools, tests and
tuning knobs), Triton issues Hopper's wgmma for these tile shapes itself and software-pipelines the loads of the
chunk loop (`num_stages`), and the Triton kernels run in Pallas' interpret mode on the CPU, where the tests check
them; Mosaic GPU would need the TMA and barrier pipeline written by hand for the same dataflow.

Operands of the tensor-core products are bf16 / fp16 when x is (B and C are cast to x's dtype; the decay-weighted
scores, the state where it enters a product and B weighted by its decay are rounded to it), with fp32
accumulation; the state is accumulated in fp32. fp32 inputs keep fp32 operands with exact (IEEE) products: the
reference precision, not a fast path. x, B, C and y are not padded to the chunk: the last chunk's rows past T are
loaded as zeros and not stored, and only dt (fp32, laid out [B, H, T'], T' = T rounded up to L, zero past T) is
copied. Steps with dt = 0 leave the state as it is and add nothing, as in the reference: that is how a right-padded
batch keeps each sequence's state at its own length (y past a length is then unspecified, finite).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_F32 = jnp.float32
_HALF = (jnp.bfloat16, jnp.float16)
_SMS = 128  # about one program per multiprocessor of an H100 / H200 (132): the loop kernels' target parallelism


def supported(chunk_size: int, head_dim: int, state_size: int) -> bool:
    """Triton tiles need power-of-two sizes of at least 16."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (chunk_size, head_dim, state_size))


def operand_dtype(dtype) -> jnp.dtype:
    """The tensor-core operand type of inputs of `dtype`: bf16 / fp16 as they are, anything else fp32."""
    return jnp.dtype(dtype) if jnp.dtype(dtype) in map(jnp.dtype, _HALF) else jnp.dtype(_F32)


def _dot(a, b, *, trans_a: bool = False, trans_b: bool = False):
    """a @ b with fp32 accumulation; fp32 operands multiply exactly (IEEE, not TF32)."""
    precision = lax.Precision.HIGHEST if a.dtype == _F32 else None
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, precision=precision)


def _iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def _load(ref, n, chunk: int, t: int):
    """ref[...] for rows [n*chunk, n*chunk + rows) of a [.., t, ..] array (t static, the array not padded to the
    chunk): rows past t read as zeros (a masked load; a plain load when t is a multiple of the chunk)."""
    if t % chunk == 0:
        return ref[...]
    return plgpu.load(ref, mask=n * chunk + _iota(ref.shape, 0) < t, other=jnp.zeros((), ref.dtype))


def _store(ref, value, n, chunk: int, t: int):
    """ref[...] = value for rows [n*chunk, ...) of a [.., t, ..] array: rows past t are not written."""
    if t % chunk == 0:
        ref[...] = value.astype(ref.dtype)
    else:
        plgpu.store(ref, value.astype(ref.dtype), mask=n * chunk + _iota(ref.shape, 0) < t)


def _decay(dt, a):
    """The chunk's dt [L] fp32 and A (a scalar) -> (cum [L], the chunk's total log decay)."""
    da = dt * a
    return jnp.cumsum(da), jnp.sum(da)


def _own_output(cb, cum, dt, x):
    """The chunk's output from its own tokens: (causal(CB exp(cum_i - cum_j)) dt_j) @ x, [L, BP] fp32. The
    exponent is masked before exp: above the diagonal it is positive and could overflow."""
    chunk = cb.shape[0]
    causal = _iota((chunk, chunk), 0) >= _iota((chunk, chunk), 1)
    decay = jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], 0.0))
    weights = jnp.where(causal, cb.astype(_F32) * decay * dt[None, :], 0.0)
    return _dot(weights.astype(x.dtype), x)


def _state_output(c, state, cum):
    """The output from the state entering the chunk: exp(cum_i) (C @ S^T) [L, BP] fp32 (S [BP, N], rounded to C's
    dtype for the product)."""
    return _dot(c, state.astype(c.dtype), trans_b=True) * jnp.exp(cum)[:, None]


def _state_update(state, x, b, cum, total, dt):
    """The state at the chunk's end: exp(total) S + x^T @ (B exp(total - cum) dt), [BP, N] fp32."""
    weighted = (b.astype(_F32) * (jnp.exp(total - cum) * dt)[:, None]).astype(b.dtype)
    return state * jnp.exp(total) + _dot(x, weighted, trans_a=True)


def _scores_kernel(c_ref, b_ref, cb_ref, *, chunk: int, t: int):
    n = pl.program_id(1)
    cb_ref[...] = _dot(_load(c_ref, n, chunk, t), _load(b_ref, n, chunk, t), trans_b=True).astype(cb_ref.dtype)


def _initial(h0_ref, shape):
    return jnp.zeros(shape, _F32) if h0_ref is None else h0_ref[...].astype(_F32)


def _scan_kernel(a_ref, dt_ref, x_ref, b_ref, c_ref, cb_ref, *rest, chunk: int, t: int, has_initial: bool):
    """The fused loop: per chunk the output (its own part and the state's) and the state's update."""
    h0_ref = rest[0] if has_initial else None
    y_ref, final_ref = rest[-2], rest[-1]  # (an aliased `out` buffer, if any, sits before them: the same memory)
    a = a_ref[pl.program_id(1)]

    def step(n, state):
        rows = pl.ds(n * chunk, chunk)
        dt = dt_ref[rows]
        cum, total = _decay(dt, a)
        x = _load(x_ref.at[rows, :], n, chunk, t)
        c = _load(c_ref.at[rows, :], n, chunk, t)
        y = _own_output(cb_ref[rows, :], cum, dt, x) + _state_output(c, state, cum)
        _store(y_ref.at[rows, :], y, n, chunk, t)
        return _state_update(state, x, _load(b_ref.at[rows, :], n, chunk, t), cum, total, dt)

    final_ref[...] = lax.fori_loop(0, pl.cdiv(t, chunk), step, _initial(h0_ref, final_ref.shape))


def _states_kernel(a_ref, dt_ref, x_ref, b_ref, *rest, chunk: int, t: int, has_initial: bool):
    """The split loop: the state entering each chunk (operand dtype) and the final state (fp32)."""
    h0_ref = rest[0] if has_initial else None
    states_ref, final_ref = rest[-2], rest[-1]
    a = a_ref[pl.program_id(1)]

    def step(n, state):
        rows = pl.ds(n * chunk, chunk)
        states_ref[n] = state.astype(states_ref.dtype)
        dt = dt_ref[rows]
        cum, total = _decay(dt, a)
        return _state_update(state, _load(x_ref.at[rows, :], n, chunk, t), _load(b_ref.at[rows, :], n, chunk, t),
                             cum, total, dt)

    final_ref[...] = lax.fori_loop(0, pl.cdiv(t, chunk), step, _initial(h0_ref, final_ref.shape))


def _output_kernel(a_ref, dt_ref, x_ref, c_ref, cb_ref, states_ref, *rest, chunk: int, t: int):
    """The split output, one chunk of one head: its own part and the entering state's."""
    y_ref = rest[-1]
    n = pl.program_id(1)
    dt = dt_ref[...]
    cum, _ = _decay(dt, a_ref[pl.program_id(2)])
    y = (_own_output(cb_ref[...], cum, dt, _load(x_ref, n, chunk, t))
         + _state_output(_load(c_ref, n, chunk, t), states_ref[...], cum))
    _store(y_ref, y, n, chunk, t)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch parameters. `fused`: the output inside the chunk loop (two kernels) or by a parallel kernel after it
    (three). `block_p`: rows of the state per loop program (None: `_block_p`, about one program per
    multiprocessor). `num_warps` / `num_stages`: per kernel, (scores, loop, output); the output entry is used
    split only. Not yet measured on a GPU: the defaults are first guesses (8 warps for the loop, whose [L, L]
    fp32 weights take 64 registers a thread at L = 128 with 8 warps and 128 with 4); benchmarks/bench_ssd.py
    --variants times the alternatives."""

    fused: bool = True
    block_p: int | None = None
    num_warps: tuple[int, int, int] = (4, 8, 8)
    num_stages: tuple[int, int, int] = (2, 2, 2)

    def __post_init__(self):
        if self.block_p is not None and (self.block_p < 16 or self.block_p & (self.block_p - 1)):
            raise ValueError(f"Tuning.block_p={self.block_p}: a power of two >= 16, or None")

    def params(self, i: int) -> plgpu.CompilerParams:
        return plgpu.CompilerParams(num_warps=self.num_warps[i], num_stages=self.num_stages[i])


def _block_p(batch: int, heads: int, p: int) -> int:
    """State rows per loop program: halved from P (down to 16) until about one program per multiprocessor."""
    bp = p
    while bp > 16 and batch * heads * (p // bp) < _SMS:
        bp //= 2
    return bp


def scores(c, b, *, chunk: int, tuning: Tuning = Tuning(), interpret: bool = False):
    """Kernel 1. c, b [B, T, G, N] (operand dtype) -> C B^T per chunk and group, [B, G, T', L] (T' = T rounded up to
    L; rows past T zero)."""
    bsz, t, g, n = c.shape
    nc = pl.cdiv(t, chunk)
    rows = pl.BlockSpec((None, chunk, None, n), lambda i, j, k: (i, j, k, 0))
    return pl.pallas_call(
        functools.partial(_scores_kernel, chunk=chunk, t=t),
        grid=(bsz, nc, g),
        in_specs=[rows, rows],
        out_specs=pl.BlockSpec((None, None, chunk, chunk), lambda i, j, k: (i, k, j, 0)),
        out_shape=jax.ShapeDtypeStruct((bsz, g, nc * chunk, chunk), c.dtype),
        compiler_params=tuning.params(0),
        interpret=interpret,
        name="ssd_scores",
    )(c, b)


def _loop_specs(a, dt, x, b, bp: int, rep: int):
    """BlockSpecs of the loop kernels' common inputs (grid (B, H, P / bp)): A whole, a head's dt [T'], its rows of x
    [T', bp], its group's B (or C) [T', N]. The blocks span T' rows; x's, B's and C's rows past T are masked."""
    tp = dt.shape[-1]
    n = b.shape[-1]
    return [pl.BlockSpec(a.shape, lambda *_: (0,)),
            pl.BlockSpec((None, None, tp), lambda i, h, j: (i, h, 0)),
            pl.BlockSpec((None, tp, None, bp), lambda i, h, j: (i, 0, h, j)),
            pl.BlockSpec((None, tp, None, n), lambda i, h, j: (i, 0, h // rep, 0))]


def scan(a, dt, x, b, c, cb, initial_state=None, out=None, *, chunk: int, y_dtype, tuning: Tuning = Tuning(),
         interpret: bool = False):
    """Kernel 2, fused. a [H] fp32; dt [B, H, T'] fp32 (zero past T); x [B, T, H, P], b, c [B, T, G, N] (operand
    dtype); cb from `scores`; initial_state [B, H, P, N] or None; out an optional [B, T, H, P] buffer of y_dtype
    that y is written into. Returns (y [B, T, H, P] y_dtype, final state [B, H, P, N] fp32)."""
    bsz, t, h, p = x.shape
    g, n = b.shape[-2:]
    rep = h // g
    tp = dt.shape[-1]
    bp = min(tuning.block_p or _block_p(bsz, h, p), p)
    state = pl.BlockSpec((None, None, bp, n), lambda i, hh, j: (i, hh, j, 0))
    y_spec = pl.BlockSpec((None, tp, None, bp), lambda i, hh, j: (i, 0, hh, j))
    common = _loop_specs(a, dt, x, b, bp, rep)
    in_specs = [*common, common[-1], pl.BlockSpec((None, None, tp, chunk), lambda i, hh, j: (i, hh // rep, 0, 0))]
    args = [a, dt, x, b, c, cb]
    if initial_state is not None:
        in_specs.append(state)
        args.append(initial_state.astype(_F32))
    if out is not None:
        in_specs.append(y_spec)
        args.append(out)
    return pl.pallas_call(
        functools.partial(_scan_kernel, chunk=chunk, t=t, has_initial=initial_state is not None),
        grid=(bsz, h, p // bp),
        in_specs=in_specs,
        out_specs=[y_spec, state],
        out_shape=[jax.ShapeDtypeStruct((bsz, t, h, p), y_dtype), jax.ShapeDtypeStruct((bsz, h, p, n), _F32)],
        input_output_aliases={len(args) - 1: 0} if out is not None else {},
        compiler_params=tuning.params(1),
        interpret=interpret,
        name="ssd_scan",
    )(*args)


def states(a, dt, x, b, initial_state=None, *, chunk: int, tuning: Tuning = Tuning(), interpret: bool = False):
    """Kernel 2, split. Returns (the state entering each chunk [B, H, T'/L, P, N] in x's dtype, final state
    [B, H, P, N] fp32)."""
    bsz, t, h, p = x.shape
    g, n = b.shape[-2:]
    nc = dt.shape[-1] // chunk
    bp = min(tuning.block_p or _block_p(bsz, h, p), p)
    state = pl.BlockSpec((None, None, bp, n), lambda i, hh, j: (i, hh, j, 0))
    in_specs = _loop_specs(a, dt, x, b, bp, h // g)
    args = [a, dt, x, b]
    if initial_state is not None:
        in_specs.append(state)
        args.append(initial_state.astype(_F32))
    return pl.pallas_call(
        functools.partial(_states_kernel, chunk=chunk, t=t, has_initial=initial_state is not None),
        grid=(bsz, h, p // bp),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, nc, bp, n), lambda i, hh, j: (i, hh, 0, j, 0)), state],
        out_shape=[jax.ShapeDtypeStruct((bsz, h, nc, p, n), x.dtype), jax.ShapeDtypeStruct((bsz, h, p, n), _F32)],
        compiler_params=tuning.params(1),
        interpret=interpret,
        name="ssd_states",
    )(*args)


def output(a, dt, x, c, cb, entering, out=None, *, chunk: int, y_dtype, tuning: Tuning = Tuning(),
           interpret: bool = False):
    """Kernel 3, split: y [B, T, H, P] in y_dtype from the states entering each chunk (`states`)."""
    bsz, t, h, p = x.shape
    g, n = c.shape[-2:]
    rep = h // g
    nc = dt.shape[-1] // chunk
    y_spec = pl.BlockSpec((None, chunk, None, p), lambda i, j, hh: (i, j, hh, 0))
    in_specs = [pl.BlockSpec(a.shape, lambda *_: (0,)),
                pl.BlockSpec((None, None, chunk), lambda i, j, hh: (i, hh, j)),
                y_spec,
                pl.BlockSpec((None, chunk, None, n), lambda i, j, hh: (i, j, hh // rep, 0)),
                pl.BlockSpec((None, None, chunk, chunk), lambda i, j, hh: (i, hh // rep, j, 0)),
                pl.BlockSpec((None, None, None, p, n), lambda i, j, hh: (i, hh, j, 0, 0))]
    args = [a, dt, x, c, cb, entering]
    if out is not None:
        in_specs.append(y_spec)
        args.append(out)
    return pl.pallas_call(
        functools.partial(_output_kernel, chunk=chunk, t=t),
        grid=(bsz, nc, h),
        in_specs=in_specs,
        out_specs=y_spec,
        out_shape=jax.ShapeDtypeStruct((bsz, t, h, p), y_dtype),
        input_output_aliases={len(args) - 1: 0} if out is not None else {},
        compiler_params=tuning.params(2),
        interpret=interpret,
        name="ssd_output",
    )(*args)


@functools.partial(jax.jit, static_argnames=("chunk_size", "y_dtype", "tuning", "interpret"))
def ssd_chunked_pallas(
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    initial_state: jax.Array | None = None,
    out: jax.Array | None = None,
    *,
    chunk_size: int,
    y_dtype=jnp.float32,
    tuning: Tuning = Tuning(),
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`ssd.ssd_chunked`'s contract: x [B, T, H, P]; dt [B, T, H] (discretised, zero on padding); a [H]; b, c
    [B, T, G, N]; initial_state [B, H, P, N] or None (zeros). Returns (y [B, T, H, P] in `y_dtype` (fp32, as the
    reference, unless asked otherwise), without the D skip; final state [B, H, P, N] fp32). `out`: an optional
    [B, T, H, P] buffer of `y_dtype` that y is written into (the tests fill it with NaN: every element must be
    written)."""
    bsz, t, h, p = x.shape
    g, n = b.shape[-2:]
    if not supported(chunk_size, p, n):
        raise ValueError(f"ssd_chunked_pallas: chunk_size {chunk_size}, head_dim {p} and state_size {n} must be "
                         "powers of two >= 16")
    if out is not None and (out.shape != x.shape or out.dtype != jnp.dtype(y_dtype)):
        raise ValueError(f"ssd_chunked_pallas: out is {out.dtype} {out.shape}; expected {jnp.dtype(y_dtype)} "
                         f"{x.shape} (y's)")
    operand = operand_dtype(x.dtype)
    x, b, c = (v.astype(operand) for v in (x, b, c))
    pad = (-t) % chunk_size
    dt = jnp.pad(dt.astype(_F32), ((0, 0), (0, pad), (0, 0))).transpose(0, 2, 1)  # [B, H, T']
    a = a.astype(_F32)
    cb = scores(c, b, chunk=chunk_size, tuning=tuning, interpret=interpret)
    if tuning.fused:
        return scan(a, dt, x, b, c, cb, initial_state, out, chunk=chunk_size, y_dtype=y_dtype, tuning=tuning,
                    interpret=interpret)
    entering, final = states(a, dt, x, b, initial_state, chunk=chunk_size, tuning=tuning, interpret=interpret)
    y = output(a, dt, x, c, cb, entering, out, chunk=chunk_size, y_dtype=y_dtype, tuning=tuning,
               interpret=interpret)
    return y, final

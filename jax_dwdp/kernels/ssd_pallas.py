"""Mamba-2's chunked SSD scan on the GPU: three Pallas (Triton) kernels.

The math and the contract are `ssd.ssd_chunked_xla`'s (the fp32 reference). Per sequence, head h (of group
g = h // R, R = H / G) and chunk of L = chunk_size tokens, with the in-chunk cumulative log decay
cum_i = sum_{j <= i} dt_j A_h and the state S [P, N]:

    y_i  = sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j  +  exp(cum_i) S C_i      (S: entering the chunk)
    S   <- exp(cum_L) S + sum_j exp(cum_L - cum_j) dt_j x_j B_j^T

1. `_scores_kernel`, one program per (sequence, chunk, group), all in parallel: the chunk's C B^T [L, L], which
   the group's R heads share (computed once instead of R times), in the operand dtype.
2. `_states_kernel`, one program per (sequence, head, block of `block_p` rows and `block_n` columns of the state):
   a loop over the chunks carrying its block of S in fp32 and writing the state entering each chunk (operand
   dtype). The update x^T (B w) is independent across the state's rows and columns, so the blocks are programs of
   their own: about two per multiprocessor at the default blocks. `Tuning.segments` also splits the chunks into
   segments looped over in parallel, each from a zero state (`_segmented`).
3. `_output_kernel`, one program per (sequence, chunk, head) (or `Tuning.output_heads` heads of a group), all in
   parallel: y from the chunk's own tokens and the state entering it. Within a chunk the rows are taken in
   `Tuning.row_blocks` blocks (in the states loop too), so that the [L, L] decay-weighted scores are computed as
   the tiles on and below the diagonal only.

Why this structure: two others were measured slower at 4K-32K tokens on an H100 (benchmarks/RESULTS.md, "Mamba-2
SSD scan"): one loop carrying the state and writing y as it goes (no states through memory, but the output's
products on the loop's 128 programs), and every chunk's own state in parallel followed by an elementwise chain over
the chunks (mamba_ssm's structure: fp32 chunk states through memory and a second pass).

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

from ._triton_rows import iota, load_rows, store_rows

_F32 = jnp.float32
_HALF = (jnp.bfloat16, jnp.float16)
_SMS = 128  # about the multiprocessors of an H100 / H200 (132): the states loop's parallelism is set against it


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


class _Rows:
    """Rows [first, first + size) of one chunk. `local`: where the chunk starts in the refs read and written (n L in
    a whole-sequence block, 0 in a one-chunk block); `start`: where it starts in the sequence (n L). Rows at or past
    t (static; x, B, C and y are not padded to the chunk) load as zeros and are not stored; when t is a multiple of
    the chunk nothing is masked."""

    def __init__(self, local, start, first: int, size: int, t: int, masked: bool):
        self.local, self.start, self.first, self.size, self.t, self.masked = local, start, first, size, t, masked

    def _view(self, ref, head):
        rows = pl.ds(self.local + self.first, self.size)
        return ref.at[rows] if head is None else ref.at[rows, head]  # (one indexer: Triton lowers no chains)

    def load(self, ref, head=None):
        """The rows of ref, or of its head `head` (ref [rows, heads, ...])."""
        return load_rows(self._view(ref, head), self.start + self.first, self.t, self.masked)

    def store(self, ref, value, head=None):
        store_rows(self._view(ref, head), value, self.start + self.first, self.t, self.masked)


def _row_blocks(local, start, chunk: int, blocks: int, t: int, masked: bool = False) -> list[_Rows]:
    """The chunk's rows in `blocks` blocks; masked where t is not a multiple of the chunk, or where `masked` says
    that chunks past the data are looped over."""
    size = chunk // blocks
    return [_Rows(local, start, k * size, size, t, masked or t % chunk != 0) for k in range(blocks)]


def _decays(dt_ref, rows: list[_Rows], a, head=None):
    """Per row block: dt [size] fp32 (zero past T), cum [size] (the log decay from the chunk's start), and the
    chunk's total log decay. dt_ref [T'], or [heads, T'] with the head `head`."""
    dts, cums = [], []
    total = jnp.zeros((), _F32)
    for r in rows:
        span = pl.ds(r.local + r.first, r.size)
        dt = dt_ref[span] if head is None else dt_ref[head, span]
        da = dt * a
        cums.append(jnp.cumsum(da) + total)
        total = total + jnp.sum(da)
        dts.append(dt)
    return dts, cums, total


def _outputs(cb_ref, rows: list[_Rows], xs, cs, state, dts, cums):
    """y of each row block k of the chunk: sum_{j <= k} (CB exp(cum_i - cum_j) dt_j)[k, j] @ x_j (blocks above the
    diagonal are zero and skipped) + exp(cum_k) (C_k @ S^T), [size, BP] fp32, S [BP, N] rounded to C's dtype for its
    product. On the diagonal the exponent is masked before exp (above it, it is positive and could overflow); below
    it every exponent is <= 0."""
    size = rows[0].size
    causal = iota((size, size), 0) >= iota((size, size), 1)
    ys = []
    for k, rk in enumerate(rows):
        y = _dot(cs[k], state.astype(cs[k].dtype), trans_b=True) * jnp.exp(cums[k])[:, None]
        for j in range(k + 1):
            cb = cb_ref[pl.ds(rk.local + rk.first, size), pl.ds(rows[j].first, size)].astype(_F32)
            exponent = cums[k][:, None] - cums[j][None, :]
            if j == k:
                weights = jnp.where(causal, cb * jnp.exp(jnp.where(causal, exponent, 0.0)) * dts[j][None, :], 0.0)
            else:
                weights = cb * jnp.exp(exponent) * dts[j][None, :]
            y = y + _dot(weights.astype(xs[j].dtype), xs[j])
        ys.append(y)
    return ys


def _updated(state, xs, bs, dts, cums, total):
    """The state at the chunk's end: exp(total) S + sum_k x_k^T @ (B_k exp(total - cum_k) dt_k), [BP, N] fp32."""
    state = state * jnp.exp(total)
    for x, b, dt, cum in zip(xs, bs, dts, cums):
        weighted = (b.astype(_F32) * (jnp.exp(total - cum) * dt)[:, None]).astype(b.dtype)
        state = state + _dot(x, weighted, trans_a=True)
    return state


def _scores_kernel(c_ref, b_ref, cb_ref, *, chunk: int, t: int):
    [rows] = _row_blocks(0, pl.program_id(1) * chunk, chunk, 1, t)
    cb_ref[...] = _dot(rows.load(c_ref), rows.load(b_ref), trans_b=True).astype(cb_ref.dtype)


def _initial(h0_ref, shape):
    return jnp.zeros(shape, _F32) if h0_ref is None else h0_ref[...].astype(_F32)


def _states_kernel(a_ref, dt_ref, x_ref, b_ref, *rest, chunk: int, blocks: int, t: int, has_initial: bool,
                   per_segment: int | None = None):
    """The loop over chunks: the state entering each chunk (operand dtype) and the final state (fp32). With
    `per_segment`, the loop covers the chunks of one segment (the grid's last axis) from a zero state: the states
    entering them from the segment's own tokens, and the state it leaves."""
    h0_ref = rest[0] if has_initial else None
    states_ref, final_ref = rest[-2], rest[-1]
    a = a_ref[pl.program_id(1)]
    first = None if per_segment is None else pl.program_id(4) * per_segment  # (read outside the loop's body)

    def step(j, state):
        n = j if first is None else first + j  # (j: the chunk within the block)
        states_ref[j] = state.astype(states_ref.dtype)
        # (segments padded to whole ones loop over chunks past the data: their rows masked too)
        rows = _row_blocks(n * chunk, n * chunk, chunk, blocks, t, first is not None)
        dts, cums, total = _decays(dt_ref, rows, a)
        return _updated(state, [r.load(x_ref) for r in rows], [r.load(b_ref) for r in rows], dts, cums, total)

    count = pl.cdiv(t, chunk) if per_segment is None else per_segment
    final_ref[...] = lax.fori_loop(0, count, step, _initial(h0_ref, final_ref.shape))


def _output_kernel(a_ref, dt_ref, x_ref, c_ref, cb_ref, states_ref, *rest, chunk: int, blocks: int, t: int,
                   heads: int, segmented: bool):
    """The output of one chunk of `heads` heads of one group: each head's own part and its entering state's. The
    chunk's C and C B^T are the group's: loaded once for all its heads. With one head the head axis of the blocks is
    squeezed away. `segmented`: states_ref holds the state from the segment's own tokens only; the one entering
    the chunk adds the state entering the segment (seg_ref, fp32) decayed by exp(log_ref[chunk]), the log decay
    from the segment's start to the chunk's."""
    y_ref = rest[-1]
    log_ref, seg_ref = (rest[0], rest[1]) if segmented else (None, None)
    rows = _row_blocks(0, pl.program_id(1) * chunk, chunk, blocks, t)
    cs = None
    for i in range(heads):
        # the head within the blocks (none: squeezed); a traced index, as the masked loads' interpret mode needs
        k = None if heads == 1 else jnp.int32(i)
        head = pl.program_id(2) if heads == 1 else pl.program_id(2) * heads + i
        dts, cums, _ = _decays(dt_ref, rows, a_ref[head], k)
        xs = [r.load(x_ref, k) for r in rows]
        cs = cs or [r.load(c_ref) for r in rows]  # (the group's: once)
        state = states_ref[...] if k is None else states_ref[k]
        if segmented:
            log = log_ref[pl.program_id(1)] if k is None else log_ref[k, pl.program_id(1)]
            seg = seg_ref[...] if k is None else seg_ref[k]
            state = state.astype(_F32) + jnp.exp(log) * seg
        ys = _outputs(cb_ref, rows, xs, cs, state, dts, cums)
        for r, y in zip(rows, ys):
            r.store(y_ref, y, k)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch parameters. `block_p` / `block_n`: rows / columns of the state per states-loop program (None: all P
    rows, and N columns halved (down to 16) until about two programs per multiprocessor, `_block_n`).
    `row_blocks`: a chunk's rows in this many blocks (at most chunk / 16, Triton's smallest tile), in the states loop
    and the output: the output's [L, L] decay-weighted scores are then computed as tiles on and below the diagonal
    only, (b + 1) / 2b of the exps and products of whole [L, L] tiles. `output_heads`: heads of one B/C group per
    output program (a divisor of the heads per group), which then loads the chunk's C and C B^T once for all of
    them instead of once per head. `segments`: the states loop over this many segments of the sequence in
    parallel (each from a zero state; then a short chain over the segments' end states, and the output adds each
    chunk's share of the state entering its segment): `segments` times the loop's programs, each 1 / `segments` as
    long. `num_warps` / `num_stages`: per kernel, (scores, states loop, output).

    The defaults are the fastest measured at 30B-A3B's heads (H100, benchmarks/RESULTS.md, "Mamba-2 SSD scan";
    `bench_ssd.py --variants` times the alternatives)."""

    block_p: int | None = None
    block_n: int | None = None
    row_blocks: int = 2
    output_heads: int = 1
    segments: int = 1
    num_warps: tuple[int, int, int] = (4, 4, 4)
    num_stages: tuple[int, int, int] = (2, 3, 2)

    def __post_init__(self):
        for name in ("block_p", "block_n"):
            value = getattr(self, name)
            if value is not None and (value < 16 or value & (value - 1)):
                raise ValueError(f"Tuning.{name}={value}: a power of two >= 16, or None")
        if self.row_blocks not in (1, 2, 4, 8):
            raise ValueError(f"Tuning.row_blocks={self.row_blocks}: 1, 2, 4 or 8")
        if self.output_heads < 1:
            raise ValueError(f"Tuning.output_heads={self.output_heads}: at least 1")
        if self.segments < 1:
            raise ValueError(f"Tuning.segments={self.segments}: at least 1")

    def blocks(self, chunk: int) -> int:
        """Row blocks of a chunk of `chunk` rows: `row_blocks`, at most chunk / 16."""
        return max(1, min(self.row_blocks, chunk // 16))

    def params(self, i: int) -> plgpu.CompilerParams:
        return plgpu.CompilerParams(num_warps=self.num_warps[i], num_stages=self.num_stages[i])


def _block_n(programs: int, n: int) -> int:
    """State columns per states-loop program: halved from N (down to 16) until about two programs per
    multiprocessor, `programs` being how many whole-column blocks there are."""
    bn = n
    while bn > 16 and programs * (n // bn) < 2 * _SMS:
        bn //= 2
    return bn


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


def states(a, dt, x, b, initial_state=None, *, chunk: int, tuning: Tuning = Tuning(), interpret: bool = False,
           per_segment: int | None = None):
    """Kernel 2. a [H] fp32; dt [B, H, T'] fp32 (zero past T); x [B, T, H, P], b [B, T, G, N] (operand dtype);
    initial_state [B, H, P, N] or None. Returns (the state entering each chunk [B, H, T'/L, P, N] in x's dtype,
    final state [B, H, P, N] fp32). With `per_segment` (T' / L a multiple of it, no initial state): the loop runs
    over each segment of that many chunks in parallel, from a zero state; returns (the state entering each chunk
    from its segment's own tokens, the state each segment leaves [B, H, T' / (L per_segment), P, N] fp32)."""
    bsz, t, h, p = x.shape
    g, n = b.shape[-2:]
    nc = dt.shape[-1] // chunk
    bp = min(tuning.block_p or p, p)
    bn = min(tuning.block_n or _block_n(bsz * h * (p // bp), n), n)
    rep = h // g
    tp = dt.shape[-1]
    state = pl.BlockSpec((None, None, bp, bn), lambda i, hh, j, k: (i, hh, j, k))
    # A whole; the head's dt [T']; its rows of x [T', bp]; its group's columns of B [T', bn]. The blocks span T'
    # rows: x's and B's rows past T are masked.
    in_specs = [pl.BlockSpec(a.shape, lambda *_: (0,)),
                pl.BlockSpec((None, None, tp), lambda i, hh, j, k: (i, hh, 0)),
                pl.BlockSpec((None, tp, None, bp), lambda i, hh, j, k: (i, 0, hh, j)),
                pl.BlockSpec((None, tp, None, bn), lambda i, hh, j, k: (i, 0, hh // rep, k))]
    args = [a, dt, x, b]
    if initial_state is not None:
        in_specs.append(state)
        args.append(initial_state.astype(_F32))
    kernel = functools.partial(_states_kernel, chunk=chunk, blocks=tuning.blocks(chunk), t=t,
                               has_initial=initial_state is not None)
    grid = (bsz, h, p // bp, n // bn)
    out_specs = [pl.BlockSpec((None, None, nc, bp, bn), lambda i, hh, j, k: (i, hh, 0, j, k)), state]
    leaving, name = (bsz, h, p, n), "ssd_states"
    if per_segment is not None:  # a last grid axis over the segments; their own states, and the state each leaves
        if initial_state is not None or nc % per_segment:
            raise ValueError(f"ssd states: segments of {per_segment} chunks need no initial state and a multiple of "
                             f"them ({nc} chunks)")
        segs = nc // per_segment
        kernel = functools.partial(kernel, per_segment=per_segment)
        grid += (segs,)
        in_specs = [pl.BlockSpec(s.block_shape, lambda i, hh, j, k, q, m=s.index_map: m(i, hh, j, k))
                    for s in in_specs]
        out_specs = [pl.BlockSpec((None, None, per_segment, bp, bn), lambda i, hh, j, k, q: (i, hh, q, j, k)),
                     pl.BlockSpec((None, None, None, bp, bn), lambda i, hh, j, k, q: (i, hh, q, j, k))]
        leaving, name = (bsz, h, segs, p, n), "ssd_segment_states"
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct((bsz, h, nc, p, n), x.dtype), jax.ShapeDtypeStruct(leaving, _F32)],
        compiler_params=tuning.params(1),
        interpret=interpret,
        name=name,
    )(*args)


def output(a, dt, x, c, cb, entering, out=None, *, chunk: int, y_dtype, tuning: Tuning = Tuning(),
           interpret: bool = False, segments=None):
    """Kernel 3: y [B, T, H, P] in y_dtype from the states entering each chunk (`states`); c, cb as `scores`
    takes and returns them; out an optional [B, T, H, P] buffer of y_dtype that y is written into. `segments`:
    (chunks per segment, the log decay from each chunk's segment start [B, H, chunks] fp32, the state entering
    each segment [B, H, segments, P, N] fp32) when `entering` holds the segments' own states only."""
    bsz, t, h, p = x.shape
    g, n = c.shape[-2:]
    rep = h // g
    nc = dt.shape[-1] // chunk
    hb = tuning.output_heads
    if rep % hb:
        raise ValueError(f"ssd output: Tuning.output_heads={hb} does not divide the {rep} heads of a B/C group")
    block = None if hb == 1 else hb  # (one head: the head axis squeezed out of the blocks)
    y_spec = pl.BlockSpec((None, chunk, block, p), lambda i, j, hh: (i, j, hh, 0))
    in_specs = [pl.BlockSpec(a.shape, lambda *_: (0,)),
                pl.BlockSpec((None, block, chunk), lambda i, j, hh: (i, hh, j)),
                y_spec,
                pl.BlockSpec((None, chunk, None, n), lambda i, j, hh: (i, j, hh * hb // rep, 0)),
                pl.BlockSpec((None, None, chunk, chunk), lambda i, j, hh: (i, hh * hb // rep, j, 0)),
                pl.BlockSpec((None, block, None, p, n), lambda i, j, hh: (i, hh, j, 0, 0))]
    args = [a, dt, x, c, cb, entering]
    if segments is not None:
        per_segment, logs, entering_segments = segments
        in_specs += [pl.BlockSpec((None, block, logs.shape[-1]), lambda i, j, hh: (i, hh, 0)),
                     pl.BlockSpec((None, block, None, p, n), lambda i, j, hh: (i, hh, j // per_segment, 0, 0))]
        args += [logs, entering_segments]
    if out is not None:
        in_specs.append(y_spec)
        args.append(out)
    return pl.pallas_call(
        functools.partial(_output_kernel, chunk=chunk, blocks=tuning.blocks(chunk), t=t, heads=hb,
                          segmented=segments is not None),
        grid=(bsz, nc, h // hb),
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
    t, p, n = x.shape[1], x.shape[-1], b.shape[-1]
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
    chunks = dt.shape[-1] // chunk_size
    if tuning.segments > 1 and chunks > 1:
        return _segmented(a, dt, x, b, c, cb, initial_state, out, chunk=chunk_size, y_dtype=y_dtype, tuning=tuning,
                          interpret=interpret)
    entering, final = states(a, dt, x, b, initial_state, chunk=chunk_size, tuning=tuning, interpret=interpret)
    y = output(a, dt, x, c, cb, entering, out, chunk=chunk_size, y_dtype=y_dtype, tuning=tuning,
               interpret=interpret)
    return y, final


def _segmented(a, dt, x, b, c, cb, initial_state, out, *, chunk: int, y_dtype, tuning: Tuning, interpret: bool):
    """`Tuning.segments`: the states loop over segments of the chunks in parallel, each from a zero state; the
    chain over the segments (S_{s+1} = exp(A dt-sum of segment s) S_s + the state segment s leaves, S_0 the
    initial state) in XLA, elementwise on [B, H, P, N] per segment; the output adds to each chunk's own-segment
    state exp(A dt-sum from its segment's start) S_s."""
    bsz, h = dt.shape[:2]
    chunks = dt.shape[-1] // chunk
    per_segment = pl.cdiv(chunks, tuning.segments)
    segs = pl.cdiv(chunks, per_segment)
    # whole segments: chunks past the last one have dt = 0 (the state unchanged) and only the loop sees them
    padded = jnp.pad(dt, ((0, 0), (0, 0), (0, (segs * per_segment - chunks) * chunk)))
    own, leaving = states(a, padded, x, b, chunk=chunk, tuning=tuning, interpret=interpret, per_segment=per_segment)
    logs = padded.reshape(bsz, h, segs, per_segment, chunk).sum(-1) * a[None, :, None, None]  # each chunk's
    into_chunk = (jnp.cumsum(logs, -1) - logs).reshape(bsz, h, segs * per_segment)  # from its segment's start

    def chain(entering, segment):
        leaves, log = segment
        return jnp.exp(log)[..., None, None] * entering + leaves, entering

    start = (jnp.zeros(leaving.shape[:2] + leaving.shape[3:], _F32) if initial_state is None
             else initial_state.astype(_F32))
    final, entering = lax.scan(chain, start, (jnp.moveaxis(leaving, 2, 0), jnp.moveaxis(logs.sum(-1), 2, 0)))
    y = output(a, dt, x, c, cb, own, out, chunk=chunk, y_dtype=y_dtype, tuning=tuning, interpret=interpret,
               segments=(per_segment, into_chunk, jnp.moveaxis(entering, 0, 2)))
    return y, final

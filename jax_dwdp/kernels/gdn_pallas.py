"""Chunked gated delta rule on the GPU: Pallas (Triton) kernels, two by default (three unfused).

The math is the chunked WY form of `gated_delta_rule.chunk_gated_delta_rule` (the fp32 reference), with chunk
C = 64 split into four sub-blocks of 16 for the triangular solve:

1. `_prep_kernel`, one program per (sequence, value head, chunk), all in parallel. From k, v, g, beta of the chunk:
   the l2 norms of k, the in-chunk cumulative log-decay `cum`, the unit lower-triangular system
   L = I + strict_lower(beta_i k_i.k_j exp(cum_i - cum_j)) and its inverse on 64x64 tiles (16x16 diagonal
   blocks by doubling, then the off-diagonal part in two products; fp32 values, products with bf16 operands and
   fp32 accumulation; see Tuning for the alternatives), then
     w = L^-1 (beta k exp(cum))    keys that read the state entering the chunk,
     u = L^-1 (beta v)             the chunk's values before the state's correction,
     kg = k exp(cum_last - cum)    keys decayed to the chunk's end (they write the state),
   and, for the fused output (the default), the chunk's causal decayed scores causal(q.k exp(cum_i - cum_j)) and
   q's row factors.
2. `_fused_kernel` (default) or `_recurrence_kernel`, one program per (sequence, value head, block of dv columns):
   the only sequential part, a loop over the chunks carrying the [dk, BV] state S in fp32:
     v_new = u - w @ S;   o = (q exp(cum)) @ S + scores @ v_new;   S <- exp(cum_last) S + kg^T @ v_new.
   Unfused, the recurrence writes the state entering each chunk (bf16) and v_new (bf16) instead of o, and
3. `_output_kernel`, one program per (sequence, value head, chunk), computes o from them in parallel.
   The final state stays fp32.

q and k are l2-normalised inside the kernels (q also scaled by dk^-0.5). Raw bf16 q and k enter the tensor-core
dot products and their norms are applied to the fp32 results, which rounds less than normalising first. Key heads
are shared by groups of value heads through the BlockSpec index maps: the repeat is never materialised. q, k, v
and o are not padded to the chunk: the last chunk's rows past T are loaded and stored with masks, so a batch of
any length costs no copies (only the fp32 gates are laid out [B, HV, T'], T' = T rounded up to C).
Sequences of a right-padded batch stop at their own length: chunks past it are skipped (their outputs are
zeros), and padded steps inside the last chunk get g = beta = 0, which leaves the state as it is, so each
sequence's output and final state are those of the sequence alone. An initial state [B, HV, dk, dv] continues a
prefill from an earlier one's cache.

Tensor-core dot products take bf16 operands with fp32 accumulation (the state is rounded to bf16 only where it
enters a dot; it is accumulated in fp32), as flash-linear-attention does.
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

CHUNK = 64
SUB = 16  # sub-block of the triangular solve
EPS = 1e-6  # l2 norm epsilon, as the reference
_F32 = jnp.float32
# The fp32 products of the triangular inverse, (the 16x16 diagonal blocks' doubling, the merge of the blocks): exact
# fp32 (CUDA cores), TF32, or bf16 operands with fp32 accumulation ("mixed": TF32 blocks, bf16 merge).
_HI, _TF32 = lax.Precision.HIGHEST, lax.Precision.DEFAULT
_MERGE_PRECISION = {"ieee": (_HI, _HI), "tf32": (_TF32, _TF32), "bf16": ("bf16", "bf16"), "mixed": (_TF32, "bf16")}


def _mm(a, b, precision):
    """a @ b for the inverse's fp32 tiles at `precision` (a value of _MERGE_PRECISION)."""
    if precision == "bf16":
        return plgpu.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16))
    return plgpu.dot(a, b, precision=precision)


def supported(dk: int, dv: int) -> bool:
    """Triton tiles need power-of-two sizes of at least 16."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (dk, dv))


def _load(ref, n, t: int, start: int = 0):
    """ref[...] for rows [n*CHUNK + start, ...) of a [.., t, ..] array (t static) that is not padded to the chunk."""
    return load_rows(ref, n * CHUNK + start, t, t % CHUNK != 0)


def _store(ref, value, n, t: int):
    """ref[...] = value for rows [n*CHUNK, ...) of a [.., t, ..] array: rows past t are not written."""
    store_rows(ref, value, n * CHUNK, t, t % CHUNK != 0)


def _inverse_unit_lower(a: jax.Array) -> jax.Array:
    """(I + a)^-1 for a strictly lower-triangular [S, S] tile, by forward substitution over its rows."""
    s = a.shape[0]
    rows, cols = iota((s, s), 0), iota((s, s), 1)
    col = iota((s,), 0)
    x = (rows == cols).astype(_F32)
    for i in range(1, s):
        a_row = jnp.sum(jnp.where(rows == i, a, 0.0), axis=0)  # a[i, :], zero from column i on
        # x[i, :] = e_i - sum_j a[i, j] x[j, :]; rows j < i of x are final.
        new_row = jnp.where(col == i, 1.0, 0.0) - jnp.sum(a_row[:, None] * x, axis=0)
        x = jnp.where(rows == i, new_row[None, :], x)
    return x


def _inverse_unit_lower_doubling(a: jax.Array, precision, order: int = SUB) -> jax.Array:
    """(I + a)^-1 = (I - a)(I + a^2)(I + a^4)(I + a^8) for a strictly lower-triangular tile with a^order = 0 (a 16x16
    block, or 16x16 blocks on a diagonal): six fp32 products instead of fifteen dependent row reductions."""
    s = a.shape[0]
    eye = (iota((s, s), 0) == iota((s, s), 1)).astype(_F32)
    x, power = eye - a, a
    p = 2
    while p < order:
        power = _mm(power, power, precision)
        x = x + _mm(x, power, precision)
        p *= 2
    return x


def _prep_wide(k, v, g_ref, beta_ref, w_ref, u_ref, kg_ref, cum_ref, precisions):
    """The prep kernel's body on whole 64-row tiles (Tuning.inverse = "wide"): a dozen 64x64 products on the
    tensor cores instead of ~70 16-row ones. With N the strictly lower system, split into its 16x16 diagonal blocks
    B and the rest R: D = (I + B)^-1 by doubling (B^16 = 0), M = D R (block nilpotent, M^4 = 0), and
    (I + N)^-1 = (I + M)^-1 D = (I - M)(I + M^2) D. The default (see Tuning)."""
    kf = k.astype(_F32)
    rk = lax.rsqrt(jnp.sum(kf * kf, axis=1) + EPS)
    kn = kf * rk[:, None]
    g, beta = g_ref[...], beta_ref[...]
    cum = jnp.cumsum(g)
    total = jnp.sum(g)
    rows, cols = iota((CHUNK, CHUNK), 0), iota((CHUNK, CHUNK), 1)
    lower = rows > cols
    system = plgpu.dot(k, k, trans_b=True) * (beta * rk)[:, None] * rk[None, :]
    system = jnp.where(lower, system * jnp.exp(jnp.where(lower, cum[:, None] - cum[None, :], 0.0)), 0.0)
    diagonal = (rows // SUB) == (cols // SUB)
    blocks, rest = jnp.where(diagonal, system, 0.0), jnp.where(diagonal, 0.0, system)
    eye = (rows == cols).astype(_F32)
    block_precision, precision = precisions
    inv_blocks = _inverse_unit_lower_doubling(blocks, block_precision)
    m = _mm(inv_blocks, rest, precision)
    left = eye - m
    left = left + _mm(left, _mm(m, m, precision), precision)
    inverse = _mm(left, inv_blocks, precision).astype(jnp.bfloat16)
    kbe = (kn * (beta * jnp.exp(cum))[:, None]).astype(jnp.bfloat16)
    vb = (v.astype(_F32) * beta[:, None]).astype(jnp.bfloat16)
    w_ref[...] = plgpu.dot(inverse, kbe).astype(w_ref.dtype)
    u_ref[...] = plgpu.dot(inverse, vb).astype(u_ref.dtype)
    kg_ref[...] = (kn * jnp.exp(total - cum)[:, None]).astype(kg_ref.dtype)
    cum_ref[...] = cum


def _scores(q, k, cum, scale: float):
    """The chunk's causal decayed scores causal(q.k exp(cum_i - cum_j)) [C, C] (q, k l2-normalised, q scaled) and
    the row factors of q against the state entering the chunk, rq exp(cum) [C] (fp32): the output's pieces that do
    not depend on the state (the output kernel, and the prep kernel for the fused recurrence)."""
    qf, kf = q.astype(_F32), k.astype(_F32)
    rq = lax.rsqrt(jnp.sum(qf * qf, axis=1) + EPS) * scale
    rk = lax.rsqrt(jnp.sum(kf * kf, axis=1) + EPS)
    causal = iota((CHUNK, CHUNK), 0) >= iota((CHUNK, CHUNK), 1)
    scores = plgpu.dot(q, k, trans_b=True) * rq[:, None] * rk[None, :]
    scores = jnp.where(causal, scores * jnp.exp(jnp.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0)
    return scores, rq * jnp.exp(cum)


def _prep_kernel(len_ref, k_ref, v_ref, g_ref, beta_ref, *refs, inverse: str, merge_precision: str,
                 fused: bool, scale: float, t: int):
    b, n = pl.program_id(0), pl.program_id(2)
    nb = CHUNK // SUB
    if fused:  # also the output's pieces that do not depend on the state (see fused_recurrence)
        q_ref, w_ref, u_ref, kg_ref, cum_ref, a_ref, qs_ref = refs

        @pl.when(n * CHUNK < len_ref[b])
        def _():
            scores, q_scale = _scores(_load(q_ref, n, t), _load(k_ref, n, t), jnp.cumsum(g_ref[...]), scale)
            a_ref[...] = scores.astype(a_ref.dtype)
            qs_ref[...] = q_scale
    else:
        w_ref, u_ref, kg_ref, cum_ref = refs

    if inverse == "wide":
        pl.when(n * CHUNK < len_ref[b])(
            lambda: _prep_wide(_load(k_ref, n, t), _load(v_ref, n, t), g_ref, beta_ref, w_ref, u_ref, kg_ref, cum_ref,
                               _MERGE_PRECISION[merge_precision]))
        return

    @pl.when(n * CHUNK < len_ref[b])
    def _():
        ks, kns, cums, betas, vbs = [], [], [], [], []
        total = jnp.zeros((), _F32)
        for a in range(nb):
            rows = pl.ds(a * SUB, SUB)
            k_a = _load(k_ref.at[rows, :], n, t, a * SUB)
            kf = k_a.astype(_F32)
            rk = lax.rsqrt(jnp.sum(kf * kf, axis=1) + EPS)
            g_a, beta_a = g_ref[rows], beta_ref[rows]
            cum = jnp.cumsum(g_a) + total
            total = total + jnp.sum(g_a)
            ks.append((k_a, rk))
            kns.append(kf * rk[:, None])
            cums.append(cum)
            betas.append(beta_a)
            vbs.append(_load(v_ref.at[rows, :], n, t, a * SUB).astype(_F32) * beta_a[:, None])
        rows, cols = iota((SUB, SUB), 0), iota((SUB, SUB), 1)

        # Blocks of the strictly lower system A (a >= c), from raw bf16 k on the tensor cores.
        system = {}
        for a in range(nb):
            for c in range(a + 1):
                (k_a, rk_a), (k_c, rk_c) = ks[a], ks[c]
                dots = plgpu.dot(k_a, k_c, trans_b=True)
                arg = cums[a][:, None] - cums[c][None, :]
                blk = dots * (betas[a] * rk_a)[:, None] * rk_c[None, :]
                if a == c:
                    lower = rows > cols
                    blk = jnp.where(lower, blk * jnp.exp(jnp.where(lower, arg, 0.0)), 0.0)
                else:
                    blk = blk * jnp.exp(arg)
                system[a, c] = blk

        # L^-1 by blocks: diagonal blocks D_a alone, then X[a, c] = -D_a sum_{m=c}^{a-1} A[a, m] X[m, c].
        block_precision, precision = _MERGE_PRECISION[merge_precision]
        inv = {}
        for a in range(nb):
            if inverse == "doubling":
                inv[a, a] = _inverse_unit_lower_doubling(system[a, a], block_precision)
            else:
                inv[a, a] = _inverse_unit_lower(system[a, a])
            for c in range(a):
                acc = sum(_mm(system[a, m], inv[m, c], precision) for m in range(c, a))
                inv[a, c] = -_mm(inv[a, a], acc, precision)

        for a in range(nb):
            rows_a = pl.ds(a * SUB, SUB)
            w = sum(
                plgpu.dot(inv[a, c].astype(jnp.bfloat16),
                          (kns[c] * (betas[c] * jnp.exp(cums[c]))[:, None]).astype(jnp.bfloat16))
                for c in range(a + 1)
            )
            u = sum(plgpu.dot(inv[a, c].astype(jnp.bfloat16), vbs[c].astype(jnp.bfloat16)) for c in range(a + 1))
            w_ref[rows_a, :] = w.astype(w_ref.dtype)
            u_ref[rows_a, :] = u.astype(u_ref.dtype)
            kg_ref[rows_a, :] = (kns[a] * jnp.exp(total - cums[a])[:, None]).astype(kg_ref.dtype)
            cum_ref[rows_a] = cums[a]


def _recurrence_kernel(len_ref, w_ref, u_ref, kg_ref, cum_ref, *rest, has_initial: bool):
    """The loop over chunks, the state [dk, BV] in fp32 registers. (Carrying it transposed, so that it and v_new
    enter the products as left operands from registers, measured no faster on an H200: 0.42-0.47 vs 0.46 ms at
    16K tokens, and the transposed stores slowed the prep kernel; benchmarks/RESULTS.md.)"""
    if has_initial:
        h0_ref, hs_ref, vn_ref, ht_ref = rest
    else:
        hs_ref, vn_ref, ht_ref = rest
    b = pl.program_id(0)
    num_chunks = (len_ref[b] + CHUNK - 1) // CHUNK
    state = h0_ref[...].astype(_F32) if has_initial else jnp.zeros(ht_ref.shape, _F32)

    def chunk(n, state):
        rows = pl.ds(n * CHUNK, CHUNK)
        hs_ref[n] = state.astype(hs_ref.dtype)
        w = w_ref[rows, :]
        decay = jnp.exp(cum_ref[n * CHUNK + CHUNK - 1])
        v_new = u_ref[rows, :].astype(_F32) - plgpu.dot(w, state.astype(w.dtype))
        v_new = v_new.astype(vn_ref.dtype)
        vn_ref[rows, :] = v_new
        return state * decay + plgpu.dot(kg_ref[rows, :], v_new, trans_a=True)

    ht_ref[...] = lax.fori_loop(0, num_chunks, chunk, state)


def _fused_kernel(len_ref, q_ref, qs_ref, a_ref, w_ref, u_ref, kg_ref, cum_ref, *rest, has_initial: bool, t: int):
    """The recurrence with the output folded in (Tuning.fused_output): per chunk, besides the state update,
      o = (q @ S) rq exp(cum) + A @ v_new,   A = causal(q.k exp(cum_i - cum_j)) from the prep kernel,
    so neither the per-chunk states nor v_new go through memory. The output's products hang off the loop's
    dependency chain (S -> v_new -> S), so they fill its latency instead of lengthening it."""
    h0_ref = rest[0] if has_initial else None
    o_ref, ht_ref = rest[-2], rest[-1]  # (an aliased `out` buffer, if any, sits before them: the same memory)
    b = pl.program_id(0)
    length = len_ref[b]
    num_chunks = (length + CHUNK - 1) // CHUNK
    state = h0_ref[...].astype(_F32) if has_initial else jnp.zeros(ht_ref.shape, _F32)
    row = iota((CHUNK, 1), 0)

    def chunk(n, state):
        rows = pl.ds(n * CHUNK, CHUNK)
        s_half = state.astype(w_ref.dtype)
        v_new = (u_ref[rows, :].astype(_F32) - plgpu.dot(w_ref[rows, :], s_half)).astype(w_ref.dtype)
        o = plgpu.dot(_load(q_ref.at[rows, :], n, t), s_half) * qs_ref[rows][:, None] + plgpu.dot(a_ref[rows, :], v_new)
        _store(o_ref.at[rows, :], jnp.where(n * CHUNK + row < length, o, 0.0).astype(o_ref.dtype), n, t)
        decay = jnp.exp(cum_ref[n * CHUNK + CHUNK - 1])
        return state * decay + plgpu.dot(kg_ref[rows, :], v_new, trans_a=True)

    ht_ref[...] = lax.fori_loop(0, num_chunks, chunk, state)

    def zero(n, carry):  # chunks past the sequence's end
        _store(o_ref.at[pl.ds(n * CHUNK, CHUNK), :], jnp.zeros((CHUNK, o_ref.shape[-1]), o_ref.dtype), n, t)
        return carry

    lax.fori_loop(num_chunks, -(-t // CHUNK), zero, 0)


def _output_kernel(len_ref, q_ref, k_ref, cum_ref, hs_ref, vn_ref, *rest, scale: float, t: int):
    o_ref = rest[-1]  # rest is (o,) or, with a buffer to write into, (that buffer as input, o): the same memory
    b, n = pl.program_id(0), pl.program_id(2)
    inside = n * CHUNK < len_ref[b]

    @pl.when(inside)
    def _():
        q = _load(q_ref, n, t)
        scores, q_scale = _scores(q, _load(k_ref, n, t), cum_ref[...], scale)
        inter = plgpu.dot(q, hs_ref[...]) * q_scale[:, None]
        intra = plgpu.dot(scores.astype(vn_ref.dtype), vn_ref[...])
        valid = n * CHUNK + iota((CHUNK, 1), 0) < len_ref[b]  # zeros past the sequence's end
        _store(o_ref, jnp.where(valid, inter + intra, 0.0).astype(o_ref.dtype), n, t)

    @pl.when(jnp.logical_not(inside))
    def _():
        _store(o_ref, jnp.zeros(o_ref.shape, o_ref.dtype), n, t)


def _block_v(batch: int, heads: int, dv: int) -> int:
    """Columns of the state per recurrence program: about one program per multiprocessor, at least 16 columns."""
    bv = dv
    while bv > 16 and batch * heads * (dv // bv) < 128:
        bv //= 2
    return bv


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Launch parameters of the kernels (prep, recurrence, output); block_v None picks `_block_v`.

    `inverse`: "wide" (the whole prep on 64x64 tiles, `_prep_wide`), or the 16-row prep with its 16x16 diagonal
    blocks by "doubling" or forward "substitution". `merge_precision` "tf32" | "ieee" | "bf16" | "mixed": the fp32
    products of the inverse on the tensor cores (TF32), in exact fp32 on the CUDA cores, on the tensor cores with
    bf16 operands (half TF32's cost), or TF32 for the diagonal blocks and bf16 for their merge.
    `fused_output`: the output computed inside the recurrence (`fused_recurrence`), two kernels instead of three.

    Defaults, measured on an H200 at 16K tokens, 16/32 heads (2026-12-01; benchmarks/RESULTS.md, "Gated DeltaNet
    kernels", the variants in benchmarks/history/RESULTS-2026-11-to-12.md):
    the wide prep with bf16 products and the fused output, 0.933 ms, vs 0.999 unfused, 1.019 / 1.081 with the merge
    only in bf16 ("mixed"), 1.101 / 1.151 with TF32, 9.6 ms in exact fp32 (64x64
    fp32 products on the CUDA cores); 8 prep warps slower than 4. The inverse's precision costs no accuracy that
    shows: it is rounded to bf16 (2^-9) before it is used, and the output / state errors vs the fp32 reference are
    3.86e-3 / 3.01e-3 at every precision (the bf16 inputs set them). The fused output saves the output kernel and
    the per-chunk states' round trip through memory (0.07 ms); its recurrence keeps at most 64 state columns per
    program (with 128 it failed the mixed-length GPU test; capped, it passes). The recurrence's block_v and warps
    come from a sweep of 18 launch configurations (H200, 2026-11-30), checked again on 2026-12-03 (H200) and
    2026-12-06 (H100): benchmarks/RESULTS.md, "Gated DeltaNet kernels"."""

    block_v: int | None = None
    num_warps: tuple[int, int, int] = (4, 4, 4)
    num_stages: tuple[int, int, int] = (2, 3, 2)
    inverse: str = "wide"
    merge_precision: str = "bf16"
    fused_output: bool = True

    def __post_init__(self):
        if self.inverse not in ("wide", "doubling", "substitution"):
            raise ValueError(f"Tuning.inverse={self.inverse!r}: expected 'wide', 'doubling' or 'substitution'")
        if self.merge_precision not in _MERGE_PRECISION:
            raise ValueError(f"Tuning.merge_precision={self.merge_precision!r}: expected one of "
                             f"{sorted(_MERGE_PRECISION)}")

    def params(self, i: int) -> plgpu.CompilerParams:
        return plgpu.CompilerParams(num_warps=self.num_warps[i], num_stages=self.num_stages[i])


def _per_chunk(d: int) -> pl.BlockSpec:
    """[B, HV, T, d] arrays, one chunk of one value head per program of a (B, HV, T/C) grid."""
    return pl.BlockSpec((None, None, CHUNK, d), lambda i, h, n: (i, h, n, 0))


def _key_chunk(dk: int, rep: int) -> pl.BlockSpec:
    """[B, T, HK, dk] q or k: the key head of value head h is h // rep."""
    return pl.BlockSpec((None, CHUNK, None, dk), lambda i, h, n: (i, n, h // rep, 0))


_GATES = pl.BlockSpec((None, None, CHUNK), lambda i, h, n: (i, h, n))


def _whole(lengths) -> pl.BlockSpec:
    return pl.BlockSpec(lengths.shape, lambda *_: (0,))


def _prep_outputs(b: int, hv: int, tp: int, dk: int, dv: int, dtype, fused: bool):
    """The prep kernels' (out_specs, out_shape): w, u, kg [B, HV, T', d] in `dtype`, cum [B, HV, T'] fp32; fused
    (for `fused_recurrence`), also the scores [B, HV, T', CHUNK] in `dtype` and q's row factors [B, HV, T'] fp32."""
    specs = [_per_chunk(dk), _per_chunk(dv), _per_chunk(dk), _GATES]
    shapes = [jax.ShapeDtypeStruct((b, hv, tp, d), dtype) for d in (dk, dv, dk)] + [
        jax.ShapeDtypeStruct((b, hv, tp), _F32)]
    if fused:
        specs += [_per_chunk(CHUNK), _GATES]
        shapes += [jax.ShapeDtypeStruct((b, hv, tp, CHUNK), dtype), jax.ShapeDtypeStruct((b, hv, tp), _F32)]
    return specs, shapes


def prepare(lengths, k, v, g, beta, q=None, *, rep: int, tuning: Tuning = Tuning(), interpret: bool = False):
    """Kernel 1. k [B, T, HK, dk], v [B, T, HV, dv] (any T: the last chunk's loads are masked); g, beta [B, HV, T']
    fp32 (T' = T rounded up to CHUNK) with padded steps zeroed. Returns w, u, kg [B, HV, T', d] in v's dtype and the
    in-chunk cumulative log-decay [B, HV, T'] fp32 (chunks past a sequence's length unwritten). With q
    [B, T, HK, dk] (for `fused_recurrence`), also the chunks' causal decayed scores A [B, HV, T', CHUNK] in v's
    dtype and q's row factors [B, HV, T'] fp32."""
    b, t, hv, dv = v.shape
    tp = g.shape[-1]
    dk = k.shape[-1]
    fused = q is not None
    values = pl.BlockSpec((None, CHUNK, None, dv), lambda i, h, n: (i, n, h, 0))
    in_specs = [_whole(lengths), _key_chunk(dk, rep), values, _GATES, _GATES]
    out_specs, out_shape = _prep_outputs(b, hv, tp, dk, dv, v.dtype, fused)
    args = [lengths, k, v, g, beta]
    if fused:
        in_specs.append(_key_chunk(dk, rep))
        args.append(q)
    return pl.pallas_call(
        functools.partial(_prep_kernel, inverse=tuning.inverse, merge_precision=tuning.merge_precision, fused=fused,
                          scale=dk**-0.5, t=t),
        grid=(b, hv, tp // CHUNK),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=tuning.params(0),
        interpret=interpret,
        name="gdn_prep",
    )(*args)


def recurrence(lengths, w, u, kg, cum, initial_state=None, *, tuning: Tuning = Tuning(), interpret: bool = False):
    """Kernel 2. Returns (states entering each chunk [B, HV, T/C, dk, dv] in u's dtype, v_new [B, HV, T, dv] in
    u's dtype, final state [B, HV, dk, dv] fp32)."""
    b, hv, tp, dk = w.shape
    dv = u.shape[3]
    nt = tp // CHUNK
    bv = min(tuning.block_v or _block_v(b, hv, dv), dv)
    has_initial = initial_state is not None

    def whole_sequence(d):
        return pl.BlockSpec((None, None, tp, d), lambda i, h, j: (i, h, 0, 0))

    values = pl.BlockSpec((None, None, tp, bv), lambda i, h, j: (i, h, 0, j))
    state_block = pl.BlockSpec((None, None, dk, bv), lambda i, h, j: (i, h, 0, j))
    in_specs = [_whole(lengths), whole_sequence(dk), values, whole_sequence(dk),
                pl.BlockSpec((None, None, tp), lambda i, h, j: (i, h, 0))]
    args = [lengths, w, u, kg, cum]
    if has_initial:
        in_specs.append(state_block)
        args.append(initial_state.astype(_F32))
    return pl.pallas_call(
        functools.partial(_recurrence_kernel, has_initial=has_initial),
        grid=(b, hv, dv // bv),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, nt, dk, bv), lambda i, h, j: (i, h, 0, 0, j)), values, state_block],
        out_shape=[jax.ShapeDtypeStruct((b, hv, nt, dk, dv), u.dtype), jax.ShapeDtypeStruct((b, hv, tp, dv), u.dtype),
                   jax.ShapeDtypeStruct((b, hv, dk, dv), _F32)],
        compiler_params=tuning.params(1),
        interpret=interpret,
        name="gdn_recurrence",
    )(*args)


def fused_recurrence(lengths, q, q_scale, scores, w, u, kg, cum, initial_state=None, out=None, *, rep: int,
                     tuning: Tuning = Tuning(), interpret: bool = False):
    """Kernels 2 and 3 in one (Tuning.fused_output): q [B, T, HK, dk] raw, q_scale / scores from `prepare(..., q)`.
    Returns (o [B, T, HV, dv] in u's dtype, zero past each sequence's length; final state [B, HV, dk, dv] fp32).
    `out`: an optional [B, T, HV, dv] buffer o is written into. T (q's) need not be a multiple of CHUNK: q and o are
    read and written with masks (their whole-sequence blocks span T', past the arrays' end, never touched)."""
    b, hv, tp, dk = w.shape
    t = q.shape[1]
    dv = u.shape[3]
    # At most 64 state columns: the one GPU failure of this kernel (2026-12-01) was the only case that had 128
    # (batch 6 x 32 heads, so _block_v kept every column), likely more live registers and shared memory than
    # Triton can place beside the output's products; every case with 32 or 64 columns passed. Unconfirmed.
    bv = min(tuning.block_v or _block_v(b, hv, dv), dv, 64)
    has_initial = initial_state is not None

    def whole_sequence(d):
        return pl.BlockSpec((None, None, tp, d), lambda i, h, j: (i, h, 0, 0))

    gates = pl.BlockSpec((None, None, tp), lambda i, h, j: (i, h, 0))
    state_block = pl.BlockSpec((None, None, dk, bv), lambda i, h, j: (i, h, 0, j))
    o_spec = pl.BlockSpec((None, tp, None, bv), lambda i, h, j: (i, 0, h, j))
    in_specs = [_whole(lengths), pl.BlockSpec((None, tp, None, dk), lambda i, h, j: (i, 0, h // rep, 0)), gates,
                whole_sequence(CHUNK), whole_sequence(dk),
                pl.BlockSpec((None, None, tp, bv), lambda i, h, j: (i, h, 0, j)), whole_sequence(dk), gates]
    args = [lengths, q, q_scale, scores, w, u, kg, cum]
    if has_initial:
        in_specs.append(state_block)
        args.append(initial_state.astype(_F32))
    if out is not None:
        in_specs.append(o_spec)
        args.append(out)
    return pl.pallas_call(
        functools.partial(_fused_kernel, has_initial=has_initial, t=t),
        grid=(b, hv, dv // bv),
        in_specs=in_specs,
        out_specs=[o_spec, state_block],
        out_shape=[jax.ShapeDtypeStruct((b, t, hv, dv), u.dtype), jax.ShapeDtypeStruct((b, hv, dk, dv), _F32)],
        input_output_aliases={len(args) - 1: 0} if out is not None else {},
        compiler_params=tuning.params(1),
        interpret=interpret,
        name="gdn_recurrence_output",
    )(*args)


def output(lengths, q, k, cum, states, v_new, out=None, *, rep: int, tuning: Tuning = Tuning(),
           interpret: bool = False):
    """Kernel 3. Returns o [B, T, HV, dv] (T: q's, any length; v_new and the states span T' = T rounded up to CHUNK)
    in v_new's dtype, zero past each sequence's length. `out`, if given, is the buffer written in place (tests fill
    it with NaN to prove every element is written)."""
    b, hv, tp, dv = v_new.shape
    t, dk = q.shape[1], q.shape[-1]
    args = [lengths, q, k, cum, states, v_new]
    spec = pl.BlockSpec((None, CHUNK, None, dv), lambda i, h, n: (i, n, h, 0))
    in_specs = [_whole(lengths), _key_chunk(dk, rep), _key_chunk(dk, rep), _GATES,
                pl.BlockSpec((None, None, None, dk, dv), lambda i, h, n: (i, h, n, 0, 0)), _per_chunk(dv)]
    if out is not None:
        args.append(out)
        in_specs.append(spec)
    return pl.pallas_call(
        functools.partial(_output_kernel, scale=dk**-0.5, t=t),
        grid=(b, hv, tp // CHUNK),
        in_specs=in_specs,
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct((b, t, hv, dv), v_new.dtype),
        input_output_aliases={len(args) - 1: 0} if out is not None else {},
        compiler_params=tuning.params(2),
        interpret=interpret,
        name="gdn_output",
    )(*args)


def _pad_gates(g, beta, lengths):
    """g, beta [B, T, HV] -> fp32 [B, HV, T'] (T' = T rounded up to CHUNK), zero past each length; lengths clipped
    to T, int32."""
    t = g.shape[1]
    pad = (-t) % CHUNK
    valid = jnp.arange(t + pad)[None, :, None] < lengths[:, None, None]
    g, beta = (jnp.where(valid, jnp.pad(x.astype(_F32), ((0, 0), (0, pad), (0, 0))), 0.0).transpose(0, 2, 1)
               for x in (g, beta))
    return g, beta, jnp.minimum(lengths.astype(jnp.int32), t)


def pad_inputs(q, k, v, g, beta, lengths):
    """Casts q, k, v to one half type (no copy when they are one already: they are not padded, the kernels mask the
    last chunk's rows past T), zeroes g and beta past each length and lays them out as [B, HV, T'], T' = T rounded
    up to CHUNK. Returns (q, k, v, g, beta, lengths clipped to T)."""
    dtype = v.dtype if v.dtype in (jnp.bfloat16, jnp.float16) else jnp.bfloat16
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    return q, k, v, *_pad_gates(g, beta, lengths)


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def chunk_gated_delta_rule_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    lengths: jax.Array,
    initial_state: jax.Array | None = None,
    out: jax.Array | None = None,
    *,
    tuning: Tuning = Tuning(),
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """q, k [B, T, HK, dk]; v [B, T, HV, dv] (HV a multiple of HK); g, beta [B, T, HV]; lengths [B] int32;
    initial_state [B, HV, dk, dv] or None; `out` an optional [B, T, HV, dv] buffer of v's half type that o is written
    into. Returns (o [B, T, HV, dv] in v's dtype (bf16 unless fp16), zero at and past each
    sequence's length, final state [B, HV, dk, dv] fp32)."""
    rep = v.shape[2] // q.shape[2]
    q, k, v, g, beta, lengths = pad_inputs(q, k, v, g, beta, lengths)
    if out is not None and (out.shape != v.shape or out.dtype != v.dtype):
        raise ValueError(f"out: expected a {v.dtype} buffer of shape {v.shape} (o's), got {out.dtype} {out.shape}")
    if tuning.fused_output:
        w, u, kg, cum, scores, q_scale = prepare(lengths, k, v, g, beta, q, rep=rep, tuning=tuning,
                                                 interpret=interpret)
        o, final = fused_recurrence(lengths, q, q_scale, scores, w, u, kg, cum, initial_state, out, rep=rep,
                                    tuning=tuning, interpret=interpret)
        return o, final
    w, u, kg, cum = prepare(lengths, k, v, g, beta, rep=rep, tuning=tuning, interpret=interpret)
    states, v_new, final = recurrence(lengths, w, u, kg, cum, initial_state, tuning=tuning, interpret=interpret)
    o = output(lengths, q, k, cum, states, v_new, out, rep=rep, tuning=tuning, interpret=interpret)
    return o, final

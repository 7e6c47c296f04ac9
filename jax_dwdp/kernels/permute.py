"""The MoE block's token permutation: each (token, slot) pair's row into expert order, and back with the top-k sum.

`dispatch_rows(x, order, inverse, k, rows)`: [rows, H] with row inverse[t*k + j] = x[t] (rows >= M*k; the rows past
M*k belong to no expert group). `combine_rows(y, inverse, weights, add=None)`: out[t] = sum_j w[t, j] * y[inverse[t*k
+ j]] (each product rounded to y's dtype, the sum in fp32), plus `add` when given.

- dispatch, two implementations (`KernelChoices.dispatch`, or `implementation=` = xla|pallas): by default the
  kernel where the computation is lowered for a CUDA GPU and XLA elsewhere (decided at lowering, as
  `kernels.routing` decides). "xla" (the CPU path and the reference): a row gather x[order // k] (rows moved as
  32-bit words, `gather_rows`); rows past M*k hold copies of x's first row. "pallas" (Pallas Triton): a *scatter*:
  one program per block of tokens and columns reads its x tile once, coalesced, and writes it to the k rows its
  pairs go to (x is read once instead of k times; each written row segment is contiguous); rows past M*k are
  written with zeros. 1.5x XLA's gather at 16K-32K tokens.
- combine: XLA everywhere, a gather of y by `inverse`, the product and the fp32 sum, plus `add`, which XLA fuses
  into one pass (faster than a Pallas kernel doing the same: benchmarks/RESULTS.md, "Variants measured slower").
Timings (H200, 35b-a3b): benchmarks/RESULTS.md, "MoE block".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_dwdp.kernels._backend import IMPLEMENTATIONS, by_platform, pow2  # noqa: F401 (IMPLEMENTATIONS: re-exported)
from jax_dwdp.kernels.choices import KernelChoices, resolve

_F32 = jnp.float32

BLOCK_TOKENS = 16  # tokens per program
BLOCK_COLUMNS = 512  # elements of a row per program (a power of two; the last block of a row is masked)
NUM_WARPS = 4
MAX_PADDING = 128  # rows past M*k a dispatch may add (the grouped matmul's row multiple is 8)


def _blocks(width: int, block_columns: int | None, block_tokens: int) -> tuple[int, int]:
    bw = block_columns or min(BLOCK_COLUMNS, pow2(width))
    for name, b in (("block_columns", bw), ("block_tokens", block_tokens)):
        if b < 1 or b & (b - 1):
            raise ValueError(f"permute: {name}={b} is not a power of two")
    return bw, -(-width // bw)


def _compiler_params(num_warps: int):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=1)


def _tile(bt: int, bw: int, tokens: int, width: int):
    """The program's block of tokens and columns: (live tokens [bt], column indices [bw], the tile's mask [bt, bw],
    the token slice, the column slice). Grid (token blocks, column blocks)."""
    from jax.experimental import pallas as pl

    i, c = pl.program_id(0), pl.program_id(1)
    token = i * bt + lax.broadcasted_iota(jnp.int32, (bt,), 0)
    col = c * bw + lax.broadcasted_iota(jnp.int32, (bw,), 0)
    live = token < tokens
    return live, col, live[:, None] & (col < width)[None, :], pl.ds(i * bt, bt), pl.ds(c * bw, bw)


# ---- dispatch: token rows into expert order ---------------------------------------------------------------------


def gather_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """x[index] for x [N, H]: rows of 2-byte elements move as 32-bit words (bit-identical). On an H200, XLA's row
    gather ran 1.31-1.57x faster that way on the MoE shapes (2026-11-30;
    benchmarks/history/RESULTS-2026-11-to-12.md)."""
    n, h = x.shape
    if x.dtype.itemsize != 2 or h % 2:
        return x[index]
    words = lax.bitcast_convert_type(x.reshape(n, h // 2, 2), jnp.uint32)
    return lax.bitcast_convert_type(words[index], x.dtype).reshape(index.shape[0], h)


def dispatch_rows_xla(x, order, inverse, *, k: int, rows: int):
    del inverse
    if x.shape[0] == 0:
        return jnp.zeros((rows, x.shape[1]), x.dtype)
    return gather_rows(x, jnp.pad(order, (0, rows - order.shape[0])) // k)


def _dispatch_kernel(x_ref, inv_ref, o_ref, *, k: int, tokens: int, pairs: int, bt: int, bw: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    width, rows = x_ref.shape[1], o_ref.shape[0]
    live, col, mask, here, cols = _tile(bt, bw, tokens, width)
    tile = plgpu.load(x_ref.at[here, cols], mask=mask, other=jnp.zeros((), x_ref.dtype))
    for j in range(k):
        # Tokens past M point past the last row: masked on the GPU, dropped by interpret mode's scatter (pointing
        # them at row 0 would write row 0 twice in one scatter there).
        dst = plgpu.load(inv_ref.at[jnp.int32(j), here], mask=live, other=rows)
        plgpu.store(o_ref.at[dst[:, None], col[None, :]], tile, mask=mask)  # rows and columns as index arrays
    pad = rows - pairs
    if pad:  # the rows past M*k (the grouped matmul's row multiple): zeros, written by the first token block
        pr = pow2(pad)

        @pl.when(pl.program_id(0) == 0)
        def _():
            r = lax.broadcasted_iota(jnp.int32, (pr,), 0)
            plgpu.store(o_ref.at[(pairs + r)[:, None], col[None, :]], jnp.zeros((pr, bw), o_ref.dtype),
                        mask=(r < pad)[:, None] & (col < width)[None, :])  # past the end when pad < pr: masked


def dispatch_rows_pallas(x, order, inverse, *, k: int, rows: int, block_tokens: int = BLOCK_TOKENS,
                         block_columns: int | None = None, num_warps: int = NUM_WARPS, interpret: bool = False):
    from jax.experimental import pallas as pl

    del order
    m, h = x.shape
    if m == 0:
        return jnp.zeros((rows, h), x.dtype)
    bw, col_blocks = _blocks(h, block_columns, block_tokens)
    bt = block_tokens
    token_blocks = -(-m // bt)
    inv = inverse.reshape(m, k).T.astype(jnp.int32)  # [k, M]: one contiguous row of destinations per slot
    kernel = functools.partial(_dispatch_kernel, k=k, tokens=m, pairs=m * k, bt=bt, bw=bw)
    whole = lambda a: pl.BlockSpec(a.shape, lambda i, c: (0, 0))  # noqa: E731 (pointers: the kernel indexes)
    return pl.pallas_call(
        kernel,
        grid=(token_blocks, col_blocks),
        in_specs=[whole(x), whole(inv)],
        out_specs=pl.BlockSpec((rows, h), lambda i, c: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((rows, h), x.dtype),
        compiler_params=None if interpret else _compiler_params(num_warps),
        interpret=interpret,
        name="moe_dispatch_rows",
    )(x, inv)


def dispatch_rows(x: jax.Array, order: jax.Array, inverse: jax.Array, k: int, rows: int, *,
                  implementation: str | None = None, kernels: KernelChoices | None = None) -> jax.Array:
    """x [M, H]; order, inverse [M*k] (`routing.expert_permutation`'s) -> [rows, H], M*k <= rows < M*k +
    MAX_PADDING: row inverse[t*k + j] holds x[t]; the rows past M*k (a grouped matmul's row multiple) hold zeros
    (Pallas) or copies of x's first row (XLA). The form: `implementation`, else `kernels.dispatch` (default: the
    process's `KernelChoices`)."""
    m, _ = x.shape
    if order.shape != (m * k,) or inverse.shape != (m * k,) or not m * k <= rows < m * k + MAX_PADDING:
        raise ValueError(f"dispatch_rows: x {x.shape}, order {order.shape}, inverse {inverse.shape}, k={k}, "
                         f"rows={rows}: want order and inverse of shape ({m * k},) and {m * k} <= rows < "
                         f"{m * k + MAX_PADDING}")
    return by_platform(functools.partial(dispatch_rows_xla, k=k, rows=rows),
                       functools.partial(dispatch_rows_pallas, k=k, rows=rows), x, order, inverse,
                       implementation=implementation, choice=resolve(kernels).dispatch, what="dispatch_rows")


# ---- combine: back to token order, the weighted top-k sum -------------------------------------------------------


def combine_rows_xla(y, inverse, weights, add=None):
    m, k = weights.shape
    out = y[inverse] * weights.reshape(-1)[:, None].astype(y.dtype)
    out = jnp.sum(out.reshape(m, k, y.shape[1]).astype(_F32), axis=1).astype(y.dtype)
    return out if add is None else out + add


def combine_rows(y: jax.Array, inverse: jax.Array, weights: jax.Array, add: jax.Array | None = None) -> jax.Array:
    """y [R, H] rows in expert order (R >= M*k); inverse [M*k]; weights [M, k] (used in y's dtype) -> [M, H] in y's
    dtype: sum_j weights[t, j] * y[inverse[t*k + j]] (+ add [M, H] of y's dtype)."""
    m, k = weights.shape
    bad_add = add is not None and (add.shape != (m, y.shape[1]) or add.dtype != y.dtype)
    if inverse.shape != (m * k,) or y.ndim != 2 or y.shape[0] < m * k or bad_add:
        raise ValueError(f"combine_rows: y {y.shape}, inverse {inverse.shape}, weights {weights.shape}, add "
                         f"{None if add is None else (add.shape, str(add.dtype))}: want y with >= {m * k} rows, "
                         f"inverse ({m * k},), add ({m}, {y.shape[1] if y.ndim == 2 else '?'}) of y's dtype {y.dtype}")
    return combine_rows_xla(y, inverse, weights, add)

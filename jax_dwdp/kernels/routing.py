"""MoE routing: softmax top-k of the router logits, and the permutation that groups (token, slot) pairs by expert.

Two implementations: Pallas where the computation is lowered for a CUDA GPU, XLA elsewhere (`KernelChoices.routing`;
`implementation=` forces one):
- "xla": `lax.top_k` of the fp32 softmax, renormalised; a stable argsort of the flattened expert ids and a scatter
  of iota for its inverse. The CPU path and the reference.
- "pallas" (GPU, Pallas Triton), two small kernels, each one pass over its input:
  `_topk_kernel`: one program per block of tokens holds its [BM, E] logits in registers and does the softmax, k
  rounds of (max, lowest index of the max, mask it out) and the renormalisation; the probabilities are computed as
  the reference computes them, so the same experts are chosen up to 1-ulp near-ties of fp32 probabilities (exact
  ties go to the lower expert id, as lax.top_k; a token with a NaN logit gets in-range ids and NaN weights).
  `_rank_kernel` (a counting sort): per block of tokens, each pair's rank among the block's earlier pairs of the
  same expert (a strictly lower-triangular matmul over the block's one-hot counts, exact: counts <= BM * k) and
  the block's expert histogram. An exclusive scan over blocks and experts (XLA, [blocks, E]) gives every pair's
  place in expert order directly: that is the inverse permutation; the order is one scatter of iota. The result
  equals the stable argsort exactly.
Timings (H200, 35b-a3b, 16K tokens): benchmarks/RESULTS.md, "MoE block".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_dwdp.kernels._backend import IMPLEMENTATIONS, by_platform, pow2  # noqa: F401 (IMPLEMENTATIONS: re-exported)
from jax_dwdp.kernels.choices import KernelChoices, resolve

_F32 = jnp.float32


def _by_platform(xla_fn, pallas_fn, *args, implementation, kernels):
    return by_platform(xla_fn, pallas_fn, *args, implementation=implementation, choice=resolve(kernels).routing,
                       what="routing")


# The kernels' tile: tokens per program from [BM, E] fp32 tiles of about BLOCK_ELEMENTS elements, and warps per
# program (read at each call, so a benchmark can patch them; `block_rows=` / `num_warps=` set them per call).
BLOCK_ELEMENTS = 8192
NUM_WARPS = 4


def _triton_params(num_warps: int | None = None):
    """Triton (not Mosaic GPU, which some jax versions default to for pallas_call), with Triton's defaults."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps or NUM_WARPS, num_stages=3)


def _block_rows(experts_padded: int, block_rows: int | None = None) -> int:
    """Tokens per program: `block_rows` if given (a power of two >= 16: the rank matmul needs 16), else [BM, E] fp32
    tiles of about BLOCK_ELEMENTS elements (16 <= BM <= 64)."""
    if block_rows is not None:
        if block_rows < 16 or block_rows & (block_rows - 1):
            raise ValueError(f"routing kernels: block_rows={block_rows} is not a power of two >= 16")
        return block_rows
    return max(16, min(64, BLOCK_ELEMENTS // experts_padded))


# ---- top-k of the softmax -------------------------------------------------------------------------------------


def topk_softmax_xla(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    probs = jax.nn.softmax(logits.astype(_F32), axis=-1)
    top_p, top_i = lax.top_k(probs, k)
    return top_i.astype(jnp.int32), top_p / jnp.sum(top_p, axis=-1, keepdims=True)


def _topk_kernel(logits_ref, ids_ref, weights_ref, *, k: int, experts: int):
    from jax.experimental.pallas import triton as plgpu  # noqa: F401 (the Triton lowering is registered by import)

    x = logits_ref[...].astype(_F32)  # [BM, EP]; padded experts hold -inf
    bm, ep = x.shape
    kp = ids_ref.shape[1]
    x = x - jnp.max(x, axis=1, keepdims=True)
    e = jnp.exp(x)
    p = e / jnp.sum(e, axis=1, keepdims=True)  # the reference's softmax, op for op
    col = lax.broadcasted_iota(jnp.int32, (bm, ep), 1)
    # A token with a NaN logit has NaN probabilities: taken as the largest (lowest ids first, as lax.top_k does),
    # so its ids stay in [0, E) and its NaN weights reach only its own output, never another token's row.
    p = jnp.where((p != p) & (col < experts), jnp.inf, p)
    slot = lax.broadcasted_iota(jnp.int32, (bm, kp), 1)
    ids = jnp.zeros((bm, kp), jnp.int32)
    weights = jnp.zeros((bm, kp), _F32)
    for j in range(k):
        best = jnp.max(p, axis=1, keepdims=True)
        idx = jnp.minimum(jnp.min(jnp.where(p == best, col, ep), axis=1, keepdims=True), experts - 1)
        ids = jnp.where(slot == j, idx, ids)
        weights = jnp.where(slot == j, best, weights)
        p = jnp.where(col == idx, -1.0, p)
    ids_ref[...] = ids
    weights_ref[...] = weights / jnp.sum(weights, axis=1, keepdims=True)


def topk_softmax_pallas(logits: jax.Array, k: int, *, interpret: bool = False, block_rows: int | None = None,
                        num_warps: int | None = None) -> tuple[jax.Array, jax.Array]:
    from jax.experimental import pallas as pl

    m, e = logits.shape
    if not 1 <= k <= e:
        raise ValueError(f"topk_softmax: top-{k} of {e} experts")
    if m == 0:
        return jnp.zeros((0, k), jnp.int32), jnp.zeros((0, k), _F32)
    ep, kp = pow2(max(e, 16)), pow2(max(k, 2))
    bm = _block_rows(ep, block_rows)
    mp = -(-m // bm) * bm
    if (mp, ep) != (m, e):  # only for odd shapes: token counts are usually a multiple of the block
        logits = jnp.pad(logits, ((0, mp - m), (0, ep - e)), constant_values=-jnp.inf)
    ids, weights = pl.pallas_call(
        functools.partial(_topk_kernel, k=k, experts=e),
        grid=(mp // bm,),
        in_specs=[pl.BlockSpec((bm, ep), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((bm, kp), lambda i: (i, 0))] * 2,
        out_shape=[jax.ShapeDtypeStruct((mp, kp), jnp.int32), jax.ShapeDtypeStruct((mp, kp), _F32)],
        compiler_params=None if interpret else _triton_params(num_warps),
        interpret=interpret,
        name="moe_topk_softmax",
    )(logits)
    return ids[:m, :k], weights[:m, :k]


def topk_softmax(logits: jax.Array, k: int, *, implementation: str | None = None,
                 kernels: KernelChoices | None = None) -> tuple[jax.Array, jax.Array]:
    """logits [M, E] -> (expert ids [M, k] int32, weights [M, k] fp32): the top k of softmax(logits) in fp32, the
    weights renormalised to sum to 1; ids in decreasing probability, ties to the lower id. The form: `implementation`,
    else `kernels.routing` (default: the process's `KernelChoices`)."""
    return _by_platform(functools.partial(topk_softmax_xla, k=k), functools.partial(topk_softmax_pallas, k=k),
                        logits, implementation=implementation, kernels=kernels)


# ---- grouping by expert ---------------------------------------------------------------------------------------


def expert_permutation_xla(expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)
    return order.astype(jnp.int32), inverse.astype(jnp.int32), group_sizes


def _rank_kernel(ids_ref, rank_ref, hist_ref, *, k: int):
    from jax.experimental.pallas import triton as plgpu

    ids = ids_ref[...]  # [BM, KP]; padded tokens hold EP (no expert)
    bm, kp = ids.shape
    ep = hist_ref.shape[-1]
    col = lax.broadcasted_iota(jnp.int32, (bm, ep), 1)
    slot = lax.broadcasted_iota(jnp.int32, (bm, kp), 1)
    columns = [jnp.sum(jnp.where(slot == j, ids, 0), axis=1, keepdims=True) for j in range(k)]  # [BM, 1] each
    counts = jnp.zeros((bm, ep), _F32)
    for c in columns:
        counts = counts + (col == c).astype(_F32)
    rows, cols = lax.broadcasted_iota(jnp.int32, (bm, bm), 0), lax.broadcasted_iota(jnp.int32, (bm, bm), 1)
    earlier = (rows > cols).astype(jnp.bfloat16)
    # Pairs of the same expert in earlier tokens of the block: exact (0/1 and small counts in bf16, fp32 sums).
    before = plgpu.dot(earlier, counts.astype(jnp.bfloat16))  # [BM, EP]
    rank = jnp.zeros((bm, kp), jnp.int32)
    for j, c in enumerate(columns):
        r = jnp.sum(jnp.where(col == c, before, 0.0), axis=1, keepdims=True).astype(jnp.int32)
        for i in range(j):  # the same expert in an earlier slot of the same token (not from top-k; kept exact)
            r = r + (columns[i] == c).astype(jnp.int32)
        rank = jnp.where(slot == j, r, rank)
    rank_ref[...] = rank
    hist_ref[...] = jnp.sum(counts, axis=0, keepdims=True).astype(jnp.int32)


def expert_permutation_pallas(expert_ids: jax.Array, num_experts: int, *, interpret: bool = False,
                              block_rows: int | None = None,
                              num_warps: int | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    from jax.experimental import pallas as pl

    m, k = expert_ids.shape
    if m == 0:
        empty = jnp.zeros((0,), jnp.int32)
        return empty, empty, jnp.zeros((num_experts,), jnp.int32)
    ep, kp = pow2(max(num_experts, 16)), pow2(max(k, 2))
    bm = _block_rows(ep, block_rows)
    mp = -(-m // bm) * bm
    ids = expert_ids.astype(jnp.int32)
    if (mp, kp) != (m, k):
        ids = jnp.pad(ids, ((0, mp - m), (0, kp - k)), constant_values=ep)
    blocks = mp // bm
    rank, hist = pl.pallas_call(
        functools.partial(_rank_kernel, k=k),
        grid=(blocks,),
        in_specs=[pl.BlockSpec((bm, kp), lambda i: (i, 0))],
        out_specs=[pl.BlockSpec((bm, kp), lambda i: (i, 0)), pl.BlockSpec((None, 1, ep), lambda i: (i, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((mp, kp), jnp.int32), jax.ShapeDtypeStruct((blocks, 1, ep), jnp.int32)],
        compiler_params=None if interpret else _triton_params(num_warps),
        interpret=interpret,
        name="moe_expert_ranks",
    )(ids)
    hist = hist[:, 0, :num_experts]  # [blocks, E]
    group_sizes = jnp.sum(hist, axis=0)
    expert_start = jnp.cumsum(group_sizes) - group_sizes
    block_start = jnp.cumsum(hist, axis=0) - hist
    base = (expert_start[None, :] + block_start).reshape(-1)  # [blocks * E]
    flat_ids = expert_ids.reshape(-1).astype(jnp.int32)
    token = jnp.arange(m * k, dtype=jnp.int32) // k
    inverse = base[(token // bm) * num_experts + flat_ids] + rank[:m, :k].reshape(-1)
    # Materialised here: otherwise XLA may fuse this index arithmetic (the scans included) into every consumer's
    # loop, and the combine recomputed it for each of its M*H outputs: 1.2 ms of a 0.83 ms MoE block at 4K tokens
    # on an H200 (2026-12-01; benchmarks/history/RESULTS-2026-11-to-12.md, "MoE block").
    inverse, group_sizes = lax.optimization_barrier((inverse, group_sizes))
    order = jnp.zeros_like(inverse).at[inverse].set(jnp.arange(m * k, dtype=jnp.int32), unique_indices=True)
    return order, inverse, group_sizes.astype(jnp.int32)


def expert_permutation(expert_ids: jax.Array, num_experts: int, *, implementation: str | None = None,
                       kernels: KernelChoices | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """expert_ids [M, k], every id in [0, E) (ids >= E: `moe.sort_by_expert`) -> (order [M*k], inverse [M*k],
    group_sizes [E]) int32: `order` lists the flattened (token, slot) pairs grouped by expert, in their original
    order within a group (a stable sort); `inverse` is its inverse (pair i sits at row inverse[i] of the grouped
    rows). The form: as `topk_softmax`'s."""
    return _by_platform(functools.partial(expert_permutation_xla, num_experts=num_experts),
                        functools.partial(expert_permutation_pallas, num_experts=num_experts), expert_ids,
                        implementation=implementation, kernels=kernels)

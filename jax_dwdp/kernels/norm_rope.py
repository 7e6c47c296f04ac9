"""Gated attention's q/k head norm and partial RoPE in one pass: XLA, and a Pallas (Triton) kernel on the GPU.

y = rope(rmsnorm(x[..., :D]) * (1 + w)) per head: the zero-centred RMSNorm over the head's D values in fp32, rounded to
x's dtype (as the model's RMSNorm module returns it), then the NeoX rotation of the first `rotary_dim` values by
(cos, sin) in fp32, rounded again. x is [B, T, H, W] with the head's D values first in its W (W = 2D for Qwen3.5's
q_proj output, whose heads interleave q and the output gate; W = D for k): the kernel reads them where they are,
so the q/gate split costs no copy.

Why a kernel: XLA makes three passes of it at 16K tokens on the H200 (the q slice converted to an fp32 copy, the norm,
the rotation's concatenate; 0.35 ms a full-attention layer, 2026-12-01, `benchmarks/probe_layer_kernels.py`),
where one pass reads q once and writes it once. The kernel splits the head into power-of-two column pieces
(the two rotary halves, then the rest) and loads each from the block: Triton has no slicing of loaded values.
`KernelChoices.norm_rope` = xla|pallas chooses; the kernel is the default where a computation is lowered for a CUDA
GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_dwdp.kernels._backend import by_platform
from jax_dwdp.kernels.choices import KernelChoices, resolve

BLOCK_T = 64
_F32 = jnp.float32


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm over the last axis: (x * rsqrt(mean(x^2) + eps)) * (1 + w) in fp32, in x's dtype."""
    x32 = x.astype(_F32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + weight.astype(_F32))).astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates the first rotary_dim dims of x [..., heads, head_dim]; cos/sin [..., rotary_dim] broadcast over heads."""
    rd = cos.shape[-1]
    x32 = x.astype(_F32)
    rot, rest = x32[..., :rd], x32[..., rd:]
    half = rd // 2
    rotated = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    out = rot * cos[..., None, :] + rotated * sin[..., None, :]
    return jnp.concatenate([out, rest], axis=-1).astype(x.dtype)


def norm_rope_xla(x, weight, cos, sin, *, eps: float, head_dim: int) -> jax.Array:
    return apply_rope(rms_norm(x[..., :head_dim], weight, eps), cos, sin)


def _pieces(head_dim: int, rotary_dim: int) -> list[tuple[int, int]] | None:
    """(offset, size) column pieces of a head: the two rotary halves, then the rest in power-of-two sizes, largest
    first; None when a piece would not be a power of two >= 16 (Triton's smallest useful block)."""
    half = rotary_dim // 2
    if rotary_dim % 2 or half < 16 or half & (half - 1):
        return None
    pieces = [(0, half), (half, half)]
    offset, rest = rotary_dim, head_dim - rotary_dim
    for bit in reversed(range(rest.bit_length())):
        size = 1 << bit
        if rest & size:
            if size < 16:
                return None
            pieces.append((offset, size))
            offset += size
    return pieces


def supported(head_dim: int, rotary_dim: int) -> bool:
    """Block shapes Triton can take: a power-of-two head and rotary width, and pieces _pieces can cut."""
    pow2 = all(n > 0 and n & (n - 1) == 0 for n in (head_dim, rotary_dim))
    return pow2 and rotary_dim <= head_dim and _pieces(head_dim, rotary_dim) is not None


def _kernel(x_ref, w_ref, cos_ref, sin_ref, *refs, t: int, eps: float, pieces, head_dim: int):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    o_ref = refs[-1]  # (refs[0] is the aliased output buffer when one is given)
    n = pl.program_id(1)
    bt = x_ref.shape[0]
    row = n * bt + lax.broadcasted_iota(jnp.int32, (bt, 1), 0)
    valid = row < t
    zero = jnp.zeros((), x_ref.dtype)
    xs = [plgpu.load(x_ref.at[:, pl.ds(off, size)], mask=valid, other=zero).astype(_F32) for off, size in pieces]
    ss = sum(jnp.sum(p * p, axis=1, keepdims=True) for p in xs)
    inv = lax.rsqrt(ss / head_dim + eps)
    # Rounded to x's dtype between the norm and the rotation, as the model's RMSNorm module returns it.
    ns = [(p * inv * (1.0 + w_ref[pl.ds(off, size)].astype(_F32)[None, :])).astype(o_ref.dtype).astype(_F32)
          for p, (off, size) in zip(xs, pieces)]
    half = pieces[0][1]
    c = plgpu.load(cos_ref.at[:, pl.ds(0, half)], mask=valid, other=0.0)
    s = plgpu.load(sin_ref.at[:, pl.ds(0, half)], mask=valid, other=0.0)
    ns[0], ns[1] = ns[0] * c - ns[1] * s, ns[1] * c + ns[0] * s
    for value, (off, size) in zip(ns, pieces):
        plgpu.store(o_ref.at[:, pl.ds(off, size)], value.astype(o_ref.dtype), mask=valid)


def norm_rope_pallas(x, weight, cos, sin, *, eps: float, head_dim: int, out: jax.Array | None = None,
                     interpret: bool = False) -> jax.Array:
    """x [B, T, H, W] (W a multiple of head_dim: the head's values are its first head_dim); weight [head_dim]; cos,
    sin [B, T, rotary_dim] fp32 in the NeoX layout, each half the same (rope_cos_sin's): the kernel reads the first.
    Returns [B, T, H, head_dim] in x's dtype. `out` (tests): a buffer of the output's shape the kernel writes into
    (a poisoned one shows unwritten elements)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    b, t, h, w = x.shape
    rotary_dim = cos.shape[-1]
    pieces = _pieces(head_dim, rotary_dim)
    if not supported(head_dim, rotary_dim):
        raise ValueError(f"norm_rope_pallas: head_dim {head_dim} with rotary_dim {rotary_dim}: needs both powers of "
                         "two, rotary halves and the rest in power-of-two pieces >= 16")
    if w % head_dim:
        raise ValueError(f"norm_rope_pallas: x has {w} columns per head, not a multiple of head_dim {head_dim}")
    cos, sin = cos.astype(_F32), sin.astype(_F32)
    rows = t
    if interpret:  # the interpreter clamps a block past T instead of masking it: pad to whole blocks
        rows = pl.cdiv(t, BLOCK_T) * BLOCK_T
        pad = ((0, 0), (0, rows - t))
        x = jnp.pad(x, pad + ((0, 0), (0, 0)))
        cos, sin = (jnp.pad(a, pad + ((0, 0),)) for a in (cos, sin))
        out = None if out is None else jnp.pad(out, pad + ((0, 0), (0, 0)), constant_values=jnp.nan)
    out_spec = pl.BlockSpec((None, BLOCK_T, None, head_dim), lambda i, n, j: (i, n, j, 0))
    angles = pl.BlockSpec((None, BLOCK_T, rotary_dim), lambda i, n, j: (i, n, 0))
    y = pl.pallas_call(
        functools.partial(_kernel, t=t, eps=eps, pieces=tuple(pieces), head_dim=head_dim),
        grid=(b, pl.cdiv(rows, BLOCK_T), h),
        in_specs=[pl.BlockSpec((None, BLOCK_T, None, head_dim), lambda i, n, j: (i, n, j, 0)),
                  pl.BlockSpec((head_dim,), lambda i, n, j: (0,)), angles, angles]
        + ([] if out is None else [out_spec]),
        out_specs=out_spec,
        input_output_aliases={} if out is None else {4: 0},
        out_shape=jax.ShapeDtypeStruct((b, rows, h, head_dim), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="attention_norm_rope",
    )(x, weight, cos, sin, *([] if out is None else [out]))
    return y[:, :t] if rows != t else y


def norm_rope(x, weight, cos, sin, *, eps: float, head_dim: int, implementation: str | None = None,
              kernels: KernelChoices | None = None) -> jax.Array:
    """The q (or k) of gated attention: rope(rmsnorm(x[..., :head_dim])) per head, see the module doc. x [B, T, H, W];
    weight [head_dim]; cos, sin [B, T, rotary_dim]. By default (`kernels.norm_rope`, default the process's
    `KernelChoices`) the kernel where the computation is lowered for a CUDA GPU (shapes it supports, 16-bit x), XLA
    elsewhere; `implementation` forces one."""
    xla = functools.partial(norm_rope_xla, eps=eps, head_dim=head_dim)
    if x.dtype not in (jnp.bfloat16, jnp.float16) or not supported(head_dim, cos.shape[-1]) or x.shape[-1] % head_dim:
        return xla(x, weight, cos, sin)
    pallas = functools.partial(norm_rope_pallas, eps=eps, head_dim=head_dim)
    return by_platform(xla, pallas, x, weight, cos, sin, implementation=implementation,
                       choice=resolve(kernels).norm_rope, what="norm_rope")

"""Mamba-2's state-space recurrence (SSD): the chunked scan for prefill and the single step for decode, pure JAX.

Per head h (in group g = h // (H / G)), with a scalar decay per step, the state S [P, N] evolves as
    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T,     y_t = S_t C_t
(x_t [P], B_t, C_t [N] of the head's group). The chunked form computes the same in blocks of L tokens: inside a
block the outputs are a masked (C B^T) * decay matrix applied to dt * x, like causal attention; across blocks only
the states at block ends travel, through a scan over blocks. All of it runs in fp32 whatever the inputs' dtype (the
state is fp32 in the cache too). Steps with dt = 0 leave the state as it is and add nothing: that is how a
right-padded batch keeps each sequence's state at its own length.

Two implementations of the chunked scan, chosen by `KernelChoices.ssd` (`default_implementation`) or
`implementation=`:
- "xla" (`ssd_chunked_xla`, below): fp32 XLA, the numerical reference and the CPU path; the default everywhere
  until the kernel is measured on a GPU.
- "pallas" (`ssd_pallas.py`): the same chunked form as Pallas Triton kernels with bf16 / fp16 tensor-core operands
  and an fp32 state, for bf16 / fp16 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dwdp.kernels._backend import IMPLEMENTATIONS, by_platform, check
from jax_dwdp.kernels.choices import KernelChoices, resolve

_F32 = jnp.float32
_HI = jax.lax.Precision.HIGHEST


def default_implementation(dtype, chunk_size: int, head_dim: int, state_size: int,
                           kernels: KernelChoices | None = None) -> str:
    """The form without `implementation=`: `kernels.ssd` (default the process's `KernelChoices`) for bf16 / fp16
    inputs whose chunk, head and state sizes the kernel takes (powers of two >= 16), else "xla" (fp32 inputs are
    the reference precision). "pallas" here means the kernel where the program is lowered for a CUDA GPU and XLA
    elsewhere (`ssd_chunked(..., implementation="pallas")` runs the kernel wherever it is lowered)."""
    if resolve(kernels).ssd == "xla" or dtype not in (jnp.bfloat16, jnp.float16):
        return "xla"
    from jax_dwdp.kernels import ssd_pallas

    return "pallas" if ssd_pallas.supported(chunk_size, head_dim, state_size) else "xla"


def ssd_chunked(
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    *,
    chunk_size: int,
    initial_state: jax.Array | None = None,
    implementation: str | None = None,
    kernels: KernelChoices | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The SSD scan over a sequence, in blocks of `chunk_size` tokens.

    x [B, T, H, P]; dt [B, T, H] (already discretised: softplus, limits, zeros on padding); a [H] (negative);
    b, c [B, T, G, N] with H % G == 0; initial_state [B, H, P, N] or None (zeros). The form: `implementation`,
    else `default_implementation`.
    Returns y [B, T, H, P] fp32 (without the D skip) and the final state [B, H, P, N] fp32.
    """
    bsz, t, h, p = x.shape
    g, n = b.shape[-2:]
    if (dt.shape != (bsz, t, h) or a.shape != (h,) or b.shape[:2] != (bsz, t) or c.shape != b.shape or b.ndim != 4
            or h % g):
        raise ValueError(f"ssd_chunked: x {x.shape}, dt {dt.shape}, a {a.shape}, b {b.shape}, c {c.shape} do not fit "
                         "x [B, T, H, P], dt [B, T, H], a [H], b, c [B, T, G, N] (H a multiple of G)")
    if initial_state is not None and initial_state.shape != (bsz, h, p, n):
        raise ValueError(f"ssd_chunked: initial_state {initial_state.shape}, expected {(bsz, h, p, n)}")
    impl = implementation or default_implementation(x.dtype, chunk_size, p, n, kernels)
    check(impl, IMPLEMENTATIONS, "ssd_chunked: implementation")

    def xla(x, dt, a, b, c, initial_state):
        return ssd_chunked_xla(x, dt, a, b, c, chunk_size=chunk_size, initial_state=initial_state)

    args = (x, dt, a, b, c, initial_state)
    if impl == "xla":
        return xla(*args)
    from jax_dwdp.kernels import ssd_pallas

    def pallas(x, dt, a, b, c, initial_state):
        return ssd_pallas.ssd_chunked_pallas(x, dt, a, b, c, initial_state, chunk_size=chunk_size)

    # asked for by name (tests, benchmarks): the kernel wherever it is lowered; from the choices: the kernel where
    # lowered for a CUDA GPU, XLA elsewhere (a bf16 model placed on the CPU of a GPU host)
    return by_platform(xla, pallas, *args, implementation=implementation, choice=impl, what="ssd_chunked")


def ssd_chunked_xla(
    x: jax.Array,
    dt: jax.Array,
    a: jax.Array,
    b: jax.Array,
    c: jax.Array,
    *,
    chunk_size: int,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`ssd_chunked` in fp32 XLA (the reference): the same arguments and results."""
    bsz, t, h, p = x.shape
    g, n = b.shape[-2:]
    r = h // g
    pad = (-t) % chunk_size
    nc = (t + pad) // chunk_size

    def blocks(z):  # [B, T, ...] -> [B, nc, L, ...], zero-padded (dt = 0 there: no effect on the state)
        z = jnp.pad(z.astype(_F32), [(0, 0), (0, pad)] + [(0, 0)] * (z.ndim - 2))
        return z.reshape(bsz, nc, chunk_size, *z.shape[2:])

    xs = blocks(x).reshape(bsz, nc, chunk_size, g, r, p)
    dts = blocks(dt).reshape(bsz, nc, chunk_size, g, r)
    bs, cs = blocks(b), blocks(c)  # [B, nc, L, G, N]
    decay = jnp.cumsum(dts * a.astype(_F32).reshape(g, r), axis=2)  # [B, nc, L, G, R]: log decay since block start
    # Inside a block: y_i = sum_{j <= i} (C_i . B_j) exp(decay_i - decay_j) dt_j x_j. The exponent is masked before
    # exp (j > i would be positive and could overflow).
    causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    diff = decay[:, :, :, None] - decay[:, :, None, :]  # [B, nc, i, j, G, R]
    weights = jnp.exp(jnp.where(causal[None, None, :, :, None, None], diff, -jnp.inf))
    scores = jnp.einsum("bcign,bcjgn->bcijg", cs, bs, precision=_HI)
    dtx = dts[..., None] * xs  # [B, nc, L, G, R, P]
    y_diag = jnp.einsum("bcijg,bcijgr,bcjgrp->bcigrp", scores, weights, dtx, precision=_HI)
    # Each block's own contribution to the state at its end, then the states carried across blocks.
    to_end = jnp.exp(decay[:, :, -1:] - decay)  # [B, nc, L, G, R]
    block_states = jnp.einsum("bcjgr,bcjgrp,bcjgn->bcgrpn", to_end, dtx, bs, precision=_HI)
    block_decay = jnp.exp(decay[:, :, -1])  # [B, nc, G, R]
    state0 = (jnp.zeros((bsz, g, r, p, n), _F32) if initial_state is None
              else initial_state.astype(_F32).reshape(bsz, g, r, p, n))

    def carry(state, inputs):
        own, d = inputs
        return d[..., None, None] * state + own, state  # (state at this block's end, state entering it)

    final, entering = jax.lax.scan(carry, state0, (jnp.moveaxis(block_states, 1, 0), jnp.moveaxis(block_decay, 1, 0)))
    entering = jnp.moveaxis(entering, 0, 1)  # [B, nc, G, R, P, N]
    y_off = jnp.einsum("bcign,bcgrpn,bcigr->bcigrp", cs, entering, jnp.exp(decay), precision=_HI)
    y = (y_diag + y_off).reshape(bsz, nc * chunk_size, h, p)[:, :t]
    return y, final.reshape(bsz, h, p, n)


def ssd_step(
    state: jax.Array, x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token per sequence: state [B, H, P, N] fp32; x [B, H, P]; dt [B, H]; a [H]; b, c [B, G, N].
    Returns y [B, H, P] fp32 (without the D skip) and the new state."""
    bsz, h, p = x.shape
    g, n = b.shape[-2:]
    r = h // g
    dt32 = dt.astype(_F32).reshape(bsz, g, r)
    s = state.astype(_F32).reshape(bsz, g, r, p, n)
    x32 = x.astype(_F32).reshape(bsz, g, r, p)
    s = (jnp.exp(dt32 * a.astype(_F32).reshape(g, r))[..., None, None] * s
         + jnp.einsum("bgr,bgrp,bgn->bgrpn", dt32, x32, b.astype(_F32), precision=_HI))
    y = jnp.einsum("bgrpn,bgn->bgrp", s, c.astype(_F32), precision=_HI)
    return y.reshape(bsz, h, p), s.reshape(bsz, h, p, n)

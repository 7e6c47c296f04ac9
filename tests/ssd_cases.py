"""Inputs of Mamba-2's SSD scan as the model makes them, and its float64 references (shared by the CPU and GPU tests
and benchmarks/bench_ssd.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from tests.gdn_cases import rel_err  # noqa: F401 (the SSD tests' too)


# bf16 inputs (compared with float64 on their bf16 values): the kernels round the chunk's C B^T, its decay-weighted
# scores, the state where it meets C and B weighted by its decay to bf16 (unit roundoff 2^-9 = 2e-3) before the
# tensor-core products, accumulating in fp32: a few roundings in a row give a few 1e-3 (measured 2-4e-3), so 1e-2
# leaves room without hiding a wrong term (a missing decay, chunk or state gives errors of order 1).
BOUND = 1e-2
# fp32 inputs: exact fp32 products, so only fp32 rounding over a few hundred terms (measured below 1e-6).
BOUND_FP32 = 1e-5


def ssd_inputs(rng, b, t, h, p, g, n, *, initial: bool, dtype=jnp.bfloat16, lengths=None):
    """x [B, T, H, P], B, C [B, T, G, N] in `dtype` (SiLU outputs of the conv, as the mixer feeds them); dt [B, T, H]
    fp32 as the mixer discretises it (softplus of a projection plus a bias drawn like transformers' dt_bias, clamped
    at time_step_min 1e-3), zero at and past each of `lengths` (default: T); a [H] = -exp(A_log), A_log drawn as the
    checkpoint's initialisation (A in [1, 16]); an optional random fp32 initial state [B, H, P, N]."""
    silu = lambda v: v / (1.0 + np.exp(-v))  # noqa: E731
    x = jnp.asarray(silu(rng.standard_normal((b, t, h, p)) * 2.0), dtype)
    bm = jnp.asarray(silu(rng.standard_normal((b, t, g, n)) * 2.0), dtype)
    cm = jnp.asarray(silu(rng.standard_normal((b, t, g, n)) * 2.0), dtype)
    step = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), h))
    bias = step + np.log(-np.expm1(-step))
    dt = np.maximum(np.logaddexp(0.0, rng.standard_normal((b, t, h)) + bias), 1e-3)
    if lengths is not None:
        dt = np.where(np.arange(t)[None, :, None] < np.asarray(lengths)[:, None, None], dt, 0.0)
    a = -rng.uniform(1.0, 16.0, h)
    h0 = jnp.asarray(rng.standard_normal((b, h, p, n)) * 0.5, jnp.float32) if initial else None
    return x, jnp.asarray(dt, jnp.float32), jnp.asarray(a, jnp.float32), bm, cm, h0


def f64(v) -> np.ndarray:
    return np.asarray(v).astype(np.float64)


def ssd_float64(x, dt, a, b, c, state):
    """The SSD recurrence one step at a time in float64 numpy: x [B,T,H,P], dt [B,T,H], a [H], b, c [B,T,G,N],
    state [B,H,P,N] -> y [B,T,H,P] (without D) and the final state."""
    heads_per_group = x.shape[2] // b.shape[2]
    ys = []
    for t in range(x.shape[1]):
        bt, ct = (np.repeat(m[:, t], heads_per_group, axis=1) for m in (b, c))  # [B, H, N]
        state = (np.exp(dt[:, t] * a)[..., None, None] * state
                 + (dt[:, t, :, None] * x[:, t])[..., None] * bt[:, :, None, :])
        ys.append(np.einsum("bhpn,bhn->bhp", state, ct))
    return np.stack(ys, 1), state


def ssd_float64_chunked(x, dt, a, b, c, state, chunk: int = 64):
    """The same recurrence in float64 by chunks (the chunked form's algebra, exact up to float64 rounding), for
    lengths where the step-by-step loop is too slow: the GPU tests' reference at 4,096 tokens and 30B-A3B heads.
    tests/test_ssd_kernel.py checks it against `ssd_float64`."""
    bsz, t, h, p = x.shape
    g, n = b.shape[-2:]
    r = h // g
    y = np.zeros((bsz, t, h, p))
    state = np.array(state, np.float64, copy=True).reshape(bsz, g, r, p, n)
    for start in range(0, t, chunk):
        sl = slice(start, min(start + chunk, t))
        xs = x[:, sl].reshape(bsz, -1, g, r, p)
        dts = dt[:, sl].reshape(bsz, -1, g, r)
        bs, cs = b[:, sl], c[:, sl]  # [B, L, G, N]
        cum = np.cumsum(dts * a.reshape(g, r), axis=1)  # [B, L, G, R]
        diff = cum[:, :, None] - cum[:, None, :]  # [B, i, j, G, R]
        causal = np.tril(np.ones((diff.shape[1],) * 2, bool))[None, :, :, None, None]
        weights = np.where(causal, np.exp(np.where(causal, diff, 0.0)), 0.0) * dts[:, None]  # times dt_j
        scores = np.einsum("bign,bjgn->bijg", cs, bs)
        own = np.einsum("bijg,bijgr,bjgrp->bigrp", scores, weights, xs, optimize=True)
        entering = np.einsum("bign,bgrpn->bigrp", cs, state, optimize=True) * np.exp(cum)[..., None]
        y[:, sl] = (own + entering).reshape(bsz, -1, h, p)
        to_end = np.exp(cum[:, -1:] - cum) * dts  # [B, L, G, R]
        state = (np.exp(cum[:, -1])[..., None, None] * state
                 + np.einsum("bjgr,bjgrp,bjgn->bgrpn", to_end, xs, bs, optimize=True))
    return y, state.reshape(bsz, h, p, n)


def reference_per_sequence(x, dt, a, b, c, h0, lengths, *, chunked: bool = False):
    """Each sequence of a right-padded batch alone, cut at its length, in float64 from the inputs as given (bf16
    inputs as their bf16 values): [(y [L, H, P], final state [H, P, N]), ...]."""
    fn = ssd_float64_chunked if chunked else ssd_float64
    out = []
    for i, length in enumerate(np.asarray(lengths)):
        length = int(length)
        state = f64(h0[i]) if h0 is not None else np.zeros((x.shape[2], x.shape[3], b.shape[3]))
        y, s = fn(*(f64(v[i : i + 1, :length]) for v in (x, dt)), f64(a),
                  *(f64(v[i : i + 1, :length]) for v in (b, c)), state[None])
        out.append((y[0], s[0]))
    return out


def check_against_reference(y, state, ref, lengths, label: str, bound: float) -> float:
    """Asserts every element of y finite (a NaN-poisoned buffer must be written everywhere, padding included), each
    sequence's y up to its length and its final state within `bound` of the reference; prints the errors. Returns
    the worst."""
    y, state = np.asarray(jnp.asarray(y, jnp.float32)), np.asarray(state)
    assert np.isfinite(y).all() and np.isfinite(state).all(), f"{label}: non-finite output or state"
    worst = 0.0
    for i, ((ry, rs), length) in enumerate(zip(ref, np.asarray(lengths))):
        e_y, e_s = rel_err(y[i, :length], ry), rel_err(state[i], rs)
        print(f"{label} seq {i} len {length}: y {e_y:.2e} state {e_s:.2e}")
        assert e_y <= bound and e_s <= bound, f"{label} seq {i}: y {e_y:.2e} state {e_s:.2e} > {bound}"
        worst = max(worst, e_y, e_s)
    return worst


def poisoned(shape, dtype=jnp.float32):
    """A NaN-filled output buffer."""
    return jnp.full(shape, jnp.nan, dtype)

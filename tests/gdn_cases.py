"""Random inputs for the gated delta rule and its per-sequence fp32 reference (shared by the CPU and GPU tests)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_dwdp.kernels.gated_delta_rule import chunk_gated_delta_rule


def gdn_inputs(rng, b, t, hk, hv, dk, dv, *, initial: bool, dtype=jnp.bfloat16):
    """q, k [B, T, HK, dk], v [B, T, HV, dv] in `dtype`; gates as the model makes them (g = -exp(A) softplus(.),
    beta = sigmoid(.)); optional random initial state. Values are drawn fresh from `rng`."""
    q = jnp.asarray(rng.standard_normal((b, t, hk, dk)), dtype)
    k = jnp.asarray(rng.standard_normal((b, t, hk, dk)), dtype)
    v = jnp.asarray(rng.standard_normal((b, t, hv, dv)), dtype)
    a_log = np.log(rng.uniform(1.0, 16.0, hv))
    g = -np.exp(a_log) * np.logaddexp(0.0, rng.standard_normal((b, t, hv)) - 4.0)
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((b, t, hv))))
    h0 = jnp.asarray(rng.standard_normal((b, hv, dk, dv)) * 0.5, jnp.float32) if initial else None
    return q, k, v, jnp.asarray(g, jnp.float32), jnp.asarray(beta, jnp.float32), h0


def reference_per_sequence(q, k, v, g, beta, lengths, h0, *, batched: bool = False):
    """The fp32 XLA reference for each sequence, cut at its length: [(o [L, HV, dv], state), ...]. Each sequence
    runs alone, or (batched) the right-padded batch runs once with its lengths, which the CPU tests prove equal to
    running alone (test_reference_batch_equals_sequences_alone): one compilation instead of one per length."""
    lengths = np.asarray(lengths)
    if batched:
        args = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
        o, s = chunk_gated_delta_rule(*args, lengths=jnp.asarray(lengths), initial_state=h0, implementation="xla")
        o, s = np.asarray(o), np.asarray(s)
        return [(o[i, : int(n)], s[i]) for i, n in enumerate(lengths)]
    out = []
    for i, n in enumerate(lengths):
        n = int(n)
        args = [jnp.asarray(x[i : i + 1, :n], jnp.float32) for x in (q, k, v, g, beta)]
        o, s = chunk_gated_delta_rule(*args, initial_state=None if h0 is None else h0[i : i + 1],
                                      implementation="xla")
        out.append((np.asarray(o[0]), np.asarray(s[0])))
    return out


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check_against_reference(o, state, ref, lengths, label: str, bound: float) -> float:
    """Asserts every sequence's output and final state within `bound` of the reference, exact zeros past each
    length, and nothing non-finite; prints the errors. Returns the worst error."""
    o, state = np.asarray(jnp.asarray(o, jnp.float32)), np.asarray(state)
    assert np.isfinite(o).all() and np.isfinite(state).all(), f"{label}: non-finite output or state"
    worst = 0.0
    for i, ((ro, rs), n) in enumerate(zip(ref, np.asarray(lengths))):
        e_o, e_s = rel_err(o[i, :n], ro), rel_err(state[i], rs)
        print(f"{label} seq {i} len {n}: output {e_o:.2e} state {e_s:.2e}")
        assert e_o <= bound and e_s <= bound, f"{label} seq {i}: output {e_o:.2e} state {e_s:.2e} > {bound}"
        assert not np.any(o[i, n:]), f"{label} seq {i}: nonzero output past its length {n}"
        worst = max(worst, e_o, e_s)
    return worst


def poisoned(b, t, hv, dv, dtype=jnp.bfloat16):
    """A NaN-filled output buffer [b, t, hv, dv]."""
    return jnp.full((b, t, hv, dv), jnp.nan, dtype)

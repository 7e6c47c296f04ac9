"""The gated delta rule of Gated DeltaNet: chunked form for prefill, step form for decode.

Per value head, with state S [dk, dv] (zero, or the state a previous prefill left):
    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
q and k are l2-normalised over the head dim and q is scaled by dk^-0.5 here (as the reference does). Key heads
are shared by groups of value heads (value head h reads key head h // (HV / HK)).

Two implementations of the prefill form, chosen by `KernelChoices.gdn` (`default_implementation`) or
`implementation=`:
- "xla" (`chunk_gated_delta_rule_xla`, below): the fp32 reference and the CPU path. T is split into chunks of
  C = 64 (padded with zeros to a multiple of C; padded steps have g = beta = 0, so they leave the state unchanged).
  Inside a chunk the C delta updates collapse into a unit lower-triangular solve (the UT/WY transform); only the
  [dk, dv] state crosses chunk boundaries, so the sequential part is a scan over T/C steps of two small matmuls,
  and the outputs are computed for all chunks at once afterwards.
- "pallas" (`gdn_pallas.py`): the same chunked form as three Pallas Triton kernels with bf16 tensor-core operands
  and an fp32 state; the GPU default for bf16/fp16 inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dwdp.kernels._backend import IMPLEMENTATIONS, by_platform, check
from jax_dwdp.kernels.choices import KernelChoices, resolve

_HI = jax.lax.Precision.HIGHEST  # fp32 state math: never let the GPU drop these matmuls to TF32.


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def default_implementation(dtype, dk: int, dv: int, kernels: KernelChoices | None = None) -> str:
    """The form without `implementation=`: `kernels.gdn` (default the process's `KernelChoices`: "pallas" on a GPU
    host, "xla" elsewhere) for bf16/fp16 inputs with power-of-two head dims >= 16, else "xla" (fp32 inputs are the
    reference precision). "pallas" here means the kernel where the program is lowered for a CUDA GPU and XLA
    elsewhere (`chunk_gated_delta_rule(..., implementation="pallas")` runs the kernel wherever it is lowered)."""
    if resolve(kernels).gdn == "xla" or dtype not in (jnp.bfloat16, jnp.float16):
        return "xla"
    from jax_dwdp.kernels import gdn_pallas

    return "pallas" if gdn_pallas.supported(dk, dv) else "xla"


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    lengths: jax.Array | None = None,
    initial_state: jax.Array | None = None,
    implementation: str | None = None,
    kernels: KernelChoices | None = None,
) -> tuple[jax.Array, jax.Array]:
    """q, k: [B, T, HK, dk]; v: [B, T, HV, dv] with HV a multiple of HK; g (log decay, <= 0), beta: [B, T, HV];
    lengths [B] (right-padded batch; default T): steps at or past a sequence's length leave its state unchanged;
    initial_state [B, HV, dk, dv] (default zero). The form: `implementation`, else `default_implementation`.

    Returns (o [B, T, HV, dv] in v's dtype, final state [B, HV, dk, dv] fp32). o past a sequence's length is
    unspecified (finite).
    """
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != (b, t) or hv % hk or g.shape != (b, t, hv) or beta.shape != g.shape:
        raise ValueError(
            f"chunk_gated_delta_rule: q {q.shape}, k {k.shape}, v {v.shape}, g {g.shape}, beta {beta.shape} do not "
            "fit q, k [B, T, HK, dk], v [B, T, HV, dv] (HV a multiple of HK), g, beta [B, T, HV]"
        )
    if initial_state is not None and initial_state.shape != (b, hv, dk, dv):
        raise ValueError(f"chunk_gated_delta_rule: initial_state {initial_state.shape}, expected {(b, hv, dk, dv)}")
    if lengths is None:
        lengths = jnp.full((b,), t, jnp.int32)
    impl = implementation or default_implementation(v.dtype, dk, dv, kernels)
    check(impl, IMPLEMENTATIONS, "chunk_gated_delta_rule: implementation")

    def xla(q, k, v, g, beta, lengths, initial_state):
        valid = jnp.arange(t)[None, :, None] < lengths[:, None, None]
        g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)
        rep = hv // hk
        q, k = jnp.repeat(q, rep, axis=2), jnp.repeat(k, rep, axis=2)
        o, state = chunk_gated_delta_rule_xla(q, k, v, g, beta, initial_state=initial_state)
        return o.astype(v.dtype), state.astype(jnp.float32)

    args = (q, k, v, g, beta, lengths, initial_state)
    if impl == "xla":
        return xla(*args)
    from jax_dwdp.kernels import gdn_pallas

    if not gdn_pallas.supported(dk, dv):
        raise ValueError(f"chunk_gated_delta_rule: the pallas kernel needs power-of-two dk, dv >= 16, got {dk}, {dv}")
    # asked for by name (tests, benchmarks): the kernel wherever it is lowered; from the choices: the kernel where
    # lowered for a CUDA GPU, XLA elsewhere (a bf16 model placed on the CPU of a GPU host)
    return by_platform(xla, gdn_pallas.chunk_gated_delta_rule_pallas, *args, implementation=implementation,
                       choice=impl, what="chunk_gated_delta_rule")


@jax.jit  # one program per shape when the chunk runs eagerly (tests, notebooks): 7.6 s vs 16.0 s op by op, CPU
def unit_lower_inverse(lower: jax.Array) -> jax.Array:
    """(I + lower)^-1 for strictly lower-triangular `lower` [..., C, C], C a power of two: by doubling the
    diagonal blocks, [[A, 0], [B, D]]^-1 = [[A^-1, 0], [-D^-1 B A^-1, D^-1]], log2(C) levels of batched matmuls
    (the stability of forward substitution).

    Not `lax.linalg.triangular_solve`: on the CPU it is LAPACK's trsm, which splits its batch over XLA's intra-op
    pool and blocks a pool thread until the pieces finish. That pool has max(cores, host devices) threads, so
    when every host device of a mesh runs such a program at once (DWDP or DEP over all the host devices, or
    pipeline stages side by side) every thread waits for pieces that no thread is left to run, forever.
    Matmuls never wait on the pool. Jitted: inside a traced program it is inlined; called eagerly (as the chunk
    is in tests and notebooks) its 6 levels would otherwise be about 60 separately compiled operations."""
    c = lower.shape[-1]
    if c & (c - 1):
        raise ValueError(f"unit_lower_inverse: the size {c} is not a power of two")
    batch = lower.shape[:-2]
    inv = jnp.ones((*batch, c, 1, 1), lower.dtype)  # the inverses of the 1 x 1 diagonal blocks
    size = 1
    while size < c:
        n = c // (2 * size)
        # The 2s x 2s diagonal blocks' lower-left s x s quarters: [..., n, s, s].
        blocks = lower.reshape(*batch, n, 2 * size, n, 2 * size)
        blocks = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)
        b = blocks[..., size:, :size]
        a_inv, d_inv = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        low = -jnp.einsum("...ij,...jk,...kl->...il", d_inv, b, a_inv, precision=_HI)
        top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
        inv = jnp.concatenate([top, jnp.concatenate([low, d_inv], axis=-1)], axis=-2)
        size *= 2
    return inv.reshape(*batch, c, c)


def chunk_gated_delta_rule_xla(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    chunk_size: int = 64,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """q, k: [B, T, H, dk] (already repeated to the value heads); v: [B, T, H, dv]; g, beta: [B, T, H].

    Returns (o [B, T, H, dv] fp32, final state [B, H, dk, dv] fp32).
    """
    b, t, h, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    f32 = jnp.float32
    q = l2_normalize(q.astype(f32)) * (dk**-0.5)
    k = l2_normalize(k.astype(f32))
    v, g, beta = v.astype(f32), g.astype(f32), beta.astype(f32)

    pad = (-t) % c
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, pad), (0, 0))) for x in (g, beta))
    n = (t + pad) // c

    # [B, T, H, d] -> [B, H, N, C, d]
    def chunks(x):
        return x.reshape(b, n, c, h, -1).transpose(0, 3, 1, 2, 4)

    q, k, v = chunks(q), chunks(k), chunks(v)
    g, beta = chunks(g[..., None])[..., 0], chunks(beta[..., None])[..., 0]

    cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C], log-decay from chunk start to each position
    causal = jnp.tril(jnp.ones((c, c), dtype=bool))
    # exp(cum_i - cum_j) for j <= i; masked before exp so the upper triangle cannot overflow.
    pair_decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))

    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    ut = jnp.einsum("bhnid,bhnjd->bhnij", k_beta, k, precision=_HI) * pair_decay
    # Unit lower-triangular system I + strict_lower(ut).
    inverse = unit_lower_inverse(jnp.where(jnp.tril(jnp.ones((c, c), dtype=bool), -1), ut, 0.0))
    rhs = jnp.concatenate([v_beta, k_beta * jnp.exp(cum)[..., None]], axis=-1)
    solved = jnp.einsum("bhnij,bhnjd->bhnid", inverse, rhs, precision=_HI)
    u, w = solved[..., :dv], solved[..., dv:]  # new values; decayed keys that read the old state

    intra = jnp.einsum("bhnid,bhnjd->bhnij", q, k, precision=_HI) * pair_decay
    q_decayed = q * jnp.exp(cum)[..., None]
    k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])  # [B, H, N]

    state0 = jnp.zeros((b, h, dk, dv), f32) if initial_state is None else initial_state.astype(f32)

    def step(state, xs):
        u_i, w_i, k_i, decay_i = xs
        v_new = u_i - jnp.einsum("bhcd,bhde->bhce", w_i, state, precision=_HI)
        new_state = state * decay_i[..., None, None] + jnp.einsum(
            "bhcd,bhce->bhde", k_i, v_new, precision=_HI
        )
        return new_state, (state, v_new)

    scan_in = tuple(jnp.moveaxis(x, 2, 0) for x in (u, w, k_decayed, chunk_decay))
    final_state, (states, v_new) = jax.lax.scan(step, state0, scan_in)
    states = jnp.moveaxis(states, 0, 2)  # [B, H, N, dk, dv], the state entering each chunk
    v_new = jnp.moveaxis(v_new, 0, 2)  # [B, H, N, C, dv]

    o = jnp.einsum("bhncd,bhnde->bhnce", q_decayed, states, precision=_HI)
    o = o + jnp.einsum("bhnij,bhnjd->bhnid", intra, v_new, precision=_HI)
    o = o.transpose(0, 2, 3, 1, 4).reshape(b, n * c, h, dv)[:, :t]
    return o, final_state


def recurrent_gated_delta_step(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One token: q, k [B, H, dk]; v [B, H, dv]; g, beta [B, H]; state [B, H, dk, dv]. Returns (o, new state)."""
    f32 = jnp.float32
    dk = q.shape[-1]
    q = l2_normalize(q.astype(f32)) * (dk**-0.5)
    k = l2_normalize(k.astype(f32))
    state = state.astype(f32) * jnp.exp(g.astype(f32))[..., None, None]
    predicted = jnp.einsum("bhde,bhd->bhe", state, k, precision=_HI)
    delta = (v.astype(f32) - predicted) * beta.astype(f32)[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    o = jnp.einsum("bhde,bhd->bhe", state, q, precision=_HI)
    return o, state

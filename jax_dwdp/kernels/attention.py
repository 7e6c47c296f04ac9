"""Causal GQA attention for prefill, and masked attention over a KV cache for one decode step."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jax_dwdp.kernels._backend import on_cuda

HALF = (jnp.bfloat16, jnp.float16)
ENV_IMPLEMENTATION = "JAX_DWDP_ATTENTION"
CORES = ("cudnn", "mgpu")
DEFAULT_CORE = "cudnn"
# Pallas Mosaic GPU's attention_mgpu tiles: two consumer warpgroups of MGPU_BLOCK_Q query rows, MGPU_BLOCK_KV kv
# rows per stage, two stages; its shared memory holds them in fp16: (2 * 64 + 2 * 2 * 64) rows of D.
MGPU_BLOCK_Q, MGPU_BLOCK_KV, MGPU_STAGES = 64, 64, 2
_SMEM_BYTES = 227 * 1024


def attention_core(implementation: str | None = None) -> str:
    """The prefill attention core on a CUDA GPU: the argument, else $JAX_DWDP_ATTENTION, else DEFAULT_CORE."""
    core = implementation or os.environ.get(ENV_IMPLEMENTATION) or DEFAULT_CORE
    if core not in CORES:
        where = "implementation" if implementation else f"${ENV_IMPLEMENTATION}"
        raise ValueError(f"causal_attention: {where}={core!r} is none of {CORES}")
    return core


def mgpu_supported(q_shape, k_shape) -> bool:
    """Whether `attention_mgpu` takes these [B, T, H, D] shapes: T a multiple of its 2 x 64 query rows per program
    (and of its 64-row kv steps), D a multiple of 64 whose fp16 tiles fit in shared memory, GQA."""
    _, t, hq, d = q_shape
    hkv = k_shape[2]
    smem = (2 * MGPU_BLOCK_Q + MGPU_STAGES * 2 * MGPU_BLOCK_KV) * d * 2
    return (t > 0 and t % (2 * MGPU_BLOCK_Q) == 0 and d % 64 == 0 and smem <= _SMEM_BYTES and hq % hkv == 0
            and tuple(k_shape[:2]) == tuple(q_shape[:2]))


def _mgpu_attention(q, k, v, *, scale: float):
    """Pallas Mosaic GPU's FA3-style kernel (`jax.experimental.pallas.ops.gpu.attention_mgpu`, imported here: it
    needs the CUDA backend). It computes softmax(q k^T) v with no scale and keeps its shared-memory tiles in fp16,
    so q is scaled in fp32 and q, k, v enter as fp16 (10 mantissa bits against bf16's 7; the model's q, k are
    RMS-normed and v a projection of a normed input, far inside fp16's range); the output returns in q's dtype."""
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    tuning = attention_mgpu.TuningConfig(block_q=MGPU_BLOCK_Q, block_kv=MGPU_BLOCK_KV,
                                         max_concurrent_steps=MGPU_STAGES, causal=True)
    f16 = jnp.float16
    out = attention_mgpu.attention((q.astype(jnp.float32) * scale).astype(f16), k.astype(f16), v.astype(f16),
                                   tuning)
    return out.astype(q.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                     implementation: str | None = None) -> jax.Array:
    """softmax(q k^T * scale + causal mask) v with GQA.

    q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] with Hq % Hkv == 0 (query head h reads kv head h // (Hq/Hkv)).
    Right-padded batches need no extra mask: a valid position only sees earlier positions, and positions past a
    sequence's length are discarded by the caller.

    Lowered for a CUDA GPU with 16-bit inputs this is a flash attention: cuDNN's ("cudnn", torch SDPA's speed, see
    gpu_facts.md) or Pallas Mosaic GPU's `attention_mgpu` ("mgpu", where `mgpu_supported`; cuDNN elsewhere), chosen
    by `implementation`, else $JAX_DWDP_ATTENTION, else DEFAULT_CORE (benchmarks/bench_attention.py compares them).
    Elsewhere XLA's reference lowering, which materialises [B, Hq, T, T] logits and is meant for the CPU and tests.
    """
    def attend(impl):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=impl)

    if q.dtype not in HALF:
        return attend("xla")(q, k, v)
    gpu = attend("cudnn")
    if attention_core(implementation) == "mgpu" and mgpu_supported(q.shape, k.shape):
        gpu = lambda q, k, v: _mgpu_attention(q, k, v, scale=scale)  # noqa: E731
    return on_cuda(gpu, attend("xla"), q, k, v)


def cached_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, q_positions: jax.Array, *, scale: float
) -> jax.Array:
    """Queries at positions q_positions [B, T] against a KV cache [B, S, Hkv, D] that already holds their own keys:
    query (b, t) attends to cache positions <= q_positions[b, t] (a prefill that continues an earlier one).

    q: [B, T, Hq, D]. The mask is explicit ([B, 1, T, S]). XLA's attention on every platform (it materialises
    [B, Hq, T, S] logits): JAX's `implementation=None`, which this called before, is XLA too (jax 0.10-0.11), and
    cuDNN with such a mask has not been measured here.
    """
    mask = jnp.arange(k_cache.shape[1])[None, None, :] <= q_positions[:, :, None]
    return jax.nn.dot_product_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype), mask=mask[:, None],
                                        scale=scale, implementation="xla")


def decode_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, valid_len: jax.Array, *, scale: float
) -> jax.Array:
    """One query token per sequence against a KV cache.

    q: [B, Hq, D]; k_cache, v_cache: [B, S, Hkv, D]; valid_len: [B] (positions < valid_len are attended).
    Softmax in fp32. Returns [B, Hq, D] in q's dtype.
    """
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    qg = q.reshape(b, hkv, hq // hkv, d).astype(jnp.float32)
    logits = jnp.einsum("bgrd,bsgd->bgrs", qg, k_cache.astype(jnp.float32)) * scale
    mask = jnp.arange(k_cache.shape[1])[None, :] < valid_len[:, None]
    logits = jnp.where(mask[:, None, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bgrs,bsgd->bgrd", probs, v_cache.astype(jnp.float32))
    return out.reshape(b, hq, d).astype(q.dtype)

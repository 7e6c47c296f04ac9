"""Causal GQA attention for prefill, and masked attention over a KV cache for one decode step."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dwdp.kernels._backend import on_cuda

HALF = (jnp.bfloat16, jnp.float16)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float) -> jax.Array:
    """softmax(q k^T * scale + causal mask) v with GQA.

    q: [B, T, Hq, D]; k, v: [B, T, Hkv, D] with Hq % Hkv == 0 (query head h reads kv head h // (Hq/Hkv)).
    Right-padded batches need no extra mask: a valid position only sees earlier positions, and positions past a
    sequence's length are discarded by the caller.

    Lowered for a CUDA GPU with 16-bit inputs this is cuDNN flash attention (torch SDPA's speed, see gpu_facts.md);
    elsewhere XLA's reference lowering, which materialises [B, Hq, T, T] logits and is meant for the CPU and for tests.
    cuDNN is the fastest core measured on the image for the model's shapes (d = 256, GQA 16/2, causal): Pallas
    Mosaic GPU's FA3-style `attention_mgpu` (fp16 only) is 0.95-0.97x its speed at 4K-32K tokens, 0.86-0.94x with
    the fp16 casts, Pallas Triton's `mha` 0.27x (benchmarks/bench_attention.py, RESULTS.md).
    """
    def attend(impl):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation=impl)

    if q.dtype not in HALF:
        return attend("xla")(q, k, v)
    return on_cuda(attend("cudnn"), attend("xla"), q, k, v)


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

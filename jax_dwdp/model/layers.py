"""Small building blocks: linear maps in the HF [out, in] layout, the RMSNorms, RoPE."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dwdp.kernels.norm_rope import rms_norm


def matmul_precision(dtype) -> jax.lax.Precision | None:
    """fp32 runs are reference runs: keep them in full fp32 on the GPU (no TF32)."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def normal_init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float) -> jax.Array:
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


class Linear(nnx.Module):
    """y = x @ weight.T, weight [out, in] as stored in HF checkpoints; no bias (the model has none)."""

    def __init__(self, in_features: int, out_features: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (out_features, in_features), dtype, in_features**-0.5))

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...]
        return jnp.einsum("...i,oi->...o", x, w, precision=matmul_precision(w.dtype))


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm: (x * rsqrt(mean(x^2) + eps)) * (1 + w), in fp32, cast back to x's dtype."""

    def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
        # Checkpoints start from zeros; random init here keeps random-weight tests sensitive to the (1 + w) form.
        self.weight = nnx.Param(normal_init(rngs, (dim,), dtype, 0.1))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)


class PlainRMSNorm(nnx.Module):
    """Nemotron-H's RMSNorm: w * norm(x) (plain w, initialised near ones), normalised in fp32; the product in x's
    dtype."""

    def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param((1.0 + normal_init(rngs, (dim,), jnp.float32, 0.1)).astype(dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        n = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * n.astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """Gated DeltaNet output norm: w * norm(x) (plain w, not 1 + w), times silu(gate) in fp32."""

    def __init__(self, dim: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param((1.0 + normal_init(rngs, (dim,), jnp.float32, 0.1)).astype(dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        n = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        y = self.weight[...] * n.astype(x.dtype)
        return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class Embedding(nnx.Module):
    def __init__(self, vocab_size: int, dim: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (vocab_size, dim), dtype, 1.0))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], tokens, axis=0)


def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [..., rotary_dim] for integer positions (NeoX layout: frequencies repeated twice).

    Text-only input has equal M-RoPE position rows, so Qwen3.5's interleaved M-RoPE reduces to this.
    """
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)

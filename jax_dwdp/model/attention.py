"""Gated full attention: q/k RMSNorm over head_dim, partial RoPE, GQA, output gated by sigmoid(gate)."""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import nnx

from jax_dwdp.config import ModelConfig
from jax_dwdp.kernels import cached_attention, causal_attention, decode_attention
from jax_dwdp.kernels.choices import KernelChoices, resolve
from jax_dwdp.kernels.norm_rope import norm_rope
from jax_dwdp.model.layers import Linear, RMSNorm, rope_cos_sin


class GatedAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, kernels: KernelChoices | None = None):
        """`kernels`: the kernel choices of this mixer's programs (default: the process's), a static attribute."""
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(h, nh * hd * 2, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(h, nkv * hd, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(h, nkv * hd, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nh * hd, h, dtype=dtype, rngs=rngs)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd
        self.rotary_dim, self.rope_theta = cfg.rotary_dim, cfg.rope_theta
        self.kernels = resolve(kernels)

    def _project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """x [B, T, H], positions [B, T] -> q [B,T,nh,hd], gate [B,T,nh*hd], k, v [B,T,nkv,hd] (k roped)."""
        b, t, _ = x.shape
        # q_proj's output is interleaved per head: [q_head0 | gate_head0 | q_head1 | ...]; the norm + RoPE reads
        # each head's q where it is (one pass on the GPU: kernels.norm_rope).
        qg = self.q_proj(x).reshape(b, t, self.num_heads, 2 * self.head_dim)
        gate = qg[..., self.head_dim :].reshape(b, t, -1)
        # XLA's dot merger would make the q, k and v projections one GEMM (they share x), concatenating the three
        # weights on every call and copying q out of the merged output for the norm + RoPE kernel (kept apart, the
        # full-attention layer takes 7.457 vs 7.562 ms at 16K tokens, an H200, 2026-12-03: benchmarks/RESULTS.md,
        # "Attention"): k and v read x through an optimization barrier, a value the merger does not take for the
        # same operand (no copy: the barrier is removed after scheduling).
        xkv = jax.lax.optimization_barrier(x)
        k = self.k_proj(xkv).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(xkv).reshape(b, t, self.num_kv_heads, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.rotary_dim, self.rope_theta)
        q = norm_rope(qg, self.q_norm.weight[...], cos, sin, eps=self.q_norm.eps, head_dim=self.head_dim,
                      kernels=self.kernels)
        k = norm_rope(k, self.k_norm.weight[...], cos, sin, eps=self.k_norm.eps, head_dim=self.head_dim,
                      kernels=self.kernels)
        return q, gate, k, v

    def __call__(
        self, x: jax.Array, positions: jax.Array | None, cache: tuple[jax.Array, jax.Array] | None = None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Prefill. Returns the output and this layer's (K, V) cache entries [B, T, nkv, hd].

        `positions` [B, T], or None for 0..T-1 in every sequence (a prefill from the start: made here, inside the
        program, so a layer-wise driver sends no positions array from the host before its first layer).
        With `cache` (K, V [B, S, nkv, hd] holding each sequence's earlier positions) the tokens continue those
        sequences at `positions` [B, T]: their K and V are written into the cache at their positions (those past S
        are dropped) and each query attends to every cached position up to its own. Returns the updated cache.
        """
        b, t, _ = x.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        q, gate, k, v = self._project(x, positions)
        if cache is None:
            attn = causal_attention(q, k, v, scale=self.head_dim**-0.5)
        else:
            rows = jnp.arange(b)[:, None]
            k_cache = cache[0].at[rows, positions].set(k.astype(cache[0].dtype), mode="drop")
            v_cache = cache[1].at[rows, positions].set(v.astype(cache[1].dtype), mode="drop")
            attn = cached_attention(q, k_cache, v_cache, positions, scale=self.head_dim**-0.5)
            k, v = k_cache, v_cache
        out = attn.reshape(b, t, -1) * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(attn.dtype)
        return self.o_proj(out), (k, v)

    def decode(
        self, x: jax.Array, position: jax.Array, k_cache: jax.Array, v_cache: jax.Array
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """One token per sequence: x [B, 1, H] at position [B]; caches [B, S, nkv, hd] hold positions < position."""
        b = x.shape[0]
        q, gate, k, v = self._project(x, position[:, None])
        rows = jnp.arange(b)
        k_cache = k_cache.at[rows, position].set(k[:, 0].astype(k_cache.dtype))
        v_cache = v_cache.at[rows, position].set(v[:, 0].astype(v_cache.dtype))
        attn = decode_attention(q[:, 0], k_cache, v_cache, position + 1, scale=self.head_dim**-0.5)
        out = attn.reshape(b, 1, -1) * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(attn.dtype)
        return self.o_proj(out), (k_cache, v_cache)

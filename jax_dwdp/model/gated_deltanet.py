"""Gated DeltaNet linear attention: the recurrent-state ("mamba") layers of Qwen3.5.

Prefill leaves two caches per layer: the conv state (the last K-1 conv inputs of each sequence, [B, C, K-1]) and
the fp32 recurrent state [B, HV, dk, dv]. With right-padded batches both are taken at each sequence's own length:
the conv state is sliced at the length and padded steps get g = beta = 0, which leaves the recurrent state as is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dwdp.config import ModelConfig
from jax_dwdp.kernels import chunk_gated_delta_rule, recurrent_gated_delta_step
from jax_dwdp.kernels.choices import KernelChoices, resolve
from jax_dwdp.kernels.conv import causal_conv_silu, causal_conv_silu_xla
from jax_dwdp.model.layers import GatedRMSNorm, Linear, normal_init


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, kernels: KernelChoices | None = None):
        """`kernels`: the kernel choices of this mixer's programs (default: the process's), a static attribute."""
        h = cfg.hidden_size
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        self.conv_kernel = cfg.linear_conv_kernel_dim
        self.in_proj_qkv = Linear(h, cfg.conv_dim, dtype=dtype, rngs=rngs)
        self.in_proj_z = Linear(h, self.value_dim, dtype=dtype, rngs=rngs)
        self.in_proj_b = Linear(h, self.num_v_heads, dtype=dtype, rngs=rngs)
        self.in_proj_a = Linear(h, self.num_v_heads, dtype=dtype, rngs=rngs)
        self.conv1d = _Conv1dWeight(cfg.conv_dim, self.conv_kernel, dtype=dtype, rngs=rngs)
        # A_log is kept in fp32 whatever the model dtype (checkpoints store it so; exp() of it sets the decay).
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (self.num_v_heads,), jnp.float32, 1.0, 16.0)))
        self.dt_bias = nnx.Param((1.0 + normal_init(rngs, (self.num_v_heads,), jnp.float32, 0.1)).astype(dtype))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.out_proj = Linear(self.value_dim, h, dtype=dtype, rngs=rngs)
        self.kernels = resolve(kernels)

    def _gates(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        beta = jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32))
        a = self.in_proj_a(x).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(a)
        return g, beta

    def _split_heads(self, mixed) -> tuple[jax.Array, jax.Array, jax.Array]:
        """[..., C] (or its q, k, v channel pieces) -> q, k [..., HK, dk], v [..., HV, dv] (the kernels share each
        key head among HV/HK value heads)."""
        q, k, v = mixed if isinstance(mixed, tuple) else jnp.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        lead = q.shape[:-1]
        q = q.reshape(*lead, self.num_k_heads, self.head_k_dim)
        k = k.reshape(*lead, self.num_k_heads, self.head_k_dim)
        return q, k, v.reshape(*lead, self.num_v_heads, self.head_v_dim)

    def _output(self, core: jax.Array, x: jax.Array) -> jax.Array:
        lead = x.shape[:-1]
        z = self.in_proj_z(x).reshape(*lead, self.num_v_heads, self.head_v_dim)
        y = self.norm(core.astype(x.dtype), z)
        return self.out_proj(y.reshape(*lead, self.value_dim))

    def __call__(
        self, x: jax.Array, lengths: jax.Array, cache: tuple[jax.Array, jax.Array] | None = None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Prefill x [B, T, H] (right-padded to T, valid lengths [B]). Returns output and (conv, recurrent) state.

        With `cache` (conv state [B, C, K-1], recurrent state [B, HV, dk, dv], what an earlier prefill of the same
        sequences left) the tokens continue those sequences: the conv reads the cached inputs before t = 0 and the
        delta rule starts from the cached state. A sequence with length 0 keeps its cache as it was.
        """
        mixed = self.in_proj_qkv(x)  # [B, T, C]
        history = None if cache is None else jnp.swapaxes(cache[0], 1, 2)  # [B, K-1, C]
        conv_state = last_inputs(mixed, lengths, self.conv_kernel - 1, history)
        g, beta = self._gates(x)
        conv_out = causal_conv_silu(mixed, self.conv1d.weight[...], history, splits=(self.key_dim, 2 * self.key_dim),
                                    kernels=self.kernels)
        q, k, v = self._split_heads(conv_out)
        core, state = chunk_gated_delta_rule(q, k, v, g, beta, lengths=lengths,
                                             initial_state=None if cache is None else cache[1], kernels=self.kernels)
        return self._output(core, x), (conv_state, state)

    def decode(
        self, x: jax.Array, conv_state: jax.Array, state: jax.Array
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """One token per sequence: x [B, 1, H]; conv_state [B, C, K-1]; state [B, HV, dk, dv] fp32."""
        mixed = self.in_proj_qkv(x)  # [B, 1, C]
        history = jnp.swapaxes(conv_state, 1, 2)  # [B, K-1, C]
        conv_out = causal_conv_silu_xla(mixed, self.conv1d.weight[...], history)
        new_conv_state = jnp.swapaxes(jnp.concatenate([history, mixed.astype(history.dtype)], axis=1)[:, 1:], 1, 2)
        q, k, v = self._split_heads(conv_out[:, 0])
        rep = self.num_v_heads // self.num_k_heads
        q, k = jnp.repeat(q, rep, axis=-2), jnp.repeat(k, rep, axis=-2)
        g, beta = self._gates(x[:, 0])
        core, state = recurrent_gated_delta_step(q, k, v, g, beta, state)
        return self._output(core[:, None], x), (new_conv_state, state)


class _Conv1dWeight(nnx.Module):
    """Holds `conv1d.weight` [C, 1, K] under the checkpoint's name."""

    def __init__(self, channels: int, kernel: int, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (channels, 1, kernel), dtype, kernel**-0.5))


def last_inputs(x: jax.Array, lengths: jax.Array, n: int, history: jax.Array | None = None) -> jax.Array:
    """x [B, T, C] -> the n inputs before each sequence's length, [B, C, n]; before t = 0 they come from `history`
    [B, n, C] (the inputs of an earlier piece of the sequence), or are zeros."""
    if history is None:
        padded = jnp.pad(x, ((0, 0), (n, 0), (0, 0)))
    else:
        padded = jnp.concatenate([history.astype(x.dtype), x], axis=1)
    # Original positions [len - n, len) sit at padded positions [len, len + n).
    window = jax.vmap(lambda row, start: jax.lax.dynamic_slice_in_dim(row, start, n, axis=0))(padded, lengths)
    return jnp.swapaxes(window, 1, 2)

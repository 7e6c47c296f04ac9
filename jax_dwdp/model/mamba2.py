"""The Mamba-2 mixer of Nemotron-H: in_proj -> causal conv (with its state) -> SSD scan -> gated grouped RMSNorm ->
out_proj.

Prefill leaves two caches per layer, like a Gated DeltaNet layer: the conv state (the last K-1 conv inputs of each
sequence, [B, C, K-1]) and the fp32 SSM state [B, H, P, N]. With right-padded batches both are taken at each
sequence's own length: the conv state is sliced at the length and padded steps get dt = 0, which leaves the SSM
state as it is.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dwdp.kernels.choices import KernelChoices, resolve
from jax_dwdp.kernels.conv import causal_conv_bias_silu_xla
from jax_dwdp.kernels.ssd import ssd_chunked, ssd_step
from jax_dwdp.model.gated_deltanet import last_inputs
from jax_dwdp.model.layers import Linear, normal_init
from jax_dwdp.nemotron_h_config import NemotronHConfig


class GroupedGatedRMSNorm(nnx.Module):
    """y = w * rmsnorm_per_group(x * silu(z)): the gate before the norm, each of the n_groups channel groups
    normalised on its own, in fp32; w plain (initialised near ones)."""

    def __init__(self, dim: int, groups: int, eps: float, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param((1.0 + normal_init(rngs, (dim,), jnp.float32, 0.1)).astype(dtype))
        self.groups, self.eps = groups, eps

    def __call__(self, x: jax.Array, gate: jax.Array, dtype) -> jax.Array:
        h = x.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
        grouped = h.reshape(*h.shape[:-1], self.groups, -1)
        grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(jnp.float32) * grouped.reshape(h.shape)).astype(dtype)


class _Conv1d(nnx.Module):
    """Holds `conv1d.weight` [C, 1, K] and `conv1d.bias` [C] under the checkpoint's names."""

    def __init__(self, channels: int, kernel: int, bias: bool, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (channels, 1, kernel), dtype, kernel**-0.5))
        self.bias = nnx.Param(normal_init(rngs, (channels,), dtype, 0.1)) if bias else None


class Mamba2Mixer(nnx.Module):
    def __init__(self, cfg: NemotronHConfig, *, dtype, rngs: nnx.Rngs, kernels: KernelChoices | None = None):
        """`kernels`: the kernel choices of this mixer's programs (default: the process's), a static attribute."""
        h = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.mamba_num_heads, cfg.mamba_head_dim
        self.n_groups, self.state_size = cfg.n_groups, cfg.ssm_state_size
        self.intermediate, self.conv_dim = cfg.mamba_intermediate_size, cfg.mamba_conv_dim
        self.conv_kernel, self.chunk_size, self.time_step_min = cfg.conv_kernel, cfg.chunk_size, cfg.time_step_min
        self.in_proj = Linear(h, cfg.mamba_in_proj_size, dtype=dtype, rngs=rngs)
        self.conv1d = _Conv1d(self.conv_dim, self.conv_kernel, cfg.use_conv_bias, dtype=dtype, rngs=rngs)
        # dt_bias drawn as transformers initialises it: softplus^-1 of a time step log-uniform in [1e-3, 1e-1].
        step = jnp.exp(jax.random.uniform(rngs.params(), (self.num_heads,), jnp.float32, math.log(1e-3),
                                          math.log(1e-1)))
        self.dt_bias = nnx.Param((step + jnp.log(-jnp.expm1(-step))).astype(dtype))
        # A_log is kept in fp32 whatever the model dtype (exp() of it sets the decay, as in Gated DeltaNet).
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (self.num_heads,), jnp.float32, 1.0, 16.0)))
        self.D = nnx.Param((1.0 + normal_init(rngs, (self.num_heads,), jnp.float32, 0.1)).astype(dtype))
        self.norm = GroupedGatedRMSNorm(self.intermediate, self.n_groups, cfg.layer_norm_epsilon, dtype=dtype,
                                        rngs=rngs)
        self.out_proj = Linear(self.intermediate, h, dtype=dtype, rngs=rngs)
        self.kernels = resolve(kernels)

    def _split(self, projected: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """in_proj's output -> gate z [..., I], conv input [..., C], dt [..., H]."""
        return tuple(jnp.split(projected, [self.intermediate, self.intermediate + self.conv_dim], axis=-1))

    def _ssm_inputs(self, conv_out: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Conv output [..., C] -> x [..., H, P], B, C [..., G, N]."""
        lead = conv_out.shape[:-1]
        gn = self.n_groups * self.state_size
        x, b, c = jnp.split(conv_out, [self.intermediate, self.intermediate + gn], axis=-1)
        return (x.reshape(*lead, self.num_heads, self.head_dim), b.reshape(*lead, self.n_groups, self.state_size),
                c.reshape(*lead, self.n_groups, self.state_size))

    def _time_step(self, dt: jax.Array) -> jax.Array:
        return jax.nn.softplus(dt.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))

    def _output(self, y: jax.Array, x: jax.Array, z: jax.Array, dtype) -> jax.Array:
        """The D skip, the gated norm and out_proj: y, x [..., H, P] (y fp32), z [..., I]."""
        y = y + self.D[...].astype(jnp.float32)[:, None] * x.astype(jnp.float32)
        y = y.reshape(*y.shape[:-2], self.intermediate)
        return self.out_proj(self.norm(y, z, dtype))

    def __call__(
        self, h: jax.Array, lengths: jax.Array, cache: tuple[jax.Array, jax.Array] | None = None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Prefill h [B, T, H] (right-padded to T, valid lengths [B]). Returns the output and (conv, SSM) state.

        With `cache` (conv state [B, C, K-1], SSM state [B, H, P, N] fp32, what an earlier prefill of the same
        sequences left) the tokens continue those sequences. A sequence with length 0 keeps its cache as it was.
        """
        z, xbc, dt = self._split(self.in_proj(h))
        history = None if cache is None else jnp.swapaxes(cache[0], 1, 2)  # [B, K-1, C]
        conv_state = last_inputs(xbc, lengths, self.conv_kernel - 1, history)
        conv_out = causal_conv_bias_silu_xla(xbc, self.conv1d.weight[...], _value(self.conv1d.bias), history)
        x, b, c = self._ssm_inputs(conv_out)
        # transformers' chunked scan clamps the time step from below at time_step_min (its single-token step does
        # not: see decode); padded steps get dt = 0.
        dt = jnp.maximum(self._time_step(dt), self.time_step_min)
        valid = jnp.arange(h.shape[1])[None, :] < lengths[:, None]
        dt = jnp.where(valid[..., None], dt, 0.0)
        a = -jnp.exp(self.A_log[...].astype(jnp.float32))
        y, state = ssd_chunked(x, dt, a, b, c, chunk_size=self.chunk_size,
                               initial_state=None if cache is None else cache[1], kernels=self.kernels)
        return self._output(y, x, z, h.dtype), (conv_state, state)

    def decode(
        self, h: jax.Array, conv_state: jax.Array, state: jax.Array
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """One token per sequence: h [B, 1, H]; conv_state [B, C, K-1]; state [B, H, P, N] fp32.

        The time step is not clamped here: the reference's step form (transformers' `selective_state_update`, as
        mamba_ssm's) applies no limit, and a decode step continues that reference."""
        z, xbc, dt = self._split(self.in_proj(h))
        history = jnp.swapaxes(conv_state, 1, 2)  # [B, K-1, C]
        conv_out = causal_conv_bias_silu_xla(xbc, self.conv1d.weight[...], _value(self.conv1d.bias), history)
        new_conv_state = jnp.swapaxes(jnp.concatenate([history, xbc.astype(history.dtype)], axis=1)[:, 1:], 1, 2)
        x, b, c = self._ssm_inputs(conv_out[:, 0])
        a = -jnp.exp(self.A_log[...].astype(jnp.float32))
        y, state = ssd_step(state, x, self._time_step(dt[:, 0]), a, b, c)
        return self._output(y[:, None], x[:, None], z, h.dtype), (new_conv_state, state)


def _value(param) -> jax.Array | None:
    return None if param is None else param[...]

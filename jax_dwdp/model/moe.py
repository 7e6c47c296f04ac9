"""Sparse MoE block: softmax router with top-k renormalisation, routed experts, sigmoid-gated shared expert.

The routed experts are a pure function of (tokens, routing, stacked expert weights), `routed_experts`, so the
parallel paths (DWDP, EP) can hand it expert weights that came from elsewhere without touching the module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dwdp import kernels
from jax_dwdp.config import ModelConfig
from jax_dwdp.model.layers import Linear, matmul_precision, normal_init


def route(x: jax.Array, router_weight: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """x [M, H] -> (expert ids [M, k] int32, weights [M, k] in x's dtype), softmax in fp32, renormalised top-k."""
    logits = jnp.einsum("mh,eh->me", x, router_weight, precision=matmul_precision(x.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_p, top_i = jax.lax.top_k(probs, top_k)
    top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    return top_i.astype(jnp.int32), top_p.astype(x.dtype)


def sort_by_expert(expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Flattened (token, slot) pairs sorted by expert: (order [M*k], group_sizes [E] int32)."""
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, group_sizes


def routed_experts(
    x: jax.Array,
    expert_ids: jax.Array,
    expert_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    *,
    grouped_matmul_impl: str | None = None,
    gate_up_interleaved: bool = False,
) -> jax.Array:
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's top-k experts e.

    x [M, H]; expert_ids, expert_weights [M, k]; gate_up_proj [E, 2I, H] (gate rows first, or, with
    `gate_up_interleaved`, in `kernels.interleave_gate_up`'s layout, which lets the GPU kernel fuse SiLU(gate) * up
    into the projection's epilogue); down_proj [E, H, I].
    Tokens are sorted by expert, pushed through two grouped matmuls, and gathered back (a gather, not a scatter).
    """
    m, k = expert_ids.shape
    num_experts, two_i, _ = gate_up_proj.shape
    order, group_sizes = sort_by_expert(expert_ids, num_experts)
    # Row count padded to the kernels' row multiple inside the gather itself (no extra copy); the padded rows
    # belong to no group and are dropped by the final gather.
    pad = (-m * k) % kernels.GROUPED_MATMUL_ROW_MULTIPLE
    rows = x[jnp.pad(order, (0, pad)) // k]  # [M*k + pad, H]
    if gate_up_interleaved:
        act = kernels.grouped_matmul_swiglu(rows, gate_up_proj, group_sizes, implementation=grouped_matmul_impl)
    else:
        gate_up = kernels.grouped_matmul(rows, gate_up_proj, group_sizes, implementation=grouped_matmul_impl)
        gate, up = gate_up[:, : two_i // 2], gate_up[:, two_i // 2 :]
        act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
    out = kernels.grouped_matmul(act, down_proj, group_sizes, implementation=grouped_matmul_impl)
    out = out[jnp.argsort(order)] * expert_weights.reshape(-1)[:, None]  # back to (token, slot) order
    return jnp.sum(out.reshape(m, k, -1).astype(jnp.float32), axis=1).astype(x.dtype)


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (cfg.num_experts, cfg.hidden_size), dtype, 1.0))


class Experts(nnx.Module):
    """All experts of one layer as stacked weights, in the checkpoint's fused layout."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nnx.Param(normal_init(rngs, (e, 2 * i, h), dtype, h**-0.5))
        self.down_proj = nnx.Param(normal_init(rngs, (e, h, i), dtype, i**-0.5))


class SharedExpert(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.gate_proj = Linear(h, i, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(h, i, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(i, h, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        act = jax.nn.silu(self.gate_proj(x).astype(jnp.float32)) * self.up_proj(x).astype(jnp.float32)
        return self.down_proj(act.astype(x.dtype))


class SparseMoe(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.gate = Router(cfg, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs)
        self.shared_expert = SharedExpert(cfg, dtype=dtype, rngs=rngs)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, dtype=dtype, rngs=rngs)
        self.top_k = cfg.num_experts_per_tok

    def __call__(self, x: jax.Array, experts: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """x [..., H]. `experts` = (gate_up_proj, down_proj) overrides this module's own expert weights; it may also
        be a function of x returning them (DWDP's FFI path waits for the layer's expert copy there)."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if callable(experts):
            experts = experts(flat)
        gate_up, down = experts if experts is not None else (self.experts.gate_up_proj[...], self.experts.down_proj[...])
        ids, weights = route(flat, self.gate.weight[...], self.top_k)
        routed = routed_experts(flat, ids, weights, gate_up, down)
        shared_gate = jax.nn.sigmoid(self.shared_expert_gate(flat).astype(jnp.float32)).astype(x.dtype)
        out = routed + shared_gate * self.shared_expert(flat)
        return out.reshape(*lead, -1)

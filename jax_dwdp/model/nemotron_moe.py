"""Nemotron-H's MoE block and dense MLP: relu^2 experts without a gate, a sigmoid router with a score-correction
bias and group-limited top-k, routed scaling, one shared expert, and the optional latent projection around the
routed experts (LatentMoE: the experts read and write `moe_latent_size` channels, the shared expert the full width).

The routed experts run through the same kernels as Qwen3.5's (`kernels.routing.expert_permutation`,
`dispatch_rows`, `grouped_matmul`, `combine_rows`); only the activation between the two grouped matmuls differs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dwdp.kernels import GROUPED_MATMUL_ROW_MULTIPLE, combine_rows, dispatch_rows, grouped_matmul
from jax_dwdp.kernels.choices import KernelChoices, resolve
from jax_dwdp.model.layers import Linear, matmul_precision, normal_init
from jax_dwdp.model.moe import combine_valid_rows, expert_order, split_awaited
from jax_dwdp.nemotron_h_config import NemotronHConfig


def relu2(x: jax.Array) -> jax.Array:
    r = jax.nn.relu(x)
    return r * r


class ReluSquaredMlp(nnx.Module):
    """down_proj(relu(up_proj(x))^2): the dense MLP layer ("-") and the MoE's shared expert."""

    def __init__(self, hidden: int, intermediate: int, *, dtype, rngs: nnx.Rngs):
        self.up_proj = Linear(hidden, intermediate, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(intermediate, hidden, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(relu2(self.up_proj(x)))


def route_sigmoid(
    logits: jax.Array, correction_bias: jax.Array, *, top_k: int, n_group: int, topk_group: int,
    norm_topk_prob: bool, scaling: float,
) -> tuple[jax.Array, jax.Array]:
    """Router logits [M, E] -> (expert ids [M, k] int32, weights [M, k] fp32).

    Experts are chosen by sigmoid score + correction bias, among the `topk_group` groups (of `n_group`) whose two
    best biased scores sum highest; the weights are the unbiased sigmoid scores of the chosen experts, normalised to
    sum 1 (with `norm_topk_prob`) and multiplied by `scaling`."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + correction_bias.astype(jnp.float32)
    m, e = choice.shape
    if n_group > 1:
        grouped = choice.reshape(m, n_group, e // n_group)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [M, n_group]
        kept = jax.lax.top_k(group_scores, topk_group)[1]
        group_mask = jnp.any(jax.nn.one_hot(kept, n_group, dtype=bool), axis=1)  # [M, n_group]
        choice = jnp.where(jnp.repeat(group_mask, e // n_group, axis=1), choice, -jnp.inf)
    ids = jax.lax.top_k(choice, top_k)[1]
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * scaling


def routed_relu2_experts(
    x: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array, up_proj: jax.Array, down_proj: jax.Array, *,
    add: jax.Array | None = None, valid: jax.Array | None = None, kernels: KernelChoices | None = None,
    wait=None,
) -> jax.Array:
    """sum_k w_k * down_e(relu(up_e(x))^2) over each token's top-k experts e (+ `add`). x [M, D]; expert_ids,
    expert_weights [M, k]; up_proj [E, I, D]; down_proj [E, D, I]. `valid` [M, k] (DEP, a rank holding a block of
    the experts): only these slots count, the others carry ids >= E (as in moe.routed_experts). `wait`
    (moe.AwaitedExperts.wait): the expert weights are read only after `wait((up_proj, down_proj), first matmul's
    input)`, whose returned input the matmul reads."""
    kernels = resolve(kernels)
    m, k = expert_ids.shape
    order, inverse, group_sizes = expert_order(expert_ids, up_proj.shape[0], valid, kernels)
    pad = (-m * k) % GROUPED_MATMUL_ROW_MULTIPLE  # padded rows are in no group and never read back
    gemm = functools.partial(grouped_matmul, kernels=kernels)
    rows = dispatch_rows(x, order, inverse, k, m * k + pad, kernels=kernels)
    if wait is not None:
        (up_proj, down_proj), rows = wait((up_proj, down_proj), rows)
    act = relu2(gemm(rows, up_proj, group_sizes).astype(jnp.float32)).astype(x.dtype)
    out = gemm(act, down_proj, group_sizes)
    weights = expert_weights.astype(x.dtype)
    if valid is None:
        return combine_rows(out, inverse, weights, add)
    return combine_valid_rows(out, inverse, weights, valid, x.dtype, add)


class TopkRouter(nnx.Module):
    def __init__(self, cfg: NemotronHConfig, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (cfg.n_routed_experts, cfg.hidden_size), dtype, 1.0))
        # fp32 whatever the model dtype, as transformers keeps it (_keep_in_fp32_modules_strict): the bias only
        # breaks near-ties between sigmoid scores.
        self.e_score_correction_bias = nnx.Param(normal_init(rngs, (cfg.n_routed_experts,), jnp.float32, 0.1))


class Experts(nnx.Module):
    """All routed experts of one layer: up_proj [E, I, D], down_proj [E, D, I] (D: the latent size if any)."""

    def __init__(self, cfg: NemotronHConfig, *, dtype, rngs: nnx.Rngs):
        e, d, i = cfg.n_routed_experts, cfg.expert_input_size, cfg.moe_intermediate_size
        self.up_proj = nnx.Param(normal_init(rngs, (e, i, d), dtype, d**-0.5))
        self.down_proj = nnx.Param(normal_init(rngs, (e, d, i), dtype, i**-0.5))


class NemotronHMoe(nnx.Module):
    def __init__(self, cfg: NemotronHConfig, *, dtype, rngs: nnx.Rngs, kernels: KernelChoices | None = None):
        """`kernels`: the kernel choices of this block's programs (default: the process's), a static attribute."""
        h = cfg.hidden_size
        self.gate = TopkRouter(cfg, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs)
        self.shared_experts = ReluSquaredMlp(h, cfg.moe_shared_expert_intermediate_size, dtype=dtype, rngs=rngs)
        if cfg.moe_latent_size is not None:
            self.fc1_latent_proj = Linear(h, cfg.moe_latent_size, dtype=dtype, rngs=rngs)
            self.fc2_latent_proj = Linear(cfg.moe_latent_size, h, dtype=dtype, rngs=rngs)
        self.latent = cfg.moe_latent_size is not None
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = cfg.norm_topk_prob, float(cfg.routed_scaling_factor)
        self.kernels = resolve(kernels)

    def __call__(self, x: jax.Array, experts=None) -> jax.Array:
        """x [..., H]. `experts` replaces this module's own expert weights, as for Qwen3.5's SparseMoe: (up_proj,
        down_proj), moe.AwaitedExperts (DWDP's FFI path: the layer's expert copy is waited for right before the
        first grouped matmul), or an object whose `routed(x, ids, weights, experts_fn=)` computes the routed
        experts (DEP: the tokens, at the experts' width, travel to the ranks holding their experts)."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        # The router runs in fp32 whatever the model dtype, as the reference's does.
        logits = jnp.einsum("mh,eh->me", flat.astype(jnp.float32), self.gate.weight[...].astype(jnp.float32),
                            precision=matmul_precision(jnp.float32))
        ids, weights = route_sigmoid(logits, self.gate.e_score_correction_bias[...], top_k=self.top_k,
                                     n_group=self.n_group, topk_group=self.topk_group,
                                     norm_topk_prob=self.norm_topk_prob, scaling=self.routed_scaling_factor)
        shared = self.shared_experts(flat)
        tokens = self.fc1_latent_proj(flat) if self.latent else flat
        if hasattr(experts, "routed"):
            routed = experts.routed(tokens, ids, weights, kernels=self.kernels, experts_fn=routed_relu2_experts)
            out = (self.fc2_latent_proj(routed) if self.latent else routed) + shared
        else:
            experts, wait = split_awaited(experts)
            up, down = experts if experts is not None else (self.experts.up_proj[...], self.experts.down_proj[...])
            if self.latent:
                out = self.fc2_latent_proj(routed_relu2_experts(tokens, ids, weights, up, down, kernels=self.kernels,
                                                                wait=wait)) + shared
            else:
                out = routed_relu2_experts(flat, ids, weights, up, down, add=shared, kernels=self.kernels, wait=wait)
        return out.reshape(*lead, -1)

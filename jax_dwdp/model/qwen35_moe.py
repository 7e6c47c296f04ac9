"""The Qwen3.5-MoE text model: its decoder layer (attention or Gated DeltaNet, then the sparse MoE) and the model
over a layer range [start_layer, end_layer), whose range, caches, prefill and decode are the families' shared
`CausalLMStage` (jax_dwdp.model.stage).
"""

from __future__ import annotations

import jax
from flax import nnx

from jax_dwdp.config import LINEAR_ATTENTION, ModelConfig
from jax_dwdp.kernels.choices import KernelChoices, resolve
from jax_dwdp.model.attention import GatedAttention
from jax_dwdp.model.cache import Cache, LogitsMode, _positions, _single_device, cache_length, kv_entry  # noqa: F401
from jax_dwdp.model.gated_deltanet import GatedDeltaNet
from jax_dwdp.model.layers import RMSNorm
from jax_dwdp.model.moe import SparseMoe
from jax_dwdp.model.stage import CausalLMStage, StageLayer


class DecoderLayer(StageLayer):
    """Attention or Gated DeltaNet, then the sparse MoE: every Qwen3.5 layer has routed experts."""

    has_experts = True
    EXPERTS = ("mlp", "experts")  # where a layer's routed experts sit, and their two weights (the expert sources'
    EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # and the placements' view of them)

    def __init__(self, cfg: ModelConfig, layer_id: int, *, dtype, rngs: nnx.Rngs, kernels: KernelChoices | None = None):
        """`kernels`: the kernel choices, handed to the mixer and the MoE block (default: the process's)."""
        super().__init__(cfg, layer_id)
        kernels = resolve(kernels)
        self.input_layernorm = self.make_norm(cfg, dtype=dtype, rngs=rngs)
        if self.layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs, kernels=kernels)
        else:
            self.self_attn = GatedAttention(cfg, dtype=dtype, rngs=rngs, kernels=kernels)
        self.post_attention_layernorm = self.make_norm(cfg, dtype=dtype, rngs=rngs)
        self.mlp = SparseMoe(cfg, dtype=dtype, rngs=rngs, kernels=kernels)

    @staticmethod
    def make_norm(cfg: ModelConfig, *, dtype, rngs: nnx.Rngs) -> RMSNorm:
        """The family's norm: the layer's two and the model's final one."""
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, lengths, experts=None, cache=None):
        """`positions` [B, T], or None for 0..T-1 in every sequence. `cache`: this layer's entries of an earlier
        prefill of the same sequences ((K, V) or (conv, recurrent)), which the tokens continue; returned updated.
        `experts`: what the layer's MoE computes with instead of its own expert weights (an expert source's)."""
        with jax.named_scope(f"layer{self.layer_id}_{self.layer_type}"):
            x, cache = self.mix(x, positions, lengths, cache)
            return self.moe(x, experts), cache

    def mix(self, x, positions, lengths, cache=None):
        """The layer's first half: x + attention or Gated DeltaNet of norm(x); (x, the layer's cache)."""
        h = self.input_layernorm(x)
        if self.layer_type == LINEAR_ATTENTION:
            mixed, cache = self.linear_attn(h, lengths, cache)
        else:
            mixed, cache = self.self_attn(h, positions, cache)
        return x + mixed, cache

    def moe(self, x, experts=None):
        """The layer's second half: x + MoE(norm(x)), with `experts` in place of its own when given."""
        return x + self.mlp(self.post_attention_layernorm(x), experts)

    def expert_weights(self) -> tuple[jax.Array, jax.Array]:
        """The layer's own routed-expert weights (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
        return self.mlp.experts.gate_up_proj[...], self.mlp.experts.down_proj[...]

    def decode(self, x, position, cache):
        h = self.input_layernorm(x)
        if self.layer_type == LINEAR_ATTENTION:
            mixed, cache = self.linear_attn.decode(h, *cache)
        else:
            mixed, cache = self.self_attn.decode(h, position, *cache)
        x = x + mixed
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Qwen35MoeForCausalLM(CausalLMStage):
    """The Qwen3.5-MoE text model (or a range of its layers): `embed_tokens`, `layers`, `norm`, `lm_head`."""

    layer_class = DecoderLayer
    embedding_name = "embed_tokens"
    final_norm_name = "norm"

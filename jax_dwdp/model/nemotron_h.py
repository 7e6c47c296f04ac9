"""The Nemotron-H text model over a layer range [start_layer, end_layer); its range, caches, prefill and decode are
the families' shared `CausalLMStage` (jax_dwdp.model.stage).

Each layer is one block: x + mixer(norm(x)), its mixer a Mamba-2 layer, an attention layer, a dense relu^2 MLP or a
MoE block, as `cfg.layer_types` says. The module tree mirrors transformers' (`embeddings`, `layers.N.norm`,
`layers.N.mixer.*`, `norm_f`, `lm_head`), so checkpoint names map to parameter paths by dropping a prefix. Caches
use the families' shared `Cache` (jax_dwdp.model.cache): K and V of the attention layers in `key` / `value`, the
conv and SSM states of the Mamba-2 layers in `conv` / `recurrent`, each slot belonging to one layer of the range;
MLP and MoE layers hold none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dwdp.kernels import cached_attention, causal_attention, decode_attention
from jax_dwdp.kernels.choices import KernelChoices, resolve
from jax_dwdp.model.layers import Linear, PlainRMSNorm
from jax_dwdp.model.mamba2 import Mamba2Mixer
from jax_dwdp.model.nemotron_moe import NemotronHMoe, ReluSquaredMlp
from jax_dwdp.model.stage import CausalLMStage, StageLayer
from jax_dwdp.nemotron_h_config import ATTENTION, MAMBA, MLP, MOE, NemotronHConfig


class Attention(nnx.Module):
    """GQA softmax attention without positional encoding (Nemotron-H's attention layers have no RoPE: the Mamba-2
    layers carry the order) and without q/k norms or an output gate."""

    def __init__(self, cfg: NemotronHConfig, *, dtype, rngs: nnx.Rngs):
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(h, nh * hd, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(h, nkv * hd, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(h, nkv * hd, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(nh * hd, h, dtype=dtype, rngs=rngs)
        self.num_heads, self.num_kv_heads, self.head_dim = nh, nkv, hd

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        lead = x.shape[:-1]
        return (self.q_proj(x).reshape(*lead, self.num_heads, self.head_dim),
                self.k_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim),
                self.v_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim))

    def __call__(self, x: jax.Array, positions: jax.Array | None,
                 cache: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Prefill x [B, T, H]; returns the output and (K, V) [B, T, nkv, hd]. With `cache` (K, V [B, S, nkv, hd])
        the tokens continue those sequences at `positions` [B, T] and the updated cache is returned."""
        b, t, _ = x.shape
        q, k, v = self._project(x)
        scale = self.head_dim**-0.5
        if cache is None:
            attn = causal_attention(q, k, v, scale=scale)
        else:
            rows = jnp.arange(b)[:, None]
            k = cache[0].at[rows, positions].set(k.astype(cache[0].dtype), mode="drop")
            v = cache[1].at[rows, positions].set(v.astype(cache[1].dtype), mode="drop")
            attn = cached_attention(q, k, v, positions, scale=scale)
        return self.o_proj(attn.reshape(b, t, -1)), (k, v)

    def decode(self, x: jax.Array, position: jax.Array, k_cache: jax.Array,
               v_cache: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """One token per sequence: x [B, 1, H] at position [B]; caches [B, S, nkv, hd] hold positions < position."""
        b = x.shape[0]
        q, k, v = self._project(x)
        rows = jnp.arange(b)
        k_cache = k_cache.at[rows, position].set(k[:, 0].astype(k_cache.dtype))
        v_cache = v_cache.at[rows, position].set(v[:, 0].astype(v_cache.dtype))
        attn = decode_attention(q[:, 0], k_cache, v_cache, position + 1, scale=self.head_dim**-0.5)
        return self.o_proj(attn.reshape(b, 1, -1)), (k_cache, v_cache)


class NemotronHBlock(StageLayer):
    """norm -> one mixer -> residual: Mamba-2, attention, the relu^2 MLP or the MoE, as the pattern says. Only a MoE
    block has routed experts."""

    EXPERTS = ("mixer", "experts")  # where a MoE block's routed experts sit, and their two weights
    EXPERT_WEIGHTS = ("up_proj", "down_proj")

    def __init__(self, cfg: NemotronHConfig, layer_id: int, *, dtype, rngs: nnx.Rngs,
                 kernels: KernelChoices | None = None):
        super().__init__(cfg, layer_id)
        kernels = resolve(kernels)
        self.norm = self.make_norm(cfg, dtype=dtype, rngs=rngs)
        if self.layer_type == MAMBA:
            self.mixer = Mamba2Mixer(cfg, dtype=dtype, rngs=rngs, kernels=kernels)
        elif self.layer_type == ATTENTION:
            self.mixer = Attention(cfg, dtype=dtype, rngs=rngs)
        elif self.layer_type == MLP:
            self.mixer = ReluSquaredMlp(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        else:
            self.mixer = NemotronHMoe(cfg, dtype=dtype, rngs=rngs, kernels=kernels)

    @staticmethod
    def make_norm(cfg: NemotronHConfig, *, dtype, rngs: nnx.Rngs) -> PlainRMSNorm:
        """The family's norm: the block's and the model's final one (norm_f)."""
        return PlainRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype=dtype, rngs=rngs)

    def __call__(self, x, positions, lengths, experts=None, cache=None):
        """x + mixer(norm(x)) and the layer's cache ((conv, SSM state), (K, V) or None). `positions` [B, T] or None
        (0..T-1); `cache` continues an earlier prefill; `experts` replaces a MoE layer's own expert weights."""
        with jax.named_scope(f"layer{self.layer_id}_{self.layer_type}"):
            h = self.norm(x)
            if self.layer_type == MAMBA:
                out, cache = self.mixer(h, lengths, cache)
            elif self.layer_type == ATTENTION:
                out, cache = self.mixer(h, positions, cache)
            elif self.layer_type == MOE:
                out, cache = self.mixer(h, experts), None
            else:
                out, cache = self.mixer(h), None
            return x + out, cache

    @property
    def has_experts(self) -> bool:
        return self.layer_type == MOE

    def expert_weights(self) -> tuple[jax.Array, jax.Array] | None:
        """A MoE block's own routed-expert weights (up_proj [E, I, D], down_proj [E, D, I]); None for the others."""
        if not self.has_experts:
            return None
        return self.mixer.experts.up_proj[...], self.mixer.experts.down_proj[...]

    def mix(self, x, positions, lengths, cache=None):
        """The block's part before the routed experts (the engine's profile splits layers in two): the whole block
        unless it is a MoE block, which has nothing before its experts."""
        if self.has_experts:
            return x, None
        return self(x, positions, lengths, None, cache)

    def moe(self, x, experts=None):
        """The block's routed-expert part: x + MoE(norm(x)) for a MoE block (`experts` in place of its own when
        given), x itself for the others."""
        if not self.has_experts:
            return x
        return self(x, None, None, experts)[0]

    def decode(self, x, position, cache):
        h = self.norm(x)
        if self.layer_type == MAMBA:
            out, cache = self.mixer.decode(h, *cache)
        elif self.layer_type == ATTENTION:
            out, cache = self.mixer.decode(h, position, *cache)
        else:
            out, cache = self.mixer(h), None
        return x + out, cache


class NemotronHForCausalLM(CausalLMStage):
    """The Nemotron-H text model (or one contiguous range of its layers, for a pipeline stage), its parameters named
    as transformers names them: `embeddings`, `layers`, `norm_f`, `lm_head`."""

    layer_class = NemotronHBlock
    embedding_name = "embeddings"
    final_norm_name = "norm_f"

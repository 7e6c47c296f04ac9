"""The Nemotron-H text model over a layer range [start_layer, end_layer), its caches, prefill and decode.

Each layer is one block: x + mixer(norm(x)), its mixer a Mamba-2 layer, an attention layer, a dense relu^2 MLP or a
MoE block, as `cfg.layer_types` says. The module tree mirrors transformers' (`embeddings`, `layers.N.norm`,
`layers.N.mixer.*`, `norm_f`, `lm_head`), so checkpoint names map to parameter paths by dropping a prefix. Caches
use the families' shared `Cache` (jax_dwdp.model.cache): K and V of the attention layers in `key` / `value`, the
conv and SSM states of the Mamba-2 layers in `conv` / `recurrent`, each slot belonging to one layer of the range;
MLP and MoE layers hold none.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dwdp.kernels import cached_attention, causal_attention, decode_attention
from jax_dwdp.kernels.choices import KernelChoices, resolve
from jax_dwdp.model.layers import Embedding, Linear, PlainRMSNorm
from jax_dwdp.model.mamba2 import Mamba2Mixer
from jax_dwdp.model.nemotron_moe import NemotronHMoe, ReluSquaredMlp
from jax_dwdp.model.cache import Cache, LogitsMode, _positions, _single_device, cache_length, kv_entry
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


class NemotronHBlock(nnx.Module):
    """norm -> one mixer -> residual: Mamba-2, attention, the relu^2 MLP or the MoE, as the pattern says. Only a MoE
    block has routed experts."""

    EXPERTS = ("mixer", "experts")  # where a MoE block's routed experts sit, and their two weights
    EXPERT_WEIGHTS = ("up_proj", "down_proj")

    def __init__(self, cfg: NemotronHConfig, layer_id: int, *, dtype, rngs: nnx.Rngs,
                 kernels: KernelChoices | None = None):
        kernels = resolve(kernels)
        self.layer_id = layer_id
        self.layer_type = cfg.layer_types[layer_id]
        self.norm = PlainRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype=dtype, rngs=rngs)
        if self.layer_type == MAMBA:
            self.mixer = Mamba2Mixer(cfg, dtype=dtype, rngs=rngs, kernels=kernels)
        elif self.layer_type == ATTENTION:
            self.mixer = Attention(cfg, dtype=dtype, rngs=rngs)
        elif self.layer_type == MLP:
            self.mixer = ReluSquaredMlp(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)
        else:
            self.mixer = NemotronHMoe(cfg, dtype=dtype, rngs=rngs, kernels=kernels)

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


class NemotronHForCausalLM(nnx.Module):
    """The text model (or one contiguous range of its layers, for a pipeline stage): the embedding only if the range
    starts at layer 0, norm_f and lm_head only if it ends at the last layer."""

    def __init__(self, cfg: NemotronHConfig, *, dtype=jnp.bfloat16, start_layer: int = 0,
                 end_layer: int | None = None, rngs: nnx.Rngs, kernels: KernelChoices | None = None):
        kernels = resolve(kernels)
        n = cfg.num_hidden_layers
        end_layer = n if end_layer is None else end_layer
        if not 0 <= start_layer < end_layer <= n:
            raise ValueError(f"layer range [{start_layer}, {end_layer}) is empty or outside [0, {n})")
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.start_layer, self.end_layer = start_layer, end_layer
        self.is_first, self.is_last = start_layer == 0, end_layer == n
        self.kernels = kernels
        # Random weights depend on the global layer, not on the range: every layout of one seed is the same model.
        root = rngs.params()

        def part(tag: int) -> nnx.Rngs:
            return nnx.Rngs(jax.random.fold_in(root, tag))

        if self.is_first:
            self.embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=part(n))
        self.layers = nnx.List([NemotronHBlock(cfg, i, dtype=dtype, rngs=part(i), kernels=kernels)
                                for i in range(start_layer, end_layer)])
        if self.is_last:
            head = part(n + 1)
            self.norm_f = PlainRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, dtype=dtype, rngs=head)
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=head)

    # ---- pieces a pipeline stage composes -----------------------------------------------------
    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        """The range's attention layers: the slots of the cache's key / value."""
        return self.cfg.layer_ids(ATTENTION, self.start_layer, self.end_layer)

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        """The range's Mamba-2 layers: the slots of the cache's conv / recurrent."""
        return self.cfg.layer_ids(MAMBA, self.start_layer, self.end_layer)

    @property
    def expert_layer_ids(self) -> tuple[int, ...]:
        """The range's MoE layers: those with routed experts."""
        return self.cfg.moe_layer_ids(self.start_layer, self.end_layer)

    def embed(self, tokens: jax.Array) -> jax.Array:
        return self.embeddings(tokens)

    def logits(self, h: jax.Array) -> jax.Array:
        """norm_f and lm_head; logits in fp32."""
        h = self.norm_f(h)
        return jnp.einsum("...h,vh->...v", h, self.lm_head.weight[...], preferred_element_type=jnp.float32)

    def head(self, h: jax.Array, lengths: jax.Array, mode: LogitsMode) -> jax.Array | None:
        if mode == "none":
            return None
        if mode == "last":
            h = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        elif mode != "all":
            raise ValueError(f"logits must be 'all', 'last' or 'none', got {mode!r}")
        return self.logits(h)

    def _assemble(self, keys, values, convs, states, lengths, batch: int, cache_len: int) -> Cache:
        """A Cache from per-layer leaves; a kind the range has no layer of becomes an empty [0, ...] leaf, made where
        the lengths live (a stage's device, not the default one)."""
        stack = lambda xs: jnp.stack(xs) if xs else None  # noqa: E731
        return Cache.assemble(self.cfg, self.dtype, key=stack(keys), value=stack(values), conv=stack(convs),
                              recurrent=stack(states), lengths=lengths.astype(jnp.int32), batch=batch,
                              cache_len=cache_len, full_layer_ids=self.full_layer_ids,
                              linear_layer_ids=self.linear_layer_ids, device=_single_device(lengths))

    def forward_layers(self, h: jax.Array, lengths: jax.Array, *, cache_len: int | None = None,
                       run_layer: Callable | None = None, cache: Cache | None = None) -> tuple[jax.Array, Cache]:
        """Runs this range's layers over h [B, T, H] (right-padded, valid lengths [B]) and builds its cache. With
        `cache` (this range's cache from an earlier prefill of the same sequences) the tokens continue it at
        positions cache.lengths[b] + t; a sequence with length 0 keeps its cache.

        `run_layer(index, layer, h, positions, lengths, layer_cache) -> (h, layer cache)` replaces the plain call, as
        in `Qwen35MoeForCausalLM.forward_layers` (the engine's StageRunner compiles layers through it)."""
        run_layer = run_layer or (lambda index, layer, *args: layer(*args[:3], None, args[3]))
        b, t, _ = h.shape
        if cache is not None:
            cache_len = cache.capacity
        cache_len = cache_length(t, cache_len)
        positions = None if cache is None else _positions(h, b, t) + cache.lengths[:, None]
        full_slot = {layer_id: i for i, layer_id in enumerate(self.full_layer_ids)}
        linear_slot = {layer_id: i for i, layer_id in enumerate(self.linear_layer_ids)}
        keys, values, convs, states = [], [], [], []
        for index, layer in enumerate(self.layers):
            layer_cache = None
            if cache is not None and layer.layer_type == MAMBA:
                i = linear_slot[layer.layer_id]
                layer_cache = (cache.conv[i], cache.recurrent[i])
            elif cache is not None and layer.layer_type == ATTENTION:
                i = full_slot[layer.layer_id]
                layer_cache = (cache.key[i], cache.value[i])
            h, out = run_layer(index, layer, h, positions, lengths, layer_cache)
            if layer.layer_type == MAMBA:
                convs.append(out[0])
                states.append(out[1])
            elif layer.layer_type == ATTENTION:  # (continuing a cache: already the whole cache)
                key, value = out if cache is not None else kv_entry(out, cache_len)
                keys.append(key)
                values.append(value)
        held = lengths if cache is None else cache.lengths + lengths
        return h, self._assemble(keys, values, convs, states, held, b, cache_len)

    # ---- whole-model entry points -------------------------------------------------------------
    def forward(self, x: jax.Array, lengths: jax.Array, *, logits: LogitsMode = "all", cache_len: int | None = None,
                run_layer: Callable | None = None, cache: Cache | None = None) -> tuple[jax.Array | None, Cache]:
        """This range's share of a prefill: x is tokens [B, T] if the range starts at layer 0, else hidden states
        [B, T, H]; returns logits (if the range ends at the last layer) or hidden states, and the range's cache."""
        h = self.embed(x) if self.is_first else x
        h, cache = self.forward_layers(h, lengths.astype(jnp.int32), cache_len=cache_len, run_layer=run_layer,
                                       cache=cache)
        return (self.head(h, lengths, logits) if self.is_last else h), cache

    def prefill(self, tokens: jax.Array, lengths: jax.Array | None = None, *, logits: LogitsMode = "all",
                cache_len: int | None = None, cache: Cache | None = None) -> tuple[jax.Array | None, Cache]:
        """tokens [B, T] int32, right-padded; lengths [B] (default T). Returns (logits, cache); see
        `Qwen35MoeForCausalLM.prefill` for the logits modes and continuing a cache."""
        if not (self.is_first and self.is_last):
            raise ValueError("prefill() needs the whole model; a pipeline stage runs forward()")
        b, t = tokens.shape
        lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths
        return self.forward(tokens, lengths, logits=logits, cache_len=cache_len, cache=cache)

    def decode_step(self, tokens: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        """Reference decode of one token per sequence (tokens [B]) at position cache.lengths; logits [B, V] fp32.
        Needs cache.capacity > max(cache.lengths)."""
        position = cache.lengths
        x = self.embed(tokens[:, None])
        keys, values, convs, states = [], [], [], []
        full_slot = {layer_id: i for i, layer_id in enumerate(cache.full_layer_ids)}
        linear_slot = {layer_id: i for i, layer_id in enumerate(cache.linear_layer_ids)}
        for layer in self.layers:
            if layer.layer_type == MAMBA:
                i = linear_slot[layer.layer_id]
                x, (c, s) = layer.decode(x, position, (cache.conv[i], cache.recurrent[i]))
                convs.append(c)
                states.append(s)
            elif layer.layer_type == ATTENTION:
                i = full_slot[layer.layer_id]
                x, (k, v) = layer.decode(x, position, (cache.key[i], cache.value[i]))
                keys.append(k)
                values.append(v)
            else:
                x, _ = layer.decode(x, position, None)
        new_cache = self._assemble(keys, values, convs, states, position + 1, tokens.shape[0], cache.capacity)
        return self.logits(x[:, 0]), new_cache

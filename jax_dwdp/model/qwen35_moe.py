"""Qwen3.5-MoE text model over a layer range [start_layer, end_layer), its caches, prefill and decode.

A model built for a range holds only those layers' weights, the embedding only if it starts at layer 0, and the
final norm and lm_head only if it ends at the last layer: one pipeline stage is exactly such a model. Caches are
allocated for the range only and indexed by position inside it (see `Cache`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dwdp.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig
from jax_dwdp.kernels.choices import KernelChoices, resolve
from jax_dwdp.model.attention import GatedAttention
from jax_dwdp.model.cache import Cache, LogitsMode, _positions, _single_device, cache_length, kv_entry  # noqa: F401
from jax_dwdp.model.gated_deltanet import GatedDeltaNet
from jax_dwdp.model.layers import Embedding, Linear, RMSNorm
from jax_dwdp.model.moe import SparseMoe


class DecoderLayer(nnx.Module):
    """Attention or Gated DeltaNet, then the sparse MoE: every Qwen3.5 layer has routed experts."""

    has_experts = True
    EXPERTS = ("mlp", "experts")  # where a layer's routed experts sit, and their two weights (the expert sources'
    EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # and the placements' view of them)

    def __init__(self, cfg: ModelConfig, layer_id: int, *, dtype, rngs: nnx.Rngs, kernels: KernelChoices | None = None):
        """`kernels`: the kernel choices, handed to the mixer and the MoE block (default: the process's)."""
        kernels = resolve(kernels)
        self.layer_id = layer_id
        self.layer_type = cfg.layer_types[layer_id]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        if self.layer_type == LINEAR_ATTENTION:
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs, kernels=kernels)
        else:
            self.self_attn = GatedAttention(cfg, dtype=dtype, rngs=rngs, kernels=kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, rngs=rngs)
        self.mlp = SparseMoe(cfg, dtype=dtype, rngs=rngs, kernels=kernels)

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


class Qwen35MoeForCausalLM(nnx.Module):
    """The text model (or one contiguous range of its layers, for a pipeline stage).

    `kernels`: which form of each kernel its programs take (`KernelChoices`; default: the process's, built once
    from the environment). A static attribute of the model and of its mixers and MoE blocks: part of the graphdef,
    so programs compiled for models of different choices are different programs."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype=jnp.bfloat16,
        start_layer: int = 0,
        end_layer: int | None = None,
        rngs: nnx.Rngs,
        kernels: KernelChoices | None = None,
    ):
        kernels = resolve(kernels)
        end_layer = cfg.num_hidden_layers if end_layer is None else end_layer
        if not 0 <= start_layer < end_layer <= cfg.num_hidden_layers:
            raise ValueError(
                f"layer range [{start_layer}, {end_layer}) is empty or outside [0, {cfg.num_hidden_layers})"
            )
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.start_layer, self.end_layer = start_layer, end_layer
        self.is_first, self.is_last = start_layer == 0, end_layer == cfg.num_hidden_layers
        self.kernels = kernels
        # Random weights depend on the global layer, not on the range: a stage draws exactly the whole model's
        # weights of its layers, so every pipeline layout of one seed is the same model.
        root = rngs.params()
        n = cfg.num_hidden_layers

        def part(tag: int) -> nnx.Rngs:
            return nnx.Rngs(jax.random.fold_in(root, tag))

        if self.is_first:
            self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=part(n))
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype, rngs=part(i), kernels=kernels)
                                for i in range(start_layer, end_layer)])
        if self.is_last:
            head = part(n + 1)
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, rngs=head)
            # With tied embeddings the loader fills lm_head from embed_tokens, so the last stage needs no embedding.
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=head)

    # ---- pieces a pipeline stage composes -----------------------------------------------------
    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        return self.cfg.layer_ids(FULL_ATTENTION, self.start_layer, self.end_layer)

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        return self.cfg.layer_ids(LINEAR_ATTENTION, self.start_layer, self.end_layer)

    @property
    def expert_layer_ids(self) -> tuple[int, ...]:
        """The range's layers with routed experts: all of them."""
        return self.cfg.moe_layer_ids(self.start_layer, self.end_layer)

    def embed(self, tokens: jax.Array) -> jax.Array:
        return self.embed_tokens(tokens)

    def logits(self, h: jax.Array) -> jax.Array:
        """Final norm and lm_head; logits in fp32."""
        h = self.norm(h)
        w = self.lm_head.weight[...]
        return jnp.einsum("...h,vh->...v", h, w, preferred_element_type=jnp.float32)

    def forward_layers(
        self,
        h: jax.Array,
        lengths: jax.Array,
        *,
        cache_len: int | None = None,
        run_layer: Callable | None = None,
        cache: Cache | None = None,
    ) -> tuple[jax.Array, Cache]:
        """Runs this range's layers over h [B, T, H] (right-padded, valid lengths [B]) and builds its cache.

        `run_layer(index, layer, h, positions, lengths, layer_cache) -> (h, layer cache)` replaces the plain call
        (positions None without `cache`: 0..T-1, made inside each attention layer);
        `index` is the layer's position in this range (the stage runner compiles layers and brings their experts
        through it). With `cache` (this range's cache from an earlier prefill of the same sequences) the tokens
        continue it: sequence b's tokens sit at positions cache.lengths[b] + t, and the returned cache (of the same
        capacity) holds cache.lengths + lengths positions; a sequence with length 0 keeps its cache.
        """
        run_layer = run_layer or (lambda index, layer, *args: layer(*args[:3], None, args[3]))
        b, t, _ = h.shape
        if cache is not None:
            cache_len = cache.capacity
        cache_len = cache_length(t, cache_len)
        # From the start, positions are 0..T-1 and each attention layer makes them (None); continuing a cache they
        # start at its lengths.
        positions = None if cache is None else _positions(h, b, t) + cache.lengths[:, None]
        full_slot = {layer_id: i for i, layer_id in enumerate(self.full_layer_ids)}
        linear_slot = {layer_id: i for i, layer_id in enumerate(self.linear_layer_ids)}
        keys, values, convs, states = [], [], [], []
        for index, layer in enumerate(self.layers):
            layer_cache = None
            if cache is not None and layer.layer_type == LINEAR_ATTENTION:
                layer_cache = (cache.conv[linear_slot[layer.layer_id]], cache.recurrent[linear_slot[layer.layer_id]])
            elif cache is not None:
                layer_cache = (cache.key[full_slot[layer.layer_id]], cache.value[full_slot[layer.layer_id]])
            h, out = run_layer(index, layer, h, positions, lengths, layer_cache)
            if layer.layer_type == LINEAR_ATTENTION:
                convs.append(out[0])
                states.append(out[1])
            else:  # (continuing a cache: already the whole cache, the new positions written in)
                key, value = out if cache is not None else kv_entry(out, cache_len)
                keys.append(key)
                values.append(value)
        held = lengths if cache is None else cache.lengths + lengths
        return h, self._stack_cache(keys, values, convs, states, held, b, cache_len)

    def _stack_cache(self, keys, values, convs, states, lengths, b, cache_len) -> Cache:
        stack = lambda xs: jnp.stack(xs) if xs else None  # noqa: E731
        return Cache.assemble(self.cfg, self.dtype, key=stack(keys), value=stack(values), conv=stack(convs),
                              recurrent=stack(states), lengths=lengths.astype(jnp.int32), batch=b,
                              cache_len=cache_len, full_layer_ids=self.full_layer_ids,
                              linear_layer_ids=self.linear_layer_ids, device=_single_device(lengths))

    # ---- whole-model entry points -------------------------------------------------------------
    def forward(
        self,
        x: jax.Array,
        lengths: jax.Array,
        *,
        logits: LogitsMode = "all",
        cache_len: int | None = None,
        run_layer: Callable | None = None,
        cache: Cache | None = None,
    ) -> tuple[jax.Array | None, Cache]:
        """This range's share of a prefill: x is tokens [B, T] if the range starts at layer 0, else hidden states
        [B, T, H]; returns logits (if the range ends at the last layer) or hidden states, and the range's cache.
        `cache` continues an earlier prefill (see forward_layers)."""
        h = self.embed(x) if self.is_first else x
        h, cache = self.forward_layers(h, lengths.astype(jnp.int32), cache_len=cache_len, run_layer=run_layer,
                                       cache=cache)
        return (self.head(h, lengths, logits) if self.is_last else h), cache

    def prefill(
        self,
        tokens: jax.Array,
        lengths: jax.Array | None = None,
        *,
        logits: LogitsMode = "all",
        cache_len: int | None = None,
        cache: Cache | None = None,
    ) -> tuple[jax.Array | None, Cache]:
        """tokens [B, T] int32, right-padded; lengths [B] (default T). Returns (logits, cache).

        logits="all": [B, T, V] fp32; "last": [B, V] at each sequence's last valid position; "none": None.
        With `cache` (from an earlier prefill, capacity enough for the new tokens) the tokens continue it: a prompt
        prefilled in pieces gives the logits and cache of one prefill of the whole prompt.
        """
        if not (self.is_first and self.is_last):
            raise ValueError("prefill() needs the whole model; a pipeline stage runs forward()")
        b, t = tokens.shape
        lengths = jnp.full((b,), t, jnp.int32) if lengths is None else lengths
        return self.forward(tokens, lengths, logits=logits, cache_len=cache_len, cache=cache)

    def head(self, h: jax.Array, lengths: jax.Array, mode: LogitsMode) -> jax.Array | None:
        if mode == "none":
            return None
        if mode == "last":
            h = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        elif mode != "all":
            raise ValueError(f"logits must be 'all', 'last' or 'none', got {mode!r}")
        return self.logits(h)

    def decode_step(self, tokens: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        """Reference decode of one token per sequence (tokens [B]) at position cache.lengths; logits [B, V] fp32.

        Needs cache.capacity > max(cache.lengths) (prefill with cache_len > T).
        """
        position = cache.lengths
        x = self.embed(tokens[:, None])
        keys, values, convs, states = [], [], [], []
        full_slot = {layer_id: i for i, layer_id in enumerate(cache.full_layer_ids)}
        linear_slot = {layer_id: i for i, layer_id in enumerate(cache.linear_layer_ids)}
        for layer in self.layers:
            if layer.layer_type == LINEAR_ATTENTION:
                i = linear_slot[layer.layer_id]
                x, (c, s) = layer.decode(x, position, (cache.conv[i], cache.recurrent[i]))
                convs.append(c)
                states.append(s)
            else:
                i = full_slot[layer.layer_id]
                x, (k, v) = layer.decode(x, position, (cache.key[i], cache.value[i]))
                keys.append(k)
                values.append(v)
        new_cache = self._stack_cache(keys, values, convs, states, position + 1, tokens.shape[0], cache.capacity)
        return self.logits(x[:, 0]), new_cache

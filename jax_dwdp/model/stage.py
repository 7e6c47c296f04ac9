"""What both model families are around their layers: a text model over a layer range [start_layer, end_layer), its
caches, prefill and decode (`CausalLMStage`).

A model built for a range holds only those layers' weights, the embedding only if it starts at layer 0, and the
final norm and lm_head only if it ends at the last layer: one pipeline stage is exactly such a model. Caches are
allocated for the range only and indexed by position inside it (see `Cache`). The layers' cache kinds are the
config's: a `full_attention` layer leaves K and V (the cache's key / value), a `linear_attention` layer a conv and a
recurrent state (conv / recurrent: Qwen3.5's Gated DeltaNet, Nemotron-H's Mamba-2); any other kind (Nemotron-H's
MLP and MoE blocks) leaves nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dwdp.config import FULL_ATTENTION, LINEAR_ATTENTION
from jax_dwdp.families import FamilyConfig
from jax_dwdp.kernels.choices import KernelChoices, resolve
from jax_dwdp.model.cache import Cache, LogitsMode, _positions, _single_device, cache_length, kv_entry
from jax_dwdp.model.layers import Embedding, Linear


def _layer_cache(cache: Cache, layer, full_layer_ids: tuple[int, ...],
                 linear_layer_ids: tuple[int, ...]) -> tuple[jax.Array, jax.Array] | None:
    """The layer's entries of `cache`: (conv, recurrent) or (K, V), at the layer's slot among `linear_layer_ids` /
    `full_layer_ids`; None for a kind that leaves none."""
    if layer.layer_type == LINEAR_ATTENTION:
        i = linear_layer_ids.index(layer.layer_id)
        return cache.conv[i], cache.recurrent[i]
    if layer.layer_type == FULL_ATTENTION:
        i = full_layer_ids.index(layer.layer_id)
        return cache.key[i], cache.value[i]
    return None


class StageLayer(nnx.Module):
    """What a `CausalLMStage` asks of its family's layer class: the layer's global id and its kind
    (`cfg.layer_types`: the kind picks its cache slots), `__call__` and `decode` over its cache entries, and
    `make_norm`, the family's norm (the model's final norm too)."""

    def __init__(self, cfg: FamilyConfig, layer_id: int):
        self.layer_id = layer_id
        self.layer_type = cfg.layer_types[layer_id]


class CausalLMStage(nnx.Module):
    """The text model (or one contiguous range of its layers, for a pipeline stage), of the family a subclass
    names: its layer class, and its embedding's and final norm's attribute names, which are its parameter paths
    (the HF and Orbax loaders name weights by them, mirroring the family's checkpoints). The final norm is the
    family's layer norm (`layer_class.make_norm`), as in both families' checkpoints.

    `kernels`: which form of each kernel its programs take (`KernelChoices`; default: the process's, built once
    from the environment). A static attribute of the model and of its mixers and MoE blocks: part of the graphdef,
    so programs compiled for models of different choices are different programs."""

    layer_class: type[StageLayer]  # the family's layer: (cfg, layer_id, *, dtype, rngs, kernels)
    embedding_name: str  # the attribute holding the embedding
    final_norm_name: str  # the attribute holding the final norm (lm_head is `lm_head` in both families)

    def __init__(self, cfg: FamilyConfig, *, dtype=jnp.bfloat16, start_layer: int = 0, end_layer: int | None = None,
                 rngs: nnx.Rngs, kernels: KernelChoices | None = None):
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
        # Random weights depend on the global layer, not on the range: a stage draws exactly the whole model's
        # weights of its layers, so every pipeline layout of one seed is the same model.
        root = rngs.params()

        def part(tag: int) -> nnx.Rngs:
            return nnx.Rngs(jax.random.fold_in(root, tag))

        if self.is_first:
            setattr(self, self.embedding_name, Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=part(n)))
        self.layers = nnx.List([self.layer_class(cfg, i, dtype=dtype, rngs=part(i), kernels=kernels)
                                for i in range(start_layer, end_layer)])
        if self.is_last:
            head = part(n + 1)
            setattr(self, self.final_norm_name, self.layer_class.make_norm(cfg, dtype=dtype, rngs=head))
            # With tied embeddings the loader fills lm_head from the embedding, so the last stage needs no embedding.
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=head)

    # ---- pieces a pipeline stage composes -----------------------------------------------------
    @property
    def full_layer_ids(self) -> tuple[int, ...]:
        """The range's full-attention layers: the slots of the cache's key / value."""
        return self.cfg.layer_ids(FULL_ATTENTION, self.start_layer, self.end_layer)

    @property
    def linear_layer_ids(self) -> tuple[int, ...]:
        """The range's layers with a conv and recurrent state: the slots of the cache's conv / recurrent."""
        return self.cfg.layer_ids(LINEAR_ATTENTION, self.start_layer, self.end_layer)

    @property
    def expert_layer_ids(self) -> tuple[int, ...]:
        """The range's layers with routed experts."""
        return self.cfg.moe_layer_ids(self.start_layer, self.end_layer)

    def embed(self, tokens: jax.Array) -> jax.Array:
        return getattr(self, self.embedding_name)(tokens)

    def logits(self, h: jax.Array) -> jax.Array:
        """Final norm and lm_head; logits in fp32."""
        h = getattr(self, self.final_norm_name)(h)
        return jnp.einsum("...h,vh->...v", h, self.lm_head.weight[...], preferred_element_type=jnp.float32)

    def head(self, h: jax.Array, lengths: jax.Array, mode: LogitsMode) -> jax.Array | None:
        if mode == "none":
            return None
        if mode == "last":
            h = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        elif mode != "all":
            raise ValueError(f"logits must be 'all', 'last' or 'none', got {mode!r}")
        return self.logits(h)

    def forward_layers(self, h: jax.Array, lengths: jax.Array, *, cache_len: int | None = None,
                       run_layer: Callable | None = None, cache: Cache | None = None) -> tuple[jax.Array, Cache]:
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
        slots = self.full_layer_ids, self.linear_layer_ids
        keys, values, convs, states = [], [], [], []
        for index, layer in enumerate(self.layers):
            layer_cache = None if cache is None else _layer_cache(cache, layer, *slots)
            h, out = run_layer(index, layer, h, positions, lengths, layer_cache)
            if layer.layer_type == LINEAR_ATTENTION:
                convs.append(out[0])
                states.append(out[1])
            elif layer.layer_type == FULL_ATTENTION:  # (continuing a cache: already the whole cache)
                key, value = out if cache is not None else kv_entry(out, cache_len)
                keys.append(key)
                values.append(value)
        held = lengths if cache is None else cache.lengths + lengths
        return h, self._assemble(keys, values, convs, states, held, b, cache_len)

    def _assemble(self, keys, values, convs, states, lengths, batch: int, cache_len: int) -> Cache:
        """A Cache from per-layer leaves; a kind the range has no layer of becomes an empty [0, ...] leaf, made where
        the lengths live (a stage's device, not the default one)."""
        stack = lambda xs: jnp.stack(xs) if xs else None  # noqa: E731
        return Cache.assemble(self.cfg, self.dtype, key=stack(keys), value=stack(values), conv=stack(convs),
                              recurrent=stack(states), lengths=lengths.astype(jnp.int32), batch=batch,
                              cache_len=cache_len, full_layer_ids=self.full_layer_ids,
                              linear_layer_ids=self.linear_layer_ids, device=_single_device(lengths))

    # ---- whole-model entry points -------------------------------------------------------------
    def forward(self, x: jax.Array, lengths: jax.Array, *, logits: LogitsMode = "all", cache_len: int | None = None,
                run_layer: Callable | None = None, cache: Cache | None = None) -> tuple[jax.Array | None, Cache]:
        """This range's share of a prefill: x is tokens [B, T] if the range starts at layer 0, else hidden states
        [B, T, H]; returns logits (if the range ends at the last layer) or hidden states, and the range's cache.
        `cache` continues an earlier prefill (see forward_layers)."""
        h = self.embed(x) if self.is_first else x
        h, cache = self.forward_layers(h, lengths.astype(jnp.int32), cache_len=cache_len, run_layer=run_layer,
                                       cache=cache)
        return (self.head(h, lengths, logits) if self.is_last else h), cache

    def prefill(self, tokens: jax.Array, lengths: jax.Array | None = None, *, logits: LogitsMode = "all",
                cache_len: int | None = None, cache: Cache | None = None) -> tuple[jax.Array | None, Cache]:
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

    def decode_step(self, tokens: jax.Array, cache: Cache) -> tuple[jax.Array, Cache]:
        """Reference decode of one token per sequence (tokens [B]) at position cache.lengths; logits [B, V] fp32.

        Needs cache.capacity > max(cache.lengths) (prefill with cache_len > T).
        """
        position = cache.lengths
        x = self.embed(tokens[:, None])
        keys, values, convs, states = [], [], [], []
        for layer in self.layers:
            x, out = layer.decode(x, position, _layer_cache(cache, layer, cache.full_layer_ids, cache.linear_layer_ids))
            if layer.layer_type == LINEAR_ATTENTION:
                convs.append(out[0])
                states.append(out[1])
            elif layer.layer_type == FULL_ATTENTION:
                keys.append(out[0])
                values.append(out[1])
        new_cache = self._assemble(keys, values, convs, states, position + 1, tokens.shape[0], cache.capacity)
        return self.logits(x[:, 0]), new_cache

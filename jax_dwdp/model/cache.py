"""What a prefill leaves for the layers of one range, shared by the model families: the `Cache`, the logits modes,
and the helpers that make positions and K/V entries where the hidden states live."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from jax_dwdp.devices import put
from jax_dwdp.families import FamilyConfig

LogitsMode = Literal["all", "last", "none"]


def _single_device(x) -> jax.Device | None:
    """The one device a concrete array lives on; None inside a trace, for host arrays and for sharded arrays."""
    if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array):
        return None
    devices = x.devices()
    return next(iter(devices)) if len(devices) == 1 else None


def _positions(h, b: int, t: int):
    """Positions 0..t-1 of each sequence, made where h lives.

    Inside a trace they are an iota. Eagerly (layer-wise drivers) they must not be a jnp op on the default device:
    that op would queue behind everything already enqueued on device 0, and a driver running another device's
    layers would wait for all of device 0's work before its first layer (independent DWDP ranks then ran one after
    the other). So they are built on the host and placed like h: on its device, or with h's mesh sharding of the
    [batch, sequence] dimensions; any other h gets the host array.
    """
    if isinstance(h, jax.core.Tracer):
        return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    device = _single_device(h)
    if device is not None:
        return jax.device_put(positions, device)
    sharding = getattr(h, "sharding", None)
    if isinstance(sharding, NamedSharding):
        spec = (*sharding.spec, None, None)[:2]
        return put(positions, NamedSharding(sharding.mesh, PartitionSpec(*spec)))
    return positions


def kv_entry(kv: tuple[jax.Array, jax.Array], cache_len: int) -> tuple[jax.Array, jax.Array]:
    """A full-attention layer's K, V [B, T, nkv, hd] as its Cache entry: padded to cache_len positions. The one
    place the layer-wise loop (forward_layers) and the scanned program (jax_dwdp.scan) make it."""
    t = kv[0].shape[1]
    if cache_len == t:  # (an eager pad by nothing would still enqueue a copy of K and V)
        return kv
    pad = ((0, 0), (0, cache_len - t), (0, 0), (0, 0))
    return jnp.pad(kv[0], pad), jnp.pad(kv[1], pad)


def cache_length(tokens: int, cache_len: int | None) -> int:
    """The K/V cache's length for a prompt of `tokens`: cache_len (room for later tokens) or the prompt's own."""
    length = tokens if cache_len is None else cache_len
    if length < tokens:
        raise ValueError(f"cache_len {length} is shorter than the prompt ({tokens} tokens)")
    return length


@struct.dataclass
class Cache:
    """What a decode step continues from, for the layers of one range, in either family.

    Slot i of `key`/`value` belongs to the range's i-th full-attention layer (`full_layer_ids[i]`, a global id);
    slot i of `conv`/`recurrent` to its i-th layer with a recurrent state (`linear_layer_ids[i]`: a Gated DeltaNet
    layer of Qwen3.5, a Mamba-2 layer of Nemotron-H). MoE and MLP layers hold no slot. A stage never holds a slot
    for a layer outside its range.
    """

    key: jax.Array  # [n_full, B, S, nkv, hd]
    value: jax.Array  # [n_full, B, S, nkv, hd]
    conv: jax.Array  # [n_linear, B, *cfg.conv_state_shape]: [conv channels, K-1]
    recurrent: jax.Array  # [n_linear, B, *cfg.recurrent_state_shape] fp32 (Qwen3.5 [HV, dk, dv], Nemotron-H [H, P, N])
    lengths: jax.Array  # [B] int32: tokens held per sequence
    full_layer_ids: tuple[int, ...] = struct.field(pytree_node=False)
    linear_layer_ids: tuple[int, ...] = struct.field(pytree_node=False)

    @property
    def capacity(self) -> int:
        return self.key.shape[2]

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in (self.key, self.value, self.conv, self.recurrent))

    @staticmethod
    def assemble(cfg: FamilyConfig, dtype, *, key, value, conv, recurrent, lengths, batch: int, cache_len: int,
                 full_layer_ids, linear_layer_ids, device=None) -> "Cache":
        """A Cache from stacked leaves; a leaf given as None (a range without full-attention or without linear
        layers) becomes an empty [0, ...] array of the right trailing shape on `device` (where the cache lives, not
        the default device)."""
        def leaf(x, shape, dt):
            return x if x is not None else jnp.zeros(shape, dt, device=device)

        kv = (0, batch, cache_len, cfg.num_key_value_heads, cfg.head_dim)
        return Cache(
            key=leaf(key, kv, dtype),
            value=leaf(value, kv, dtype),
            conv=leaf(conv, (0, batch, *cfg.conv_state_shape), dtype),
            recurrent=leaf(recurrent, (0, batch, *cfg.recurrent_state_shape), jnp.float32),
            lengths=lengths,
            full_layer_ids=tuple(full_layer_ids),
            linear_layer_ids=tuple(linear_layer_ids),
        )

    @staticmethod
    def concat_batch(caches: list["Cache"]) -> "Cache":
        """Joins caches of the same layers computed for consecutive slices of a batch (microbatches)."""
        first = caches[0]
        if len(caches) == 1:
            return first
        if any(c.full_layer_ids != first.full_layer_ids or c.linear_layer_ids != first.linear_layer_ids for c in caches):
            raise ValueError("caches of different layer ranges cannot be joined along the batch")
        cat = lambda name, axis: jnp.concatenate([getattr(c, name) for c in caches], axis=axis)  # noqa: E731
        return first.replace(key=cat("key", 1), value=cat("value", 1), conv=cat("conv", 1),
                             recurrent=cat("recurrent", 1), lengths=cat("lengths", 0))

    @staticmethod
    def concat_layers(caches: list["Cache"], device=None) -> "Cache":
        """Joins the caches of consecutive layer ranges (pipeline stages) into one, on `device`."""
        moved = [jax.device_put(c, device) for c in caches] if device is not None else caches
        cat = lambda name: jnp.concatenate([getattr(c, name) for c in moved], axis=0)  # noqa: E731
        return Cache(key=cat("key"), value=cat("value"), conv=cat("conv"), recurrent=cat("recurrent"),
                     lengths=moved[0].lengths,
                     full_layer_ids=sum((c.full_layer_ids for c in caches), ()),
                     linear_layer_ids=sum((c.linear_layer_ids for c in caches), ()))

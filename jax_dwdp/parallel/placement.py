"""Where a stage's weights go on a 1-D 'dwdp' mesh (a pipeline stage's row, or independent ranks' devices), and a
stage built one layer at a time onto it.

Non-expert weights are replicated on every rank. A routed-expert weight ([E, ...] per layer) goes where the expert
backend's placement puts it (jax_dwdp.parallel.backends): on every rank (`Placement`, the replicated baseline),
split by rank (`SplitPlacement`: padded to N * ceil(E/N) slots, rank r holds block r, `ExpertLayout`), or copied
block by block into a CUDA VMM expert store (`StorePlacement`), the XLA array then a scalar placeholder.

`build_placed` makes a stage one layer at a time, each layer placed (and, when it was made for this stage, freed)
before the next is made: no device ever holds a whole stage's experts on the way. (Building the whole stage on one
device and then splitting it held all its experts plus a rank's block on the first device: 95 GiB per GPU for
35B-A3B over two ranks, where a rank's share is about 35.)
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dwdp.devices import put
from jax_dwdp.families import FamilyConfig
from jax_dwdp.model import (CausalLM, abstract_model, expert_weight_index, fused_swiglu_enabled, set_fused_swiglu,
                            with_kernels)
from jax_dwdp.parallel.expert_layout import ExpertLayout
from jax_dwdp.progress import layers
from jax_dwdp.sources import AXIS


def pad_experts(array, layout: ExpertLayout):
    """[E, ...] -> [N * ceil(E/N), ...] with zero padding slots at the end."""
    pad = layout.padded_experts - array.shape[0]
    if pad == 0:
        return array
    return jnp.concatenate([array, jnp.zeros((pad, *array.shape[1:]), array.dtype)], axis=0)


class Placement:
    """Every weight of a stage replicated on every rank of `mesh`, its experts too (the replicated baseline); the
    subclasses place the experts otherwise. `owned`: the arrays handed in belong to the builder (a layer made for
    this stage), which frees each layer's once it is placed (build_placed); otherwise (a caller's model) they are
    left alone. (They are freed by dropping them, not `delete()`: a replicated placement may share the buffer of
    the array it came from on that device.)"""

    def __init__(self, mesh: Mesh, *, owned: bool = False):
        self.mesh, self.owned = mesh, owned
        self.split, self.replicated = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())

    def __call__(self, path: tuple, value: jax.Array, layer: int | None, num_experts: int) -> jax.Array:
        """`value` of the flat state path `path`; `layer`: the index of its layer among the stage's layers with
        routed experts (`model.expert_slots`; every layer for Qwen3.5), None for a layer without."""
        weight = expert_weight_index(path)
        if weight is None:
            return put(value, self.replicated)
        layout = ExpertLayout(num_experts, self.mesh.shape[AXIS])
        return self.experts(value, weight, layer, layout)

    def experts(self, value, weight: int, layer: int, layout: ExpertLayout) -> jax.Array:
        return put(value, self.replicated)


class SplitPlacement(Placement):
    """Experts padded to N * ceil(E/N) slots and split by rank (P('dwdp')): DWDP over XLA, and DEP."""

    def experts(self, value, weight, layer, layout):
        padded = pad_experts(value, layout)
        placed = put(padded, self.split)
        if padded is not value:
            padded.delete()
        return placed


class StorePlacement(Placement):
    """Each rank's block of the experts copied into `store` (an open dwdp_ffi.ExpertStore over the mesh's devices,
    in order; or, one process per device, a ProcessExpertStore, which takes this process's block alone); the XLA
    array becomes a scalar placeholder, so the XLA copy of a layer's experts is gone before the next layer is made."""

    def __init__(self, mesh: Mesh, store, *, owned: bool = False):
        super().__init__(mesh, owned=owned)
        self.store = store
        _check_store_matches_mesh(store, mesh)

    def experts(self, value, weight, layer, layout):
        padded = pad_experts(value, layout)
        for rank, device in self.store.own_ranks():  # one process per device: its own rank only
            block, copied = own_block(padded, rank, layout.slots_per_rank, device)
            self.store.fill(layer, weight, rank, block)
            if copied:
                block.delete()
        if padded is not value:
            padded.delete()
        return put(jnp.zeros((), value.dtype), self.replicated)


def _check_store_matches_mesh(store, mesh: Mesh) -> None:
    """The store's ranks are the mesh's: as many, and each rank this process fills on the mesh's device of that
    rank (a store made over other devices, or in another order, would hand each rank another rank's experts)."""
    ranks = list(mesh.devices.flat)
    if store.num_ranks != len(ranks):
        raise ValueError(f"expert store of {store.num_ranks} rank(s) for a '{AXIS}' mesh of {len(ranks)} device(s)")
    for rank, device in store.own_ranks():
        if ranks[rank] != device:
            raise ValueError(f"expert store rank {rank} is on {device}, but the '{AXIS}' mesh puts rank {rank} on "
                             f"{ranks[rank]}: make the store over the mesh's devices, in mesh order")


def own_block(padded, rank: int, slots: int, device) -> tuple[jax.Array, bool]:
    """Rank `rank`'s block [slots, ...] of a layer's padded experts, on `device` (this process's), and whether it is
    a copy: the shard `device` already holds when `padded` is split over processes (loaded split), else a slice."""
    if isinstance(padded, jax.Array) and not padded.is_fully_addressable:
        for shard in padded.addressable_shards:
            if shard.device == device and (shard.index[0].start or 0) == rank * slots and \
                    shard.data.shape[0] == slots:
                return shard.data, False
        raise ValueError(f"rank {rank}'s expert block (slots [{rank * slots}, {(rank + 1) * slots})) is not a shard "
                         f"of the placed experts on {device}")
    return jax.device_put(padded[rank * slots:(rank + 1) * slots], device), True


def place_model(model: CausalLM, mesh: Mesh, *, split_experts: bool = True) -> CausalLM:
    """A model (or stage) on a 1-D 'dwdp' mesh: expert weights split by rank (padded to N * ceil(E/N) slots), the
    rest replicated; split_experts=False replicates everything (the no-communication baseline). `model` is left
    as it was (its arrays stay where they are)."""
    placement = SplitPlacement(mesh) if split_experts else Placement(mesh)
    return build_placed(model.cfg, model.start_layer, model.end_layer, lambda a, b: model_range(model, a, b),
                        placement, dtype=model.dtype)


def model_range(model: CausalLM, start_layer: int, end_layer: int) -> CausalLM:
    """Layers [start_layer, end_layer) of `model` (global ids, inside its range) as a model of that range that
    shares `model`'s arrays (nothing is copied), with its embedding / head if the range has them."""
    graphdef, abstract = nnx.split(abstract_model(model.cfg, dtype=model.dtype, start_layer=start_layer,
                                                  end_layer=end_layer, kernels=model.kernels))
    full = dict(nnx.to_flat_state(nnx.state(model)))
    leaves = []
    for path, var in nnx.to_flat_state(abstract):
        src = ("layers", path[1] + start_layer - model.start_layer, *path[2:]) if path[0] == "layers" else path
        leaves.append((path, type(var)(full[src].get_value())))
    part = nnx.merge(graphdef, nnx.from_flat_state(leaves))
    return set_fused_swiglu(part, _interleaved(model), permute=False)  # the weights came in their layout


def _interleaved(model) -> bool:
    """Whether the model's SwiGLU experts are in the fused layout (a Nemotron-H model has none: False)."""
    return fused_swiglu_enabled(model)


def build_placed(cfg: FamilyConfig, start_layer: int, end_layer: int, make_range, placement: Placement, *,
                 dtype) -> CausalLM:
    """The stage [start_layer, end_layer) with every weight placed by `placement`, built one layer at a time.

    make_range(a, b) returns the model of layers [a, b) (weights anywhere, e.g. random or loaded on one device);
    each layer's arrays are placed before the next layer is made, and (with an `owned` placement) freed once
    placed, so the device that makes them never holds more than one layer of them beside what it keeps. The stage
    takes the parts' kernel choices."""
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype=dtype, start_layer=start_layer, end_layer=end_layer))
    wanted = {path for path, _ in nnx.to_flat_state(abstract)}
    slot = {layer: k for k, layer in enumerate(cfg.moe_layer_ids(start_layer, end_layer))}  # its expert layer
    values: dict = {}
    interleaved, kernels = False, None
    with layers(f"building layers [{start_layer}, {end_layer})", end_layer - start_layer) as bar:
        for layer in range(start_layer, end_layer):
            part = make_range(layer, layer + 1)
            interleaved, kernels = _interleaved(part), part.kernels
            nbytes = 0
            for path, var in nnx.to_flat_state(nnx.state(part)):
                target = ("layers", layer - start_layer, *path[2:]) if path[0] == "layers" else path
                if target in wanted:
                    value = var.get_value()
                    nbytes += value.nbytes
                    values[target] = type(var)(placement(target, value, slot.get(layer), cfg.num_experts))
            del part, var
            if placement.owned:
                gc.collect()  # flax modules hold reference cycles: their arrays go only with a collection
            bar.advance(nbytes)
    stage = nnx.merge(graphdef, nnx.from_flat_state([(path, values[path]) for path, _ in
                                                     nnx.to_flat_state(abstract)]))
    stage = set_fused_swiglu(stage, interleaved, permute=False)
    return stage if kernels is None or stage.kernels == kernels else with_kernels(stage, kernels)


def expert_blocks(model: CausalLM) -> list[tuple[jax.Array, jax.Array] | None]:
    """Each layer's two routed-expert weights of a model or stage (Qwen3.5: gate_up_proj, down_proj; Nemotron-H:
    up_proj, down_proj), in its layer order; None for a layer without experts."""
    return [layer.expert_weights() for layer in model.layers]


def by_rank(array: jax.Array) -> list[jax.Array]:
    """The shards of an array split P('dwdp'), in rank order, each on its own device."""
    return [s.data for s in sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)]

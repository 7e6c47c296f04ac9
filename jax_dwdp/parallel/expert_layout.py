"""Which experts each DWDP rank stores: pure arithmetic, no devices.

Rank r of N owns a contiguous block of every MoE layer's experts. When N divides E the blocks are E / N experts
each. Otherwise each rank gets S = ceil(E / N) expert slots and the slots past E (on the last ranks) hold zero
padding: the gathered expert set is then [N * S, ...] with experts 0..E-1 in order and padding after them, the
router never picks a padding slot (its ids are < E), so its group size is 0 and no kernel reads it. Nothing is
reordered or copied to undo the padding; the cost is at most N - 1 zero experts per layer across all ranks.
(TensorRT-LLM's alternative overlaps the blocks instead; with padding every rank's block has the same shape,
which is what a sharded XLA array and a composite virtual address both want.)
"""

from __future__ import annotations

import dataclasses
import math

from jax_dwdp.families import FamilyConfig


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    num_experts: int
    ranks: int

    def __post_init__(self):
        if self.ranks < 1 or self.num_experts < 1:
            raise ValueError(f"need >= 1 experts and ranks, got E={self.num_experts} N={self.ranks}")
        if self.ranks > self.num_experts:
            raise ValueError(f"{self.ranks} DWDP ranks for {self.num_experts} experts: a rank would own none")

    @property
    def slots_per_rank(self) -> int:
        return math.ceil(self.num_experts / self.ranks)

    @property
    def padded_experts(self) -> int:
        return self.slots_per_rank * self.ranks

    def owned(self, rank: int) -> range:
        """The real experts rank `rank` stores."""
        start = rank * self.slots_per_rank
        return range(min(start, self.num_experts), min(start + self.slots_per_rank, self.num_experts))

    def padding_slots(self, rank: int) -> int:
        return self.slots_per_rank - len(self.owned(rank))

    def owner(self, expert: int) -> int:
        return expert // self.slots_per_rank


def expert_bytes_per_layer(cfg: FamilyConfig, itemsize: int) -> int:
    """The bytes of one expert's two weights (Qwen3.5: gate_up_proj + down_proj; Nemotron-H: up_proj + down_proj)."""
    return sum(math.prod(shape) for shape in cfg.expert_shapes) * itemsize


# The CUDA VMM allocation granularity (cuMemGetAllocationGranularity, recommended) of the H100 and H200: the store
# reads its experts in place when each rank's block of each weight is a multiple of it (the store asks the driver).
VMM_GRANULARITY = 2 << 20
SLOT_SETS = 2  # in place: layer l reads one set of slots while layer l+1's peers are copied into the other


def store_reads_in_place(cfg: FamilyConfig, layout: ExpertLayout, itemsize: int,
                         granularity: int = VMM_GRANULARITY) -> bool:
    """Whether the FFI store's views are contiguous [E, ...] tensors: every rank block a granularity multiple."""
    return all(layout.slots_per_rank * math.prod(shape) * itemsize % granularity == 0 for shape in cfg.expert_shapes)


def rank_memory(cfg: FamilyConfig, layout: ExpertLayout, rank: int, num_moe_layers: int, itemsize: int, *,
                prefetch: bool = True, non_expert_bytes: int | None = None) -> dict:
    """Resident expert bytes of a rank (its slots of every layer) and what its prefetch needs besides.

    The FFI store in place (`store_mode` "in_place": every rank block a multiple of the VMM granularity, as at every
    published size) holds store-owned slots for the peers' blocks of two layers (`store_slot_bytes`; the one the MoE
    reads and the next being copied) and no XLA buffer: only the peers' experts move, `peer_bytes_per_layer` over
    NVLink. Copying out ("copy") it holds two layers' full expert sets in XLA buffers (`prefetch_buffer_bytes`) and
    also copies its own block HBM to HBM (`local_copy_bytes_per_layer`). The XLA all-gather holds two gathered layers
    with the padding slots (`xla_gather_buffer_bytes`). prefetch=False (DEP: the experts never move, the tokens do;
    or one rank) has none of these. With `non_expert_bytes` (the stage's other weights, which every rank holds),
    `resident_bytes` is everything the rank keeps: those plus its experts."""
    per_expert = expert_bytes_per_layer(cfg, itemsize)
    owned = len(layout.owned(rank))
    peer_experts = cfg.num_experts - owned
    in_place = store_reads_in_place(cfg, layout, itemsize)
    slot_bytes = SLOT_SETS * (layout.ranks - 1) * sum(
        -(-layout.slots_per_rank * math.prod(shape) * itemsize // VMM_GRANULARITY) * VMM_GRANULARITY
        for shape in cfg.expert_shapes)
    out = {
        "rank": rank,
        "experts_owned": [layout.owned(rank).start, layout.owned(rank).stop],
        "padding_slots": layout.padding_slots(rank),
        "resident_expert_bytes": num_moe_layers * layout.slots_per_rank * per_expert,
        "store_mode": ("in_place" if in_place else "copy") if prefetch else "none",
        "store_slot_bytes": slot_bytes if prefetch and in_place else 0,
        "prefetch_buffer_bytes": 2 * cfg.num_experts * per_expert if prefetch and not in_place else 0,
        "xla_gather_buffer_bytes": 2 * layout.padded_experts * per_expert if prefetch else 0,
        "peer_bytes_per_layer": peer_experts * per_expert if prefetch else 0,
        "local_copy_bytes_per_layer": owned * per_expert if prefetch and not in_place else 0,
    }
    if non_expert_bytes is not None:
        out["resident_bytes"] = non_expert_bytes + out["resident_expert_bytes"]
    return out

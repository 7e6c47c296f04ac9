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

from jax_dwdp.config import ModelConfig


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


def expert_bytes_per_layer(cfg: ModelConfig, itemsize: int) -> int:
    """gate_up_proj + down_proj bytes of one expert."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * itemsize


def rank_memory(cfg: ModelConfig, layout: ExpertLayout, rank: int, num_moe_layers: int, itemsize: int, *,
                prefetch: bool = True, non_expert_bytes: int | None = None) -> dict:
    """Resident expert bytes of a rank (its slots of every layer) and its prefetch buffers: two layers' full expert
    sets (the one the MoE reads and the next being copied). The FFI path copies the E real experts (local block
    included, so the grouped matmul sees one contiguous [E, ...] array); the XLA all-gather also gathers the padding
    slots. Of those bytes, `peer_bytes_per_layer` cross NVLink per layer. prefetch=False (DEP: the experts never
    move, the tokens do) has no prefetch buffers. With `non_expert_bytes` (the stage's other weights, which every
    rank holds), `resident_bytes` is everything the rank keeps: those plus its experts."""
    per_expert = expert_bytes_per_layer(cfg, itemsize)
    peer_experts = cfg.num_experts - len(layout.owned(rank))
    out = {
        "rank": rank,
        "experts_owned": [layout.owned(rank).start, layout.owned(rank).stop],
        "padding_slots": layout.padding_slots(rank),
        "resident_expert_bytes": num_moe_layers * layout.slots_per_rank * per_expert,
        "prefetch_buffer_bytes": 2 * cfg.num_experts * per_expert if prefetch else 0,
        "xla_gather_buffer_bytes": 2 * layout.padded_experts * per_expert if prefetch else 0,
        "peer_bytes_per_layer": peer_experts * per_expert if prefetch else 0,
    }
    if non_expert_bytes is not None:
        out["resident_bytes"] = non_expert_bytes + out["resident_expert_bytes"]
    return out

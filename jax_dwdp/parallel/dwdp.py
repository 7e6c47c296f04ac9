"""DWDP (distributed weight data parallelism): where the experts are stored, and independent ranks.

N ranks each run their own sequences against all experts. Each rank stores one block of every MoE layer's experts
(`ExpertLayout`); non-expert weights are replicated. No token leaves its rank: the expert weights come to the
tokens, one layer ahead (the stage runner schedules it, an expert source moves them; see runner.py, experts.py).

Two ways to run the ranks:
- SPMD over a 1-D 'dwdp' mesh (a Pipeline stage's row): `place_model` splits the experts over the row, one
  program runs every rank on an equal share of the batch (`Gather` or `Store` experts).
- `IndependentRanks`: each rank runs its own batch, of its own length, as its own programs on its own device
  (`PeerCopy` or `Store` experts). Ranks share no collective, so a rank with a short sequence never waits for
  one with a long sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dwdp.model import Qwen35MoeForCausalLM
from jax_dwdp.model.qwen35_moe import LogitsMode
from jax_dwdp.parallel.expert_layout import ExpertLayout
from jax_dwdp.parallel.experts import AXIS, PeerCopy, Store, is_expert_weight
from jax_dwdp.parallel.mesh import cpu_barrier
from jax_dwdp.parallel.runner import StageRunner

EXPERT_CHOICES = ("local", "xla", "ffi")


def check_experts_choice(experts: str, ranks: int, choices=EXPERT_CHOICES) -> None:
    """One clear error for an experts backend that cannot run with `ranks` DWDP ranks."""
    if experts not in choices:
        raise ValueError(f"experts {experts!r}: choose one of {', '.join(choices)}")
    if experts != "local" and ranks < 2:
        raise ValueError(f"experts {experts!r} (DWDP) needs DWDP ranks > 1; one rank holds its experts: 'local'")


def pad_experts(array, layout: ExpertLayout):
    """[E, ...] -> [N * ceil(E/N), ...] with zero padding slots at the end."""
    pad = layout.padded_experts - array.shape[0]
    if pad == 0:
        return array
    return jnp.concatenate([array, jnp.zeros((pad, *array.shape[1:]), array.dtype)], axis=0)


def place_model(model: Qwen35MoeForCausalLM, mesh: Mesh, *, split_experts: bool = True) -> Qwen35MoeForCausalLM:
    """A model (or stage) on a 1-D 'dwdp' mesh: expert weights split by rank (padded to N * ceil(E/N) slots), the
    rest replicated; split_experts=False replicates everything (the no-communication baseline)."""
    layout = ExpertLayout(model.cfg.num_experts, mesh.shape[AXIS])
    graphdef, state = nnx.split(model)
    split, replicated = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
    leaves = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if split_experts and is_expert_weight(path):
            placed = jax.device_put(pad_experts(value, layout), split)
        else:
            placed = jax.device_put(value, replicated)
        leaves.append((path, type(var)(placed)))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def expert_blocks(model: Qwen35MoeForCausalLM) -> list[tuple[jax.Array, jax.Array]]:
    """Each layer's (gate_up_proj, down_proj) of a model or stage, in its layer order."""
    return [(layer.mlp.experts.gate_up_proj[...], layer.mlp.experts.down_proj[...]) for layer in model.layers]


class IndependentRanks:
    """DWDP ranks that run independently: each its own batch and length, no collective between them.

    Rank r holds the non-expert weights and its own expert blocks on device r, and runs the model through its own
    StageRunner (layer-wise programs). experts="xla": the peers' blocks of layer l+1 are copied device-to-device
    before layer l is enqueued (PeerCopy). experts="ffi" (GPUs): the blocks move into a CUDA VMM ExpertStore that
    this object owns; `close()` (or leaving a `with` block) releases it.
    """

    def __init__(self, model: Qwen35MoeForCausalLM, devices: list[jax.Device], *, experts: str = "xla"):
        if not (model.is_first and model.is_last):
            raise ValueError("independent DWDP ranks run whole models (use a Pipeline for stages)")
        check_experts_choice(experts, 2, ("xla", "ffi"))
        if experts == "ffi":
            from jax_dwdp.parallel.dwdp_ffi import require_gpus

            require_gpus(devices)  # before any weights are placed
        self.model, self.devices = model, list(devices)
        self.store = None
        layout = ExpertLayout(model.cfg.num_experts, len(devices))
        slots = layout.slots_per_rank
        blocks = [[tuple(jax.device_put(pad_experts(w, layout)[r * slots:(r + 1) * slots], d) for w in layer)
                   for r, d in enumerate(self.devices)] for layer in expert_blocks(model)]
        barrier = cpu_barrier(self.devices[0].platform)
        if experts == "ffi":
            from jax_dwdp.parallel.dwdp_ffi import ExpertStore

            # blocks[layer][weight][rank]; the store holds the only copy of each rank's experts afterwards.
            self.store = ExpertStore.from_blocks(
                self.devices, [[[rank[w] for rank in layer] for w in range(2)] for layer in blocks],
                model.cfg.num_experts)
            self.source = Store(self.store)
        else:
            self.source = PeerCopy(self.devices, blocks, barrier)
        try:
            self.runners = [StageRunner(model, self.source, device=d, barrier=barrier) for d in self.devices]
        except BaseException as e:
            self.close(e)
            raise

    def close(self, exc: BaseException | None = None) -> None:
        """Releases the FFI store, if any; while `exc` propagates, a failure to close only warns (close_store)."""
        if self.store is not None:
            from jax_dwdp.parallel.dwdp_ffi import close_store

            close_store(self.store, exc)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(exc)

    def prefill(self, rank: int, tokens, lengths=None, *, logits: LogitsMode = "all", cache_len: int | None = None):
        """Rank `rank` prefills its own batch; returns (logits, cache) on its device.

        The call returns once the rank's layers are enqueued, but that takes host time (tens of ms for a deep model
        on GPUs), so calling it for each rank in turn starts each rank only after the previous one is enqueued: use
        `prefill_all` to run the ranks at the same time."""
        tokens, lengths = self._check(rank, tokens, lengths, cache_len)
        return self._prefill(rank, tokens, lengths, logits, cache_len, sync_on_error=True)

    def _check(self, rank: int, tokens, lengths, cache_len):
        from jax_dwdp.prefill import check_tokens

        if not 0 <= rank < len(self.runners):
            raise ValueError(f"rank {rank} is not one of this driver's {len(self.runners)} ranks")
        tokens, lengths = check_tokens(tokens, self.model.cfg.vocab_size, lengths)
        if cache_len is not None and cache_len < tokens.shape[1]:
            raise ValueError(f"cache_len {cache_len} is shorter than rank {rank}'s prompt ({tokens.shape[1]} tokens)")
        return tokens, lengths

    def _prefill(self, rank, tokens, lengths, logits, cache_len, *, sync_on_error):
        """prefill on inputs `_check` has already validated."""
        return self.runners[rank](tokens, lengths, logits=logits, cache_len=cache_len, abort_on_error=sync_on_error)

    def prefill_all(self, work, *, logits: LogitsMode = "all", cache_len: int | None = None,
                    threads: bool | None = None) -> dict:
        """Every rank's own batch at once: work = {rank: (tokens, lengths or None)} -> {rank: (logits, cache)}.

        Each rank's layers are enqueued from its own host thread (threads=None: on GPUs, not on the CPU), so the
        host time one rank spends dispatching its layer programs does not hold back the next rank's first layer.
        Every rank's input is checked before any rank starts. If a rank fails, the others are waited for, the
        expert source is aborted once (the FFI store's pending copies drained), and the first error is raised.
        """
        from concurrent.futures import ThreadPoolExecutor, wait

        work = {r: self._check(r, t, n, cache_len) for r, (t, n) in dict(work).items()}
        if threads is None:
            # XLA's CPU client runs every host "device" on one small thread pool; two dispatching threads can
            # deadlock it (seen with jax 0.10.2, see cpu_barrier), so the CPU runs the ranks in turn.
            threads = len(work) > 1 and self.devices[0].platform != "cpu"
        if not threads:
            return {r: self._prefill(r, t, n, logits, cache_len, sync_on_error=True) for r, (t, n) in work.items()}
        with ThreadPoolExecutor(max_workers=len(work), thread_name_prefix="dwdp-rank") as pool:
            # No rank aborts on its own error: that would drop the other ranks' pending copies.
            futures = {r: pool.submit(self._prefill, r, t, n, logits, cache_len, sync_on_error=False)
                       for r, (t, n) in work.items()}
            wait(futures.values())
        errors = [f.exception() for f in futures.values() if f.exception() is not None]
        if errors:
            self.source.abort()
            raise errors[0]
        return {r: f.result() for r, f in futures.items()}

"""DWDP (distributed weight data parallelism) with independent ranks.

N ranks each run their own sequences against all experts. Each rank stores one block of every MoE layer's experts
(`ExpertLayout`); non-expert weights are replicated. No token leaves its rank: the expert weights come to the
tokens, one layer ahead (the stage runner schedules it, the expert backend's source moves them; see
jax_dwdp/runner.py, jax_dwdp/parallel/backends.py).

Two ways to run the ranks:
- SPMD over a 1-D 'dwdp' mesh (a `Pipeline` stage's row): one program runs every rank on an equal share of the
  batch.
- `IndependentRanks` (here): each rank runs its own batch, of its own length, as its own programs on its own device.
  Ranks share no collective, so a rank with a short sequence never waits for one with a long sequence.

Memory: a rank holds its block of the experts, the non-expert weights, two layers' expert buffers and its
activations (`jax-dwdp plan`). The ranks' weights are built one layer at a time (`build_placed`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jax_dwdp.families import FamilyConfig
from jax_dwdp.model import CausalLM, init_model
from jax_dwdp.model.cache import LogitsMode
from jax_dwdp.parallel.backends import ExpertBackend, FfiBackend, expert_backend
from jax_dwdp.parallel.checkpoint_layers import CheckpointLayers
from jax_dwdp.parallel.placement import build_placed, model_range
from jax_dwdp.prefill import check_tokens
from jax_dwdp.runner import StageRunner
from jax_dwdp.sources import AXIS
from jax_dwdp.weights.hf_loader import load_config


class IndependentRanks:
    """DWDP ranks that run independently: each its own batch and length, no collective between them.

    Rank r holds the non-expert weights and its own expert blocks on device r, and runs the model through its own
    StageRunner (layer-wise programs). experts="xla": the peers' blocks of layer l+1 are copied device-to-device
    before layer l is enqueued. experts="ffi" (GPUs): the blocks live in a CUDA VMM expert store that the backend
    owns; `close()` (or leaving a `with` block) releases it. experts="local": every rank holds every expert (the
    replicated baseline), nothing moves. `experts` is a word of backends.BACKENDS or an ExpertBackend.

    `IndependentRanks(model, devices)` copies a whole model's weights onto the ranks and leaves `model` as it
    was (the caller's model keeps its own memory); `random` and `from_checkpoint` build the ranks' weights one
    layer at a time (build_placed), so no device ever holds more than its share plus one layer.
    """

    def __init__(self, model: CausalLM, devices: list[jax.Device], *,
                 experts: str | ExpertBackend = "xla"):
        if not (model.is_first and model.is_last):
            raise ValueError("independent DWDP ranks run whole models (use a Pipeline for stages)")
        self._setup(model.cfg, devices, experts, lambda a, b: model_range(model, a, b), model.dtype, owned=False)

    @classmethod
    def random(cls, cfg: FamilyConfig, devices, *, experts: str | ExpertBackend = "xla", dtype=jnp.bfloat16,
               seed: int = 0, fused_swiglu: bool = False, store_options: dict | None = None,
               kernels=None) -> "IndependentRanks":
        """Random weights (the same model as init_model(cfg, seed=seed)), made one layer at a time on devices[0].
        `store_options` (experts="ffi"): ExpertStore options, e.g. timing=True to read each layer's copy time."""
        if store_options:
            if experts != "ffi":
                raise ValueError(f"store_options are for experts 'ffi', not {experts!r}")
            experts = FfiBackend(**store_options)
        ranks = cls.__new__(cls)
        ranks._setup(cfg, devices, experts, lambda a, b: init_model(
            cfg, dtype=dtype, seed=seed, start_layer=a, end_layer=b, device=devices[0], fused_swiglu=fused_swiglu,
            kernels=kernels),
            dtype, owned=True)
        return ranks

    @classmethod
    def from_checkpoint(cls, directory, devices, *, experts: str | ExpertBackend = "xla", dtype=jnp.bfloat16,
                        cfg: FamilyConfig | None = None, fused_swiglu: bool = False,
                        kernels=None) -> "IndependentRanks":
        """An HF or Orbax checkpoint, loaded one layer at a time onto devices[0] and placed; `load_report`."""
        cfg = cfg or load_config(directory)
        layers = CheckpointLayers(directory, cfg, dtype, devices[0], fused_swiglu=fused_swiglu, kernels=kernels)
        ranks = cls.__new__(cls)
        try:
            ranks._setup(cfg, devices, experts, layers, dtype, owned=True)
        finally:
            layers.close()
        ranks.load_report = layers.report(0, cfg.num_hidden_layers)
        return ranks

    def _setup(self, cfg: FamilyConfig, devices, experts, make_range, dtype, *, owned: bool) -> None:
        self.cfg, self.devices = cfg, list(devices)
        self.backend = expert_backend(experts, independent=True)
        self.experts = self.backend.name
        self.backend.check(self.devices, max(len(self.devices), self.backend.min_ranks))  # before any weights
        mesh = Mesh(np.array(self.devices), (AXIS,))
        try:
            placement = self.backend.placement(mesh, cfg, len(cfg.moe_layer_ids()), dtype, owned=owned)
            placed = build_placed(cfg, 0, cfg.num_hidden_layers, make_range, placement, dtype=dtype)
            self.backend.built(0)
            self.source = self.backend.ranks_source(placed, self.devices)
            self.runners = [StageRunner(placed, self.source, device=d) for d in self.devices]
        except BaseException as e:
            self.close(e)
            raise

    @property
    def store(self):
        """The FFI backend's expert store (None for the other backends)."""
        return getattr(self.backend, "stores", {}).get(0)

    def close(self, exc: BaseException | None = None) -> None:
        """Releases what the expert backend opened (the FFI store); while `exc` propagates, a failure to close only
        warns."""
        self.backend.close(exc)

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
        if not 0 <= rank < len(self.runners):
            raise ValueError(f"rank {rank} is not one of this driver's {len(self.runners)} ranks")
        tokens, lengths = check_tokens(tokens, self.cfg.vocab_size, lengths)
        if cache_len is not None and cache_len < tokens.shape[1]:
            raise ValueError(f"cache_len {cache_len} is shorter than rank {rank}'s prompt ({tokens.shape[1]} tokens)")
        return tokens, lengths

    def _prefill(self, rank, tokens, lengths, logits, cache_len, *, sync_on_error):
        """prefill on inputs `_check` has already validated."""
        return self.runners[rank](tokens, lengths, logits=logits, cache_len=cache_len, mode="layerwise",
                                  abort_on_error=sync_on_error)

    def prefill_all(self, work, *, logits: LogitsMode = "all", cache_len: int | None = None,
                    threads: bool | None = None) -> dict:
        """Every rank's own batch at once: work = {rank: (tokens, lengths or None)} -> {rank: (logits, cache)}.

        Each rank's layers are enqueued from its own host thread (threads=None: whenever there are several), so the
        host time one rank spends dispatching its layer programs does not hold back the next rank's first layer.
        Every rank's input is checked before any rank starts. If a rank fails, the others are waited for, the
        expert source is aborted once (the FFI store's pending copies drained), and the first error is raised.
        """
        work = {r: self._check(r, t, n, cache_len) for r, (t, n) in dict(work).items()}
        if threads is None:
            threads = len(work) > 1
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

"""How the ranks of a stage hold and get their experts: one backend object per choice, looked up by its word.

The word is the same in the command line (`--experts`) and the API (`Pipeline(..., experts=)`,
`IndependentRanks(..., experts=)`), and `BACKENDS` is the one place that maps it to a class:

    word   class          placement          source over a stage's row     source of independent ranks
    local  LocalBackend   Placement          LocalSource                   LocalSource
    xla    XlaBackend     SplitPlacement     XlaGatherSource               XlaPeerCopySource
    ffi    FfiBackend     StorePlacement     FfiStoreSource                FfiStoreSource
    dep    DepBackend     SplitPlacement     DepDispatchSource             (none: DEP's exchange is a collective)

A backend object serves one driver (a `Pipeline` or an `IndependentRanks`) and owns what it opens: the FFI backend
opens one CUDA VMM expert store per stage and releases them in `close()`, the driver's one close path (drivers are
context managers). Adding a backend is one class here and one entry in `BACKENDS`.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from jax_dwdp.distributed import launch_id
from jax_dwdp.families import FamilyConfig
from jax_dwdp.model import expert_slots
from jax_dwdp.parallel.fd_exchange import ExchangeTimeout, FdExchange
from jax_dwdp.parallel.placement import Placement, SplitPlacement, StorePlacement, by_rank, expert_blocks
from jax_dwdp.sources import (DepDispatchSource, ExpertSource, FfiStoreSource, LocalSource, XlaGatherSource,
                              XlaPeerCopySource)

CONNECT_TIMEOUT_S = 600.0  # how long a process's store waits for its peers' (they may still be loading weights)


class ExpertBackend:
    """One way for N ranks to hold and get their experts. Subclasses set the class attributes and the methods."""

    name: str = ""  # the word, in BACKENDS
    scheme: str = "DWDP"  # what the ranks are called in messages: DWDP, DEP, or replicated
    min_ranks = 2  # fewest ranks it can run over (one rank holds its own experts: 'local')
    independent = True  # can serve IndependentRanks (ranks without a collective between them)
    splits_experts = True  # each rank keeps its block of the experts (a checkpoint's experts load split)
    summary = ""  # one line for --help and errors

    def check(self, devices, ranks: int) -> None:
        """Refuses, before any weights are made, what this backend cannot run: too few ranks, the wrong devices."""
        if ranks < self.min_ranks:
            raise ValueError(f"experts {self.name!r} ({self.scheme}) needs {self.scheme} ranks > 1; one rank holds "
                             f"its experts: 'local'")

    def placement(self, row: Mesh, cfg: FamilyConfig, num_layers: int, dtype, *, owned: bool,
                  stage: int = 0) -> Placement:
        """Where stage `stage`'s weights go on its row (a 1-D 'dwdp' mesh); `num_layers`: the stage's layers with
        routed experts."""
        raise NotImplementedError

    def built(self, stage: int) -> None:
        """Stage `stage` is built and placed (the FFI store's processes then trade their blocks)."""

    def stage_source(self, stage: int, model, row: Mesh) -> ExpertSource:
        """The experts of stage `stage` (placed on `row`) for a runner over the row's ranks (shard_map)."""
        raise NotImplementedError

    def ranks_source(self, model, devices) -> ExpertSource:
        """The experts of a whole model placed over `devices`, for one runner per device (IndependentRanks)."""
        raise NotImplementedError

    def close(self, exc: BaseException | None = None) -> None:
        """Releases what the backend opened; while `exc` propagates, a failure to close only warns."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exc)


class LocalBackend(ExpertBackend):
    name, scheme, min_ranks, splits_experts = "local", "replicated", 1, False
    summary = "every rank holds all experts (one device; with N ranks the replicated baseline); nothing moves"

    def placement(self, row, cfg, num_layers, dtype, *, owned, stage=0):
        return Placement(row, owned=owned)

    def stage_source(self, stage, model, row):
        return LocalSource()

    def ranks_source(self, model, devices):
        return LocalSource()


class XlaBackend(ExpertBackend):
    name = "xla"
    summary = "DWDP: each rank stores 1/N of the experts; XLA all-gathers (or copies) layer l+1's while layer l runs"

    def placement(self, row, cfg, num_layers, dtype, *, owned, stage=0):
        return SplitPlacement(row, owned=owned)

    def stage_source(self, stage, model, row):
        return XlaGatherSource(expert_blocks(model), row)

    def ranks_source(self, model, devices):
        # blocks[layer][rank]: rank r's shard of the split experts (a view, nothing is copied)
        return XlaPeerCopySource(devices, [None if layer is None else list(zip(*(by_rank(w) for w in layer)))
                                           for layer in expert_blocks(model)])


class DepBackend(ExpertBackend):
    name, scheme, independent = "dep", "DEP", False
    summary = "DEP: each rank stores 1/N of the experts; each MoE sends its tokens to their experts and back"

    def placement(self, row, cfg, num_layers, dtype, *, owned, stage=0):
        return SplitPlacement(row, owned=owned)

    def stage_source(self, stage, model, row):
        return DepDispatchSource(expert_blocks(model))


class FfiBackend(ExpertBackend):
    """DWDP through CUDA VMM expert stores (GPUs): one store per stage, owned here. `store_options` go to each
    store (e.g. timing=True to read each layer's copy time)."""

    name = "ffi"
    summary = "DWDP through a CUDA VMM expert store (GPUs): layer l+1's peer experts copied on a side stream"

    def __init__(self, **store_options):
        self.store_options = store_options
        self.stores: dict[int, object] = {}

    def check(self, devices, ranks):
        super().check(devices, ranks)
        from jax_dwdp.parallel.dwdp_ffi import load_library, require_gpus  # CUDA-only: loaded when chosen

        require_gpus(devices)
        load_library()

    def placement(self, row, cfg, num_layers, dtype, *, owned, stage=0):
        if num_layers == 0:  # a stage without MoE layers (Nemotron-H) has no experts to store
            return Placement(row, owned=owned)
        self.stores[stage] = self._open(row, cfg, num_layers, dtype, name=f"stage{stage}")
        return StorePlacement(row, self.stores[stage], owned=owned)

    def built(self, stage):
        if stage in self.stores:
            connect_store(self.stores[stage])

    def stage_source(self, stage, model, row):
        if stage not in self.stores:
            return LocalSource()
        return FfiStoreSource(self.stores[stage], row, layers=expert_slots(model))

    def ranks_source(self, model, devices):
        if 0 not in self.stores:
            return LocalSource()
        return FfiStoreSource(self.stores[0], layers=expert_slots(model))

    def close(self, exc=None):
        from jax_dwdp.parallel.dwdp_ffi import close_store

        stores, self.stores = list(self.stores.values()), {}
        for store in stores:
            close_store(store, exc)

    def _open(self, mesh: Mesh, cfg: FamilyConfig, num_layers: int, dtype, *, name: str):
        """An empty expert store over the mesh's devices for `num_layers` layers of `cfg`'s experts (of either
        family: the store holds each expert's two weights at `cfg.expert_shapes`, whatever they are).

        One process driving every device of the mesh: an `ExpertStore` over them. One process per device (the
        mesh's devices in several processes): a `ProcessExpertStore` of this process's device, its rank the
        device's position in the mesh; `connect_store` maps the peer processes' blocks, pairing the stores of the
        processes by `name` (the stage's), which is the same in every process."""
        from jax_dwdp.parallel.dwdp_ffi import ExpertStore, ProcessExpertStore

        shapes = cfg.expert_shapes
        devices = list(mesh.devices.flat)
        mine = [r for r, d in enumerate(devices) if d.process_index == jax.process_index()]
        if len(mine) == len(devices):
            return ExpertStore(devices, num_layers, cfg.num_experts, shapes, dtype, **self.store_options)
        if len(mine) != 1:
            raise ValueError(f"an expert store across processes needs one device of its ranks per process; process "
                             f"{jax.process_index()} drives {len(mine)} of {len(devices)}")
        return ProcessExpertStore(devices[mine[0]], mine[0], len(devices), num_layers, cfg.num_experts, shapes, dtype,
                                  name=name, **self.store_options)


def connect_store(store, *, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """After the store is filled: a `ProcessExpertStore` trades its blocks with its peer processes' stores (the
    store of the same name in every process of the launch, over an FdExchange named by the launch and that name)
    and maps theirs; an `ExpertStore` has them all already. A peer that does not connect within `timeout_s` is named
    in the error."""
    if getattr(store, "connected", True):  # (an ExpertStore of one process has no peers to connect)
        return
    try:
        with FdExchange(f"{launch_id(timeout_s)}-{store.name}", store.rank, store.num_ranks,
                        timeout_s=timeout_s) as exchange:
            store.connect(exchange)
    except ExchangeTimeout as e:
        raise ExchangeTimeout(f"connecting expert store {store.name!r} of rank {store.rank} (the peers' processes "
                              f"must run on this host and open the same stores)", e.missing, timeout_s) from None


BACKENDS: dict[str, type[ExpertBackend]] = {b.name: b for b in (LocalBackend, XlaBackend, FfiBackend, DepBackend)}


def expert_backend(choice: str | ExpertBackend, *, independent: bool = False) -> ExpertBackend:
    """The backend for a word of BACKENDS (a new object, which the driver owns), or `choice` itself if it already
    is one; `independent`: for IndependentRanks, which runs only the backends without a collective."""
    if isinstance(choice, ExpertBackend):
        backend = choice
    elif choice not in BACKENDS:
        raise ValueError(f"experts {choice!r}: choose one of {', '.join(BACKENDS)}")
    else:
        backend = BACKENDS[choice]()
    if independent and not backend.independent:
        usable = ", ".join(name for name, b in BACKENDS.items() if b.independent)
        raise ValueError(f"experts {backend.name!r}: independent ranks run {usable} (DEP exchanges tokens in a "
                         f"collective over the ranks: use a Pipeline)")
    return backend

"""DWDP (distributed weight data parallelism): where the experts are stored, and independent ranks.

N ranks each run their own sequences against all experts. Each rank stores one block of every MoE layer's experts
(`ExpertLayout`); non-expert weights are replicated. No token leaves its rank: the expert weights come to the
tokens, one layer ahead (the stage runner schedules it, an expert source moves them; see runner.py, experts.py).

Two ways to run the ranks:
- SPMD over a 1-D 'dwdp' mesh (a Pipeline stage's row): `place_model` splits the experts over the row, one
  program runs every rank on an equal share of the batch (`Gather`, `Store` or, for DEP, `Dispatch` experts).
- `IndependentRanks`: each rank runs its own batch, of its own length, as its own programs on its own device
  (`PeerCopy` or `Store` experts; `Local` for the replicated baseline). Ranks share no collective, so a rank with a
  short sequence never waits for one with a long sequence.

Memory: a rank should hold its block of the experts, the non-expert weights, two layers' expert buffers and its
activations (`jax-dwdp plan`). `build_placed` builds a stage one layer at a time, each layer made on one device,
placed (`Placement`: experts split, replicated, or moved into a CUDA VMM store) and its source arrays freed before
the next layer is made: no device ever holds a whole stage's experts on the way. (Building the whole stage on
one device and then splitting it held all its experts plus a rank's block on the first device: 95 GiB per GPU
for 35B-A3B over two ranks, where a rank's share is about 35.)
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import Qwen35MoeForCausalLM, abstract_model
from jax_dwdp.model.moe import set_fused_swiglu
from jax_dwdp.model.qwen35_moe import LogitsMode
from jax_dwdp.parallel.expert_layout import ExpertLayout
from jax_dwdp.sources import _EXPERT_WEIGHTS, AXIS, Local, PeerCopy, Store, is_expert_weight
from jax_dwdp.devices import put
from jax_dwdp.runner import StageRunner

EXPERT_CHOICES = ("local", "xla", "ffi", "dep")


def check_experts_choice(experts: str, ranks: int, choices=EXPERT_CHOICES) -> None:
    """One clear error for an experts backend that cannot run with `ranks` DWDP ranks."""
    if experts not in choices:
        raise ValueError(f"experts {experts!r}: choose one of {', '.join(choices)}")
    if experts != "local" and ranks < 2:
        kind = "DEP" if experts == "dep" else "DWDP"
        raise ValueError(f"experts {experts!r} ({kind}) needs {kind} ranks > 1; one rank holds its experts: 'local'")


def pad_experts(array, layout: ExpertLayout):
    """[E, ...] -> [N * ceil(E/N), ...] with zero padding slots at the end."""
    pad = layout.padded_experts - array.shape[0]
    if pad == 0:
        return array
    return jnp.concatenate([array, jnp.zeros((pad, *array.shape[1:]), array.dtype)], axis=0)


class Placement:
    """Where each weight of a stage goes on a 1-D 'dwdp' mesh, one array at a time.

    Non-expert weights are replicated. Expert weights ([E, ...] per layer): experts="split" pads them to
    N * ceil(E/N) slots and splits them by rank (P('dwdp'), `ExpertLayout`); "replicate" puts all of them on every
    rank (the no-communication baseline); "store" copies each rank's block into `store` (an open
    dwdp_ffi.ExpertStore over the mesh's devices, in order; or, one process per device, a ProcessExpertStore,
    which takes this process's block alone) and keeps a scalar placeholder, so that the XLA copy of a layer's
    experts is gone before the next layer is made. `owned`: the arrays handed in belong to the
    builder (a layer made for this stage), which frees each layer's once it is placed (build_placed); otherwise (a
    caller's model) they are left alone. (They are freed by dropping them, not `delete()`: a replicated placement
    may share the buffer of the array it came from on that device.)
    """

    def __init__(self, mesh: Mesh, *, experts: str = "split", store=None, owned: bool = False):
        if experts not in ("split", "replicate", "store") or (experts == "store") != (store is not None):
            raise ValueError(f"placement of experts {experts!r} with store {store!r}")
        self.mesh, self.experts, self.store, self.owned = mesh, experts, store, owned
        self.split, self.replicated = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
        if store is not None:
            _check_store_matches_mesh(store, mesh)

    def __call__(self, path: tuple, value: jax.Array, layer: int, num_experts: int) -> jax.Array:
        """`value` of the flat state path `path`, of the stage's layer `layer` (position in the stage)."""
        if not is_expert_weight(path) or self.experts == "replicate":
            placed = put(value, self.replicated)
        else:
            layout = ExpertLayout(num_experts, self.mesh.shape[AXIS])
            padded = pad_experts(value, layout)
            if self.experts == "split":
                placed = put(padded, self.split)
            else:
                self._fill(layer, _EXPERT_WEIGHTS.index(path[-1]), padded, layout)
                placed = put(jnp.zeros((), value.dtype), self.replicated)
            if padded is not value:
                padded.delete()
        return placed

    def _fill(self, layer, weight, padded, layout):
        # each rank this process fills (one process per device: its own rank only)
        for rank, device in self.store.own_ranks():
            block, copied = own_block(padded, rank, layout.slots_per_rank, device)
            self.store.fill(layer, weight, rank, block)
            if copied:
                block.delete()


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


def place_model(model: Qwen35MoeForCausalLM, mesh: Mesh, *, split_experts: bool = True) -> Qwen35MoeForCausalLM:
    """A model (or stage) on a 1-D 'dwdp' mesh: expert weights split by rank (padded to N * ceil(E/N) slots), the
    rest replicated; split_experts=False replicates everything (the no-communication baseline). `model` is left
    as it was (its arrays stay where they are)."""
    placement = Placement(mesh, experts="split" if split_experts else "replicate")
    return build_placed(model.cfg, model.start_layer, model.end_layer, lambda a, b: model_range(model, a, b),
                        placement, dtype=model.dtype)


def model_range(model: Qwen35MoeForCausalLM, start_layer: int, end_layer: int) -> Qwen35MoeForCausalLM:
    """Layers [start_layer, end_layer) of `model` (global ids, inside its range) as a model of that range that
    shares `model`'s arrays (nothing is copied), with its embedding / head if the range has them."""
    graphdef, abstract = nnx.split(abstract_model(model.cfg, dtype=model.dtype, start_layer=start_layer,
                                                  end_layer=end_layer))
    full = dict(nnx.to_flat_state(nnx.state(model)))
    leaves = []
    for path, var in nnx.to_flat_state(abstract):
        src = ("layers", path[1] + start_layer - model.start_layer, *path[2:]) if path[0] == "layers" else path
        leaves.append((path, type(var)(full[src].get_value())))
    part = nnx.merge(graphdef, nnx.from_flat_state(leaves))
    return set_fused_swiglu(part, _interleaved(model), permute=False)  # the weights came in their layout


def _interleaved(model) -> bool:
    return bool(model.layers[0].mlp.experts.gate_up_interleaved) if len(model.layers) else False


def build_placed(cfg: ModelConfig, start_layer: int, end_layer: int, make_range, placement: Placement, *,
                 dtype) -> Qwen35MoeForCausalLM:
    """The stage [start_layer, end_layer) with every weight placed by `placement`, built one layer at a time.

    make_range(a, b) returns the model of layers [a, b) (weights anywhere, e.g. random or loaded on one device);
    each layer's arrays are placed before the next layer is made, and (with an `owned` placement) freed once
    placed, so the device that makes them never holds more than one layer of them beside what it keeps."""
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype=dtype, start_layer=start_layer, end_layer=end_layer))
    wanted = {path for path, _ in nnx.to_flat_state(abstract)}
    values: dict = {}
    interleaved = False
    for layer in range(start_layer, end_layer):
        part = make_range(layer, layer + 1)
        interleaved = _interleaved(part)
        for path, var in nnx.to_flat_state(nnx.state(part)):
            target = ("layers", layer - start_layer, *path[2:]) if path[0] == "layers" else path
            if target in wanted:
                values[target] = type(var)(placement(target, var.get_value(), layer - start_layer, cfg.num_experts))
        del part, var
        if placement.owned:
            gc.collect()  # flax modules hold reference cycles: their arrays go only with a collection
    stage = nnx.merge(graphdef, nnx.from_flat_state([(path, values[path]) for path, _ in
                                                     nnx.to_flat_state(abstract)]))
    return set_fused_swiglu(stage, interleaved, permute=False)


CONNECT_TIMEOUT_S = 600.0  # how long a process's store waits for its peers' (they may still be loading weights)


def open_store(mesh: Mesh, cfg: ModelConfig, num_layers: int, dtype, *, name: str = "store", **options):
    """An empty CUDA VMM expert store over the mesh's devices for `num_layers` layers of `cfg`'s experts, to be
    filled by a Placement(experts="store") and then connected (`connect_store`).

    One process driving every device of the mesh: an `ExpertStore` over them. One process per device
    (jax.distributed; the mesh's devices in several processes): a `ProcessExpertStore` of this process's device,
    its rank the device's position in the mesh; `connect_store` maps the peer processes' blocks, pairing the stores
    of the processes by `name` (e.g. the pipeline stage's), which must be the same in every process."""
    from jax_dwdp.parallel.dwdp_ffi import ExpertStore, ProcessExpertStore

    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    shapes = ((2 * i, h), (h, i))
    devices = list(mesh.devices.flat)
    mine = [r for r, d in enumerate(devices) if d.process_index == jax.process_index()]
    if len(mine) == len(devices):
        return ExpertStore(devices, num_layers, cfg.num_experts, shapes, dtype, **options)
    if len(mine) != 1:
        raise ValueError(f"an expert store across processes needs one device of its ranks per process; process "
                         f"{jax.process_index()} drives {len(mine)} of {len(devices)}")
    return ProcessExpertStore(devices[mine[0]], mine[0], len(devices), num_layers, cfg.num_experts, shapes, dtype,
                              name=name, **options)


def connect_store(store, *, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """After the store is filled: a `ProcessExpertStore` trades its blocks with its peer processes' stores (the
    store of the same name in every process of the launch, over an FdExchange named by the launch and that name)
    and maps theirs; an `ExpertStore` has them all already. A peer that does not connect within `timeout_s` is named
    in the error."""
    from jax_dwdp.parallel.dwdp_ffi import ProcessExpertStore

    if not isinstance(store, ProcessExpertStore) or store.connected:
        return
    from jax_dwdp.distributed import launch_id
    from jax_dwdp.parallel.fd_exchange import ExchangeTimeout, FdExchange

    try:
        with FdExchange(f"{launch_id(timeout_s)}-{store.name}", store.rank, store.num_ranks,
                        timeout_s=timeout_s) as exchange:
            store.connect(exchange)
    except ExchangeTimeout as e:
        raise ExchangeTimeout(f"connecting expert store {store.name!r} of rank {store.rank} (the peers' processes "
                              f"must run on this host and open the same stores)", e.missing, timeout_s) from None


def expert_blocks(model: Qwen35MoeForCausalLM) -> list[tuple[jax.Array, jax.Array]]:
    """Each layer's (gate_up_proj, down_proj) of a model or stage, in its layer order."""
    return [(layer.mlp.experts.gate_up_proj[...], layer.mlp.experts.down_proj[...]) for layer in model.layers]


def _by_rank(array: jax.Array) -> list[jax.Array]:
    """The shards of an array split P('dwdp'), in rank order, each on its own device."""
    return [s.data for s in sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)]


class CheckpointLayers:
    """make_range for build_placed from a checkpoint: layers [a, b) loaded onto `device` (an HF folder is opened
    once for every range), and the LoadReport of everything loaded so far.

    `row` (the stage's mesh row), with one process per device: the expert weights are loaded straight into their
    split placement over the row when the ranks divide the experts (no padding slots), so each process reads only
    its own experts' bytes (Orbax: its chunks; HF: its slices of the mapped file, when no cast is needed)."""

    def __init__(self, directory, cfg: ModelConfig, dtype, device, *, fused_swiglu: bool = False, row=None):
        from jax_dwdp.weights.orbax_store import is_orbax_checkpoint
        from jax_dwdp.weights.safetensors_reader import SafetensorsCheckpoint

        self.directory, self.cfg, self.dtype, self.fused_swiglu = directory, cfg, dtype, fused_swiglu
        self.sharding = jax.sharding.SingleDeviceSharding(device)
        ranks = 1 if row is None else row.shape[AXIS]
        direct = row is not None and jax.process_count() > 1 and cfg.num_experts % ranks == 0 and not fused_swiglu
        self.split = NamedSharding(row, P(AXIS)) if direct else None
        self.hf = None if is_orbax_checkpoint(directory) else SafetensorsCheckpoint(directory)
        self.reports: list = []

    def __call__(self, start_layer: int, end_layer: int) -> Qwen35MoeForCausalLM:
        from jax_dwdp.weights import load_checkpoint
        from jax_dwdp.weights.hf_loader import load_hf_checkpoint

        def placement(path, shape, dtype):
            return self.split if self.split is not None and is_expert_weight(path) else self.sharding

        if self.hf is None:
            model, report = load_checkpoint(self.directory, cfg=self.cfg, dtype=self.dtype, start_layer=start_layer,
                                            end_layer=end_layer, placement=placement, fused_swiglu=self.fused_swiglu)
        else:
            model, report = load_hf_checkpoint(self.hf, cfg=self.cfg, dtype=self.dtype, start_layer=start_layer,
                                               end_layer=end_layer, placement=placement)
            model = set_fused_swiglu(model, True, donate=True) if self.fused_swiglu else model
        self.reports.append(report)
        return model

    def report(self, start_layer: int, end_layer: int):
        """One LoadReport for the range [start_layer, end_layer) loaded piece by piece."""
        from jax_dwdp.weights.hf_loader import LoadReport, _name_index

        total = LoadReport(skipped_non_text=self.reports[0].skipped_non_text if self.reports else 0)
        for r in self.reports:
            total.tensors_loaded += r.tensors_loaded
            total.bytes_read += r.bytes_read
            total.seconds += r.seconds
            for key, n in r.cast.items():
                total.cast[key] = total.cast.get(key, 0) + n
        if self.hf is not None:
            index = _name_index(self.hf)
            total.skipped_other_layers = sum(len(index.by_layer[layer])
                                             for layer in index.select(start_layer, end_layer)[1])
        return total

    def close(self) -> None:
        if self.hf is not None:
            self.hf.close()


class IndependentRanks:
    """DWDP ranks that run independently: each its own batch and length, no collective between them.

    Rank r holds the non-expert weights and its own expert blocks on device r, and runs the model through its own
    StageRunner (layer-wise programs). experts="xla": the peers' blocks of layer l+1 are copied device-to-device
    before layer l is enqueued (PeerCopy). experts="ffi" (GPUs): the blocks live in a CUDA VMM ExpertStore that
    this object owns; `close()` (or leaving a `with` block) releases it. experts="local": every rank holds every
    expert (the replicated baseline), nothing moves.

    `IndependentRanks(model, devices)` copies a whole model's weights onto the ranks and leaves `model` as it
    was (the caller's model keeps its own memory); `random` and `from_checkpoint` build the ranks' weights one
    layer at a time (build_placed), so no device ever holds more than its share plus one layer.
    """

    def __init__(self, model: Qwen35MoeForCausalLM, devices: list[jax.Device], *, experts: str = "xla"):
        if not (model.is_first and model.is_last):
            raise ValueError("independent DWDP ranks run whole models (use a Pipeline for stages)")
        self._setup(model.cfg, devices, experts, lambda a, b: model_range(model, a, b), model.dtype, owned=False)

    @classmethod
    def random(cls, cfg: ModelConfig, devices, *, experts: str = "xla", dtype=jnp.bfloat16, seed: int = 0,
               fused_swiglu: bool = False, store_options: dict | None = None) -> "IndependentRanks":
        """Random weights (the same model as init_model(cfg, seed=seed)), made one layer at a time on devices[0].
        `store_options` (experts="ffi"): ExpertStore options, e.g. timing=True to read each layer's copy time."""
        from jax_dwdp.model import init_model

        ranks = cls.__new__(cls)
        ranks._setup(cfg, devices, experts, lambda a, b: init_model(
            cfg, dtype=dtype, seed=seed, start_layer=a, end_layer=b, device=devices[0], fused_swiglu=fused_swiglu),
            dtype, owned=True, store_options=store_options)
        return ranks

    @classmethod
    def from_checkpoint(cls, directory, devices, *, experts: str = "xla", dtype=jnp.bfloat16,
                        cfg: ModelConfig | None = None, fused_swiglu: bool = False) -> "IndependentRanks":
        """An HF or Orbax checkpoint, loaded one layer at a time onto devices[0] and placed; `load_report`."""
        from jax_dwdp.weights.hf_loader import load_config

        cfg = cfg or load_config(directory)
        layers = CheckpointLayers(directory, cfg, dtype, devices[0], fused_swiglu=fused_swiglu)
        ranks = cls.__new__(cls)
        try:
            ranks._setup(cfg, devices, experts, layers, dtype, owned=True)
        finally:
            layers.close()
        ranks.load_report = layers.report(0, cfg.num_hidden_layers)
        return ranks

    def _setup(self, cfg: ModelConfig, devices, experts: str, make_range, dtype, *, owned: bool,
               store_options: dict | None = None) -> None:
        check_experts_choice(experts, 2, ("local", "xla", "ffi"))
        if experts == "ffi":
            from jax_dwdp.parallel.dwdp_ffi import require_gpus

            require_gpus(devices)  # before any weights are made
        self.cfg, self.devices, self.experts = cfg, list(devices), experts
        self.store = None
        mesh = Mesh(np.array(self.devices), (AXIS,))
        try:
            if experts == "ffi":
                self.store = open_store(mesh, cfg, cfg.num_hidden_layers, dtype, **(store_options or {}))
                placement = Placement(mesh, experts="store", store=self.store, owned=owned)
            else:
                placement = Placement(mesh, experts="replicate" if experts == "local" else "split", owned=owned)
            placed = build_placed(cfg, 0, cfg.num_hidden_layers, make_range, placement, dtype=dtype)
            if experts == "ffi":
                self.source = Store(self.store)
            elif experts == "local":
                self.source = Local()
            else:
                # blocks[layer][rank]: rank r's shard of the split experts (a view, nothing is copied)
                self.source = PeerCopy(self.devices, [list(zip(*(_by_rank(w) for w in layer)))
                                                      for layer in expert_blocks(placed)])
            self.runners = [StageRunner(placed, self.source, device=d) for d in self.devices]
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
        tokens, lengths = check_tokens(tokens, self.cfg.vocab_size, lengths)
        if cache_len is not None and cache_len < tokens.shape[1]:
            raise ValueError(f"cache_len {cache_len} is shorter than rank {rank}'s prompt ({tokens.shape[1]} tokens)")
        return tokens, lengths

    def _prefill(self, rank, tokens, lengths, logits, cache_len, *, sync_on_error):
        """prefill on inputs `_check` has already validated."""
        return self.runners[rank](tokens, lengths, logits=logits, cache_len=cache_len, abort_on_error=sync_on_error)

    def prefill_all(self, work, *, logits: LogitsMode = "all", cache_len: int | None = None,
                    threads: bool | None = None) -> dict:
        """Every rank's own batch at once: work = {rank: (tokens, lengths or None)} -> {rank: (logits, cache)}.

        Each rank's layers are enqueued from its own host thread (threads=None: whenever there are several), so the
        host time one rank spends dispatching its layer programs does not hold back the next rank's first layer.
        Every rank's input is checked before any rank starts. If a rank fails, the others are waited for, the
        expert source is aborted once (the FFI store's pending copies drained), and the first error is raised.
        """
        from concurrent.futures import ThreadPoolExecutor, wait

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

"""The CUDA side of DWDP: an expert store in CUDA VMM memory and the two XLA FFI custom calls that read it.

Nothing here is imported by `import jax_dwdp`; cuda.bindings (the store's driver calls, `cuda_vmm`), the handler
library (ffi/dwdp_store/, built into jax_dwdp/_lib/) and the NVIDIA driver are loaded only when an `ExpertStore` is
made.

- `ExpertStore(devices, layers, ...)`: rank r's block of every (layer, weight) lives in a cuMemCreate allocation
  on devices[r]; one composite virtual address per (layer, weight) shows all ranks' blocks, contiguous when a
  block is a multiple of the 2 MiB allocation granularity, to every device of the store (peer reads over NVLink).
  Python makes and releases every CUDA object (`cuda_vmm.VmmStore`).
- In place (`store.in_place`: every block a multiple of the 2 MiB allocation granularity, as at every published
  Qwen3.5-MoE size): each device sees each layer's experts as one [E, ...] range, its own rank's block mapped
  where its experts sit and store-owned slots at the peers' offsets; `store.layer_experts(layer)` gives that range
  as jax.Arrays that are views of it (device_view: XLA holds no copy of any expert, and the rank's own experts
  never move). `store.prefetch_in_place(dep, layer_experts(layer))` (inside shard_map) copies only the peers'
  blocks into the layer's slots (slot set layer % 2), on a copy stream that starts after everything XLA enqueued
  before the call: layer l+1's copy runs under layer l, into the slot set layer l does not read. The call finds its
  layer from the views it gets as an operand, so it can sit inside layer l's own program.
- Otherwise (copy out) `store.prefetch(dep, layer)` returns the layer's full (gate_up [E, 2I, H], down [E, H, I])
  in fresh XLA buffers, every rank's block copied, the rank's own too.
- `store.wait(experts, after)` -> (experts, after): the experts (views or buffers), after XLA's stream has waited
  for their copy, and `after` handed on (the MoE calls it with its first grouped matmul's input and computes from
  the returned one: moe.AwaitedExperts); that data dependency keeps and orders the call, and an optimization
  barrier orders every use of the experts after it. The custom calls' whole interface is their attributes
  (`VmmStore.in_place_attributes` / `prefetch_attributes` / `wait_attributes` here, `PrefetchInPlaceBinding` /
  `PrefetchBinding` / `WaitBinding` in ffi/dwdp_store/handlers.h).
- `close()` (or leaving a `with` block) releases every allocation, mapping, VA range, stream, event and context;
  whoever made the store closes it (a Pipeline or IndependentRanks with experts="ffi" makes and closes its own).
  `live_objects()` counts them, for tests.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dwdp.native import NativeLibrary
from jax_dwdp.parallel import cuda_vmm, device_view
from jax_dwdp.parallel.cuda_vmm import FfiUnavailable, StoreError, VmmStore, live_objects
from jax_dwdp.parallel.expert_layout import ExpertLayout
from jax_dwdp.parallel.fd_exchange import close_all

__all__ = ["ExpertStore", "ProcessExpertStore", "FfiUnavailable", "StoreError", "close_store", "device_memory",
           "library_path", "live_objects", "load_library", "require_gpus"]

PREFETCH_TARGET = "jax_dwdp_dwdp_prefetch"
PREFETCH_IN_PLACE_TARGET = "jax_dwdp_dwdp_prefetch_in_place"
WAIT_TARGET = "jax_dwdp_dwdp_wait"
HANDLERS = {PREFETCH_TARGET: "JaxDwdpStorePrefetch", PREFETCH_IN_PLACE_TARGET: "JaxDwdpStorePrefetchInPlace",
            WAIT_TARGET: "JaxDwdpStoreWait"}


def _has_handlers(lib) -> None:
    for symbol in HANDLERS.values():
        getattr(lib, symbol)  # AttributeError: a library built from other sources


LIBRARY = NativeLibrary(
    "DWDP FFI library", "libjax_dwdp_ffi.so", "JAX_DWDP_FFI_LIB", FfiUnavailable, declare=_has_handlers,
    needs_driver=True,
    build_hint="build it on a machine with the CUDA toolkit: `pip install -e .` (JAX_DWDP_BUILD_FFI=1 to make a failed "
               "build an error), or `cmake -S ffi -B build/ffi -DJAX_DWDP_LIB_DIR=$PWD/jax_dwdp/_lib && cmake --build "
               "build/ffi`")
library_path = LIBRARY.path


def load_library():
    """Loads the handler library, the driver and the driver bindings on first use, and registers the custom
    calls."""
    lib = LIBRARY.register(HANDLERS)
    cuda_vmm.driver()
    return lib


def device_memory(device) -> tuple[int, int]:
    """(free, total) bytes of a GPU as the driver sees them (XLA's pool counts as used)."""
    return cuda_vmm.device_memory(device.local_hardware_id)


def require_gpus(devices) -> None:
    platforms = {d.platform for d in devices}
    if platforms != {"gpu"}:
        raise FfiUnavailable(f"the DWDP FFI path needs CUDA GPUs; these devices are {sorted(platforms)} "
                             "(use the XLA path: --experts xla)")


class ExpertStore:
    """Every MoE layer's experts, rank r's block on devices[r], readable by every device. See the module doc."""

    # the custom calls the prefetches run (tests/store_testing.py names its own)
    prefetch_target, prefetch_in_place_target = PREFETCH_TARGET, PREFETCH_IN_PLACE_TARGET

    def __init__(self, devices, num_layers: int, num_experts: int, shapes, dtype, *, timing: bool = False,
                 in_place: bool = True, slot_sets: int = 2):
        """`shapes` = per-expert shapes of the weights, ((2I, H), (H, I)); blocks are ceil(E/N) experts, the last
        rank's padded with zeros when N does not divide E (its padding is never copied). `timing` records each
        layer's copy time (`copy_ms`). `in_place`: read the experts where they live whenever the blocks allow it
        (`info()["mode"]` says what was chosen and, if not in place, why); False copies every block out.
        `slot_sets`: in place, the layers whose peers' experts can be held at once (a prefetch depth of d needs
        d + 1; the runner's is 1)."""
        self.devices = list(devices)
        self.num_ranks = len(self.devices)
        require_gpus(self.devices)
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"an expert store needs distinct devices, got {self.devices}")
        if any(d.process_index != jax.process_index() for d in self.devices):
            raise ValueError("an expert store's devices must all belong to this process")
        sizes = self._configure(len(self.devices), num_layers, num_experts, shapes, dtype, timing=timing,
                                in_place=in_place, slot_sets=slot_sets)
        self.vmm = VmmStore.build([d.local_hardware_id for d in self.devices], **sizes)
        self._finish()

    def _finish(self) -> None:
        """After the VMM store is built: the views of the in-place ranges (released by close on any failure)."""
        self.id = self.vmm.id
        self.closed = False
        self._views: list[list[tuple[jax.Array, jax.Array]]] = []  # [row][layer] = (gate_up, down)
        if not self.vmm.in_place:
            return
        try:
            for row, device in enumerate(self.devices):
                self._views.append([tuple(
                    device_view.view(self.vmm.view_address(row, layer, w), (self.num_experts, *self.shapes[w]),
                                     self.dtype, device) for w in range(2)) for layer in range(self.num_layers)])
        except BaseException:
            self.close()
            raise

    @property
    def in_place(self) -> bool:
        """Whether the MoE reads the experts in place (layer_experts + prefetch_in_place) or from copies (prefetch)."""
        return self.vmm.in_place

    def _configure(self, ranks: int, num_layers: int, num_experts: int, shapes, dtype, *, timing: bool,
                   in_place: bool, slot_sets: int) -> dict:
        """The store's layout, shapes and dtype; returns VmmStore's sizes."""
        load_library()
        self.layout = ExpertLayout(num_experts, ranks)
        self.num_layers, self.num_experts = num_layers, num_experts
        self.shapes, self.dtype = tuple(tuple(s) for s in shapes), jnp.dtype(dtype)
        self.timing = timing
        return dict(layers=num_layers, expert_bytes=[int(np.prod(s)) * self.dtype.itemsize for s in self.shapes],
                    slots=self.layout.slots_per_rank, experts=num_experts, timing=timing, in_place=in_place,
                    slot_sets=slot_sets)

    # ---- filling ---------------------------------------------------------------------------------------------
    def own_ranks(self) -> list[tuple[int, object]]:
        """(rank, device) of each rank whose blocks this process fills: every rank (one process drives them all)."""
        return list(enumerate(self.devices))

    def fill(self, layer: int, weight: int, rank: int, block: jax.Array) -> None:
        """Copies rank `rank`'s block ([ceil(E/N), *shape], on that rank's device alone) into the store; `rank` is
        one of `own_ranks()`."""
        self.check_open()
        own = dict(self.own_ranks())
        if rank not in own:
            raise ValueError(f"expert block for layer {layer} weight {weight} rank {rank}: this store fills the "
                             f"blocks of rank(s) {sorted(own)} only")
        want = (self.layout.slots_per_rank, *self.shapes[weight])
        if block.shape != want or block.dtype != self.dtype:
            raise ValueError(f"expert block for layer {layer} weight {weight} rank {rank}: got {block.shape} "
                             f"{block.dtype}, expected {want} {self.dtype}")
        shard = block.addressable_shards[0]
        if len(block.addressable_shards) != 1 or shard.device != own[rank]:
            raise ValueError(f"expert block for rank {rank} must live on {own[rank]} alone")
        data = shard.data.block_until_ready()
        self.vmm.fill(layer, weight, rank, data.unsafe_buffer_pointer(), data.nbytes)

    @classmethod
    def from_blocks(cls, devices, blocks, num_experts: int, *, delete: bool = True, **options) -> "ExpertStore":
        """From blocks[layer][weight][rank]: rank r's [ceil(E/N), ...] block, on devices[r] alone.

        delete=True deletes each layer's blocks once copied (layer by layer, so the experts are never held twice
        in full): a rank's experts then live in the store only. `options`: the constructor's (timing).
        """
        first = blocks[0]
        store = cls(devices, len(blocks), num_experts, tuple(w[0].shape[1:] for w in first), first[0][0].dtype,
                    **options)
        done = 0
        try:
            for l, weights in enumerate(blocks):
                for w, per_rank in enumerate(weights):
                    for r, block in enumerate(per_rank):
                        store.fill(l, w, r, block)
                if delete:
                    for block in (b for per_rank in weights for b in per_rank):
                        block.delete()
                done = l + 1
        except BaseException as e:
            store.close()
            if delete and done:
                raise StoreError(f"filling the expert store failed at layer {done} ({e}); the expert arrays of "
                                 f"layers [0, {done}) were already moved into it and are gone: rebuild the "
                                 "model") from e
            raise
        return store

    @classmethod
    def from_sharded(cls, layers: list[tuple[jax.Array, jax.Array]], num_experts: int, *, delete: bool = True,
                     **options) -> "ExpertStore":
        """From each layer's (gate_up, down) sharded P('dwdp') over the store's devices ([N * ceil(E/N), ...]);
        rank r is the shard at block position r. See from_blocks for `delete` and `options`."""
        def by_position(array):
            return [s.data for s in sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)]

        devices = [block.device for block in by_position(layers[0][0])]
        blocks = [[by_position(w) for w in layer] for layer in layers]
        # Deleting a shard's view deletes its buffer, which the sharded array shares.
        return cls.from_blocks(devices, blocks, num_experts, delete=delete, **options)

    # ---- the custom calls (inside shard_map: per-device shapes) ----------------------------------------------
    def prefetch_attributes(self, layer: int) -> dict:
        """Copy out: layer `layer`'s dwdp_prefetch attributes (the custom call's whole interface)."""
        self.check_open()
        return self.vmm.prefetch_attributes(layer)

    def in_place_attributes(self) -> dict:
        """In place: dwdp_prefetch_in_place's attributes, one set for every layer."""
        self.check_open()
        return self.vmm.in_place_attributes()

    def prefetch(self, dep: jax.Array, layer: int) -> tuple[jax.Array, jax.Array]:
        """Copy out: layer `layer`'s experts in fresh XLA buffers, every rank's block copied."""
        if self.in_place:
            raise StoreError(f"expert store {self.id} reads its experts in place: prefetch_in_place(dep, experts) "
                             "with experts = layer_experts(layer)")
        out = tuple(jax.ShapeDtypeStruct((self.num_experts, *s), self.dtype) for s in self.shapes)
        attributes = self.prefetch_attributes(layer)
        call = jax.ffi.ffi_call(self.prefetch_target, out, has_side_effect=True)
        return call(dep, **attributes)

    def prefetch_in_place(self, dep: jax.Array, experts: tuple[jax.Array, jax.Array]) -> jax.Array:
        """In place: copies the peers' blocks of the layer whose views `experts` are (this device's
        `layer_experts(layer)`, as operands of the calling program) into this device's slots for it; returns a
        token. The call's attributes are the same for every layer, so it can sit inside the program of the layer
        before, which one compilation serves for every layer; `wait` on the same views finds the copy by their
        address."""
        if not self.in_place:
            raise StoreError(f"expert store {self.id} copies its experts out ({self.vmm.not_in_place}): "
                             "prefetch(dep, layer)")
        gate_up = experts[0]
        expected = (self.num_experts, *self.shapes[0])
        if tuple(gate_up.shape) != expected or gate_up.dtype != self.dtype:
            raise StoreError(f"prefetch_in_place(store {self.id}): experts[0] is {gate_up.dtype}{list(gate_up.shape)}"
                             f", not a gate_up view of the store ({self.dtype}{list(expected)} per device)")
        attributes = self.in_place_attributes()
        # Not a side effect to JAX: the token is a program output, so the call runs on every execution, and a failed
        # prefetch raises once, where it ran (a side effect's runtime token would raise it again at exit).
        call = jax.ffi.ffi_call(self.prefetch_in_place_target, jax.ShapeDtypeStruct((1,), jnp.int32))
        return call(dep, gate_up, **attributes)

    def layer_experts(self, layer: int, device=None) -> tuple[jax.Array, jax.Array]:
        """In place: layer `layer`'s (gate_up [E, 2I, H], down [E, H, I]) as `device`'s views of the store (its
        own block and its slots); without `device`, the store's one device (a ProcessExpertStore's)."""
        self.check_open()
        if not self.in_place:
            raise StoreError(f"expert store {self.id} copies its experts out: it has no views")
        if device is None:
            if len(self.devices) != 1:
                raise ValueError("layer_experts: name the device (the store has several)")
            device = self.devices[0]
        return self._views[self.devices.index(device)][layer]

    def sharded_layer_experts(self, layer: int, mesh) -> tuple[jax.Array, jax.Array]:
        """In place, over a 1-D mesh of the store's ranks (rank r on the mesh's r-th device; the devices of other
        processes are their own stores'): arrays sharded P(axis) ([N * E, ...]) whose shard on each of this
        process's devices is that device's views, for shard_map."""
        devices = list(mesh.devices.flat)
        mine = [(r, d) for r, d in enumerate(devices) if d.process_index == jax.process_index()]
        if [(r, d) for r, d in mine if d not in self.devices or self.rank_of(d) != r]:
            raise ValueError(f"sharded_layer_experts: the mesh's devices {devices} are not the store's ranks "
                             f"{self.devices}, in order")
        sharding = NamedSharding(mesh, P(mesh.axis_names[0]))
        return tuple(jax.make_array_from_single_device_arrays(
            (len(devices) * self.num_experts, *self.shapes[w]), sharding,
            [self.layer_experts(layer, d)[w] for _, d in mine]) for w in range(2))

    def rank_of(self, device) -> int:
        """The rank whose blocks live on `device` (one process drives every rank: its position)."""
        return self.devices.index(device)

    def wait(self, experts: tuple[jax.Array, jax.Array],
             after: jax.Array) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        """(experts, after): the experts, usable once XLA's stream has waited for their copy, and `after` as the
        wait hands it on. The caller must compute from the returned `after` (the MoE: its first grouped matmul's
        input): that data is what keeps the call in the program and orders it, because the call is no side effect
        to JAX (an effect sends every call of the program through JAX's Python dispatch path). A wait whose `after`
        is dropped is dropped with it, and the store then refuses the next prefetch into those slots ("not yet
        waited for"). The call's output aliases `after` (no copy when `after` has no other use; the experts are
        not aliased: XLA would copy an aliased program parameter first, racing the copy); an optimization barrier
        makes every use of the experts come after it."""
        self.check_open()
        call = jax.ffi.ffi_call(WAIT_TARGET, jax.ShapeDtypeStruct(after.shape, after.dtype),
                                input_output_aliases={2: 0})
        after = call(*experts, after, **self.vmm.wait_attributes())
        gate_up, down, after = jax.lax.optimization_barrier((*experts, after))
        return (gate_up, down), after

    # ---- facts -----------------------------------------------------------------------------------------------
    def copy_ms(self) -> np.ndarray:
        """[ranks, layers] duration of each layer's last prefetch copy in ms (NaN when not timed); a
        ProcessExpertStore's is [1, layers], its own rank's."""
        self.check_open()
        return self.vmm.copy_ms()

    def sync(self) -> None:
        """Waits for every copy enqueued so far and forgets prefetches nobody waited for. The drivers call it when
        a prefill fails half-way, so that no copy still writes into an output XLA has freed."""
        if not self.closed:
            self.vmm.sync()

    def info(self) -> dict:
        self.check_open()
        return {**self.vmm.info(), "ranks": self.num_ranks, "layers": self.num_layers,
                "slots_per_rank": self.layout.slots_per_rank}

    def slot_bytes(self) -> int:
        """Device memory of each device's in-place slots (0 when copying out)."""
        return self.vmm.slot_bytes()

    def check_open(self) -> None:
        if self.closed:
            raise StoreError(f"expert store {self.id} is closed")

    # ---- lifetime --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Waits for the store's devices, then releases everything. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        # The views go before the memory they show is unmapped (XLA frees a view once no program uses it).
        for row in getattr(self, "_views", []):
            for layer in row:
                for view in layer:
                    view.delete()
        self._views = []
        self.vmm.close()

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        close_store(self, exc)


class ProcessExpertStore(ExpertStore):
    """One process per device (issue 17): this process is rank `rank` of `num_ranks`, on `device`. It allocates and
    fills only its own rank's blocks; `connect(exchange)` exports them as POSIX file descriptors, trades them with
    every peer process through a `fd_exchange.FdExchange`, and maps the peers' blocks into this device's composite
    ranges, after which prefetch / wait work as in `ExpertStore` (every rank's block, the peers' over NVLink).

    Lifetime: an imported block holds its own reference to the peer's memory, so a peer that closes its store (or
    dies) before this one does not pull memory from under this process's copies; the memory is freed when the last
    process holding it releases it (or exits). Every descriptor is closed once imported, on every path.
    """

    def __init__(self, device, rank: int, num_ranks: int, num_layers: int, num_experts: int, shapes, dtype, *,
                 name: str = "experts", timing: bool = False, in_place: bool = True, slot_sets: int = 2):
        require_gpus([device])
        if not 0 <= rank < num_ranks:
            raise ValueError(f"ProcessExpertStore: rank {rank} is not in [0, {num_ranks})")
        self.devices, self.rank, self.num_ranks = [device], rank, num_ranks
        self.name = name  # pairs this store with its peers' (the same name in every process; backends.connect_store)
        sizes = self._configure(num_ranks, num_layers, num_experts, shapes, dtype, timing=timing,
                                in_place=in_place, slot_sets=slot_sets)
        self.vmm = VmmStore.build_local(device.local_hardware_id, rank, num_ranks, **sizes)
        self.connected = num_ranks == 1
        self._finish()

    @classmethod
    def from_blocks(cls, *args, **kwargs):  # noqa: D102 (the one-process constructors do not apply)
        raise TypeError("ProcessExpertStore holds one rank's blocks: create it, fill(layer, weight, rank, block) for "
                        "each of its own blocks, then connect(exchange)")

    from_sharded = from_blocks

    def own_ranks(self) -> list[tuple[int, object]]:
        """This process's rank alone, on its device."""
        return [(self.rank, self.devices[0])]

    def rank_of(self, device) -> int:
        return self.rank

    def fill(self, layer: int, weight: int, rank: int, block: jax.Array) -> None:
        """Copies this rank's block (`rank` == self.rank; [ceil(E/N), *shape], on this process's device alone) into
        the store; before connect (afterwards the peers may be reading it)."""
        self.check_open()
        if self.connected and self.num_ranks > 1:
            raise StoreError("ProcessExpertStore.fill after connect: the peers may be reading the blocks")
        super().fill(layer, weight, rank, block)

    def export(self) -> list[int]:
        """This rank's blocks as new POSIX descriptors, (layer, weight) order; the caller closes them."""
        self.check_open()
        return self.vmm.export()

    def import_peer(self, peer: int, fds: list[int]) -> None:
        """Maps rank `peer`'s blocks from its exported descriptors (which stay the caller's)."""
        self.check_open()
        self.vmm.import_peer(peer, list(fds))

    def configuration(self) -> dict:
        """What every rank of one store must agree on before mapping each other's blocks."""
        return {"ranks": self.num_ranks, "layers": self.num_layers, "experts": self.num_experts,
                "shapes": [list(s) for s in self.shapes], "dtype": self.dtype.name,
                "slots_per_rank": self.layout.slots_per_rank, "granularity": self.info()["granularity"]}

    def connect(self, exchange) -> None:
        """Trades descriptors with every peer through `exchange` (an FdExchange of this rank and world) and maps
        their blocks. The ranks first compare their configurations (a peer of another one is an error naming it
        and the difference, on every rank), and afterwards tell each other whether their imports worked, so a
        failure on one rank is an error on all. Every descriptor, its own and the received, is closed on every
        path."""
        if exchange.rank != self.rank or exchange.world != self.num_ranks:
            raise ValueError(f"ProcessExpertStore.connect: exchange of rank {exchange.rank} / {exchange.world}, "
                             f"store of rank {self.rank} / {self.num_ranks}")
        config = self.configuration()
        mine = self.export()
        received: dict[int, list[int]] = {}
        failure = ""
        try:
            got = exchange.exchange(mine, json.dumps(config, sort_keys=True).encode())
            received = {r: m.fds for r, m in got.items()}
            for peer in sorted(got):
                theirs = json.loads(got[peer].payload)
                if theirs != config:
                    diff = {k: (config.get(k), theirs.get(k)) for k in sorted(set(config) | set(theirs))
                            if config.get(k) != theirs.get(k)}
                    failure = f"rank {peer}'s store differs from rank {self.rank}'s: {diff} (this rank's, peer's)"
                    break
            if not failure:
                for peer in sorted(received):
                    try:
                        self.import_peer(peer, received[peer])
                    except StoreError as e:
                        failure = f"rank {self.rank} could not map rank {peer}'s blocks: {e}"
                        break
        finally:
            close_all({self.rank: mine, **received})
        status = exchange.exchange([], failure.encode())
        failures = [failure] if failure else []
        failures += [m.payload.decode() for r, m in sorted(status.items()) if m.payload]
        if failures:
            raise StoreError("ProcessExpertStore.connect: " + "; ".join(failures))
        self.connected = True

    def check_connected(self) -> None:
        self.check_open()
        if not self.connected:
            raise StoreError(f"ProcessExpertStore (rank {self.rank}): connect(exchange) first, the peers' blocks "
                             "are not mapped yet")

    def prefetch(self, dep: jax.Array, layer: int) -> tuple[jax.Array, jax.Array]:
        self.check_connected()
        return super().prefetch(dep, layer)

    def prefetch_in_place(self, dep: jax.Array, experts: tuple[jax.Array, jax.Array]) -> jax.Array:
        self.check_connected()
        return super().prefetch_in_place(dep, experts)

    def info(self) -> dict:
        return {**super().info(), "ranks": self.num_ranks, "rank": self.rank}


def close_store(store, exc=None) -> None:
    """Closes `store` (None is fine). While another exception `exc` is propagating, a failure to close is reported
    as a warning instead of replacing it."""
    if store is None:
        return
    if exc is None:
        store.close()
        return
    try:
        store.close()
    except Exception as close_error:  # keep the original error
        import warnings

        warnings.warn(f"closing expert store {store.id} after an error also failed: {close_error}", stacklevel=2)

"""The CUDA side of DWDP: an expert store in CUDA VMM memory and the two XLA FFI custom calls that read it.

Nothing here is imported by `import jax_dwdp`; the library (ffi/dwdp_store/, built into jax_dwdp/_lib/) and the
NVIDIA driver are loaded only when an `ExpertStore` is made.

- `ExpertStore(devices, layers, ...)`: rank r's block of every (layer, weight) lives in a cuMemCreate allocation
  on devices[r]; one composite virtual address per (layer, weight) shows all ranks' blocks, contiguous when a
  block is a multiple of the 2 MiB allocation granularity, to every device of the store (peer reads over NVLink).
- `store.prefetch(dep, layer)` (inside shard_map): returns the layer's full (gate_up [E, 2I, H], down [E, H, I])
  in fresh XLA buffers, filled by a copy stream that starts after everything XLA enqueued before the call.
- `store.wait(experts, after)`: the same buffers, after XLA's stream has waited for that copy; `after` (the MoE's
  input) keeps XLA from scheduling it early, and an optimization barrier on its token orders every use after it.
- `close()` (or leaving a `with` block) releases every allocation, mapping, VA range, stream and event; whoever
  made the store closes it (a Pipeline or IndependentRanks with experts="ffi" makes and closes its own).
  `live_objects()` counts them, for tests.
"""

from __future__ import annotations

import ctypes
import json

import jax
import jax.numpy as jnp
import numpy as np

from jax_dwdp.native import NativeLibrary
from jax_dwdp.parallel.expert_layout import ExpertLayout
from jax_dwdp.parallel.fd_exchange import close_all

PREFETCH_TARGET = "jax_dwdp_dwdp_prefetch"
WAIT_TARGET = "jax_dwdp_dwdp_wait"
_LIVE_FIELDS = ("allocations", "mappings", "va_ranges", "streams", "events", "stores")


class FfiUnavailable(RuntimeError):
    """The FFI path cannot run here (no GPU, no driver, or the library is not built); the message says which."""


class StoreError(RuntimeError):
    """A CUDA call of the expert store failed; the message names the call and the CUresult."""


def _declare(lib: ctypes.CDLL) -> None:
    i64, c_int, u64 = ctypes.c_int64, ctypes.c_int, ctypes.c_uint64
    lib.dwdp_last_error.restype = ctypes.c_char_p
    lib.dwdp_store_create.argtypes = [c_int, ctypes.POINTER(c_int), c_int, c_int, ctypes.POINTER(u64), c_int, c_int,
                                      c_int, ctypes.POINTER(i64)]
    lib.dwdp_store_fill.argtypes = [i64, c_int, c_int, c_int, u64, u64]
    lib.dwdp_store_close.argtypes = [i64]
    lib.dwdp_store_copy_ms.argtypes = [i64, c_int, c_int, ctypes.POINTER(ctypes.c_float)]
    lib.dwdp_store_inject_error.argtypes = [i64, c_int]
    lib.dwdp_store_info.argtypes = [i64, ctypes.POINTER(c_int), ctypes.POINTER(u64)]
    lib.dwdp_device_memory.argtypes = [c_int, ctypes.POINTER(u64), ctypes.POINTER(u64)]
    lib.dwdp_device_memory.restype = c_int
    lib.dwdp_live_objects.argtypes = [ctypes.POINTER(i64)]
    lib.dwdp_live_objects.restype = None
    lib.dwdp_store_sync.argtypes = [i64]
    lib.dwdp_store_create_local.argtypes = [c_int, c_int, c_int, c_int, c_int, ctypes.POINTER(u64), c_int, c_int,
                                            c_int, ctypes.POINTER(i64)]
    lib.dwdp_store_export.argtypes = [i64, ctypes.POINTER(c_int), c_int]
    lib.dwdp_store_import.argtypes = [i64, c_int, ctypes.POINTER(c_int), c_int]
    for fn in ("dwdp_store_create", "dwdp_store_fill", "dwdp_store_close", "dwdp_store_copy_ms",
               "dwdp_store_inject_error", "dwdp_store_info", "dwdp_store_sync", "dwdp_store_create_local",
               "dwdp_store_export", "dwdp_store_import"):
        getattr(lib, fn).restype = c_int


LIBRARY = NativeLibrary(
    "DWDP FFI library", "libjax_dwdp_ffi.so", "JAX_DWDP_FFI_LIB", FfiUnavailable, declare=_declare, needs_driver=True,
    build_hint="build it on a machine with the CUDA toolkit: `pip install -e .` (JAX_DWDP_BUILD_FFI=1 to make a failed "
               "build an error), or `cmake -S ffi -B build/ffi -DJAX_DWDP_LIB_DIR=$PWD/jax_dwdp/_lib && cmake --build "
               "build/ffi`")
library_path = LIBRARY.path


def load_library() -> ctypes.CDLL:
    """Loads the driver and the library on first use, and registers the two custom calls."""
    return LIBRARY.register({PREFETCH_TARGET: "JaxDwdpPrefetch", WAIT_TARGET: "JaxDwdpWait"})


def _check(lib, status: int) -> None:
    if status != 0:
        raise StoreError(lib.dwdp_last_error().decode(errors="replace"))


def live_objects() -> dict[str, int]:
    """CUDA objects held by all open stores of this process (all zero when every store is closed)."""
    lib = load_library()
    out = (ctypes.c_int64 * len(_LIVE_FIELDS))()
    lib.dwdp_live_objects(out)
    return dict(zip(_LIVE_FIELDS, (int(v) for v in out)))


def device_memory(device) -> tuple[int, int]:
    """(free, total) bytes of a GPU as the driver sees them (XLA's pool counts as used)."""
    lib = load_library()
    free, total = ctypes.c_uint64(), ctypes.c_uint64()
    _check(lib, lib.dwdp_device_memory(device.local_hardware_id, ctypes.byref(free), ctypes.byref(total)))
    return free.value, total.value


def require_gpus(devices) -> None:
    platforms = {d.platform for d in devices}
    if platforms != {"gpu"}:
        raise FfiUnavailable(f"the DWDP FFI path needs CUDA GPUs; these devices are {sorted(platforms)} "
                             "(use the XLA path: --experts xla)")


class ExpertStore:
    """Every MoE layer's experts, rank r's block on devices[r], readable by every device. See the module doc."""

    def __init__(self, devices, num_layers: int, num_experts: int, shapes, dtype, *, timing: bool = False,
                 poison: bool = False, delay_copies: bool = False):
        """`shapes` = per-expert shapes of the weights, ((2I, H), (H, I)); blocks are ceil(E/N) experts, the last
        rank's padded with zeros when N does not divide E (its padding is never copied). `timing` records each
        layer's copy time; `poison` (tests) fills every prefetch destination with NaN before the copy;
        `delay_copies` (tests) holds the copy stream 20 ms before each prefetch, so that a read of the experts that
        does not wait for their copy sees the poison."""
        self.devices = list(devices)
        self.num_ranks = len(self.devices)
        require_gpus(self.devices)
        if len(set(self.devices)) != len(self.devices):
            raise ValueError(f"an expert store needs distinct devices, got {self.devices}")
        if any(d.process_index != jax.process_index() for d in self.devices):
            raise ValueError("an expert store's devices must all belong to this process")
        sizes, flags = self._configure(len(self.devices), num_layers, num_experts, shapes, dtype, timing=timing,
                                       poison=poison, delay_copies=delay_copies)
        ordinals = (ctypes.c_int * len(self.devices))(*[d.local_hardware_id for d in self.devices])
        sid = ctypes.c_int64()
        _check(self.lib, self.lib.dwdp_store_create(len(self.devices), ordinals, num_layers, len(self.shapes), sizes,
                                                    self.layout.slots_per_rank, num_experts, flags, ctypes.byref(sid)))
        self.id = sid.value
        self.closed = False

    def _configure(self, ranks: int, num_layers: int, num_experts: int, shapes, dtype, *, timing: bool,
                   poison: bool, delay_copies: bool):
        """The store's layout, shapes and dtype; returns the C API's per-expert byte sizes and flag bits."""
        self.lib = load_library()
        self.layout = ExpertLayout(num_experts, ranks)
        self.num_layers, self.num_experts = num_layers, num_experts
        self.shapes, self.dtype = tuple(tuple(s) for s in shapes), jnp.dtype(dtype)
        self.timing = timing
        expert_bytes = [int(np.prod(s)) * self.dtype.itemsize for s in self.shapes]
        sizes = (ctypes.c_uint64 * len(expert_bytes))(*expert_bytes)
        return sizes, int(timing) | (2 if poison else 0) | (4 if delay_copies else 0)

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
        _check(self.lib, self.lib.dwdp_store_fill(self.id, layer, weight, rank, data.unsafe_buffer_pointer(),
                                                  data.nbytes))

    @classmethod
    def from_blocks(cls, devices, blocks, num_experts: int, *, delete: bool = True, **options) -> "ExpertStore":
        """From blocks[layer][weight][rank]: rank r's [ceil(E/N), ...] block, on devices[r] alone.

        delete=True deletes each layer's blocks once copied (layer by layer, so the experts are never held twice
        in full): a rank's experts then live in the store only. `options`: timing, poison, delay_copies.
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
    def prefetch(self, dep: jax.Array, layer: int) -> tuple[jax.Array, jax.Array]:
        self.check_open()
        out = tuple(jax.ShapeDtypeStruct((self.num_experts, *s), self.dtype) for s in self.shapes)
        call = jax.ffi.ffi_call(PREFETCH_TARGET, out, has_side_effect=True)
        return call(dep, store=np.int64(self.id), layer=np.int64(layer))

    def wait(self, experts: tuple[jax.Array, jax.Array], after: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The experts, usable once XLA's stream has waited for their copy. The custom call returns a token (its
        operands are not aliased: XLA would copy an aliased program parameter first, racing the copy); an
        optimization barrier makes every use of the experts come after it."""
        self.check_open()
        call = jax.ffi.ffi_call(WAIT_TARGET, jax.ShapeDtypeStruct((), jnp.int32), has_side_effect=True)
        token = call(*experts, after, store=np.int64(self.id))
        gate_up, down, _ = jax.lax.optimization_barrier((*experts, token))
        return gate_up, down

    # ---- facts, tests ----------------------------------------------------------------------------------------
    def copy_ms(self) -> np.ndarray:
        """[ranks, layers] duration of each layer's last prefetch copy in ms (NaN when not timed)."""
        self.check_open()
        out = np.full((len(self.devices), self.num_layers), np.nan)
        ms = ctypes.c_float()
        for r in range(len(self.devices)):
            for l in range(self.num_layers):
                _check(self.lib, self.lib.dwdp_store_copy_ms(self.id, r, l, ctypes.byref(ms)))
                if ms.value >= 0:
                    out[r, l] = ms.value
        return out

    def sync(self) -> None:
        """Waits for every copy enqueued so far and forgets prefetches nobody waited for. The drivers call it when
        a prefill fails half-way, so that no copy still writes into an output XLA has freed."""
        if not self.closed:
            _check(self.lib, self.lib.dwdp_store_sync(self.id))

    def info(self) -> dict:
        self.check_open()
        fabric, gran = ctypes.c_int(), ctypes.c_uint64()
        _check(self.lib, self.lib.dwdp_store_info(self.id, ctypes.byref(fabric), ctypes.byref(gran)))
        return {"handle_type": "fabric" if fabric.value else "posix_fd", "granularity": gran.value,
                "ranks": len(self.devices), "layers": self.num_layers, "slots_per_rank": self.layout.slots_per_rank}

    def inject_error(self, code: int) -> None:
        """Makes the next prefetch fail as if a CUDA call had returned `code` (for tests)."""
        self.check_open()
        _check(self.lib, self.lib.dwdp_store_inject_error(self.id, code))

    def check_open(self) -> None:
        if self.closed:
            raise StoreError(f"expert store {self.id} is closed")

    # ---- lifetime --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Waits for the store's devices, then releases everything. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        _check(self.lib, self.lib.dwdp_store_close(self.id))

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
                 name: str = "experts", timing: bool = False, poison: bool = False, delay_copies: bool = False):
        require_gpus([device])
        if not 0 <= rank < num_ranks:
            raise ValueError(f"ProcessExpertStore: rank {rank} is not in [0, {num_ranks})")
        self.devices, self.rank, self.num_ranks = [device], rank, num_ranks
        self.name = name  # pairs this store with its peers' (the same name in every process; backends.connect_store)
        sizes, flags = self._configure(num_ranks, num_layers, num_experts, shapes, dtype, timing=timing,
                                       poison=poison, delay_copies=delay_copies)
        sid = ctypes.c_int64()
        _check(self.lib, self.lib.dwdp_store_create_local(num_ranks, rank, device.local_hardware_id, num_layers,
                                                          len(self.shapes), sizes, self.layout.slots_per_rank,
                                                          num_experts, flags, ctypes.byref(sid)))
        self.id = sid.value
        self.closed = False
        self.connected = num_ranks == 1

    @classmethod
    def from_blocks(cls, *args, **kwargs):  # noqa: D102 (the one-process constructors do not apply)
        raise TypeError("ProcessExpertStore holds one rank's blocks: create it, fill(layer, weight, rank, block) for "
                        "each of its own blocks, then connect(exchange)")

    from_sharded = from_blocks

    def own_ranks(self) -> list[tuple[int, object]]:
        """This process's rank alone, on its device."""
        return [(self.rank, self.devices[0])]

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
        n = self.num_layers * len(self.shapes)
        fds = (ctypes.c_int * n)()
        _check(self.lib, self.lib.dwdp_store_export(self.id, fds, n))
        return list(fds)

    def import_peer(self, peer: int, fds: list[int]) -> None:
        """Maps rank `peer`'s blocks from its exported descriptors (which stay the caller's)."""
        self.check_open()
        arr = (ctypes.c_int * len(fds))(*fds)
        _check(self.lib, self.lib.dwdp_store_import(self.id, peer, arr, len(fds)))

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

    def copy_ms(self) -> np.ndarray:
        """[1, layers]: this rank's last copy time per layer in ms (NaN when not timed)."""
        self.check_open()
        out = np.full((1, self.num_layers), np.nan)
        ms = ctypes.c_float()
        for l in range(self.num_layers):
            _check(self.lib, self.lib.dwdp_store_copy_ms(self.id, self.rank, l, ctypes.byref(ms)))
            if ms.value >= 0:
                out[0, l] = ms.value
        return out

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

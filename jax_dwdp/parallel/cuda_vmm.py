"""The CUDA driver side of the DWDP expert store, in Python through cuda.bindings.driver (cuda-python).

CUDA-only: `cuda.bindings` is imported on first use (`driver()`), never by `import jax_dwdp`. jax-free: a
`VmmStore` takes device ordinals and raw device addresses; `dwdp_ffi.ExpertStore` wraps it for JAX.

A `VmmStore` holds every CUDA object of one expert store in this process:
- per device row (one per store device this process drives): the retained primary context (XLA's), a copy stream,
  a "ready" event (recorded on XLA's stream before each copy: the write-after-read guard), `pending_slots` "done"
  events (one per prefetch not yet waited for), and with `timing` a start / stop event pair per layer;
- per (layer, weight) a region: one reserved virtual address range of `ranks x stride` bytes, rank r's block (a
  cuMemCreate allocation on rank r's device, `stride` = the block rounded up to the allocation granularity) mapped
  at r x stride and readable by every device of the store, so a peer's block is an address;
- one process per device (`build_local`): only this rank's blocks are allocated (POSIX file descriptor handles);
  `export` gives them as descriptors and `import_peer` maps a peer process's blocks from its descriptors;
- in place (`in_place`, when every block is a multiple of the allocation granularity): per device row and
  (layer, weight) a compute view, one virtual range of `ranks x stride` bytes that the layer's MoE reads as its
  [E, ...] experts: the row's own block mapped a second time at its rank's offset (read where it lives, never
  copied) and, at each peer's offset, a slot of the row's own memory that the prefetch fills over the link. Layer l
  uses slot set l % slot_sets (two: layer l+1's copy runs while layer l reads the other set);
- the host table the custom calls share with Python (layout in ffi/dwdp_store/handlers.h, TABLE_* here).

Everything acquired is recorded as it is acquired and released newest first, on every path: a failed build
releases what it made before raising, a failed import undoes that peer's blocks, and `close` (idempotent) first
makes the custom calls refuse, then waits for the devices, then releases. `live_objects()` counts what is alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import threading
from collections.abc import Callable, Sequence

import numpy as np

# The host table (ffi/dwdp_store/handlers.h): per device row, a spinlock word, a closed word, then one word per
# pending slot (the gate_up address of the prefetch whose done event that slot is, or 0).
TABLE_LOCK, TABLE_CLOSED, TABLE_FIRST_SLOT = 0, 1, 2
DEFAULT_PENDING_SLOTS = 4  # beyond the layers: prefetches in flight at depth 2, plus one (see VmmStore)
LIVE_FIELDS = ("allocations", "mappings", "va_ranges", "streams", "events", "contexts", "stores")


class FfiUnavailable(RuntimeError):
    """The FFI path cannot run here (no GPU, no driver, no cuda-bindings, or the library is not built); the message
    says which."""


class StoreError(RuntimeError):
    """A CUDA call of the expert store failed; the message names the call and the CUresult."""


# ---- the driver ----------------------------------------------------------------------------------------------

_driver = None


def driver():
    """cuda.bindings.driver, imported on first use (the CUDA-only path)."""
    global _driver
    if _driver is None:
        try:
            from cuda.bindings import driver as module
        except ImportError as e:
            raise FfiUnavailable(f"the DWDP FFI path needs cuda-python's driver bindings ({e}): pip install -e "
                                 "'.[cuda]' (cuda-bindings)") from None
        _driver = module
    return _driver


def error_name(code) -> str:
    """CUDA_ERROR_... for a CUresult (the driver's own name; the enum's when the driver cannot say)."""
    try:
        err, name = driver().cuGetErrorName(code)
        if int(err) == 0 and name:
            return name.decode() if isinstance(name, bytes) else str(name)
    except (RuntimeError, TypeError, ValueError):
        pass
    return getattr(code, "name", None) or "CUDA_ERROR_UNKNOWN"


def describe(where: str, call: str, code) -> str:
    """The one form every CUDA failure is reported in (the handlers' Describe is the same)."""
    return f"{where}: {call} failed with {error_name(code)} ({int(code)})"


def cu(where: str, name: str, *args):
    """driver().<name>(*args), which returns (CUresult, outputs...): the outputs (None, one value, or a tuple), or
    StoreError naming `where`, the call and the CUresult."""
    try:
        result = getattr(driver(), name)(*args)
    except RuntimeError as e:  # cuda.bindings: the driver library or this function cannot be loaded
        raise StoreError(f"{where}: {name}: {e}") from None
    code = result[0]
    if int(code) != 0:
        raise CudaError(describe(where, name, code), code)
    values = tuple(result[1:])
    return None if not values else values[0] if len(values) == 1 else values


class CudaError(StoreError):
    """A CUDA call returned a CUresult other than success (`code`)."""

    def __init__(self, message: str, code):
        super().__init__(message)
        self.code = int(code)


# ---- live objects --------------------------------------------------------------------------------------------

_live = dict.fromkeys(LIVE_FIELDS, 0)
_live_lock = threading.Lock()


def _count(kind: str, delta: int) -> None:
    with _live_lock:
        _live[kind] += delta


def live_objects() -> dict[str, int]:
    """CUDA objects held by all open stores of this process (all zero when every store is closed)."""
    with _live_lock:
        return dict(_live)


class Held:
    """What a store holds, in the order acquired: `add` each object with the function that releases it; `release`
    releases them newest first, keeps going past a failure and returns the first failure's message ("" if none)."""

    def __init__(self):
        self._items: list[tuple[str, Callable[[], None]]] = []

    def add(self, kind: str, release: Callable[[], None]) -> None:
        self._items.append((kind, release))
        _count(kind, +1)

    def take(self, other: Held) -> None:
        """Moves `other`'s objects (acquired after this one's) into this one, to be released first."""
        self._items.extend(other._items)
        other._items = []

    def release(self) -> str:
        first = ""
        while self._items:
            kind, release = self._items.pop()
            try:
                release()
                _count(kind, -1)
            except StoreError as e:
                first = first or str(e)
        return first


# ---- a spinlock shared with the custom calls --------------------------------------------------------------------

@contextlib.contextmanager
def _spinlock(address: int):
    """Holds the pthread spinlock at `address` (a table row's lock word, which the handlers take with the same
    glibc functions). ctypes releases the GIL while it spins."""
    libc = _libc()
    libc.pthread_spin_lock(address)
    try:
        yield
    finally:
        libc.pthread_spin_unlock(address)


_libc_handle = None


def _libc():
    global _libc_handle
    if _libc_handle is None:
        lib = ctypes.CDLL(None)
        for fn in ("pthread_spin_init", "pthread_spin_lock", "pthread_spin_unlock"):
            getattr(lib, fn).restype = ctypes.c_int
        lib.pthread_spin_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.pthread_spin_lock.argtypes = lib.pthread_spin_unlock.argtypes = [ctypes.c_void_p]
        _libc_handle = lib
    return _libc_handle


# Tables of closed stores stay allocated: a compiled program that still calls a closed store's custom call then
# reads "closed" from its table instead of freed memory.
_closed_tables: list[np.ndarray] = []


# ---- layout (pure arithmetic) ----------------------------------------------------------------------------------

def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def as_int64(values: Sequence[int]) -> np.ndarray:
    """Addresses and handles as an int64 attribute array: the same 64 bits (an address past 2**63 wraps negative;
    the handlers read the bits back as uint64)."""
    return np.array([int(v) & 0xFFFF_FFFF_FFFF_FFFF for v in values], dtype=np.uint64).view(np.int64)


class Region:
    """One (layer, weight): every rank's block in one reserved virtual address range."""

    def __init__(self, block: int, granularity: int, ranks: int):
        self.block = block
        self.stride = round_up(block, granularity)  # bytes between rank blocks
        self.reserved = self.stride * ranks
        self.va = 0
        self.handles: list = [None] * ranks
        self.mapped = [False] * ranks

    def address(self, rank: int) -> int:
        return self.va + rank * self.stride


class Device:
    """One device row of a store in this process."""

    def __init__(self, ordinal: int):
        self.ordinal = ordinal
        self.dev = None
        self.context = None
        self.copy = None
        self.ready = None
        self.done: list = []
        self.timing: list[tuple] = []  # per layer (start, stop), with timing
        self.rank = -1  # the rank whose blocks live on this device
        self.views_va = 0  # in place: the row's compute views, layer-major (see VmmStore.view_address)


# ---- the store ---------------------------------------------------------------------------------------------------

_store_ids = itertools.count(1)


class VmmStore:
    """Every CUDA object of one expert store in this process (see the module doc). Build it with `build` (one
    process drives every rank's device) or `build_local` (this process is one rank). `expert_bytes`: per weight,
    the bytes of one expert; a rank's block is `slots` experts; `experts` of the N x slots are real (the last
    rank's padding slots are never copied)."""

    def __init__(self, *, ranks: int, layers: int, expert_bytes: Sequence[int], slots: int, experts: int,
                 local_rank: int | None, timing: bool, pending_slots: int | None = None, in_place: bool = False,
                 slot_sets: int = 2, where: str):
        if ranks < 1 or layers < 1 or not expert_bytes or slots < 1 or not 1 <= experts <= ranks * slots:
            raise ValueError(f"{where}: bad sizes (ranks {ranks}, layers {layers}, weights {len(expert_bytes)}, "
                             f"slots {slots}, experts {experts})")
        if any(b <= 0 for b in expert_bytes):
            raise ValueError(f"{where}: a weight of 0 bytes per expert: {list(expert_bytes)}")
        if slot_sets < 2:
            raise ValueError(f"{where}: {slot_sets} slot sets; in place needs at least 2 (one read, one filled)")
        self.ranks, self.layers, self.slots, self.experts = ranks, layers, slots, experts
        self.expert_bytes = [int(b) for b in expert_bytes]
        self.local_rank, self.timing = local_rank, timing
        # Prefetches not yet waited for, per device: normally two (layer l+1's is enqueued before layer l's wait),
        # three at depth 2; a prefetch nobody waits for (timing probes) holds its slot until sync(). One slot per
        # layer plus a margin covers a whole prefill of those.
        self.pending_slots = pending_slots or layers + DEFAULT_PENDING_SLOTS
        self.id = next(_store_ids)
        self.devices: list[Device] = []
        self.regions: list[Region] = []  # layer * weights + weight
        self.granularity = 0
        self.handle_type = "posix_fd"
        self.held = Held()  # everything but the retained contexts, released with device 0's context current
        self.retained = Held()  # the primary contexts, released last
        self.table = np.zeros(0, np.int64)
        self.closed = False
        self._attributes: dict[int | str, dict] = {}  # per layer (copy out); "in_place"
        # In place is asked for; it holds once the granularity is known (see _views_possible).
        self.in_place, self.slot_sets = in_place, slot_sets
        self.not_in_place = "" if in_place else "not asked for"

    # ---- building ----------------------------------------------------------------------------------------------
    @classmethod
    def build(cls, ordinals: Sequence[int], **sizes) -> VmmStore:
        """One process drives every rank: rank r on device ordinals[r]."""
        store = cls(ranks=len(ordinals), local_rank=None, where="ExpertStore", **sizes)
        if len(set(ordinals)) != len(ordinals):
            raise ValueError(f"ExpertStore: a device is given for two ranks: {list(ordinals)}")
        return store._acquire(store._build_all, list(ordinals))

    @classmethod
    def build_local(cls, ordinal: int, rank: int, ranks: int, **sizes) -> VmmStore:
        """One process per device: this process is rank `rank` of `ranks`, on device `ordinal`; only its blocks."""
        if not 0 <= rank < ranks:
            raise ValueError(f"ProcessExpertStore: rank {rank} is not in [0, {ranks})")
        store = cls(ranks=ranks, local_rank=rank, where="ProcessExpertStore", **sizes)
        return store._acquire(store._build_local, ordinal)

    def _acquire(self, build, *args) -> VmmStore:
        """Runs `build`; a failure releases everything acquired so far before it propagates."""
        _count("stores", +1)
        try:
            build(*args)
        except BaseException:
            self._teardown()
            raise
        return self

    def _add_device(self, ordinal: int, where: str) -> Device:
        d = driver()
        dev = Device(ordinal)
        dev.dev = cu(where, "cuDeviceGet", ordinal)
        vmm = cu(where, "cuDeviceGetAttribute",
                 d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev.dev)
        if not vmm:
            raise StoreError(f"{where}: device {ordinal} does not support CUDA VMM")
        dev.context = cu(where, "cuDevicePrimaryCtxRetain", dev.dev)
        self.retained.add("contexts", lambda: cu("close", "cuDevicePrimaryCtxRelease", dev.dev))
        self.devices.append(dev)
        with self.current(dev, where):
            dev.copy = cu(where, "cuStreamCreate", int(d.CUstream_flags.CU_STREAM_NON_BLOCKING))
            self.held.add("streams", self._in(dev, "cuStreamDestroy", dev.copy))
            dev.ready = self._event(dev, int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), where)
            dev.done = [self._event(dev, int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING), where)
                        for _ in range(self.pending_slots)]
            if self.timing:
                dev.timing = [(self._event(dev, int(d.CUevent_flags.CU_EVENT_DEFAULT), where),
                               self._event(dev, int(d.CUevent_flags.CU_EVENT_DEFAULT), where))
                              for _ in range(self.layers)]
        return dev

    def _event(self, dev: Device, flags: int, where: str):
        event = cu(where, "cuEventCreate", flags)
        self.held.add("events", self._in(dev, "cuEventDestroy", event))
        return event

    def _in(self, dev: Device, name: str, *args) -> Callable[[], None]:
        """A release: `name(*args)` with dev's context current."""
        def release():
            with self.current(dev, "close"):
                cu("close", name, *args)
        return release

    @contextlib.contextmanager
    def current(self, dev: Device, where: str):
        """dev's primary context current on this thread for the block."""
        cu(where, "cuCtxPushCurrent", dev.context)
        try:
            yield
        finally:
            driver().cuCtxPopCurrent()  # (its failure would hide the block's own error; there is nothing to undo)

    def _allocation_prop(self, ordinal: int, handle_type):
        d = driver()
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = ordinal
        prop.requestedHandleTypes = handle_type
        return prop

    def _access(self, ordinal: int):
        d = driver()
        desc = d.CUmemAccessDesc()
        desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = ordinal
        desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return desc

    def _granularity(self, prop, where: str) -> int:
        option = driver().CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        return int(cu(where, "cuMemGetAllocationGranularity", prop, option))

    def _fabric_works(self, ordinal: int) -> bool:
        """FABRIC handles (multi-node NVLink) need IMEX: drivers advertise them where cuMemCreate then refuses
        (CUDA_ERROR_NOT_PERMITTED on the H200 hosts), so a probe allocation decides. Never fails."""
        d = driver()
        prop = self._allocation_prop(ordinal, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC)
        try:
            gran = self._granularity(prop, "probe")
            handle = cu("probe", "cuMemCreate", gran, prop, 0)
        except StoreError:
            return False
        try:
            cu("probe", "cuMemRelease", handle)
        except StoreError:
            pass
        return True

    def _create_block(self, reg: Region, rank: int, prop, layer: int, where: str) -> None:
        """Allocates rank `rank`'s block of `reg` (prop: on its device) and maps it at its offset."""
        try:
            handle = cu(where, "cuMemCreate", reg.stride, prop, 0)
        except CudaError as e:
            hint = ""
            if e.code == int(driver().CUresult.CUDA_ERROR_OUT_OF_MEMORY):
                hint = (" (XLA preallocates XLA_PYTHON_CLIENT_MEM_FRACTION of GPU memory; leave room for the store, "
                        "e.g. XLA_PYTHON_CLIENT_PREALLOCATE=false)")
            raise CudaError(f"{e} allocating {reg.stride} bytes on device {prop.location.id} for layer {layer}"
                            f"{hint}", e.code) from None
        reg.handles[rank] = handle
        self.held.add("allocations", lambda: self._forget_handle(reg, rank, "cuMemRelease", handle))
        cu(where, "cuMemMap", reg.address(rank), reg.stride, 0, handle, 0)
        reg.mapped[rank] = True
        self.held.add("mappings", lambda: self._unmap(reg, rank))

    def _forget_handle(self, reg: Region, rank: int, name: str, handle) -> None:
        cu("close", name, handle)
        reg.handles[rank] = None

    def _unmap(self, reg: Region, rank: int) -> None:
        cu("close", "cuMemUnmap", reg.address(rank), reg.stride)
        reg.mapped[rank] = False

    def _reserve(self, reg: Region, where: str) -> None:
        reg.va = int(cu(where, "cuMemAddressReserve", reg.reserved, self.granularity, 0, 0))
        va = reg.va
        self.held.add("va_ranges", lambda: cu("close", "cuMemAddressFree", va, reg.reserved))

    def _regions(self) -> None:
        self.regions = [Region(self.slots * b, self.granularity, self.ranks)
                        for _ in range(self.layers) for b in self.expert_bytes]

    def _build_all(self, ordinals: list[int]) -> None:
        where = "ExpertStore"
        d = driver()
        cu(where, "cuInit", 0)
        for ordinal in ordinals:
            self._add_device(ordinal, where)
        for a in self.devices:
            for b in self.devices:
                if a is not b and not cu(where, "cuDeviceCanAccessPeer", a.dev, b.dev):
                    raise StoreError(f"{where}: device {a.ordinal} cannot access device {b.ordinal}'s memory (no "
                                     "peer access: DWDP needs NVLink or PCIe P2P)")
        with self.current(self.devices[0], where):
            fabric = self._fabric_works(ordinals[0])
        self.handle_type = "fabric" if fabric else "posix_fd"
        kind = (d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC if fabric else
                d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        props = [self._allocation_prop(o, kind) for o in ordinals]
        self.granularity = max(self._granularity(p, where) for p in props)
        access = [self._access(o) for o in ordinals]
        self._regions()
        with self.current(self.devices[0], where):
            for i, reg in enumerate(self.regions):
                self._reserve(reg, where)
                for r, prop in enumerate(props):
                    self._create_block(reg, r, prop, i // len(self.expert_bytes), where)
                cu(where, "cuMemSetAccess", reg.va, reg.reserved, access, len(access))
        for r, (dev, prop) in enumerate(zip(self.devices, props)):
            dev.rank = r
            self._build_views(dev, prop, where)
        self._open_table()

    def _build_local(self, ordinal: int) -> None:
        where = "ProcessExpertStore"
        d = driver()
        cu(where, "cuInit", 0)
        dev = self._add_device(ordinal, where)
        # Exported as POSIX descriptors. Every process must compute the same strides: the granularity of the
        # allocation kind, which is the same on every GPU of a host.
        prop = self._allocation_prop(ordinal, d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)
        with self.current(dev, where):
            self.granularity = self._granularity(prop, where)
            self._regions()
            access = self._access(ordinal)
            r = self.local_rank
            for i, reg in enumerate(self.regions):
                self._reserve(reg, where)
                self._create_block(reg, r, prop, i // len(self.expert_bytes), where)
                cu(where, "cuMemSetAccess", reg.address(r), reg.stride, [access], 1)
        dev.rank = r
        self._build_views(dev, prop, where)
        self._open_table()

    # ---- in place: the compute views -----------------------------------------------------------------------------
    def _views_possible(self) -> str:
        """Why the views cannot be contiguous [E, ...] tensors ("" when they can): a block that is not a multiple of
        the granularity leaves a gap before the next rank's block."""
        ragged = [w for w, b in enumerate(self.expert_bytes) if (self.slots * b) % self.granularity]
        if ragged:
            return (f"weight {ragged[0]}'s block of {self.slots * self.expert_bytes[ragged[0]]} bytes is not a "
                    f"multiple of the {self.granularity}-byte allocation granularity")
        return ""

    def layer_view_bytes(self) -> int:
        """The virtual bytes of one layer's views on a row (every weight's `ranks x stride`)."""
        return sum(self.ranks * round_up(self.slots * b, self.granularity) for b in self.expert_bytes)

    def view_address(self, row: int, layer: int, weight: int) -> int:
        """Where device row `row` sees layer `layer`'s weight `weight` as one [E, ...] tensor (in place)."""
        dev = self.devices[row]
        offset = sum(self.ranks * round_up(self.slots * b, self.granularity) for b in self.expert_bytes[:weight])
        return dev.views_va + layer * self.layer_view_bytes() + offset

    def slot_bytes(self) -> int:
        """The device memory of one row's slots (in place; 0 otherwise): slot_sets x the peers' blocks of a
        layer."""
        if not self.in_place:
            return 0
        return self.slot_sets * (self.ranks - 1) * sum(round_up(self.slots * b, self.granularity)
                                                        for b in self.expert_bytes)

    def _build_views(self, dev: Device, prop, where: str) -> None:
        """In place: the row's slots (slot_sets x weights x peers allocations on its device) and its compute views
        (the row's own blocks mapped a second time, the slots at the peers' offsets), readable by its device."""
        if self.in_place:
            self.not_in_place = self._views_possible()
            self.in_place = not self.not_in_place
        if not self.in_place:
            return
        with self.current(dev, where):
            peers = [p for p in range(self.ranks) if p != dev.rank]
            strides = [round_up(self.slots * b, self.granularity) for b in self.expert_bytes]
            slots = {}  # (set, weight, peer) -> handle
            for s in range(self.slot_sets):
                for w, stride in enumerate(strides):
                    for p in peers:
                        try:
                            handle = cu(where, "cuMemCreate", stride, prop, 0)
                        except CudaError as e:
                            raise CudaError(f"{e} allocating a {stride}-byte expert slot on device {dev.ordinal}",
                                            e.code) from None
                        slots[s, w, p] = handle
                        self.held.add("allocations", lambda h=handle: cu("close", "cuMemRelease", h))
            size = self.layers * self.layer_view_bytes()
            dev.views_va = int(cu(where, "cuMemAddressReserve", size, self.granularity, 0, 0))
            va = dev.views_va
            self.held.add("va_ranges", lambda: cu("close", "cuMemAddressFree", va, size))
            row = self.devices.index(dev)
            for layer in range(self.layers):
                for w, stride in enumerate(strides):
                    base = self.view_address(row, layer, w)
                    for p in range(self.ranks):
                        handle = (self.region(layer, w).handles[p] if p == dev.rank else
                                  slots[layer % self.slot_sets, w, p])
                        cu(where, "cuMemMap", base + p * stride, stride, 0, handle, 0)
                        self.held.add("mappings", lambda a=base + p * stride, n=stride: cu("close", "cuMemUnmap", a,
                                                                                            n))
            cu(where, "cuMemSetAccess", va, size, [self._access(dev.ordinal)], 1)

    def _open_table(self) -> None:
        """The host table the custom calls share (one row per device, each row's spinlock initialised)."""
        self.row_words = TABLE_FIRST_SLOT + self.pending_slots
        self.table = np.zeros(len(self.devices) * self.row_words, np.int64)
        for row in range(len(self.devices)):
            _libc().pthread_spin_init(self._row_address(row), 0)

    def _row_address(self, row: int) -> int:
        return self.table.ctypes.data + row * self.row_words * self.table.itemsize

    # ---- one process per device: descriptors -----------------------------------------------------------------
    def export(self) -> list[int]:
        """This rank's block of every (layer, weight), region order, as new POSIX descriptors the caller closes.
        On failure none is left open."""
        where = "ProcessExpertStore.export"
        self._check_local(where)
        kind = driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        fds: list[int] = []
        try:
            with self.current(self.devices[0], where):
                for i, reg in enumerate(self.regions):
                    try:
                        fds.append(int(cu(where, "cuMemExportToShareableHandle", reg.handles[self.local_rank], kind,
                                          0)))
                    except StoreError as e:
                        raise StoreError(f"{e} (block {i})") from None
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def import_peer(self, peer: int, fds: Sequence[int]) -> None:
        """Maps rank `peer`'s blocks from the descriptors it exported (export's order) into this device's ranges,
        readable by this device. The descriptors stay the caller's (an imported handle holds its own reference to
        the peer's memory). On a failure part-way, this peer's blocks imported so far are released again."""
        where = f"ProcessExpertStore.import(rank {peer})"
        self._check_local(where)
        if not 0 <= peer < self.ranks or peer == self.local_rank:
            raise StoreError(f"{where}: not a peer rank of this store (ranks {self.ranks}, this one "
                             f"{self.local_rank})")
        if len(fds) != len(self.regions):
            raise StoreError(f"{where}: {len(fds)} descriptors, the store has {len(self.regions)} blocks (layers x "
                             "weights)")
        if self.rank_mapped(peer):
            raise StoreError(f"{where}: already imported")
        kind = driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        dev = self.devices[0]
        access = self._access(dev.ordinal)
        mine = Held()
        with self.current(dev, where):
            try:
                for i, (reg, fd) in enumerate(zip(self.regions, fds)):
                    try:
                        handle = cu(where, "cuMemImportFromShareableHandle", int(fd), kind)
                    except StoreError as e:
                        raise StoreError(f"{e} (block {i})") from None
                    reg.handles[peer] = handle
                    mine.add("allocations", lambda reg=reg, h=handle: self._forget_handle(reg, peer, "cuMemRelease",
                                                                                          h))
                    try:
                        cu(where, "cuMemMap", reg.address(peer), reg.stride, 0, handle, 0)
                    except StoreError as e:  # e.g. a peer of another configuration: its block is smaller
                        raise StoreError(f"{e} mapping block {i} ({reg.stride} bytes): do all ranks use the same "
                                         "layers, weights and slots?") from None
                    reg.mapped[peer] = True
                    mine.add("mappings", lambda reg=reg: self._unmap(reg, peer))
                    try:
                        cu(where, "cuMemSetAccess", reg.address(peer), reg.stride, [access], 1)
                    except StoreError as e:
                        raise StoreError(f"{e} on block {i} (can device {dev.ordinal} reach the peer's GPU? DWDP "
                                         "needs NVLink or PCIe P2P)") from None
            except BaseException:
                mine.release()
                raise
        self.held.take(mine)
        self._attributes.clear()

    def _check_local(self, where: str) -> None:
        self._check_open(where)
        if self.local_rank is None:
            raise StoreError(f"{where}: the store was not built for one process per device (build_local)")

    def rank_mapped(self, rank: int) -> bool:
        return all(reg.mapped[rank] for reg in self.regions)

    # ---- use -------------------------------------------------------------------------------------------------
    def region(self, layer: int, weight: int) -> Region:
        return self.regions[layer * len(self.expert_bytes) + weight]

    def block_bytes(self, weight: int) -> int:
        return self.slots * self.expert_bytes[weight]

    def row_of_rank(self, rank: int) -> int | None:
        """The device row holding rank `rank`'s blocks in this process; None for a peer process's rank."""
        if self.local_rank is not None:
            return 0 if rank == self.local_rank else None
        return rank if 0 <= rank < self.ranks else None

    def fill(self, layer: int, weight: int, rank: int, src: int, nbytes: int) -> None:
        """Copies `nbytes` from device address `src` (on rank `rank`'s device) into rank `rank`'s block of
        (layer, weight), and waits for the copy."""
        where = "ExpertStore.fill"
        self._check_open(where)
        if not (0 <= layer < self.layers and 0 <= weight < len(self.expert_bytes) and 0 <= rank < self.ranks):
            raise StoreError(f"{where}: (layer {layer}, weight {weight}, rank {rank}) is out of range")
        if nbytes != self.block_bytes(weight):
            raise StoreError(f"{where}: layer {layer} weight {weight} rank {rank}: got {nbytes} bytes, expected "
                             f"{self.block_bytes(weight)}")
        row = self.row_of_rank(rank)
        if row is None:
            raise StoreError(f"{where}: rank {rank}'s blocks belong to another process")
        dev = self.devices[row]
        with self.current(dev, where):
            cu(where, "cuMemcpyDtoDAsync", self.region(layer, weight).address(rank), src, nbytes, dev.copy)
            cu(where, "cuStreamSynchronize", dev.copy)

    def prefetch_attributes(self, layer: int) -> dict:
        """Copy out: the attributes of layer `layer`'s dwdp_prefetch custom call, its whole interface (handlers.h,
        PrefetchBinding), the same for every device of the store (each finds its row by its ordinal)."""
        where = f"dwdp_prefetch(store {self.id}, layer {layer})"
        self._check_mapped(where)
        if self.in_place:
            raise StoreError(f"{where}: the store reads its experts in place (in_place_attributes)")
        if not 0 <= layer < self.layers:
            raise StoreError(f"{where}: layer out of range [0, {self.layers})")
        if layer not in self._attributes:
            self._attributes[layer] = dict(self._copy_attributes(), layer=np.int64(layer),
                                           timing=as_int64(self._timing_events(layer)),
                                           sources=as_int64(self._sources(layer)))
        return self._attributes[layer]

    def in_place_attributes(self) -> dict:
        """In place: the attributes of dwdp_prefetch_in_place (handlers.h, PrefetchInPlaceBinding), one set for
        every layer: the layer is the one whose gate_up view the call gets as its target operand, so the call can
        sit inside a program that one compilation serves for every layer. `sources` and `timing` hold every layer;
        `view_layout` = [slot sets, bytes of one layer's views, layers, each row's first view], from which the
        handler finds the target's layer and tells which slot set a pending prefetch fills."""
        where = f"dwdp_prefetch_in_place(store {self.id})"
        self._check_mapped(where)
        if not self.in_place:
            raise StoreError(f"{where}: the store copies its experts out ({self.not_in_place})")
        if "in_place" not in self._attributes:
            layer_bytes = self.layer_view_bytes()
            self._attributes["in_place"] = dict(
                self._copy_attributes(),
                timing=as_int64(e for layer in range(self.layers) for e in self._timing_events(layer)),
                sources=as_int64(a for layer in range(self.layers) for a in self._sources(layer)),
                total_bytes=as_int64(self.experts * b for b in self.expert_bytes),
                view_layout=as_int64([self.slot_sets, layer_bytes, self.layers,
                                      *(d.views_va for d in self.devices)]))
        return self._attributes["in_place"]

    def _check_mapped(self, where: str) -> None:
        self._check_open(where)
        if len(self.expert_bytes) != 2:
            raise StoreError(f"{where}: the store holds {len(self.expert_bytes)} weights, expected 2")
        for r in range(self.ranks):
            if not self.rank_mapped(r):
                raise StoreError(f"{where}: rank {r}'s blocks are not mapped here yet (connect the store first)")

    def _copy_attributes(self) -> dict:
        """What both prefetches' attributes share, whatever the layer."""
        ranks = [self.local_rank] if self.local_rank is not None else list(range(self.ranks))
        return dict(self.wait_attributes(), ranks=as_int64(ranks),
                    streams=as_int64(int(d.copy) for d in self.devices),
                    ready=as_int64(int(d.ready) for d in self.devices),
                    block_bytes=as_int64(self.block_bytes(w) for w in range(2)))

    def _timing_events(self, layer: int) -> list[int]:
        """Per device row, layer `layer`'s copy start / stop events (0, 0 when not timed)."""
        return [int(e) for d in self.devices for e in (d.timing[layer] if d.timing else (0, 0))]

    def _sources(self, layer: int) -> list[int]:
        """sources[w * N + r]: where rank r's block of weight w of layer `layer` is."""
        return [self.region(layer, w).address(r) for w in range(2) for r in range(self.ranks)]

    def wait_attributes(self) -> dict:
        """The attributes of the store's dwdp_wait custom call (handlers.h, WaitBinding): one for every layer."""
        self._check_open(f"dwdp_wait(store {self.id})")
        return dict(store=np.int64(self.id), table=np.int64(self.table.ctypes.data),
                    ordinals=as_int64(d.ordinal for d in self.devices),
                    contexts=as_int64(int(d.context) for d in self.devices),
                    done=as_int64(int(e) for d in self.devices for e in d.done))

    def copy_ms(self) -> np.ndarray:
        """[device rows, layers]: each layer's last prefetch copy time in ms, NaN where none was timed."""
        where = "ExpertStore.copy_ms"
        self._check_open(where)
        out = np.full((len(self.devices), self.layers), np.nan)
        if not self.timing:
            return out
        not_recorded = int(driver().CUresult.CUDA_ERROR_INVALID_HANDLE)  # an event pair never recorded
        for row, dev in enumerate(self.devices):
            with self.current(dev, where):
                for layer, (start, stop) in enumerate(dev.timing):
                    cu(where, "cuEventSynchronize", stop)
                    try:
                        out[row, layer] = float(cu(where, "cuEventElapsedTime", start, stop))
                    except CudaError as e:
                        if e.code != not_recorded:
                            raise
        return out

    def sync(self) -> None:
        """Waits for every copy enqueued so far and forgets the prefetches nobody waited for (an error path dropped
        their outputs): afterwards no copy writes into memory XLA may have freed. Under each row's lock, so no
        custom call enqueues in between."""
        if self.closed:
            return
        first = ""
        for row, dev in enumerate(self.devices):
            with _spinlock(self._row_address(row)):
                try:
                    with self.current(dev, "ExpertStore.sync"):
                        cu("ExpertStore.sync", "cuStreamSynchronize", dev.copy)
                except StoreError as e:
                    first = first or str(e)
                start = row * self.row_words + TABLE_FIRST_SLOT
                self.table[start:start + self.pending_slots] = 0
        if first:
            raise StoreError(first)

    def info(self) -> dict:
        """How the store holds its experts: the handle type, the granularity and whether the MoE reads them in
        place (`mode`, with `slot_sets` and `slot_bytes` per row) or from XLA buffers the prefetch fills ("copy",
        with why not in place)."""
        if self.in_place:
            return {"handle_type": self.handle_type, "granularity": self.granularity, "mode": "in_place",
                    "slot_sets": self.slot_sets, "slot_bytes": self.slot_bytes()}
        return {"handle_type": self.handle_type, "granularity": self.granularity, "mode": "copy",
                "not_in_place": self.not_in_place}

    def _check_open(self, where: str) -> None:
        if self.closed:
            raise StoreError(f"{where}: expert store {self.id} is closed")

    # ---- lifetime --------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Makes the custom calls refuse (under each row's lock, so none is half-way through enqueuing), waits
        for every stream of the store's devices (XLA's included: nothing may still read or write the memory),
        then releases everything, newest first; keeps going past a failure and raises the first. Idempotent."""
        if self.closed:
            return
        self.closed = True
        first = self._teardown()
        if first:
            raise StoreError(first)

    def _teardown(self) -> str:
        first = ""
        for row in range(len(self.devices) if self.table.size else 0):
            with _spinlock(self._row_address(row)):
                self.table[row * self.row_words + TABLE_CLOSED] = 1
        for dev in self.devices:
            if dev.context is None:
                continue
            try:
                with self.current(dev, "close"):
                    cu("close", "cuCtxSynchronize")
            except StoreError as e:
                first = first or str(e)
        if self.devices and self.devices[0].context is not None:
            try:
                with self.current(self.devices[0], "close"):
                    first = self.held.release() or first
            except StoreError as e:  # the context could not be made current: release without it
                first = first or str(e)
        first = self.held.release() or first
        first = self.retained.release() or first
        if self.table.size:
            _closed_tables.append(self.table)
        self.closed = True
        self._attributes.clear()
        _count("stores", -1)
        return first


def device_memory(ordinal: int) -> tuple[int, int]:
    """(free, total) bytes of a GPU as the driver sees them (XLA's pool counts as used)."""
    where = "device_memory"
    cu(where, "cuInit", 0)
    dev = cu(where, "cuDeviceGet", ordinal)
    ctx = cu(where, "cuDevicePrimaryCtxRetain", dev)
    try:
        cu(where, "cuCtxPushCurrent", ctx)
        try:
            free, total = cu(where, "cuMemGetInfo")
        finally:
            cu(where, "cuCtxPopCurrent")
    finally:
        cu(where, "cuDevicePrimaryCtxRelease", dev)
    return int(free), int(total)

"""A stand-in for `cuda.bindings.driver` on machines without a GPU (or without cuda-bindings): the calls the expert
store makes, with cuda.bindings' conventions (every call returns a tuple whose first item is a CUresult, then its
outputs; enums and structs by the same names), and the driver's rules the store relies on checked as it goes:
a stream or event is made and destroyed with a context current, memory is unmapped before its range is freed, a
handle is mapped only into a reserved range and no larger than it is, nothing is released twice.

`fail_at(name, n, code)` makes the n-th call (1-based) of `name` return `code`; `live()` counts what is alive.
"""

from __future__ import annotations

import enum
import itertools
import os
from types import SimpleNamespace


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801


class CUmemAllocationHandleType(enum.IntEnum):
    CU_MEM_HANDLE_TYPE_NONE = 0
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
    CU_MEM_HANDLE_TYPE_FABRIC = 8


CUdevice_attribute = SimpleNamespace(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED=102)
CUstream_flags = SimpleNamespace(CU_STREAM_DEFAULT=0, CU_STREAM_NON_BLOCKING=1)
CUevent_flags = SimpleNamespace(CU_EVENT_DEFAULT=0, CU_EVENT_DISABLE_TIMING=2)
CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0,
                                                   CU_MEM_ALLOC_GRANULARITY_RECOMMENDED=1)
CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
GRANULARITY = 2 << 20


class CUmemAllocationProp:
    def __init__(self):
        self.type = 0
        self.requestedHandleTypes = CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        self.location = SimpleNamespace(type=0, id=0)


class CUmemAccessDesc:
    def __init__(self):
        self.location = SimpleNamespace(type=0, id=0)
        self.flags = 0


class Handle(int):
    """A CUDA object: an integer value (cuda.bindings' objects convert with int())."""


class FakeDriver:
    CUresult = CUresult
    CUmemAllocationHandleType = CUmemAllocationHandleType
    CUdevice_attribute = CUdevice_attribute
    CUstream_flags = CUstream_flags
    CUevent_flags = CUevent_flags
    CUmemAllocationType = CUmemAllocationType
    CUmemLocationType = CUmemLocationType
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUmemAccess_flags = CUmemAccess_flags
    CUmemAllocationProp = CUmemAllocationProp
    CUmemAccessDesc = CUmemAccessDesc

    def __init__(self, devices: int = 2, *, fabric: bool = False, peer_access: bool = True):
        self.devices, self.fabric, self.peer_access = devices, fabric, peer_access
        self._ids = itertools.count(0x1000, 0x10)
        self._va = itertools.count(0x7F00_0000_0000, 1 << 36)
        self.contexts: dict[int, int] = {}  # device -> retain count
        self.stack: list[int] = []  # this thread's current contexts
        self.streams: dict[int, int] = {}  # stream -> its device
        self.events: dict[int, int] = {}
        self.handles: dict[int, int] = {}  # handle -> size
        self.ranges: dict[int, int] = {}  # va -> size
        self.maps: dict[int, tuple[int, int]] = {}  # address -> (size, handle)
        self.exported: list[int] = []
        self.calls: list[str] = []
        self._fail: dict[str, tuple[int, CUresult]] = {}

    # ---- test controls -------------------------------------------------------------------------------------
    def fail_at(self, name: str, n: int, code: CUresult = CUresult.CUDA_ERROR_OUT_OF_MEMORY) -> None:
        self._fail[name] = (n, code)

    def live(self) -> dict[str, int]:
        return {"contexts": sum(self.contexts.values()), "streams": len(self.streams), "events": len(self.events),
                "allocations": len(self.handles), "va_ranges": len(self.ranges), "mappings": len(self.maps)}

    def __getattribute__(self, name):
        attr = object.__getattribute__(self, name)
        if not name.startswith("cu") or not callable(attr):
            return attr
        calls = object.__getattribute__(self, "calls")

        def call(*args):
            calls.append(name)
            n, code = object.__getattribute__(self, "_fail").get(name, (0, None))
            if n and calls.count(name) == n:
                return (code, None) if name not in _NO_OUTPUT else (code,)
            return attr(*args)
        return call

    def _current(self) -> int | None:
        return self.stack[-1] if self.stack else None

    def _need_context(self):
        return None if self.stack else (CUresult.CUDA_ERROR_INVALID_CONTEXT,)

    # ---- the calls -----------------------------------------------------------------------------------------
    def cuGetErrorName(self, code):
        return CUresult.CUDA_SUCCESS, CUresult(int(code)).name.encode()

    def cuInit(self, flags):
        return (CUresult.CUDA_SUCCESS,)

    def cuDeviceGet(self, ordinal):
        if not 0 <= ordinal < self.devices:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        return CUresult.CUDA_SUCCESS, Handle(ordinal)

    def cuDeviceGetAttribute(self, attribute, dev):
        return CUresult.CUDA_SUCCESS, 1

    def cuDeviceCanAccessPeer(self, a, b):
        return CUresult.CUDA_SUCCESS, int(self.peer_access)

    def cuDevicePrimaryCtxRetain(self, dev):
        self.contexts[int(dev)] = self.contexts.get(int(dev), 0) + 1
        return CUresult.CUDA_SUCCESS, Handle(0x100 + int(dev))

    def cuDevicePrimaryCtxRelease(self, dev):
        if self.contexts.get(int(dev), 0) < 1:
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        self.contexts[int(dev)] -= 1
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxPushCurrent(self, ctx):
        self.stack.append(int(ctx))
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxPopCurrent(self):
        if not self.stack:
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        return CUresult.CUDA_SUCCESS, Handle(self.stack.pop())

    def cuCtxSynchronize(self):
        return self._need_context() or (CUresult.CUDA_SUCCESS,)

    def cuStreamCreate(self, flags):
        if self._need_context():
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        stream = Handle(next(self._ids))
        self.streams[stream] = self._current()
        return CUresult.CUDA_SUCCESS, stream

    def cuStreamDestroy(self, stream):
        if self.streams.get(int(stream)) is None or self.streams[int(stream)] != self._current():
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        del self.streams[int(stream)]
        return (CUresult.CUDA_SUCCESS,)

    def cuStreamSynchronize(self, stream):
        return (CUresult.CUDA_SUCCESS if int(stream) in self.streams else CUresult.CUDA_ERROR_INVALID_HANDLE,)

    def cuEventCreate(self, flags):
        if self._need_context():
            return CUresult.CUDA_ERROR_INVALID_CONTEXT, None
        event = Handle(next(self._ids))
        self.events[event] = self._current()
        return CUresult.CUDA_SUCCESS, event

    def cuEventDestroy(self, event):
        if self.events.get(int(event)) is None or self.events[int(event)] != self._current():
            return (CUresult.CUDA_ERROR_INVALID_HANDLE,)
        del self.events[int(event)]
        return (CUresult.CUDA_SUCCESS,)

    def cuEventSynchronize(self, event):
        return (CUresult.CUDA_SUCCESS,)

    def cuEventElapsedTime(self, start, stop):
        return CUresult.CUDA_ERROR_INVALID_HANDLE, None  # never recorded: no custom call runs here

    def cuMemGetAllocationGranularity(self, prop, option):
        if prop.requestedHandleTypes == CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC and not self.fabric:
            return CUresult.CUDA_ERROR_NOT_SUPPORTED, None
        return CUresult.CUDA_SUCCESS, GRANULARITY

    def cuMemCreate(self, size, prop, flags):
        if size % GRANULARITY or flags or not 0 <= prop.location.id < self.devices:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        if prop.requestedHandleTypes == CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC and not self.fabric:
            return CUresult.CUDA_ERROR_NOT_PERMITTED, None
        handle = Handle(next(self._ids))
        self.handles[handle] = size
        return CUresult.CUDA_SUCCESS, handle

    def cuMemRelease(self, handle):
        if self.handles.pop(int(handle), None) is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        if size % GRANULARITY or alignment % GRANULARITY:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        va = next(self._va)
        self.ranges[va] = size
        return CUresult.CUDA_SUCCESS, Handle(va)

    def cuMemAddressFree(self, va, size):
        if self.ranges.get(int(va)) != size or any(int(va) <= a < int(va) + size for a in self.maps):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        del self.ranges[int(va)]
        return (CUresult.CUDA_SUCCESS,)

    def _inside(self, address: int, size: int) -> bool:
        return any(va <= address and address + size <= va + n for va, n in self.ranges.items())

    def cuMemMap(self, address, size, offset, handle, flags):
        if int(handle) not in self.handles or size > self.handles[int(handle)] or offset or flags \
                or not self._inside(int(address), size) or int(address) in self.maps:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.maps[int(address)] = (size, int(handle))
        return (CUresult.CUDA_SUCCESS,)

    def cuMemUnmap(self, address, size):
        if self.maps.get(int(address), (None,))[0] != size:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        del self.maps[int(address)]
        return (CUresult.CUDA_SUCCESS,)

    def cuMemSetAccess(self, address, size, descs, count):
        covered = sum(n for a, (n, _) in self.maps.items() if int(address) <= a < int(address) + size)
        if covered != size or count != len(descs) or not descs:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemExportToShareableHandle(self, handle, kind, flags):
        posix = CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        if int(handle) not in self.handles or kind != posix:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        fd = os.memfd_create("fake-vmm-block")
        os.ftruncate(fd, self.handles[int(handle)])
        self.exported.append(fd)
        return CUresult.CUDA_SUCCESS, fd

    def cuMemImportFromShareableHandle(self, fd, kind):
        try:
            size = os.fstat(fd).st_size  # the descriptor must be a real, open one
        except (OSError, TypeError):
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        handle = Handle(next(self._ids))
        self.handles[handle] = size
        return CUresult.CUDA_SUCCESS, handle

    def cuMemcpyDtoDAsync(self, dst, src, size, stream):
        if int(stream) not in self.streams or not any(a <= int(dst) and int(dst) + size <= a + n
                                                      for a, (n, _) in self.maps.items()):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemGetInfo(self):
        return CUresult.CUDA_SUCCESS, 80 << 30, 80 << 30


_NO_OUTPUT = {name for name in dir(FakeDriver) if name.startswith("cu")} - {
    "cuGetErrorName", "cuDeviceGet", "cuDeviceGetAttribute", "cuDeviceCanAccessPeer", "cuDevicePrimaryCtxRetain",
    "cuCtxPopCurrent", "cuStreamCreate", "cuEventCreate", "cuEventElapsedTime", "cuMemGetAllocationGranularity",
    "cuMemCreate", "cuMemAddressReserve", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle",
    "cuMemGetInfo"}

"""A jax.Array that is a view of memory someone else owns (a raw device address), through DLPack, without a copy.

The expert store reads experts in place this way: each layer's composite virtual address range (the rank's own
block mapped where its experts sit, the peers' slots around it) becomes an operand of the layer's compiled program,
so the MoE kernels read the store's memory directly and XLA never holds a copy of the experts.

The view does not own its memory: whoever made the address keeps it mapped until every view of it is deleted (the
store deletes its views before it unmaps; `ExpertStore.close`). The DLPack tensor (its struct and shape) is one
malloc'd block whose deleter is libc's free: XLA frees it when the view goes, without calling back into Python
(which may already be finalizing when the last view is deleted).
"""

from __future__ import annotations

import ctypes

import jax
import numpy as np

__all__ = ["view", "DL_CPU", "DL_CUDA"]

DL_CPU, DL_CUDA = 1, 2  # DLDeviceType
_DL_INT, _DL_UINT, _DL_FLOAT, _DL_BFLOAT = 0, 1, 2, 4  # DLDataTypeCode


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _ManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


# Prototypes of our own: ctypes.pythonapi's function objects are shared by every library in the process, and
# others set their argtypes too (a destructor typed as a CFUNCTYPE refuses our None).
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
_capsule_unused = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_libc = ctypes.CDLL(None)
_malloc, _free = _libc.malloc, _libc.free
_malloc.restype, _malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
_free.restype, _free.argtypes = None, [ctypes.c_void_p]
_FREE = ctypes.cast(_free, ctypes.c_void_p).value


def _dl_dtype(dtype) -> _DataType:
    dtype = np.dtype(dtype)
    if dtype == jax.numpy.bfloat16:
        code = _DL_BFLOAT
    elif dtype.kind == "f":
        code = _DL_FLOAT
    elif dtype.kind == "i":
        code = _DL_INT
    elif dtype.kind == "u":
        code = _DL_UINT
    else:
        raise TypeError(f"device_view: dtype {dtype} has no DLPack code here")
    return _DataType(code, dtype.itemsize * 8, 1)


class _External:
    """The producer side of the DLPack protocol for one address: what jax.dlpack.from_dlpack reads. The managed
    tensor is made by __dlpack__ and belongs to the consumer from then on (it frees it); one that was never consumed
    is freed by `release_unconsumed`."""

    def __init__(self, address: int, shape, dtype, device_type: int, device_id: int):
        self.address, self.shape, self.dtype = address, shape, _dl_dtype(dtype)
        self.device = (device_type, device_id)
        self.capsule = None
        self._block = 0

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, stream=None, **_):
        # The memory is ready whenever XLA reads it: the store orders its writes with its own events.
        size = ctypes.sizeof(_ManagedTensor) + 8 * len(self.shape)
        block = _malloc(size)
        if not block:
            raise MemoryError("device_view: malloc of a DLPack tensor failed")
        ctypes.memset(block, 0, size)
        managed = _ManagedTensor.from_address(block)
        shape = (ctypes.c_int64 * len(self.shape)).from_address(block + ctypes.sizeof(_ManagedTensor))
        shape[:] = self.shape
        t = managed.dl_tensor
        t.data, t.ndim, t.dtype = self.address, len(self.shape), self.dtype
        t.device = _Device(*self.device)
        t.shape = ctypes.cast(shape, ctypes.POINTER(ctypes.c_int64))
        t.strides = None  # row-major, contiguous
        managed.deleter = _FREE
        self._block = block
        self.capsule = _capsule_new(block, b"dltensor", None)
        return self.capsule

    def release_unconsumed(self) -> None:
        """Frees the managed tensor if no consumer took it (the capsule still has its unused name)."""
        if self.capsule is not None and _capsule_unused(self.capsule, b"dltensor"):
            _free(self._block)
        self.capsule, self._block = None, 0


def view(address: int, shape, dtype, device) -> jax.Array:
    """A jax.Array of `shape` / `dtype` on `device` whose buffer is the memory at `address` (row-major,
    contiguous), never a copy: it raises when JAX would copy (an address not aligned as XLA needs).

    The memory must stay valid, and nobody else may write it while XLA reads it, until the view is deleted."""
    if address == 0 or address % 256:
        raise ValueError(f"device_view: address {address:#x} is not a 256-byte aligned device address")
    device_type = {"cpu": DL_CPU, "gpu": DL_CUDA}.get(device.platform)
    if device_type is None:
        raise ValueError(f"device_view: no DLPack device type for platform {device.platform}")
    external = _External(address, tuple(int(s) for s in shape), dtype, device_type, device.local_hardware_id)
    try:
        array = jax.dlpack.from_dlpack(external, device=device, copy=False)
    finally:
        external.release_unconsumed()
    if array.unsafe_buffer_pointer() != address:  # a copy after all: the caller's writes would never be seen
        array.delete()
        raise RuntimeError(f"device_view: JAX copied the memory at {address:#x} instead of viewing it")
    if array.dtype != np.dtype(dtype):
        raise RuntimeError(f"device_view: JAX read dtype {array.dtype}, expected {np.dtype(dtype)}")
    return array

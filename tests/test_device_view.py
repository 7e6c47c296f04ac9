"""jax_dwdp.parallel.device_view on the CPU: a jax.Array that is a view of memory it does not own (what the expert
store hands the MoE in place), never a copy. Host memory stands in for device memory; the DLPack path is the
same (only the device type differs)."""

from __future__ import annotations

import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.parallel.device_view import view


def _aligned(nbytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(owner, a 256-byte aligned uint8 window of it)."""
    owner = np.empty(nbytes + 256, np.uint8)
    start = (-owner.ctypes.data) % 256
    return owner, owner[start:start + nbytes]


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32])
def test_a_view_reads_the_memory_in_place(dtype):
    rng = np.random.default_rng()
    owner, raw = _aligned(64 * 48 * 4)
    item = np.dtype(dtype).itemsize
    shape = (64, 48 * 4 // item)
    window = raw.view(dtype).reshape(shape)
    window[...] = rng.standard_normal(shape).astype(dtype) if np.dtype(dtype).kind == "f" else \
        rng.integers(-1000, 1000, shape).astype(dtype)
    device = jax.devices("cpu")[0]
    a = view(raw.ctypes.data, shape, dtype, device)
    assert a.shape == shape and a.dtype == np.dtype(dtype) and a.unsafe_buffer_pointer() == raw.ctypes.data
    assert np.array_equal(np.asarray(a), window)
    # Not a copy: a write to the memory shows in the next program that reads the view.
    window[3, 5] = 7
    assert jax.jit(lambda x: x[3, 5])(a) == 7
    a.delete()
    del owner


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _malloced_bytes() -> int:
    """glibc's count of the bytes malloc has handed out and not had back."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().uordblks


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallinfo2"), reason="needs glibc's mallinfo2")
def test_views_are_freed_with_their_arrays():
    """Each view's DLPack tensor is one malloc'd block that XLA frees (libc free) when the array goes, deleted or
    garbage-collected: 8,000 more views leave malloc's count where it was (a leak would hold 8,000 blocks)."""
    from jax_dwdp.parallel.device_view import _ManagedTensor

    owner, raw = _aligned(4096)
    device = jax.devices("cpu")[0]
    for _ in range(2000):  # warm-up: the allocator's and XLA's own one-time structures
        view(raw.ctypes.data, (1024,), np.float32, device).delete()
    block = ctypes.sizeof(_ManagedTensor) + 8
    before = _malloced_bytes()
    for i in range(8000):
        v = view(raw.ctypes.data, (1024,), np.float32, device)
        if i % 2:
            v.delete()
        del v  # the other half garbage-collected
    grown = _malloced_bytes() - before
    print(f"8,000 views: malloc'd bytes grew by {grown} (a leak: >= {8000 * block})")
    assert grown < 8000 * block // 4, grown
    del owner


def test_an_unaligned_or_null_address_is_refused():
    owner, raw = _aligned(4096)
    device = jax.devices("cpu")[0]
    with pytest.raises(ValueError, match="is not a 256-byte aligned device address"):
        view(raw.ctypes.data + 4, (16,), np.float32, device)
    with pytest.raises(ValueError, match="is not a 256-byte aligned"):
        view(0, (16,), np.float32, device)
    with pytest.raises(TypeError, match="has no DLPack code"):
        view(raw.ctypes.data, (16,), np.complex64, device)
    del owner

"""The expert store's control plane (jax_dwdp/parallel/cuda_vmm.py) on the CPU, through a stand-in for
cuda.bindings.driver (tests/fake_cuda_driver.py: cuda.bindings' call conventions, the driver's rules checked):

- a store built, filled, exported, imported and closed leaves nothing alive, in the fake driver's count and in
  `live_objects()`; closing twice is fine;
- a failure at ANY driver call of a build (or of an import) releases everything made so far, and says which call
  failed with which CUresult;
- the custom calls' attributes: the names the handlers bind (parsed from ffi/dwdp_store/handlers.h), every rank's
  block address where the handler looks for it, 64-bit addresses kept bit for bit, the host table's layout;
- CUresult codes become messages naming the call and the code, with the out-of-memory hint.
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import numpy as np
import pytest

from jax_dwdp.parallel import cuda_vmm
from jax_dwdp.parallel.cuda_vmm import CudaError, StoreError, VmmStore
from tests.fake_cuda_driver import GRANULARITY, CUresult, FakeDriver

HANDLERS_H = Path(__file__).resolve().parents[1] / "ffi" / "dwdp_store" / "handlers.h"
SIZES = dict(layers=3, expert_bytes=(3 << 20, 1 << 20), slots=2, experts=3, timing=True)  # 6 MiB and 2 MiB blocks


@pytest.fixture
def fake(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(cuda_vmm, "_driver", driver)
    yield driver


def nothing_alive(fake: FakeDriver) -> None:
    assert all(v == 0 for v in fake.live().values()), fake.live()
    assert all(v == 0 for v in cuda_vmm.live_objects().values()), cuda_vmm.live_objects()
    assert not fake.stack, "a context was left current"


def test_one_process_store_lives_and_closes(fake):
    store = VmmStore.build([0, 1], **SIZES)
    live = cuda_vmm.live_objects()
    # 2 ranks x 3 layers x 2 weights blocks; per device a stream, a ready event, layers + 4 done events and a timing
    # pair per layer
    assert live == {"allocations": 12, "mappings": 12, "va_ranges": 6, "streams": 2, "events": 2 * (1 + 7 + 6),
                    "contexts": 2, "stores": 1}, live
    assert fake.live()["allocations"] == 12 and store.handle_type == "posix_fd"
    assert store.info() == {"handle_type": "posix_fd", "granularity": GRANULARITY, "mode": "copy",
                            "not_in_place": "not asked for"}
    reg = store.region(1, 0)
    assert reg.stride == 6 << 20 and reg.reserved == 12 << 20  # 6 MiB blocks: already granularity multiples
    assert store.region(1, 1).stride == GRANULARITY  # 2 MiB
    store.fill(1, 0, 1, 0xABC000, 6 << 20)
    with pytest.raises(StoreError, match="got 5 bytes, expected 6291456"):
        store.fill(1, 0, 1, 0xABC000, 5)
    assert np.isnan(store.copy_ms()).all() and store.copy_ms().shape == (2, 3)  # no prefetch ran: nothing timed
    store.sync()
    store.close()
    store.close()
    nothing_alive(fake)
    with pytest.raises(StoreError, match="is closed"):
        store.prefetch_attributes(0)


def test_fabric_handles_when_a_probe_allocation_works(monkeypatch):
    driver = FakeDriver(fabric=True)
    monkeypatch.setattr(cuda_vmm, "_driver", driver)
    store = VmmStore.build([0, 1], **SIZES)
    assert store.handle_type == "fabric"
    store.close()
    nothing_alive(driver)


def test_no_peer_access_is_a_clear_error(monkeypatch):
    driver = FakeDriver(peer_access=False)
    monkeypatch.setattr(cuda_vmm, "_driver", driver)
    with pytest.raises(StoreError, match="device 0 cannot access device 1's memory .no peer access"):
        VmmStore.build([0, 1], **SIZES)
    nothing_alive(driver)


def _calls_of_a_build(build) -> list[str]:
    driver = FakeDriver()
    cuda_vmm._driver = driver
    try:
        store = build()
        calls = list(driver.calls)
        store.close()
    finally:
        cuda_vmm._driver = None
    return calls


@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in place"])
@pytest.mark.parametrize("kind", ["one process", "one rank"])
def test_a_failure_at_any_driver_call_of_a_build_releases_everything(monkeypatch, kind, in_place):
    """Every driver call a build makes, failed in turn: the constructor raises (naming the call and the
    CUresult, or for the capability probe falls back to POSIX descriptors) and nothing it made is left."""
    sizes = {**SIZES, "in_place": in_place}
    build = ((lambda: VmmStore.build([0, 1], **sizes)) if kind == "one process" else
             (lambda: VmmStore.build_local(1, 1, 2, **sizes)))
    calls = _calls_of_a_build(build)
    seen: dict[str, int] = {}
    failed = 0
    for name in calls:
        seen[name] = seen.get(name, 0) + 1
        if name in ("cuCtxPopCurrent", "cuGetErrorName"):
            continue  # (a pop's result is not checked: there is nothing to undo)
        driver = FakeDriver()
        driver.fail_at(name, seen[name], CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        monkeypatch.setattr(cuda_vmm, "_driver", driver)
        try:
            build().close()
        except StoreError as e:
            failed += 1
            assert f"{name} failed with CUDA_ERROR_OUT_OF_MEMORY (2)" in str(e), (name, str(e))
        nothing_alive(driver)
    assert failed > 30, failed


def test_out_of_memory_names_the_allocation_and_xla_preallocation(fake):
    fake.fail_at("cuMemCreate", 5)  # 2 weights x 2 ranks per layer: layer 1's first
    with pytest.raises(CudaError, match=r"cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY \(2\) allocating "
                                        r"6291456 bytes on device 0 for layer 1 .*XLA_PYTHON_CLIENT_PREALLOCATE"):
        VmmStore.build([0, 1], **SIZES)
    nothing_alive(fake)


def test_two_process_stores_trade_descriptors(fake):
    """Rank 0 and rank 1 of a two-process store (both in this process, on the fake's devices 0 and 1): each exports
    its blocks as descriptors and imports the other's; a second import, a wrong count, a wrong rank are refused;
    a failed import leaves the store as it was; closing releases the imported handles too."""
    stores = [VmmStore.build_local(r, r, 2, **SIZES) for r in range(2)]
    with pytest.raises(StoreError, match="rank 1's blocks are not mapped here yet"):
        stores[0].prefetch_attributes(0)
    fds = [s.export() for s in stores]
    assert all(len(f) == 6 for f in fds)
    with pytest.raises(StoreError, match="not a peer rank"):
        stores[0].import_peer(0, fds[0])
    with pytest.raises(StoreError, match="5 descriptors, the store has 6 blocks"):
        stores[0].import_peer(1, fds[1][:5])
    before = cuda_vmm.live_objects()
    fake.fail_at("cuMemSetAccess", fake.calls.count("cuMemSetAccess") + 3)  # the third block's access
    with pytest.raises(StoreError, match="on block 2 .can device 0 reach the peer's GPU"):
        stores[0].import_peer(1, fds[1])
    assert cuda_vmm.live_objects() == before and not stores[0].rank_mapped(1)
    stores[0].import_peer(1, fds[1])
    stores[1].import_peer(0, fds[0])
    with pytest.raises(StoreError, match="already imported"):
        stores[0].import_peer(1, fds[1])
    for fd in fds[0] + fds[1]:
        os.close(fd)
    assert cuda_vmm.live_objects()["allocations"] == 2 * 12  # each store: its own 6 blocks and the peer's 6
    attrs = stores[1].prefetch_attributes(2)
    assert list(attrs["ranks"]) == [1] and list(attrs["ordinals"]) == [1]
    for s in stores:
        s.close()
    nothing_alive(fake)


def _mapped(fake: FakeDriver, address: int) -> int:
    """The handle the fake maps at `address` (a mapping starts there)."""
    return fake.maps[address][1]


def test_in_place_views_map_the_own_block_and_the_slots(fake):
    """In place, each device row sees each (layer, weight) as one range of `ranks x stride` bytes: its own rank's
    block (the same allocation the peers read) at its offset, and at each peer's offset a slot of its own, from slot
    set layer % 2; the prefetch gets the views and the bytes of E experts; close releases the views and slots."""
    store = VmmStore.build([0, 1], **SIZES, in_place=True)
    try:
        assert store.in_place and store.info()["mode"] == "in_place"
        live = cuda_vmm.live_objects()
        # per row: 2 slot sets x 2 weights x 1 peer slots, 3 layers x 2 weights x 2 ranks mappings, one range
        assert live["allocations"] == 12 + 2 * 4 and live["mappings"] == 12 + 2 * 12 and live["va_ranges"] == 6 + 2
        assert store.slot_bytes() == 2 * ((6 << 20) + (2 << 20)) and store.info()["slot_bytes"] == store.slot_bytes()
        slots = {}
        for row in range(2):
            for layer in range(3):
                for w in range(2):
                    base, stride = store.view_address(row, layer, w), store.region(layer, w).stride
                    assert _mapped(fake, base + row * stride) == store.region(layer, w).handles[row]  # own block
                    peer = _mapped(fake, base + (1 - row) * stride)
                    assert peer not in store.region(layer, w).handles  # a slot, not the peer's block
                    slots[row, layer, w] = peer
        for row in range(2):
            for w in range(2):
                assert slots[row, 0, w] == slots[row, 2, w] != slots[row, 1, w]  # sets alternate by layer
        assert len(set(slots.values())) == 8  # no slot shared between rows or weights
        attrs = store.in_place_attributes()
        assert set(attrs) == _bound_attributes("PrefetchInPlaceBinding")
        for name, value in attrs.items():
            assert value.dtype == np.int64, name
        with pytest.raises(StoreError, match="reads its experts in place"):
            store.prefetch_attributes(1)
        assert list(attrs["total_bytes"]) == [3 * (3 << 20), 3 * (1 << 20)]  # E = 3 experts: no padding slot
        # every layer's sources[(l * 2 + w) * N + r] and timing[(l * rows + row) * 2 + {start, stop}]
        assert [int(v) for v in attrs["sources"]] == [store.region(l, w).address(r) for l in range(3)
                                                      for w in range(2) for r in range(2)]
        assert [int(v) for v in attrs["timing"]] == [int(e) for l in range(3) for d in store.devices
                                                     for e in (d.timing[l] if d.timing else (0, 0))]
        # [slot sets, one layer's view bytes, layers, each row's first view]: the handler's arithmetic, layer
        # l's weight w at base + l * bytes + w * N * block_bytes[0], is where the views are
        layer_bytes = 2 * (6 << 20) + 2 * (2 << 20)
        assert [int(v) for v in attrs["view_layout"]] == [2, layer_bytes, 3, store.view_address(0, 0, 0),
                                                          store.view_address(1, 0, 0)]
        for row in range(2):
            for layer in range(3):
                base = int(attrs["view_layout"][3 + row]) + layer * layer_bytes
                assert [store.view_address(row, layer, w) for w in range(2)] == [
                    base, base + 2 * int(attrs["block_bytes"][0])]
        assert (store.view_address(1, 2, 0) - store.view_address(1, 0, 0)) // layer_bytes == 2
    finally:
        store.close()
    nothing_alive(fake)


def test_blocks_off_the_granularity_are_copied_out(fake):
    store = VmmStore.build([0, 1], **{**SIZES, "expert_bytes": (3 << 20, 1 << 19)}, in_place=True)  # 1 MiB block
    try:
        assert not store.in_place and store.slot_bytes() == 0
        assert store.info()["mode"] == "copy"
        assert "weight 1's block of 1048576 bytes is not a multiple of the 2097152-byte" in \
            store.info()["not_in_place"]
        assert set(store.prefetch_attributes(0)) == _bound_attributes("PrefetchBinding")
    finally:
        store.close()
    nothing_alive(fake)


def test_one_rank_per_process_in_place_views_its_own_slots(fake):
    """One process per device: the view maps this rank's block and slots of its own device, never the peer's
    imported block (which the prefetch copies from)."""
    stores = [VmmStore.build_local(r, r, 2, **SIZES, in_place=True) for r in range(2)]
    fds = [s.export() for s in stores]
    for r, s in enumerate(stores):
        s.import_peer(1 - r, fds[1 - r])
    for fd in fds[0] + fds[1]:
        os.close(fd)
    for r, s in enumerate(stores):
        base, stride = s.view_address(0, 1, 0), s.region(1, 0).stride
        assert _mapped(fake, base + r * stride) == s.region(1, 0).handles[r]
        assert _mapped(fake, base + (1 - r) * stride) not in s.region(1, 0).handles
        attrs = s.in_place_attributes()
        # layer 1's sources start at (1 * 2 + 0) * N
        assert list(attrs["ranks"]) == [r] and int(attrs["sources"][4 + 1 - r]) == s.region(1, 0).address(1 - r)
        s.close()
    nothing_alive(fake)


def _bound_attributes(binding: str) -> set[str]:
    """The attribute names handlers.h binds for `binding` (an inline function), with those of the helpers it
    calls (`CopyAttributes`)."""
    text = HANDLERS_H.read_text()

    def body(start: str) -> str:
        rest = text[text.index(start):]
        return rest[:rest.index(";")]

    own = body(f"inline auto {binding}()")
    names = _attr_names(own)
    if "CopyAttributes(" in own:
        names |= _attr_names(body("auto CopyAttributes(Binding binding)"))
    return names


def _attr_names(body: str) -> set[str]:
    return set(re.findall(r'\.(?:template )?Attr<[^>]+>\("(\w+)"\)', body))


def test_attributes_are_the_handlers_interface(fake):
    store = VmmStore.build([0, 1], **SIZES)
    try:
        prefetch, wait = store.prefetch_attributes(1), store.wait_attributes()
        assert set(prefetch) == _bound_attributes("PrefetchBinding")
        assert set(wait) == _bound_attributes("WaitBinding")
        for name, value in prefetch.items():
            assert value.dtype == np.int64, name
        k = SIZES["layers"] + cuda_vmm.DEFAULT_PENDING_SLOTS
        assert list(prefetch["ordinals"]) == [0, 1] and list(prefetch["ranks"]) == [0, 1]
        assert prefetch["done"].shape == (2 * k,) and prefetch["timing"].shape == (4,)
        assert list(prefetch["timing"]) == [int(e) for d in store.devices for e in d.timing[1]]
        # sources[w * N + r]: rank r's block of weight w of this layer, where the handler copies it from
        for w in range(2):
            for r in range(2):
                assert prefetch["sources"][w * 2 + r] == store.region(1, w).va + r * store.region(1, w).stride
        assert list(prefetch["block_bytes"]) == [2 * (3 << 20), 2 * (1 << 20)]
        # the table: a row per device of 2 + K words (lock, closed, K pending slots)
        assert prefetch["table"] == store.table.ctypes.data and store.table.shape == (2 * (2 + k),)
    finally:
        store.close()
    row = store.table.reshape(2, -1)
    assert (row[:, cuda_vmm.TABLE_CLOSED] == 1).all()  # a stale program's custom call now refuses
    nothing_alive(fake)


def test_untimed_store_passes_zero_timing_events(fake):
    store = VmmStore.build([0, 1], **{**SIZES, "timing": False})
    try:
        assert list(store.prefetch_attributes(0)["timing"]) == [0, 0, 0, 0]
    finally:
        store.close()


def test_addresses_keep_their_64_bits():
    values = [0, 1, 0x7FFF_FFFF_FFFF_FFFF, 0x8000_0000_0000_0000, 0xFFFF_FFFF_FFFF_FFFF, 0x7F12_3456_0000]
    encoded = cuda_vmm.as_int64(values)
    assert encoded.dtype == np.int64
    assert [int(v) for v in encoded.view(np.uint64)] == values


def test_sync_clears_the_pending_slots_under_the_row_lock(fake):
    store = VmmStore.build([0, 1], **SIZES)
    try:
        words = store.row_words
        store.table[cuda_vmm.TABLE_FIRST_SLOT] = 0x1234  # as a prefetch nobody waited for leaves it
        store.table[words + cuda_vmm.TABLE_FIRST_SLOT + 3] = 0x5678
        store.sync()
        assert not store.table.reshape(2, words)[:, cuda_vmm.TABLE_FIRST_SLOT:].any()
        libc = ctypes.CDLL(None)
        for row in range(2):  # unlocked again (the lock word's value is glibc's business: try to take it)
            address = store.table.ctypes.data + row * words * 8
            assert libc.pthread_spin_trylock(ctypes.c_void_p(address)) == 0
            libc.pthread_spin_unlock(ctypes.c_void_p(address))
    finally:
        store.close()


def test_cuda_errors_name_the_call_and_the_code(fake):
    assert cuda_vmm.describe("ExpertStore", "cuMemMap", CUresult.CUDA_ERROR_INVALID_VALUE) == \
        "ExpertStore: cuMemMap failed with CUDA_ERROR_INVALID_VALUE (1)"
    with pytest.raises(CudaError, match=r"^here: cuMemRelease failed with CUDA_ERROR_INVALID_VALUE \(1\)$") as e:
        cuda_vmm.cu("here", "cuMemRelease", 12345)
    assert e.value.code == 1

    class Unloadable:
        def cuInit(self, flags):
            raise RuntimeError("Failed to dlopen libcuda.so.1")

    cuda_vmm._driver = Unloadable()
    with pytest.raises(StoreError, match="here: cuInit: Failed to dlopen libcuda.so.1"):
        cuda_vmm.cu("here", "cuInit", 0)


def test_bad_sizes_are_refused_before_any_driver_call(fake):
    with pytest.raises(ValueError, match="bad sizes"):
        VmmStore.build([0, 1], **{**SIZES, "experts": 5})  # more than 2 ranks x 2 slots
    with pytest.raises(ValueError, match="a device is given for two ranks"):
        VmmStore.build([1, 1], **SIZES)
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        VmmStore.build_local(0, 2, 2, **SIZES)
    assert fake.calls == []
    nothing_alive(fake)


def test_missing_bindings_are_a_clear_error(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_cuda(name, *args, **kwargs):
        if name.startswith("cuda"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(cuda_vmm, "_driver", None)
    monkeypatch.setattr(builtins, "__import__", no_cuda)
    with pytest.raises(cuda_vmm.FfiUnavailable, match=r"needs cuda-python's driver bindings .*'\.\[cuda\]'"):
        cuda_vmm.driver()

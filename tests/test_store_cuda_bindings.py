"""The expert store's control plane through the real cuda.bindings.driver, against a stand-in libcuda.so.1
(tests/stub_libcuda.c, compiled here) instead of the NVIDIA driver: every call the store makes goes through
cuda.bindings' own argument conversion (structs, enums, lists of access descriptors, handles, a POSIX descriptor
passed as the import's void*) into a C function with the driver's signature, which checks what it receives.

cuda-bindings is in the `test` and `cuda` extras; without it (a bare environment) or a C compiler it skips.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("cuda") is None or
                       importlib.util.find_spec("cuda.bindings") is None,
                       reason="cuda-bindings is not installed (pip install -e '.[cuda]')"),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler for the stand-in libcuda.so.1"),
]

SCRIPT = r"""
import ctypes, os, sys
import numpy as np
from jax_dwdp.parallel import cuda_vmm
from jax_dwdp.parallel.cuda_vmm import StoreError, VmmStore

stub = ctypes.CDLL("libcuda.so.1")
def stub_live():
    out = (ctypes.c_long * 6)()
    stub.dwdp_stub_live(out)
    return dict(zip(("contexts", "streams", "events", "handles", "ranges", "maps"), out))

sizes = dict(layers=2, expert_bytes=(3 << 20, 1 << 20), slots=2, experts=3, timing=True)
store = VmmStore.build([0, 1], **sizes)
assert store.handle_type == "posix_fd" and store.granularity == 2 << 20, store.info()
store.fill(1, 0, 1, 0xABC000, 6 << 20)
attrs = store.prefetch_attributes(1)
assert attrs["sources"][1] == store.region(1, 0).va + store.region(1, 0).stride
assert np.isnan(store.copy_ms()).all()
store.sync()
print("one process:", cuda_vmm.live_objects())
store.close()

store = VmmStore.build([0, 1], **sizes, in_place=True)  # the views: second mappings of the blocks, slots
assert store.in_place and store.slot_bytes() == 2 * ((6 << 20) + (2 << 20)), store.info()
assert len(store.in_place_attributes()["view_layout"]) == 5  # sets, bytes, layers, two rows
print("one process in place:", cuda_vmm.live_objects())
store.close()

ranks = [VmmStore.build_local(r, r, 2, **sizes, in_place=True) for r in range(2)]
fds = [s.export() for s in ranks]
ranks[0].import_peer(1, fds[1])
ranks[1].import_peer(0, fds[0])
for fd in fds[0] + fds[1]:
    os.close(fd)
try:
    ranks[0].import_peer(1, [0] * 4)
except StoreError as e:
    assert "already imported" in str(e)
print("two ranks:", cuda_vmm.live_objects())
for s in ranks:
    s.close()
print("device memory:", cuda_vmm.device_memory(0))
assert all(v == 0 for v in cuda_vmm.live_objects().values()), cuda_vmm.live_objects()
assert all(v == 0 for v in stub_live().values()), stub_live()
print("OK")
"""


def test_the_store_through_cuda_bindings_and_a_stand_in_driver(tmp_path):
    lib = tmp_path / "libcuda.so.1"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(ROOT / "tests" / "stub_libcuda.c"), "-ldl"],
                   check=True)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}",
               PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    print(proc.stdout)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]

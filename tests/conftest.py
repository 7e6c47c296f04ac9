import os
import zlib

# Several tests need more than one CPU device (pipeline and DWDP meshes); must be set before jax initialises.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if os.environ.get("JAX_DWDP_TEST_GPU") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's id (repeatable, but different across tests)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))

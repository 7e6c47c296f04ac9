import os
import zlib

# Several tests need more than one CPU device (pipeline and DWDP meshes); must be set before jax initialises.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if os.environ.get("JAX_DWDP_TEST_GPU") != "1":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Most of the suite's time is XLA compiling the same small programs again: in other tests, in the xdist workers
# and in the subprocesses the CLI tests start (which inherit these variables). JAX's persistent compilation cache
# keeps every compiled program (keyed by its HLO, the jax version, the flags and the devices), within a run and
# across runs; $JAX_COMPILATION_CACHE_DIR chooses another folder, an empty value turns it off.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jax_dwdp",
                                   "test-compilation-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 * 2**30))  # least recently used entries go first

import numpy as np  # noqa: E402
import pytest  # noqa: E402


SLOW_TESTS = os.path.join(os.path.dirname(__file__), "slow_tests.txt")


def slow_test_ids() -> set[str]:
    with open(SLOW_TESTS) as f:
        return {line.split("#")[0].strip() for line in f if line.split("#")[0].strip()}


def pytest_collection_modifyitems(config, items):
    """The tests listed in slow_tests.txt (the slowest measured, with their seconds) carry the `slow` mark: the
    README's test command runs `-m "not slow"`, CI runs both tiers (test_test_tiers.py checks that every listed
    test exists)."""
    listed = slow_test_ids()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)


def pytest_runtest_setup(item):
    """`@pytest.mark.devices(n)`: the test builds a mesh of n devices of JAX's default backend (pipeline stages, DWDP
    ranks). With fewer (a one-GPU machine under JAX_DWDP_TEST_GPU=1, or XLA_FLAGS asking for fewer CPU devices) it is
    skipped, saying so, instead of failing on "a mesh of ... needs n devices"."""
    marks = list(item.iter_markers(name="devices"))
    if marks:
        import jax

        need, have = max(m.args[0] for m in marks), jax.device_count()
        if have < need:
            pytest.skip(f"needs {need} {jax.default_backend()} devices; {have} available")


@pytest.fixture
def rng(request):
    """A fresh generator per test, seeded from the test's id (repeatable, but different across tests)."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))

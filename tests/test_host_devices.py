"""Every layout finishes on exactly as many host devices as it uses, on a 2-core machine: the Gated DeltaNet
chunk's triangular inverse is matmuls, not LAPACK's trsm, which split its batch over XLA's intra-op pool
(max(cores, host devices) threads) and blocked a pool thread per device until the pieces ran: with every device of
the mesh in such a program, no thread was left to run them. And a step that never finishes ends the CLI with a
line naming it (the watchdog) instead of waiting forever."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.kernels.gated_delta_rule import unit_lower_inverse
from jax_dwdp.watchdog import Watchdog

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("size", [1, 2, 8, 64])
def test_unit_lower_inverse_equals_float64_inverse(rng, size):
    lower = np.tril(rng.uniform(-1, 1, (3, 2, size, size)), -1)
    got = np.asarray(unit_lower_inverse(jnp.asarray(lower, jnp.float32)), np.float64)
    want = np.linalg.inv(np.eye(size) + lower)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    print(f"size {size}: relative error {err:.2e} against float64")
    assert err < 1e-5
    assert np.all(np.triu(got, 1) == 0)  # exactly lower triangular, as the chunk's masks assume


def test_unit_lower_inverse_refuses_sizes_that_are_not_powers_of_two():
    with pytest.raises(ValueError, match="not a power of two"):
        unit_lower_inverse(jnp.zeros((3, 3)))


_LAYOUTS = textwrap.dedent("""
    import sys
    from jax_dwdp.cli import main
    for layout in sys.argv[1:]:
        print("start", layout, flush=True)
        code = main(["prefill", "--preset", "tiny", "--dtype", "float32", "--batch", "4", "--seq-len", "70",
                     "--iters", "1", "--json", *layout.split()])
        print("done", layout, code, flush=True)
        if code:
            sys.exit(code)
""")


@pytest.mark.parametrize("devices, layouts", [
    (4, ["--dwdp 4", "--dep 4", "--pipeline 2 --dwdp 2 --microbatches 2", "--pipeline 4 --microbatches 2"]),
    (2, ["--dwdp 2", "--pipeline 2 --microbatches 2"]),
], ids=["4-host-devices", "2-host-devices"])
def test_layouts_finish_on_exactly_their_host_devices(devices, layouts):
    """Each layout in a subprocess with a deadline, so that a hang fails the test (naming the layout it hung in)
    instead of stopping the suite. Sequences of 70 tokens: two GDN chunks, the second padded."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=str(ROOT))
    try:
        proc = subprocess.run([sys.executable, "-c", _LAYOUTS, *layouts], capture_output=True, text=True,
                              timeout=420, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        started = [line for line in out.splitlines() if line.startswith("start")]
        pytest.fail(f"hung on {devices} host devices in: {started[-1] if started else 'start-up'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line for line in proc.stdout.splitlines() if line.startswith("done")] == [
        f"done {layout} 0" for layout in layouts]


def test_watchdog_calls_on_stall_for_a_step_that_overruns_and_not_for_one_that_finishes():
    stalled = []
    fired = threading.Event()

    def on_stall(what, timeout_s):
        stalled.append((what, timeout_s))
        fired.set()

    dog = Watchdog(0.2, on_stall)
    with dog.step("quick"):
        pass
    time.sleep(0.4)
    assert stalled == []
    with dog.step("slow"):
        assert fired.wait(5)
    assert stalled == [("slow", 0.2)]
    with pytest.raises(ValueError, match="> 0"):
        Watchdog(0)


_STALL = textwrap.dedent("""
    import time
    from jax_dwdp import cli, driver
    build = driver.build_driver

    def never_compiles(*args, **kwargs):  # a step that never returns, as a deadlocked device program
        built = build(*args, **kwargs)
        built.compile = lambda *a: time.sleep(3600)
        return built

    driver.build_driver = never_compiles
    cli.main(["prefill", "--preset", "tiny", "--seq-len", "8", "--iters", "1", "--stall-timeout", "3"])
""")


def test_a_prefill_that_never_completes_ends_with_a_line_naming_the_step():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _STALL], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert last == "error: no progress for 3 s while compiling; stopped (--stall-timeout sets the bound)", \
        proc.stderr[-2000:]

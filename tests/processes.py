"""Starting a child process from a test process that has imported JAX."""

from __future__ import annotations

import signal
import subprocess


def popen_default_sigint(cmd: list[str], **kw) -> subprocess.Popen:
    """subprocess.Popen with SIGINT at its default in the child, also when this test run inherited it ignored (a
    background launch, which the child would inherit and Python then keep). Not through a preexec_fn: that runs
    the at-fork hooks here, and JAX's warns of a deadlock. A handler installed here is reset to the default across
    exec, where an ignored signal would stay ignored; so one is installed around the start (main thread only)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(cmd, **kw)
    finally:
        signal.signal(signal.SIGINT, previous)

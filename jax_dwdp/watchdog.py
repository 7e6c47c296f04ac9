"""A bound on how long one step of a run may go without finishing, so that no command waits forever.

A device program that never completes (a collective whose peers never arrive, a runtime deadlock) blocks the host
thread that waits for it in C++, where neither Ctrl-C nor a Python exception reaches it. The watchdog runs beside
it: each step is entered with `step(what)`; when one lasts longer than `timeout_s`, `on_stall(what, timeout_s)` is
called from the watchdog's thread. The CLI's `on_stall` prints one line naming the step and ends the process
(`stall_exit`): the blocked thread cannot be unwound, and whatever the process holds (device memory, an expert
store's mappings) is released by the operating system at exit.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator

EXIT_RUNTIME = 1
DEFAULT_STALL_S = 1800.0  # the longest step measured, compiling the 40-layer model as one GPU program, takes minutes


def stall_exit(what: str, timeout_s: float) -> None:
    """Reports a stalled step on stderr and ends the process at once (exit status 1)."""
    sys.stderr.write(f"error: no progress for {timeout_s:g} s while {what}; stopped (--stall-timeout sets the "
                     "bound)\n")
    sys.stderr.flush()
    os._exit(EXIT_RUNTIME)


class Watchdog:
    """`with watchdog.step("compiling"): ...` bounds the step to `timeout_s` seconds."""

    def __init__(self, timeout_s: float, on_stall: Callable[[str, float], None] = stall_exit):
        if not timeout_s > 0:
            raise ValueError(f"the watchdog's timeout must be > 0 s, got {timeout_s}")
        self.timeout_s, self.on_stall = float(timeout_s), on_stall

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        timer = threading.Timer(self.timeout_s, self.on_stall, (what, self.timeout_s))
        timer.daemon = True  # never keeps a finished process alive
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

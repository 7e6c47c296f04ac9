"""Progress lines on a stream while weights load, convert or build: one line per task, redrawn per layer,

    [##########....................] 12/40 layers, 9.61 GB, 1.32 GB/s  loading layers

the same for `convert`, for checkpoint loading (HF and Orbax, one device or per stage / rank) and for model building
layer by layer. Nothing is drawn unless a caller turned it on (`shown_on(sys.stderr)`: the CLI does, but not with
--json), so library users and tests see nothing by default.
"""

from __future__ import annotations

import contextlib
import threading
import time

__all__ = ["bar_line", "LayerBar", "layers", "shown_on"]

_shown = threading.local()  # .stream: where this thread's bars go (None: nowhere)


def bar_line(done: int, total: int, nbytes: int, seconds: float, what: str = "", unit: str = "layers",
             width: int = 30) -> str:
    """`[####....] done/total unit, X GB, Y GB/s  what` (the line, without its carriage return)."""
    filled = int(width * done / max(total, 1))
    rate = nbytes / 1e9 / max(seconds, 1e-9)
    tail = f"  {what}" if what else ""
    return (f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {unit}, {nbytes / 1e9:.2f} GB, "
            f"{rate:.2f} GB/s{tail}")


class LayerBar:
    """A progress line over `total` units on `stream` (None: draws nothing): `advance(nbytes)` per unit done,
    `close()` ends the line."""

    def __init__(self, what: str, total: int, stream=None, unit: str = "layers"):
        self.what, self.total, self.stream, self.unit = what, total, stream, unit
        self.done, self.nbytes, self.t0, self.drawn = 0, 0, time.perf_counter(), False

    def advance(self, nbytes: int = 0, units: int = 1) -> None:
        self.done += units
        self.nbytes += int(nbytes)
        if self.stream is not None:
            self.stream.write("\r" + bar_line(self.done, self.total, self.nbytes, time.perf_counter() - self.t0,
                                              self.what, self.unit))
            self.stream.flush()
            self.drawn = True

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


@contextlib.contextmanager
def shown_on(stream):
    """Bars started in this thread inside the block are drawn on `stream` (None: not drawn)."""
    before = getattr(_shown, "stream", None)
    _shown.stream = stream
    try:
        yield
    finally:
        _shown.stream = before


@contextlib.contextmanager
def layers(what: str, total: int, unit: str = "layers"):
    """A LayerBar for a loop over `total` layers, drawn where `shown_on` said (else silent); the line is ended on
    every path. Inside another bar of this thread it is silent: building a stage layer by layer from a checkpoint
    shows the layers, not each layer's tensors."""
    depth = getattr(_shown, "depth", 0)
    bar = LayerBar(what, total, getattr(_shown, "stream", None) if depth == 0 else None, unit)
    _shown.depth = depth + 1
    try:
        yield bar
    finally:
        _shown.depth = depth
        bar.close()

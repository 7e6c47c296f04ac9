"""Lines for the person running `pip install`, which captures a build's output (shown only with -v or on
failure): each line goes to stderr (the build log) and, when stderr is not a terminal, to the controlling
terminal too ($JAX_DWDP_NOTICE_TTY, default /dev/tty; nothing when there is none, as in CI). Where there is no
terminal at all (CI, a log file, an IDE) the outcome is also recorded in jax_dwdp/_lib/BUILD.json (`record`),
which `jax-dwdp prefill` reports (jax_dwdp.native.build_status)."""

import json
import os
import sys
import time
from pathlib import Path

SKIP = "JAX_DWDP_BUILD_FFI=0 skips it (the XLA paths need no FFI library)"


def notice(message: str) -> None:
    line = f"jax_dwdp: {message}\n"
    sys.stderr.write(line)
    sys.stderr.flush()
    if sys.stderr.isatty():
        return
    try:
        with open(os.environ.get("JAX_DWDP_NOTICE_TTY", "/dev/tty"), "a") as tty:
            tty.write(line)
    except OSError:
        pass


def record(lib_dir: Path, outcome: str, detail: str, seconds: float | None = None) -> None:
    """Writes what this install did about the FFI libraries ("built", "skipped" or "failed", and why) to
    lib_dir/BUILD.json."""
    lib_dir.mkdir(parents=True, exist_ok=True)
    built = sorted(p.name for p in lib_dir.glob("*.so"))
    (lib_dir / "BUILD.json").write_text(json.dumps({
        "outcome": outcome, "detail": detail, "seconds": None if seconds is None else round(seconds),
        "libraries": built, "when": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")

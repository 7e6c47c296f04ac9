"""Lines for the person running `pip install`, which captures a build's output (shown only with -v or on
failure): each line goes to stderr (the build log) and, when stderr is not a terminal, to the controlling
terminal too ($JAX_DWDP_NOTICE_TTY, default /dev/tty; nothing when there is none, as in CI)."""

import os
import sys

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

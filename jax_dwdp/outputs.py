"""Output files written whole or not at all: checked before any work, written through a partial file renamed into
place, so a failure (a full disk, Ctrl-C) never leaves a half-written file looking valid."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np

from jax_dwdp.options import OptionError, literal


class OutputError(OptionError):
    """An output path that cannot be written; the message names it and why (its option as $name, when the caller
    names it so: options.OptionError)."""


def partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial-{os.getpid()}")


def output_file(raw: str, what: str) -> Path:
    """The regular file an output option (`what`, e.g. "$logits_out") names, checked before any work. A symlink is
    written through: its target is what gets replaced (atomically), the link stays. A device, FIFO, socket or folder
    is refused, so is a name ending in "/" (a folder's name)."""
    if raw.endswith("/"):
        raise OutputError(f"{what} {literal(raw)}: names a folder (it ends with /); give a file name, e.g. "
                          f"{literal(raw)}logits.npy")
    path = Path(raw)
    target = path.resolve() if path.is_symlink() else path
    if target.exists() and not target.is_file():
        kind = "a folder" if target.is_dir() else "not a regular file (a device, FIFO or socket)"
        via = f" (the target of the symlink {path})" if target != path else ""
        example = f"; give a file name, e.g. {target / 'logits.npy'}" if target.is_dir() else ""
        raise OutputError(f"{what} {literal(target)}{literal(via)}: is {kind}{literal(example)}")
    if not target.parent.is_dir():
        raise OutputError(f"{what} {literal(target)}: folder {literal(target.parent)} does not exist")
    probe = partial_path(target)
    try:
        probe.open("xb").close()
    except OSError as e:
        raise OutputError(f"{what} {literal(target)}: cannot write in {literal(target.parent)} "
                          f"({e.strerror})") from None
    probe.unlink()
    return target


def save_npy_atomically(path: Path, array, what: str) -> None:
    """`array` as .npy at `path`, replacing it only once the whole file is written."""
    tmp = partial_path(path)
    try:
        with open(tmp, "wb") as f:
            np.save(f, array)
        os.replace(tmp, path)
    except OSError as e:  # checked before the run; this is the file system changing meanwhile (or full)
        why = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e) or type(e).__name__)
        raise OutputError(f"{what} {literal(path)}: cannot write {array.nbytes / 2**20:.1f} MiB ({why}); nothing was "
                          "written") from None
    finally:
        tmp.unlink(missing_ok=True)

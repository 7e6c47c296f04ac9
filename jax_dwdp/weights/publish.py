"""Publishing a conversion's output atomically: whatever happens to the converter, OUT_DIR is either absent, left as
it was, or a complete checkpoint.

`destination(out_dir, overwrite)` holds an exclusive lock on `OUT.lock` beside OUT (a second conversion into the
same OUT fails at once), refuses an OUT that may not be replaced, removes leftover `OUT.partial-<pid>` folders whose
process is gone, and hands out `OUT.partial-<pid>` to write into; `Destination.publish()` renames it to OUT at the
very end (renameat2 with RENAME_NOREPLACE: atomic, and never replaces an OUT it was not told to replace). A
conversion that fails or is interrupted has its partial folder removed; one that is killed leaves only that folder,
which the next conversion removes. With overwrite, only a jax_dwdp checkpoint or an empty folder is replaced.
`DeferInterrupt` holds Ctrl-C back until the converter is between items, so that no Orbax writer thread is still
writing into the partial folder while it is removed.

Kept apart from the checkpoint format: none of this knows what a layer is; it knows only the marker file that tells
a checkpoint (which --overwrite may replace) from someone's data (which it must not).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from jax_dwdp.config import read_json_file
from jax_dwdp.weights.orbax_format import FORMAT, MARKER
from jax_dwdp.weights.safetensors_reader import CheckpointError


def refuse_overlap(source: Path, out_dir: Path) -> None:
    """OUT_DIR equal to, inside or containing the source folder would delete or mix into the source (with
    --overwrite)."""
    src, out = source.resolve(), out_dir.resolve()
    relation = ("is" if out == src else "is inside" if src in out.parents else "contains" if out in src.parents
                else None)
    if relation is not None:
        raise CheckpointError(f"{out_dir}: the output folder {relation} the source folder {source}; "
                              "choose an output folder outside it")


class Destination:
    """OUT_DIR reserved for this process: write into `partial`, then publish()."""

    def __init__(self, out_dir: Path, overwrite: bool):
        self.out_dir, self.overwrite = out_dir, overwrite
        self.partial = out_dir.parent / f"{out_dir.name}.partial-{os.getpid()}"

    def publish(self) -> None:
        publish(self.partial, self.out_dir, self.overwrite)


@contextlib.contextmanager
def destination(out_dir: Path, overwrite: bool) -> Iterator[Destination]:
    """Reserves OUT_DIR (an absolute path) for one writer: creates its parent, takes OUT.lock (CheckpointError at
    once when another conversion holds it), refuses an existing OUT_DIR without overwrite or one that overwrite must
    not replace, and removes stale partial folders. An exception inside removes the partial folder; the lock is
    released on every path."""
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{out_dir.parent}: cannot create the output's folder ({e.strerror})") from None
    lock = lock_destination(out_dir)
    try:
        if os.path.lexists(out_dir) and not overwrite:
            raise CheckpointError(f"{out_dir}: already exists; pass --overwrite to replace it")
        if os.path.lexists(out_dir):
            check_replaceable(out_dir)
        _remove_stale_partials(out_dir)
        reserved = Destination(out_dir, overwrite)
        try:
            yield reserved
        except BaseException:
            shutil.rmtree(reserved.partial, ignore_errors=True)
            raise
    finally:
        unlock_destination(out_dir, lock)


def _lock_path(out_dir: Path) -> Path:
    return out_dir.parent / f"{out_dir.name}.lock"


def lock_destination(out_dir: Path) -> int:
    """Takes the exclusive lock on OUT.lock without waiting and returns its file descriptor; raises CheckpointError
    naming the holder's pid when another conversion holds it. The holder unlinks the file before it unlocks
    (unlock_destination), so a process that locked the file just before it was unlinked sees that the path no
    longer names its file and tries again with a fresh one."""
    path = _lock_path(out_dir)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except IsADirectoryError:
            raise CheckpointError(f"{path}: is a folder; convert keeps its lock file there while it writes "
                                  f"{out_dir.name} (and removes it after): remove that folder or choose another "
                                  "OUT_DIR") from None
        except OSError as e:  # a read-only file system, an immutable folder, /proc or /sys
            raise CheckpointError(f"{out_dir}: cannot write in {out_dir.parent} ({e.strerror or e}: creating the "
                                  f"lock file {path.name})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointError(f"{out_dir}: another conversion (pid {holder}) is writing it; wait for it to "
                                  f"finish (lock file {path})") from None
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        mine = os.fstat(fd)
        if current is not None and (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino):
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            except OSError as e:  # the pid is for the message of a second conversion; a full disk refuses it
                unlock_destination(out_dir, fd)
                raise CheckpointError(f"{out_dir}: cannot write in {out_dir.parent} ({e.strerror or e}: writing "
                                      f"the lock file {path.name})") from None
            return fd
        os.close(fd)


def unlock_destination(out_dir: Path, fd: int) -> None:
    try:
        os.unlink(_lock_path(out_dir))
    except OSError:  # (made immutable meanwhile): a lock file left behind is taken by the next conversion
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _remove_stale_partials(out_dir: Path) -> None:
    """Removes OUT.partial-<pid> folders whose process is gone (killed conversions); live ones are left alone."""
    for stale in out_dir.parent.glob(f"{out_dir.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


_AT_FDCWD, _RENAME_NOREPLACE = -100, 1


def rename_noreplace(src: Path, dst: Path) -> None:
    """Renames src to dst, or raises FileExistsError if dst exists: renameat2(RENAME_NOREPLACE), atomic; where the
    C library or the file system lacks it, a check right before a plain rename (under the destination lock)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), str(src), None, str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)


def check_replaceable(out_dir: Path) -> None:
    """--overwrite replaces a jax_dwdp checkpoint (a folder with the marker convert writes) or an empty folder and
    nothing else: a folder of other files, a file or a link at a mistyped OUT_DIR is someone's data, which
    --overwrite would delete. Raises CheckpointError saying what OUT_DIR is."""
    rule = ("--overwrite replaces only a checkpoint made by convert (a folder with its marker file "
            f"{MARKER}) or an empty folder; remove it yourself or choose another OUT_DIR")
    if os.path.islink(out_dir):
        raise CheckpointError(f"{out_dir}: is a symbolic link, not a jax_dwdp checkpoint; {rule}")
    if not out_dir.is_dir():
        raise CheckpointError(f"{out_dir}: is a file, not a jax_dwdp checkpoint; {rule}")
    if (out_dir / MARKER).exists():
        try:
            marker = read_json_file(out_dir / MARKER, CheckpointError)
        except CheckpointError as e:
            raise CheckpointError(f"{out_dir}: not a jax_dwdp checkpoint ({e}); {rule}") from None
        if isinstance(marker, dict) and marker.get("format") == FORMAT:  # any version: convert replaces old ones
            return
        raise CheckpointError(f"{out_dir}: not a jax_dwdp checkpoint ({MARKER} is not convert's marker); {rule}")
    try:
        entries = sorted(os.listdir(out_dir))
    except OSError as e:
        raise CheckpointError(f"{out_dir}: cannot list it ({e.strerror or e}); {rule}") from None
    if entries:
        shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
        raise CheckpointError(f"{out_dir}: not a jax_dwdp checkpoint (no {MARKER}; it holds {len(entries)} "
                              f"entr{'ies' if len(entries) > 1 else 'y'}: {shown}); {rule}")


def publish(partial: Path, out_dir: Path, overwrite: bool) -> None:
    """Moves the finished checkpoint to OUT_DIR. An existing OUT_DIR is replaced only with overwrite and only when
    it is a checkpoint or an empty folder (checked before the conversion and again here, under the lock), moved
    aside first and removed after; anything that appears at OUT_DIR meanwhile is never replaced."""
    old = None
    if overwrite and os.path.lexists(out_dir):
        check_replaceable(out_dir)
        old = out_dir.parent / f"{out_dir.name}.old-{os.getpid()}"
        try:
            os.rename(out_dir, old)
        except OSError as e:  # an immutable OUT_DIR (chattr +i)
            raise CheckpointError(f"{out_dir}: cannot move it aside to replace it ({e.strerror or e}); it was left "
                                  "as it is and the new checkpoint was discarded") from None
    try:
        rename_noreplace(partial, out_dir)
    except FileExistsError:
        kept = f"; the checkpoint it replaces is at {old}" if old is not None else ""
        raise CheckpointError(f"{out_dir}: appeared while converting; it was left as it is and the new checkpoint "
                              f"was discarded{kept}") from None
    except OSError as e:
        kept = f"; the checkpoint it replaces is at {old}" if old is not None else ""
        raise CheckpointError(f"{out_dir}: cannot move the new checkpoint there ({e.strerror or e}); it was "
                              f"discarded{kept}") from None
    if old is not None:
        try:
            _remove(old)
        except OSError as e:
            raise CheckpointError(f"{out_dir}: converted, but the checkpoint it replaced could not be removed from "
                                  f"{old} ({e.strerror or e}); remove it yourself") from None


class DeferInterrupt:
    """Ctrl-C must not stop the main thread while Orbax writes an item: its writer threads would go on writing into
    the partial folder while it is being removed, leaving files behind. So the first SIGINT is only noted and
    raised as KeyboardInterrupt by check(), which the converter calls between items; a second one interrupts at
    once. Installed only where Python's own SIGINT handler is in place (in the main thread, not ignored)."""

    def __enter__(self):
        self.pending = False
        self._installed = (threading.current_thread() is threading.main_thread()
                           and signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        if self._installed:
            signal.signal(signal.SIGINT, self._note)
        return self

    def _note(self, signum, frame):
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True

    def check(self) -> None:
        if self.pending:
            raise KeyboardInterrupt

    def __exit__(self, *exc):
        if self._installed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return False

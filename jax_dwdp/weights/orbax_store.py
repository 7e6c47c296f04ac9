"""jax_dwdp's Orbax checkpoints: converted from HF safetensors layer by layer, restored per stage or per rank.

Layout of a checkpoint folder:
    config.json          the model config (HF text form)
    jax_dwdp.json        format marker, dtypes stored and cast, counts; written last, so a folder without it is not a
                         checkpoint
    embed/               Orbax PyTree checkpoint: {"embed_tokens": {"weight"}}
    layers/NNN/          one Orbax PyTree checkpoint per layer, keyed like the model's state
    head/                {"norm": {"weight"}, "lm_head": {"weight"}}
Each layer is its own Orbax checkpoint, so a pipeline stage opens only its layers' folders and reads no byte of
another layer; arrays are restored with the caller's sharding, so a DWDP rank reads only its slice of the experts.
Items are plain zarr (Orbax without OCDBT; JAX_DWDP_CONVERT_OCDBT=1 writes OCDBT, and restore reads both): each
array is a folder with one file per chunk, expert tensors one expert per chunk.

The marker lists every file with its size and CRC-32 (computed by `convert` right after each item is written);
a restore checks the files it is about to read (a DWDP rank only its own experts' chunks) and names the layer,
tensor and file of the first that is missing, truncated or changed. `verify_checkpoint` checks them all, then
restores one layer at a time and names the tensors that hold NaN or Inf (which `convert` warns about). A restore
that finds the folder replaced meanwhile (another conversion's --overwrite) says so instead of "damaged".

Conversion holds an exclusive lock on `OUT.lock` beside OUT (a second conversion into the same OUT fails at once),
writes into `OUT.partial-<pid>` and renames it to OUT at the very end (rename is atomic, and never replaces an OUT
it was not told to replace): a conversion that fails, is interrupted or is killed leaves no folder at OUT, and the
next run removes leftover `.partial-<pid>` folders whose process is gone. With overwrite, only a jax_dwdp
checkpoint or an empty folder is replaced. A write that fails (a full disk, a read-only location) is one
CheckpointError naming what was being written.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import errno
import fcntl
import json
import logging
import os
import re
import resource
import shutil
import signal
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dwdp.config import ModelConfig, read_json_file
from jax_dwdp.model import abstract_model
from jax_dwdp.weights.safetensors_reader import ORBAX_MARKER, CheckpointError, orbax_without_marker

FORMAT = "jax_dwdp-orbax"
FORMAT_VERSION = 1
MARKER = ORBAX_MARKER  # "jax_dwdp.json"
# Test hook: SIGKILL the converter after this many layers, to prove that a killed conversion leaves nothing.
_KILL_AFTER_LAYERS = "JAX_DWDP_TEST_KILL_AFTER_LAYERS"
# "0": turn off page reuse (below), for A/B measurements; the default is on.
_PAGE_REUSE = "JAX_DWDP_CONVERT_PAGE_REUSE"
# "1": write items in Orbax's OCDBT format (Orbax's default; older jax_dwdp checkpoints are in it). The default
# here is plain zarr (one file per chunk), which the CPU machine wrote 19-44% faster. Restore reads either format.
_OCDBT = "JAX_DWDP_CONVERT_OCDBT"


def _drop_written_pages(item: Path) -> None:
    """Makes an item's files durable and drops them from the page cache, so that the next layer's writes reuse
    these page-cache pages instead of taking never-used ones. On the project's VM (Firecracker with free page
    reporting) a page the guest has not used for a few seconds goes back to the host, and filling it again runs at
    the host's page-allocation rate (0.3-0.9 GB/s) instead of memory speed: writing the whole checkpoint into fresh
    page-cache pages was what held the converter at ~0.3-0.5 GB/s (benchmarks/RESULTS.md). Tensorstore already
    fsyncs each file, so the fdatasync here is cheap; with it, DONTNEED drops every page, dirty ones included."""
    for root, _, files in os.walk(item):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class _KeepFreedMemory:
    """While converting, glibc keeps freed memory in the process (no mmap for large blocks, no trimming), so each
    layer's buffers reuse the previous layer's pages instead of unmapping them and faulting in fresh ones (which the
    VM backs slowly, see _drop_written_pages). RSS stays about the peak of one layer. On exit: glibc's defaults
    again and malloc_trim(0), so the memory goes back. Not glibc: does nothing."""

    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4

    def __init__(self):
        self._libc = None  # __exit__ without __enter__ (the conversion failed before it) does nothing

    def __enter__(self):
        try:
            self._libc = ctypes.CDLL("libc.so.6")
            self._libc.mallopt(self.M_MMAP_MAX, 0)
            self._libc.mallopt(self.M_TRIM_THRESHOLD, 1 << 30)
        except (OSError, AttributeError):
            self._libc = None
        return self

    def __exit__(self, *exc):
        if self._libc is not None:
            self._libc.mallopt(self.M_MMAP_MAX, 65536)  # glibc's defaults
            self._libc.mallopt(self.M_TRIM_THRESHOLD, 128 * 1024)
            self._libc.malloc_trim(0)
        return False


_CRC_BLOCK = 8 << 20


def _file_crc(path: Path) -> tuple[int, int]:
    """(size, CRC-32) of a file, read in blocks (zlib.crc32 releases the GIL, so threads run in parallel)."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(max(1, min(_CRC_BLOCK, os.fstat(f.fileno()).st_size)))
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, crc


def _crc_many(paths: list[Path]) -> list[tuple[int, int]]:
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(_file_crc, paths))


def _checksum_item(root: Path, item: Path) -> dict[str, list[int]]:
    """{path relative to root: [size, crc32]} of every file of an item."""
    paths = sorted(p for p in item.rglob("*") if p.is_file())
    return {p.relative_to(root).as_posix(): list(sc) for p, sc in zip(paths, _crc_many(paths))}


def _describe(relpath: str) -> str:
    """'layer 2, tensor mlp.experts.down_proj' for layers/002/mlp.experts.down_proj/3.0.0."""
    parts = relpath.split("/")
    if parts[0] == "layers" and len(parts) > 1 and not parts[1].isdigit():
        return "/".join(parts[:2])
    where = f"layer {int(parts[1])}" if parts[0] == "layers" and len(parts) > 1 else parts[0]
    depth = 2 if parts[0] == "layers" else 1
    if len(parts) > depth + 1:  # a file inside an array's folder
        return f"{where}, tensor {parts[depth]}"
    return f"{where}, Orbax metadata"


def _verify_files(root: Path, expected: dict[str, list[int]], crc: bool = True) -> tuple[int, int]:
    """Checks files against their [size, crc32] (crc False: sizes only, which costs a stat per file): (files, bytes)
    checked, or CheckpointError naming the first bad one."""
    names = sorted(expected)
    paths = [root / name for name in names]
    for name, path in zip(names, paths):
        if not path.is_file():
            raise CheckpointError(f"{path}: missing ({_describe(name)}); the checkpoint is damaged, convert it again")
        size = path.stat().st_size
        if size != expected[name][0]:
            raise CheckpointError(f"{path}: {size} bytes, expected {expected[name][0]} ({_describe(name)}; truncated "
                                  "or replaced); the checkpoint is damaged, convert it again")
    for name, path, (_, value) in zip(names, paths, _crc_many(paths) if crc else []):
        if value != expected[name][1]:
            raise CheckpointError(f"{path}: checksum {value:08x}, expected {expected[name][1]:08x} ({_describe(name)}; "
                                  "the data changed since conversion); the checkpoint is damaged, convert it again")
    return len(names), sum(expected[name][0] for name in names)


_VERIFY = contextvars.ContextVar("jax_dwdp_verify_checksums", default=True)


@contextlib.contextmanager
def checksums_checked(enabled: bool):
    """Within it, restores not told otherwise check (True) or skip (False) the checksums; this is how the CLI's
    --no-verify reaches the loads that a pipeline's stages make."""
    token = _VERIFY.set(enabled)
    try:
        yield
    finally:
        _VERIFY.reset(token)


def verify_checkpoint(directory: str | Path) -> dict:
    """Checks every file of a checkpoint against its size and CRC-32, then that every tensor is finite:
    {"files", "bytes", "tensors", "seconds"}, or CheckpointError naming the layer, tensor and file of the first bad
    file, or every tensor that holds NaN or Inf (with the counts).

    The checksums prove the files are what convert wrote, not that the weights are usable: a source with NaN or
    Inf converts to a checkpoint whose every checksum matches and whose logits are all NaN. The finite check
    restores one item (one layer) at a time onto the host, in its stored dtype, so host memory holds one layer."""
    directory = Path(directory)
    files = read_marker(directory).get("files")
    if not files:
        raise CheckpointError(f"{directory / MARKER}: no checksums (converted by an older jax_dwdp); convert it again")
    t0 = time.perf_counter()
    n, nbytes = _verify_files(directory, files)
    items = sorted({name.split("/")[0] if not name.startswith("layers/") else "/".join(name.split("/")[:2])
                    for name in files if "/" in name}, key=lambda item: (item != "embed", item == "head", item))
    bad, tensors = [], 0
    for item in items:
        arrays = _restore_stored(directory, directory / item)
        tensors += len(arrays)
        bad += [(item, name, *counts) for name, counts in _nonfinite(arrays).items()]
        del arrays
    if bad:
        raise CheckpointError(f"{directory}: {_nonfinite_line(bad)} (the files match their checksums: the values "
                              "came from the source); a prefill with them gives NaN logits")
    return {"directory": str(directory), "files": n, "bytes": nbytes, "tensors": tensors,
            "seconds": round(time.perf_counter() - t0, 3)}


_COUNT_BLOCK = 1 << 22  # elements checked at a time: the masks take this many bytes, not the tensor's size
# Half-precision floats are checked on their bits (every exponent bit set: Inf or NaN), ~3x faster than np.isfinite
# on bfloat16 (a numpy extension type); float32 and float64 with np.isfinite. 13-17 GB/s on one CPU core, so a
# conversion (0.3-1 GB/s) spends a few percent on it.
_EXPONENT_BITS = {np.dtype(jnp.bfloat16): 0x7F80, np.dtype(np.float16): 0x7C00}


def _nonfinite(arrays: dict) -> dict:
    """{key: (NaN count, Inf count, values)} of the host (CPU) arrays that hold NaN or Inf, checked in blocks."""
    out = {}
    for key, x in arrays.items():
        flat = np.asarray(x).reshape(-1)  # a host jax.Array: no copy
        if not np.issubdtype(flat.dtype, np.inexact) and flat.dtype not in _EXPONENT_BITS:
            continue
        bits = _EXPONENT_BITS.get(flat.dtype)
        bad = False
        for start in range(0, flat.size, _COUNT_BLOCK):
            block = flat[start:start + _COUNT_BLOCK]
            if bits is not None:
                exponent = block.view(np.uint16) & bits
                bad = bool(np.any(exponent == bits))
            else:
                bad = not np.isfinite(block).all()
            if bad:
                break
        if not bad:
            continue
        nan = inf = 0
        for start in range(0, flat.size, _COUNT_BLOCK):
            block = flat[start:start + _COUNT_BLOCK]
            nan += int(np.count_nonzero(np.isnan(block)))
            inf += int(np.count_nonzero(np.isinf(block)))
        out[key] = (nan, inf, int(flat.size))
    return out


def _nonfinite_line(bad: list[tuple[str, str, int, int, int]], limit: int = 6) -> str:
    """'2 tensors hold NaN or Inf: layer 1, tensor mlp.experts.down_proj: 3 NaN, 0 Inf of 16384 values; ...' for
    (item, tensor, NaN, Inf, values) rows; items are "embed", "head" or "layers/NNN"."""
    def where(item: str) -> str:
        return f"layer {int(item.split('/')[1])}" if item.startswith("layers/") else item

    rows = [f"{where(item)}, tensor {name}: {nan} NaN, {inf} Inf of {size} values"
            for item, name, nan, inf, size in bad[:limit]]
    more = f"; and {len(bad) - limit} more" if len(bad) > limit else ""
    return f"{len(bad)} tensor{'s hold' if len(bad) > 1 else ' holds'} NaN or Inf: {'; '.join(rows)}{more}"


def _restore_stored(directory: Path, item: Path) -> dict[str, jax.Array]:
    """{dotted name: array} of every array of an item, in its stored dtype, on the host CPU."""
    import orbax.checkpoint as ocp

    if not item.is_dir():
        raise CheckpointError(f"{item}: missing from the checkpoint")
    ckpt = _checkpointer()
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    _silence_orbax_leftover_reads()
    try:
        meta = ckpt.metadata(item)
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        args = jax.tree.map(lambda m: ocp.ArrayRestoreArgs(sharding=cpu, global_shape=tuple(m.shape), dtype=m.dtype),
                            tree)
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=cpu), tree)
        restored = ckpt.restore(item, item=target, restore_args=args)
    except Exception as e:  # Orbax/tensorstore raise many types for damaged or mismatched data
        _silence_orbax_leftover_reads()
        raise CheckpointError(_restore_error(directory, item, e)) from None
    finally:
        ckpt.close()
    return {".".join(str(k.key) for k in path): x for path, x in jax.tree_util.tree_flatten_with_path(restored)[0]}


def _files_to_read(directory: Path, item: Path, files: dict[str, list[int]], expert_rows: dict[str, set[int]]) -> dict:
    """The checksummed files of an item that a restore reads: all but the chunks of experts it does not load
    (expert_rows: array folder -> the expert indices this process restores; chunk files are named "e.0.0")."""
    prefix = item.relative_to(directory).as_posix() + "/"
    wanted = {}
    for name, value in files.items():
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):].split("/")
        if len(rest) == 2 and rest[0] in expert_rows and rest[1][:1].isdigit():
            if int(rest[1].split(".")[0]) not in expert_rows[rest[0]]:
                continue
        wanted[name] = value
    return wanted


def _silence_orbax_leftover_reads() -> None:
    """After one array of a restore fails, Orbax (0.12.8) closes its event loop while the item's other reads are
    still pending, and each of them reports at exit or when its tensorstore read completes: "Exception ignored in:
    <coroutine object _read_array_index_and_device_put>" (its `except BaseException` turns the GeneratorExit that
    closes it into an Exception) or a bare "RuntimeError: Event loop is closed" from asyncio's
    call_soon_threadsafe, each with a traceback, tens to hundreds of times. Drops exactly those reports (the error
    was already reported once); every other one reaches the previous hook."""
    previous = sys.unraisablehook
    if getattr(previous, "drops_orbax_reads", False):
        return

    def leftover(unraisable) -> bool:
        if getattr(unraisable.object, "__qualname__", None) == "_read_array_index_and_device_put":
            return True
        tb = unraisable.exc_traceback
        while tb is not None and tb.tb_frame.f_code.co_name != "call_soon_threadsafe":
            tb = tb.tb_next
        return tb is not None and isinstance(unraisable.exc_value, RuntimeError)

    def hook(unraisable):
        if not leftover(unraisable):
            previous(unraisable)

    hook.drops_orbax_reads = True
    sys.unraisablehook = hook

    # The same "Event loop is closed" from a tensorstore callback thread can also arrive printed through
    # sys.excepthook (PyErr_Print; seen once in CI, before the error line) or threading.excepthook: dropped too.
    def loop_closed(tb, value) -> bool:
        while tb is not None and tb.tb_frame.f_code.co_name != "call_soon_threadsafe":
            tb = tb.tb_next
        return tb is not None and isinstance(value, RuntimeError)

    previous_except, previous_thread = sys.excepthook, threading.excepthook

    def excepthook(kind, value, tb):
        if not loop_closed(tb, value):
            previous_except(kind, value, tb)

    def thread_hook(args):
        if not loop_closed(args.exc_traceback, args.exc_value):
            previous_thread(args)

    sys.excepthook, threading.excepthook = excepthook, thread_hook


class _LeftoverWrites(logging.Filter):
    """Drops asyncio's "Task exception was never retrieved" for a tensorstore write of Orbax that failed (the disk
    full): the failure was raised in the converting thread and reported there."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (str(record.msg).startswith("Task exception was never retrieved")
                    and "Error writing local file" in str(exc))


_LEFTOVER_WRITES = _LeftoverWrites()


def _silence_orbax_leftover_writes() -> None:
    """When one write of an item fails (a full disk), Orbax (0.12.8) raises the error in the caller and leaves the
    item's other writes behind: asyncio logs each as "Task exception was never retrieved" with a traceback when it
    is collected (often at exit, after the error line), and a closed event loop's callbacks report "Event loop is
    closed" (see _silence_orbax_leftover_reads). Drops exactly those reports, for the rest of the process."""
    _silence_orbax_leftover_reads()
    logging.getLogger("asyncio").addFilter(_LEFTOVER_WRITES)  # (once: addFilter skips a filter it has)


def _restore_error(directory: Path, item: Path, error: BaseException) -> str:
    """One line for a failed restore: the file tensorstore could not read (with layer and tensor) when it says."""
    seen = error
    while seen is not None:
        m = re.search(r'Error reading local file "([^"]+)": ([^\n]+)', str(seen))
        if m:
            path = Path(m.group(1))
            try:
                what = _describe(path.relative_to(directory.absolute()).as_posix())
            except ValueError:
                what = item.name
            return f"{path}: cannot read ({what}): {m.group(2)}; the checkpoint is damaged, convert it again"
        seen = seen.__cause__ or seen.__context__
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if not first or re.search(r"<bound method |<function |<built-in | object at 0x", first):
        first = type(error).__name__  # a Python repr (a pybind11 callback's) says nothing to a user
    return f"{item}: cannot restore ({first[:300]})"


def is_orbax_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def _checkpointer(use_ocdbt: bool = True):
    """use_ocdbt only matters for saving (restore detects the format). Conversion saves without OCDBT: each array
    is a zarr folder with one file per chunk (an expert per file for expert tensors), which keeps the partial
    restore layout and wrote faster on the CPU machine (benchmarks/RESULTS.md)."""
    import orbax.checkpoint as ocp  # imported here: orbax pulls in a lot at import time

    # No compression: weights are high-entropy, and zstd over them costs far more time than it saves bytes.
    return ocp.PyTreeCheckpointer(use_compression=False, use_ocdbt=use_ocdbt)


def _layer_dir(root: Path, layer_id: int) -> Path:
    return root / "layers" / f"{layer_id:03d}"


def _to_tree(flat: list[tuple[tuple, object]]) -> dict:
    tree: dict = {}
    for path, value in flat:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = value
    return tree


def _save_args(path: tuple, value):
    """Expert tensors are chunked one expert per chunk, so that a DWDP rank restoring its block of experts reads
    only those experts' chunks; other arrays keep Orbax's default chunking."""
    import orbax.checkpoint as ocp

    if path[-3:-1] == ("mlp", "experts"):
        return ocp.SaveArgs(chunk_byte_size=value.nbytes // value.shape[0], shard_axes=(0,))
    return ocp.SaveArgs()


def _host_cpu_placement():
    cpu = jax.devices("cpu")[0]
    sharding = jax.sharding.SingleDeviceSharding(cpu)
    return lambda *_: sharding


def _progress(done: int, total: int, nbytes: int, t0: float, stream) -> None:
    elapsed = max(time.perf_counter() - t0, 1e-9)
    width = 30
    filled = int(width * done / total)
    stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} layers, "
                 f"{nbytes / 1e9:.2f} GB, {nbytes / 1e9 / elapsed:.2f} GB/s")
    stream.flush()


class _QuietAbsl:
    """Orbax logs a few WARNING lines per saved item through absl (chunk size hints, "Skipping merge of OCDBT
    checkpoints"), which break up the progress bar and say nothing actionable; while converting, only absl errors
    are shown."""

    def __enter__(self):
        self._logger = logging.getLogger("absl")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)
        self._logger.addFilter(self._thread_failure)
        return self

    @staticmethod
    def _thread_failure(record: logging.LogRecord) -> bool:
        """Drops Orbax's "_SignalingThread.run() raised an exception" (an ERROR with the writer thread's traceback,
        one per thread that failed: a full disk gave two): the same exception is raised again in the converting
        thread, which reports it once, as one line."""
        return "_SignalingThread.run() raised an exception" not in str(record.msg)

    def __exit__(self, *exc):
        self._logger.removeFilter(self._thread_failure)
        self._logger.setLevel(self._level)
        return False


class _DeferInterrupt:
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


def _refuse_overlap(hf_dir: Path, out_dir: Path) -> None:
    """OUT_DIR equal to, inside or containing HF_DIR would delete or mix into the source (with --overwrite)."""
    hf, out = hf_dir.resolve(), out_dir.resolve()
    relation = ("is" if out == hf else "is inside" if hf in out.parents else "contains" if out in hf.parents else None)
    if relation is not None:
        raise CheckpointError(f"{out_dir}: the output folder {relation} the source folder {hf_dir}; "
                              "choose an output folder outside it")


def _lock_path(out_dir: Path) -> Path:
    return out_dir.parent / f"{out_dir.name}.lock"


def _lock_destination(out_dir: Path) -> int:
    """Takes the exclusive lock on OUT.lock without waiting and returns its file descriptor; raises CheckpointError
    naming the holder's pid when another conversion holds it. The holder unlinks the file before it unlocks
    (_unlock_destination), so a process that locked the file just before it was unlinked sees that the path no
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
                _unlock_destination(out_dir, fd)
                raise CheckpointError(f"{out_dir}: cannot write in {out_dir.parent} ({e.strerror or e}: writing "
                                      f"the lock file {path.name})") from None
            return fd
        os.close(fd)


def _unlock_destination(out_dir: Path, fd: int) -> None:
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


def _rename_noreplace(src: Path, dst: Path) -> None:
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


def _check_replaceable(out_dir: Path) -> None:
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


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Moves the finished checkpoint to OUT_DIR. An existing OUT_DIR is replaced only with overwrite and only when
    it is a checkpoint or an empty folder (checked before the conversion and again here, under the lock), moved
    aside first and removed after; anything that appears at OUT_DIR meanwhile is never replaced."""
    old = None
    if overwrite and os.path.lexists(out_dir):
        _check_replaceable(out_dir)
        old = out_dir.parent / f"{out_dir.name}.old-{os.getpid()}"
        try:
            os.rename(out_dir, old)
        except OSError as e:  # an immutable OUT_DIR (chattr +i)
            raise CheckpointError(f"{out_dir}: cannot move it aside to replace it ({e.strerror or e}); it was left "
                                  "as it is and the new checkpoint was discarded") from None
    try:
        _rename_noreplace(tmp, out_dir)
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


def convert_hf_to_orbax(hf_dir: str | Path, out_dir: str | Path, *, dtype=None, overwrite: bool = False,
                        progress="stderr") -> dict:
    """Converts an HF checkpoint folder to a jax_dwdp Orbax checkpoint; returns a summary dict.

    dtype None (the default) stores every tensor in its own dtype; a dtype casts every tensor to it (A_log stays
    float32), and the summary's "cast" counts what changed ({"float32->bfloat16": n}).

    progress: a stream for the progress bar, "stderr" (the default: sys.stderr at call time) or None.

    Reads and writes one layer at a time (host memory: about one layer plus a fixed buffer; writing layer l in a
    background thread while layer l+1 is read was measured and did not pay: benchmarks/RESULTS.md). Each finished item is made durable and dropped from the page cache, and freed memory stays in the process
    (page reuse; JAX_DWDP_CONVERT_PAGE_REUSE=0 turns it off): see _drop_written_pages and _KeepFreedMemory.
    """
    from jax_dwdp.weights.hf_loader import load_config

    hf_dir, out_dir = Path(hf_dir), Path(out_dir).absolute()
    _refuse_overlap(hf_dir, out_dir)
    cfg = load_config(hf_dir)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{out_dir.parent}: cannot create the output's folder ({e.strerror})") from None
    lock = _lock_destination(out_dir)
    try:
        if os.path.lexists(out_dir) and not overwrite:
            raise CheckpointError(f"{out_dir}: already exists; pass --overwrite to replace it")
        if os.path.lexists(out_dir):
            _check_replaceable(out_dir)
        _remove_stale_partials(out_dir)
        with _QuietAbsl(), _DeferInterrupt() as interrupt:
            return _convert_locked(hf_dir, out_dir, cfg, None if dtype is None else jnp.dtype(dtype), overwrite,
                                   sys.stderr if progress == "stderr" else progress, interrupt)
    finally:
        _unlock_destination(out_dir, lock)


def _convert_locked(hf_dir: Path, out_dir: Path, cfg: ModelConfig, dtype, overwrite: bool, progress,
                    interrupt: _DeferInterrupt) -> dict:
    from jax_dwdp.weights.hf_loader import load_hf_checkpoint
    from jax_dwdp.weights.safetensors_reader import SafetensorsCheckpoint

    bar_open = False  # a progress line without its newline yet
    tmp = out_dir.parent / f"{out_dir.name}.partial-{os.getpid()}"
    t0 = time.perf_counter()
    # non_finite: [item, tensor, NaN count, Inf count, values] of the tensors that hold NaN or Inf (converted as
    # they are, with a warning: a user may want the checkpoint anyway; `verify` refuses it).
    summary = {"tensors": 0, "bytes": 0, "skipped_non_text": 0, "dtypes": {}, "cast": {}, "non_finite": []}
    files: dict[str, list[int]] = {}  # every file's [size, crc32], for the marker
    crc_seconds = 0.0
    kill_after = int(os.environ.get(_KILL_AFTER_LAYERS, "-1"))
    source = ckpt = None
    reuse = os.environ.get(_PAGE_REUSE, "1") != "0"
    keep = _KeepFreedMemory() if reuse else None

    writing = tmp.name  # what a failed write was writing, for its message

    def save(item: Path, tree: dict, **kw) -> None:
        nonlocal crc_seconds, writing
        writing = _item_name(item.relative_to(tmp).as_posix())
        ckpt.save(item, tree, **kw)  # synchronous: the item is complete when it returns
        t = time.perf_counter()
        files.update(_checksum_item(tmp, item))  # its pages are still cached: no disk read
        crc_seconds += time.perf_counter() - t
        if reuse:
            _drop_written_pages(item)
        interrupt.check()

    _silence_orbax_leftover_writes()
    try:
        tmp.mkdir()
        if keep is not None:
            keep.__enter__()
        source = SafetensorsCheckpoint(hf_dir)  # every shard header parsed once, kept across the layers
        ocdbt = os.environ.get(_OCDBT, "0") == "1"
        ckpt = _checkpointer(use_ocdbt=ocdbt)
        placement = _host_cpu_placement()
        n = cfg.num_hidden_layers
        for layer_id in range(n):
            interrupt.check()
            model, report = load_hf_checkpoint(source, cfg=cfg, dtype=dtype, start_layer=layer_id,
                                               end_layer=layer_id + 1, placement=placement)
            flat = list(nnx.to_flat_state(nnx.state(model)))
            summary["tensors"] += report.tensors_loaded
            summary["bytes"] += sum(v.get_value().nbytes for _, v in flat)
            for _, v in flat:
                name = v.get_value().dtype.name
                summary["dtypes"][name] = summary["dtypes"].get(name, 0) + 1
            for key, count in report.cast.items():
                summary["cast"][key] = summary["cast"].get(key, 0) + count
            summary["skipped_non_text"] = report.skipped_non_text
            for p, counts in _nonfinite({p: v.get_value() for p, v in flat}).items():
                item = f"layers/{layer_id:03d}" if p[0] == "layers" else "embed" if p[0] == "embed_tokens" else "head"
                summary["non_finite"].append([item, ".".join(map(str, p[2:] if p[0] == "layers" else p)), *counts])
            layer = [(p[2:], v.get_value()) for p, v in flat if p[0] == "layers"]
            save(_layer_dir(tmp, layer_id), _to_tree(layer), save_args=_to_tree(
                [(p, _save_args(p, v)) for p, v in layer]))
            if layer_id == 0:
                save(tmp / "embed", _to_tree([(p, v.get_value()) for p, v in flat if p[0] == "embed_tokens"]))
            if layer_id == n - 1:
                save(tmp / "head", _to_tree([(p, v.get_value()) for p, v in flat if p[0] in ("norm", "lm_head")]))
            del model, flat, layer
            if progress is not None:
                _progress(layer_id + 1, n, summary["bytes"], t0, progress)
                bar_open = True
            if layer_id + 1 == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
        if bar_open:
            progress.write("\n")
            bar_open = False
        writing = "config.json"
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))
        files["config.json"] = list(_file_crc(tmp / "config.json"))
        seconds = time.perf_counter() - t0
        summary.update(seconds=round(seconds, 3), gb_per_s=round(summary["bytes"] / 1e9 / seconds, 3),
                       checksum_seconds=round(crc_seconds, 3),
                       peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                       dtype=None if dtype is None else dtype.name, layers=cfg.num_hidden_layers, source=str(hf_dir),
                       output=str(out_dir))
        writing = MARKER
        (tmp / MARKER).write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, **summary, "files": files},
                                             indent=1))
        _publish(tmp, out_dir, overwrite)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if bar_open:  # end the bar's line, so that the caller's error message gets a line of its own
            progress.write("\n")
            progress.flush()
        message = None if isinstance(e, CheckpointError) else _write_error(e, tmp, out_dir, writing, source, dtype)
        if message is not None:
            raise CheckpointError(message) from None
        raise
    finally:
        if ckpt is not None:
            ckpt.close()
        if source is not None:
            source.close()
        if keep is not None:
            keep.__exit__(None, None, None)
    if summary["non_finite"]:
        print(f"warning: {hf_dir}: {_nonfinite_line(summary['non_finite'])}; converted as they are (a prefill with "
              "them gives NaN logits)", file=sys.stderr, flush=True)
    return summary


def _item_name(relpath: str) -> str:
    """'layer 3' for layers/003, 'the embedding (embed/)', 'the head (head/)'."""
    parts = relpath.split("/")
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        return f"layer {int(parts[1])}"
    return {"embed": "the embedding (embed/)", "head": "the head (head/)"}.get(parts[0], relpath)


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _write_error(error: BaseException, tmp: Path, out_dir: Path, writing: str, source, dtype) -> str | None:
    """One line for a conversion that failed writing its output: the disk full (an OSError, or tensorstore's
    RESOURCE_EXHAUSTED from inside Orbax) or another OS error, with the item being written (the layer, tensor and
    file when tensorstore names it). None for any other failure."""
    code, path, seen = None, None, error
    while seen is not None and code is None:
        if isinstance(seen, OSError) and seen.errno is not None:
            code, path = seen.errno, seen.filename
        else:
            m = re.search(r"os_error_code='(\d+)'", str(seen))
            if m:
                code = int(m.group(1))
                f = re.search(r'Error writing local file "([^"]+)"', str(seen))
                path = f.group(1) if f else None
        seen = seen.__cause__ or seen.__context__
    if code is None or isinstance(error, KeyboardInterrupt):
        return None
    where = ""
    if path is not None:
        try:
            rel = Path(path).relative_to(tmp).as_posix().replace(".orbax-checkpoint-tmp", "")
        except ValueError:
            where = f" (file {path})"
        else:
            desc = _describe(rel)
            tensor = desc.split(", ", 1)[1] + ", " if ", tensor " in desc else ""
            where = f" ({tensor}file {rel})" if rel not in (".", writing) else ""
    if code in _NO_SPACE:
        need = _needed_bytes(source, dtype)
        size = f" (the checkpoint needs about {need / 1e9:.3g} GB)" if need else ""
        return (f"{out_dir}: no space left on device while writing {writing}{where}; the partial checkpoint was "
                f"removed; free space in {out_dir.parent}{size} and convert again")
    if writing == tmp.name:
        return f"{out_dir}: cannot write in {out_dir.parent} ({os.strerror(code)}: creating the folder {tmp.name})"
    return (f"{out_dir}: cannot write ({os.strerror(code)}) while writing {writing}{where}; the partial "
            "checkpoint was removed")


def _needed_bytes(source, dtype) -> int:
    """About the bytes of the converted text model (from the source's headers): for the message of a full disk."""
    from jax_dwdp.weights import hf_names
    from jax_dwdp.weights.safetensors_reader import DTYPES

    if source is None:
        return 0
    total = 0
    for name in source.names():
        target = hf_names.classify(name, 0, 0)
        if target is None or target.kind == "non_text":
            continue
        info = source.info(name)
        itemsize = DTYPES[info.dtype].itemsize
        total += info.nbytes if dtype is None else info.nbytes // itemsize * jnp.dtype(dtype).itemsize
    return total


def read_marker(directory: Path) -> dict:
    if not os.path.lexists(directory / MARKER):
        raise CheckpointError(orbax_without_marker(directory)
                              or f"{directory}: not a jax_dwdp Orbax checkpoint (no {MARKER})")
    marker = read_json_file(directory / MARKER, CheckpointError)
    if not isinstance(marker, dict):
        raise CheckpointError(f"{directory / MARKER}: expected a JSON object")
    if marker.get("format") != FORMAT or marker.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{directory / MARKER}: format {marker.get('format')!r} version "
                              f"{marker.get('version')!r}; expected {FORMAT!r} version {FORMAT_VERSION}")
    return marker


def _snapshot(directory: Path) -> tuple | None:
    """What changes when a checkpoint folder is replaced (convert --overwrite renames a new folder in) or its
    marker rewritten: the folder's and the marker's identity and the marker's size and times. None: gone."""
    try:
        folder, marker = os.stat(directory), os.stat(directory / MARKER)
    except OSError:
        return None
    return (folder.st_dev, folder.st_ino, marker.st_ino, marker.st_size, marker.st_mtime_ns, marker.st_ctime_ns)


def load_orbax_checkpoint(directory: str | Path, *, dtype=jnp.bfloat16, start_layer: int = 0,
                          end_layer: int | None = None, placement=None, verify: bool | None = None,
                          cfg: ModelConfig | None = None):
    """Restores layers [start_layer, end_layer) (and the embedding / head if the range has them) of the stored
    model, or of `cfg` when it is the stored model cut to its first layers (ModelConfig.first_layers).

    placement(path, shape, dtype) -> Sharding decides where each array lands (default: the first device); with a
    sharded placement, each device reads only its slice. verify: check the files about to be read against the
    checksums of the marker first (None: as set by checksums_checked, by default yes); without it their sizes are
    still checked (a stat each), so that a truncated file never reaches Orbax, whose failed reads leave threads that
    print tracebacks at exit. Checkpoints converted before checksums are not checked. Returns (model, LoadReport).

    A folder replaced or rewritten while it is read (`convert --overwrite` into it) fails its checksums or reads,
    or with --no-verify could mix layers of two checkpoints: the folder and its marker are compared before and
    after, and a change is reported as such ("changed while being read; run again"), whether the load failed or not.
    """
    directory = Path(directory)
    before = _snapshot(directory)
    try:
        result = _load_orbax(directory, dtype=dtype, start_layer=start_layer, end_layer=end_layer,
                             placement=placement, verify=verify, cfg=cfg)
    except Exception:
        if before is not None and _snapshot(directory) != before:
            raise CheckpointError(_changed(directory)) from None
        raise
    if _snapshot(directory) != before:
        raise CheckpointError(_changed(directory))
    return result


def _changed(directory: Path) -> str:
    return (f"{directory}: changed while being read (replaced or rewritten, e.g. by `jax-dwdp convert --overwrite` "
            "into it); run again")


def _load_orbax(directory: Path, *, dtype, start_layer: int, end_layer: int | None, placement, verify: bool | None,
                cfg: ModelConfig | None = None):
    from jax_dwdp.weights.hf_loader import LoadReport

    import orbax.checkpoint as ocp

    t0 = time.perf_counter()
    marker = read_marker(directory)
    files, crc = marker.get("files"), _VERIFY.get() if verify is None else verify
    stored = ModelConfig.from_json_file(directory / "config.json")
    cfg = cfg if cfg is not None and cfg.cuts(stored) else stored
    end_layer = cfg.num_hidden_layers if end_layer is None else end_layer
    dtype = jnp.dtype(dtype)
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype=dtype, start_layer=start_layer, end_layer=end_layer))
    expected = list(nnx.to_flat_state(abstract))
    if placement is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        placement = lambda *_: sharding  # noqa: E731
    ckpt = _checkpointer()

    def restore(item: Path, entries: list[tuple[tuple, tuple, object]]) -> dict:
        """entries: (path in the item, model path, var)."""
        if not item.is_dir():
            raise CheckpointError(f"{item}: missing from the checkpoint")
        target = _to_tree([(p, jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=placement(mp, tuple(v.shape), v.dtype)))
                           for p, mp, v in entries])
        args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype),
                            target)
        if files is not None:
            rows = {}
            for p, mp, v in entries:
                if mp[-3:-1] == ("mlp", "experts"):
                    indices = placement(mp, tuple(v.shape), v.dtype).addressable_devices_indices_map(tuple(v.shape))
                    rows[".".join(map(str, p))] = {e for index in indices.values()
                                                   for e in range(*index[0].indices(v.shape[0]))}
            _verify_files(directory, _files_to_read(directory, item, files, rows), crc)
        _silence_orbax_leftover_reads()  # before: a failed read's leftovers can report before the except clause runs
        try:
            return ckpt.restore(item, item=target, restore_args=args)
        except Exception as e:  # Orbax/tensorstore raise many types for damaged or mismatched data
            _silence_orbax_leftover_reads()
            raise CheckpointError(_restore_error(directory, item, e)) from None

    def lookup(tree: dict, path: tuple):
        for key in path:
            tree = tree[str(key)]
        return tree

    values = {}
    groups: dict[Path, list] = {}
    for path, var in expected:
        if path[0] == "layers":
            item, inner = _layer_dir(directory, int(path[1]) + start_layer), path[2:]
        elif path[0] == "embed_tokens":
            item, inner = directory / "embed", path
        else:
            item, inner = directory / "head", path
        groups.setdefault(item, []).append((inner, path, var))
    for item, entries in groups.items():
        restored = restore(item, entries)
        for inner, path, _ in entries:
            values[path] = lookup(restored, inner)
    state = nnx.from_flat_state([(path, type(var)(values[path])) for path, var in expected])
    report = LoadReport(tensors_loaded=len(expected), bytes_read=int(sum(v.nbytes for v in values.values())),
                        seconds=time.perf_counter() - t0)
    return nnx.merge(graphdef, state), report

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
tensor and file of the first that is missing, truncated or changed. `verify_checkpoint` checks them all.

Conversion holds an exclusive lock on `OUT.lock` beside OUT (a second conversion into the same OUT fails at once),
writes into `OUT.partial-<pid>` and renames it to OUT at the very end (rename is atomic, and never replaces an OUT
it was not told to replace): a conversion that fails, is interrupted or is killed leaves no folder at OUT, and the
next run removes leftover `.partial-<pid>` folders whose process is gone.
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
from flax import nnx

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import abstract_model
from jax_dwdp.weights.safetensors_reader import CheckpointError

FORMAT = "jax_dwdp-orbax"
FORMAT_VERSION = 1
MARKER = "jax_dwdp.json"
# Test hook: SIGKILL the converter after this many layers, to prove that a killed conversion leaves nothing.
_KILL_AFTER_LAYERS = "JAX_DWDP_TEST_KILL_AFTER_LAYERS"
# "0": turn off page reuse (below), for A/B measurements; the default is on.
_PAGE_REUSE = "JAX_DWDP_CONVERT_PAGE_REUSE"
# "1": write items in Orbax's OCDBT format (its default; the format before 2026-11-30's fourth session). The default
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
    """Checks every file of a checkpoint against its size and CRC-32: {"files", "bytes", "seconds"}, or
    CheckpointError naming the layer, tensor and file of the first bad one."""
    directory = Path(directory)
    files = read_marker(directory).get("files")
    if not files:
        raise CheckpointError(f"{directory / MARKER}: no checksums (converted by an older jax_dwdp); convert it again")
    t0 = time.perf_counter()
    n, nbytes = _verify_files(directory, files)
    return {"directory": str(directory), "files": n, "bytes": nbytes, "seconds": round(time.perf_counter() - t0, 3)}


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
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
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
        return self

    def __exit__(self, *exc):
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
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)


def _unlock_destination(out_dir: Path, fd: int) -> None:
    try:
        os.unlink(_lock_path(out_dir))
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


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Moves the finished checkpoint to OUT_DIR. An existing OUT_DIR (a folder or a file) is replaced only with
    overwrite, moved aside first and removed after; anything that appears at OUT_DIR meanwhile is never replaced."""
    old = None
    if overwrite and os.path.lexists(out_dir):
        old = out_dir.parent / f"{out_dir.name}.old-{os.getpid()}"
        os.rename(out_dir, old)
    try:
        _rename_noreplace(tmp, out_dir)
    except FileExistsError:
        kept = f"; the checkpoint it replaces is at {old}" if old is not None else ""
        raise CheckpointError(f"{out_dir}: appeared while converting; it was left as it is and the new checkpoint "
                              f"was discarded{kept}") from None
    if old is not None:
        _remove(old)


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
    summary = {"tensors": 0, "bytes": 0, "skipped_non_text": 0, "dtypes": {}, "cast": {}}
    files: dict[str, list[int]] = {}  # every file's [size, crc32], for the marker
    crc_seconds = 0.0
    kill_after = int(os.environ.get(_KILL_AFTER_LAYERS, "-1"))
    source = ckpt = None
    reuse = os.environ.get(_PAGE_REUSE, "1") != "0"
    keep = _KeepFreedMemory() if reuse else None

    def save(item: Path, tree: dict, **kw) -> None:
        nonlocal crc_seconds
        ckpt.save(item, tree, **kw)  # synchronous: the item is complete when it returns
        t = time.perf_counter()
        files.update(_checksum_item(tmp, item))  # its pages are still cached: no disk read
        crc_seconds += time.perf_counter() - t
        if reuse:
            _drop_written_pages(item)
        interrupt.check()

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
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))
        files["config.json"] = list(_file_crc(tmp / "config.json"))
        seconds = time.perf_counter() - t0
        summary.update(seconds=round(seconds, 3), gb_per_s=round(summary["bytes"] / 1e9 / seconds, 3),
                       checksum_seconds=round(crc_seconds, 3),
                       peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                       dtype=None if dtype is None else dtype.name, layers=cfg.num_hidden_layers, source=str(hf_dir),
                       output=str(out_dir))
        (tmp / MARKER).write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, **summary, "files": files},
                                             indent=1))
        _publish(tmp, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if bar_open:  # end the bar's line, so that the caller's error message gets a line of its own
            progress.write("\n")
            progress.flush()
        raise
    finally:
        if ckpt is not None:
            ckpt.close()
        if source is not None:
            source.close()
        if keep is not None:
            keep.__exit__(None, None, None)
    return summary


def read_marker(directory: Path) -> dict:
    try:
        marker = json.loads((directory / MARKER).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: not a jax_dwdp Orbax checkpoint (no {MARKER})") from None
    except json.JSONDecodeError:
        raise CheckpointError(f"{directory / MARKER}: not valid JSON") from None
    if marker.get("format") != FORMAT or marker.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{directory / MARKER}: format {marker.get('format')!r} version "
                              f"{marker.get('version')!r}; expected {FORMAT!r} version {FORMAT_VERSION}")
    return marker


def load_orbax_checkpoint(directory: str | Path, *, dtype=jnp.bfloat16, start_layer: int = 0,
                          end_layer: int | None = None, placement=None, verify: bool | None = None):
    """Restores layers [start_layer, end_layer) (and the embedding / head if the range has them).

    placement(path, shape, dtype) -> Sharding decides where each array lands (default: the first device); with a
    sharded placement, each device reads only its slice. verify: check the files about to be read against the
    checksums of the marker first (None: as set by checksums_checked, by default yes); without it their sizes are
    still checked (a stat each), so that a truncated file never reaches Orbax, whose failed reads leave threads that
    print tracebacks at exit. Checkpoints converted before checksums are not checked. Returns (model, LoadReport).
    """
    from jax_dwdp.weights.hf_loader import LoadReport

    import orbax.checkpoint as ocp

    t0 = time.perf_counter()
    directory = Path(directory)
    marker = read_marker(directory)
    files, crc = marker.get("files"), _VERIFY.get() if verify is None else verify
    cfg = ModelConfig.from_json_file(directory / "config.json")
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

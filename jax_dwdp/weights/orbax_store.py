"""Conversion of HF safetensors to jax_dwdp's Orbax checkpoints, layer by layer, and their restore per stage or per
rank.

The format (folder layout, marker, items) is orbax_format's; the checksums and the finite check are integrity's;
making the output appear atomically at OUT_DIR (lock, partial folder, rename without replace, Ctrl-C held back) is
publish's. This module owns the two data paths that use them: `convert_hf_to_orbax` reads an HF checkpoint one
layer at a time, writes each layer as one Orbax item into the partial folder, checksums it and drops its pages
(page reuse, below), then writes the marker and publishes; `load_orbax_checkpoint` restores any layer range with
the caller's placement, checking the checksums of the files it reads and noticing a folder replaced meanwhile.

Items are written as plain zarr with page reuse, the fastest the CPU machine measured (benchmarks/RESULTS.md);
restore also reads items in Orbax's OCDBT format, that of older jax_dwdp checkpoints.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import re
import resource
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from jax_dwdp.families import FamilyConfig, config_from_json_file
from jax_dwdp.model import abstract_model, is_expert_weight
from jax_dwdp.progress import bar_line, layers
from jax_dwdp.weights import integrity, publish
from jax_dwdp.weights.hf_loader import NAMINGS, LoadReport, load_config, load_hf_checkpoint
from jax_dwdp.weights.orbax_format import (FORMAT, FORMAT_VERSION, MARKER, checkpointer, describe, layer_dir,
                                           read_marker, restore_error, silence_orbax_leftover_reads,
                                           silence_orbax_leftover_writes, to_tree)
from jax_dwdp.weights.safetensors_reader import DTYPES, CheckpointError, SafetensorsCheckpoint


def _after_layer_saved(layer_id: int) -> None:
    """Called once layer `layer_id` (and the embedding or head saved with it) is written, checksummed and its
    progress shown; does nothing. The tests replace it to interrupt or kill a conversion between two layers."""


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


def _save_args(path: tuple, value):
    """Expert tensors (`path` inside a layer's item) are chunked one expert per chunk, so that a DWDP rank restoring
    its block of experts reads only those experts' chunks; other arrays keep Orbax's default chunking."""
    import orbax.checkpoint as ocp  # imported here: orbax pulls in a lot at import time

    if is_expert_weight(("layers", 0, *path)):
        return ocp.SaveArgs(chunk_byte_size=value.nbytes // value.shape[0], shard_axes=(0,))
    return ocp.SaveArgs()


def _host_cpu_placement():
    cpu = jax.devices("cpu")[0]
    sharding = jax.sharding.SingleDeviceSharding(cpu)
    return lambda *_: sharding


def _progress(done: int, total: int, nbytes: int, t0: float, stream) -> None:
    stream.write("\r" + bar_line(done, total, nbytes, time.perf_counter() - t0))
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

    def __exit__(self, exc_type, *exc):
        self._logger.setLevel(self._level)
        # After a failure, Orbax's other writer threads can still fail (the same full disk) and log after the
        # converting thread has raised and left this block: the filter stays, so that the one-line error is all
        # the user sees (it drops only that message, whose exception was already raised).
        if exc_type is None:
            self._logger.removeFilter(self._thread_failure)
        return False


def convert_hf_to_orbax(hf_dir: str | Path, out_dir: str | Path, *, dtype=None, overwrite: bool = False,
                        progress="stderr") -> dict:
    """Converts an HF checkpoint folder to a jax_dwdp Orbax checkpoint; returns a summary dict.

    dtype None (the default) stores every tensor in its own dtype; a dtype casts every tensor to it (A_log stays
    float32), and the summary's "cast" counts what changed ({"float32->bfloat16": n}).

    progress: a stream for the progress bar, "stderr" (the default: sys.stderr at call time) or None.

    Reads and writes one layer at a time (host memory: about one layer plus a fixed buffer; writing layer l in a
    background thread while layer l+1 is read was measured and did not pay: benchmarks/RESULTS.md). Each finished
    item is made durable and dropped from the page cache, and freed memory stays in the process (page reuse; see
    _drop_written_pages and _KeepFreedMemory). The output appears at out_dir only once complete (see publish): a
    conversion that fails, is interrupted or is killed leaves no folder there. A write that fails (a full disk, a
    read-only location) is one CheckpointError naming what was being written.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir).absolute()
    publish.refuse_overlap(hf_dir, out_dir)
    cfg = load_config(hf_dir)
    with _QuietAbsl(), publish.DeferInterrupt() as interrupt, publish.destination(out_dir, overwrite) as dest:
        return _convert_into(hf_dir, dest, cfg, None if dtype is None else jnp.dtype(dtype),
                             sys.stderr if progress == "stderr" else progress, interrupt)


def _convert_into(hf_dir: Path, dest: publish.Destination, cfg: FamilyConfig, dtype, progress,
                  interrupt: publish.DeferInterrupt) -> dict:
    """Writes the checkpoint into dest.partial and publishes it; dest removes the partial folder when this fails."""
    bar_open = False  # a progress line without its newline yet
    tmp, out_dir = dest.partial, dest.out_dir
    t0 = time.perf_counter()
    # non_finite: [item, tensor, NaN count, Inf count, values] of the tensors that hold NaN or Inf (converted as
    # they are, with a warning: a user may want the checkpoint anyway; `verify` refuses it).
    summary = {"tensors": 0, "bytes": 0, "skipped_non_text": 0, "dtypes": {}, "cast": {}, "non_finite": []}
    files: dict[str, list[int]] = {}  # every file's [size, crc32], for the marker
    naming = NAMINGS[type(cfg)]
    embedding = naming.embedding[0]  # the embed item's top-level name; the head item holds the other top-level ones
    crc_seconds = 0.0
    source = ckpt = None
    keep = _KeepFreedMemory()

    writing = tmp.name  # what a failed write was writing, for its message

    def save(item: Path, tree: dict, **kw) -> None:
        nonlocal crc_seconds, writing
        writing = _item_name(item.relative_to(tmp).as_posix())
        ckpt.save(item, tree, **kw)  # synchronous: the item is complete when it returns
        t = time.perf_counter()
        files.update(integrity.checksum_item(tmp, item))  # its pages are still cached: no disk read
        crc_seconds += time.perf_counter() - t
        _drop_written_pages(item)
        interrupt.check()

    silence_orbax_leftover_writes()
    try:
        tmp.mkdir()
        keep.__enter__()
        source = SafetensorsCheckpoint(hf_dir)  # every shard header parsed once, kept across the layers
        ckpt = checkpointer(use_ocdbt=False)
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
            for p, counts in integrity.nonfinite({p: v.get_value() for p, v in flat}).items():
                item = f"layers/{layer_id:03d}" if p[0] == "layers" else "embed" if p[0] == embedding else "head"
                summary["non_finite"].append([item, ".".join(map(str, p[2:] if p[0] == "layers" else p)), *counts])
            layer = [(p[2:], v.get_value()) for p, v in flat if p[0] == "layers"]
            save(layer_dir(tmp, layer_id), to_tree(layer), save_args=to_tree(
                [(p, _save_args(p, v)) for p, v in layer]))
            if layer_id == 0:
                save(tmp / "embed", to_tree([(p, v.get_value()) for p, v in flat if p[0] == embedding]))
            if layer_id == n - 1:
                save(tmp / "head", to_tree([(p, v.get_value()) for p, v in flat if p[0] not in ("layers", embedding)]))
            del model, flat, layer
            if progress is not None:
                _progress(layer_id + 1, n, summary["bytes"], t0, progress)
                bar_open = True
            _after_layer_saved(layer_id)
        if bar_open:
            progress.write("\n")
            bar_open = False
        writing = "config.json"
        (tmp / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))
        files["config.json"] = list(integrity.file_crc(tmp / "config.json"))
        seconds = time.perf_counter() - t0
        summary.update(seconds=round(seconds, 3), gb_per_s=round(summary["bytes"] / 1e9 / seconds, 3),
                       checksum_seconds=round(crc_seconds, 3),
                       peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                       dtype=None if dtype is None else dtype.name, layers=cfg.num_hidden_layers, source=str(hf_dir),
                       output=str(out_dir))
        writing = MARKER
        (tmp / MARKER).write_text(json.dumps({"format": FORMAT, "version": FORMAT_VERSION, **summary, "files": files},
                                             indent=1))
        dest.publish()
    except BaseException as e:
        if bar_open:  # end the bar's line, so that the caller's error message gets a line of its own
            progress.write("\n")
            progress.flush()
        message = None if isinstance(e, CheckpointError) else _write_error(e, tmp, out_dir, writing, source, dtype,
                                                                           naming.names)
        if message is not None:
            raise CheckpointError(message) from None
        raise
    finally:
        if ckpt is not None:
            ckpt.close()
        if source is not None:
            source.close()
        keep.__exit__(None, None, None)
    if summary["non_finite"]:
        print(f"warning: {hf_dir}: {integrity.nonfinite_line(summary['non_finite'])}; converted as they are (a "
              "prefill with them gives NaN logits)", file=sys.stderr, flush=True)
    return summary


def _item_name(relpath: str) -> str:
    """'layer 3' for layers/003, 'the embedding (embed/)', 'the head (head/)'."""
    parts = relpath.split("/")
    if parts[0] == "layers" and len(parts) > 1 and parts[1].isdigit():
        return f"layer {int(parts[1])}"
    return {"embed": "the embedding (embed/)", "head": "the head (head/)"}.get(parts[0], relpath)


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _write_error(error: BaseException, tmp: Path, out_dir: Path, writing: str, source, dtype,
                 names) -> str | None:
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
            desc = describe(rel)
            tensor = desc.split(", ", 1)[1] + ", " if ", tensor " in desc else ""
            where = f" ({tensor}file {rel})" if rel not in (".", writing) else ""
    if code in _NO_SPACE:
        need = _needed_bytes(source, dtype, names)
        size = f" (the checkpoint needs about {need / 1e9:.3g} GB)" if need else ""
        return (f"{out_dir}: no space left on device while writing {writing}{where}; the partial checkpoint was "
                f"removed; free space in {out_dir.parent}{size} and convert again")
    if writing == tmp.name:
        return f"{out_dir}: cannot write in {out_dir.parent} ({os.strerror(code)}: creating the folder {tmp.name})"
    return (f"{out_dir}: cannot write ({os.strerror(code)}) while writing {writing}{where}; the partial "
            "checkpoint was removed")


def _needed_bytes(source, dtype, names) -> int:
    """About the bytes of the converted text model (from the source's headers; `names`: its family's name map):
    for the message of a full disk."""
    if source is None:
        return 0
    total = 0
    for name in source.names():
        target = names.classify(name, 0, 0)
        if target is None or target.kind == "non_text":
            continue
        info = source.info(name)
        itemsize = DTYPES[info.dtype].itemsize
        total += info.nbytes if dtype is None else info.nbytes // itemsize * jnp.dtype(dtype).itemsize
    return total


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
                          cfg: FamilyConfig | None = None):
    """Restores layers [start_layer, end_layer) (and the embedding / head if the range has them) of the stored
    model, or of `cfg` when it is the stored model cut to its first layers (`first_layers`).

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
                cfg: FamilyConfig | None = None):
    import orbax.checkpoint as ocp  # imported here: orbax pulls in a lot at import time

    t0 = time.perf_counter()
    marker = read_marker(directory)
    files, crc = marker.get("files"), integrity.checksums_wanted(verify)
    stored = config_from_json_file(directory / "config.json")
    cfg = cfg if cfg is not None and type(cfg) is type(stored) and cfg.cuts(stored) else stored
    embedding = NAMINGS[type(cfg)].embedding[0]
    end_layer = cfg.num_hidden_layers if end_layer is None else end_layer
    dtype = jnp.dtype(dtype)
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype=dtype, start_layer=start_layer, end_layer=end_layer))
    expected = list(nnx.to_flat_state(abstract))
    if placement is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        placement = lambda *_: sharding  # noqa: E731
    ckpt = checkpointer()

    def restore(item: Path, entries: list[tuple[tuple, tuple, object]]) -> dict:
        """entries: (path in the item, model path, var)."""
        if not item.is_dir():
            raise CheckpointError(f"{item}: missing from the checkpoint")
        target = to_tree([(p, jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=placement(mp, tuple(v.shape), v.dtype)))
                          for p, mp, v in entries])
        args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding, global_shape=s.shape, dtype=s.dtype),
                            target)
        if files is not None:
            rows = {}
            for p, mp, v in entries:
                if is_expert_weight(mp):
                    indices = placement(mp, tuple(v.shape), v.dtype).addressable_devices_indices_map(tuple(v.shape))
                    rows[".".join(map(str, p))] = {e for index in indices.values()
                                                   for e in range(*index[0].indices(v.shape[0]))}
            integrity.verify_files(directory, integrity.files_to_read(directory, item, files, rows), crc)
        silence_orbax_leftover_reads()  # before: a failed read's leftovers can report before the except clause runs
        try:
            return ckpt.restore(item, item=target, restore_args=args)
        except Exception as e:  # Orbax/tensorstore raise many types for damaged or mismatched data
            silence_orbax_leftover_reads()
            raise CheckpointError(restore_error(directory, item, e)) from None

    def lookup(tree: dict, path: tuple):
        for key in path:
            tree = tree[str(key)]
        return tree

    values = {}
    groups: dict[Path, list] = {}
    for path, var in expected:
        if path[0] == "layers":
            item, inner = layer_dir(directory, int(path[1]) + start_layer), path[2:]
        elif path[0] == embedding:
            item, inner = directory / "embed", path
        else:
            item, inner = directory / "head", path
        groups.setdefault(item, []).append((inner, path, var))
    with layers(f"restoring {directory.name}", len(groups), unit="parts") as bar:
        for item, entries in groups.items():
            restored = restore(item, entries)
            for inner, path, _ in entries:
                values[path] = lookup(restored, inner)
            bar.advance(sum(int(v.nbytes) for v in (values[path] for _, path, _ in entries)))
    state = nnx.from_flat_state([(path, type(var)(values[path])) for path, var in expected])
    report = LoadReport(tensors_loaded=len(expected), bytes_read=int(sum(v.nbytes for v in values.values())),
                        seconds=time.perf_counter() - t0)
    return nnx.merge(graphdef, state), report

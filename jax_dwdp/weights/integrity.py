"""Integrity of a jax_dwdp Orbax checkpoint: the files' checksums and the weights' finiteness.

The marker lists every file with its size and CRC-32 (computed by convert right after each item is written,
`checksum_item`); a restore checks the files it is about to read (`files_to_read`: a DWDP rank only its own
experts' chunks) and names the layer, tensor and file of the first that is missing, truncated or changed
(`verify_files`). `checksums_checked` is how a caller (the CLI's --no-verify) turns that check off for the restores
it makes. The checksums prove the files are what convert wrote, not that the weights are usable, so
`verify_checkpoint` also restores each item and names the tensors that hold NaN or Inf (`nonfinite`, which convert
uses to warn). Kept apart from conversion and restore: these checks read files and arrays, never write, and are
the one place that says what "damaged" means.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jax_dwdp.weights.orbax_format import MARKER, describe, read_marker, restore_stored
from jax_dwdp.weights.safetensors_reader import CheckpointError

_CRC_BLOCK = 8 << 20


def file_crc(path: Path) -> tuple[int, int]:
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
        return list(pool.map(file_crc, paths))


def checksum_item(root: Path, item: Path) -> dict[str, list[int]]:
    """{path relative to root: [size, crc32]} of every file of an item."""
    paths = sorted(p for p in item.rglob("*") if p.is_file())
    return {p.relative_to(root).as_posix(): list(sc) for p, sc in zip(paths, _crc_many(paths))}


def verify_files(root: Path, expected: dict[str, list[int]], crc: bool = True) -> tuple[int, int]:
    """Checks files against their [size, crc32] (crc False: sizes only, which costs a stat per file): (files, bytes)
    checked, or CheckpointError naming the first bad one."""
    names = sorted(expected)
    paths = [root / name for name in names]
    for name, path in zip(names, paths):
        if not path.is_file():
            raise CheckpointError(f"{path}: missing ({describe(name)}); the checkpoint is damaged, convert it again")
        size = path.stat().st_size
        if size != expected[name][0]:
            raise CheckpointError(f"{path}: {size} bytes, expected {expected[name][0]} ({describe(name)}; truncated "
                                  "or replaced); the checkpoint is damaged, convert it again")
    for name, path, (_, value) in zip(names, paths, _crc_many(paths) if crc else []):
        if value != expected[name][1]:
            raise CheckpointError(f"{path}: checksum {value:08x}, expected {expected[name][1]:08x} ({describe(name)}; "
                                  "the data changed since conversion); the checkpoint is damaged, convert it again")
    return len(names), sum(expected[name][0] for name in names)


def files_to_read(directory: Path, item: Path, files: dict[str, list[int]], expert_rows: dict[str, set[int]]) -> dict:
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


def checksums_wanted(verify: bool | None) -> bool:
    """A restore's `verify` argument, None meaning: as the enclosing checksums_checked says (by default yes)."""
    return _VERIFY.get() if verify is None else verify


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
    n, nbytes = verify_files(directory, files)
    items = sorted({name.split("/")[0] if not name.startswith("layers/") else "/".join(name.split("/")[:2])
                    for name in files if "/" in name}, key=lambda item: (item != "embed", item == "head", item))
    bad, tensors = [], 0
    for item in items:
        arrays = restore_stored(directory, directory / item)
        tensors += len(arrays)
        bad += [(item, name, *counts) for name, counts in nonfinite(arrays).items()]
        del arrays
    if bad:
        raise CheckpointError(f"{directory}: {nonfinite_line(bad)} (the files match their checksums: the values "
                              "came from the source); a prefill with them gives NaN logits")
    return {"directory": str(directory), "files": n, "bytes": nbytes, "tensors": tensors,
            "seconds": round(time.perf_counter() - t0, 3)}


_COUNT_BLOCK = 1 << 22  # elements checked at a time: the masks take this many bytes, not the tensor's size
# Half-precision floats are checked on their bits (every exponent bit set: Inf or NaN), ~3x faster than np.isfinite
# on bfloat16 (a numpy extension type); float32 and float64 with np.isfinite. 13-17 GB/s on one CPU core, so a
# conversion (0.3-1 GB/s) spends a few percent on it.
_EXPONENT_BITS = {np.dtype(jnp.bfloat16): 0x7F80, np.dtype(np.float16): 0x7C00}


def nonfinite(arrays: dict) -> dict:
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


def nonfinite_line(bad: list[tuple[str, str, int, int, int]], limit: int = 6) -> str:
    """'2 tensors hold NaN or Inf: layer 1, tensor mlp.experts.down_proj: 3 NaN, 0 Inf of 16384 values; ...' for
    (item, tensor, NaN, Inf, values) rows; items are "embed", "head" or "layers/NNN"."""
    def where(item: str) -> str:
        return f"layer {int(item.split('/')[1])}" if item.startswith("layers/") else item

    rows = [f"{where(item)}, tensor {name}: {nan} NaN, {inf} Inf of {size} values"
            for item, name, nan, inf, size in bad[:limit]]
    more = f"; and {len(bad) - limit} more" if len(bad) > limit else ""
    return f"{len(bad)} tensor{'s hold' if len(bad) > 1 else ' holds'} NaN or Inf: {'; '.join(rows)}{more}"

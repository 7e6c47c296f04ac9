"""Lazy, memory-mapped reader for Hugging Face safetensors checkpoints.

Why not load whole files: a Qwen3.5-MoE checkpoint is far larger than host
memory, so each tensor is handed out as a read-only numpy view of an mmap and
only the pages a caller touches are read; peak host memory stays near the
largest tensor being converted. Why parse headers ourselves: a truncated
download or a hand-edited index should fail up front with one line naming the
file, the tensor and expected vs actual values, not with a bus error or a raw
KeyError deep inside a conversion.

Format (https://github.com/huggingface/safetensors): an 8-byte little-endian
u64 header length N, N bytes of UTF-8 JSON mapping tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (plus an optional
``"__metadata__"`` object of strings), then the data region; offsets are
relative to the data region, which starts at byte 8 + N.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import ml_dtypes
import numpy as np

INDEX_FILENAME = "model.safetensors.index.json"
# The marker file of a jax_dwdp Orbax checkpoint (orbax_store.MARKER), named here so that a folder that looks like
# one but lacks it gets a message that says so instead of "no *.safetensors files".
ORBAX_MARKER = "jax_dwdp.json"
_ORBAX_ITEMS = ("layers", "embed", "head")
_METADATA_KEY = "__metadata__"
_LENGTH_PREFIX_BYTES = 8
_REQUIRED_FIELDS = ("dtype", "shape", "data_offsets")


class CheckpointError(ValueError):
    """A checkpoint file or folder is missing, malformed or inconsistent."""


def orbax_without_marker(directory: Path) -> str | None:
    """A message when `directory` holds a jax_dwdp Orbax checkpoint's items (layers/, embed/, head/) but no
    marker file, which convert writes last; None otherwise. Such a folder is not an HF checkpoint either."""
    items = [name for name in _ORBAX_ITEMS if (directory / name).is_dir()]
    if not items or (directory / ORBAX_MARKER).is_file():
        return None
    return (f"{directory}: looks like a jax_dwdp Orbax checkpoint ({', '.join(n + '/' for n in items)}) but has no "
            f"marker file {directory / ORBAX_MARKER}, which convert writes last: an interrupted conversion or an "
            "incomplete copy; convert it again")


def _build_dtypes() -> dict[str, np.dtype]:
    # Explicit little-endian dtypes: the format is little-endian whatever the host.
    table = {
        "F64": np.dtype("<f8"),
        "F32": np.dtype("<f4"),
        "F16": np.dtype("<f2"),
        "BF16": np.dtype(ml_dtypes.bfloat16),
        "I64": np.dtype("<i8"),
        "I32": np.dtype("<i4"),
        "I16": np.dtype("<i2"),
        "I8": np.dtype("i1"),
        "U8": np.dtype("u1"),
        "BOOL": np.dtype(np.bool_),
    }
    # safetensors' F8_E4M3 is the "fn" variant (no infinities), as in torch.
    for name, attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
        if hasattr(ml_dtypes, attr):
            table[name] = np.dtype(getattr(ml_dtypes, attr))
    return table


DTYPES: dict[str, np.dtype] = _build_dtypes()


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives; begin/end are absolute byte offsets in ``file``."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class _DuplicateKeyError(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads silently keeps the last duplicate; two entries for one tensor
    # name means the header is corrupt, so refuse instead of guessing.
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(key)
        result[key] = value
    return result


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but `true` is not a valid size or offset.
    return isinstance(value, int) and not isinstance(value, bool)


def _read_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """Return (parsed JSON header, data region start, file size)."""
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(_LENGTH_PREFIX_BYTES)
            if len(prefix) < _LENGTH_PREFIX_BYTES:
                raise CheckpointError(
                    f"{path}: file is {size} bytes, shorter than the "
                    f"{_LENGTH_PREFIX_BYTES}-byte header length prefix"
                )
            header_len = int.from_bytes(prefix, "little")
            if header_len > size - _LENGTH_PREFIX_BYTES:
                raise CheckpointError(
                    f"{path}: header length {header_len} runs past the end of the "
                    f"file (file is {size} bytes, at most "
                    f"{size - _LENGTH_PREFIX_BYTES} header bytes available)"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read file: {e.strerror or e}") from e
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: header is not valid UTF-8: {e}") from e
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: header is not valid JSON: {e}") from e
    except _DuplicateKeyError as e:
        raise CheckpointError(f"{path}: header repeats key {e.key!r}") from e
    if not isinstance(header, dict):
        raise CheckpointError(
            f"{path}: header must be a JSON object, got {type(header).__name__}"
        )
    return header, _LENGTH_PREFIX_BYTES + header_len, size


def _parse_metadata(path: Path, header: dict[str, Any]) -> dict[str, str]:
    metadata = header.get(_METADATA_KEY, {})
    if not isinstance(metadata, dict) or not all(
        isinstance(v, str) for v in metadata.values()
    ):
        raise CheckpointError(f"{path}: {_METADATA_KEY} must be an object of strings")
    return metadata


def _parse_entry(path: Path, name: str, entry: Any, data_start: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: entry must be an object, got {type(entry).__name__}")
    missing = [k for k in _REQUIRED_FIELDS if k not in entry]
    if missing:
        raise CheckpointError(f"{where}: entry is missing {', '.join(missing)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPES:
        raise CheckpointError(
            f"{where}: unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})"
        )
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(
            f"{where}: shape must be a list of non-negative integers, got {shape!r}"
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and o >= 0 for o in offsets)
    ):
        raise CheckpointError(
            f"{where}: data_offsets must be [begin, end] non-negative integers, "
            f"got {offsets!r}"
        )
    begin, end = offsets
    if begin > end:
        raise CheckpointError(f"{where}: data_offsets begin {begin} > end {end}")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != expected:
        raise CheckpointError(
            f"{where}: data_offsets [{begin}, {end}] span {end - begin} bytes, but "
            f"{dtype} shape {shape} needs {expected}"
        )
    return TensorInfo(name, path, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_fits(path: Path, tensors: dict[str, TensorInfo], size: int) -> None:
    # Checked at open, not at read, so a short download fails before any
    # conversion work and the message can give the expected size.
    last = max(tensors.values(), key=lambda t: t.end, default=None)
    if last is not None and last.end > size:
        raise CheckpointError(
            f"{path}: file is truncated: tensor {last.name!r} ends at byte {last.end}, "
            f"so expected at least {last.end} bytes, actual size {size}"
        )


def _check_no_overlap(path: Path, tensors: dict[str, TensorInfo]) -> None:
    # Empty tensors occupy no bytes, so they cannot overlap anything.
    ranges = sorted((t for t in tensors.values() if t.nbytes), key=lambda t: t.begin)
    for prev, cur in zip(ranges, ranges[1:]):
        if cur.begin < prev.end:
            raise CheckpointError(
                f"{path}: tensors {prev.name!r} [{prev.begin}, {prev.end}) and "
                f"{cur.name!r} [{cur.begin}, {cur.end}) overlap"
            )


class SafetensorsFile:
    """One .safetensors file: header parsed and validated eagerly, data mmapped lazily."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        header, data_start, size = _read_header(self.path)
        self._metadata = _parse_metadata(self.path, header)
        self._tensors = {
            name: _parse_entry(self.path, name, entry, data_start)
            for name, entry in header.items()
            if name != _METADATA_KEY
        }
        _check_fits(self.path, self._tensors, size)
        _check_no_overlap(self.path, self._tensors)
        self._mmap: mmap.mmap | None = None
        self._closed = False
        self.bytes_read = 0

    @property
    def metadata(self) -> dict[str, str]:
        return dict(self._metadata)

    def names(self) -> list[str]:
        return sorted(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in this file") from None

    def read(self, name: str) -> np.ndarray:
        """Read-only view of the tensor; pages are read only when touched."""
        if self._closed:
            raise CheckpointError(f"{self.path}: file is closed, cannot read {name!r}")
        info = self.info(name)
        dtype = DTYPES[info.dtype]
        if info.nbytes == 0:
            array = np.empty(info.shape, dtype)
            array.flags.writeable = False
        else:
            count = info.nbytes // dtype.itemsize
            array = np.frombuffer(self._mapped(info), dtype, count, info.begin)
            array = array.reshape(info.shape)
        self.bytes_read += info.nbytes
        return array

    def _mapped(self, info: TensorInfo) -> mmap.mmap:
        if self._mmap is None:
            try:
                with self.path.open("rb") as f:
                    self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{self.path}: cannot map file: {e}") from e
        # The file may have shrunk since the header was validated; without this,
        # np.frombuffer would raise a bare ValueError.
        if len(self._mmap) < info.end:
            raise CheckpointError(
                f"{self.path}: file is truncated: tensor {info.name!r} ends at byte "
                f"{info.end}, actual size {len(self._mmap)}"
            )
        return self._mmap

    def unmap(self) -> None:
        """Drops the mapping (and so its resident pages) but keeps the parsed header; the next read maps again.

        A reader kept open across many reads (a conversion, layer by layer) calls this between layers so that host
        memory holds about one layer of mapped pages, not every page read so far."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # arrays from read() still export it; it unmaps when the last of them is collected
            self._mmap = None

    def close(self) -> None:
        self._closed = True
        self.unmap()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _load_weight_map(index_path: Path) -> dict[str, str]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"{index_path}: cannot read index: {e.strerror or e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index_path}: index is not valid JSON: {e}") from e
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: index has no weight_map object")
    for tensor, shard in weight_map.items():
        # Shards must sit beside the index; a path would escape the folder.
        if not isinstance(shard, str) or not shard or Path(shard).name != shard:
            raise CheckpointError(
                f"{index_path}: tensor {tensor!r} maps to {shard!r}, "
                "expected a shard file name in the same folder"
            )
    return weight_map


class SafetensorsCheckpoint:
    """A checkpoint folder: sharded with an index.json, or plain *.safetensors files."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        if not self.directory.exists():
            raise CheckpointError(f"{self.directory}: checkpoint folder does not exist")
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: checkpoint path is not a folder")
        # Every header is parsed up front: it costs a few KB per shard and
        # surfaces a bad shard before any conversion work starts.
        self._files: dict[Path, SafetensorsFile] = {}
        self._owner: dict[str, SafetensorsFile] = {}
        self._names: list[str] | None = None
        index_path = self.directory / INDEX_FILENAME
        if index_path.exists():
            self._open_indexed(index_path)
        else:
            self._open_unindexed()

    def _open_indexed(self, index_path: Path) -> None:
        weight_map = _load_weight_map(index_path)
        for tensor, shard in sorted(weight_map.items()):
            path = self.directory / shard
            if path not in self._files:
                if not path.is_file():
                    raise CheckpointError(
                        f"{index_path}: shard {shard!r} (needed by tensor {tensor!r}) "
                        f"does not exist at {path}"
                    )
                self._files[path] = SafetensorsFile(path)
            file = self._files[path]
            if tensor not in file:
                raise CheckpointError(
                    f"{path}: tensor {tensor!r} is listed in {INDEX_FILENAME} "
                    "but missing from this shard's header"
                )
            self._owner[tensor] = file

    def _open_unindexed(self) -> None:
        paths = sorted(p for p in self.directory.glob("*.safetensors") if p.is_file())
        if not paths:
            orbax = orbax_without_marker(self.directory)
            if orbax is not None:
                raise CheckpointError(orbax)
            raise CheckpointError(
                f"{self.directory}: no *.safetensors files and no {INDEX_FILENAME}"
            )
        for path in paths:
            file = SafetensorsFile(path)
            self._files[path] = file
            for tensor in file.names():
                if tensor in self._owner:
                    raise CheckpointError(
                        f"{path}: tensor {tensor!r} is also in "
                        f"{self._owner[tensor].path} (no {INDEX_FILENAME} to choose)"
                    )
                self._owner[tensor] = file

    @property
    def files(self) -> list[Path]:
        return sorted(self._files)

    @property
    def total_bytes(self) -> int:
        return sum(f.info(name).nbytes for name, f in self._owner.items())

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self._files.values())

    def names(self) -> list[str]:
        if self._names is None:
            self._names = sorted(self._owner)
        return list(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._owner

    def _file_for(self, name: str) -> SafetensorsFile:
        try:
            return self._owner[name]
        except KeyError:
            raise CheckpointError(
                f"{self.directory}: no tensor {name!r} in checkpoint"
            ) from None

    def info(self, name: str) -> TensorInfo:
        return self._file_for(name).info(name)

    def read(self, name: str) -> np.ndarray:
        return self._file_for(name).read(name)

    def unmap(self) -> None:
        """See SafetensorsFile.unmap: frees mapped pages between layers; headers stay parsed."""
        for file in self._files.values():
            file.unmap()

    def close(self) -> None:
        for file in self._files.values():
            file.close()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

"""Tests for jax_dwdp.weights.safetensors_reader against files written by safetensors."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file as save_torch

from jax_dwdp.weights.safetensors_reader import (
    DTYPES,
    INDEX_FILENAME,
    CheckpointError,
    SafetensorsCheckpoint,
    SafetensorsFile,
    TensorInfo,
)

SHAPES = [(3, 5), (), (0, 4), (2, 3, 4), (7,)]


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    # Seeded from the test id: reproducible, yet different data in every test.
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def random_array(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    # np.asarray: for shape () numpy returns a scalar, not an array.
    return np.asarray(rng.standard_normal(size=shape) * 100).astype(dtype)


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    assert actual.dtype.itemsize == expected.dtype.itemsize
    uint = np.dtype(f"u{actual.dtype.itemsize}")
    np.testing.assert_array_equal(actual.view(uint), expected.view(uint))


def write_raw(path: Path, header: dict | bytes, data: bytes = b"", *, header_len: int | None = None) -> Path:
    """Write a safetensors-shaped file by hand, so tests can make it lie."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(body) if header_len is None else header_len
    path.write_bytes(length.to_bytes(8, "little") + body + data)
    return path


def error_of(fn, *args) -> str:
    with pytest.raises(CheckpointError) as excinfo:
        fn(*args)
    message = str(excinfo.value)
    assert "\n" not in message, "errors must be one line"
    return message


# --- round trips -------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype_name, np_dtype",
    [
        ("F64", np.float64),
        ("F32", np.float32),
        ("F16", np.float16),
        ("I64", np.int64),
        ("I32", np.int32),
        ("I16", np.int16),
        ("I8", np.int8),
        ("U8", np.uint8),
        ("BOOL", np.bool_),
    ],
)
def test_round_trip_numpy(tmp_path: Path, rng: np.random.Generator, dtype_name: str, np_dtype: type) -> None:
    tensors = {f"t{i}": random_array(rng, np_dtype, shape) for i, shape in enumerate(SHAPES)}
    path = tmp_path / "x.safetensors"
    save_numpy(tensors, str(path))

    with SafetensorsFile(path) as f:
        assert f.names() == sorted(tensors)
        for name, expected in tensors.items():
            info = f.info(name)
            assert info.dtype == dtype_name
            assert info.shape == expected.shape
            assert info.nbytes == expected.nbytes
            actual = f.read(name)
            assert actual.dtype == np.dtype(np_dtype)
            assert not actual.flags.writeable
            assert_bits_equal(actual, expected)


def test_mixed_dtypes_in_one_file(tmp_path: Path, rng: np.random.Generator) -> None:
    tensors = {
        "a.f32": random_array(rng, np.float32, (4, 6)),
        "b.f16": random_array(rng, np.float16, (5,)),
        "c.i32": random_array(rng, np.int32, (2, 2, 3)),
        "d.i64": random_array(rng, np.int64, ()),
        "e.empty": random_array(rng, np.float32, (3, 0)),
    }
    path = tmp_path / "mixed.safetensors"
    save_numpy(tensors, str(path))
    with SafetensorsFile(path) as f:
        for name, expected in tensors.items():
            assert_bits_equal(f.read(name), expected)
            assert f.read(name).dtype == expected.dtype


@pytest.mark.parametrize(
    "dtype_name, torch_dtype, np_dtype",
    [
        ("BF16", torch.bfloat16, ml_dtypes.bfloat16),
        ("F8_E4M3", torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn),
        ("F8_E5M2", torch.float8_e5m2, ml_dtypes.float8_e5m2),
    ],
)
def test_round_trip_torch_low_precision(
    tmp_path: Path, rng: np.random.Generator, dtype_name: str, torch_dtype: torch.dtype, np_dtype: type
) -> None:
    assert dtype_name in DTYPES
    tensors = {
        f"w{i}": torch.from_numpy(random_array(rng, np.float32, shape)).to(torch_dtype)
        for i, shape in enumerate(SHAPES)
    }
    path = tmp_path / "low.safetensors"
    save_torch(tensors, str(path))

    with SafetensorsFile(path) as f:
        for name, tensor in tensors.items():
            actual = f.read(name)
            assert f.info(name).dtype == dtype_name
            assert actual.dtype == np.dtype(np_dtype)
            bits = torch.int16 if tensor.element_size() == 2 else torch.int8
            assert_bits_equal(actual, tensor.view(bits).numpy())


def test_bf16_values_match_torch(tmp_path: Path, rng: np.random.Generator) -> None:
    tensor = torch.from_numpy(random_array(rng, np.float32, (8, 16))).to(torch.bfloat16)
    path = tmp_path / "bf16.safetensors"
    save_torch({"w": tensor}, str(path))
    with SafetensorsFile(path) as f:
        np.testing.assert_array_equal(f.read("w").astype(np.float32), tensor.float().numpy())


def test_metadata(tmp_path: Path, rng: np.random.Generator) -> None:
    path = tmp_path / "meta.safetensors"
    metadata = {"format": "pt", "note": f"seed-{rng.integers(1 << 30)}"}
    save_numpy({"x": random_array(rng, np.float32, (2,))}, str(path), metadata=metadata)
    with SafetensorsFile(path) as f:
        assert f.metadata == metadata
        assert "__metadata__" not in f.names()


def test_no_metadata_is_empty(tmp_path: Path, rng: np.random.Generator) -> None:
    path = tmp_path / "plain.safetensors"
    save_numpy({"x": random_array(rng, np.float32, (2,))}, str(path))
    with SafetensorsFile(path) as f:
        assert f.metadata == {}


def test_info_offsets_are_absolute(tmp_path: Path, rng: np.random.Generator) -> None:
    expected = random_array(rng, np.int32, (3, 4))
    path = tmp_path / "abs.safetensors"
    save_numpy({"x": expected}, str(path))
    info = SafetensorsFile(path).info("x")
    assert info == TensorInfo("x", path, "I32", (3, 4), info.begin, info.end)
    raw = path.read_bytes()[info.begin : info.end]
    assert raw == expected.astype("<i4").tobytes()


def test_read_is_a_view_of_the_map(tmp_path: Path, rng: np.random.Generator) -> None:
    path = tmp_path / "view.safetensors"
    save_numpy({"x": random_array(rng, np.float32, (64, 64))}, str(path))
    with SafetensorsFile(path) as f:
        array = f.read("x")
        assert not array.flags.owndata
        with pytest.raises(ValueError):
            array[0, 0] = 1.0


# --- checkpoints -------------------------------------------------------------


def write_sharded(tmp_path: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    shard1 = {"model.embed": random_array(rng, np.float32, (6, 4)), "model.norm": random_array(rng, np.float16, (4,))}
    shard2 = {"lm_head": random_array(rng, np.float32, (4, 6)), "model.step": random_array(rng, np.int64, ())}
    save_numpy(shard1, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_numpy(shard2, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {name: "model-00001-of-00002.safetensors" for name in shard1}
    weight_map |= {name: "model-00002-of-00002.safetensors" for name in shard2}
    write_index(tmp_path, weight_map)
    return shard1 | shard2


def write_index(folder: Path, weight_map: dict[str, str]) -> None:
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / INDEX_FILENAME).write_text(json.dumps(index))


def test_sharded_checkpoint_with_index(tmp_path: Path, rng: np.random.Generator) -> None:
    tensors = write_sharded(tmp_path, rng)
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert ckpt.names() == sorted(tensors)
        assert ckpt.files == [
            tmp_path / "model-00001-of-00002.safetensors",
            tmp_path / "model-00002-of-00002.safetensors",
        ]
        assert ckpt.total_bytes == sum(t.nbytes for t in tensors.values())
        assert "lm_head" in ckpt and "missing" not in ckpt
        assert ckpt.info("lm_head").file.name == "model-00002-of-00002.safetensors"
        for name, expected in tensors.items():
            assert_bits_equal(ckpt.read(name), expected)


def test_index_is_authoritative_over_extra_shard_tensors(tmp_path: Path, rng: np.random.Generator) -> None:
    save_numpy(
        {"kept": random_array(rng, np.float32, (3,)), "extra": random_array(rng, np.float32, (2,))},
        str(tmp_path / "a.safetensors"),
    )
    write_index(tmp_path, {"kept": "a.safetensors"})
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert ckpt.names() == ["kept"]
        message = error_of(ckpt.read, "extra")
        assert str(tmp_path) in message and "extra" in message


def test_unindexed_folder_with_two_files(tmp_path: Path, rng: np.random.Generator) -> None:
    first = {"a": random_array(rng, np.float32, (2, 3)), "c": random_array(rng, np.int32, (4,))}
    second = {"b": random_array(rng, np.float16, (5,))}
    save_numpy(first, str(tmp_path / "one.safetensors"))
    save_numpy(second, str(tmp_path / "two.safetensors"))
    (tmp_path / "README.md").write_text("not a tensor file")
    with SafetensorsCheckpoint(str(tmp_path)) as ckpt:
        assert ckpt.names() == ["a", "b", "c"]
        assert ckpt.files == [tmp_path / "one.safetensors", tmp_path / "two.safetensors"]
        for name, expected in (first | second).items():
            assert_bits_equal(ckpt.read(name), expected)


def test_bytes_read_counts_only_what_was_read(tmp_path: Path, rng: np.random.Generator) -> None:
    tensors = write_sharded(tmp_path, rng)
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        assert ckpt.bytes_read == 0
        ckpt.read("model.norm")
        assert ckpt.bytes_read == tensors["model.norm"].nbytes
        ckpt.read("lm_head")
        assert ckpt.bytes_read == tensors["model.norm"].nbytes + tensors["lm_head"].nbytes
        assert ckpt.bytes_read < ckpt.total_bytes

    path = tmp_path / "single.safetensors"
    big, small = random_array(rng, np.float32, (256, 256)), random_array(rng, np.float32, (3,))
    save_numpy({"big": big, "small": small}, str(path))
    with SafetensorsFile(path) as f:
        f.read("small")
        assert f.bytes_read == small.nbytes


# --- header errors -----------------------------------------------------------


def valid_file(tmp_path: Path, rng: np.random.Generator, name: str = "good.safetensors") -> Path:
    path = tmp_path / name
    save_numpy(
        {"alpha": random_array(rng, np.float32, (16, 8)), "beta": random_array(rng, np.int64, (5,))},
        str(path),
    )
    return path


@pytest.mark.parametrize("cut", [1, 7, 100])
def test_truncated_file(tmp_path: Path, rng: np.random.Generator, cut: int) -> None:
    path = valid_file(tmp_path, rng)
    size = path.stat().st_size
    with path.open("r+b") as f:
        f.truncate(size - cut)
    message = error_of(SafetensorsFile, path)
    assert path.name in message and "truncated" in message
    assert str(size) in message and str(size - cut) in message


def test_file_shorter_than_length_prefix(tmp_path: Path) -> None:
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01\x02\x03")
    message = error_of(SafetensorsFile, path)
    assert path.name in message and "3 bytes" in message


def test_header_length_larger_than_file(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "long.safetensors", {}, header_len=10_000)
    message = error_of(SafetensorsFile, path)
    assert path.name in message and "10000" in message


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"\xff\xfe\x00garbage", b"[1, 2, 3]", b'"a string"'],
    ids=["bad-json", "bad-utf8", "json-list", "json-string"],
)
def test_garbage_header(tmp_path: Path, body: bytes) -> None:
    path = write_raw(tmp_path / "garbage.safetensors", body)
    assert path.name in error_of(SafetensorsFile, path)


def test_duplicate_tensor_in_header(tmp_path: Path) -> None:
    entry = '{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    body = f'{{"dup": {entry}, "dup": {entry}}}'.encode()
    path = write_raw(tmp_path / "dup.safetensors", body, b"\x07")
    message = error_of(SafetensorsFile, path)
    assert path.name in message and "dup" in message


def test_bad_metadata(tmp_path: Path) -> None:
    path = write_raw(tmp_path / "meta.safetensors", {"__metadata__": {"n": 3}})
    assert path.name in error_of(SafetensorsFile, path)


@pytest.mark.parametrize("field", ["dtype", "shape", "data_offsets"])
def test_entry_missing_field(tmp_path: Path, field: str) -> None:
    entry = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    del entry[field]
    path = write_raw(tmp_path / "missing.safetensors", {"weight": entry}, bytes(8))
    message = error_of(SafetensorsFile, path)
    assert path.name in message and "weight" in message and field in message


def test_unknown_dtype(tmp_path: Path) -> None:
    entry = {"dtype": "F12", "shape": [2], "data_offsets": [0, 8]}
    path = write_raw(tmp_path / "dtype.safetensors", {"weight": entry}, bytes(8))
    message = error_of(SafetensorsFile, path)
    assert path.name in message and "weight" in message and "F12" in message


@pytest.mark.parametrize("shape", [[-1, 2], [2.5], ["2"], [True], 4], ids=str)
def test_bad_shape(tmp_path: Path, shape: object) -> None:
    entry = {"dtype": "U8", "shape": shape, "data_offsets": [0, 4]}
    path = write_raw(tmp_path / "shape.safetensors", {"weight": entry}, bytes(4))
    message = error_of(SafetensorsFile, path)
    assert path.name in message and "weight" in message and "shape" in message


@pytest.mark.parametrize("offsets", [[0], [0, 4, 8], [-4, 0], [0, "4"], None], ids=str)
def test_bad_offsets_type(tmp_path: Path, offsets: object) -> None:
    entry = {"dtype": "U8", "shape": [4], "data_offsets": offsets}
    path = write_raw(tmp_path / "offs.safetensors", {"weight": entry}, bytes(4))
    message = error_of(SafetensorsFile, path)
    assert path.name in message and "weight" in message and "data_offsets" in message


def test_offsets_inconsistent_with_shape(tmp_path: Path) -> None:
    entry = {"dtype": "F32", "shape": [3, 2], "data_offsets": [0, 20]}
    path = write_raw(tmp_path / "span.safetensors", {"weight": entry}, bytes(24))
    message = error_of(SafetensorsFile, path)
    assert path.name in message and "weight" in message
    assert "20 bytes" in message and "24" in message


def test_offsets_begin_after_end(tmp_path: Path) -> None:
    entry = {"dtype": "U8", "shape": [0], "data_offsets": [8, 4]}
    path = write_raw(tmp_path / "order.safetensors", {"weight": entry}, bytes(8))
    message = error_of(SafetensorsFile, path)
    assert path.name in message and "weight" in message and "8" in message and "4" in message


def test_range_past_end_of_file(tmp_path: Path) -> None:
    header = {
        "ok": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "far": {"dtype": "F32", "shape": [4], "data_offsets": [100, 116]},
    }
    path = write_raw(tmp_path / "past.safetensors", header, bytes(8))
    message = error_of(SafetensorsFile, path)
    data_start = path.stat().st_size - 8
    assert path.name in message and "far" in message and "truncated" in message
    assert str(data_start + 116) in message and str(path.stat().st_size) in message


def test_overlapping_ranges(tmp_path: Path) -> None:
    header = {
        "first": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "second": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
    }
    path = write_raw(tmp_path / "overlap.safetensors", header, bytes(20))
    message = error_of(SafetensorsFile, path)
    assert path.name in message and "first" in message and "second" in message and "overlap" in message


def test_empty_tensor_inside_another_range_is_not_an_overlap(tmp_path: Path, rng: np.random.Generator) -> None:
    data = random_array(rng, np.uint8, (16,))
    header = {
        "full": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]},
        "empty": {"dtype": "F32", "shape": [0, 3], "data_offsets": [8, 8]},
    }
    path = write_raw(tmp_path / "empty.safetensors", header, data.tobytes())
    with SafetensorsFile(path) as f:
        assert f.read("empty").shape == (0, 3)
        np.testing.assert_array_equal(f.read("full"), data)


def test_missing_tensor_names_file_and_tensor(tmp_path: Path, rng: np.random.Generator) -> None:
    path = valid_file(tmp_path, rng)
    with SafetensorsFile(path) as f:
        for method in (f.info, f.read):
            message = error_of(method, "gamma")
            assert path.name in message and "gamma" in message


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.safetensors"
    assert path.name in error_of(SafetensorsFile, path)


# --- checkpoint errors -------------------------------------------------------


def test_missing_shard_named_in_index(tmp_path: Path, rng: np.random.Generator) -> None:
    write_sharded(tmp_path, rng)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    message = error_of(SafetensorsCheckpoint, tmp_path)
    assert INDEX_FILENAME in message and "model-00002-of-00002.safetensors" in message
    assert "lm_head" in message or "model.step" in message


def test_tensor_in_index_but_not_in_shard(tmp_path: Path, rng: np.random.Generator) -> None:
    save_numpy({"present": random_array(rng, np.float32, (2,))}, str(tmp_path / "s.safetensors"))
    write_index(tmp_path, {"present": "s.safetensors", "ghost": "s.safetensors"})
    message = error_of(SafetensorsCheckpoint, tmp_path)
    assert "s.safetensors" in message and "ghost" in message


@pytest.mark.parametrize(
    "text",
    ["{oops", "[]", '{"metadata": {}}', '{"weight_map": ["a"]}'],
    ids=["bad-json", "list", "no-weight-map", "weight-map-list"],
)
def test_bad_index(tmp_path: Path, rng: np.random.Generator, text: str) -> None:
    valid_file(tmp_path, rng)
    (tmp_path / INDEX_FILENAME).write_text(text)
    assert INDEX_FILENAME in error_of(SafetensorsCheckpoint, tmp_path)


def test_index_shard_outside_folder(tmp_path: Path, rng: np.random.Generator) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    valid_file(tmp_path, rng, "outside.safetensors")
    write_index(folder, {"alpha": "../outside.safetensors"})
    message = error_of(SafetensorsCheckpoint, folder)
    assert INDEX_FILENAME in message and "alpha" in message


def test_bad_shard_header_names_shard(tmp_path: Path, rng: np.random.Generator) -> None:
    write_sharded(tmp_path, rng)
    broken = tmp_path / "model-00001-of-00002.safetensors"
    broken.write_bytes(broken.read_bytes()[:-3])
    message = error_of(SafetensorsCheckpoint, tmp_path)
    assert broken.name in message and "truncated" in message


def test_duplicate_tensor_across_unindexed_files(tmp_path: Path, rng: np.random.Generator) -> None:
    save_numpy({"shared": random_array(rng, np.float32, (2,))}, str(tmp_path / "a.safetensors"))
    save_numpy({"shared": random_array(rng, np.float32, (2,))}, str(tmp_path / "b.safetensors"))
    message = error_of(SafetensorsCheckpoint, tmp_path)
    assert "a.safetensors" in message and "b.safetensors" in message and "shared" in message


def test_empty_folder(tmp_path: Path) -> None:
    folder = tmp_path / "empty_ckpt"
    folder.mkdir()
    assert "empty_ckpt" in error_of(SafetensorsCheckpoint, folder)


def test_missing_folder(tmp_path: Path) -> None:
    assert "nowhere" in error_of(SafetensorsCheckpoint, tmp_path / "nowhere")


def test_folder_is_a_file(tmp_path: Path, rng: np.random.Generator) -> None:
    path = valid_file(tmp_path, rng)
    assert path.name in error_of(SafetensorsCheckpoint, path)


def test_checkpoint_missing_tensor(tmp_path: Path, rng: np.random.Generator) -> None:
    write_sharded(tmp_path, rng)
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        for method in (ckpt.info, ckpt.read):
            message = error_of(method, "nope")
            assert str(tmp_path) in message and "nope" in message


# --- closing -----------------------------------------------------------------


def test_read_after_close_raises(tmp_path: Path, rng: np.random.Generator) -> None:
    path = valid_file(tmp_path, rng)
    f = SafetensorsFile(path)
    f.read("beta")
    f.close()
    message = error_of(f.read, "alpha")
    assert path.name in message and "alpha" in message
    f.close()


def test_close_before_any_read(tmp_path: Path, rng: np.random.Generator) -> None:
    f = SafetensorsFile(valid_file(tmp_path, rng))
    f.close()
    f.close()
    with pytest.raises(CheckpointError):
        f.read("alpha")


def test_views_outlive_close(tmp_path: Path, rng: np.random.Generator) -> None:
    path = tmp_path / "alive.safetensors"
    expected = random_array(rng, np.float32, (32, 32))
    save_numpy({"x": expected}, str(path))
    f = SafetensorsFile(path)
    view = f.read("x")
    f.close()  # must not raise "cannot close exported pointers exist"
    assert_bits_equal(view, expected)
    del view


def test_context_manager_closes(tmp_path: Path, rng: np.random.Generator) -> None:
    path = valid_file(tmp_path, rng)
    with SafetensorsFile(path) as f:
        f.read("alpha")
    with pytest.raises(CheckpointError):
        f.read("alpha")


def test_checkpoint_context_manager_closes_every_file(tmp_path: Path, rng: np.random.Generator) -> None:
    write_sharded(tmp_path, rng)
    with SafetensorsCheckpoint(tmp_path) as ckpt:
        ckpt.read("model.embed")
    ckpt.close()
    for name in ("model.embed", "lm_head"):
        message = error_of(ckpt.read, name)
        assert name in message


def test_truncated_after_open_is_caught_before_mapping(tmp_path: Path, rng: np.random.Generator) -> None:
    path = valid_file(tmp_path, rng)
    f = SafetensorsFile(path)
    os.truncate(path, path.stat().st_size - 4)
    message = error_of(f.read, "beta" if f.info("beta").end > f.info("alpha").end else "alpha")
    assert path.name in message and "truncated" in message
    f.close()

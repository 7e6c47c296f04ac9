"""The on-disk format of a jax_dwdp Orbax checkpoint, and reading and writing its items with Orbax.

Layout of a checkpoint folder:
    config.json          the model config (HF text form)
    jax_dwdp.json        format marker, dtypes stored and cast, counts, every file's size and CRC-32; written last,
                         so a folder without it is not a checkpoint
    embed/               Orbax PyTree checkpoint: {"embed_tokens": {"weight"}}
    layers/NNN/          one Orbax PyTree checkpoint per layer, keyed like the model's state
    head/                {"norm": {"weight"}, "lm_head": {"weight"}}
Each layer is its own Orbax checkpoint, so a pipeline stage opens only its layers' folders and reads no byte of
another layer; arrays are restored with the caller's sharding, so a DWDP rank reads only its slice of the experts.
Items are written as plain zarr (each array a folder with one file per chunk, expert tensors one expert per chunk)
or, on request, in Orbax's OCDBT format; Orbax detects the format on restore, so checkpoints of either kind load.

This module is what every other part of the checkpoint code agrees on: the marker (`read_marker`,
`is_orbax_checkpoint`), where an item lives (`layer_dir`), how a path inside the folder is named in messages
(`describe`), the Orbax checkpointer, restoring a whole item onto the host (`restore_stored`), and the quirks of
Orbax's failed reads and writes (`restore_error`, `silence_orbax_leftover_*`). Conversion and restore
(orbax_store), the integrity checks (integrity) and publishing a finished conversion (publish) build on it.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from pathlib import Path

import jax

from jax_dwdp.config import read_json_file
from jax_dwdp.weights.safetensors_reader import ORBAX_MARKER, CheckpointError, orbax_without_marker

FORMAT = "jax_dwdp-orbax"
FORMAT_VERSION = 1
MARKER = ORBAX_MARKER  # "jax_dwdp.json"


def is_orbax_checkpoint(directory: str | Path) -> bool:
    return (Path(directory) / MARKER).is_file()


def read_marker(directory: Path) -> dict:
    """The marker's JSON object, or CheckpointError: no marker (with what the folder looks like), not JSON, or
    another format or version."""
    directory = Path(directory)
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


def layer_dir(root: Path, layer_id: int) -> Path:
    return root / "layers" / f"{layer_id:03d}"


def to_tree(flat: list[tuple[tuple, object]]) -> dict:
    """The nested dict of string keys that an Orbax item stores, from (path, value) pairs."""
    tree: dict = {}
    for path, value in flat:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1])] = value
    return tree


def describe(relpath: str) -> str:
    """'layer 2, tensor mlp.experts.down_proj' for layers/002/mlp.experts.down_proj/3.0.0."""
    parts = relpath.split("/")
    if parts[0] == "layers" and len(parts) > 1 and not parts[1].isdigit():
        return "/".join(parts[:2])
    where = f"layer {int(parts[1])}" if parts[0] == "layers" and len(parts) > 1 else parts[0]
    depth = 2 if parts[0] == "layers" else 1
    if len(parts) > depth + 1:  # a file inside an array's folder
        return f"{where}, tensor {parts[depth]}"
    return f"{where}, Orbax metadata"


def checkpointer(use_ocdbt: bool = True):
    """use_ocdbt only matters for saving (restore detects the format). Conversion saves without OCDBT:
    each array is a zarr folder with one file per chunk (an expert per file for expert tensors), which keeps the
    partial restore layout and wrote faster on the CPU machine (benchmarks/RESULTS.md)."""
    import orbax.checkpoint as ocp  # imported here: orbax pulls in a lot at import time

    # No compression: weights are high-entropy, and zstd over them costs far more time than it saves bytes.
    return ocp.PyTreeCheckpointer(use_compression=False, use_ocdbt=use_ocdbt)


def restore_stored(directory: Path, item: Path) -> dict[str, jax.Array]:
    """{dotted name: array} of every array of an item, in its stored dtype, on the host CPU."""
    import orbax.checkpoint as ocp  # imported here: orbax pulls in a lot at import time

    if not item.is_dir():
        raise CheckpointError(f"{item}: missing from the checkpoint")
    ckpt = checkpointer()
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    silence_orbax_leftover_reads()
    try:
        meta = ckpt.metadata(item)
        tree = getattr(meta, "item_metadata", meta)
        tree = getattr(tree, "tree", tree)
        args = jax.tree.map(lambda m: ocp.ArrayRestoreArgs(sharding=cpu, global_shape=tuple(m.shape), dtype=m.dtype),
                            tree)
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=cpu), tree)
        restored = ckpt.restore(item, item=target, restore_args=args)
    except Exception as e:  # Orbax/tensorstore raise many types for damaged or mismatched data
        silence_orbax_leftover_reads()
        raise CheckpointError(restore_error(directory, item, e)) from None
    finally:
        ckpt.close()
    return {".".join(str(k.key) for k in path): x for path, x in jax.tree_util.tree_flatten_with_path(restored)[0]}


def restore_error(directory: Path, item: Path, error: BaseException) -> str:
    """One line for a failed restore: the file tensorstore could not read (with layer and tensor) when it says."""
    seen = error
    while seen is not None:
        m = re.search(r'Error reading local file "([^"]+)": ([^\n]+)', str(seen))
        if m:
            path = Path(m.group(1))
            try:
                what = describe(path.relative_to(directory.absolute()).as_posix())
            except ValueError:
                what = item.name
            return f"{path}: cannot read ({what}): {m.group(2)}; the checkpoint is damaged, convert it again"
        seen = seen.__cause__ or seen.__context__
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if not first or re.search(r"<bound method |<function |<built-in | object at 0x", first):
        first = type(error).__name__  # a Python repr (a pybind11 callback's) says nothing to a user
    return f"{item}: cannot restore ({first[:300]})"


def silence_orbax_leftover_reads() -> None:
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


def silence_orbax_leftover_writes() -> None:
    """When one write of an item fails (a full disk), Orbax (0.12.8) raises the error in the caller and leaves the
    item's other writes behind: asyncio logs each as "Task exception was never retrieved" with a traceback when it
    is collected (often at exit, after the error line), and a closed event loop's callbacks report "Event loop is
    closed" (see silence_orbax_leftover_reads). Drops exactly those reports, for the rest of the process."""
    silence_orbax_leftover_reads()
    logging.getLogger("asyncio").addFilter(_LEFTOVER_WRITES)  # (once: addFilter skips a filter it has)

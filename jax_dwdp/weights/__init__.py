"""Checkpoints: HF safetensors (read lazily) and jax_dwdp's Orbax format (per-layer items).

Modules: safetensors_reader (the HF files), hf_names (HF name <-> parameter path), hf_loader (HF -> model, any
layer range), orbax_format (the Orbax checkpoint's layout and marker), integrity (its checksums and finite check,
`verify_checkpoint`), publish (a conversion's output appearing atomically), orbax_store (conversion and restore).
The public names are importable from here.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from jax_dwdp.model import set_fused_swiglu
from jax_dwdp.weights.hf_loader import NAMINGS, load_config, load_hf_checkpoint
from jax_dwdp.weights.integrity import checksums_checked, verify_checkpoint
from jax_dwdp.weights.orbax_format import is_orbax_checkpoint, read_marker
from jax_dwdp.weights.orbax_store import convert_hf_to_orbax, load_orbax_checkpoint
from jax_dwdp.weights.safetensors_reader import DTYPES, CheckpointError, SafetensorsCheckpoint

__all__ = ["CheckpointError", "checksums_checked", "convert_hf_to_orbax", "is_orbax_checkpoint", "load_checkpoint",
           "load_orbax_checkpoint", "precision_notice", "read_marker", "stored_dtypes", "verify_checkpoint"]


def load_checkpoint(directory: str | Path, *, cfg=None, dtype, start_layer: int = 0, end_layer: int | None = None,
                    placement=None, fused_swiglu: bool = False, verify: bool | None = None):
    """Loads layers [start_layer, end_layer) from an HF folder or a jax_dwdp Orbax folder: (model, LoadReport).

    `fused_swiglu` then puts the expert gate_up weights in the fused-SwiGLU layout (`set_fused_swiglu`, opt-in).
    `verify` (Orbax folders): check the checksums of the files read (see load_orbax_checkpoint).
    """
    if is_orbax_checkpoint(directory):
        model, report = load_orbax_checkpoint(directory, dtype=dtype, start_layer=start_layer, end_layer=end_layer,
                                              placement=placement, verify=verify, cfg=cfg)
    else:
        model, report = load_hf_checkpoint(directory, cfg=cfg, dtype=dtype, start_layer=start_layer,
                                           end_layer=end_layer, placement=placement)
    return (set_fused_swiglu(model, True, donate=True) if fused_swiglu else model), report


def stored_dtypes(directory: str | Path) -> dict[str, int]:
    """{dtype name: number of text-model tensors stored in it} of an HF or jax_dwdp Orbax folder (headers only)."""
    if is_orbax_checkpoint(directory):
        marker = read_marker(Path(directory))
        return marker.get("dtypes") or {marker["dtype"]: marker["tensors"]}  # before per-tensor dtypes: one
    counts: dict[str, int] = {}
    names = NAMINGS[type(load_config(directory))].names  # the family's name map
    with SafetensorsCheckpoint(directory) as ckpt:
        for name in ckpt.names():
            target = names.classify(name, 0, 0)
            if target is not None and target.kind != "non_text":
                dtype = DTYPES[ckpt.info(name).dtype].name
                counts[dtype] = counts.get(dtype, 0) + 1
    return counts


def precision_notice(directory: str | Path, dtype) -> str | None:
    """A sentence when tensors are stored narrower than `dtype` (a bfloat16 checkpoint run in float32): the run
    computes in dtype, but the weights keep the precision they are stored in. None otherwise."""
    want = jnp.dtype(dtype)
    narrow = {name: n for name, n in stored_dtypes(directory).items() if jnp.dtype(name).itemsize < want.itemsize}
    if not narrow:
        return None
    stored = ", ".join(f"{n} tensors in {name}" for name, n in sorted(narrow.items()))
    return f"{directory} stores {stored}; the model runs in {want.name}, but these weights keep their stored precision"

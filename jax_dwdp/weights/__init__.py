"""Checkpoints: HF safetensors (read lazily) and jax_dwdp's Orbax format (per-layer items)."""

from __future__ import annotations

from pathlib import Path


def load_checkpoint(directory: str | Path, *, cfg=None, dtype, start_layer: int = 0, end_layer: int | None = None,
                    placement=None):
    """Loads layers [start_layer, end_layer) from an HF folder or a jax_dwdp Orbax folder: (model, LoadReport)."""
    from jax_dwdp.weights.orbax_store import is_orbax_checkpoint, load_orbax_checkpoint

    if is_orbax_checkpoint(directory):
        return load_orbax_checkpoint(directory, dtype=dtype, start_layer=start_layer, end_layer=end_layer,
                                     placement=placement)
    from jax_dwdp.weights.hf_loader import load_hf_checkpoint

    return load_hf_checkpoint(directory, cfg=cfg, dtype=dtype, start_layer=start_layer, end_layer=end_layer,
                              placement=placement)

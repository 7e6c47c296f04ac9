"""Checkpoints: HF safetensors (read lazily) and jax_dwdp's Orbax format (per-layer items)."""

from __future__ import annotations

from pathlib import Path


def load_checkpoint(directory: str | Path, *, cfg=None, dtype, start_layer: int = 0, end_layer: int | None = None,
                    placement=None, fused_swiglu: bool = False):
    """Loads layers [start_layer, end_layer) from an HF folder or a jax_dwdp Orbax folder: (model, LoadReport).

    `fused_swiglu` then puts the expert gate_up weights in the fused-SwiGLU layout (`set_fused_swiglu`, opt-in).
    """
    from jax_dwdp.model.moe import set_fused_swiglu
    from jax_dwdp.weights.orbax_store import is_orbax_checkpoint, load_orbax_checkpoint

    if is_orbax_checkpoint(directory):
        model, report = load_orbax_checkpoint(directory, dtype=dtype, start_layer=start_layer, end_layer=end_layer,
                                              placement=placement)
    else:
        from jax_dwdp.weights.hf_loader import load_hf_checkpoint

        model, report = load_hf_checkpoint(directory, cfg=cfg, dtype=dtype, start_layer=start_layer,
                                           end_layer=end_layer, placement=placement)
    return (set_fused_swiglu(model, True, donate=True) if fused_swiglu else model), report

"""The map between Hugging Face Nemotron-H tensor names and jax_dwdp parameter paths.

jax_dwdp's Nemotron-H module tree mirrors transformers', so a name maps to a path by dropping the prefix and shifting
the layer index by the range's start_layer:
    backbone.layers.7.mixer.experts.up_proj  ->  ('layers', 7 - start_layer, 'mixer', 'experts', 'up_proj')
Accepted prefixes: `backbone.` (NVIDIA's released checkpoints) and `model.` (what transformers 5.17 renames it to).
Per-expert tensors (`mixer.experts.{e}.{up_proj,down_proj}.weight`, the released layout) are pieces of the fused
[E, ...] expert tensors. The multi-token-prediction head (`mtp.*`) is not part of the text model.
"""

from __future__ import annotations

from jax_dwdp.weights.hf_names import NameScheme

TEXT_PREFIXES = ("backbone.", "model.")
NON_TEXT_PREFIXES = ("mtp.", "backbone.mtp.", "model.mtp.")

NEMOTRON_H_NAMES = NameScheme(
    TEXT_PREFIXES, NON_TEXT_PREFIXES, top_level=("embeddings.weight", "norm_f.weight"), experts=("mixer", "experts"),
    fused={"up_proj": "up_proj", "down_proj": "down_proj"})
classify = NEMOTRON_H_NAMES.classify
hf_name = NEMOTRON_H_NAMES.hf_name

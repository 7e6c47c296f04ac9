"""The map between Hugging Face Nemotron-H tensor names and jax_dwdp parameter paths.

jax_dwdp's Nemotron-H module tree mirrors transformers', so a name maps to a path by dropping the prefix and shifting
the layer index by the range's start_layer:
    backbone.layers.7.mixer.experts.up_proj  ->  ('layers', 7 - start_layer, 'mixer', 'experts', 'up_proj')
Accepted prefixes: `backbone.` (NVIDIA's released checkpoints) and `model.` (what transformers 5.17 renames it to).
Per-expert tensors (`mixer.experts.{e}.{up_proj,down_proj}.weight`, the released layout) are pieces of the fused
[E, ...] expert tensors. The multi-token-prediction head (`mtp.*`) is not part of the text model.
"""

from __future__ import annotations

import re

from jax_dwdp.weights.hf_names import Path, Target

TEXT_PREFIXES = ("backbone.", "model.")
NON_TEXT_PREFIXES = ("mtp.", "backbone.mtp.", "model.mtp.")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_PER_EXPERT = re.compile(r"^mixer\.experts\.(\d+)\.(up_proj|down_proj)\.weight$")
_TOP_LEVEL = ("embeddings.weight", "norm_f.weight")


def classify(name: str, start_layer: int, end_layer: int) -> Target | None:
    """Maps a checkpoint tensor name to its target; None for a name the text model does not know."""
    if name.startswith(NON_TEXT_PREFIXES):
        return Target("non_text")
    if name == "lm_head.weight":
        return Target("param", ("lm_head", "weight"))
    for prefix in TEXT_PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            break
    else:
        return None
    m = _LAYER.match(rest)
    if m is None:
        return Target("param", tuple(rest.split("."))) if rest in _TOP_LEVEL else None
    layer, tail = int(m.group(1)), m.group(2)
    if not start_layer <= layer < end_layer:
        return Target("other_layer", layer=layer)
    local = layer - start_layer
    pe = _PER_EXPERT.match(tail)
    if pe is not None:
        part = pe.group(2)
        return Target("expert_piece", ("layers", local, "mixer", "experts", part), layer, int(pe.group(1)), part)
    return Target("param", ("layers", local, *tail.split(".")), layer)


def hf_name(path: Path, start_layer: int, prefix: str = "backbone.") -> str:
    """The HF name of a jax_dwdp parameter path (inverse of `classify` for fused tensors)."""
    if path == ("lm_head", "weight"):
        return "lm_head.weight"
    if path[0] == "layers":
        return prefix + ".".join(["layers", str(int(path[1]) + start_layer), *map(str, path[2:])])
    return prefix + ".".join(map(str, path))

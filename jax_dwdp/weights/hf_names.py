"""The map between Hugging Face Qwen3.5-MoE tensor names and jax_dwdp parameter paths.

jax_dwdp's module tree mirrors the HF text model, so a name maps to a path by dropping the prefix and shifting the
layer index by the range's start_layer:
    model.language_model.layers.7.mlp.experts.gate_up_proj  ->  ('layers', 7 - start_layer, 'mlp', 'experts', 'gate_up_proj')
Accepted prefixes: `model.language_model.` (released vision-language checkpoints) and `model.` (text-only exports).
Per-expert exports (`mlp.experts.{e}.{gate,up,down}_proj.weight`) are pieces of the fused expert tensors.
"""

from __future__ import annotations

import dataclasses
import re

TEXT_PREFIXES = ("model.language_model.", "model.")
NON_TEXT_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_PER_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

Path = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes. `expert`/`part` are set for per-expert pieces of a fused tensor."""

    kind: str  # "param", "expert_piece", "other_layer", "non_text"
    path: Path = ()
    layer: int | None = None
    expert: int | None = None
    part: str | None = None  # gate_proj | up_proj | down_proj


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
        if rest in ("embed_tokens.weight", "norm.weight"):
            return Target("param", tuple(rest.split(".")))
        return None
    layer, tail = int(m.group(1)), m.group(2)
    if not start_layer <= layer < end_layer:
        return Target("other_layer", layer=layer)
    local = layer - start_layer
    pe = _PER_EXPERT.match(tail)
    if pe is not None:
        fused = "down_proj" if pe.group(2) == "down_proj" else "gate_up_proj"
        return Target("expert_piece", ("layers", local, "mlp", "experts", fused), layer, int(pe.group(1)), pe.group(2))
    return Target("param", ("layers", local, *tail.split(".")), layer)


def hf_name(path: Path, start_layer: int, prefix: str = "model.language_model.") -> str:
    """The HF name of a jax_dwdp parameter path (inverse of `classify` for fused tensors)."""
    if path == ("lm_head", "weight"):
        return "lm_head.weight"
    if path[0] == "layers":
        return prefix + ".".join(["layers", str(int(path[1]) + start_layer), *map(str, path[2:])])
    return prefix + ".".join(map(str, path))

"""The map between Hugging Face Qwen3.5-MoE tensor names and jax_dwdp parameter paths, and the `NameScheme` both
families' maps are.

jax_dwdp's module tree mirrors the HF text model, so a name maps to a path by dropping the prefix and shifting the
layer index by the range's start_layer:
    model.language_model.layers.7.mlp.experts.gate_up_proj  ->  ('layers', 7 - start_layer, 'mlp', 'experts', 'gate_up_proj')
Accepted prefixes: `model.language_model.` (released vision-language checkpoints) and `model.` (text-only exports).
Per-expert exports (`mlp.experts.{e}.{gate,up,down}_proj.weight`) are pieces of the fused expert tensors.
"""

from __future__ import annotations

import dataclasses
import functools
import re

TEXT_PREFIXES = ("model.language_model.", "model.")
NON_TEXT_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")

Path = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes. `expert`/`part` are set for per-expert pieces of a fused tensor."""

    kind: str  # "param", "expert_piece", "other_layer", "non_text"
    path: Path = ()
    layer: int | None = None
    expert: int | None = None
    part: str | None = None  # gate_proj | up_proj | down_proj


@dataclasses.dataclass(frozen=True)
class NameScheme:
    """How one family's checkpoints name its text model's tensors: each family's module of names is one of these
    (its `classify` and `hf_name`), since the families' module trees mirror their checkpoints the same way."""

    text_prefixes: tuple[str, ...]  # a text-model tensor's name starts with one of these, the first to write
    non_text_prefixes: tuple[str, ...]  # tensors of other models in the checkpoint (vision, multi-token prediction)
    top_level: tuple[str, ...]  # the names (after the prefix) of the parameters outside the layers, but lm_head
    experts: tuple[str, str]  # where a layer's fused expert tensors sit
    fused: dict[str, str]  # per-expert part (gate_proj, up_proj, down_proj) -> the fused tensor it is a piece of

    @functools.cached_property
    def _per_expert(self) -> re.Pattern:
        """A layer's per-expert tensor (after `layers.N.`): groups expert, part."""
        return re.compile(rf"^{re.escape('.'.join(self.experts))}\.(\d+)\.({'|'.join(self.fused)})\.weight$")

    def classify(self, name: str, start_layer: int, end_layer: int) -> Target | None:
        """Maps a checkpoint tensor name to its target; None for a name the text model does not know."""
        if name.startswith(self.non_text_prefixes):
            return Target("non_text")
        if name == "lm_head.weight":
            return Target("param", ("lm_head", "weight"))
        rest = next((name[len(p):] for p in self.text_prefixes if name.startswith(p)), None)
        if rest is None:
            return None
        m = _LAYER.match(rest)
        if m is None:
            return Target("param", tuple(rest.split("."))) if rest in self.top_level else None
        layer, tail = int(m.group(1)), m.group(2)
        if not start_layer <= layer < end_layer:
            return Target("other_layer", layer=layer)
        local = layer - start_layer
        pe = self._per_expert.match(tail)
        if pe is not None:
            part = pe.group(2)
            fused = ("layers", local, *self.experts, self.fused[part])
            return Target("expert_piece", fused, layer, int(pe.group(1)), part)
        return Target("param", ("layers", local, *tail.split(".")), layer)

    def hf_name(self, path: Path, start_layer: int, prefix: str | None = None) -> str:
        """The HF name of a jax_dwdp parameter path (inverse of `classify` for fused tensors); `prefix` defaults to
        the first of the text prefixes."""
        prefix = self.text_prefixes[0] if prefix is None else prefix
        if path == ("lm_head", "weight"):
            return "lm_head.weight"
        if path[0] == "layers":
            return prefix + ".".join(["layers", str(int(path[1]) + start_layer), *map(str, path[2:])])
        return prefix + ".".join(map(str, path))


QWEN35_NAMES = NameScheme(
    TEXT_PREFIXES, NON_TEXT_PREFIXES, top_level=("embed_tokens.weight", "norm.weight"), experts=("mlp", "experts"),
    fused={"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"})
classify = QWEN35_NAMES.classify
hf_name = QWEN35_NAMES.hf_name

"""Loading Hugging Face safetensors checkpoints (Qwen3.5-MoE, Nemotron-H) into jax_dwdp models, one tensor at a time.

Tensors are read lazily from memory-mapped files, converted and placed on the device one by one, so host memory
peaks near the largest tensor (a fused expert tensor when per-expert pieces are assembled), not the model.
A loader for a layer range never reads the tensors of other layers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dwdp.config import ModelConfig
from jax_dwdp.devices import put
from jax_dwdp.families import config_from_json_file
from jax_dwdp.model import NemotronHForCausalLM, Qwen35MoeForCausalLM, abstract_model
from jax_dwdp.nemotron_h_config import NemotronHConfig
from jax_dwdp.progress import layers
from jax_dwdp.weights import hf_names, nemotron_h_names
from jax_dwdp.weights.safetensors_reader import CheckpointError, SafetensorsCheckpoint, orbax_without_marker

log = logging.getLogger(__name__)

# Decides where a parameter lives: (path, shape, dtype) -> a jax Sharding. Default: the first device.
Placement = Callable[[hf_names.Path, tuple[int, ...], np.dtype], jax.sharding.Sharding]


@dataclasses.dataclass
class LoadReport:
    tensors_loaded: int = 0
    skipped_non_text: int = 0
    skipped_other_layers: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    # Loaded tensors whose dtype was changed while loading: {"float32->bfloat16": count}. Counted per tensor of the
    # model (as tensors_loaded), not per source tensor: a fused expert tensor assembled from 2 x num_experts
    # per-expert pieces counts once.
    cast: dict[str, int] = dataclasses.field(default_factory=dict)

    def count_cast(self, source: np.dtype | str, target: np.dtype) -> None:
        """source: a dtype, or the name of the source dtypes of an assembled tensor ("bfloat16+float32")."""
        name = source if isinstance(source, str) else np.dtype(source).name
        if name != np.dtype(target).name:
            key = f"{name}->{np.dtype(target).name}"
            self.cast[key] = self.cast.get(key, 0) + 1

    def line(self) -> str:
        return (
            f"loaded {self.tensors_loaded} tensors ({self.bytes_read / 1e9:.3f} GB) in {self.seconds:.2f} s; "
            f"skipped {self.skipped_non_text} vision/MTP tensors and {self.skipped_other_layers} tensors of "
            f"layers outside the range; {cast_line(self.cast)}"
        )


def cast_line(cast: dict[str, int]) -> str:
    """What a load or conversion did to the checkpoint's dtypes, in words."""
    if not cast:
        return "every tensor kept its dtype"
    return "cast " + ", ".join(f"{n} tensors {key.replace('->', ' to ')}" for key, n in sorted(cast.items()))


def load_config(checkpoint_dir: str | Path) -> ModelConfig | NemotronHConfig:
    """The config of an HF or jax_dwdp Orbax checkpoint folder, of the family its model_type names (Qwen3.5-MoE:
    `ModelConfig`, Nemotron-H: `NemotronHConfig`)."""
    return config_from_json_file(_config_path(checkpoint_dir))


def _config_path(checkpoint_dir: str | Path) -> Path:
    path = Path(checkpoint_dir) / "config.json"
    if not os.path.lexists(path):  # a copy of a conversion's items, made before it wrote its config and marker
        orbax = orbax_without_marker(Path(checkpoint_dir))
        if orbax is not None:
            raise CheckpointError(orbax)
    return path


@dataclasses.dataclass(frozen=True)
class Naming:
    """How one family's checkpoints name its tensors; the loader is the same for every family."""

    family: str
    names: object  # the module mapping names to paths: classify, hf_name, TEXT_PREFIXES
    embedding: hf_names.Path
    final_norm: hf_names.Path


NAMINGS = {
    ModelConfig: Naming("Qwen3.5-MoE", hf_names, ("embed_tokens", "weight"), ("norm", "weight")),
    NemotronHConfig: Naming("Nemotron-H", nemotron_h_names, ("embeddings", "weight"), ("norm_f", "weight")),
}


def _convert(array: np.ndarray, dtype: np.dtype | None, name: str, file: Path,
             report: LoadReport | None) -> np.ndarray:
    """The tensor in `dtype` (None: its own), counted in report.cast when that changes it (report None: not
    counted; an expert piece is counted with its assembled tensor)."""
    if not (np.issubdtype(array.dtype, np.floating) or array.dtype == jnp.bfloat16):
        raise CheckpointError(f"{file}: tensor {name} has dtype {array.dtype}; expected a floating-point tensor")
    target = array.dtype if dtype is None else np.dtype(dtype)
    if report is not None:
        report.count_cast(array.dtype, target)
    return array.astype(target, copy=False)


def _parts(fused: hf_names.Path) -> tuple[str, ...]:
    """The per-expert pieces of a fused expert tensor, in its row order: Qwen3.5's gate_up_proj stacks gate_proj
    over up_proj; every other fused tensor (down_proj, Nemotron-H's up_proj) is one piece per expert."""
    return ("gate_proj", "up_proj") if fused[-1] == "gate_up_proj" else (fused[-1],)


class _ExpertAssembler:
    """Builds fused expert tensors [E, rows, cols] from per-expert pieces; host memory: one fused tensor per open
    layer."""

    def __init__(self, report: LoadReport):
        self.report = report
        self.num_experts: dict[hf_names.Path, int] = {}
        self.buffers: dict[hf_names.Path, np.ndarray] = {}
        self.seen: dict[hf_names.Path, set[tuple[int, str]]] = {}
        self.sources: dict[hf_names.Path, set[str]] = {}  # the pieces' dtypes, for report.cast

    def add(self, target: hf_names.Target, piece: np.ndarray, shape, dtype, name: str, file: Path):
        """dtype None: the first piece's dtype (pieces of another dtype are cast to it, and counted)."""
        parts = _parts(target.path)
        rows = shape[1] // len(parts)
        expected = (rows, shape[2])
        if tuple(piece.shape) != expected:
            raise CheckpointError(f"{file}: tensor {name} has shape {tuple(piece.shape)}; expected {expected}")
        if not 0 <= target.expert < shape[0]:
            raise CheckpointError(f"{file}: tensor {name} names expert {target.expert}; the model has {shape[0]}")
        buf = self.buffers.get(target.path)
        if buf is None:
            buf = self.buffers[target.path] = np.empty(shape, piece.dtype if dtype is None else dtype)
            self.seen[target.path] = set()
            self.sources[target.path] = set()
            self.num_experts[target.path] = shape[0]
        j = parts.index(target.part)
        buf[target.expert, j * rows:(j + 1) * rows] = _convert(piece, buf.dtype, name, file, None)
        self.seen[target.path].add((target.expert, target.part))
        self.sources[target.path].add(np.dtype(piece.dtype).name)
        if len(self.seen[target.path]) == shape[0] * len(parts):
            del self.seen[target.path]
            del self.num_experts[target.path]
            # One assembled tensor, counted once: under its pieces' dtype, or all of them ("bfloat16+float32")
            # when they differ.
            self.report.count_cast("+".join(sorted(self.sources.pop(target.path))), buf.dtype)
            return self.buffers.pop(target.path)
        return None

    def missing(self, start_layer: int, prefix: str) -> str | None:
        for path, seen in self.seen.items():
            for e in range(self.num_experts[path]):
                for p in _parts(path):
                    if (e, p) not in seen:
                        layer = int(path[1]) + start_layer
                        return f"{prefix}layers.{layer}.{path[2]}.experts.{e}.{p}.weight"
        return None


class _NameIndex:
    """A checkpoint's tensor names grouped by layer, built once per open checkpoint, so that loading a layer range
    from a checkpoint kept open across many ranges (conversion) visits only that range's names."""

    def __init__(self, ckpt: SafetensorsCheckpoint, names):
        self.by_layer: dict[int, list[str]] = {}
        self.rest: list[str] = []  # embedding, norm, head, vision/MTP and unknown names
        # The text-model prefix this checkpoint uses, so that a missing tensor is named as the checkpoint names it.
        self.prefix = next((p for p in names.TEXT_PREFIXES if any(n.startswith(p + "layers.") for n in ckpt.names())),
                           names.TEXT_PREFIXES[0])
        for name in ckpt.names():
            target = names.classify(name, 0, 0)  # an empty range: every layer tensor is "other_layer"
            if target is not None and target.kind == "other_layer":
                self.by_layer.setdefault(target.layer, []).append(name)
            else:
                self.rest.append(name)

    def select(self, start_layer: int, end_layer: int) -> tuple[list[str], list[int]]:
        """(names to visit, sorted; the layers outside the range that have tensors)."""
        inside = list(self.rest)
        outside = []
        for layer, names in self.by_layer.items():
            if start_layer <= layer < end_layer:
                inside.extend(names)
            else:
                outside.append(layer)
        return sorted(inside), outside


_INDEXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _name_index(ckpt: SafetensorsCheckpoint, names=hf_names) -> _NameIndex:
    indexes = _INDEXES.setdefault(ckpt, {})
    if names.__name__ not in indexes:
        indexes[names.__name__] = _NameIndex(ckpt, names)
    return indexes[names.__name__]


def load_hf_checkpoint(
    checkpoint_dir: str | Path | SafetensorsCheckpoint,
    *,
    cfg: ModelConfig | NemotronHConfig | None = None,
    dtype=jnp.bfloat16,
    start_layer: int = 0,
    end_layer: int | None = None,
    placement: Placement | None = None,
) -> tuple[Qwen35MoeForCausalLM | NemotronHForCausalLM, LoadReport]:
    """Loads layers [start_layer, end_layer) (and the embedding / head when the range has them), of the family that
    the checkpoint's config.json (or `cfg`) names.

    `checkpoint_dir` is a folder, or an already open SafetensorsCheckpoint (headers parsed once) that a caller
    loading many ranges keeps open; it is left open, with its mappings dropped so that mapped pages do not pile up.
    dtype None keeps each tensor's own dtype (what conversion does by default); otherwise every tensor is cast to
    dtype (A_log stays float32) and report.cast counts the tensors that changed.
    Raises CheckpointError naming the file, the tensor and the expected shape for a missing, unexpected or
    mis-shaped tensor.
    """
    t0 = time.perf_counter()
    if isinstance(checkpoint_dir, SafetensorsCheckpoint):
        opened, checkpoint_dir = checkpoint_dir, checkpoint_dir.directory
    else:
        opened, checkpoint_dir = None, Path(checkpoint_dir)
    stored = (load_config(checkpoint_dir) if cfg is None or (Path(checkpoint_dir) / "config.json").is_file()
              else cfg)
    cfg = cfg or stored
    if type(stored) is not type(cfg):
        raise CheckpointError(f"{checkpoint_dir}: a {NAMINGS[type(stored)].family} checkpoint, not a "
                              f"{NAMINGS[type(cfg)].family} model")
    naming = NAMINGS[type(cfg)]
    # A config of the checkpoint's first layers (--num-layers) loads those; the others are skipped, not unexpected.
    stored_layers = stored.num_hidden_layers if cfg.cuts(stored) else cfg.num_hidden_layers
    end_layer = cfg.num_hidden_layers if end_layer is None else end_layer
    keep = dtype is None
    dtype = jnp.dtype(jnp.float32 if keep else dtype)  # with keep, the abstract model gives only the shapes
    model = abstract_model(cfg, dtype=dtype, start_layer=start_layer, end_layer=end_layer)
    graphdef, abstract = nnx.split(model)
    expected = {path: var for path, var in nnx.to_flat_state(abstract)}
    if placement is None:
        device = jax.devices()[0]
        placement = lambda path, shape, dt: jax.sharding.SingleDeviceSharding(device)  # noqa: E731
    loaded: dict[hf_names.Path, jax.Array] = {}
    report = LoadReport()
    assembler = _ExpertAssembler(report)

    def place(path, array: np.ndarray, name: str, file: Path, assembled: bool = False):
        var = expected[path]
        if tuple(array.shape) != tuple(var.shape):
            raise CheckpointError(
                f"{file}: tensor {name} has shape {tuple(array.shape)}; expected {tuple(var.shape)}"
            )
        if path in loaded:
            raise CheckpointError(f"{file}: tensor {name} is given twice (as fused and per-expert tensors?)")
        # An assembled expert tensor was counted in report.cast by the assembler (once, not per piece).
        host = _convert(array, None if keep else var.dtype, name, file, None if assembled else report)
        loaded[path] = put(host, placement(path, tuple(var.shape), host.dtype))
        report.tensors_loaded += 1

    ckpt = opened if opened is not None else SafetensorsCheckpoint(checkpoint_dir)
    bytes_before = ckpt.bytes_read
    try:
        index = _name_index(ckpt, naming.names)
        inside, outside = index.select(start_layer, end_layer)
        # A missing tensor is reported against the file when there is one, else against the folder.
        where = ckpt.files[0] if len(ckpt.files) == 1 else checkpoint_dir
        beyond = [layer for layer in outside if layer >= stored_layers]
        if beyond:  # named by its first tensor in name order
            name, layer = min((n, layer) for layer in beyond for n in index.by_layer[layer])
            raise CheckpointError(
                f"{ckpt.info(name).file}: tensor {name} belongs to layer {layer}, but the config has "
                f"{cfg.num_hidden_layers} layers"
            )
        report.skipped_other_layers += sum(len(index.by_layer[layer]) for layer in outside)
        read_so_far = ckpt.bytes_read
        with layers(f"loading {Path(checkpoint_dir).name}", len(inside), unit="tensors") as bar:
            for name in inside:
                info = ckpt.info(name)
                target = naming.names.classify(name, start_layer, end_layer)
                if target is None:
                    raise CheckpointError(f"{info.file}: unexpected tensor {name} (not part of the {naming.family} "
                                          "text model)")
                if target.kind == "non_text":
                    report.skipped_non_text += 1
                elif target.kind == "expert_piece":
                    var = expected.get(target.path)
                    if var is None:
                        raise CheckpointError(f"{info.file}: unexpected tensor {name}")
                    fused = assembler.add(target, ckpt.read(name), tuple(var.shape), None if keep else var.dtype,
                                          name, info.file)
                    if fused is not None:
                        place(target.path, fused, name, info.file, assembled=True)
                else:
                    path = target.path
                    if path == naming.embedding and cfg.tie_word_embeddings and ("lm_head", "weight") in expected:
                        place(("lm_head", "weight"), ckpt.read(name), name, info.file)
                    if path not in expected:
                        if path in (naming.embedding, naming.final_norm, ("lm_head", "weight")):
                            report.skipped_other_layers += 1  # belongs to another pipeline stage
                            bar.advance()
                            continue
                        raise CheckpointError(
                            f"{info.file}: unexpected tensor {name} (no parameter {'.'.join(map(str, path))} in "
                            f"layer type {cfg.layer_types[target.layer] if target.layer is not None else 'model'})"
                        )
                    place(path, ckpt.read(name), name, info.file)
                bar.advance(ckpt.bytes_read - read_so_far)
                read_so_far = ckpt.bytes_read
        report.bytes_read = ckpt.bytes_read - bytes_before
        missing_piece = assembler.missing(start_layer, index.prefix)
        if missing_piece is not None:
            raise CheckpointError(f"{where}: missing tensor {missing_piece}")
    finally:
        if opened is None:
            ckpt.close()
        else:
            ckpt.unmap()
    for path, var in expected.items():
        if path not in loaded:
            raise CheckpointError(
                f"{where}: missing tensor {naming.names.hf_name(path, start_layer, index.prefix)} "
                f"(expected shape {tuple(var.shape)})"
            )
    state = nnx.from_flat_state([(path, type(var)(loaded[path])) for path, var in expected.items()])
    report.seconds = time.perf_counter() - t0
    log.info("%s", report.line())
    return nnx.merge(graphdef, state), report

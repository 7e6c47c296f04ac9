"""The Qwen3.5-MoE text-model configuration: one frozen dataclass, from HF config.json or a preset."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
_LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)
_TEXT_MODEL_TYPES = ("qwen3_5_moe_text",)
_VL_MODEL_TYPES = ("qwen3_5_moe",)
# Keys of an HF config that set the model's shapes: a missing one is an error naming it, not a silent 35B-A3B
# default. The others default as in transformers (rms_norm_eps, rope_theta, partial_rotary_factor,
# tie_word_embeddings, full_attention_interval / layer_types).
REQUIRED_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
    "shared_expert_intermediate_size",
)


class ConfigError(ValueError):
    """A model configuration that jax_dwdp cannot run; the message names the field."""


def json_error(e: json.JSONDecodeError) -> str:
    """Where and what: "line 15, column 3: Invalid control character". json's own messages for some errors end in
    "at" or "starting at" (they expect a position to follow), which is cut here."""
    msg = e.msg.removesuffix(" at").removesuffix(" starting")
    return f"line {e.lineno}, column {e.colno}: {msg}"


def read_json_file(path: str | Path, error: type[ValueError] | None = None) -> Any:
    """The parsed contents of a UTF-8 JSON file, or `error` (default ConfigError) with one line naming the file and
    the problem: missing, a folder, unreadable, not UTF-8, not JSON."""
    path, error = Path(path), error or ConfigError
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a folder, expected a JSON file") from None
    except OSError as e:
        raise error(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); expected UTF-8 "
                    "JSON") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({json_error(e)})") from None
    except RecursionError:
        raise error(f"{path}: not valid JSON (nested too deeply)") from None


class LayerPatternConfig:
    """What both families' configs (frozen dataclasses with `layer_types` and `num_hidden_layers`) share: the ids of
    their layers of a kind, their presets (`presets`, the family's table, set where it is defined; `family`, its
    name in messages), the model cut to its first layers, and reading the HF config.json."""

    presets: dict = {}
    family = ""

    def layer_ids(self, kind: str, start_layer: int = 0, end_layer: int | None = None) -> tuple[int, ...]:
        """Global ids of the layers of one kind inside [start_layer, end_layer)."""
        end = self.num_hidden_layers if end_layer is None else end_layer
        return tuple(i for i in range(start_layer, end) if self.layer_types[i] == kind)

    @classmethod
    def preset(cls, name: str):
        try:
            return cls.presets[name]
        except KeyError:
            raise ConfigError(f"unknown {cls.family}preset {name!r}; choose one of {sorted(cls.presets)}") from None

    @classmethod
    def from_json_file(cls, path: str | Path):
        return cls.from_hf_dict(read_json_file(path), source=str(path))

    def first_layers(self, n: int):
        """This model cut to its first n layers (their types kept): a quick experiment on a big checkpoint."""
        if not 1 <= n <= self.num_hidden_layers:
            raise ConfigError(f"the first {n} layers: choose 1 to {self.num_hidden_layers}")
        count = {"num_hidden_layers": n} if "num_hidden_layers" in {f.name for f in dataclasses.fields(self)} else {}
        return dataclasses.replace(self, layer_types=self.layer_types[:n], **count)

    def cuts(self, stored) -> bool:
        """This config is `stored` (a checkpoint's) cut to fewer layers: a loader skips the others."""
        return self.num_hidden_layers < stored.num_hidden_layers and stored.first_layers(self.num_hidden_layers) == self


@dataclasses.dataclass(frozen=True)
class ModelConfig(LayerPatternConfig):
    """Every number the Qwen3.5-MoE text model needs (see shared/docs/qwen35_moe_spec.md)."""

    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    layer_types: tuple[str, ...] = ()
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    num_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    full_attention_interval: int = 4

    def __post_init__(self) -> None:
        if not self.layer_types:
            types = tuple(
                FULL_ATTENTION if (i + 1) % self.full_attention_interval == 0 else LINEAR_ATTENTION
                for i in range(self.num_hidden_layers)
            )
            object.__setattr__(self, "layer_types", types)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    # ---- checks -------------------------------------------------------------------------
    def validate(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        for i, t in enumerate(self.layer_types):
            if t not in _LAYER_TYPES:
                raise ConfigError(f"layer_types[{i}] is {t!r}; expected one of {_LAYER_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) is not a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
            )
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ConfigError(
                f"head_dim * partial_rotary_factor = {self.head_dim} * {self.partial_rotary_factor} "
                "must give a positive even rotary dimension"
            )

    # ---- derived sizes ------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: [q | k | v] of the Gated DeltaNet."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """A linear-attention layer's conv state per sequence: [conv channels, K-1]."""
        return self.conv_dim, self.linear_conv_kernel_dim - 1

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """A linear-attention layer's fp32 recurrent state per sequence: [HV, dk, dv]."""
        return self.linear_num_value_heads, self.linear_key_head_dim, self.linear_value_head_dim

    @property
    def expert_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """One routed expert's two weights: gate_up_proj [2I, H], down_proj [H, I]."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return (2 * i, h), (h, i)

    def moe_layer_ids(self, start_layer: int = 0, end_layer: int | None = None) -> tuple[int, ...]:
        """Global ids of the layers with routed experts inside [start_layer, end_layer): every Qwen3.5 layer."""
        return tuple(range(start_layer, self.num_hidden_layers if end_layer is None else end_layer))

    def scan_period(self, start_layer: int = 0, end_layer: int | None = None) -> int:
        """How many layers one block of a scanned stack of [start_layer, end_layer) holds (jax_dwdp.scan): the
        pattern's period, full_attention_interval."""
        return self.full_attention_interval

    def param_counts(self) -> dict[str, int]:
        """Parameter counts of the text model: total and activated per token."""
        h, e, i = self.hidden_size, self.num_experts, self.moe_intermediate_size
        attn = h * self.num_attention_heads * self.head_dim * 2 + 2 * h * self.num_key_value_heads * self.head_dim
        attn += self.num_attention_heads * self.head_dim * h + 2 * self.head_dim
        gdn = h * (self.conv_dim + self.linear_value_dim + 2 * self.linear_num_value_heads)
        gdn += self.conv_dim * self.linear_conv_kernel_dim + self.linear_value_dim * h
        gdn += 2 * self.linear_num_value_heads + self.linear_value_head_dim
        shared = 3 * h * self.shared_expert_intermediate_size + h
        expert = 3 * h * i
        per_layer_dense = 2 * h + e * h + shared
        n_full = len(self.layer_ids(FULL_ATTENTION))
        n_lin = self.num_hidden_layers - n_full
        dense = n_full * attn + n_lin * gdn + self.num_hidden_layers * per_layer_dense
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        total = dense + embed + self.num_hidden_layers * e * expert
        active = dense + embed + self.num_hidden_layers * self.num_experts_per_tok * expert
        return {"total": total, "active": active}

    def prefill_flops(self, batch: int, seq_len: int, logits_positions: int) -> float:
        """Forward FLOPs of a causal prefill (matmuls + attention), for MFU.

        lm_head is counted only for the positions whose logits are computed (1 per sequence for "last").
        """
        counts = self.param_counts()
        head = self.vocab_size * self.hidden_size
        embed = self.vocab_size * self.hidden_size
        layer_params = counts["active"] - head - embed  # the embedding is a lookup, not a matmul
        n_full = len(self.layer_ids(FULL_ATTENTION))
        # QK^T and PV over the average causal context seq_len / 2.
        attn_per_token = n_full * 2 * 2 * self.num_attention_heads * self.head_dim * (seq_len / 2)
        return batch * seq_len * (2.0 * layer_params + attn_per_token) + 2.0 * head * logits_positions

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Builds the config from an HF config dict: flat text config or the VL form with text_config."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        model_type = raw.get("model_type")
        if model_type in _VL_MODEL_TYPES:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: model_type {model_type!r} needs a text_config object")
            text = dict(text)
            text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
            where = "text_config."
        elif model_type in _TEXT_MODEL_TYPES:
            text, where = raw, ""
        else:
            raise ConfigError(
                f"{source}: unknown model_type {model_type!r}; expected one of "
                f"{_VL_MODEL_TYPES + _TEXT_MODEL_TYPES}"
            )
        missing = [where + key for key in REQUIRED_KEYS if key not in text]
        if missing:
            raise ConfigError(f"{source}: missing {', '.join(missing)} (no safe default: it sets the model's shapes)")
        if text.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act {text['hidden_act']!r} is not supported (only silu)")
        if text.get("attention_bias", False):
            raise ConfigError(f"{source}: attention_bias=True is not supported")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "mrope"):
            raise ConfigError(f"{source}: rope_type {rope_type!r} is not supported")
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in text.items() if k in fields}
        kwargs["rope_theta"] = float(rope.get("rope_theta", text.get("rope_theta", 10000.0)))
        kwargs["partial_rotary_factor"] = float(
            rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        )
        if kwargs.get("layer_types") is not None:
            kwargs["layer_types"] = tuple(kwargs["layer_types"])
        else:
            kwargs.pop("layer_types", None)
        try:
            return cls(**kwargs)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The flat HF text config (model_type qwen3_5_moe_text) that rebuilds this config."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["layer_types"] = list(self.layer_types)
        rope = {
            "rope_type": "default",
            "rope_theta": out.pop("rope_theta"),
            "partial_rotary_factor": out.pop("partial_rotary_factor"),
        }
        out.pop("full_attention_interval")
        out.update(model_type="qwen3_5_moe_text", rope_parameters=rope, hidden_act="silu")
        return out

    def replace(self, **changes: Any) -> "ModelConfig":
        if "num_hidden_layers" in changes and "layer_types" not in changes:
            changes["layer_types"] = ()
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        counts = self.param_counts()
        return (
            f"{self.num_hidden_layers} layers ({len(self.layer_ids(LINEAR_ATTENTION))} linear, "
            f"{len(self.layer_ids(FULL_ATTENTION))} full), hidden {self.hidden_size}, "
            f"{self.num_experts} experts top-{self.num_experts_per_tok}, "
            f"{_count(counts['total'])} params ({_count(counts['active'])} active)"
        )


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


PRESETS: dict[str, ModelConfig] = {
    # A few MB of weights; a CPU prefill takes seconds. Covers every layer type, GQA, value heads = 2 x key heads.
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
    ),
    "35b-a3b": ModelConfig(),
    "122b-a10b": ModelConfig(
        hidden_size=3072, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2,
        linear_num_value_heads=64, moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
    ),
    "397b-a17b": ModelConfig(
        hidden_size=4096, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2,
        linear_num_value_heads=64, num_experts=512, num_experts_per_tok=10,
        moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
    ),
}

ModelConfig.presets = PRESETS

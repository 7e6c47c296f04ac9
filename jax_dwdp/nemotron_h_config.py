"""The Nemotron-H configuration: one frozen dataclass, from HF config.json (model_type nemotron_h) or a preset.

The layer pattern uses transformers 5.17's names, which are also the Qwen3.5 family's cache kinds: a Mamba-2 layer
is a `linear_attention` layer (it leaves a conv and a recurrent state), an attention layer `full_attention` (K and
V); `mlp` and `moe` layers leave nothing. See docs/nemotron_h_spec.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_dwdp.config import FULL_ATTENTION, LINEAR_ATTENTION, ConfigError, LayerPatternConfig

MAMBA = LINEAR_ATTENTION
ATTENTION = FULL_ATTENTION
MLP = "mlp"
MOE = "moe"
LAYER_TYPES = (MAMBA, ATTENTION, MLP, MOE)
MODEL_TYPES = ("nemotron_h",)
# The pattern string of older configs (`hybrid_override_pattern`) and the names transformers < 5.17 wrote.
PATTERN_SYMBOLS = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
LEGACY_NAMES = {"mamba": MAMBA, "attention": ATTENTION}
# Keys that set the model's shapes: a missing one is an error naming it, not a silent 30B-A3B default.
REQUIRED_KEYS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "mamba_num_heads",
    "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel", "n_routed_experts", "num_experts_per_tok",
    "moe_intermediate_size", "moe_shared_expert_intermediate_size",
)
# HF keys whose other spellings older configs use (transformers' NemotronHConfig accepts both).
_ALIASES = {"mamba_n_groups": "n_groups", "mamba_d_conv": "conv_kernel", "mamba_chunk_size": "chunk_size",
            "mamba_dt_min": "time_step_min", "mamba_conv_bias": "use_conv_bias", "norm_eps": "layer_norm_epsilon"}


def parse_pattern(pattern: str) -> tuple[str, ...]:
    """"MEM*E-" -> the layer types it spells; an unknown symbol is an error naming it."""
    bad = sorted(set(pattern) - set(PATTERN_SYMBOLS))
    if bad:
        raise ConfigError(f"hybrid_override_pattern has unknown symbols {bad}; expected {sorted(PATTERN_SYMBOLS)}")
    return tuple(PATTERN_SYMBOLS[c] for c in pattern)


def best_period(layer_types: tuple[str, ...]) -> int:
    """The period p of a scanned stack of these layers: the first p layers repeated as often as they recur from the
    start, the rest unrolled, p chosen for the fewest layers to compile (p + the rest); ties: the shorter. A
    pattern that never repeats gives its own length (one block)."""
    n = len(layer_types)

    def repeats(p: int) -> int:
        blocks = 1
        while (blocks + 1) * p <= n and layer_types[blocks * p:(blocks + 1) * p] == layer_types[:p]:
            blocks += 1
        return blocks

    best = min(range(1, n + 1), key=lambda p: (n - (repeats(p) - 1) * p, p)) if n else 1
    return best if repeats(best) > 1 else max(n, 1)


def pattern_of(layer_types: tuple[str, ...]) -> str:
    symbol = {t: s for s, t in PATTERN_SYMBOLS.items()}
    return "".join(symbol[t] for t in layer_types)


@dataclasses.dataclass(frozen=True)
class NemotronHConfig(LayerPatternConfig):
    """Every number the Nemotron-H text model needs (defaults: Nemotron-3 Nano 30B-A3B)."""

    vocab_size: int = 131072
    hidden_size: int = 2688
    layer_types: tuple[str, ...] = parse_pattern("MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME")
    num_attention_heads: int = 32
    num_key_value_heads: int = 2
    head_dim: int = 128
    intermediate_size: int = 1856
    mamba_num_heads: int = 64
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 128
    time_step_min: float = 0.001
    use_conv_bias: bool = True
    n_routed_experts: int = 128
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 1856
    moe_shared_expert_intermediate_size: int = 3712
    moe_latent_size: int | None = None
    routed_scaling_factor: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    layer_norm_epsilon: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    # ---- checks -------------------------------------------------------------------------
    def validate(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "conv_kernel",
            "chunk_size", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
            "moe_shared_expert_intermediate_size", "n_group", "topk_group",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if self.moe_latent_size is not None and (not isinstance(self.moe_latent_size, int)
                                                 or self.moe_latent_size <= 0):
            raise ConfigError(f"moe_latent_size must be null or a positive integer, got {self.moe_latent_size!r}")
        if not self.layer_types:
            raise ConfigError("layer_types is empty: the model needs at least one layer")
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise ConfigError(f"layer_types[{i}] is {t!r}; expected one of {LAYER_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                              f"num_key_value_heads ({self.num_key_value_heads})")
        if self.mamba_num_heads % self.n_groups:
            raise ConfigError(f"mamba_num_heads ({self.mamba_num_heads}) is not a multiple of n_groups "
                              f"({self.n_groups})")
        if self.n_routed_experts % self.n_group or not self.topk_group <= self.n_group:
            raise ConfigError(f"n_routed_experts ({self.n_routed_experts}) must split into n_group ({self.n_group}) "
                              f"groups, of which topk_group ({self.topk_group}) are kept")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ConfigError("grouped routing scores each group by its two best experts: needs >= 2 per group")
        kept = self.topk_group * (self.n_routed_experts // self.n_group)
        if self.num_experts_per_tok > kept:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the {kept} experts of the "
                              f"kept groups")
        if not self.time_step_min >= 0:
            raise ConfigError(f"time_step_min must be >= 0, got {self.time_step_min!r}")

    # ---- derived sizes ------------------------------------------------------------------
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_intermediate_size(self) -> int:
        """Channels of the SSM's x (heads x head_dim), also of the gate z and of the gated norm."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def mamba_conv_dim(self) -> int:
        """Channels of the depthwise conv: [x | B | C]."""
        return self.mamba_intermediate_size + 2 * self.n_groups * self.ssm_state_size

    @property
    def mamba_in_proj_size(self) -> int:
        """in_proj's output: [z | x B C | dt]."""
        return self.mamba_intermediate_size + self.mamba_conv_dim + self.mamba_num_heads

    @property
    def expert_input_size(self) -> int:
        """The width the routed experts read and write: the latent size when the MoE has a latent projection."""
        return self.moe_latent_size or self.hidden_size

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (the engine's name for n_routed_experts)."""
        return self.n_routed_experts

    @property
    def expert_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """One routed expert's two weights: up_proj [I, D], down_proj [D, I] (D: expert_input_size)."""
        d, i = self.expert_input_size, self.moe_intermediate_size
        return (i, d), (d, i)

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        """A Mamba-2 layer's conv state per sequence: [x | B | C channels, K-1]."""
        return self.mamba_conv_dim, self.conv_kernel - 1

    @property
    def recurrent_state_shape(self) -> tuple[int, int, int]:
        """A Mamba-2 layer's fp32 SSM state per sequence: [heads, head_dim, state size]."""
        return self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size

    def moe_layer_ids(self, start_layer: int = 0, end_layer: int | None = None) -> tuple[int, ...]:
        """Global ids of the layers with routed experts (the MoE layers) inside [start_layer, end_layer)."""
        return self.layer_ids(MOE, start_layer, end_layer)

    def scan_period(self, start_layer: int = 0, end_layer: int | None = None) -> int:
        """How many layers one block of a scanned stack of [start_layer, end_layer) holds (jax_dwdp.scan): the
        `best_period` of the range's own pattern (Nano 30B-A3B: 7, "MEMEM*E" five times, 17 layers after)."""
        end = self.num_hidden_layers if end_layer is None else end_layer
        return best_period(self.layer_types[start_layer:end])

    def prefill_flops(self, batch: int, seq_len: int, logits_positions: int) -> float:
        """Forward FLOPs of a causal prefill of `batch` sequences of `seq_len` tokens, for MFU: every layer's
        `layer_flops` per token, and lm_head only at the positions whose logits are computed (1 per sequence for
        "last"); the embedding is a lookup, not a product."""
        per_token = sum(self.layer_flops(t, seq_len) for t in self.layer_types)
        return batch * seq_len * per_token + 2.0 * self.vocab_size * self.hidden_size * logits_positions

    def layer_flops(self, layer_type: str, seq_len: int) -> float:
        """FLOPs per token (2 per multiply-add) of one layer of `layer_type` in a prefill of `seq_len` tokens: its
        products only (norms, activations, gates, softplus and the routing's top-k are elementwise and left out).

        - Mamba-2: in_proj; the depthwise conv (conv_kernel multiply-adds per channel); the SSD chunked scan; out_proj.
          The scan in chunks of L = chunk_size tokens: inside a chunk C B^T (per group) and its decay-masked product
          with dt x (per head) over the causal half of the chunk, min(L, seq_len) / 2 positions on average, as
          attention's QK^T and PV count seq_len / 2; each chunk's own state (dt x)^T B and the states' read-out
          C . state, one multiply-add per state entry (head_dim x state size per head) and token each. The carry of
          the states across chunks (one multiply-add per state entry per chunk, 1/L of the last two) is left out.
        - attention: the q, k, v, o projections; QK^T and PV over the average causal context seq_len / 2.
        - MLP: up_proj and down_proj.
        - MoE: the router (n_routed_experts x hidden); the top-k routed experts (up and down, at the latent width
          when moe_latent_size is set) and the latent projections in and out; the shared expert.
        """
        h = self.hidden_size
        if layer_type == MAMBA:
            heads, p, n = self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size
            context = min(self.chunk_size, seq_len) / 2
            ssd = context * (self.n_groups * n + heads * p) + 2 * heads * p * n
            macs = h * self.mamba_in_proj_size + self.conv_kernel * self.mamba_conv_dim + ssd
            macs += self.mamba_intermediate_size * h
        elif layer_type == ATTENTION:
            q = self.num_attention_heads * self.head_dim
            macs = h * (q + 2 * self.num_key_value_heads * self.head_dim) + q * h + 2 * q * (seq_len / 2)
        elif layer_type == MLP:
            macs = 2 * h * self.intermediate_size
        elif layer_type == MOE:
            expert = 2 * self.expert_input_size * self.moe_intermediate_size
            macs = self.n_routed_experts * h + self.num_experts_per_tok * expert
            macs += 2 * h * self.moe_shared_expert_intermediate_size
            macs += 2 * h * self.moe_latent_size if self.moe_latent_size else 0
        else:
            raise ConfigError(f"layer type {layer_type!r}: expected one of {LAYER_TYPES}")
        return 2.0 * macs

    def param_counts(self) -> dict[str, int]:
        """Parameter counts of the text model (MTP head excluded): total and activated per token."""
        h = self.hidden_size
        mamba = h * self.mamba_in_proj_size + self.mamba_conv_dim * (self.conv_kernel + int(self.use_conv_bias))
        mamba += 3 * self.mamba_num_heads + self.mamba_intermediate_size + self.mamba_intermediate_size * h
        attn = h * (self.num_attention_heads + 2 * self.num_key_value_heads) * self.head_dim
        attn += self.num_attention_heads * self.head_dim * h
        mlp = 2 * h * self.intermediate_size
        d, e = self.expert_input_size, self.n_routed_experts
        moe_dense = e * h + e + 2 * h * self.moe_shared_expert_intermediate_size
        moe_dense += 2 * h * self.moe_latent_size if self.moe_latent_size else 0
        expert = 2 * d * self.moe_intermediate_size
        count = {t: self.layer_types.count(t) for t in LAYER_TYPES}
        dense = count[MAMBA] * mamba + count[ATTENTION] * attn + count[MLP] * mlp + count[MOE] * moe_dense
        dense += self.num_hidden_layers * h  # the block norms
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        total = dense + embed + count[MOE] * e * expert
        active = dense + embed + count[MOE] * self.num_experts_per_tok * expert
        return {"total": total, "active": active}

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str = "config.json") -> "NemotronHConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object")
        if raw.get("model_type") not in MODEL_TYPES:
            raise ConfigError(f"{source}: model_type {raw.get('model_type')!r} is not {MODEL_TYPES}")
        text = dict(raw)
        for alias, name in _ALIASES.items():
            if alias in text:
                text.setdefault(name, text.pop(alias))
        missing = [key for key in REQUIRED_KEYS if key not in text]
        if missing:
            raise ConfigError(f"{source}: missing {', '.join(missing)} (no safe default: it sets the model's shapes)")
        # The parts of transformers' NemotronH that jax_dwdp does not build are refused, not ignored.
        unsupported = {"mlp_hidden_act": "relu2", "mamba_hidden_act": "silu", "use_bias": False,
                       "mamba_proj_bias": False, "attention_bias": False, "mlp_bias": False}
        for key, wanted in unsupported.items():
            if text.get(key, wanted) != wanted:
                raise ConfigError(f"{source}: {key}={text[key]!r} is not supported (only {wanted!r})")
        if text.get("sliding_window") is not None:
            raise ConfigError(f"{source}: sliding_window={text['sliding_window']!r} is not supported")
        try:
            types = text.get("layers_block_type") or text.get("layer_types")
            if types is not None:
                types = tuple(LEGACY_NAMES.get(t, t) for t in types)
            elif "hybrid_override_pattern" in text:
                types = parse_pattern(text["hybrid_override_pattern"])
            else:
                raise ConfigError("missing layers_block_type (or hybrid_override_pattern): the layer pattern")
            fields = {f.name for f in dataclasses.fields(cls)}
            kwargs = {k: v for k, v in text.items() if k in fields and k != "layer_types"}
            return cls(layer_types=types, **kwargs)
        except (ConfigError, TypeError) as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config (model_type nemotron_h, transformers 5.17's field names) that rebuilds this config."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["layers_block_type"] = list(out.pop("layer_types"))
        out.update(model_type="nemotron_h", mlp_hidden_act="relu2", mamba_hidden_act="silu", use_bias=False,
                   mlp_bias=False, attention_bias=False, n_shared_experts=1)
        return out

    def replace(self, **changes: Any) -> "NemotronHConfig":
        return dataclasses.replace(self, **changes)

    def summary(self) -> str:
        counts = self.param_counts()
        n = {t: self.layer_types.count(t) for t in LAYER_TYPES}
        latent = f", latent {self.moe_latent_size}" if self.moe_latent_size else ""
        return (f"{self.num_hidden_layers} layers ({n[MAMBA]} Mamba-2, {n[ATTENTION]} attention, {n[MOE]} MoE, "
                f"{n[MLP]} MLP), hidden {self.hidden_size}, {self.n_routed_experts} experts "
                f"top-{self.num_experts_per_tok}{latent}, {_count(counts['total'])} params "
                f"({_count(counts['active'])} active)")


def _count(n: int) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


PRESETS: dict[str, NemotronHConfig] = {
    # A few MB of weights; every layer type, GQA 4/2, 2 SSM groups, grouped routing, chunks of 16 tokens so a short
    # prompt spans several.
    "tiny": NemotronHConfig(
        vocab_size=512, hidden_size=64, layer_types=parse_pattern("ME*-ME"), num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8,
        ssm_state_size=16, n_groups=2, chunk_size=16, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1,
    ),
    # docs/nemotron_h_spec.md gives each number's source.
    "nano-30b-a3b": NemotronHConfig(),
    "super-120b-a12b": NemotronHConfig(
        hidden_size=4096, intermediate_size=2688,
        layer_types=parse_pattern("MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*"
                                  "EMEMEMEME"),
        mamba_num_heads=128, n_routed_experts=512, num_experts_per_tok=22, moe_intermediate_size=2688,
        moe_shared_expert_intermediate_size=5376, moe_latent_size=1024, routed_scaling_factor=5.0,
    ),
}

NemotronHConfig.presets, NemotronHConfig.family = PRESETS, "Nemotron-H "

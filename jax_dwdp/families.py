"""The model families jax_dwdp runs, chosen from config.json's model_type: Qwen3.5-MoE (`ModelConfig`) and Nemotron-H
(`NemotronHConfig`); their presets by family-qualified name (`nemotron-h:tiny`, `qwen3.5:35b-a3b`; a bare name is
Qwen3.5-MoE's, as before the second family)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jax_dwdp import config, nemotron_h_config
from jax_dwdp.config import ConfigError, ModelConfig, read_json_file
from jax_dwdp.nemotron_h_config import NemotronHConfig

FamilyConfig = ModelConfig | NemotronHConfig  # a model's config, of either family

FAMILIES: dict[str, type[ModelConfig] | type[NemotronHConfig]] = {
    "qwen3_5_moe": ModelConfig,
    "qwen3_5_moe_text": ModelConfig,
    "nemotron_h": NemotronHConfig,
}


def config_from_hf_dict(raw: Any, source: str = "config.json") -> FamilyConfig:
    """The config of the family that `raw["model_type"]` names."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    family = FAMILIES.get(raw.get("model_type"))
    if family is None:
        raise ConfigError(f"{source}: unknown model_type {raw.get('model_type')!r}; expected one of "
                          f"{tuple(FAMILIES)}")
    return family.from_hf_dict(raw, source=source)


def config_from_json_file(path: str | Path) -> FamilyConfig:
    return config_from_hf_dict(read_json_file(path), source=str(path))


# The presets of each family, by the family's name in a preset name ("FAMILY:NAME").
PRESETS: dict[str, dict[str, FamilyConfig]] = {
    "qwen3.5": config.PRESETS,
    "nemotron-h": nemotron_h_config.PRESETS,
}
DEFAULT_PRESET_FAMILY = "qwen3.5"  # a bare name (tiny, 35b-a3b, 122b-a10b, 397b-a17b) names a Qwen3.5-MoE preset


def preset_names() -> list[str]:
    """Every preset's family-qualified name, family by family."""
    return [f"{family}:{name}" for family, presets in PRESETS.items() for name in presets]


def config_from_preset(name: str) -> FamilyConfig:
    """The config a preset name gives: "FAMILY:NAME" (`preset_names`), or a bare NAME of the default family
    (Qwen3.5-MoE). An unknown name is a ConfigError listing them all."""
    family, qualified, preset = name.rpartition(":")
    presets = PRESETS.get(family if qualified else DEFAULT_PRESET_FAMILY, {})
    if preset not in presets:
        bare = ", ".join(PRESETS[DEFAULT_PRESET_FAMILY])
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(preset_names())} (or a bare {bare}: "
                          f"{DEFAULT_PRESET_FAMILY}'s)")
    return presets[preset]

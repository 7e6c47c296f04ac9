"""The model families jax_dwdp runs, chosen from config.json's model_type: Qwen3.5-MoE (`ModelConfig`) and Nemotron-H
(`NemotronHConfig`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jax_dwdp.config import ConfigError, ModelConfig, read_json_file
from jax_dwdp.nemotron_h_config import NemotronHConfig

FAMILIES: dict[str, type[ModelConfig] | type[NemotronHConfig]] = {
    "qwen3_5_moe": ModelConfig,
    "qwen3_5_moe_text": ModelConfig,
    "nemotron_h": NemotronHConfig,
}


def config_from_hf_dict(raw: Any, source: str = "config.json") -> ModelConfig | NemotronHConfig:
    """The config of the family that `raw["model_type"]` names."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a JSON object")
    family = FAMILIES.get(raw.get("model_type"))
    if family is None:
        raise ConfigError(f"{source}: unknown model_type {raw.get('model_type')!r}; expected one of "
                          f"{tuple(FAMILIES)}")
    return family.from_hf_dict(raw, source=source)


def config_from_json_file(path: str | Path) -> ModelConfig | NemotronHConfig:
    return config_from_hf_dict(read_json_file(path), source=str(path))

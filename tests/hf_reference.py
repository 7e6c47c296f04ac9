"""Builds random Qwen3.5-MoE models in transformers (the numerical reference) and writes them as checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

from jax_dwdp.config import ModelConfig


def hf_text_config(cfg: ModelConfig) -> Qwen3_5MoeTextConfig:
    d = cfg.to_hf_dict()
    d.pop("model_type")
    return Qwen3_5MoeTextConfig(**d)


def eager_model(model_class, config, seed: int):
    """(an fp32 HF model of `config` on the eager attention and per-expert paths (exact, any shape), the generator
    of `seed` that draws its fresh weights)."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    model.config._attn_implementation = "eager"
    model.config._experts_implementation = "eager"
    return model, torch.Generator().manual_seed(seed)


def random_hf_model(cfg: ModelConfig, seed: int) -> Qwen3_5MoeForCausalLM:
    """An fp32 HF model whose every parameter is fresh random (norm weights too, so (1 + w) forms are tested)."""
    model, gen = eager_model(Qwen3_5MoeForCausalLM, hf_text_config(cfg), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen)))
            elif p.ndim == 1:  # norms, dt_bias
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * fan_in**-0.5)
    return model


def hf_prefill(model: Qwen3_5MoeForCausalLM, tokens: np.ndarray) -> dict[str, np.ndarray]:
    """Logits [B, T, V] and the HF caches, converted to jax_dwdp's cache layout (float64 numpy)."""
    with torch.no_grad():
        out = model(torch.as_tensor(tokens, dtype=torch.long), use_cache=True)
    layers = out.past_key_values.layers
    types = model.config.layer_types
    keys = [layers[i].keys.permute(0, 2, 1, 3) for i, t in enumerate(types) if t == "full_attention"]
    values = [layers[i].values.permute(0, 2, 1, 3) for i, t in enumerate(types) if t == "full_attention"]
    k_minus_1 = model.config.linear_conv_kernel_dim - 1
    conv = [layers[i].conv_states[0][..., -k_minus_1:] for i, t in enumerate(types) if t == "linear_attention"]
    rec = [layers[i].recurrent_states[0] for i, t in enumerate(types) if t == "linear_attention"]
    as_np = lambda xs: np.stack([x.double().numpy() for x in xs])  # noqa: E731
    return {
        "logits": out.logits.double().numpy(),
        "key": as_np(keys),
        "value": as_np(values),
        "conv": as_np(conv),
        "recurrent": as_np(rec),
    }


def save_hf(model: Qwen3_5MoeForCausalLM, directory: Path) -> Path:
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def write_config(directory: Path, cfg: ModelConfig, released_form: bool) -> None:
    text = cfg.to_hf_dict()
    if released_form:
        text["model_type"] = "qwen3_5_moe_text"
        raw = {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    else:
        raw = text
    (directory / "config.json").write_text(json.dumps(raw, indent=1))

"""Parity with transformers' PyTorch Qwen3.5-MoE (fp32): logits and every cache, on random configs."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.config import ModelConfig
from jax_dwdp.prefill import jit_prefill
from jax_dwdp.weights.hf_loader import load_hf_checkpoint
from tests.hf_reference import hf_prefill, random_hf_model, rel_err, save_hf

CONFIGS = {
    # 4 layers = 3 linear + 1 full; value heads = 2 x key heads; GQA 4/2.
    "base": dict(vocab_size=96, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                 linear_value_head_dim=12, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=20,
                 shared_expert_intermediate_size=24),
    # 6 layers with an explicit, irregular pattern; 8 query / 1 kv heads; top-2 of 8; wider partial rotary.
    "irregular": dict(vocab_size=80, hidden_size=40, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=1,
                      head_dim=8, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
                      linear_value_head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=12,
                      shared_expert_intermediate_size=16, partial_rotary_factor=0.5, rope_theta=1e6,
                      layer_types=("full_attention", "linear_attention", "linear_attention", "full_attention",
                                   "linear_attention", "full_attention")),
}


@pytest.mark.parametrize("name,batch,seq_len", [("base", 2, 70), ("base", 1, 130), ("irregular", 3, 67)])
def test_prefill_matches_transformers(tmp_path, rng, name, batch, seq_len):
    cfg = ModelConfig(**CONFIGS[name])
    seed = int(rng.integers(1 << 30))
    hf = random_hf_model(cfg, seed)
    tokens = rng.integers(0, cfg.vocab_size, (batch, seq_len)).astype(np.int32)
    ref = hf_prefill(hf, tokens)
    model, report = load_hf_checkpoint(save_hf(hf, tmp_path / "ckpt"), dtype=jnp.float32)
    assert report.tensors_loaded == len(list(hf.parameters()))
    logits, cache = jit_prefill(model)(tokens)
    errors = {
        "logits": rel_err(logits, ref["logits"]),
        "key": rel_err(cache.key, ref["key"]),
        "value": rel_err(cache.value, ref["value"]),
        "conv": rel_err(cache.conv, ref["conv"]),
        "recurrent": rel_err(cache.recurrent, ref["recurrent"]),
    }
    print(f"{name} B={batch} T={seq_len} relative errors vs transformers:",
          " ".join(f"{k}={v:.2e}" for k, v in errors.items()))
    assert cache.recurrent.dtype == jnp.float32
    for key, err in errors.items():
        assert err <= 1e-4, f"{key}: relative error {err:.3e} > 1e-4"

"""HF checkpoint loading: every accepted layout gives the same weights; every bad checkpoint one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file

from jax_dwdp.config import ConfigError, ModelConfig
from jax_dwdp.weights.hf_loader import load_hf_checkpoint
from jax_dwdp.weights.safetensors_reader import CheckpointError
from tests.hf_reference import random_hf_model, write_config

CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=5, vocab_size=72, num_experts=4)


@pytest.fixture(scope="module")
def hf_state():
    model = random_hf_model(CFG, seed=3)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_checkpoint(directory: Path, tensors: dict[str, torch.Tensor], *, shards: int = 1, released=False,
                     config: ModelConfig = CFG) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    names = sorted(tensors)
    if shards == 1:
        save_file({k: tensors[k].contiguous() for k in names}, directory / "model.safetensors")
    else:
        weight_map = {}
        for s in range(shards):
            part = names[s::shards]
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: tensors[k].contiguous() for k in part}, directory / fname)
            weight_map.update({k: fname for k in part})
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    write_config(directory, config, released_form=released)
    return directory


def released_layout(state: dict[str, torch.Tensor], per_expert_layers=(1, 3)) -> dict[str, torch.Tensor]:
    """The released vision-language naming, per-expert keys on some layers, plus vision and MTP tensors."""
    out = {}
    i = CFG.moe_intermediate_size
    for name, t in state.items():
        new = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if layer in per_expert_layers and name.endswith("mlp.experts.gate_up_proj"):
            base = new[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :i]
                out[f"{base}{e}.up_proj.weight"] = t[e, i:]
        elif layer in per_expert_layers and name.endswith("mlp.experts.down_proj"):
            base = new[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            out[new] = t
    out["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(6, 4)
    out["model.visual.merger.mlp.0.bias"] = torch.randn(4)
    out["mtp.fc.weight"] = torch.randn(8, 4)
    return out


def flat_params(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def test_released_sharded_per_expert_layout_loads_the_same_weights(tmp_path, hf_state):
    plain, plain_report = load_hf_checkpoint(write_checkpoint(tmp_path / "plain", hf_state), dtype=jnp.float32)
    rel, report = load_hf_checkpoint(
        write_checkpoint(tmp_path / "released", released_layout(hf_state), shards=3, released=True), dtype=jnp.float32
    )
    assert report.skipped_non_text == 3 and plain_report.skipped_non_text == 0
    a, b = flat_params(plain), flat_params(rel)
    assert a.keys() == b.keys()
    for path in a:
        np.testing.assert_array_equal(a[path], b[path], err_msg=str(path))
    # And the weights really are HF's: the fused expert tensor of layer 1 equals the source.
    np.testing.assert_array_equal(a[("layers", 1, "mlp", "experts", "gate_up_proj")],
                                  hf_state["model.layers.1.mlp.experts.gate_up_proj"].numpy())


def test_bf16_checkpoint_and_dtypes(tmp_path, hf_state):
    bf16 = {k: (v.to(torch.bfloat16) if not k.endswith("A_log") else v) for k, v in hf_state.items()}
    ckpt = write_checkpoint(tmp_path / "bf16", bf16)
    m16, _ = load_hf_checkpoint(ckpt, dtype=jnp.bfloat16)
    m32, _ = load_hf_checkpoint(ckpt, dtype=jnp.float32)
    assert m16.layers[0].linear_attn.A_log[...].dtype == jnp.float32  # kept fp32 whatever the model dtype
    assert m16.layers[0].mlp.experts.gate_up_proj[...].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(m16.lm_head.weight[...]).view(np.uint16),
                                  bf16["lm_head.weight"].view(torch.int16).numpy().view(np.uint16))
    np.testing.assert_array_equal(np.asarray(m32.lm_head.weight[...]), bf16["lm_head.weight"].float().numpy())


def test_layer_range_reads_only_its_tensors(tmp_path, hf_state):
    ckpt = write_checkpoint(tmp_path / "c", hf_state, shards=2)
    model, report = load_hf_checkpoint(ckpt, dtype=jnp.float32, start_layer=1, end_layer=3)
    in_range = {k: v for k, v in hf_state.items() if k.startswith(("model.layers.1.", "model.layers.2."))}
    assert report.tensors_loaded == len(in_range)
    assert report.bytes_read == sum(v.numel() * v.element_size() for v in in_range.values())
    assert report.skipped_other_layers == len(hf_state) - len(in_range)
    assert [layer.layer_id for layer in model.layers] == [1, 2]
    np.testing.assert_array_equal(np.asarray(model.layers[0].mlp.gate.weight[...]),
                                  hf_state["model.layers.1.mlp.gate.weight"].numpy())


def mutate(state, **changes):
    out = dict(state)
    for k, v in changes.items():
        k = k.replace("__", ".")
        if v is None:
            out.pop(k)
        else:
            out[k] = v
    return out


@pytest.mark.parametrize(
    "change,message",
    [
        (dict(model__layers__2__mlp__gate__weight=None), "missing tensor model.layers.2.mlp.gate.weight (expected shape (4, 64))"),
        (dict(model__layers__0__mlp__extra__weight=torch.randn(3)), "unexpected tensor model.layers.0.mlp.extra.weight"),
        (dict(model__layers__7__mlp__gate__weight=torch.randn(4, 64)), "belongs to layer 7, but the config has 5 layers"),
        (dict(model__layers__0__self_attn__q_proj__weight=torch.randn(3, 64)), "unexpected tensor model.layers.0.self_attn.q_proj.weight"),
        (dict(model__norm__weight=torch.randn(65)), "tensor model.norm.weight has shape (65,); expected (64,)"),
        (dict(lm_head__weight=torch.randint(0, 5, (72, 64))), "tensor lm_head.weight has dtype int64; expected a floating-point"),
    ],
)
def test_bad_checkpoint_names_file_tensor_and_shape(tmp_path, hf_state, change, message):
    ckpt = write_checkpoint(tmp_path / "bad", mutate(hf_state, **change))
    with pytest.raises(CheckpointError) as info:
        load_hf_checkpoint(ckpt, dtype=jnp.float32)
    assert message in str(info.value)
    assert "model.safetensors" in str(info.value)  # one file: even a missing tensor is reported against it


def test_missing_per_expert_piece_is_named(tmp_path, hf_state):
    tensors = released_layout(hf_state)
    tensors.pop("model.language_model.layers.3.mlp.experts.2.up_proj.weight")
    with pytest.raises(CheckpointError, match=r"missing tensor model\.language_model\.layers\.3\.mlp\.experts\.2\.up_proj"):
        load_hf_checkpoint(write_checkpoint(tmp_path / "c", tensors, released=True), dtype=jnp.float32)


def test_bad_configs_are_refused(tmp_path):
    base = CFG.to_hf_dict()
    cases = [
        (dict(base, model_type="llama"), "unknown model_type 'llama'"),
        (dict(base, num_attention_heads=3), "num_attention_heads (3) is not a multiple of num_key_value_heads (2)"),
        (dict(base, layer_types=["linear_attention"] * 4), "layer_types has 4 entries but num_hidden_layers is 5"),
        (dict(base, layer_types=["linear_attention"] * 4 + ["mamba"]), "layer_types[4] is 'mamba'"),
        ({"model_type": "qwen3_5_moe"}, "needs a text_config"),
    ]
    for raw, message in cases:
        with pytest.raises(ConfigError) as info:
            ModelConfig.from_hf_dict(raw)
        assert message in str(info.value), str(info.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json_file(tmp_path / "config.json")


def test_config_round_trips_through_hf_forms():
    for cfg in (CFG, ModelConfig.preset("397b-a17b")):
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
        assert ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe", "text_config": cfg.to_hf_dict()}) == cfg


def test_loaded_arrays_live_on_the_requested_device(tmp_path, hf_state):
    device = jax.devices()[-1]
    model, _ = load_hf_checkpoint(write_checkpoint(tmp_path / "c", hf_state), dtype=jnp.float32,
                                  placement=lambda path, shape, dtype: jax.sharding.SingleDeviceSharding(device))
    assert model.layers[0].mlp.experts.down_proj[...].devices() == {device}

"""`python -m jax_dwdp.weights.hf_export` writes an HF folder that the HF loader reads back as the same model (the
newcomer's way to a checkpoint for `convert`, `verify` and `prefill --checkpoint`), and refuses an existing folder."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.text import Tokenizer
from jax_dwdp.weights.hf_export import main, save_hf_checkpoint
from jax_dwdp.weights.hf_loader import load_config, load_hf_checkpoint
from tests.checkpoint_helpers import flat


def test_saved_folder_loads_back_as_the_same_model(tmp_path):
    cfg = ModelConfig.preset("tiny")
    model = init_model(cfg, dtype=jnp.float32, seed=11)
    save_hf_checkpoint(model, cfg, tmp_path / "hf")
    assert load_config(tmp_path / "hf") == cfg
    loaded, report = load_hf_checkpoint(tmp_path / "hf", dtype=None)
    want, got = flat(model), flat(loaded)
    assert want.keys() == got.keys() and report.tensors_loaded == len(want)
    for key in want:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=str(key))


def test_the_command_writes_a_new_folder_and_refuses_an_existing_one(tmp_path, capsys):
    assert main([str(tmp_path / "hf"), "--num-layers", "2", "--dtype", "bfloat16", "--seed", "3"]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors",
                                                                   "tokenizer.json", "tokenizer_config.json"]
    assert load_config(tmp_path / "hf").num_hidden_layers == 2
    tok = Tokenizer.from_checkpoint(tmp_path / "hf")  # text in and out work on it
    tokens, lengths = tok.batch(["hello world", "the quick brown fox"], chat=True)
    assert tokens.max() < load_config(tmp_path / "hf").vocab_size and tok.decode([int(t) for t in tokens[0][:1]])
    assert main([str(tmp_path / "bare"), "--num-layers", "1", "--no-tokenizer"]) == 0
    assert sorted(p.name for p in (tmp_path / "bare").iterdir()) == ["config.json", "model.safetensors"]
    before = (tmp_path / "hf" / "model.safetensors").read_bytes()
    assert main([str(tmp_path / "hf")]) == 2
    assert "exists" in capsys.readouterr().err
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == before

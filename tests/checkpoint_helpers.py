"""Small HF checkpoints written without transformers, and model comparisons, for the conversion and checkpoint tests."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from safetensors.torch import save_file

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.weights.hf_names import hf_name
from tests.hf_reference import write_config


def write_hf(directory: Path, cfg: ModelConfig, seed: int, dtype=torch.float32) -> Path:
    """An HF folder (one safetensors file, `model.` names) of a random jax_dwdp model in `dtype`."""
    model = init_model(cfg, dtype=jnp.float32, seed=seed)
    tensors = {hf_name(p, 0, "model."): torch.from_numpy(np.array(v.get_value())).to(dtype)
               for p, v in nnx.to_flat_state(nnx.state(model))}
    directory.mkdir(parents=True)
    save_file(tensors, directory / "model.safetensors")
    write_config(directory, cfg, released_form=False)
    return directory


def flat(model) -> dict:
    """{parameter path: numpy array} of a model."""
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}

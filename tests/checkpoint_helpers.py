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


def write_hf(directory: Path, cfg: ModelConfig, seed: int, dtype=torch.float32, per_expert: bool = False,
             edit=None) -> Path:
    """An HF folder (one safetensors file, `model.` names) of a random jax_dwdp model in `dtype`; per_expert: expert
    tensors as per-expert pieces (`experts.E.gate_proj.weight`, ...), as released checkpoints store them; edit:
    called with {name: tensor} before writing, to change them."""
    model = init_model(cfg, dtype=jnp.float32, seed=seed)
    tensors = {hf_name(p, 0, "model."): torch.from_numpy(np.array(v.get_value())).to(dtype)
               for p, v in nnx.to_flat_state(nnx.state(model))}
    if per_expert:
        i = cfg.moe_intermediate_size
        for name in [n for n in tensors if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]:
            t, base = tensors.pop(name), name.rsplit(".", 1)[0]
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    tensors[f"{base}.{e}.gate_proj.weight"] = t[e, :i].clone()
                    tensors[f"{base}.{e}.up_proj.weight"] = t[e, i:].clone()
                else:
                    tensors[f"{base}.{e}.down_proj.weight"] = t[e].clone()
    if edit is not None:
        edit(tensors)
    directory.mkdir(parents=True)
    save_file(tensors, directory / "model.safetensors")
    write_config(directory, cfg, released_form=False)
    return directory


def flat(model) -> dict:
    """{parameter path: numpy array} of a model."""
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}

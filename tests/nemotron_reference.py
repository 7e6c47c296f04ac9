"""Random Nemotron-H models built in transformers (the numerical reference), copied into jax_dwdp through the
checkpoint-name map, and the reference's prefill and decode per sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx
from transformers import NemotronHConfig as HfNemotronHConfig
from transformers import NemotronHForCausalLM as HfNemotronHForCausalLM

from jax_dwdp.model import abstract_model
from jax_dwdp.nemotron_h_config import ATTENTION, MAMBA, NemotronHConfig
from jax_dwdp.weights import nemotron_h_names
from tests.hf_reference import eager_model


def hf_config(cfg: NemotronHConfig) -> HfNemotronHConfig:
    d = cfg.to_hf_dict()
    d.pop("model_type")
    return HfNemotronHConfig(**d)


def random_hf_model(cfg: NemotronHConfig, seed: int) -> HfNemotronHForCausalLM:
    """An fp32 HF model whose every parameter (and the router's correction bias) is fresh random at scales that keep
    every path sensitive: norms near 1, time steps around the clamp at time_step_min, decays of a few steps."""
    model, gen = eager_model(HfNemotronHForCausalLM, hf_config(cfg), seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.5, 4.0, generator=gen)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 - 2.0)
            elif name.endswith("e_score_correction_bias") or name.endswith("conv1d.bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            elif p.ndim == 1:  # norms, D
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.2)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return model


def to_jax(hf: HfNemotronHForCausalLM, cfg: NemotronHConfig):
    """jax_dwdp's fp32 model holding hf's weights, each placed by `nemotron_h_names.classify`; every parameter of
    the model must be given exactly once."""
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype=jnp.float32))
    expected = dict(nnx.to_flat_state(abstract))
    loaded = {}
    for name, tensor in hf.state_dict().items():
        target = nemotron_h_names.classify(name, 0, cfg.num_hidden_layers)
        assert target is not None and target.kind == "param", (name, target)
        var = expected[target.path]
        array = tensor.detach().numpy()
        assert array.shape == tuple(var.shape) and target.path not in loaded, (name, array.shape, var.shape)
        loaded[target.path] = jnp.asarray(array, var.dtype)
    assert set(loaded) == set(expected), set(expected) ^ set(loaded)
    state = nnx.from_flat_state([(path, type(var)(loaded[path])) for path, var in expected.items()])
    return nnx.merge(graphdef, state)


def hf_prefill_and_step(hf: HfNemotronHForCausalLM, tokens: np.ndarray, next_token: int) -> dict[str, np.ndarray]:
    """One sequence (tokens [T], no padding) through the reference: its logits [T, V], its caches in jax_dwdp's
    layout (float64; KV [n_attn, T, nkv, hd], conv [n_mamba, C, K-1], SSM [n_mamba, H, P, N]) and the logits [V]
    of one decode step with `next_token` that continues them."""
    types = hf.config.layers_block_type
    with torch.no_grad():
        out = hf(torch.as_tensor(tokens[None], dtype=torch.long), use_cache=True)
        cache = out.past_key_values
        layers = cache.layers
        k_minus_1 = hf.config.conv_kernel - 1
        as_np = lambda xs: np.stack([x[0].double().numpy() for x in xs])  # noqa: E731
        ref = {
            "logits": out.logits[0].double().numpy(),
            "key": as_np([layers[i].keys.permute(0, 2, 1, 3) for i, t in enumerate(types) if t == ATTENTION]),
            "value": as_np([layers[i].values.permute(0, 2, 1, 3) for i, t in enumerate(types) if t == ATTENTION]),
            "conv": as_np([layers[i].conv_states[0][..., -k_minus_1:] for i, t in enumerate(types) if t == MAMBA]),
            "recurrent": as_np([layers[i].recurrent_states[0] for i, t in enumerate(types) if t == MAMBA]),
        }
        step = hf(torch.as_tensor([[next_token]], dtype=torch.long), past_key_values=cache, use_cache=True)
    ref["next_logits"] = step.logits[0, -1].double().numpy()
    return ref


def jit_prefill_and_step(model):
    """The model's prefill (logits "all", cache room for one more token) and decode step, each one jitted program."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill(state, tokens, lengths):
        return nnx.merge(graphdef, state).prefill(tokens, lengths, cache_len=tokens.shape[1] + 1)

    @jax.jit
    def step(state, tokens, cache):
        return nnx.merge(graphdef, state).decode_step(tokens, cache)

    return (lambda tokens, lengths: prefill(state, tokens, lengths)), (lambda tokens, cache: step(state, tokens, cache))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))

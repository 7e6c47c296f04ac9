"""Prefill in pieces: each piece continues the previous one's caches and equals the one-shot prefill (fp32, CPU)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dwdp.config import ModelConfig
from jax_dwdp.model.attention import GatedAttention
from jax_dwdp.model.gated_deltanet import GatedDeltaNet
from tests.gdn_cases import rel_err

CFG = ModelConfig.preset("tiny")


def _pieces(lengths, cut):
    """Per-sequence token counts of the two pieces [0, cut) and [cut, T) of a right-padded batch."""
    first = np.minimum(lengths, cut)
    return first, lengths - first


def test_gated_deltanet_in_two_pieces(rng):
    """Conv history and recurrent state carry across the cut, also for a sequence that ends before it."""
    mixer = GatedDeltaNet(CFG, dtype=jnp.float32, rngs=nnx.Rngs(3))
    lengths = np.array([150, 40, 97], np.int32)
    x = jnp.asarray(rng.standard_normal((3, 150, CFG.hidden_size)), jnp.float32)
    whole, (conv, state) = mixer(x, jnp.asarray(lengths))
    cut = 61
    n1, n2 = _pieces(lengths, cut)
    out1, cache1 = mixer(x[:, :cut], jnp.asarray(n1))
    out2, (conv2, state2) = mixer(x[:, cut:], jnp.asarray(n2), cache1)
    for i, n in enumerate(lengths):
        got = np.concatenate([np.asarray(out1[i, : n1[i]]), np.asarray(out2[i, : n2[i]])])
        err = rel_err(got, whole[i, :n])
        print(f"seq {i} (len {n}): output {err:.2e}, conv {rel_err(conv2[i], conv[i]):.2e}, "
              f"state {rel_err(state2[i], state[i]):.2e}")
        assert err <= 1e-5 and rel_err(conv2[i], conv[i]) <= 1e-6 and rel_err(state2[i], state[i]) <= 1e-5


def test_attention_in_two_pieces(rng):
    """The second piece writes its K/V after the first's and attends to all earlier positions."""
    attn = GatedAttention(CFG, dtype=jnp.float32, rngs=nnx.Rngs(4))
    lengths = np.array([120, 33], np.int32)
    t = 120
    x = jnp.asarray(rng.standard_normal((2, t, CFG.hidden_size)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(t), (2, t))
    whole, (k, v) = attn(x, positions)
    cut = 50
    n1, _ = _pieces(lengths, cut)
    shape = (2, t, CFG.num_key_value_heads, CFG.head_dim)
    # Unwritten slots poisoned: NaN keys, huge values (a masked value meets weight 0, and 0 * NaN would be NaN).
    cache = (jnp.full(shape, jnp.nan, jnp.float32), jnp.full(shape, 1e30, jnp.float32))
    out1, cache = attn(x[:, :cut], positions[:, :cut], cache)
    start = jnp.asarray(n1)[:, None]
    out2, (k2, v2) = attn(x[:, cut:], start + jnp.arange(t - cut)[None, :], cache)
    for i, n in enumerate(lengths):
        n_a = int(n1[i])
        got = np.concatenate([np.asarray(out1[i, :n_a]), np.asarray(out2[i, : n - n_a])])
        err, err_k = rel_err(got, whole[i, :n]), rel_err(k2[i, :n], k[i, :n])
        print(f"seq {i} (len {n}): output {err:.2e}, keys {err_k:.2e}")
        assert err <= 1e-5 and err_k <= 1e-6

"""Prefill in pieces: each piece continues the previous one's caches and equals the one-shot prefill (fp32, CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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


def _model_and_prompt(rng, lengths, t):
    from jax_dwdp.model import init_model

    cfg = CFG.replace(num_hidden_layers=5)  # linear, linear, linear, full, linear
    model = init_model(cfg, dtype=jnp.float32, seed=5)
    tokens = rng.integers(0, cfg.vocab_size, (len(lengths), t)).astype(np.int32)
    return model, tokens


# fp32 rounding through five layers. On a GPU (JAX_DWDP_TEST_GPU=1) cuBLAS picks other fp32 GEMM algorithms for the
# pieces' shapes than for the whole prompt's, whose sums round in another order: one sequence at 1.27e-5 (the others
# 5.6e-6 to 9.5e-6) on an H200 (2026-12-02; benchmarks/history/RESULTS-2026-11-to-12.md).
PIECES_TOL = 1e-5 if jax.default_backend() == "cpu" else 3e-5


@pytest.mark.parametrize("layerwise", [False, True])
def test_prefill_in_pieces_equals_one_prefill(rng, layerwise):
    """Three pieces (cut at 50 and 97; one sequence ends in the first piece) continue each other's caches,
    full-attention KV included: every position's logits and every cache equal one prefill of the whole prompt."""
    from jax_dwdp.prefill import jit_prefill

    lengths = np.array([130, 41, 97], np.int32)
    t = 130
    model, tokens = _model_and_prompt(rng, lengths, t)
    whole_logits, whole_cache = jit_prefill(model, layerwise=layerwise)(tokens, lengths)
    prefill = jit_prefill(model, cache_len=t, layerwise=layerwise)
    cache, parts = None, []
    for start, stop in [(0, 50), (50, 97), (97, 130)]:
        n = np.clip(lengths - start, 0, stop - start).astype(np.int32)
        logits, cache = prefill(tokens[:, start:stop], n, cache=cache)
        parts.append(np.asarray(logits))
    logits = np.concatenate(parts, axis=1)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)
    for i, n in enumerate(lengths):
        err = rel_err(logits[i, :n], whole_logits[i, :n])
        print(f"seq {i} (len {n}): logits {err:.2e} (bound {PIECES_TOL:.0e})")
        assert err <= PIECES_TOL
    for name in ("key", "value", "conv", "recurrent"):
        got, want = getattr(cache, name), getattr(whole_cache, name)
        errs = [rel_err(got[:, i, :n] if name in ("key", "value") else got[:, i],
                        want[:, i, :n] if name in ("key", "value") else want[:, i]) for i, n in enumerate(lengths)]
        print(f"cache {name}: {max(errs):.2e}")
        assert max(errs) <= PIECES_TOL, name


def test_continuing_a_cache_checks_its_room(rng):
    from jax_dwdp.prefill import InputError, jit_prefill

    lengths = np.array([60, 60], np.int32)
    model, tokens = _model_and_prompt(rng, lengths, 60)
    _, cache = jit_prefill(model, cache_len=50)(tokens[:, :40])
    with pytest.raises(InputError, match="holds 50 positions; sequence 0 needs 60"):
        jit_prefill(model)(tokens[:, 40:], cache=cache)
    with pytest.raises(InputError, match="cache is for"):
        jit_prefill(model)(tokens[:1, 40:45], cache=cache)


def test_cli_prefill_chunk_writes_the_same_logits(tmp_path, capsys):
    """`jax-dwdp prefill --prefill-chunk C`: every position's logits equal the one-shot prefill's (fp32), for a
    prompt length that is not a multiple of C; with --pipeline it is refused in one line."""
    from jax_dwdp.cli import main

    tokens = np.random.default_rng(11).integers(0, CFG.vocab_size, (2, 90)).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    common = ["prefill", "--preset", "tiny", "--dtype", "float32", "--tokens", str(tmp_path / "tokens.npy"),
              "--iters", "1", "--json"]
    assert main(common + ["--logits-out", str(tmp_path / "whole.npy")]) == 0
    assert main(common + ["--logits-out", str(tmp_path / "pieces.npy"), "--prefill-chunk", "32"]) == 0
    capsys.readouterr()
    err = rel_err(np.load(tmp_path / "pieces.npy"), np.load(tmp_path / "whole.npy"))
    print(f"CLI --prefill-chunk 32 vs one prefill: {err:.2e}")
    assert err <= 1e-5
    assert main(common + ["--prefill-chunk", "32", "--pipeline", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: --prefill-chunk runs on one device"), lines


def test_chunked_last_logits_come_from_each_sequences_last_piece(rng):
    """logits="last" in pieces: each sequence's last position, from the piece that holds it (a right-padded batch
    whose sequences end in different pieces)."""
    from jax_dwdp.driver import chunked_prefill
    from jax_dwdp.prefill import jit_prefill

    lengths = np.array([100, 30, 64], np.int32)
    model, tokens = _model_and_prompt(rng, lengths, 100)
    want, _ = jit_prefill(model, logits="last")(tokens, lengths)
    got, [cache] = chunked_prefill(model, "last", 32)(tokens, lengths)
    err = rel_err(got, want)
    print(f"last logits in pieces of 32: {err:.2e}")
    assert err <= 1e-5
    np.testing.assert_array_equal(np.asarray(cache.lengths), lengths)

"""Model behaviour on the CPU: decode continuation, variable-length batches, bf16 vs fp32, layer ranges."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.prefill import InputError, jit_decode_step, jit_prefill
from tests.hf_reference import rel_err

# 5 layers (4 linear + 1 full): T = 70 crosses a chunk boundary; value heads = 2 x key heads.
CFG = ModelConfig(
    vocab_size=101, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
)


@pytest.fixture(scope="module")
def model32():
    return init_model(CFG, dtype=jnp.float32, seed=11)


def test_decode_continues_prefill(model32, rng):
    """prefill(T) + decode(token T+1) == prefill(T+1) at the last position, logits and caches."""
    b, t = 2, 70
    tokens = rng.integers(0, CFG.vocab_size, (b, t + 1)).astype(np.int32)
    _, cache = jit_prefill(model32, logits="none", cache_len=t + 1)(tokens[:, :t])
    step_logits, step_cache = jit_decode_step(model32)(tokens[:, t], cache)
    full_logits, full_cache = jit_prefill(model32, logits="all")(tokens)
    err = rel_err(step_logits, full_logits[:, t])
    print(f"decode vs prefill(T+1): logits rel err {err:.2e}")
    assert err <= 1e-5
    assert np.array_equal(step_cache.lengths, [t + 1] * b)
    for field in ("key", "value", "conv", "recurrent"):
        e = rel_err(getattr(step_cache, field), getattr(full_cache, field))
        print(f"  cache {field}: {e:.2e}")
        assert e <= 1e-5, field


def test_layerwise_prefill_equals_whole_program(model32, rng):
    lengths = np.array([70, 41], np.int32)
    tokens = rng.integers(0, CFG.vocab_size, (2, 70)).astype(np.int32)
    whole_logits, whole = jit_prefill(model32, logits="last", cache_len=75)(tokens, lengths)
    lw_logits, lw = jit_prefill(model32, logits="last", cache_len=75, layerwise=True)(tokens, lengths)
    assert lw.full_layer_ids == whole.full_layer_ids and lw.linear_layer_ids == whole.linear_layer_ids
    for name, a, b in [("logits", lw_logits, whole_logits), ("key", lw.key, whole.key),
                       ("recurrent", lw.recurrent, whole.recurrent), ("conv", lw.conv, whole.conv)]:
        assert a.shape == b.shape
        assert rel_err(a, b) <= 1e-5, name


def test_layerwise_dispatch_does_not_rehash_graphdefs(model32, rng, monkeypatch):
    """Layer-wise drivers call one jitted program per layer with the graphdef as a static argument; flax recomputes
    a GraphDef's hash by walking the module graph, so the drivers hash each graphdef once (StaticGraph), not on
    every call. A second driver over the same model reuses the executables (equal graphdefs compare equal)."""
    from flax.nnx import graphlib

    from jax_dwdp.parallel.dwdp import IndependentRanks

    tokens = rng.integers(0, CFG.vocab_size, (1, 20)).astype(np.int32)
    prefill = jit_prefill(model32, logits="last", layerwise=True)
    ranks = IndependentRanks(model32, jax.devices()[:1])
    want = np.asarray(jax.block_until_ready(prefill(tokens)[0]))
    jax.block_until_ready(ranks.prefill(0, tokens, logits="last"))  # compile
    calls = []
    original = graphlib.GraphDef.__hash__
    monkeypatch.setattr(graphlib.GraphDef, "__hash__", lambda self: calls.append(1) or original(self))
    for _ in range(2):
        np.testing.assert_array_equal(np.asarray(prefill(tokens)[0]), want)
        jax.block_until_ready(ranks.prefill(0, tokens, logits="last"))
    assert not calls, f"GraphDef hashed {len(calls)} times in 2 x 2 layer-wise prefills of {CFG.num_hidden_layers} layers"
    from jax_dwdp import programs

    compiled = programs.run_layer._cache_size()
    second = jit_prefill(model32, logits="last", layerwise=True)  # a second driver: new, equal graphdefs
    jax.block_until_ready(second(tokens))
    assert programs.run_layer._cache_size() == compiled
    compared = []
    original_eq = graphlib.GraphDef.__eq__
    monkeypatch.setattr(graphlib.GraphDef, "__eq__", lambda self, other: compared.append(1) or original_eq(self, other))
    calls.clear()
    jax.block_until_ready(second(tokens))
    assert not calls and not compared, "the second driver's calls hash or compare module graphs"


def test_decode_on_full_cache_is_refused(model32, rng):
    tokens = rng.integers(0, CFG.vocab_size, (1, 9)).astype(np.int32)
    _, cache = jit_prefill(model32, logits="none")(tokens)
    with pytest.raises(InputError, match="cache is full"):
        jit_decode_step(model32)(tokens[:, 0], cache)


def test_variable_length_batch_is_independent_per_sequence(model32, rng):
    """Right-padded sequences of lengths 70, 33, 1 give the logits and caches of running each alone."""
    lengths = np.array([70, 33, 1], np.int32)
    t = int(lengths.max())
    tokens = rng.integers(0, CFG.vocab_size, (3, t)).astype(np.int32)
    # Garbage in the padding must not leak into any sequence.
    for i, n in enumerate(lengths):
        tokens[i, n:] = rng.integers(0, CFG.vocab_size, t - n)
    logits, cache = jit_prefill(model32, logits="all")(tokens, lengths)
    last, _ = jit_prefill(model32, logits="last")(tokens, lengths)
    for i, n in enumerate(lengths):
        alone_logits, alone = jit_prefill(model32, logits="all")(tokens[i : i + 1, :n])
        errs = {
            "logits": rel_err(logits[i, :n], alone_logits[0]),
            "last": rel_err(last[i], alone_logits[0, n - 1]),
            "key": rel_err(cache.key[:, i, :n], alone.key[:, 0]),
            "value": rel_err(cache.value[:, i, :n], alone.value[:, 0]),
            "conv": rel_err(cache.conv[:, i], alone.conv[:, 0]),
            "recurrent": rel_err(cache.recurrent[:, i], alone.recurrent[:, 0]),
        }
        print(f"length {n}: " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()))
        # Batch shape changes fp32 summation order (1e-6..3e-5 seen); a padding leak is O(1).
        for k, v in errs.items():
            assert v <= 1e-4, (n, k, v)


def _damp_residual_branches(model, factor: float):
    """Scales every projection that writes into the residual stream, as trained checkpoints have it.

    With unit-scale random branches, a 5-layer random MoE is chaotic: transformers' own bf16 run differs from its
    fp32 run by ~30% there, so bf16 accuracy can only be judged on a model whose residual stream is dominated by
    its input, like a trained one.
    """
    graphdef, state = nnx.split(model)
    writers = ("o_proj", "out_proj", "down_proj")

    def scale(path, x):
        names = [str(getattr(k, "key", k)) for k in path]
        return x * factor if any(n in writers for n in names) else x

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(scale, state))


def test_bf16_prefill_close_to_fp32(rng):
    m32 = _damp_residual_branches(init_model(CFG, dtype=jnp.float32, seed=5), 0.2)
    m16 = _damp_residual_branches(init_model(CFG, dtype=jnp.bfloat16, seed=5), 0.2)
    tokens = rng.integers(0, CFG.vocab_size, (2, 80)).astype(np.int32)
    l32, c32 = jit_prefill(m32)(tokens)
    l16, c16 = jit_prefill(m16)(tokens)
    # Same seed: the bf16 weights are the fp32 weights rounded.
    err = rel_err(l16.astype(jnp.float32), l32)
    print(f"bf16 vs fp32 logits rel err {err:.2e}; recurrent {rel_err(c16.recurrent, c32.recurrent):.2e}")
    assert c16.recurrent.dtype == jnp.float32 and c16.key.dtype == jnp.bfloat16
    assert err <= 2e-2


def test_layer_range_model_holds_only_its_layers():
    stage = init_model(CFG, dtype=jnp.float32, start_layer=2, end_layer=4)
    assert [layer.layer_id for layer in stage.layers] == [2, 3]
    assert not hasattr(stage, "embed_tokens") and not hasattr(stage, "lm_head")
    assert stage.linear_layer_ids == (2,) and stage.full_layer_ids == (3,)
    with pytest.raises(ValueError, match="empty"):
        init_model(CFG, start_layer=3, end_layer=3)


@pytest.mark.parametrize(
    "tokens,lengths,match",
    [
        (np.array([[1, 2, 101]]), None, "outside the vocabulary"),
        (np.array([[1, -1]]), None, "outside the vocabulary"),
        (np.zeros((1, 0), np.int32), None, "empty"),
        (np.array([1, 2, 3]), None, r"\[batch, seq_len\]"),
        (np.array([[1.5, 2.0]]), None, "integers"),
        (np.array([[1, 2]]), np.array([3]), "lengths must lie"),
        (np.array([[1, 2]]), np.array([0]), "lengths must lie"),
    ],
)
def test_bad_tokens_are_refused(model32, tokens, lengths, match):
    with pytest.raises(InputError, match=match):
        jit_prefill(model32)(tokens, lengths)



def test_fused_swiglu_layout_computes_the_same_model(rng):
    """The interleaved gate_up layout (the fused SwiGLU epilogue's; opt-in) is a pure row permutation: same seed ->
    the same logits, bit for bit on the CPU path; an exact round trip; a program built before a conversion keeps
    computing the same (the conversion returns a new model); donate=True frees the old weights loudly; mixed-layout
    models refused."""
    from jax_dwdp.model import fused_swiglu_enabled, set_fused_swiglu

    plain = init_model(CFG, dtype=jnp.float32, seed=5)
    fused = init_model(CFG, dtype=jnp.float32, seed=5, fused_swiglu=True)
    assert not fused_swiglu_enabled(plain) and fused_swiglu_enabled(fused)
    w_plain = np.asarray(plain.layers[1].mlp.experts.gate_up_proj[...])
    w_fused = np.asarray(fused.layers[1].mlp.experts.gate_up_proj[...])
    assert not np.array_equal(w_plain, w_fused)
    np.testing.assert_array_equal(w_fused[:, 8:16], w_plain[:, 16:24])  # rows 8..15: up rows 0..7 (I = 16)
    tokens = rng.integers(0, CFG.vocab_size, (2, 20)).astype(np.int32)
    program = jit_prefill(plain)
    a, b = program(tokens)[0], jit_prefill(fused)(tokens)[0]
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    back = set_fused_swiglu(fused, False)
    assert fused_swiglu_enabled(fused) and not fused_swiglu_enabled(back)  # the input model is left as it was
    np.testing.assert_array_equal(np.asarray(back.layers[1].mlp.experts.gate_up_proj[...]), w_plain)
    np.testing.assert_array_equal(np.asarray(fused.layers[1].mlp.experts.gate_up_proj[...]), w_fused)
    converted = set_fused_swiglu(plain, True)
    np.testing.assert_array_equal(np.asarray(program(tokens)[0]), np.asarray(a))  # built before: unaffected
    np.testing.assert_array_equal(np.asarray(jit_prefill(converted)(tokens)[0]), np.asarray(a))
    donor = init_model(CFG, dtype=jnp.float32, seed=5)
    donated = set_fused_swiglu(donor, True, donate=True)
    np.testing.assert_array_equal(np.asarray(jit_prefill(donated)(tokens)[0]), np.asarray(a))
    with pytest.raises(RuntimeError, match="deleted"):
        jit_prefill(donor)(tokens)
    fused.layers[0].mlp.experts.gate_up_interleaved = False
    with pytest.raises(ValueError, match="mix gate_up layouts"):
        fused_swiglu_enabled(fused)
    odd = CFG.replace(moe_intermediate_size=12)
    with pytest.raises(ValueError, match="moe_intermediate_size % 8 == 0"):
        init_model(odd, dtype=jnp.float32, seed=5, fused_swiglu=True)



@pytest.mark.parametrize("experts", [6, 7])  # 6 + 2 x 16 + 1 = 39 rows: one zero row padded; 7: 40, none
def test_merged_token_projection_computes_the_same_block(rng, experts):
    """`KernelChoices.moe_merged_projection` (None, the default: on from MERGED_PROJECTION_MIN_TOKENS tokens per
    call): the router, the shared expert's gate / up and its sigmoid gate as one matmul (three dots fewer in the
    block's jaxpr) computes the block the four separate projections do (fp32, random weights and tokens)."""
    from jax_dwdp.kernels import KernelChoices
    from jax_dwdp.model import moe
    from jax_dwdp.model.moe import SparseMoe

    default = KernelChoices.defaults("cpu")
    cfg = CFG.replace(num_experts=experts)
    x = jnp.asarray(rng.standard_normal((2, 37, CFG.hidden_size)), jnp.float32)

    def run(flag):  # the same weights (same rngs), the choice a static attribute of the block
        block = SparseMoe(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3), kernels=default.replace(moe_merged_projection=flag))
        dots = sum(e.primitive.name == "dot_general" for e in jax.make_jaxpr(lambda v: block(v))(x).jaxpr.eqns)
        return np.asarray(block(x)), dots

    (merged, merged_dots), (apart, apart_dots), (_, default_dots) = run(True), run(False), run(None)
    assert moe.MERGED_PROJECTION_DEFAULT and default.moe_merged_projection is None
    assert moe.merged_projection(kernels=default)
    assert moe.merged_projection(tokens=moe.MERGED_PROJECTION_MIN_TOKENS, kernels=default)
    assert not moe.merged_projection(tokens=moe.MERGED_PROJECTION_MIN_TOKENS - 1, kernels=default)
    assert moe.merged_projection(tokens=1, kernels=default.replace(moe_merged_projection=True))
    # by default a call of fewer tokens than MERGED_PROJECTION_MIN_TOKENS keeps the projections apart
    assert x.shape[0] * x.shape[1] < moe.MERGED_PROJECTION_MIN_TOKENS and default_dots == apart_dots
    assert merged_dots == apart_dots - 3, (merged_dots, apart_dots)
    err = rel_err(merged, apart)
    print(f"merged vs separate projections (fp32, {experts} experts): rel err {err:.2e}")
    assert err < 1e-5
    assert np.abs(merged).max() > 0  # a real output, not an empty one

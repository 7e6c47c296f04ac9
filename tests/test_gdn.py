"""The gated delta rule: the Pallas kernels (in interpret mode on the CPU) against the fp32 reference, the
reference's variable lengths and initial state, and the implementation switch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.kernels import gated_delta_rule as gdr
from jax_dwdp.kernels.gdn_pallas import Tuning, chunk_gated_delta_rule_conv_pallas, chunk_gated_delta_rule_pallas
from tests.gdn_cases import (
    check_against_reference,
    conv_gdn_inputs,
    conv_split,
    gdn_inputs,
    poisoned,
    reference_per_sequence,
    rel_err,
)

# bf16 inputs; the kernels round w, u, the decayed keys, the per-chunk states, v_new and the intra-chunk scores to
# bf16 (unit roundoff 2^-9 = 2e-3) before the tensor-core products, and accumulate in fp32: a few roundings in a
# row give a few 1e-3 (measured 3-4e-3 on random inputs), so 1e-2 leaves room without hiding a wrong term
# (a missing decay, block or sequence gives errors of order 1).
BOUND = 1e-2


@pytest.mark.parametrize("hk,hv", [(2, 4), (1, 4)])
@pytest.mark.parametrize("initial", [False, True])
def test_pallas_kernels_match_reference_interpreted(rng, hk, hv, initial):
    """Lengths 1, 63, 64, 65 and 130 in one right-padded batch; each sequence's output and final state equal the
    reference run on it alone; every output element is written (NaN-poisoned buffer), zero past each length."""
    lengths = np.array([130, 1, 63, 64, 65], np.int32)
    q, k, v, g, beta, h0 = gdn_inputs(rng, len(lengths), 130, hk, hv, 16, 32, initial=initial)
    o, state = chunk_gated_delta_rule_pallas(q, k, v, g, beta, jnp.asarray(lengths), h0,
                                             poisoned(len(lengths), 130, hv, 32), tuning=Tuning(block_v=16),
                                             interpret=True)
    ref = reference_per_sequence(q, k, v, g, beta, lengths, h0)
    check_against_reference(o, state, ref, lengths, f"pallas (interpret) {hk}/{hv} heads", BOUND)


@pytest.mark.parametrize("precision", ["tf32", "bf16", "mixed"])
def test_wide_prep_kernel_matches_reference_interpreted(rng, precision):
    """The prep kernel on 64x64 tiles (Tuning(inverse="wide")), its inverse's products at each precision: the same
    outputs within the same bound."""
    lengths = np.array([130, 1, 65], np.int32)
    q, k, v, g, beta, h0 = gdn_inputs(rng, 3, 130, 2, 4, 16, 32, initial=True)
    o, state = chunk_gated_delta_rule_pallas(q, k, v, g, beta, jnp.asarray(lengths), h0, poisoned(3, 130, 4, 32),
                                             tuning=Tuning(block_v=16, inverse="wide", merge_precision=precision),
                                             interpret=True)
    ref = reference_per_sequence(q, k, v, g, beta, lengths, h0)
    check_against_reference(o, state, ref, lengths, f"pallas (interpret) wide prep, {precision}", BOUND)


def test_tuning_rejects_unknown_options():
    with pytest.raises(ValueError, match="merge_precision='fp8'"):
        Tuning(merge_precision="fp8")
    with pytest.raises(ValueError, match="inverse='lu'"):
        Tuning(inverse="lu")


@pytest.mark.parametrize("inverse,hk,hv,initial", [("doubling", 2, 4, True), ("doubling", 1, 4, False),
                                                    ("wide", 2, 4, False)])
def test_fused_recurrence_output_matches_reference_interpreted(rng, inverse, hk, hv, initial):
    """Tuning(fused_output=True): the output computed inside the recurrence (no per-chunk states in memory), the
    same batch of lengths 1-130 as above, NaN-poisoned output buffer, zero past each length."""
    lengths = np.array([130, 1, 63, 64, 65], np.int32)
    q, k, v, g, beta, h0 = gdn_inputs(rng, len(lengths), 130, hk, hv, 16, 32, initial=initial)
    o, state = chunk_gated_delta_rule_pallas(q, k, v, g, beta, jnp.asarray(lengths), h0,
                                             poisoned(len(lengths), 130, hv, 32),
                                             tuning=Tuning(block_v=16, inverse=inverse, fused_output=True),
                                             interpret=True)
    ref = reference_per_sequence(q, k, v, g, beta, lengths, h0)
    check_against_reference(o, state, ref, lengths, f"pallas fused (interpret) {inverse} {hk}/{hv}", BOUND)


def test_reference_batch_equals_sequences_alone(rng):
    lengths = np.array([100, 37, 64], np.int32)
    q, k, v, g, beta, h0 = gdn_inputs(rng, 3, 100, 2, 4, 16, 16, initial=True, dtype=jnp.float32)
    o, state = gdr.chunk_gated_delta_rule(q, k, v, g, beta, lengths=jnp.asarray(lengths), initial_state=h0,
                                          implementation="xla")
    for i, (ro, rs) in enumerate(reference_per_sequence(q, k, v, g, beta, lengths, h0)):
        n = lengths[i]
        err = max(rel_err(o[i, :n], ro), rel_err(state[i], rs))
        print(f"batched vs alone, seq {i}: {err:.2e}")
        assert err <= 1e-6


def test_reference_in_two_pieces_equals_one(rng):
    """The second piece continues from the first's final state: the same outputs and final state as one call."""
    q, k, v, g, beta, _ = gdn_inputs(rng, 2, 200, 2, 4, 16, 16, initial=False, dtype=jnp.float32)
    o, state = gdr.chunk_gated_delta_rule(q, k, v, g, beta, implementation="xla")
    cut = 77
    o1, s1 = gdr.chunk_gated_delta_rule(*(x[:, :cut] for x in (q, k, v, g, beta)), implementation="xla")
    o2, s2 = gdr.chunk_gated_delta_rule(*(x[:, cut:] for x in (q, k, v, g, beta)), initial_state=s1,
                                        implementation="xla")
    err_o = rel_err(jnp.concatenate([o1, o2], axis=1), o)
    err_s = rel_err(s2, state)
    print(f"two pieces vs one: output {err_o:.2e}, state {err_s:.2e}")
    assert err_o <= 1e-5 and err_s <= 1e-5


def test_implementation_switch(monkeypatch):
    monkeypatch.delenv(gdr.ENV_IMPLEMENTATION, raising=False)
    assert gdr.default_implementation(jnp.bfloat16, 128, 128) == "xla"  # the CPU
    monkeypatch.setenv(gdr.ENV_IMPLEMENTATION, "pallas")
    assert gdr.default_implementation(jnp.float32, 128, 128) == "pallas"
    monkeypatch.setenv(gdr.ENV_IMPLEMENTATION, "fast")
    with pytest.raises(ValueError, match="JAX_DWDP_GDN='fast'"):
        gdr.default_implementation(jnp.bfloat16, 128, 128)


def test_shape_errors_name_the_inputs():
    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match="HV a multiple of HK"):
        gdr.chunk_gated_delta_rule(q, q, jnp.zeros((1, 8, 3, 16)), jnp.zeros((1, 8, 3)), jnp.zeros((1, 8, 3)))
    with pytest.raises(ValueError, match="initial_state"):
        gdr.chunk_gated_delta_rule(q, q, jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 8, 4)), jnp.zeros((1, 8, 4)),
                                   initial_state=jnp.zeros((1, 4, 16, 8)))
    with pytest.raises(ValueError, match="power-of-two"):
        gdr.chunk_gated_delta_rule(jnp.zeros((1, 8, 2, 24)), jnp.zeros((1, 8, 2, 24)), jnp.zeros((1, 8, 4, 16)),
                                   jnp.zeros((1, 8, 4)), jnp.zeros((1, 8, 4)), implementation="pallas")


@pytest.mark.parametrize("hk,hv", [(2, 4), (1, 4)])
def test_conv_in_prep_kernel_matches_separate_conv_interpreted(rng, hk, hv):
    """The conv inside the prep kernel (`chunk_gated_delta_rule_conv_pallas`) on a right-padded batch of lengths
    1-130, T = 130 (not a multiple of the chunk), into a NaN-poisoned buffer: equal to the separate conv followed by
    the same kernels, and within the bound of the fp32 reference on fp32-conv'd inputs; zero past each length."""
    lengths = np.array([130, 1, 63, 64, 65], np.int32)
    b, t, dk, dv = len(lengths), 130, 16, 32
    mixed, weight, g, beta = conv_gdn_inputs(rng, b, t, hk, hv, dk, dv)
    o, state = chunk_gated_delta_rule_conv_pallas(mixed, weight, g, beta, jnp.asarray(lengths), poisoned(b, t, hv, dv),
                                                  heads=(hk, hv), head_dims=(dk, dv), interpret=True)
    q, k, v = conv_split(mixed, weight, hk, hv, dk, dv)
    o2, state2 = chunk_gated_delta_rule_pallas(q, k, v, g, beta, jnp.asarray(lengths), interpret=True)
    err = max(rel_err(o, o2), rel_err(state, state2))
    print(f"conv in the prep kernel vs the separate conv, {hk}/{hv} heads: {err:.2e} (bound 1e-6)")
    assert err <= 1e-6
    ref = reference_per_sequence(*conv_split(mixed, weight, hk, hv, dk, dv, jnp.float32), g, beta, lengths, None)
    check_against_reference(o, state, ref, lengths, f"pallas conv prep (interpret) {hk}/{hv}", BOUND)


def test_conv_in_prep_kernel_choice(monkeypatch):
    """`conv_fused`: off by default; with $JAX_DWDP_GDN_CONV=fused only where the Pallas gated delta rule is chosen,
    for shapes the kernel takes; a bad value is named; the kernel refuses shapes it cannot take."""
    heads, dims = (16, 32), (128, 128)
    c = 2 * 16 * 128 + 32 * 128
    monkeypatch.delenv(gdr.ENV_CONV, raising=False)
    monkeypatch.setenv(gdr.ENV_IMPLEMENTATION, "pallas")
    assert not gdr.conv_fused(jnp.bfloat16, c, 4, heads, dims)  # the default: the separate conv
    monkeypatch.setenv(gdr.ENV_CONV, "fused")
    monkeypatch.delenv(gdr.ENV_IMPLEMENTATION)
    monkeypatch.setattr(gdr, "on_gpu", lambda: False)
    assert not gdr.conv_fused(jnp.bfloat16, c, 4, heads, dims)  # on the CPU: XLA's gated delta rule
    monkeypatch.setenv(gdr.ENV_IMPLEMENTATION, "pallas")
    assert gdr.conv_fused(jnp.bfloat16, c, 4, heads, dims)
    assert not gdr.conv_fused(jnp.float32, c, 4, heads, dims)
    assert not gdr.conv_fused(jnp.bfloat16, c, 3, heads, dims)  # conv width not a power of two
    assert not gdr.conv_fused(jnp.bfloat16, c + 128, 4, heads, dims)  # channels are not q | k | v
    monkeypatch.setenv(gdr.ENV_CONV, "separate")
    assert not gdr.conv_fused(jnp.bfloat16, c, 4, heads, dims)
    monkeypatch.setenv(gdr.ENV_CONV, "inline")
    with pytest.raises(ValueError, match="JAX_DWDP_GDN_CONV='inline'"):
        gdr.conv_fused(jnp.bfloat16, c, 4, heads, dims)
    x = jnp.zeros((1, 64, 2 * 16 + 2 * 16 + 4 * 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="conv width 3"):
        chunk_gated_delta_rule_conv_pallas(x, jnp.zeros((x.shape[-1], 1, 3), jnp.bfloat16), jnp.zeros((1, 64, 4)),
                                           jnp.zeros((1, 64, 4)), jnp.array([64]), heads=(2, 4), head_dims=(16, 32),
                                           interpret=True)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        chunk_gated_delta_rule_conv_pallas(x.astype(jnp.float32), jnp.zeros((x.shape[-1], 1, 4)),
                                           jnp.zeros((1, 64, 4)), jnp.zeros((1, 64, 4)), jnp.array([64]),
                                           heads=(2, 4), head_dims=(16, 32), interpret=True)


@pytest.mark.parametrize("mode,cached,want", [("fused", False, "gdn_conv_prep"), ("", False, "gdn_prep"),
                                              ("fused", True, "gdn_prep")])
def test_gdn_mixer_lowered_for_cuda_chooses_its_prep_kernel(rng, monkeypatch, mode, cached, want):
    """The Gated DeltaNet mixer lowered for CUDA with the Pallas gated delta rule: the separate conv and the plain
    prep kernel by default; the conv inside the prep kernel with $JAX_DWDP_GDN_CONV=fused, but not when a cache's
    inputs precede t = 0."""
    from flax import nnx

    from jax_dwdp.config import ModelConfig
    from jax_dwdp.model.gated_deltanet import GatedDeltaNet

    monkeypatch.setenv(gdr.ENV_IMPLEMENTATION, "pallas")
    monkeypatch.setenv(gdr.ENV_CONV, mode)
    monkeypatch.delenv("JAX_DWDP_CONV", raising=False)
    cfg = ModelConfig.preset("tiny").replace(linear_key_head_dim=16, linear_value_head_dim=32)
    mixer = GatedDeltaNet(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graph, state = nnx.split(mixer)
    x = jax.ShapeDtypeStruct((1, 1000, cfg.hidden_size), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    cache = (jax.ShapeDtypeStruct((1, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1), jnp.bfloat16),
             jax.ShapeDtypeStruct((1, cfg.linear_num_value_heads, 16, 32), jnp.float32)) if cached else None
    fn = jax.jit(lambda s, x, n, c: nnx.merge(graph, s)(x, n, c)[0])
    text = fn.trace(state, x, lengths, cache).lower(lowering_platforms=("cuda",)).as_text()
    other = ({"gdn_conv_prep", "gdn_prep"} - {want}).pop()
    assert f'"{want}"' in text and f'"{other}"' not in text and "gdn_recurrence_output" in text

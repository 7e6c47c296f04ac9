"""The gated delta rule: the Pallas kernels (in interpret mode on the CPU) against the fp32 reference, the
reference's variable lengths and initial state, and the implementation switch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.kernels import gated_delta_rule as gdr
from jax_dwdp.kernels.choices import KernelChoices
from jax_dwdp.kernels.gdn_pallas import Tuning, chunk_gated_delta_rule_pallas
from tests.gdn_cases import check_against_reference, gdn_inputs, poisoned, reference_per_sequence, rel_err

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


def test_implementation_switch():
    """Without `implementation=`: `KernelChoices.gdn` for bf16/fp16 inputs of power-of-two head dims >= 16 (the
    Pallas kernels by default on a GPU host, XLA elsewhere), XLA for fp32 inputs (the reference) and other head
    dims; a bad forced form is named."""
    cpu, gpu = KernelChoices.defaults("cpu"), KernelChoices.defaults("gpu")
    assert gdr.default_implementation(jnp.bfloat16, 128, 128, cpu) == "xla"
    assert gdr.default_implementation(jnp.bfloat16, 128, 128) == KernelChoices.from_environment().gdn
    assert gdr.default_implementation(jnp.bfloat16, 128, 128, gpu) == "pallas"
    assert gdr.default_implementation(jnp.float16, 16, 32, gpu) == "pallas"
    assert gdr.default_implementation(jnp.float32, 128, 128, gpu) == "xla"
    assert gdr.default_implementation(jnp.bfloat16, 24, 128, gpu) == "xla"
    assert gdr.default_implementation(jnp.bfloat16, 128, 128, gpu.replace(gdn="xla")) == "xla"
    q = jnp.zeros((1, 8, 2, 16))
    with pytest.raises(ValueError, match="implementation='fast' is none of"):
        gdr.chunk_gated_delta_rule(q, q, jnp.zeros((1, 8, 4, 16)), jnp.zeros((1, 8, 4)), jnp.zeros((1, 8, 4)),
                                   implementation="fast")


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


@pytest.mark.parametrize("gdn,cached", [("pallas", False), ("pallas", True), ("xla", False)])
def test_gdn_mixer_lowered_for_cuda_takes_the_chosen_form(rng, gdn, cached):
    """The bf16 Gated DeltaNet mixer lowered for CUDA: with `KernelChoices.gdn="pallas"` the separate conv, the
    prep kernel and the recurrence with the output (also continuing a cache); with "xla" none of the kernels."""
    from flax import nnx

    from jax_dwdp.config import ModelConfig
    from jax_dwdp.model.gated_deltanet import GatedDeltaNet

    cfg = ModelConfig.preset("tiny").replace(linear_key_head_dim=16, linear_value_head_dim=32)
    mixer = GatedDeltaNet(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), kernels=KernelChoices.defaults("cpu").replace(
        gdn=gdn))
    graph, state = nnx.split(mixer)
    x = jax.ShapeDtypeStruct((1, 1000, cfg.hidden_size), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    cache = (jax.ShapeDtypeStruct((1, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1), jnp.bfloat16),
             jax.ShapeDtypeStruct((1, cfg.linear_num_value_heads, 16, 32), jnp.float32)) if cached else None
    fn = jax.jit(lambda s, x, n, c: nnx.merge(graph, s)(x, n, c)[0])
    text = fn.trace(state, x, lengths, cache).lower(lowering_platforms=("cuda",)).as_text()
    assert ('"gdn_prep"' in text and "gdn_recurrence_output" in text) == (gdn == "pallas")
    assert "gdn_causal_conv_silu" not in text  # 1000 tokens: XLA's conv

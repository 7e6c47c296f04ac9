"""The Pallas gated delta rule on the GPU against the fp32 reference (skipped without a GPU; JAX_DWDP_TEST_GPU=1)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.gdn_cases import check_against_reference, gdn_inputs, poisoned, reference_per_sequence, rel_err
from tests.test_gdn import BOUND

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)"),
]


@pytest.mark.parametrize("hk,hv", [(16, 32), (16, 64)])  # 35b-a3b; 122b-a10b and 397b-a17b
@pytest.mark.parametrize("initial", [False, True])
def test_kernel_matches_reference(rng, hk, hv, initial):
    """Lengths 1, 63, 64, 65, 1000 and 4096 in one right-padded batch, dk = dv = 128, NaN-poisoned output."""
    from jax_dwdp.kernels.gdn_pallas import chunk_gated_delta_rule_pallas

    lengths = np.array([4096, 1, 63, 64, 65, 1000], np.int32)
    b, t = len(lengths), int(lengths.max())
    q, k, v, g, beta, h0 = gdn_inputs(rng, b, t, hk, hv, 128, 128, initial=initial)
    o, state = chunk_gated_delta_rule_pallas(q, k, v, g, beta, jnp.asarray(lengths), h0, poisoned(b, t, hv, 128))
    ref = reference_per_sequence(q, k, v, g, beta, lengths, h0, batched=True)
    check_against_reference(o, state, ref, lengths, f"pallas {hk}/{hv} heads, initial {initial}", BOUND)


@pytest.mark.parametrize("options", [dict(merge_precision="ieee", fused_output=False),
                                     dict(merge_precision="tf32", fused_output=False), dict(fused_output=False),
                                     dict(merge_precision="mixed"), dict(merge_precision="tf32")])
def test_kernel_variants_match_reference(rng, options):
    """The variants beside the default (the prep's inverse in exact fp32, TF32, bf16 for the merge only; the output
    kernel apart) on the mixed-length batch with a random initial state. (On 2026-12-01 the fused output failed here
    with 128 state columns per program, since capped at 64.)"""
    from jax_dwdp.kernels.gdn_pallas import Tuning, chunk_gated_delta_rule_pallas

    lengths = np.array([4096, 1, 63, 64, 65, 1000], np.int32)
    b, t = len(lengths), int(lengths.max())
    q, k, v, g, beta, h0 = gdn_inputs(rng, b, t, 16, 32, 128, 128, initial=True)
    o, state = chunk_gated_delta_rule_pallas(q, k, v, g, beta, jnp.asarray(lengths), h0, poisoned(b, t, 32, 128),
                                             tuning=Tuning(**options))
    ref = reference_per_sequence(q, k, v, g, beta, lengths, h0, batched=True)
    check_against_reference(o, state, ref, lengths, f"pallas {options}", BOUND)


@pytest.mark.parametrize("fused", [True, False])
def test_kernel_unpadded_length_batch(rng, fused):
    """T = 1000, not a multiple of the chunk, in a batch of 3: q, k, v and o are not padded, the last chunk's rows
    are read and written with masks; the NaN-poisoned buffer behind o must hold exactly the outputs."""
    from jax_dwdp.kernels.gdn_pallas import Tuning, chunk_gated_delta_rule_pallas

    lengths = np.array([1000, 999, 937], np.int32)
    q, k, v, g, beta, h0 = gdn_inputs(rng, 3, 1000, 16, 32, 128, 128, initial=True)
    o, state = chunk_gated_delta_rule_pallas(q, k, v, g, beta, jnp.asarray(lengths), h0, poisoned(3, 1000, 32, 128),
                                             tuning=Tuning(fused_output=fused))
    assert o.shape == (3, 1000, 32, 128)
    ref = reference_per_sequence(q, k, v, g, beta, lengths, h0, batched=True)
    check_against_reference(o, state, ref, lengths, f"pallas unpadded T=1000 fused={fused}", BOUND)


@pytest.mark.parametrize("t", [1, 63, 64, 65, 1000, 4096])
def test_kernel_single_lengths(rng, t):
    from jax_dwdp.kernels import chunk_gated_delta_rule

    q, k, v, g, beta, _ = gdn_inputs(rng, 1, t, 16, 32, 128, 128, initial=False)
    o, state = chunk_gated_delta_rule(q, k, v, g, beta)  # the GPU default for bf16
    check_against_reference(o, state, reference_per_sequence(q, k, v, g, beta, [t], None), [t], f"T={t}", BOUND)


def test_kernel_in_two_pieces_equals_one(rng):
    """A prompt prefilled in two pieces (the second from the first's state) equals one call, within bf16 rounding."""
    from jax_dwdp.kernels import chunk_gated_delta_rule

    q, k, v, g, beta, _ = gdn_inputs(rng, 2, 3000, 16, 32, 128, 128, initial=False)
    o, state = chunk_gated_delta_rule(q, k, v, g, beta)
    cut = 1234
    o1, s1 = chunk_gated_delta_rule(*(x[:, :cut] for x in (q, k, v, g, beta)))
    o2, s2 = chunk_gated_delta_rule(*(x[:, cut:] for x in (q, k, v, g, beta)), initial_state=s1)
    err_o, err_s = rel_err(jnp.concatenate([o1, o2], 1).astype(jnp.float32), o.astype(jnp.float32)), rel_err(s2, state)
    print(f"GPU two pieces vs one: output {err_o:.2e}, state {err_s:.2e}")
    assert err_o <= BOUND and err_s <= BOUND

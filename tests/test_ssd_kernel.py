"""Mamba-2's SSD scan as Pallas kernels (`kernels/ssd_pallas.py`) in interpret mode on the CPU against a float64
sequential recurrence: single lengths around the chunk, a right-padded batch of mixed lengths (dt = 0 on padding),
zero and random initial states, several heads per B/C group, the state in one block or in blocks of rows and
columns, heads per output program, the states loop in segments, bf16 and fp32 inputs, outputs written into
NaN-filled buffers; the implementation switch; the Triton lowering of every variant at 30B-A3B's heads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.kernels import ssd
from jax_dwdp.kernels.choices import KernelChoices
from jax_dwdp.kernels.ssd_pallas import Tuning, ssd_chunked_pallas
from tests.ssd_cases import (BOUND, BOUND_FP32, check_against_reference, f64, poisoned, reference_per_sequence,
                             rel_err, ssd_float64, ssd_float64_chunked, ssd_inputs)

# Small heads so that interpret mode stays quick: 4 heads in 2 groups of B/C, P = 32 in two blocks of 16 state rows
# (the states loop's grid may cover P in pieces), N = 16, chunks of 64 (lengths 63, 64, 65 sit around a boundary).
H, P, G, N, CHUNK = 4, 32, 2, 16, 64


FORMS = {"whole state": Tuning(), "state rows in blocks": Tuning(block_p=16),
         "two heads per output program": Tuning(output_heads=2),
         "the states loop in segments": Tuning(segments=3, block_p=16, output_heads=2)}


def _run(x, dt, a, b, c, h0, *, y_dtype=jnp.float32, row_blocks=2, tuning=None):
    out = poisoned(x.shape, y_dtype)
    tuning = tuning or Tuning(block_p=16, row_blocks=row_blocks)
    return ssd_chunked_pallas(x, dt, a, b, c, h0, out, chunk_size=CHUNK, y_dtype=y_dtype, tuning=tuning,
                              interpret=True)


@pytest.mark.parametrize("t", [1, 63, 64, 65, 1000])
def test_kernel_single_lengths_match_float64_interpreted(rng, t):
    """One sequence of each length (T not a multiple of the chunk: the last chunk's rows are masked, not padded),
    random initial state, bf16."""
    x, dt, a, b, c, h0 = ssd_inputs(rng, 1, t, H, P, G, N, initial=True)
    y, state = _run(x, dt, a, b, c, h0)
    assert y.shape == x.shape and y.dtype == jnp.float32 and state.shape == (1, H, P, N) and state.dtype == jnp.float32
    check_against_reference(y, state, reference_per_sequence(x, dt, a, b, c, h0, [t]), [t], f"T={t}", BOUND)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("initial", [False, True])
def test_kernel_mixed_lengths_match_each_sequence_alone_interpreted(rng, form, initial):
    """Lengths 1000, 1, 63, 64, 65 in one right-padded batch of T = 1000 (dt = 0 past each length): each
    sequence's y and final state are those of the sequence alone; y is written everywhere (NaN-poisoned buffer)."""
    lengths = np.array([1000, 1, 63, 64, 65])
    x, dt, a, b, c, h0 = ssd_inputs(rng, len(lengths), 1000, H, P, G, N, initial=initial, lengths=lengths)
    y, state = _run(x, dt, a, b, c, h0, tuning=FORMS[form])
    ref = reference_per_sequence(x, dt, a, b, c, h0, lengths)
    check_against_reference(y, state, ref, lengths, f"{form} initial={initial}", BOUND)


@pytest.mark.parametrize("form", list(FORMS))
def test_kernel_fp32_inputs_match_float64_tightly_interpreted(rng, form):
    """fp32 inputs keep fp32 operands (exact products): the chunked algebra itself to fp32 rounding, with no bf16
    rounding that could hide a small wrong term. Lengths 200, 37, 130 with a random initial state."""
    lengths = np.array([200, 37, 130])
    x, dt, a, b, c, h0 = ssd_inputs(rng, 3, 200, H, P, G, N, initial=True, dtype=jnp.float32, lengths=lengths)
    y, state = _run(x, dt, a, b, c, h0, tuning=FORMS[form])
    ref = reference_per_sequence(x, dt, a, b, c, h0, lengths)
    check_against_reference(y, state, ref, lengths, f"fp32 {form}", BOUND_FP32)


def test_kernel_bf16_output_and_one_head_per_group_interpreted(rng):
    """y_dtype=bf16 (what mamba_ssm returns) and G = H (no group sharing) agree with float64."""
    x, dt, a, b, c, h0 = ssd_inputs(rng, 2, 150, 2, P, 2, N, initial=True)
    y, state = _run(x, dt, a, b, c, h0, y_dtype=jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    check_against_reference(y, state, reference_per_sequence(x, dt, a, b, c, h0, [150, 150]), [150, 150], "bf16 y",
                            BOUND)


def test_states_in_column_blocks_interpreted(rng):
    """The states loop over blocks of the state's rows and columns (Tuning.block_p / block_n, P = 32 and N = 32 in
    two blocks of 16 each): the same results as float64 on a right-padded batch (lengths 130, 65, 1) with a random
    initial state, fp32 (the tight bound: a block that read another's x or B, or wrote another's state, would
    show)."""
    lengths = np.array([130, 65, 1])
    x, dt, a, b, c, h0 = ssd_inputs(rng, 3, 130, H, P, G, 32, initial=True, dtype=jnp.float32, lengths=lengths)
    out = poisoned(x.shape, jnp.float32)
    y, state = ssd_chunked_pallas(x, dt, a, b, c, h0, out, chunk_size=CHUNK,
                                  tuning=Tuning(block_p=16, block_n=16), interpret=True)
    ref = reference_per_sequence(x, dt, a, b, c, h0, lengths)
    check_against_reference(y, state, ref, lengths, "state in row and column blocks", BOUND_FP32)


@pytest.mark.parametrize("segments,t", [(8, 130), (2, 65), (2, 192)])
def test_states_in_more_segments_than_chunks_interpreted(rng, segments, t):
    """Tuning.segments past the chunk count (8 segments of 3 chunks: one chunk each), two segments of two chunks
    (the last one a single row), and two segments of two chunks over three whole chunks (the loop's fourth chunk
    past the data, on a length that is a multiple of the chunk): fp32 against float64 with a random initial state,
    y into a NaN-filled buffer."""
    x, dt, a, b, c, h0 = ssd_inputs(rng, 2, t, H, P, G, N, initial=True, dtype=jnp.float32)
    y, state = _run(x, dt, a, b, c, h0, tuning=Tuning(segments=segments))
    check_against_reference(y, state, reference_per_sequence(x, dt, a, b, c, h0, [t, t]), [t, t],
                            f"{segments} segments, T={t}", BOUND_FP32)


@pytest.mark.parametrize("row_blocks", [1, 4])
def test_kernel_row_blocks_interpreted(rng, row_blocks):
    """The chunk's rows as one block (whole [L, L] tiles) or four (tiles on and below the diagonal only): the same
    results, on lengths that end inside a block and inside a chunk."""
    lengths = np.array([300, 17, 40])
    x, dt, a, b, c, h0 = ssd_inputs(rng, 3, 300, H, P, G, N, initial=True, lengths=lengths)
    y, state = _run(x, dt, a, b, c, h0, row_blocks=row_blocks)
    check_against_reference(y, state, reference_per_sequence(x, dt, a, b, c, h0, lengths), lengths,
                            f"row blocks {row_blocks}", BOUND)


def test_kernel_in_two_pieces_equals_one_interpreted(rng):
    """A prompt in two pieces, the second from the first's final state (chunked prefill): the same y and state as
    one call, within bf16 rounding. (A zero initial state, not None, so that the whole and the first piece reuse the
    single-length test's programs.)"""
    x, dt, a, b, c, _ = ssd_inputs(rng, 1, 1000, H, P, G, N, initial=False)
    zero = jnp.zeros((1, H, P, N), jnp.float32)
    y, state = _run(x, dt, a, b, c, zero)
    cut = 63
    y1, s1 = _run(*(v[:, :cut] for v in (x, dt)), a, *(v[:, :cut] for v in (b, c)), zero)
    y2, s2 = _run(*(v[:, cut:] for v in (x, dt)), a, *(v[:, cut:] for v in (b, c)), s1)
    err_y, err_s = rel_err(jnp.concatenate([y1, y2], axis=1), f64(y)), rel_err(s2, f64(state))
    print(f"two pieces vs one: y {err_y:.2e}, state {err_s:.2e}")
    assert err_y <= BOUND and err_s <= BOUND


def test_float64_chunked_reference_equals_the_recurrence(rng):
    """The GPU tests' float64 reference by chunks is the step-by-step recurrence (to float64 rounding), at a length
    that ends inside a chunk, with several heads per group and an initial state."""
    x, dt, a, b, c, h0 = ssd_inputs(rng, 2, 150, 6, 8, 2, 5, initial=True, dtype=jnp.float32)
    args = (f64(x), f64(dt), f64(a), f64(b), f64(c), f64(h0))
    (y, s), (y_ref, s_ref) = ssd_float64_chunked(*args, chunk=64), ssd_float64(*args)
    err = max(rel_err(y, y_ref), rel_err(s, s_ref))
    print(f"float64 chunked vs recurrence: {err:.1e}")
    assert err <= 1e-12


def test_kernel_4096_tokens_interpreted(rng):
    """4,096 tokens (64 chunks) in one sequence with a random initial state."""
    x, dt, a, b, c, h0 = ssd_inputs(rng, 1, 4096, H, P, G, N, initial=True)
    y, state = _run(x, dt, a, b, c, h0)
    ref = reference_per_sequence(x, dt, a, b, c, h0, [4096], chunked=True)
    check_against_reference(y, state, ref, [4096], "T=4096", BOUND)


def test_implementation_switch():
    """Without `implementation=`: `KernelChoices.ssd` for bf16 / fp16 inputs of power-of-two sizes >= 16 (the
    kernel by default on the GPU), XLA for fp32 inputs (the reference) and other sizes; bad forms, shapes and sizes
    are named."""
    cpu, gpu = KernelChoices.defaults("cpu"), KernelChoices.defaults("gpu")
    chosen = gpu.replace(ssd="pallas")
    assert ssd.default_implementation(jnp.bfloat16, 128, 64, 128, gpu) == "pallas"
    assert ssd.default_implementation(jnp.bfloat16, 128, 64, 128, gpu.replace(ssd="xla")) == "xla"
    assert ssd.default_implementation(jnp.bfloat16, 128, 64, 128, cpu) == "xla"
    assert ssd.default_implementation(jnp.bfloat16, 128, 64, 128, cpu.replace(ssd="pallas")) == "pallas"
    assert ssd.default_implementation(jnp.bfloat16, 128, 64, 128, chosen) == "pallas"
    assert ssd.default_implementation(jnp.float16, 16, 16, 16, chosen) == "pallas"
    assert ssd.default_implementation(jnp.float32, 128, 64, 128, chosen) == "xla"
    assert ssd.default_implementation(jnp.bfloat16, 128, 8, 128, chosen) == "xla"
    assert ssd.default_implementation(jnp.bfloat16, 100, 64, 128, chosen) == "xla"
    x, dt, a, b, c, _ = ssd_inputs(np.random.default_rng(0), 1, 8, 4, 8, 2, 16, initial=False)
    with pytest.raises(ValueError, match="implementation='fast' is none of"):
        ssd.ssd_chunked(x, dt, a, b, c, chunk_size=16, implementation="fast")
    with pytest.raises(ValueError, match="powers of two"):
        ssd.ssd_chunked(x, dt, a, b, c, chunk_size=16, implementation="pallas")
    with pytest.raises(ValueError, match="do not fit"):
        ssd.ssd_chunked(x, dt, a[:3], b, c, chunk_size=16)
    with pytest.raises(ValueError, match="initial_state"):
        ssd.ssd_chunked(x, dt, a, b, c, chunk_size=16, initial_state=jnp.zeros((1, 4, 16, 8)))
    x, dt, a, b, c, _ = ssd_inputs(np.random.default_rng(0), 1, 8, 4, 16, 2, 16, initial=False)
    with pytest.raises(ValueError, match="out is float32"):
        ssd_chunked_pallas(x, dt, a, b, c, None, jnp.zeros(x.shape), chunk_size=16, y_dtype=jnp.bfloat16,
                           interpret=True)
    with pytest.raises(ValueError, match="block_p=24"):
        Tuning(block_p=24)
    with pytest.raises(ValueError, match="row_blocks=3"):
        Tuning(row_blocks=3)
    with pytest.raises(ValueError, match="block_n=48"):
        Tuning(block_n=48)
    with pytest.raises(ValueError, match="output_heads=0"):
        Tuning(output_heads=0)
    with pytest.raises(ValueError, match="segments=0"):
        Tuning(segments=0)
    x, dt, a, b, c, _ = ssd_inputs(np.random.default_rng(0), 1, 8, 4, 16, 2, 16, initial=False)
    with pytest.raises(ValueError, match="output_heads=4 does not divide the 2 heads of a B/C group"):
        ssd_chunked_pallas(x, dt, a, b, c, chunk_size=16, tuning=Tuning(output_heads=4), interpret=True)
    assert (Tuning().blocks(128), Tuning(row_blocks=8).blocks(64), Tuning(row_blocks=4).blocks(16)) == (2, 4, 1)


def _lowered_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


KERNELS = ["ssd_scores", "ssd_states", "ssd_output"]


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernels_lower_to_triton_at_30b_a3b_heads(form, dtype):
    """Every variant lowers to Triton for CUDA (on the CPU: the lowering, not the compile) at the 30B-A3B heads and
    a length off the chunk, with and without an initial state: the kernels it names, and no XLA fallback."""
    shape = jax.ShapeDtypeStruct
    t, h, p, g, n = 1000, 64, 64, 8, 128
    args = [shape((1, t, h, p), dtype), shape((1, t, h), jnp.float32), shape((h,), jnp.float32),
            shape((1, t, g, n), dtype), shape((1, t, g, n), dtype)]
    tuning = FORMS[form]
    names = [{"ssd_states": "ssd_segment_states"}.get(k, k) if tuning.segments > 1 else k for k in KERNELS]
    for initial in ([], [shape((1, h, p, n), jnp.float32)]):
        text = _lowered_for_cuda(lambda *v: ssd_chunked_pallas(*v, chunk_size=128, tuning=tuning), *args, *initial)
        assert all(f'"{name}"' in text for name in names), [name for name in names if f'"{name}"' not in text]


@pytest.mark.parametrize("choice", ["pallas", "xla"])
def test_mamba_mixer_lowered_for_cuda_takes_the_chosen_form(choice):
    """The bf16 Mamba-2 mixer lowered for CUDA: with `KernelChoices.ssd="pallas"` the kernels (also continuing a
    cache), with "xla" none of them."""
    from flax import nnx

    from jax_dwdp.model.mamba2 import Mamba2Mixer
    from jax_dwdp.nemotron_h_config import NemotronHConfig

    cfg = NemotronHConfig.preset("tiny").replace(mamba_head_dim=16)
    mixer = Mamba2Mixer(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                        kernels=KernelChoices.defaults("cpu").replace(ssd=choice))
    graph, state = nnx.split(mixer)
    x = jax.ShapeDtypeStruct((2, 100, cfg.hidden_size), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    fn = jax.jit(lambda s, x, n, c: nnx.merge(graph, s)(x, n, c)[0])
    for cache in (None, (jax.ShapeDtypeStruct((2, cfg.mamba_conv_dim, cfg.conv_kernel - 1), jnp.bfloat16),
                         jax.ShapeDtypeStruct((2, cfg.mamba_num_heads, 16, cfg.ssm_state_size), jnp.float32))):
        text = fn.trace(state, x, lengths, cache).lower(lowering_platforms=("cuda",)).as_text()
        assert [f'"{name}"' in text for name in KERNELS] == [choice == "pallas"] * len(KERNELS)

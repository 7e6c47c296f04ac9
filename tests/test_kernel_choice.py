"""Which form of a kernel runs is decided where the computation is lowered, not by JAX's default backend: a
half-type model placed on the CPU of a GPU host takes the XLA forms (it used to trace the Pallas, cuDNN and CUTLASS
paths and fail to lower them for the CPU), and the same program lowered for CUDA carries the GPU kernels.

On a CPU-only machine the GPU host is pretended (`on_gpu` patched, cuDNN's trace-time checks skipped, the grouped
matmul forced to Mosaic, which can be traced without a GPU); on a GPU host (JAX_DWDP_TEST_GPU=1) the second test
places a bf16 model on the CPU device for real."""

from __future__ import annotations

import collections
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dwdp.config import ModelConfig
from jax_dwdp.kernels import _backend

gm = importlib.import_module("jax_dwdp.kernels.grouped_matmul")
gdr = importlib.import_module("jax_dwdp.kernels.gated_delta_rule")

# Head and expert widths every GPU kernel takes (Mosaic's grouped matmul needs K % 64 == 0).
CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=4, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=64)


def _model_program(dtype=jnp.bfloat16, *, fused_swiglu: bool = False):
    from jax_dwdp.model.moe import set_fused_swiglu
    from jax_dwdp.model.qwen35_moe import Qwen35MoeForCausalLM

    model = Qwen35MoeForCausalLM(CFG, dtype=dtype, rngs=nnx.Rngs(3))
    graph, state = nnx.split(set_fused_swiglu(model, True) if fused_swiglu else model)

    def program():  # a new function each time: the choice of forms is traced
        return jax.jit(lambda state, tokens, lengths: nnx.merge(graph, state).prefill(tokens, lengths)[0])

    return state, program


def _inputs(rng):
    return (jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 24)), jnp.int32), jnp.asarray([24, 17], jnp.int32))


def _pretend_gpu(monkeypatch, present: bool):
    """Every module that asks whether a GPU backend exists hears `present`."""
    for module in (_backend, gm, gdr):
        monkeypatch.setattr(module, "on_gpu", lambda: present)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="pretends a GPU host on a CPU-only machine")
def test_half_model_on_a_gpu_host_lowers_kernels_for_cuda_and_xla_for_the_cpu(rng, monkeypatch):
    state, program = _model_program()
    tokens, lengths = _inputs(rng)
    ref = np.asarray(program()(state, tokens, lengths).astype(jnp.float32))  # a CPU machine: XLA forms only

    from jax._src.cudnn import fused_attention_stablehlo as cudnn_checks

    monkeypatch.setattr(cudnn_checks, "check_cudnn_version", lambda *a, **k: None)
    monkeypatch.setattr(cudnn_checks, "check_compute_capability", lambda *a, **k: True)
    _pretend_gpu(monkeypatch, True)
    monkeypatch.setenv(gm.ENV_IMPLEMENTATION, "mosaic")
    fn = program()
    traced = fn.trace(state, tokens, lengths)
    calls = collections.Counter(re.findall(r"stablehlo\.custom_call @([\w$.]+)",
                                           traced.lower(lowering_platforms=("cuda",)).as_text()))
    linear = sum(1 for t in CFG.layer_types if t == "linear_attention")
    # GDN's two Pallas kernels per linear layer and the two routing kernels per MoE; cuDNN attention per full layer;
    # the two grouped matmuls per MoE
    assert calls["__gpu$xla.gpu.triton"] == 2 * linear + 2 * CFG.num_hidden_layers, calls
    assert sum(v for k, v in calls.items() if "cudnn" in k) == CFG.num_hidden_layers - linear, calls
    assert calls["mosaic_gpu_v2"] == 2 * CFG.num_hidden_layers, calls
    cpu_text = traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "custom_call @__gpu" not in cpu_text and "cudnn" not in cpu_text and "mosaic" not in cpu_text
    got = np.asarray(fn(state, tokens, lengths).astype(jnp.float32))  # lowered for this CPU: the XLA forms
    np.testing.assert_array_equal(got, ref)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)")
@pytest.mark.parametrize("fused_swiglu", [False, True], ids=["checkpoint_layout", "fused_swiglu"])
def test_half_model_placed_on_the_cpu_of_a_gpu_host_runs_xla(rng, monkeypatch, fused_swiglu):
    """A bf16 model and its inputs put on the CPU device of a GPU host: the program runs there, and equals the same
    program traced with the GPU forms left out altogether (the same XLA forms lowered for the CPU). fused_swiglu:
    the opt-in interleaved layout, whose CUTLASS epilogue kernel is the default for it on the GPU."""
    state, program = _model_program(fused_swiglu=fused_swiglu)
    tokens, lengths = _inputs(rng)
    cpu = jax.devices("cpu")[0]
    state_c, tokens_c, lengths_c = jax.device_put((state, tokens, lengths), cpu)
    got = program()(state_c, tokens_c, lengths_c)
    assert got.devices() == {cpu}
    _pretend_gpu(monkeypatch, False)
    ref = program()(state_c, tokens_c, lengths_c)
    got, ref = np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, ref)
    print(f"bf16 model on the GPU host's CPU: logits equal to the XLA-only program (max |logit| {np.abs(got).max():.2f})")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="pretends a GPU host on a CPU-only machine")
def test_fused_swiglu_on_a_gpu_host_lowers_the_epilogue_kernel_for_cuda_and_the_group_loop_for_the_cpu(
        rng, monkeypatch):
    """The opt-in fused SwiGLU (interleaved gate_up, chosen by default for bf16 where CUTLASS is built): lowered for
    CUDA it is the epilogue kernel's custom call; lowered for the CPU, the group loop and the activation, equal to
    the unfused XLA path. (The CUTLASS call is a stand-in here: its library needs a GPU to load.)"""
    from jax_dwdp.kernels import _cutlass as cutlass

    groups, k, inter = 4, 64, 32
    sizes = jnp.asarray([5, 0, 9, 3], jnp.int32)
    x = jnp.asarray(rng.standard_normal((20, k)), jnp.bfloat16)  # 3 rows past sum(sizes)
    w = gm.interleave_gate_up(jnp.asarray(rng.standard_normal((groups, 2 * inter, k)) / 8, jnp.bfloat16))
    ref = np.asarray(gm.grouped_matmul_swiglu(x, w, sizes).astype(jnp.float32))  # a CPU machine: XLA
    assert np.isfinite(ref).all() and np.abs(ref[:17]).max() > 0

    _pretend_gpu(monkeypatch, True)
    monkeypatch.delenv(gm.ENV_IMPLEMENTATION, raising=False)
    monkeypatch.setattr(cutlass, "available", lambda: True)
    monkeypatch.setattr(cutlass, "_call", lambda target, names, n_out, x, w, s, config: jax.ffi.ffi_call(
        target, jax.ShapeDtypeStruct((x.shape[0], n_out), x.dtype))(x, w, s))
    fn = jax.jit(lambda x, w, s: gm.grouped_matmul_swiglu(x, w, s))
    traced = fn.trace(x, w, sizes)
    assert f"custom_call @{cutlass.SWIGLU_TARGET}" in traced.lower(lowering_platforms=("cuda",)).as_text()
    assert cutlass.SWIGLU_TARGET not in traced.lower(lowering_platforms=("cpu",)).as_text()
    got = np.asarray(fn(x, w, sizes).astype(jnp.float32))  # lowered for this CPU: the group loop
    np.testing.assert_array_equal(got, ref)

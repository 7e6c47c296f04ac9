"""Kernel choices as data (`KernelChoices`): built once per process from the defaults and the environment, bad
values refused naming their variable, handed to the model at construction and from its modules to the kernels.

Which form of a kernel runs is decided where the computation is lowered, not by JAX's default backend: a half-type
model placed on the CPU of a GPU host takes the XLA forms (it used to trace the Pallas, cuDNN and CUTLASS paths and
fail to lower them for the CPU), and the same program lowered for CUDA carries the GPU kernels its choices name.
On a CPU-only machine the GPU host is pretended (`on_gpu` patched, cuDNN's trace-time checks skipped, the grouped
matmul chosen as Mosaic, which can be traced without a GPU); on a GPU host (JAX_DWDP_TEST_GPU=1) the GPU test places
a bf16 model on the CPU device for real."""

from __future__ import annotations

import ast
import collections
import dataclasses
import importlib
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dwdp.config import ModelConfig
from jax_dwdp.kernels import _backend
from jax_dwdp.kernels import choices as choices_mod
from jax_dwdp.kernels.choices import KernelChoices, env_var

gm = importlib.import_module("jax_dwdp.kernels.grouped_matmul")

# Head and expert widths every GPU kernel takes (Mosaic's grouped matmul needs K % 64 == 0).
CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=4, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=64)
CPU = KernelChoices.defaults("cpu")
GPU_MOSAIC = KernelChoices.defaults("gpu").replace(grouped_matmul="mosaic")  # (Mosaic traces without a GPU)
FIELDS = [f.name for f in dataclasses.fields(KernelChoices)]


@pytest.fixture
def fresh_environment():
    """`KernelChoices.from_environment()` read anew in the test and again after it (the test's variables do not
    leak into the process's choices)."""
    KernelChoices.from_environment.cache_clear()
    yield
    KernelChoices.from_environment.cache_clear()


def _model(kernels: KernelChoices, dtype=jnp.bfloat16, *, fused_swiglu: bool = False):
    from jax_dwdp.model.moe import set_fused_swiglu
    from jax_dwdp.model.qwen35_moe import Qwen35MoeForCausalLM

    model = Qwen35MoeForCausalLM(CFG, dtype=dtype, rngs=nnx.Rngs(3), kernels=kernels)
    return set_fused_swiglu(model, True) if fused_swiglu else model


def _program(model):
    graph, state = nnx.split(model)

    def program():  # a new function each time: the forms are traced
        return jax.jit(lambda state, tokens, lengths: nnx.merge(graph, state).prefill(tokens, lengths)[0])

    return state, program


def _inputs(rng):
    return (jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 24)), jnp.int32), jnp.asarray([24, 17], jnp.int32))


def _pretend_gpu(monkeypatch, present: bool):
    """`on_cuda` (every GPU form that cannot be traced without a GPU sits behind it) hears `present`."""
    monkeypatch.setattr(_backend, "on_gpu", lambda: present)


def _custom_calls(text: str) -> collections.Counter:
    return collections.Counter(re.findall(r"stablehlo\.custom_call @([\w$.]+)", text))


# ---- the record: defaults, the environment, bad values -------------------------------------------------------------


def test_defaults_per_platform(monkeypatch):
    """Only the grouped matmul, the gated delta rule and the SSD scan differ by platform: on a GPU host CUTLASS
    (Mosaic without its library) and the Pallas gated delta rule and SSD scan, elsewhere XLA; every other kernel's
    GPU form is the default wherever (it is chosen when lowered for CUDA).
    An empty environment gives the defaults."""
    from jax_dwdp.kernels import _cutlass

    cpu, gpu = KernelChoices.defaults("cpu"), KernelChoices.defaults("gpu")
    assert (cpu.grouped_matmul, cpu.gdn, cpu.ssd) == ("xla", "xla", "xla") and gpu.gdn == gpu.ssd == "pallas"
    assert {f for f in FIELDS if getattr(cpu, f) != getattr(gpu, f)} == {"grouped_matmul", "gdn", "ssd"}
    assert (cpu.routing, cpu.dispatch, cpu.norm_rope, cpu.conv, cpu.conv_silu) == ("pallas", "pallas", "pallas",
                                                                                  None, "ex2")
    assert (cpu.moe_gather, cpu.moe_merged_projection, cpu.gmm_config, cpu.gmm_cmd_buffer) == (None, None, None, False)
    monkeypatch.setattr(_cutlass, "available", lambda: True)
    assert KernelChoices.defaults("gpu").grouped_matmul == "cutlass"
    monkeypatch.setattr(_cutlass, "available", lambda: False)
    assert KernelChoices.defaults("gpu").grouped_matmul == "mosaic"
    assert KernelChoices.read_environment({}, "cpu") == cpu
    assert KernelChoices.read_environment({env_var(f): "" for f in FIELDS}, "cpu") == cpu  # empty: unset
    assert KernelChoices.defaults() == KernelChoices.defaults(jax.default_backend())


def test_environment_sets_each_field():
    """Every field has its variable (JAX_DWDP_ + the name in capitals); set, it replaces the default."""
    environ = {"JAX_DWDP_GROUPED_MATMUL": "mosaic", "JAX_DWDP_GMM_CONFIG": "coop_128x256x64_c2x1",
               "JAX_DWDP_GMM_CMD_BUFFER": "1", "JAX_DWDP_GATHER_CONFIG": "1", "JAX_DWDP_GATHER_SWIGLU_CONFIG": "0",
               "JAX_DWDP_MOE_GATHER": "0", "JAX_DWDP_MOE_MERGED_PROJECTION": "1", "JAX_DWDP_ROUTING": "xla",
               "JAX_DWDP_DISPATCH": "xla", "JAX_DWDP_CONV": "pallas", "JAX_DWDP_CONV_SILU": "tanh",
               "JAX_DWDP_NORM_ROPE": "xla", "JAX_DWDP_GDN": "pallas", "JAX_DWDP_SSD": "pallas"}
    assert sorted(environ) == sorted(env_var(f) for f in FIELDS)
    got = KernelChoices.read_environment(environ, "cpu")
    assert got == KernelChoices(grouped_matmul="mosaic", gmm_config="coop_128x256x64_c2x1", gmm_cmd_buffer=True,
                                gather_config="1", gather_swiglu_config="0", moe_gather=False,
                                moe_merged_projection=True, routing="xla", dispatch="xla", conv="pallas",
                                conv_silu="tanh", norm_rope="xla", gdn="pallas", ssd="pallas")
    assert all(getattr(got, f) != getattr(CPU, f) for f in FIELDS)


@pytest.mark.parametrize("var,value,allowed", [
    ("JAX_DWDP_GROUPED_MATMUL", "cudnn", "'cutlass', 'mosaic', 'xla'"),
    ("JAX_DWDP_ROUTING", "cub", "'pallas', 'xla'"),
    ("JAX_DWDP_DISPATCH", "triton", "'pallas', 'xla'"),
    ("JAX_DWDP_CONV", "auto", "'pallas', 'xla'"),
    ("JAX_DWDP_CONV_SILU", "exact", "'ex2', 'tanh'"),
    ("JAX_DWDP_NORM_ROPE", "nope", "'pallas', 'xla'"),
    ("JAX_DWDP_GDN", "fast", "'pallas', 'xla'"),
    ("JAX_DWDP_SSD", "triton", "'pallas', 'xla'"),
    ("JAX_DWDP_MOE_GATHER", "yes", "use 1 or 0"),
    ("JAX_DWDP_MOE_MERGED_PROJECTION", "true", "use 1 or 0"),
    ("JAX_DWDP_GMM_CMD_BUFFER", "on", "use 1 or 0"),
])
def test_a_bad_value_is_refused_naming_the_variable(var, value, allowed):
    with pytest.raises(ValueError) as err:
        KernelChoices.read_environment({var: value}, "gpu")
    message = str(err.value)
    assert f"${var}={value!r}" in message and allowed in message, message


def test_variables_of_removed_forms_are_refused():
    """A variable of a form measured slower and removed is refused while set (it would otherwise be ignored
    silently); the field's own checks refuse values given in Python, naming the field."""
    for var in ("JAX_DWDP_GDN_CONV", "JAX_DWDP_COMBINE", "JAX_DWDP_MERGE_QKV"):
        with pytest.raises(ValueError, match=rf"\${var}='1'.*removed"):
            KernelChoices.read_environment({var: "1"}, "cpu")
    assert KernelChoices.read_environment({"JAX_DWDP_COMBINE": ""}, "cpu") == CPU
    with pytest.raises(ValueError, match=r"KernelChoices\.routing='cub' is none of \('pallas', 'xla'\)"):
        CPU.replace(routing="cub")
    with pytest.raises(ValueError, match=r"KernelChoices\.moe_gather=1 is none of"):
        CPU.replace(moe_gather=1)
    with pytest.raises(ValueError, match=r"KernelChoices\.gmm_config=3"):
        CPU.replace(gmm_config=3)
    with pytest.raises(TypeError, match="no field combine"):
        CPU.replace(combine="pallas")
    with pytest.raises(dataclasses.FrozenInstanceError):
        CPU.routing = "xla"


def test_the_environment_is_read_once(monkeypatch, fresh_environment):
    """`from_environment()` reads the variables on its first call; later changes to the environment change neither
    it nor the models built from it (a model built with `kernels=` takes those)."""
    from jax_dwdp.model import abstract_model, init_model

    monkeypatch.setenv("JAX_DWDP_ROUTING", "xla")
    monkeypatch.setenv("JAX_DWDP_MOE_GATHER", "0")
    first = KernelChoices.from_environment()
    assert (first.routing, first.moe_gather) == ("xla", False)
    monkeypatch.setenv("JAX_DWDP_ROUTING", "pallas")
    monkeypatch.setenv("JAX_DWDP_MOE_GATHER", "nonsense")  # not read again, so not refused either
    assert KernelChoices.from_environment() is first
    model = init_model(CFG, dtype=jnp.float32)
    assert model.kernels is first and model.layers[0].mlp.kernels is first
    assert abstract_model(CFG, dtype=jnp.float32).kernels is first
    assert init_model(CFG, dtype=jnp.float32, kernels=CPU).kernels == CPU
    KernelChoices.from_environment.cache_clear()
    with pytest.raises(ValueError, match=r"\$JAX_DWDP_MOE_GATHER='nonsense'"):
        KernelChoices.from_environment()


def test_no_other_module_reads_a_kernel_variable():
    """choices.py is the one module naming a kernel variable as a value (what reading it takes: os.environ[...],
    os.environ.get(...), a constant holding the name); elsewhere they appear in messages and docs only."""
    names = {env_var(f) for f in FIELDS} | set(choices_mod.REMOVED)
    root = Path(choices_mod.__file__).resolve().parents[1]
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "choices.py" and path.parent.name == "kernels":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {node.value}")
    assert not found, found
    text = Path(choices_mod.__file__).read_text()
    assert all(f'"{n}"' in text for n in choices_mod.REMOVED)  # (the check above would see them there)


# ---- the model: its modules hold the choices, its programs follow them ---------------------------------------------


def test_model_modules_hold_the_choices_they_were_built_with():
    """The record reaches every mixer and MoE block as a static attribute: part of the graphdef, so two models
    built with different choices have different graphdefs (their programs are compiled apart), and equal choices
    give equal graphdefs. `with_kernels` swaps them on a copy sharing the weights."""
    from jax_dwdp.model import with_kernels
    from jax_dwdp.model.attention import GatedAttention
    from jax_dwdp.model.gated_deltanet import GatedDeltaNet
    from jax_dwdp.model.moe import SparseMoe

    other = CPU.replace(routing="xla", conv="pallas", moe_gather=True)
    a, b, a2 = _model(CPU, jnp.float32), _model(other, jnp.float32), _model(KernelChoices.defaults("cpu"), jnp.float32)

    def holders(model):
        return [m for _, m in nnx.iter_modules(model) if isinstance(m, (GatedAttention, GatedDeltaNet, SparseMoe))]

    assert len(holders(b)) == 2 * CFG.num_hidden_layers
    assert all(m.kernels == other for m in holders(b)) and all(m.kernels == CPU for m in holders(a))
    assert b.kernels == other
    assert nnx.graphdef(a) != nnx.graphdef(b) and nnx.graphdef(a) == nnx.graphdef(a2)
    swapped = with_kernels(a, other)
    assert nnx.graphdef(swapped) == nnx.graphdef(b) and all(m.kernels == CPU for m in holders(a))
    assert swapped.layers[0].mlp.experts.gate_up_proj is a.layers[0].mlp.experts.gate_up_proj


def test_models_with_different_choices_lower_different_kernels_for_cuda(rng):
    """Two bf16 models of the same weights, one with every Pallas form chosen and one with XLA everywhere, through
    one jitted function keyed by the graphdef: lowered for CUDA the first holds the Pallas kernels (the gated delta
    rule's two, the routing's two, the dispatch, the norm + RoPE pass) and the second none; lowered for this CPU
    both run XLA's forms and give the same logits."""
    from jax_dwdp.model import init_model, with_kernels

    pallas = CPU.replace(routing="pallas", dispatch="pallas", norm_rope="pallas", gdn="pallas")
    xla = CPU.replace(routing="xla", dispatch="xla", norm_rope="xla", gdn="xla")
    cfg = CFG.replace(head_dim=128)  # (norm + RoPE: rotary halves of 16, the rest 64 + 32: pieces the kernel takes)
    base = init_model(cfg, dtype=jnp.bfloat16, seed=3, kernels=pallas)
    tokens, lengths = _inputs(rng)
    run = jax.jit(lambda graph, state, t, n: nnx.merge(graph, state).prefill(t, n)[0], static_argnums=0)
    texts, logits = {}, {}
    for name, model in (("pallas", base), ("xla", with_kernels(base, xla))):
        graph, state = nnx.split(model)
        texts[name] = run.trace(graph, state, tokens, lengths).lower(lowering_platforms=("cuda",)).as_text()
        logits[name] = np.asarray(run(graph, state, tokens, lengths).astype(jnp.float32))
    kernels = {"moe_topk_softmax", "moe_expert_ranks", "moe_dispatch_rows", "attention_norm_rope", "gdn_prep",
               "gdn_recurrence_output"}
    assert set(re.findall(r'name = "(gdn_\w+|moe_\w+|attention_norm_rope)"', texts["pallas"])) == kernels
    assert _custom_calls(texts["pallas"])["__gpu$xla.gpu.triton"] > 0
    assert "__gpu$xla.gpu.triton" not in texts["xla"] and not any(f'"{k}"' in texts["xla"] for k in kernels)
    assert run._cache_size() == 2  # one program per graphdef
    np.testing.assert_array_equal(logits["pallas"], logits["xla"])


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="pretends a GPU host on a CPU-only machine")
def test_half_model_on_a_gpu_host_lowers_kernels_for_cuda_and_xla_for_the_cpu(rng, monkeypatch):
    """A bf16 model with a GPU host's choices (Mosaic for the grouped matmul): lowered for CUDA its program holds
    the GPU kernels, lowered for the CPU none, and run here it equals the model with the CPU's choices."""
    from jax_dwdp.model import with_kernels

    model = _model(CPU)
    tokens, lengths = _inputs(rng)
    state, program = _program(model)
    ref = np.asarray(program()(state, tokens, lengths).astype(jnp.float32))  # a CPU machine: XLA forms only

    from jax._src.cudnn import fused_attention_stablehlo as cudnn_checks

    monkeypatch.setattr(cudnn_checks, "check_cudnn_version", lambda *a, **k: None)
    monkeypatch.setattr(cudnn_checks, "check_compute_capability", lambda *a, **k: True)
    _pretend_gpu(monkeypatch, True)
    state, program = _program(with_kernels(model, GPU_MOSAIC))
    fn = program()
    traced = fn.trace(state, tokens, lengths)
    calls = _custom_calls(traced.lower(lowering_platforms=("cuda",)).as_text())
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
    """A bf16 model with the GPU host's default choices and its inputs put on the CPU device of a GPU host: the
    program runs there, and equals the same weights' program with the CPU's choices and the GPU forms left out
    altogether (the same XLA forms lowered for the CPU). fused_swiglu: the opt-in interleaved layout, whose CUTLASS
    epilogue kernel is the default for it on the GPU."""
    from jax_dwdp.model import with_kernels

    model = _model(KernelChoices.defaults("gpu"), fused_swiglu=fused_swiglu)
    tokens, lengths = _inputs(rng)
    cpu = jax.devices("cpu")[0]
    state, program = _program(model)
    state_c, tokens_c, lengths_c = jax.device_put((state, tokens, lengths), cpu)
    got = program()(state_c, tokens_c, lengths_c)
    assert got.devices() == {cpu}
    _pretend_gpu(monkeypatch, False)
    _, reference = _program(with_kernels(model, CPU))
    ref = reference()(state_c, tokens_c, lengths_c)
    got, ref = np.asarray(got.astype(jnp.float32)), np.asarray(ref.astype(jnp.float32))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, ref)
    print(f"bf16 model on the GPU host's CPU: logits equal to the XLA-only program (max |logit| {np.abs(got).max():.2f})")


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="pretends a GPU host on a CPU-only machine")
def test_fused_swiglu_on_a_gpu_host_lowers_the_epilogue_kernel_for_cuda_and_the_group_loop_for_the_cpu(
        rng, monkeypatch):
    """The opt-in fused SwiGLU (interleaved gate_up, chosen by default for bf16 where CUTLASS is built): lowered for
    CUDA it is the epilogue kernel's custom call (its command-buffer handler with `gmm_cmd_buffer`, the tile the
    choices prefer passed on); lowered for the CPU, the group loop and the activation, equal to the unfused XLA
    path. (The CUTLASS call is a stand-in here: its library needs a GPU to load.)"""
    from jax_dwdp.kernels import _cutlass as cutlass

    groups, k, inter = 4, 64, 32
    sizes = jnp.asarray([5, 0, 9, 3], jnp.int32)
    x = jnp.asarray(rng.standard_normal((20, k)), jnp.bfloat16)  # 3 rows past sum(sizes)
    w = gm.interleave_gate_up(jnp.asarray(rng.standard_normal((groups, 2 * inter, k)) / 8, jnp.bfloat16))
    ref = np.asarray(gm.grouped_matmul_swiglu(x, w, sizes, kernels=CPU).astype(jnp.float32))  # XLA
    assert np.isfinite(ref).all() and np.abs(ref[:17]).max() > 0

    _pretend_gpu(monkeypatch, True)
    preferred = []

    def stand_in(target, names, n_out, x, w, s, config, preferred_config=None, cmd_buffer=False):
        preferred.append(preferred_config)
        target += cutlass.CMD_BUFFER_SUFFIX if cmd_buffer else ""
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], n_out), x.dtype))(x, w, s)

    monkeypatch.setattr(cutlass, "_call", stand_in)
    for cmd_buffer in (False, True):
        kernels = GPU_MOSAIC.replace(grouped_matmul="cutlass", gmm_config="3", gmm_cmd_buffer=cmd_buffer)
        fn = jax.jit(lambda x, w, s: gm.grouped_matmul_swiglu(x, w, s, kernels=kernels))
        traced = fn.trace(x, w, sizes)
        target = cutlass.SWIGLU_TARGET + (cutlass.CMD_BUFFER_SUFFIX if cmd_buffer else "")
        assert _custom_calls(traced.lower(lowering_platforms=("cuda",)).as_text()) == {target: 1}
        assert cutlass.SWIGLU_TARGET not in traced.lower(lowering_platforms=("cpu",)).as_text()
        got = np.asarray(fn(x, w, sizes).astype(jnp.float32))  # lowered for this CPU: the group loop
        np.testing.assert_array_equal(got, ref)
    assert preferred == ["3", "3"]

"""kernels.streams: a layer's independent work (the MoE's shared expert, Gated DeltaNet's z projection) on a second
CUDA stream. On the CPU the annotation is made by pretending the backend is a GPU (`streams.on_gpu` patched): the
program lowered for CUDA carries the stream annotation on exactly those calls, and the same program run on the CPU
(where XLA ignores the stream) gives the same numbers as without it, within the dots' rounding. The GPU timing and equality:
tests/test_gpu.py, benchmarks/bench_layer_parts.py --variants streams."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_dwdp.config import ModelConfig
from jax_dwdp.kernels import streams

ANNOTATION = '_xla_stream_annotation = "1"'


@pytest.fixture
def on_stream(monkeypatch):
    monkeypatch.setenv(streams.ENV, "1")
    monkeypatch.setattr(streams, "on_gpu", lambda: True)


def _annotated_calls(text: str) -> list[str]:
    """The annotated calls made by the program's main function (calls inside an annotated function carry the
    annotation too)."""
    main = text.split("func.func public @main", 1)[1].split("func.func ", 1)[0]
    return [line for line in main.splitlines() if ANNOTATION in line and " call @" in line]


def test_side_is_inline_unless_asked(monkeypatch):
    x = jnp.arange(12.0).reshape(3, 4)
    monkeypatch.delenv(streams.ENV, raising=False)
    text = jax.jit(lambda x: streams.side(jnp.sin, x)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert ANNOTATION not in text
    monkeypatch.setenv(streams.ENV, "1")  # asked, but the backend is the CPU: still inline
    assert not streams.enabled()
    monkeypatch.setenv(streams.ENV, "yes")
    with pytest.raises(ValueError, match="JAX_DWDP_STREAMS='yes'"):
        streams.enabled()


def test_side_annotates_the_call_and_keeps_its_value(on_stream):
    rng = np.random.default_rng(0)
    x, w = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((8, 16), (16, 16)))
    f = jax.jit(lambda x, w: streams.side(lambda a, b: jnp.tanh(a @ b), x, w) + x @ w)
    text = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    assert len(_annotated_calls(text)) == 1, text
    np.testing.assert_array_equal(np.asarray(f(x, w)), np.asarray(jnp.tanh(x @ w) + x @ w))


def _functions(text: str) -> dict[str, str]:
    """The lowered module's functions by name (quoted names keep their quotes), each with its body."""
    out = {}
    for chunk in text.split("func.func ")[1:]:
        name = re.match(r'(?:private |public )?@("[^"]*"|[\w$.-]+)', chunk).group(1)
        out[name] = chunk
    return out


def test_annotated_calls_nest_no_call(rng, on_stream):
    """XLA:GPU cannot run a call nested inside a stream-annotated one ('No ExecutionStreamId found for %call-start
    ... only reachable through embedded calls', fourteenth session's run F: jax.nn.silu / sigmoid are themselves
    jitted): no function that the model calls on the second stream calls another."""
    from jax_dwdp.model.qwen35_moe import Qwen35MoeForCausalLM

    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=4)
    graph, state = nnx.split(Qwen35MoeForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(3)))
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
    fn = jax.jit(lambda state, tokens, lengths: nnx.merge(graph, state).prefill(tokens, lengths)[0])
    text = fn.trace(state, tokens, jnp.asarray([24, 17], jnp.int32)).lower(lowering_platforms=("cpu",)).as_text()
    funcs = _functions(text)
    callees = re.findall(r'call @("[^"]*"|[\w$.-]+)\([^\n]*' + re.escape(ANNOTATION), text)
    assert len(callees) == sum(1 for t in cfg.layer_types if t == "linear_attention") + cfg.num_hidden_layers
    nested = {c: re.findall(r' call @("[^"]*"|[\w$.-]+)', funcs[c]) for c in callees}
    assert not any(nested.values()), f"calls nested inside annotated calls: {nested}"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_model_layers_put_shared_expert_and_z_on_the_second_stream(rng, monkeypatch, dtype):
    """A tiny model (3 linear-attention + 1 full-attention layer): lowered for CUDA with streams on, one annotated call
    per MoE (the shared expert) and per Gated DeltaNet (z), none in full attention; run on the CPU its logits equal
    the default's exactly."""
    from jax_dwdp.model.qwen35_moe import Qwen35MoeForCausalLM

    cfg = ModelConfig.preset("tiny").replace(num_hidden_layers=4)
    model = Qwen35MoeForCausalLM(cfg, dtype=dtype, rngs=nnx.Rngs(3))
    graph, state = nnx.split(model)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
    lengths = jnp.asarray([24, 17], jnp.int32)

    def program():  # a new function each time: jax caches a function's trace, and the choice is made when tracing
        return jax.jit(lambda state, tokens, lengths: nnx.merge(graph, state).prefill(tokens, lengths)[0])

    monkeypatch.delenv(streams.ENV, raising=False)
    ref = np.asarray(program()(state, tokens, lengths).astype(jnp.float32))
    monkeypatch.setenv(streams.ENV, "1")
    monkeypatch.setattr(streams, "on_gpu", lambda: True)
    fn = program()
    text = fn.trace(state, tokens, lengths).lower(lowering_platforms=("cpu",)).as_text()
    linear = sum(1 for t in cfg.layer_types if t == "linear_attention")
    assert len(_annotated_calls(text)) == linear + cfg.num_hidden_layers, "one per GDN mixer, one per MoE block"
    got = np.asarray(fn(state, tokens, lengths).astype(jnp.float32))
    assert np.isfinite(ref).all()
    # The same math, but XLA fuses differently around a call it may not inline (the router's matmul is no longer
    # merged with the shared expert's), so the roundings of the dots may differ: within fp32 / bf16 rounding.
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    print(f"{jnp.dtype(dtype).name}: logits with the second stream vs without: {err:.2e}")
    assert err <= (1e-5 if dtype == jnp.float32 else 2e-2), err

"""Independent work of a layer on a second CUDA stream (XLA's stream annotation, `compute_on("gpu_stream:1")`).

Inside one layer some work does not depend on the chain beside it: the MoE's shared expert and its gate (about
0.25 ms at 16K tokens on 35b-a3b) need only the layer's input, while the routing, sort, dispatch and grouped GEMMs
run; Gated DeltaNet's z projection (about 0.33 ms) is read only by the output norm, after the conv and the gated
delta rule. XLA puts every kernel of a program on one stream, so such work waits its turn although the memory-bound
permutation kernels and the latency-bound recurrence leave the GPU partly idle.

`side(fn, *args)` runs fn(*args) as a call annotated for stream 1: XLA makes it an async call-start / call-done
pair, launches its kernels on a second stream and waits for them where the result is first used. The math is the
same; XLA may fuse the dots around a call it does not inline differently (the router's matmul is then not merged
with the shared expert's gate/up), so fp32 results can differ in the last bits (1.3e-6 of the logits on the CPU,
tests/test_streams.py).

An annotated function must not call another (XLA:GPU finds no stream for a call nested inside an annotated one and
fails at run time: 'No ExecutionStreamId found'), so the functions given to `side` use lax.logistic rather than
jax.nn.silu / sigmoid, which are themselves jitted (tests/test_streams.py checks the model's annotated calls).

$JAX_DWDP_STREAMS = 1 | 0 chooses; the default is off (opt-in until measured on the GPU: benchmarks/RESULTS.md).
Only where the default backend is a GPU (decided at trace time, as the grouped matmul decides): on the CPU the
annotation would only keep XLA from inlining the call.
"""

from __future__ import annotations

import inspect
import os

import jax

from jax_dwdp.kernels._backend import on_gpu

ENV = "JAX_DWDP_STREAMS"
SIDE_STREAM = "gpu_stream:1"


def enabled() -> bool:
    """Whether `side` moves work to the second stream: $JAX_DWDP_STREAMS (1 or 0; default 0) on a GPU backend."""
    value = os.environ.get(ENV, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected 1 (the second stream) or 0")
    return value == "1" and on_gpu()


def side(fn, *args):
    """fn(*args), on the second stream when `enabled()` (see the module's docstring), else inline."""
    if not enabled():
        return fn(*args)
    from jax.experimental import compute_on as api

    if "out_memory_spaces" in inspect.signature(api.compute_on).parameters:
        # jax >= 0.11.1: a transform that traces fn into its own annotated computation
        device = jax.memory.Space.Device if hasattr(jax, "memory") else _core_device_space()
        return api.compute_on(fn, compute_type=SIDE_STREAM, out_memory_spaces=device)(*args)
    with api.compute_on(SIDE_STREAM):  # through jax 0.11.0: a context manager around a jitted call
        return jax.jit(fn)(*args)


def _core_device_space():
    from jax._src import core

    return core.MemorySpace.Device

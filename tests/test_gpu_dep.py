"""DEP and per-rank memory on two (or four) GPUs (skipped otherwise; run with JAX_DWDP_TEST_GPU=1).

- DEP (experts="dep": tokens all-gathered over NCCL, partial outputs back with an all-to-all) equals one GPU:
  fp32 <= 1e-5, bf16 <= 2e-2 (the bounds of tests/test_gpu_dwdp.py), also with a batch the ranks do not divide;
- peak device memory per rank: a `jax-dwdp prefill` of 35B-A3B shapes (8 layers) over 2 ranks, each scheme in its
  own process, stays within `jax-dwdp plan`'s resident bytes + expert buffers + activations, where activations are
  what one GPU needs beyond its weights for the same tokens (measured in a process of its own). Before the stages
  were built one layer at a time, GPU 0 held a whole stage's experts plus its own block (95 GiB for 40 layers
  where its share is ~35 GiB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import Cache, init_model
from jax_dwdp.parallel import Pipeline
from jax_dwdp.prefill import jit_prefill
from tests.hf_reference import rel_err

# The two-GPU skip and the small model (6 experts over 2 ranks) of the DWDP GPU tests.
from tests.test_gpu_dwdp import SMALL, pytestmark  # noqa: F401 (pytestmark applies here)


@pytest.mark.parametrize("dtype,bound", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_dep_equals_one_gpu(rng, dtype, bound):
    model = init_model(SMALL, dtype=dtype, seed=int(rng.integers(1 << 30)))
    seq = 96
    tokens = rng.integers(0, SMALL.vocab_size, (4, seq)).astype(np.int32)
    lengths = rng.integers(seq // 2, seq + 1, 4).astype(np.int32)
    lengths[0] = seq
    layouts = [(1, 2)] + ([(1, 4), (2, 2)] if jax.device_count() >= 4 else [])
    for batch in (4, 3):
        want, want_cache = jit_prefill(model, cache_len=seq)(tokens[:batch], lengths[:batch])
        for pipeline, ranks in layouts:
            for layerwise in (False, True):
                pipe = Pipeline.from_model(model, pipeline, dwdp=ranks, experts="dep")
                got, caches = pipe.prefill(tokens[:batch], lengths[:batch], cache_len=seq, layerwise=layerwise)
                cache = Cache.concat_layers(caches, jax.devices()[0])
                errs = {"logits": rel_err(got, want), **{f: rel_err(getattr(cache, f), getattr(want_cache, f))
                                                         for f in ("key", "value", "conv", "recurrent")}}
                print(f"{jnp.dtype(dtype).name} dep P={pipeline} N={ranks} batch {batch} layerwise={layerwise} vs one "
                      "GPU: " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()) + f" (bound {bound})")
                assert np.isfinite(np.asarray(got, np.float32)).all()
                assert all(v <= bound for v in errs.values()), errs


def _prefill(*argv) -> dict:
    """One `jax-dwdp prefill ... --json` in a process of its own (its own peak memory)."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run([sys.executable, "-m", "jax_dwdp.cli", "prefill", "--preset", "35b-a3b", "--num-layers", "8",
                           "--seq-len", "2048", "--layerwise", "--iters", "1", "--json", *argv],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_peak_memory_per_rank_within_plan():
    from jax_dwdp.plan import plan_layout

    cfg = ModelConfig.preset("35b-a3b").replace(num_hidden_layers=8)
    gib = 2**30
    one_rank = plan_layout(cfg, 1, 1, jnp.bfloat16)[0]
    activations = {}
    for batch in (1, 2):  # one GPU: its peak minus its weights is what the tokens need
        out = _prefill("--batch", str(batch))
        activations[batch] = out["peak_device_memory_bytes"] - one_rank["weight_bytes"]
        print(f"one GPU, batch {batch} x 2048: peak {out['peak_device_memory_bytes'] / gib:.2f} GiB, weights "
              f"{one_rank['weight_bytes'] / gib:.2f} GiB, activations {activations[batch] / gib:.2f} GiB")
    dwdp = plan_layout(cfg, 1, 2, jnp.bfloat16)[0]
    dep = plan_layout(cfg, 1, 2, jnp.bfloat16, dep=True)[0]
    cases = {  # name: (CLI flags, per-rank bound without activations, activations, bytes outside XLA per rank)
        "dwdp ffi": (["--dwdp", "2", "--dwdp-backend", "ffi"],
                     [r["resident_bytes"] + r["prefetch_buffer_bytes"] + r["store_slot_bytes"]
                      for r in dwdp["dwdp_ranks"]], activations[1],
                     [r["resident_expert_bytes"] + r["store_slot_bytes"] for r in dwdp["dwdp_ranks"]]),
        "dwdp xla": (["--dwdp", "2"], [r["resident_bytes"] + r["xla_gather_buffer_bytes"] for r in dwdp["dwdp_ranks"]],
                     activations[1], [0, 0]),
        # DEP's MoE sees every rank's tokens: the activations of one GPU running the whole batch bound it.
        "dep": (["--dep", "2"], [r["resident_bytes"] for r in dep["dwdp_ranks"]], activations[2], [0, 0]),
        "replicated": (["--dwdp", "2", "--dwdp-backend", "local"], [one_rank["weight_bytes"]] * 2, activations[1],
                       [0, 0]),
    }
    failures = []
    for name, (flags, resident, act, outside) in cases.items():
        out = _prefill("--batch", "2", *flags)
        peaks = [p + o for p, o in zip(out["peak_device_memory_bytes_per_device"], outside)]
        bounds = [r + act for r in resident]
        slack = 0.03 * max(bounds) + 256 * 2**20  # allocator rounding, compiled programs' scratch
        print(f"{name}: peak per rank {[round(p / gib, 2) for p in peaks]} GiB, plan resident + buffers + "
              f"activations {[round(b / gib, 2) for b in bounds]} GiB (+{slack / gib:.2f} slack)")
        if any(p > b + slack for p, b in zip(peaks, bounds)):
            failures.append(name)
    assert not failures, failures

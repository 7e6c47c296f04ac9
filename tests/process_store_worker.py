"""The worker of tests/test_gpu_process_launch.py: one process of a two-process jax.distributed launch that runs
the tiny model's prefill as DWDP rank PID over the CUDA VMM store (`Pipeline(..., experts="ffi")`) and writes its
own rows of the logits and its store's facts into OUT.

    python -m tests.process_store_worker COORDINATOR PID OUT SOURCE      (SOURCE: random, aligned, or an HF folder)

(A module of its own: jax.distributed must start before anything touches a device, which a test module's
import does.)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

# 4 sequences over 2 ranks, two each (a batch the ranks do not divide would take the first rows of the padded
# logits, a program over both processes' devices that needs a collective: not possible on one shared GPU)
BATCH, SEQ = 4, 40


def _aligned():
    from jax_dwdp.config import ModelConfig

    # fp32, 4 experts per rank: gate_up blocks 4 x 512 x 512 x 4 B = 4 MiB, down 2 MiB
    return ModelConfig.preset("tiny").replace(num_hidden_layers=3, vocab_size=300, hidden_size=512,
                                              moe_intermediate_size=256, num_experts=8, num_experts_per_tok=2)


def _tokens(cfg):
    rng = np.random.default_rng(7)
    lengths = np.array([SEQ, SEQ - 9, SEQ - 17, SEQ - 3], np.int32)
    return rng.integers(0, cfg.vocab_size, (BATCH, SEQ)).astype(np.int32), lengths


def _pipeline(source: str, **kwargs):
    """The tiny model: random weights (seed 3), or the HF checkpoint folder `source`, fp32."""
    import jax.numpy as jnp

    from jax_dwdp.config import ModelConfig
    from jax_dwdp.parallel import Pipeline

    if source == "random":
        return Pipeline.random(ModelConfig.preset("tiny"), 1, dtype=jnp.float32, seed=3, **kwargs)
    if source == "aligned":  # rank blocks of 2 MiB multiples: the store reads its experts in place
        return Pipeline.random(_aligned(), 1, dtype=jnp.float32, seed=3, **kwargs)
    return Pipeline.from_checkpoint(source, 1, dtype=jnp.float32, **kwargs)


def _worker(coordinator: str, pid: str, out: str, source: str) -> None:
    pid = int(pid)
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    from jax_dwdp.distributed import initialize

    initialize(coordinator, 2, pid, timeout_s=120)
    from jax_dwdp.parallel.dwdp_ffi import ProcessExpertStore, live_objects

    with _pipeline(source, dwdp=2, experts="ffi") as pipe:
        tokens, lengths = _tokens(pipe.cfg)
        store = pipe.stores[0]
        kind, mode = type(store).__name__, store.info()["mode"]
        assert isinstance(store, ProcessExpertStore) and store.connected, kind
        logits, _ = pipe.prefill(tokens, lengths, logits="all", layerwise=True)
        rows = {int(s.index[0].start or 0): np.asarray(s.data) for s in logits.addressable_shards}
    start, = rows
    np.save(Path(out) / f"logits_{pid}_{start}.npy", rows[start])
    (Path(out) / f"report_{pid}.json").write_text(json.dumps({"store": kind, "rank": store.rank, "mode": mode,
                                                              "live": live_objects()}))


if __name__ == "__main__":
    _worker(*sys.argv[1:])

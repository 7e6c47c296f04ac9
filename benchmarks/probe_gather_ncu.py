"""The gate_up projection's two kernels side by side under Nsight Compute (GPU, the CUTLASS library built): the gather +
SwiGLU kernel (rows gathered by cp.async) and CUTLASS's TMA grouped GEMM on the same rows gathered beforehand,
35b-a3b shapes at 16K tokens, uniform routing; three calls of each (profile the later ones).

    ncu --clock-control none --kernel-name regex:"gather_gemm_kernel|device_kernel" --launch-skip 4 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy python3 benchmarks/probe_gather_ncu.py
"""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_grouped_matmul import routing_for
from jax_dwdp.kernels import _cutlass
from jax_dwdp.kernels.permute import gather_rows
T, E, K, H, I = 16384, 256, 8, 2048, 512
ids, _, counts = routing_for(np.random.default_rng(0), T, E, K, "uniform")
gs = jnp.asarray(counts)
tok = jnp.asarray((np.argsort(ids.reshape(-1), kind="stable") // K).astype(np.int32))
x = jax.random.normal(jax.random.key(4), (T, H), jnp.bfloat16)
w = (jax.random.normal(jax.random.key(2), (E, 2 * I, H), jnp.float32) * H**-0.5).astype(jnp.bfloat16)
rows = jax.block_until_ready(gather_rows(x, tok))
f = jax.jit(lambda x, t, w, s: _cutlass.grouped_matmul_gather_swiglu(x, t, w, s))
g = jax.jit(lambda a, w, s: _cutlass.grouped_matmul(a, w, s, config="coop_128x256x64_c1x1"))
for _ in range(3):
    jax.block_until_ready(f(x, tok, w, gs)); jax.block_until_ready(g(rows, w, gs))
print("done")

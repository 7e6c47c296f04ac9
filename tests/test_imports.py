"""Importing jax_dwdp and running its XLA paths loads no CUDA Python library (CPU-only machines must work)."""

import subprocess
import sys

CODE = """
import sys
import jax_dwdp, jax_dwdp.cli, jax_dwdp.parallel, jax_dwdp.parallel.dwdp, jax_dwdp.weights.hf_loader
from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.parallel import Pipeline
import numpy as np
cfg = ModelConfig.preset("tiny")
logits, _ = Pipeline.random(cfg, 1, dwdp=2).prefill(np.ones((2, 8), np.int32), logits="last")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("cuda", "cupy", "torch", "jax_dwdp_ffi"))
print("LOADED", loaded)
"""


def test_no_cuda_or_torch_modules_are_imported():
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout, proc.stdout

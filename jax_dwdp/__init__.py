"""jax_dwdp: long-context MoE prefill in JAX.

Qwen3.5-MoE (gated attention, Gated DeltaNet, sparse MoE) in Flax NNX, with pipeline parallelism and DWDP
(distributed weight data parallelism). Importing this package never loads CUDA libraries; GPU-only code is
imported when a GPU path is chosen.
"""

from jax_dwdp.config import ConfigError, ModelConfig, PRESETS

__version__ = "0.1.0"

__all__ = ["ConfigError", "ModelConfig", "PRESETS", "__version__"]

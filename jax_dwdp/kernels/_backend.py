"""Which platform a jitted computation is being lowered for."""

import jax


def default_platform() -> str:
    """The platform of the default backend ('cpu', 'gpu', 'tpu'); decides kernel choices at trace time."""
    return jax.default_backend()


def on_gpu() -> bool:
    return default_platform() == "gpu"

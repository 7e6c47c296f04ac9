"""Parallelism over a device mesh: pipeline stages and DWDP ranks."""

from jax_dwdp.devices import AXES, make_mesh
from jax_dwdp.parallel.pipeline import Pipeline, StageSpec, plan_stages

__all__ = ["AXES", "Pipeline", "StageSpec", "make_mesh", "plan_stages"]

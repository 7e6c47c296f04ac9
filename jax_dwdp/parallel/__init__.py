"""Parallelism over a device mesh: pipeline stages, and DWDP / DEP ranks with their expert backends."""

from jax_dwdp.devices import AXES, make_mesh
from jax_dwdp.parallel.backends import BACKENDS, ExpertBackend, expert_backend
from jax_dwdp.parallel.dwdp import IndependentRanks
from jax_dwdp.parallel.pipeline import Pipeline, StageSpec, plan_stages

__all__ = ["AXES", "BACKENDS", "ExpertBackend", "IndependentRanks", "Pipeline", "StageSpec", "expert_backend",
           "make_mesh", "plan_stages"]

"""A layout's plan from shapes alone (nothing is allocated): per stage its layers, weight and cache bytes, and per
rank its experts, resident bytes and buffers; with a GPU profile, the planner's prediction. What `jax-dwdp plan`
prints (`plan`)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp

from jax_dwdp.families import FamilyConfig
from jax_dwdp.parallel.expert_layout import ExpertLayout, expert_bytes_per_layer, rank_memory
from jax_dwdp.parallel.pipeline import (cache_bytes_per_sequence, cache_bytes_per_token, plan_stages,
                                        stage_weight_bytes)
from jax_dwdp.planner import PlannerError, predict, prediction_inputs


def plan_layout(cfg: FamilyConfig, pipeline: int, ranks: int, dtype, *, boundaries=None,
                dep: bool = False) -> list[dict]:
    """Per stage: layers, weight and cache bytes, and per rank its experts, resident bytes (non-expert weights + its
    expert block) and buffers (dep=True: none, the experts never move). `dtype`: a numpy / jax dtype or its name."""
    stages = plan_stages(cfg, pipeline, boundaries)
    layout = ExpertLayout(cfg.num_experts, ranks)
    dtype = jnp.dtype(dtype)
    itemsize = dtype.itemsize
    out = []
    for st in stages:
        moe_layers = len(st.moe_layers)
        weights = stage_weight_bytes(cfg, st, dtype)
        non_expert = weights - moe_layers * cfg.num_experts * expert_bytes_per_layer(cfg, itemsize)
        # One rank holds every expert: nothing is fetched, so there are no prefetch or gather buffers.
        rank_rows = [dict(rank_memory(cfg, layout, r, moe_layers, itemsize, prefetch=not dep and ranks > 1,
                                      non_expert_bytes=non_expert), device=st.stage * ranks + r)
                     for r in range(ranks)]
        out.append({
            "stage": st.stage,
            "start_layer": st.start_layer,
            "end_layer": st.end_layer,
            "linear_attention_layers": list(st.linear_attention_layers),
            "full_attention_layers": list(st.full_attention_layers),
            "moe_layers": list(st.moe_layers),
            "weight_bytes": weights,
            "non_expert_weight_bytes": non_expert,
            "cache_bytes_per_token": cache_bytes_per_token(cfg, st, dtype),
            "cache_bytes_per_sequence": cache_bytes_per_sequence(cfg, st, dtype),
            # Positions in jax.devices() order: row `stage` of the (pipeline, dwdp) mesh.
            "devices": list(range(st.stage * ranks, (st.stage + 1) * ranks)),
            "dwdp_ranks": rank_rows,
        })
    return out


def plan(cfg: FamilyConfig, pipeline: int, ranks: int, dtype: str, *, boundaries=None, dep: bool = False,
         profile: str | Path | None = None, link: str | None = None, stream: str | None = None, **options) -> dict:
    """What `jax-dwdp plan` reports of a layout: the model, its stages (`plan_layout`) and, given a GPU `profile`
    (with its `link` and `stream`, read by planner.prediction_inputs), the predicted times of DWDP, DEP and
    replicated weights (planner.predict, with `options`: requests, seed, bucket, dep_exchange, crossover; None
    leaves predict's default). The performance model's parameters without a profile would do nothing: PlannerError."""
    options = {name: value for name, value in options.items() if value is not None}
    given = [name for name, value in (("link", link), ("stream", stream), *options.items()) if value is not None]
    if profile is None and given:  # (the stream's seed as predict names it: $stream_seed, "seed" in Python)
        named = ", ".join("$stream_seed" if name == "seed" else "$" + name for name in given)
        raise PlannerError(f"{named} {'is' if len(given) == 1 else 'are'} for the performance model: add $profile "
                           "h200|h100|FILE", stream_seed="seed")
    out = {"model": cfg.summary(), "dtype": dtype, "pipeline": pipeline,
           "stages": plan_layout(cfg, pipeline, ranks, dtype, boundaries=boundaries, dep=dep)}
    if profile is not None:
        out["performance"] = predict(cfg, *prediction_inputs(profile, link, stream, dtype=dtype), pipeline=pipeline,
                                     ranks=ranks, boundaries=boundaries, itemsize=jnp.dtype(dtype).itemsize,
                                     **options)
    return out

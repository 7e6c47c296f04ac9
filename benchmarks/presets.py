"""The model that a benchmark's --preset and --num-layers name, for the scripts that run either family
(bench_prefill.py, bench_transformers.py). It imports no JAX: the transformers reference runs in a process of its
own and reads the same configs."""

from __future__ import annotations

import argparse

from jax_dwdp.config import ConfigError, ModelConfig
from jax_dwdp.families import FamilyConfig, config_from_preset

PRESET_HELP = "FAMILY:NAME (qwen3.5:35b-a3b, nemotron-h:nano-30b-a3b, ...; a bare name is Qwen3.5-MoE's)"


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--preset", default="35b-a3b", help=PRESET_HELP)
    ap.add_argument("--num-layers", type=int, help="keep only the first N layers")


def model_config(ap: argparse.ArgumentParser, args: argparse.Namespace) -> FamilyConfig:
    """The preset's config, of its family, cut to --num-layers; a name or a layer count that does not fit is a usage
    error (ap.error). A Qwen3.5-MoE preset takes any number of layers (its pattern follows num_hidden_layers);
    a Nemotron-H one keeps the first N layers of its pattern."""
    try:
        cfg = config_from_preset(args.preset)
    except ConfigError as e:
        ap.error(str(e))
    if isinstance(cfg, ModelConfig):
        return cfg.replace(num_hidden_layers=args.num_layers) if args.num_layers else cfg
    if args.num_layers is not None:
        try:
            cfg = cfg.first_layers(args.num_layers)
        except ConfigError as e:
            ap.error(f"--num-layers: {e}")
    return cfg

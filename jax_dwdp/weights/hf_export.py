"""A jax_dwdp model written as a Hugging Face folder (config.json and one model.safetensors, the text model's names):
a small checkpoint to try `jax-dwdp convert`, `verify` and `prefill --checkpoint` on, without downloading one. With
a small byte-level tokenizer (tokenizer.json, a ChatML tokenizer_config.json) unless --no-tokenizer, so that
`prefill --prompt TEXT --generate N` runs too (random weights: the text it writes is noise).

    python -m jax_dwdp.weights.hf_export OUT_DIR [--preset tiny | nemotron-h:tiny] [--seed 0] [--dtype float32|bfloat16]

Either family: a Qwen3.5-MoE model under `model.` (fused expert tensors), a Nemotron-H model under `backbone.` (fused
expert tensors too; the loader also reads the per-expert pieces NVIDIA's releases store).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from jax_dwdp.families import FamilyConfig, config_from_preset, preset_names
from jax_dwdp.model import CausalLM, init_model
from jax_dwdp.text import write_small_tokenizer
from jax_dwdp.weights.hf_loader import NAMINGS

PREFIX = {"Qwen3.5-MoE": "model.", "Nemotron-H": "backbone."}  # the text model's names in each family's folders


def save_hf_checkpoint(model: CausalLM, cfg: FamilyConfig, directory: str | Path) -> Path:
    """Writes `model` (all of its layers, of either family) to `directory`, which must not exist yet; returns it."""
    naming = NAMINGS[type(cfg)]
    directory = Path(directory)
    directory.mkdir(parents=True)  # (an existing folder is refused: nothing of the user's is overwritten)
    tensors = {naming.names.hf_name(path, 0, PREFIX[naming.family]): np.asarray(var.get_value())
               for path, var in nnx.to_flat_state(nnx.state(model))}
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))
    return directory


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_dwdp.weights.hf_export", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="the HF folder to write (must not exist)")
    ap.add_argument("--preset", default="tiny", help=f"tiny (default) | {' | '.join(preset_names())}")
    ap.add_argument("--num-layers", type=int, help="keep only the first N layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--no-tokenizer", action="store_true", help="write no tokenizer files")
    args = ap.parse_args(argv)
    if args.out_dir.exists():
        print(f"error: {args.out_dir} exists; give a new folder", file=sys.stderr)
        return 2
    cfg = config_from_preset(args.preset)
    if args.num_layers is not None:
        cfg = cfg.first_layers(args.num_layers)
    model = init_model(cfg, dtype=jnp.dtype(args.dtype), seed=args.seed)
    save_hf_checkpoint(model, cfg, args.out_dir)
    tokenizer = ""
    if not args.no_tokenizer:
        write_small_tokenizer(args.out_dir, min(cfg.vocab_size, 512))
        tokenizer = ", a small byte-level tokenizer"
    print(f"wrote {args.out_dir}: {cfg.summary()}, random weights (seed {args.seed}), {args.dtype}{tokenizer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

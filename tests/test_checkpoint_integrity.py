"""Damaged Orbax data: checksums written by convert and checked on load (a DWDP rank only its own experts'),
`jax-dwdp verify`, and one line naming the layer, tensor and file, without Orbax's traceback spam."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.cli import main
from jax_dwdp.config import ModelConfig
from jax_dwdp.weights import convert_hf_to_orbax, integrity, load_checkpoint, load_orbax_checkpoint, verify_checkpoint
from jax_dwdp.weights.safetensors_reader import CheckpointError
from tests.checkpoint_helpers import flat, write_hf

CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=3, vocab_size=40)
CHUNK = "layers/001/mlp.experts.down_proj/{e}.0.0"  # expert e's chunk of one layer's down_proj


@pytest.fixture(scope="module")
def orbax_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    hf = write_hf(root / "hf", CFG, seed=int(np.random.default_rng().integers(1 << 30)))
    convert_hf_to_orbax(hf, root / "orbax", progress=None)
    return root / "orbax"


@pytest.fixture
def damaged(orbax_dir, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(orbax_dir, copy)
    return copy


def truncate(f: Path, rng) -> None:
    f.write_bytes(f.read_bytes()[: int(rng.integers(1, f.stat().st_size))])


def empty(f: Path, rng) -> None:
    f.write_bytes(b"")


def random_bytes(f: Path, rng) -> None:  # same size: only the checksum can tell
    f.write_bytes(rng.integers(0, 256, f.stat().st_size, dtype=np.uint8).tobytes())


def remove(f: Path, rng) -> None:
    f.unlink()


DAMAGE = [(truncate, "bytes, expected"), (empty, "0 bytes, expected"), (random_bytes, "checksum"),
          (remove, "missing")]


@pytest.mark.parametrize("damage,message", DAMAGE, ids=[d.__name__ for d, _ in DAMAGE])
def test_damaged_chunk_is_named_by_load_and_verify(damaged, capsys, rng, damage, message):
    e = int(rng.integers(CFG.num_experts))
    f = damaged / CHUNK.format(e=e)
    damage(f, rng)
    want = f"{f}: "
    for argv in (["verify", str(damaged)], ["prefill", "--checkpoint", str(damaged), "--seq-len", "4", "--iters", "1",
                                            "--json"]):
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (argv, err)
        assert err.startswith(f"error: {want}") and message in err, err
        assert "layer 1, tensor mlp.experts.down_proj" in err, err


def test_verify_ok_and_old_checkpoints(orbax_dir, damaged, capsys):
    assert main(["verify", str(orbax_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    files = json.loads((orbax_dir / "jax_dwdp.json").read_text())["files"]
    assert result["files"] == len(files) and result["bytes"] == sum(size for size, _ in files.values())
    assert result["files"] == sum(1 for p in orbax_dir.rglob("*") if p.is_file()) - 1  # all but the marker
    marker = json.loads((damaged / "jax_dwdp.json").read_text())
    del marker["files"]  # a checkpoint converted before checksums: loads, but verify says it cannot check
    (damaged / "jax_dwdp.json").write_text(json.dumps(marker))
    a = flat(load_orbax_checkpoint(damaged, dtype=jnp.float32)[0])
    b = flat(load_orbax_checkpoint(orbax_dir, dtype=jnp.float32)[0])
    assert a.keys() == b.keys() and all(np.array_equal(a[p], b[p]) for p in a)
    assert main(["verify", str(damaged)]) == 2
    assert "no checksums (converted by an older jax_dwdp)" in capsys.readouterr().err


@pytest.mark.devices(2)
def test_no_verify_skips_the_checksums_also_in_a_pipeline(damaged, capsys, rng):
    """Same-size random bytes in an expert chunk: refused by default, loaded with --no-verify (for one device and
    for every pipeline stage, which load deep inside Pipeline)."""
    random_bytes(damaged / CHUNK.format(e=int(rng.integers(CFG.num_experts))), rng)
    for extra in ([], ["--pipeline", "2"]):
        argv = ["prefill", "--checkpoint", str(damaged), "--seq-len", "4", "--iters", "1", "--json", *extra]
        assert main(argv) == 2 and "checksum" in capsys.readouterr().err
        code = main(argv + ["--no-verify"])
        assert code == 0, capsys.readouterr().err
        json.loads(capsys.readouterr().out)
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(damaged, dtype=jnp.float32)
    load_checkpoint(damaged, dtype=jnp.float32, verify=False)


def test_size_is_checked_without_checksums_and_orbax_errors_are_one_line(damaged, rng):
    """--no-verify still stats every file (a truncated chunk never reaches Orbax); when Orbax itself fails (the
    marker's sizes lied), one line names the file, its layer and tensor, and the process prints no traceback."""
    f = damaged / CHUNK.format(e=int(rng.integers(CFG.num_experts)))
    empty(f, rng)
    with pytest.raises(CheckpointError, match="0 bytes, expected"):
        load_orbax_checkpoint(damaged, verify=False)
    marker = json.loads((damaged / "jax_dwdp.json").read_text())
    marker["files"][f.relative_to(damaged).as_posix()][0] = 0
    (damaged / "jax_dwdp.json").write_text(json.dumps(marker))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    for _ in range(3):  # Orbax's leftover reads print at exit only sometimes
        proc = subprocess.run([sys.executable, "-m", "jax_dwdp.cli", "prefill", "--checkpoint", str(damaged),
                               "--seq-len", "4", "--iters", "1", "--json", "--no-verify"], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 2 and proc.stdout == "", proc.stderr
        assert proc.stderr.startswith(f"error: {f}: cannot read (layer 1, tensor mlp.experts.down_proj)"), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_rank_checks_only_the_experts_it_reads(orbax_dir):
    files = json.loads((orbax_dir / "jax_dwdp.json").read_text())["files"]
    item = orbax_dir / "layers" / "001"
    rows = {"mlp.experts.down_proj": {2, 3}, "mlp.experts.gate_up_proj": {2, 3}}
    wanted = integrity.files_to_read(orbax_dir, item, files, rows)
    experts = sorted(n.split("/", 2)[2] for n in wanted if "/mlp.experts." in n)
    assert experts == sorted(f"{name}/{f}" for name in rows for f in (".zarray", "2.0.0", "3.0.0"))
    others = {n for n in files if n.startswith("layers/001/") and "/mlp.experts." not in n}
    assert others and others <= set(wanted)  # every other file of the item (metadata, other tensors)


def test_checksums_cover_every_file_and_cost_is_reported(orbax_dir, tmp_path):
    summary = verify_checkpoint(orbax_dir)
    marker = json.loads((orbax_dir / "jax_dwdp.json").read_text())
    assert 0 < marker["checksum_seconds"] < marker["seconds"]
    assert summary["files"] == len(marker["files"])

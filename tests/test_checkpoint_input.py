"""Bad checkpoint input and output locations (issue 43): each is one `error:` line and exit 2, with nothing changed
on disk; --overwrite replaces only a checkpoint or an empty folder; a full disk names what was being written;
`verify` names tensors that hold NaN or Inf; a checkpoint replaced while it is read says so; an Orbax folder
without its marker says so; the convert summary counts cast tensors as it counts stored ones."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jax_dwdp.cli import main
from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.weights import (convert_hf_to_orbax, integrity, is_orbax_checkpoint, load_checkpoint,
                              load_orbax_checkpoint, orbax_format)
from jax_dwdp.weights.hf_loader import load_hf_checkpoint
from jax_dwdp.weights.safetensors_reader import CheckpointError
from tests.checkpoint_helpers import flat, write_hf

CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=3, vocab_size=40, num_experts=4)
REPO = Path(__file__).resolve().parents[1]


def fresh_seed() -> int:
    return int(np.random.default_rng().integers(1 << 30))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf(tmp_path_factory.mktemp("hf") / "ckpt", CFG, seed=fresh_seed())


@pytest.fixture(scope="module")
def orbax_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax") / "ckpt"
    convert_hf_to_orbax(hf_dir, out, progress=None)
    return out


def tree(directory: Path) -> dict[str, str]:
    """Every entry under directory: a file's sha256, a folder, a link's target."""
    out = {}
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        out[rel] = (f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir()
                    else hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def one_error(capsys) -> str:
    """The one line on stderr (without the progress bar's frames), checked to be an error line; stdout empty."""
    out, err = capsys.readouterr()
    lines = [line for line in err.replace("\r", "\n").splitlines()
             if line.strip() and not (line.startswith("[") and "layers" in line)]
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (out, err)
    return lines[0]


def cli(*argv: str) -> subprocess.CompletedProcess:
    """The CLI in a process of its own: its whole stderr, including what threads and loggers print."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "jax_dwdp.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=300)


def assert_valid_copy(out: Path, hf: Path) -> None:
    assert is_orbax_checkpoint(out)
    fa = flat(load_hf_checkpoint(hf, dtype=jnp.float32)[0])
    fb = flat(load_orbax_checkpoint(out, dtype=jnp.float32)[0])
    assert fa.keys() == fb.keys() and all(np.array_equal(fa[p], fb[p]) for p in fa)


# ---- 1. --overwrite replaces only a checkpoint or an empty folder ----------------------------------------------

def _folder_of_files(out: Path, rng) -> None:
    out.mkdir()
    (out / "notes.txt").write_bytes(rng.bytes(100))
    (out / "data").mkdir()
    (out / "data" / "x.bin").write_bytes(rng.bytes(1000))


def _regular_file(out: Path, rng) -> None:
    out.write_bytes(rng.bytes(100))


def _link_to_a_folder(out: Path, rng) -> None:
    target = out.parent / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_bytes(rng.bytes(10))
    out.symlink_to(target)


def _foreign_marker(out: Path, rng) -> None:  # a file named like the marker, not written by convert
    out.mkdir()
    (out / "jax_dwdp.json").write_text(json.dumps({"format": "mine", "n": int(rng.integers(100))}))
    (out / "keep.txt").write_bytes(rng.bytes(10))


OTHERS = [(_folder_of_files, "not a jax_dwdp checkpoint (no jax_dwdp.json; it holds 2 entries: data, notes.txt)"),
          (_regular_file, "is a file, not a jax_dwdp checkpoint"),
          (_link_to_a_folder, "is a symbolic link, not a jax_dwdp checkpoint"),
          (_foreign_marker, "not a jax_dwdp checkpoint (jax_dwdp.json is not convert's marker)")]


@pytest.mark.parametrize("make,message", OTHERS, ids=[m.__name__.strip("_") for m, _ in OTHERS])
def test_overwrite_refuses_what_is_not_a_checkpoint(hf_dir, tmp_path, capsys, rng, make, message):
    out = tmp_path / "out"
    make(out, rng)
    before = tree(tmp_path)
    code = main(["convert", str(hf_dir), str(out), "--overwrite"])
    line = one_error(capsys)
    assert code == 2 and line.startswith(f"error: {out}: {message}"), line
    assert "--overwrite replaces only a checkpoint made by convert" in line, line
    assert tree(tmp_path) == before  # OUT untouched, no lock, partial or old folder left


def test_overwrite_replaces_a_checkpoint_or_an_empty_folder(hf_dir, orbax_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    assert main(["convert", str(hf_dir), str(out), "--overwrite", "--json"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert_valid_copy(out, hf_dir)
    other = write_hf(tmp_path / "other", CFG, seed=fresh_seed())
    assert main(["convert", str(other), str(out), "--overwrite", "--json"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert_valid_copy(out, other)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "out"]


# ---- 2. config.json and the marker: not UTF-8, a folder, not JSON -------------------------------------------------

def _not_utf8(path: Path, rng) -> str:
    path.write_bytes(b'{"model_type": "qwen3_5_moe_text", "x": "' + bytes([0xff, 0xfe]) + rng.bytes(4) + b'"}')
    return "not UTF-8 text (byte 0xff at offset 41); expected UTF-8 JSON"


def _a_folder(path: Path, rng) -> str:
    path.mkdir()
    return "is a folder, expected a JSON file"


def _control_character(path: Path, rng) -> str:  # json's message for it ends in "at", as if a position followed
    path.write_text('{\n "model_type": "qwen3_5_moe_text",\n "name": "a\tb"\n}')
    return "not valid JSON (line 3, column 12: Invalid control character)"


BAD_JSON = [_not_utf8, _a_folder, _control_character]


@pytest.mark.parametrize("damage", BAD_JSON, ids=[d.__name__.strip("_") for d in BAD_JSON])
def test_bad_config_json_is_one_line_naming_the_file(hf_dir, tmp_path, capsys, rng, damage):
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    (src / "config.json").unlink()
    message = damage(src / "config.json", rng)
    before = tree(tmp_path)
    for argv in (["convert", str(src), str(tmp_path / "out")], ["prefill", "--checkpoint", str(src)]):
        code = main(argv)
        line = one_error(capsys)
        assert code == 2 and line == f"error: {src / 'config.json'}: {message}", line
        assert " at at " not in line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("damage", [_not_utf8, _a_folder], ids=["not_utf8", "a_folder"])
def test_bad_marker_is_one_line_naming_the_file(orbax_dir, tmp_path, capsys, rng, damage):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(orbax_dir, ckpt)
    (ckpt / "jax_dwdp.json").unlink()
    message = damage(ckpt / "jax_dwdp.json", rng)
    code = main(["verify", str(ckpt)])
    line = one_error(capsys)
    assert code == 2 and line == f"error: {ckpt / 'jax_dwdp.json'}: {message}", line


# ---- 3. an output location that cannot be written -----------------------------------------------------------------

def _immutable(path: Path) -> None:
    """chattr +i, or skip where the file system or the user cannot."""
    proc = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"chattr +i {path} is not possible here: {proc.stderr.strip()}")


def _mutable(path: Path) -> None:
    subprocess.run(["chattr", "-i", str(path)], check=True)


def test_read_only_location_is_one_line(hf_dir, capsys):
    """/sys refuses new files even to root (permission bits do not stop root)."""
    out = Path("/sys") / f"jaxdwdp_out-{uuid.uuid4().hex[:8]}"
    if not os.path.ismount("/sys"):
        pytest.skip("no sysfs mounted at /sys")
    code = main(["convert", str(hf_dir), str(out)])
    line = one_error(capsys)
    assert code == 2 and line.startswith(f"error: {out}: cannot write in /sys ("), line
    assert f"creating the lock file {out.name}.lock" in line, line
    assert not os.path.lexists(out) and not os.path.lexists(f"{out}.lock")


@pytest.mark.parametrize("lock_left", [False, True], ids=["empty", "lock_file_left"])
def test_immutable_folder_is_one_line(hf_dir, tmp_path, capsys, lock_left):
    """An immutable folder (chattr +i: root cannot create files in it either); with a lock file left there by a
    killed conversion, the lock is taken and creating the partial folder fails instead."""
    parent = tmp_path / "frozen"
    parent.mkdir()
    if lock_left:
        (parent / "out.lock").write_text("12345\n")
    _immutable(parent)
    try:
        code = main(["convert", str(hf_dir), str(parent / "out")])
        line = one_error(capsys)
    finally:
        _mutable(parent)
    what = f"creating the folder out.partial-{os.getpid()}" if lock_left else "creating the lock file out.lock"
    assert code == 2 and line == (f"error: {parent / 'out'}: cannot write in {parent} (Operation not permitted: "
                                  f"{what})"), line
    assert sorted(tree(tmp_path)) == ["frozen", *(["frozen/out.lock"] if lock_left else [])]  # (the lock file is
    # convert's own: it holds the pid of the conversion that took it last)


def test_immutable_checkpoint_is_not_replaced(hf_dir, orbax_dir, tmp_path, capsys):
    out = tmp_path / "out"
    shutil.copytree(orbax_dir, out)
    before = tree(tmp_path)
    _immutable(out)
    try:
        code = main(["convert", str(hf_dir), str(out), "--overwrite"])
        line = one_error(capsys)
    finally:
        _mutable(out)
    assert code == 2 and line == (f"error: {out}: cannot move it aside to replace it (Operation not permitted); it "
                                  "was left as it is and the new checkpoint was discarded"), line
    assert tree(tmp_path) == before


def test_lock_path_that_is_a_folder_is_one_line(hf_dir, tmp_path, capsys):
    (tmp_path / "out.lock").mkdir()
    before = tree(tmp_path)
    code = main(["convert", str(hf_dir), str(tmp_path / "out")])
    line = one_error(capsys)
    assert code == 2 and line.startswith(f"error: {tmp_path / 'out.lock'}: is a folder; convert keeps its lock "
                                         "file there"), line
    assert tree(tmp_path) == before


# ---- 4. a full disk ---------------------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs at tmp_path/disk (root, and mounting allowed: else skipped), unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root and the permission): {proc.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.9])
def test_full_disk_is_one_line_naming_the_layer(hf_dir, small_disk, fraction):
    """A tmpfs that holds part of the checkpoint: Orbax's writer threads fail with RESOURCE_EXHAUSTED and log their
    tracebacks, and leftover writes report at exit; the user sees one line naming the layer (or the embedding or
    head) being written, and nothing is left on the disk."""
    convert_hf_to_orbax(hf_dir, small_disk / "probe", progress=None)
    used = sum(p.stat().st_blocks * 512 for p in small_disk.rglob("*"))
    shutil.rmtree(small_disk / "probe")
    subprocess.run(["mount", "-o", f"remount,size={int(used * fraction) // 4096 * 4096}", str(small_disk)],
                   check=True)
    out = small_disk / "out"
    proc = cli("convert", str(hf_dir), str(out))
    lines = [line for line in proc.stderr.replace("\r", "\n").splitlines()
             if line.strip() and not (line.startswith("[") and "layers" in line)]
    assert proc.returncode == 2 and proc.stdout == "" and len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "RESOURCE_EXHAUSTED" not in proc.stderr, proc.stderr
    assert re.match(rf"error: {re.escape(str(out))}: no space left on device while writing (layer \d|the embedding "
                    r"\(embed/\)|the head \(head/\))", lines[0]), lines
    assert f"free space in {small_disk}" in lines[0], lines
    assert list(small_disk.iterdir()) == []


def test_full_disk_at_the_marker_is_one_line(hf_dir, tmp_path, capsys, monkeypatch):
    """The disk fills up as the last file (the marker) is written: one line naming it; nothing left."""
    real = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name == "jax_dwdp.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", write_text)
    out = tmp_path / "out"
    code = main(["convert", str(hf_dir), str(out)])
    line = one_error(capsys)
    assert code == 2 and line.startswith(f"error: {out}: no space left on device while writing jax_dwdp.json; the "
                                         f"partial checkpoint was removed; free space in {tmp_path}"), line
    assert list(tmp_path.iterdir()) == []


# ---- 5. NaN and Inf --------------------------------------------------------------------------------------------------

def test_verify_names_tensors_with_nan_or_inf_and_convert_warns(tmp_path, capsys, rng):
    layer, expert = int(rng.integers(CFG.num_hidden_layers)), int(rng.integers(CFG.num_experts))
    nans, infs = int(rng.integers(1, 5)), int(rng.integers(1, 5))

    def poison(tensors):
        t = tensors[f"model.layers.{layer}.mlp.experts.{expert}.down_proj.weight"]
        t.view(-1)[:nans] = float("nan")
        t.view(-1)[nans:nans + infs] = float("inf")
        tensors["model.norm.weight"][0] = -float("inf")

    hf = write_hf(tmp_path / "hf", CFG, seed=fresh_seed(), dtype=torch.bfloat16, per_expert=True, edit=poison)
    out = tmp_path / "out"
    assert main(["convert", str(hf), str(out)]) == 0
    captured = capsys.readouterr()
    size = CFG.num_experts * CFG.hidden_size * CFG.moe_intermediate_size
    want = (f"layer {layer}, tensor mlp.experts.down_proj: {nans} NaN, {infs} Inf of {size} values; "
            f"head, tensor norm.weight: 0 NaN, 1 Inf of {CFG.hidden_size} values")
    warnings = [line for line in captured.err.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {hf}: 2 tensors hold NaN or Inf: {want}; converted as they are (a prefill with "
                        "them gives NaN logits)"], captured.err
    code = main(["verify", str(out)])
    line = one_error(capsys)
    assert code == 2 and line.startswith(f"error: {out}: 2 tensors hold NaN or Inf: {want} (the files match"), line


def test_verify_restores_one_item_at_a_time(orbax_dir, capsys, monkeypatch):
    seen = []
    real = integrity.restore_stored

    def restore(directory, item):
        seen.append(item.relative_to(directory).as_posix())
        return real(directory, item)

    monkeypatch.setattr(integrity, "restore_stored", restore)
    assert main(["verify", str(orbax_dir), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert seen == ["embed", *(f"layers/{i:03d}" for i in range(CFG.num_hidden_layers)), "head"]
    assert result["tensors"] == sum(1 for _ in nnx.to_flat_state(nnx.state(init_model(CFG, dtype=jnp.float32))))


# ---- 6. a checkpoint replaced while it is read ----------------------------------------------------------------------

@pytest.mark.parametrize("verify", [True, False], ids=["checksums", "no_verify"])
def test_checkpoint_replaced_while_loading_says_so(hf_dir, orbax_dir, tmp_path, capsys, monkeypatch, verify):
    """What `convert --overwrite` does to a checkpoint a prefill is reading (the new one moved in, the old one
    removed) between two items of the load: "changed while being read; run again", not "damaged" (with
    checksums) nor a model of two checkpoints' layers (without them)."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(orbax_dir, ckpt)
    other = tmp_path / "other"
    convert_hf_to_orbax(write_hf(tmp_path / "hf2", CFG, seed=fresh_seed()), other, progress=None)
    real, calls = integrity.files_to_read, []

    def files_to_read(*args):
        calls.append(1)
        if len(calls) == 2:
            os.rename(ckpt, tmp_path / "ckpt.old")
            shutil.copytree(other, ckpt)
            shutil.rmtree(tmp_path / "ckpt.old")
        return real(*args)

    monkeypatch.setattr(integrity, "files_to_read", files_to_read)
    argv = ["prefill", "--checkpoint", str(ckpt), "--seq-len", "4", "--iters", "1", "--json"]
    code = main(argv + ([] if verify else ["--no-verify"]))
    line = one_error(capsys)
    assert code == 2 and line == (f"error: {ckpt}: changed while being read (replaced or rewritten, e.g. by "
                                  "`jax-dwdp convert --overwrite` into it); run again"), line
    monkeypatch.setattr(integrity, "files_to_read", real)
    assert main(["verify", str(ckpt)]) == 0
    capsys.readouterr()
    load_checkpoint(ckpt, dtype=jnp.float32)  # and run again, it loads


def test_restore_error_never_shows_a_python_repr(orbax_dir):
    error = TypeError("<bound method pybind11_detail_function_record_v1.__call__ of "
                      "<pybind11_detail_function_record_v1 object at 0x7f0011223344>>")
    item = orbax_dir / "layers" / "001"
    message = orbax_format.restore_error(orbax_dir, item, error)
    assert message == f"{item}: cannot restore (TypeError)", message


# ---- 7. an Orbax folder without its marker -----------------------------------------------------------------------

@pytest.mark.parametrize("also_config", [False, True], ids=["marker", "marker_and_config"])
def test_orbax_folder_without_marker_says_so(orbax_dir, tmp_path, capsys, also_config):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(orbax_dir, ckpt)
    (ckpt / "jax_dwdp.json").unlink()
    if also_config:  # as a conversion's partial folder is before its last step
        (ckpt / "config.json").unlink()
    want = (f"error: {ckpt}: looks like a jax_dwdp Orbax checkpoint (layers/, embed/, head/) but has no marker file "
            f"{ckpt / 'jax_dwdp.json'}, which convert writes last: an interrupted conversion or an incomplete copy; "
            "convert it again")
    for argv in (["prefill", "--checkpoint", str(ckpt), "--seq-len", "4", "--iters", "1"], ["verify", str(ckpt)],
                 ["convert", str(ckpt), str(tmp_path / "out")]):
        code = main(argv)
        line = one_error(capsys)
        assert code == 2 and line == want, (argv, line)
    with pytest.raises(CheckpointError, match="looks like a jax_dwdp Orbax checkpoint"):
        load_checkpoint(ckpt, cfg=CFG, dtype=jnp.float32)


# ---- 8. the convert summary counts cast tensors as stored tensors --------------------------------------------------

def test_cast_counts_stored_tensors_not_per_expert_pieces(tmp_path, capsys):
    hf = write_hf(tmp_path / "hf", CFG, seed=fresh_seed(), per_expert=True)
    assert main(["convert", str(hf), str(tmp_path / "out"), "--dtype", "bfloat16"]) == 0
    line = capsys.readouterr().out
    n = sum(1 for _ in nnx.to_flat_state(nnx.state(init_model(CFG, dtype=jnp.float32))))
    a_log = len(CFG.layer_ids("linear_attention"))  # A_log stays float32
    assert f"converted {n} tensors" in line and f"cast {n - a_log} tensors float32 to bfloat16;" in line, line
    assert json.loads((tmp_path / "out" / "jax_dwdp.json").read_text())["cast"] == {"float32->bfloat16": n - a_log}
    _, report = load_hf_checkpoint(hf, dtype=jnp.bfloat16)
    assert report.tensors_loaded == n and report.cast == {"float32->bfloat16": n - a_log}, report

"""`jax-dwdp convert` never loses or mixes data: one conversion per destination (lock), stale partials of dead
processes only, no replacing what it was not told to replace, source folders protected, Ctrl-C cleans up."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import save_file

from jax_dwdp.cli import main
from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.weights import orbax_store
from jax_dwdp.weights.hf_loader import load_hf_checkpoint
from jax_dwdp.weights.hf_names import hf_name
from jax_dwdp.weights.orbax_store import convert_hf_to_orbax, is_orbax_checkpoint, load_orbax_checkpoint
from jax_dwdp.weights.safetensors_reader import CheckpointError
from tests.hf_reference import write_config

# Many small layers: a conversion takes long enough to be interrupted between layers.
CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=12, vocab_size=48, num_experts=4)
REPO = Path(__file__).resolve().parents[1]


def write_hf(directory: Path, cfg: ModelConfig, seed: int, dtype=torch.float32) -> Path:
    """An HF folder (one safetensors file, `model.` names) of a random jax_dwdp model; no transformers needed."""
    model = init_model(cfg, dtype=jnp.float32, seed=seed)
    tensors = {hf_name(p, 0, "model."): torch.from_numpy(np.array(v.get_value())).to(dtype)
               for p, v in nnx.to_flat_state(nnx.state(model))}
    directory.mkdir(parents=True)
    save_file(tensors, directory / "model.safetensors")
    write_config(directory, cfg, released_form=False)
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf(tmp_path_factory.mktemp("hf") / "ckpt", CFG, seed=int(np.random.default_rng().integers(1 << 30)))


def cli(*argv: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    return subprocess.Popen([sys.executable, "-m", "jax_dwdp.cli", *argv], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def error_lines(stderr: str) -> list[str]:
    """stderr's lines without the progress bar's frames."""
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    return [line for line in lines if not (line.startswith("[") and "layers" in line)]


def assert_valid_copy(out: Path, hf: Path) -> None:
    """out is a complete checkpoint whose every tensor equals the HF source's."""
    assert is_orbax_checkpoint(out)
    ref, _ = load_hf_checkpoint(hf, dtype=jnp.float32)
    got, _ = load_orbax_checkpoint(out, dtype=jnp.float32)
    fa = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(ref))}
    fb = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(got))}
    assert fa.keys() == fb.keys()
    for path in fa:
        np.testing.assert_array_equal(fa[path], fb[path], err_msg=str(path))


def leftovers(parent: Path, name: str = "out") -> list[str]:
    """Partial, old and lock files a conversion into parent/name may leave."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f"{name}."))


def tree_digest(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_two_conversions_race_one_wins(hf_dir, tmp_path):
    """Two `convert` processes started together into one OUT_DIR: one exits 0, the other 2 with one error line;
    OUT_DIR is a complete checkpoint equal to the source, and nothing else is left beside it."""
    out = tmp_path / "out"
    procs = [cli("convert", str(hf_dir), str(out), "--dtype", "float32") for _ in range(2)]
    results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    _, _, won = next(r for r in results if r[0] == 0)
    assert error_lines(won) == [], won  # only the progress bar: no Orbax/absl WARNING lines
    _, _, err = next(r for r in results if r[0] == 2)
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert "another conversion" in lines[0] or "already exists" in lines[0], err
    assert_valid_copy(out, hf_dir)
    assert leftovers(tmp_path) == [], leftovers(tmp_path)


def test_lock_refuses_a_second_conversion_and_is_released_on_every_path(hf_dir, tmp_path, capsys):
    out = tmp_path / "out"
    fd = orbax_store._lock_destination(out)  # another conversion in progress
    try:
        code = main(["convert", str(hf_dir), str(out)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and f"another conversion (pid {os.getpid()})" in err, err
        assert not out.exists() and leftovers(tmp_path) == ["out.lock"]
    finally:
        orbax_store._unlock_destination(out, fd)
    assert leftovers(tmp_path) == []
    # A conversion that fails (a tensor missing from the source, found at layer 2) releases it too.
    bad = write_hf(tmp_path / "bad", CFG.replace(num_hidden_layers=2), seed=1)
    write_config(bad, CFG, released_form=False)  # config says 12 layers, the file has 2
    with pytest.raises(CheckpointError, match="missing tensor"):
        convert_hf_to_orbax(bad, out, progress=None)
    assert leftovers(tmp_path) == [] and not out.exists()
    convert_hf_to_orbax(hf_dir, out, dtype=jnp.float32, progress=None)
    assert_valid_copy(out, hf_dir)
    assert leftovers(tmp_path) == []


def test_stale_partials_are_removed_only_when_their_process_is_gone(hf_dir, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        for pid in (dead.pid, live.pid):
            (tmp_path / f"out.partial-{pid}" / "layers").mkdir(parents=True)
        convert_hf_to_orbax(hf_dir, tmp_path / "out", dtype=jnp.float32, progress=None)
        assert leftovers(tmp_path) == [f"out.partial-{live.pid}"]  # the live process's folder is untouched
        assert (tmp_path / f"out.partial-{live.pid}" / "layers").is_dir()
    finally:
        live.kill()
        live.wait()


def test_final_rename_never_replaces_what_appeared_meanwhile(hf_dir, tmp_path, monkeypatch):
    """Something that appears at OUT_DIR during the conversion (another tool's empty folder, which a plain rename
    would silently replace) is left as it is; the conversion fails with one line and leaves nothing of its own."""
    out = tmp_path / "out"
    real = orbax_store._progress

    def progress(done, *args):
        if done == 3:
            out.mkdir()
        real(done, *args)

    monkeypatch.setattr(orbax_store, "_progress", progress)
    with open(os.devnull, "w") as devnull, pytest.raises(CheckpointError, match="appeared while converting; it was "
                                                                                "left as it is"):
        convert_hf_to_orbax(hf_dir, out, progress=devnull)
    assert out.is_dir() and not any(out.iterdir())
    assert leftovers(tmp_path) == []


def test_rename_noreplace_without_renameat2(tmp_path, monkeypatch):
    """Where the C library has no renameat2, a check before a plain rename still never replaces."""
    class NoRenameat2:
        def __init__(self, *_, **__):
            pass

    monkeypatch.setattr(orbax_store.ctypes, "CDLL", NoRenameat2)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    with pytest.raises(FileExistsError):
        orbax_store._rename_noreplace(src, dst)
    assert src.is_dir() and dst.is_dir()
    dst.rmdir()
    orbax_store._rename_noreplace(src, dst)
    assert dst.is_dir() and not src.exists()


@pytest.mark.parametrize("where,relation", [(".", "is"), ("sub", "is inside"), ("..", "contains")])
def test_output_overlapping_the_source_is_refused(hf_dir, tmp_path, capsys, where, relation):
    src = tmp_path / "a" / "hf"
    src.parent.mkdir()
    src.mkdir()
    for f in hf_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    before = tree_digest(tmp_path)
    out = (src / where) if where != "sub" else src / "sub" / "out"
    code = main(["convert", str(src), str(out), "--overwrite"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"the output folder {relation} the source folder" in err, err
    assert tree_digest(tmp_path) == before  # nothing deleted, nothing created


def test_overwrite_of_a_regular_file_leaves_nothing_behind(hf_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("not a checkpoint")
    code = main(["convert", str(hf_dir), str(out)])
    assert code == 2 and "already exists; pass --overwrite" in capsys.readouterr().err
    assert out.read_text() == "not a checkpoint"
    code = main(["convert", str(hf_dir), str(out), "--overwrite", "--dtype", "float32"])
    assert code == 0, capsys.readouterr().err
    assert_valid_copy(out, hf_dir)
    assert leftovers(tmp_path) == [], leftovers(tmp_path)


def test_ctrl_c_during_conversion_cleans_up(hf_dir, tmp_path):
    """SIGINT once the second layer is on disk: exit 130, one line, no OUT_DIR, partial folder or lock left."""
    out = tmp_path / "out"
    proc = cli("convert", str(hf_dir), str(out))
    deadline = time.monotonic() + 300
    while not list(tmp_path.glob("out.partial-*/layers/001/_CHECKPOINT_METADATA")):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    lines = error_lines(err)
    assert proc.returncode == 130 and lines == ["error: interrupted; convert stopped"], (proc.returncode, err)
    assert not out.exists() and leftovers(tmp_path) == [], leftovers(tmp_path)

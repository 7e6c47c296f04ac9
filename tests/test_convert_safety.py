"""`jax-dwdp convert` never loses or mixes data: one conversion per destination (lock), stale partials of dead
processes only, no replacing what it was not told to replace, source folders protected, Ctrl-C cleans up; each
tensor keeps its dtype unless a cast is asked for, and a run wider than the stored weights says so."""

from __future__ import annotations

import hashlib
import json
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

from jax_dwdp.cli import main
from jax_dwdp.config import ModelConfig
from jax_dwdp.model import init_model
from jax_dwdp.weights import convert_hf_to_orbax, is_orbax_checkpoint, load_orbax_checkpoint, orbax_store, publish
from jax_dwdp.weights.hf_loader import load_hf_checkpoint
from jax_dwdp.weights.safetensors_reader import CheckpointError
from tests.checkpoint_helpers import flat, write_hf
from tests.hf_reference import write_config
from tests.processes import popen_default_sigint

# Many small layers: a conversion takes long enough to be interrupted between layers.
CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=12, vocab_size=48, num_experts=4)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf(tmp_path_factory.mktemp("hf") / "ckpt", CFG, seed=int(np.random.default_rng().integers(1 << 30)))


def cli(*argv: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    return popen_default_sigint([sys.executable, "-m", "jax_dwdp.cli", *argv], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, **kw)


def error_lines(stderr: str) -> list[str]:
    """stderr's lines without the progress bar's frames."""
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.strip()]
    return [line for line in lines if not (line.startswith("[") and "layers" in line)]


def assert_valid_copy(out: Path, hf: Path) -> None:
    """out is a complete checkpoint whose every tensor equals the HF source's."""
    assert is_orbax_checkpoint(out)
    fa = flat(load_hf_checkpoint(hf, dtype=jnp.float32)[0])
    fb = flat(load_orbax_checkpoint(out, dtype=jnp.float32)[0])
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
    procs = [cli("convert", str(hf_dir), str(out)) for _ in range(2)]
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
    fd = publish.lock_destination(out)  # another conversion in progress
    try:
        code = main(["convert", str(hf_dir), str(out)])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and f"another conversion (pid {os.getpid()})" in err, err
        assert not out.exists() and leftovers(tmp_path) == ["out.lock"]
    finally:
        publish.unlock_destination(out, fd)
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

    monkeypatch.setattr(publish.ctypes, "CDLL", NoRenameat2)
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    dst.mkdir()
    with pytest.raises(FileExistsError):
        publish.rename_noreplace(src, dst)
    assert src.is_dir() and dst.is_dir()
    dst.rmdir()
    publish.rename_noreplace(src, dst)
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


def test_overwrite_of_a_regular_file_is_refused(hf_dir, tmp_path, capsys):
    """--overwrite replaces only a checkpoint or an empty folder: a file at OUT_DIR is left as it is."""
    out = tmp_path / "out"
    out.write_text("not a checkpoint")
    for extra in ([], ["--overwrite"]):
        code = main(["convert", str(hf_dir), str(out), *extra])
        err = capsys.readouterr().err
        want = "is a file, not a jax_dwdp checkpoint" if extra else "already exists; pass --overwrite"
        assert code == 2 and err.count("\n") == 1 and want in err, err
        assert out.read_text() == "not a checkpoint"
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


def test_convert_keeps_each_tensors_dtype_and_casts_only_on_request(hf_dir, tmp_path, capsys):
    """An fp32 source stays fp32 by default (bit for bit); --dtype bfloat16 casts and the summary says what."""
    code = main(["convert", str(hf_dir), str(tmp_path / "kept")])
    out = capsys.readouterr().out
    n = sum(1 for _ in nnx.to_flat_state(nnx.state(init_model(CFG, dtype=jnp.float32))))
    assert code == 0 and f"stored {n} float32; every tensor kept its dtype" in out, out
    assert_valid_copy(tmp_path / "kept", hf_dir)
    code = main(["convert", str(hf_dir), str(tmp_path / "cast"), "--dtype", "bfloat16", "--json"])
    summary = json.loads(capsys.readouterr().out)
    a_log = len(CFG.layer_ids("linear_attention"))  # A_log stays float32
    assert code == 0 and summary["cast"] == {"float32->bfloat16": n - a_log}, summary
    assert summary["dtypes"] == {"bfloat16": n - a_log, "float32": a_log}, summary
    ref = flat(load_hf_checkpoint(hf_dir, dtype=jnp.bfloat16)[0])
    got = flat(load_orbax_checkpoint(tmp_path / "cast", dtype=jnp.bfloat16)[0])
    assert got.keys() == ref.keys() and all(np.array_equal(ref[p], got[p]) for p in ref)


def test_bf16_source_stays_bf16_and_a_float32_run_says_so(tmp_path, capsys, rng):
    cfg = CFG.replace(num_hidden_layers=2)
    hf16 = write_hf(tmp_path / "hf16", cfg, seed=int(rng.integers(1 << 30)), dtype=torch.bfloat16)
    assert main(["convert", str(hf16), str(tmp_path / "orbax16"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    n = summary["tensors"]
    assert summary["dtypes"] == {"bfloat16": n} and summary["cast"] == {}, summary
    np.save(tmp_path / "t.npy", rng.integers(0, cfg.vocab_size, (1, 9)).astype(np.int32))
    for source, notice in ((hf16, True), (tmp_path / "orbax16", True), (hf16, False)):
        dtype = "float32" if notice else "bfloat16"
        code = main(["prefill", "--checkpoint", str(source), "--tokens", str(tmp_path / "t.npy"), "--dtype", dtype,
                     "--iters", "1", "--json"])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        json.loads(captured.out)  # stdout stays one JSON object
        want = f"notice: {source} stores {n} tensors in bfloat16; the model runs in float32"
        assert (want in captured.err) == notice, captured.err


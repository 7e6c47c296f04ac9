"""What the prefill command refuses before any work, each as one `error:` line and exit 2 with nothing changed on
disk: output paths that are not regular files, conflicting or ignored options, seeds and sizes out of range,
malformed multi-process options; and what it says about a launch that never assembles and about non-finite
logits."""

from __future__ import annotations

import errno
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jax_dwdp.driver
import jax_dwdp.model
from jax_dwdp.cli import main
from jax_dwdp.config import ModelConfig
from jax_dwdp.distributed import NativeLogFilter, explain_death

ROOT = Path(__file__).resolve().parents[1]
TINY = ["prefill", "--preset", "tiny", "--seq-len", "8", "--iters", "1"]


def refused(capsys, argv, message):
    code = main(list(argv))
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, (code, out, err)
    assert lines[0].startswith("error: ") and message in lines[0], err
    return lines[0]


def test_logits_out_refuses_what_is_not_a_regular_file_and_leaves_it_as_it_was(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused(capsys, [*TINY, "--logits-out", str(fifo)], "not a regular file (a device, FIFO or socket)")
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    link_to_fifo = tmp_path / "to-fifo"
    link_to_fifo.symlink_to(fifo)
    refused(capsys, [*TINY, "--logits-out", str(link_to_fifo)], f"(the target of the symlink {link_to_fifo})")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))
        refused(capsys, [*TINY, "--logits-out", str(tmp_path / "sock")], "not a regular file")
    refused(capsys, [*TINY, "--logits-out", "/dev/null"], "/dev/null: is not a regular file")
    (tmp_path / "folder").mkdir()
    refused(capsys, [*TINY, "--logits-out", str(tmp_path / "folder")], "is a folder")
    refused(capsys, [*TINY, "--logits-out", f"{tmp_path}/missing/"], "names a folder (it ends with /)")
    refused(capsys, [*TINY, "--logits-out", f"{tmp_path}/folder/"], "names a folder (it ends with /)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "folder", "sock", "to-fifo"]
    assert os.stat("/dev/null").st_rdev and stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_logits_out_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path, capsys):
    target = tmp_path / "data" / "logits.npy"
    target.parent.mkdir()
    target.write_bytes(b"old")
    link = tmp_path / "link.npy"
    link.symlink_to(target)
    dangling = tmp_path / "dangling.npy"
    dangling.symlink_to(tmp_path / "data" / "new.npy")
    for path, written in ((link, target), (dangling, tmp_path / "data" / "new.npy")):
        assert main([*TINY, "--json", "--logits-out", str(path)]) == 0
        capsys.readouterr()
        assert path.is_symlink()
        assert np.load(written).shape == (1, 8, ModelConfig.preset("tiny").vocab_size)
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["logits.npy", "new.npy"]


def test_a_full_disk_while_writing_the_logits_names_the_cause_and_leaves_no_file(tmp_path, capsys, monkeypatch):
    def full(file, array):
        file.write(b"\x93NUMPY")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "save", full)
    line = refused(capsys, [*TINY, "--json", "--logits-out", str(tmp_path / "l.npy")],
                   "cannot write 0.0 MiB (no space left on device); nothing was written")
    assert "None" not in line
    assert list(tmp_path.iterdir()) == []


def test_paths_of_the_wrong_kind_are_named_as_such(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    refused(capsys, ["prefill", "--checkpoint", str(a_file)], f"--checkpoint {a_file}: is not a folder")
    refused(capsys, ["prefill", "--checkpoint", str(tmp_path / "nope")], "no such folder")
    refused(capsys, ["prefill", "--preset", "tiny", "--tokens", str(tmp_path)], f"--tokens {tmp_path}: is not a regular file")
    refused(capsys, ["verify", str(a_file)], "is not a folder")
    refused(capsys, ["convert", str(a_file), str(tmp_path / "out")], "is not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "--seed must lie in [0, 4294967295], got -1"),
    (["--seed", "99999999999999999999999"], "--seed must lie in [0, 4294967295]"),
    (["--batch", "1000000000"], "needs at least"),
    (["--seq-len", "100000000000"], "needs at least"),
    (["--dwdp-backend", "local"], "--experts local needs --dwdp N with N >= 2"),
    (["--dwdp-backend", "xla"], "--experts xla needs --dwdp N"),
    (["--stall-timeout", "0"], "--stall-timeout must be > 0"),
    # checked by the spec (driver.PrefillSpec), named here by the flags
    (["--prefill-chunk", "4", "--pipeline", "2"],
     "--prefill-chunk runs on one device: it does not combine with --pipeline, --dwdp or --microbatches"),
    (["--prefill-chunk", "4", "--scan"], "--prefill-chunk continues a cache layer by layer: not with --scan"),
    (["--dep", "2", "--scan"], "--scan runs the model (or each --pipeline stage) on one device as one program: not "
                               "with --dep > 1"),
    (["--scan", "--layerwise"], "--scan and --layerwise are two execution modes: choose one"),
    (["--pipeline", "0"], "--pipeline must be >= 1, got 0"),
    (["--dwdp", "0"], "--dwdp and --dep must be >= 1, got 0 and 1"),
    (["--num-processes", "0"], "--num-processes must be >= 1, got 0"),
    (["--num-processes", "-2"], "--num-processes must be >= 1, got -2"),
    (["--dwdp", "2", "--num-processes", "2", "--process-timeout", "0"], "--process-timeout must be > 0"),
    (["--dwdp", "2", "--num-processes", "2", "--process-timeout", "-5"], "--process-timeout must be > 0"),
    (["--dwdp", "2", "--num-processes", "2", "--process-id", "0", "--coordinator", "127.0.0.1:notaport"],
     "the port 'notaport' is not a number"),
    (["--dwdp", "2", "--num-processes", "2", "--process-id", "0", "--coordinator", "abc"], "expected HOST:PORT"),
    (["--dwdp", "2", "--num-processes", "2", "--process-id", "0", "--coordinator", "host:70000"],
     "not a number in [1, 65535]"),
    (["--dwdp", "2", "--num-processes", "2", "--process-id", "0", "--coordinator", "::1:80"], "in brackets"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_options_out_of_range_or_doing_nothing_are_refused(capsys, argv, message):
    refused(capsys, [*TINY, *argv], message)


def test_tokens_file_with_batch_or_seq_len_is_refused(tmp_path, capsys):
    np.save(tmp_path / "t.npy", np.ones((2, 5), np.int32))
    refused(capsys, ["prefill", "--preset", "tiny", "--tokens", str(tmp_path / "t.npy"), "--batch", "3"],
            "--batch shapes random tokens; with --tokens the file gives the shape")
    refused(capsys, ["prefill", "--preset", "tiny", "--tokens", str(tmp_path / "t.npy"), "--seq-len", "3",
                     "--batch", "1"], "--batch and --seq-len shape random tokens")


def test_non_finite_logits_are_reported_with_the_first_layer_whose_cache_holds_them(capsys, monkeypatch):
    init = jax_dwdp.driver.init_model

    def poisoned(cfg, **kw):
        model = init(cfg, **kw)
        norm = model.layers[2].input_layernorm.weight
        norm[...] = norm[...].at[0].set(np.nan)
        return model

    monkeypatch.setattr(jax_dwdp.driver, "init_model", poisoned)
    assert main([*TINY, "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    warning = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and warning[0].startswith("warning: the logits are not finite (") \
        and "values NaN or Inf); the first layer whose cache holds such values is layer 2;" in warning[0], err


def test_native_log_lines_are_held_back_and_ours_pass():
    logs = NativeLogFilter()
    lines = ["compiling ...", "E1207 03:17:57.924346    7178 agent.cc:454] Shutdown() was called", "",
             "RPC: /xla.coordination.CoordinationService/RegisterTask", "error: our own line",
             "F1207 03:17:07.083960    6748 client.h:80] Terminating process", "*** Check failure stack trace: ***",
             "    @     0x7f6a50240634  absl::LogMessage::Flush()", "Rank 0 is connected to 1 peer ranks.",
             '{"command": "prefill"}']
    assert [line for line in lines if logs.passes(line)] == ["compiling ...", "error: our own line",
                                                             '{"command": "prefill"}']
    assert logs.held[0].startswith("E1207") and "RPC: /xla.coordination.CoordinationService/RegisterTask" in logs.held
    verbose = NativeLogFilter(verbose=True)
    assert all(verbose.passes(line) for line in lines)


def test_a_native_abort_is_explained_in_one_line():
    held = ["F1207 03:17:07.083960 6748 client.h:80] Terminating process because the JAX distributed service "
            "detected fatal errors. absl::Status: UNAVAILABLE: The following tasks are unhealthy (stopped sending "
            "heartbeats):", "2", "The tasks have crashed."]
    line = explain_death(-6, held, process_id=0, num_processes=3, coordinator="127.0.0.1:1", timeout_s=7)
    assert line == ("process 0 of 3: process 2 stopped answering (no heartbeat for 7 s, --process-timeout); this "
                    "process stopped too")
    assert explain_death(-11, [], process_id=1, num_processes=2, coordinator="127.0.0.1:1", timeout_s=7) == (
        "process 1 of 2 was killed by SIGSEGV (--verbose shows the native libraries' messages)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("process_id, message", [
    (0, "error: process 0 of 2: process 1 did not join the launch at 127.0.0.1:{port} within 3 s (--process-timeout)"),
    (1, "error: process 1 of 2: nothing answers at 127.0.0.1:{port}, where process 0 of the launch (the coordinator) "
        "should run; waited 3 s (--process-timeout)"),
], ids=["peer-never-joins", "no-coordinator"])
def test_a_launch_that_never_assembles_ends_with_one_line(process_id, message):
    """Today's jax.distributed aborts such a process with a C++ stack dump (exit 134): the supervising parent
    turns it into one line naming the missing process and the timeout."""
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "jax_dwdp.cli", *TINY, "--dwdp", "2", "--num-processes", "2",
                           "--process-id", str(process_id), "--coordinator", f"127.0.0.1:{port}",
                           "--process-timeout", "3"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 1 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr[-3000:])
    assert proc.stderr.strip().splitlines() == [message.format(port=port)], proc.stderr[-3000:]


def test_num_layers_with_a_checkpoint_loads_only_the_first_layers(tmp_path, capsys):
    """HF folder and its Orbax conversion alike: `--num-layers 2` runs the checkpoint's first two layers (their
    logits equal the Python API's model of those layers), not all four."""
    import json

    import jax.numpy as jnp

    from jax_dwdp.prefill import jit_prefill
    from jax_dwdp.weights import load_checkpoint
    from jax_dwdp.weights.hf_loader import load_config
    from tests.checkpoint_helpers import write_hf

    hf = write_hf(tmp_path / "hf", ModelConfig.preset("tiny"), seed=3)
    assert main(["convert", str(hf), str(tmp_path / "orbax"), "--json"]) == 0
    tokens = np.random.default_rng(4).integers(0, 256, (2, 12)).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    model, _ = load_checkpoint(hf, cfg=load_config(hf).first_layers(2), dtype=jnp.float32)
    want = np.asarray(jit_prefill(model, logits="all")(tokens, np.full((2,), 12, np.int32))[0])
    capsys.readouterr()
    for source in (hf, tmp_path / "orbax"):
        out = tmp_path / f"{source.name}.npy"
        assert main(["prefill", "--checkpoint", str(source), "--num-layers", "2", "--dtype", "float32", "--iters",
                     "1", "--tokens", str(tmp_path / "tokens.npy"), "--logits-out", str(out), "--json"]) == 0
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["model"].startswith("2 layers"), result["model"]
        err = float(np.abs(np.load(out) - want).max() / np.abs(want).max())
        print(f"{source.name}: --num-layers 2 against the 2-layer model: {err:.2e}")
        assert err < 1e-5

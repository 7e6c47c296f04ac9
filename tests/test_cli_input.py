"""The command line fails early and says what it does: unwritable --logits-out before any work, a config.json
missing a shape key names it, help text for every argument, progress lines on stderr (none with --json)."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest

from jax_dwdp.cli import build_parser, main
from jax_dwdp.config import ModelConfig
from tests.hf_reference import write_config

TINY = ["--preset", "tiny", "--batch", "1", "--seq-len", "8", "--iters", "1"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_error_line(code, out, err, message):
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, (code, out, err)  # no "loading ..." line: before any work
    assert lines[0].startswith("error: ") and message in lines[0], err


@pytest.fixture
def unwritable_folder(tmp_path):
    """A folder that refuses new files, also to root (who ignores permission bits): then sysfs's root."""
    if os.geteuid() == 0:
        yield "/sys"
        return
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    yield str(folder)
    folder.chmod(0o755)


def test_logits_out_that_cannot_be_written_fails_before_any_work(tmp_path, capsys, unwritable_folder):
    target = f"{unwritable_folder}/logits.npy"
    one_error_line(*run(capsys, "prefill", *TINY, "--logits-out", target),
                   f"--logits-out {target}: cannot write in {unwritable_folder} (Permission denied)")
    (tmp_path / "adir").mkdir()
    one_error_line(*run(capsys, "prefill", *TINY, "--logits-out", str(tmp_path / "adir")), "is a folder")
    one_error_line(*run(capsys, "prefill", *TINY, "--json", "--logits-out", str(tmp_path / "adir")), "is a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir"]  # no probe or partial file left


def test_logits_out_is_written_and_nothing_else(tmp_path, capsys):
    code, out, err = run(capsys, "prefill", *TINY, "--json", "--logits-out", str(tmp_path / "l.npy"))
    assert code == 0, err
    assert np.load(tmp_path / "l.npy").shape == (1, 8, ModelConfig.preset("tiny").vocab_size)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["l.npy"]


@pytest.mark.parametrize("key", ["num_hidden_layers", "vocab_size", "head_dim", "num_experts"])
@pytest.mark.parametrize("released", [False, True])
def test_config_missing_a_shape_key_names_it(tmp_path, capsys, key, released):
    write_config(tmp_path, ModelConfig.preset("tiny"), released_form=released)
    raw = json.loads((tmp_path / "config.json").read_text())
    del (raw["text_config"] if released else raw)[key]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    name = f"text_config.{key}" if released else key
    one_error_line(*run(capsys, "prefill", "--checkpoint", str(tmp_path)),
                   f"{tmp_path / 'config.json'}: missing {name} (no safe default")


def test_help_says_what_the_tool_and_every_argument_do(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "runs long-context prefill of Qwen3.5-MoE" in top and "converts Hugging Face checkpoints" in top
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help, (name, action.dest)


def test_prefill_reports_progress_on_stderr_and_is_quiet_with_json(capsys):
    code, out, err = run(capsys, "prefill", *TINY)
    assert code == 0, err
    assert err.splitlines() == ["making random weights ...", "compiling ...",
                                "running 1 warm-up and 1 timed prefills ..."]
    assert "tokens/s" in out
    code, out, err = run(capsys, "prefill", *TINY, "--json")
    assert code == 0 and err == "" and json.loads(out)["batch"] == 1

"""The `jax-dwdp prefill` command: output contract, logits file, and one clear line for each bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.cli import main
from jax_dwdp.config import ModelConfig
from jax_dwdp.prefill import jit_prefill
from jax_dwdp.weights.hf_loader import load_hf_checkpoint
from tests.hf_reference import random_hf_model, rel_err, save_hf

SMALL = ModelConfig.preset("tiny").replace(num_hidden_layers=2, vocab_size=64)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_hf(random_hf_model(SMALL, seed=7), tmp_path_factory.mktemp("ckpt") / "hf")


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_console_script_prints_one_json_object():
    exe = shutil.which("jax-dwdp") or sys.executable
    cmd = [exe] if exe.endswith("jax-dwdp") else [exe, "-m", "jax_dwdp.cli"]
    proc = subprocess.run(cmd + ["prefill", "--preset", "tiny", "--batch", "2", "--seq-len", "33", "--json",
                                 "--iters", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["batch"] == 2 and result["seq_len"] == 33 and result["logits_finite"]
    assert result["tokens_per_s"] > 0 and result["compile_s"] > 0


def test_logits_out_matches_python_api(tmp_path, capsys, checkpoint, rng):
    tokens = rng.integers(0, SMALL.vocab_size, (2, 21)).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    code, out, err = run_cli(capsys, "prefill", "--checkpoint", str(checkpoint), "--tokens", str(tmp_path / "tokens.npy"),
                             "--dtype", "float32", "--logits-out", str(tmp_path / "logits.npy"), "--json", "--iters", "1")
    assert code == 0, err
    logits = np.load(tmp_path / "logits.npy")
    assert logits.dtype == np.float32 and logits.shape == (2, 21, SMALL.vocab_size)
    model, _ = load_hf_checkpoint(checkpoint, dtype=jnp.float32)
    expected, _ = jit_prefill(model)(tokens)
    assert rel_err(logits, expected) <= 1e-5
    assert json.loads(out)["logits_out"] == str(tmp_path / "logits.npy")


def bad_cases(tmp_path, checkpoint):
    np.save(tmp_path / "oov.npy", np.array([[1, 2, SMALL.vocab_size]], np.int32))
    np.save(tmp_path / "empty.npy", np.zeros((1, 0), np.int32))
    (tmp_path / "garbage.npy").write_bytes(b"not numpy")
    ck = ["--checkpoint", str(checkpoint)]
    return [
        (ck + ["--tokens", str(tmp_path / "oov.npy")], f"token id {SMALL.vocab_size} is outside the vocabulary"),
        (ck + ["--tokens", str(tmp_path / "empty.npy")], "tokens is empty"),
        (ck + ["--tokens", str(tmp_path / "garbage.npy")], "not a readable .npy"),
        (ck + ["--tokens", str(tmp_path / "missing.npy")], "no such file"),
        (ck + ["--dtype", "float16"], "dtype 'float16' is not supported"),
        (["--checkpoint", str(tmp_path / "nowhere")], "no such folder"),
        (["--preset", "huge"], "unknown preset 'huge'"),
        (["--preset", "tiny", "--seq-len", "0"], "--seq-len must be >= 1"),
        (["--preset", "tiny", "--logits-out", str(tmp_path / "no" / "dir.npy")], "does not exist"),
    ]


def test_bad_input_gives_one_clear_line(tmp_path, capsys, checkpoint):
    for argv, message in bad_cases(tmp_path, checkpoint):
        code, out, err = run_cli(capsys, "prefill", *argv, "--iters", "1")
        assert code == 2, (argv, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (argv, err)
        assert "Traceback" not in err and out == ""


@pytest.mark.devices(2)
def test_pipeline_prefill_logits_equal_one_device(tmp_path, capsys, checkpoint, rng):
    tokens = rng.integers(0, SMALL.vocab_size, (4, 19)).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    outs = {}
    for p, m in ((1, 1), (2, 2)):
        code, out, err = run_cli(capsys, "prefill", "--checkpoint", str(checkpoint), "--tokens", str(tmp_path / "tokens.npy"),
                                 "--dtype", "float32", "--pipeline", str(p), "--microbatches", str(m), "--iters", "1",
                                 "--logits-out", str(tmp_path / f"logits{p}.npy"), "--json")
        assert code == 0, err
        assert (f"pipeline {p} stages" in json.loads(out)["model"]) == (p > 1)
        outs[p] = np.load(tmp_path / f"logits{p}.npy")
    assert rel_err(outs[2], outs[1]) <= 1e-4


@pytest.mark.devices(2)
def test_fused_swiglu_flag_computes_the_same_logits(tmp_path, capsys, checkpoint, rng):
    """--fused-swiglu (interleaved expert weights; on the CPU the portable path) gives the same logits, alone and
    through the pipeline."""
    tokens = rng.integers(0, SMALL.vocab_size, (2, 17)).astype(np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    outs = {}
    for name, extra in (("plain", []), ("fused", ["--fused-swiglu"]), ("fused_p2", ["--fused-swiglu", "--pipeline", "2"])):
        code, _, err = run_cli(capsys, "prefill", "--checkpoint", str(checkpoint), "--tokens", str(tmp_path / "tokens.npy"),
                               "--dtype", "float32", "--iters", "1", "--logits-out", str(tmp_path / f"{name}.npy"), *extra)
        assert code == 0, err
        outs[name] = np.load(tmp_path / f"{name}.npy")
    assert rel_err(outs["fused"], outs["plain"]) <= 1e-6
    assert rel_err(outs["fused_p2"], outs["plain"]) <= 1e-4


def test_plan_prints_the_stage_layout(capsys):
    code, out, err = run_cli(capsys, "plan", "--preset", "35b-a3b", "--pipeline", "3", "--json")
    assert code == 0, err
    plan = json.loads(out)
    stages = plan["stages"]
    assert [(s["start_layer"], s["end_layer"]) for s in stages] == [(0, 14), (14, 27), (27, 40)]
    cfg = ModelConfig.preset("35b-a3b")
    for s in stages:
        ids = range(s["start_layer"], s["end_layer"])
        assert s["full_attention_layers"] == [i for i in ids if cfg.layer_types[i] == "full_attention"]
        assert s["linear_attention_layers"] == [i for i in ids if cfg.layer_types[i] == "linear_attention"]
        assert s["cache_bytes_per_token"] == 2 * len(s["full_attention_layers"]) * 2 * 256 * 2
        assert s["devices"] == [s["stage"]]
    # Weights are split exactly: the stages' bytes add up to the whole model's bf16 bytes (A_log stays fp32).
    a_log = len(cfg.layer_ids("linear_attention")) * cfg.linear_num_value_heads
    assert sum(s["weight_bytes"] for s in stages) == 2 * cfg.param_counts()["total"] + 2 * a_log


def test_plan_prints_a_table_and_no_buffers_for_one_rank(capsys):
    code, out, err = run_cli(capsys, "plan", "--preset", "35b-a3b", "--pipeline", "2", "--dwdp", "2")
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4 and rows[0].startswith("| 0 | [0, 20) |") and rows[3].startswith("| 1 | [20, 40) |")
    assert all(row.split("|")[10].strip() == "1.50" for row in rows), rows  # the in-place store's slots, GiB
    assert "read in place" in out
    code, out, err = run_cli(capsys, "plan", "--preset", "35b-a3b", "--json")
    (rank,) = json.loads(out)["stages"][0]["dwdp_ranks"]  # one rank holds every expert: nothing is fetched
    assert rank["prefetch_buffer_bytes"] == rank["xla_gather_buffer_bytes"] == rank["peer_bytes_per_layer"] == 0
    assert rank["store_slot_bytes"] == 0 and rank["store_mode"] == "none"


def test_plan_and_pipeline_refuse_bad_layouts(capsys):
    for argv, message in [
        (["plan", "--preset", "tiny", "--pipeline", "5"], "5 pipeline stages for 4 layers"),
        (["plan", "--preset", "tiny", "--pipeline", "2", "--stage-boundaries", "4"], "empty stage"),
        (["plan", "--preset", "tiny", "--pipeline", "2", "--stage-boundaries", "x"], "expected comma-separated"),
        (["prefill", "--preset", "tiny", "--batch", "3", "--microbatches", "0"], "--microbatches must be >= 1"),
        (["prefill", "--preset", "tiny", "--dwdp", "2", "--dwdp-backend", "ffi"], "--experts ffi: the DWDP FFI path needs CUDA GPUs"),
        (["prefill", "--preset", "tiny", "--dwdp", "2", "--dwdp-backend", "nccl"], "choose one of local, xla, ffi, dep"),
        (["plan", "--preset", "tiny", "--dwdp", "9"], "9 DWDP ranks for 8 experts"),
    ]:
        code, out, err = run_cli(capsys, *argv)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (argv, err)

"""A PrefillRequest is what `jax-dwdp prefill` runs: made from Python it refuses what the command refuses, naming
its fields where the command names its flags (one message, options.OptionError), and it runs to the dict the
command prints."""

from __future__ import annotations

import json

import numpy as np
import pytest

from jax_dwdp import driver as driver_module
from jax_dwdp.cli import main
from jax_dwdp.driver import PrefillSpec
from jax_dwdp.outputs import OutputError
from jax_dwdp.request import PrefillRequest, RequestError

TINY = PrefillSpec(preset="tiny")


def flags(error) -> str:
    return error.named(lambda name: "--" + name.replace("_", "-"))


@pytest.mark.parametrize("fields, message", [
    (dict(iters=0), "iters must be >= 1, got 0"),
    (dict(stall_timeout=0), "stall_timeout must be > 0 seconds, got 0"),
    (dict(num_processes=0), "num_processes must be >= 1, got 0"),
    (dict(tokens="t.npy", batch=2), "batch shapes random tokens; with tokens the file gives the shape"),
    (dict(tokens="t.npy", batch=2, seq_len=4), "batch and seq_len shape random tokens"),
    (dict(top_k=0), "top_k must be >= 1 and generate >= 0, got 0 and 0"),
    (dict(generate=2, num_processes=2), "generate continues one prefill's cache in one process: not with "
                                        "prefill_chunk or num_processes"),
    (dict(spec=PrefillSpec(preset="tiny", prefill_chunk=4), generate=2), "generate continues one prefill's cache"),
    (dict(share_gpu=True), "share_gpu shares one GPU between the processes of a launch: give num_processes N"),
    (dict(spec=PrefillSpec(preset="tiny", ranks=2, experts="ffi", microbatches=2), share_gpu=True, num_processes=2),
     "share_gpu runs one microbatch, not 2: joining microbatches' outputs across processes is a device collective, "
     "which NCCL refuses on one GPU"),
    (dict(chat=True), "chat renders prompts / prompt_file text: give a prompt"),
    (dict(prompts=["hi"]), "prompts needs checkpoint DIR with the model's tokenizer.json (a preset has random "
                           "weights and no tokenizer"),
    (dict(spec=PrefillSpec(checkpoint="ckpt"), prompts=["hi"], seq_len=8),
     "the prompts are the batch: prompts / prompt_file do not combine with tokens, batch or seq_len"),
    (dict(spec=PrefillSpec(checkpoint="ckpt"), prompt_file="p.txt", num_processes=2),
     "prompts runs in one process: not with num_processes"),
], ids=lambda v: ",".join(v) if isinstance(v, dict) else None)
def test_a_request_refuses_fields_that_do_not_combine_naming_them(fields, message):
    """The checks `jax-dwdp prefill` makes of how its options combine live in the request: Python hears field
    names, the command line (tests/test_cli_refusals.py, test_text.py, test_multiprocess.py) its flags."""
    fields = {"spec": TINY, **fields}
    with pytest.raises(RequestError) as e:
        PrefillRequest(**fields)
    assert str(e.value).startswith(message), str(e.value)
    assert "$" not in flags(e.value) and "--" in flags(e.value)


def test_prepare_names_the_field_of_a_file_or_shape_it_cannot_take(tmp_path, monkeypatch):
    with pytest.raises(RequestError, match=f"^tokens {tmp_path / 'none.npy'}: no such file$"):
        PrefillRequest(TINY, tokens=tmp_path / "none.npy").prepare()
    with pytest.raises(OutputError, match=f"^logits_out {tmp_path}: is a folder"):
        PrefillRequest(TINY, logits_out=tmp_path).prepare()
    with pytest.raises(RequestError, match="^9 DWDP ranks for 8 experts"):  # a layout the model cannot take
        PrefillRequest(PrefillSpec(preset="tiny", ranks=9), seq_len=4).prepare()
    monkeypatch.setattr(driver_module, "host_memory_bytes", lambda: 1)
    with pytest.raises(RequestError, match=r"^a batch of 2 x 4 tokens needs at least .*; lower batch or seq_len$") \
            as e:
        PrefillRequest(TINY, batch=2, seq_len=4).prepare()
    assert flags(e.value).endswith("; lower --batch or --seq-len")


def test_prepare_reads_the_tokens_and_a_logits_file_asks_for_every_position(tmp_path):
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    np.save(tmp_path / "t.npy", ids)
    inputs = PrefillRequest(TINY, tokens=tmp_path / "t.npy").prepare()
    assert inputs.tokens.tolist() == ids.tolist() and inputs.lengths.tolist() == [6, 6] and inputs.prompts is None
    assert PrefillRequest(TINY, tokens=ids).prepare().tokens.tolist() == ids.tolist()
    drawn = PrefillRequest(TINY, batch=3, seq_len=5).prepare()
    assert drawn.tokens.shape == (3, 5) and drawn.tokens.max() < drawn.cfg.vocab_size
    request = PrefillRequest(TINY, logits_out=tmp_path / "l.npy")
    assert request.spec.logits == "all" and TINY.logits == "last"
    assert PrefillRequest(PrefillSpec(checkpoint="ckpt"), prompts="one prompt").prompts == ("one prompt",)


def test_a_request_runs_what_the_command_runs(tmp_path, capsys):
    """The dict `run()` returns is what `jax-dwdp prefill --json` prints (the timings aside), the logits file the
    same file."""
    spec = PrefillSpec(preset="tiny", dtype="float32")
    notes = []
    got = PrefillRequest(spec, batch=2, seq_len=8, iters=1, generate=2, logits_out=tmp_path / "py.npy").run(
        notes=notes.append)
    assert main(["prefill", "--preset", "tiny", "--dtype", "float32", "--batch", "2", "--seq-len", "8", "--iters",
                 "1", "--generate", "2", "--logits-out", str(tmp_path / "cli.npy"), "--json"]) == 0
    want = json.loads(capsys.readouterr().out)
    assert want.pop("command") == "prefill" and notes == []
    timings = ("compile_s", "prefill_s", "tokens_per_s", "tflops_per_s", "peak_device_memory_bytes",
               "peak_device_memory_bytes_per_device", "logits_out")
    assert {k: v for k, v in got.items() if k not in timings} == {k: v for k, v in want.items() if k not in timings}
    assert list(got) == list(want) and got["generated_ids"] and got["logits_finite"]
    np.testing.assert_array_equal(np.load(tmp_path / "py.npy"), np.load(tmp_path / "cli.npy"))


def test_a_dollar_in_a_path_stays_a_dollar(tmp_path):
    """Messages name options as $name; a path's own $ (a folder named $run) is kept as written, from Python and on
    the command line."""
    from jax_dwdp.outputs import OutputError, output_file

    missing = tmp_path / "$run" / "logits.npy"
    with pytest.raises(OutputError) as e:
        output_file(str(missing), "$logits_out")
    assert str(e.value).startswith(f"logits_out {missing}: folder {missing.parent} does not exist"), str(e.value)
    assert e.value.named(lambda name: "--" + name.replace("_", "-")).startswith(f"--logits-out {missing}:")


def test_a_shared_gpu_takes_a_batch_the_ranks_divide():
    """--share-gpu: padding rows dropped across processes would be a device collective (NCCL refuses two ranks on
    one GPU), so a batch the ranks do not divide is refused before any process starts; one they divide passes."""
    spec = PrefillSpec(preset="tiny", ranks=2, experts="ffi")
    with pytest.raises(RequestError) as e:
        PrefillRequest(spec, batch=3, seq_len=8, share_gpu=True, num_processes=2).prepare()
    assert str(e.value).startswith("share_gpu needs a batch that the 2 ranks divide, got 3 sequences"), str(e.value)
    assert flags(e.value).startswith("--share-gpu needs a batch")
    assert PrefillRequest(spec, batch=4, seq_len=8, share_gpu=True, num_processes=2).prepare().tokens.shape == (4, 8)

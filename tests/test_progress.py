"""Progress lines (jax_dwdp/progress.py): one bar format for convert, checkpoint loading and building; drawn only
where a caller turned it on (the CLI, without --json), one line per task (a loader inside a layer-by-layer build
stays silent)."""

from __future__ import annotations

import io
import json

import pytest

from jax_dwdp.cli import main
from jax_dwdp.config import ModelConfig
from jax_dwdp.progress import LayerBar, bar_line, layers, shown_on
from tests.checkpoint_helpers import write_hf


def test_the_bar_counts_bytes_and_rate_and_ends_its_line():
    assert bar_line(3, 4, 2_000_000_000, 2.0, "loading x", width=8) == \
        "[######..] 3/4 layers, 2.00 GB, 1.00 GB/s  loading x"
    stream = io.StringIO()
    with shown_on(stream):
        with layers("outer", 2) as bar:
            with layers("inner", 5) as inner:  # inside another bar of this thread: silent
                inner.advance(10)
            bar.advance(1e9)
            bar.advance(1e9)
    text = stream.getvalue()
    assert text.count("\r") == 2 and text.endswith("\n") and "inner" not in text
    assert "2/2 layers, 2.00 GB" in text.splitlines()[-1] or "2/2 layers, 2.00 GB" in text.split("\r")[-1]
    silent = LayerBar("nowhere", 3)  # no stream: draws nothing, closes quietly
    silent.advance(5)
    silent.close()
    with layers("not shown", 1) as bar:  # outside shown_on: nothing anywhere
        bar.advance(1)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_hf(tmp_path_factory.mktemp("progress") / "hf", ModelConfig.preset("tiny"), seed=4)


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


def test_loading_shows_one_progress_line_and_json_none(capsys, hf_dir):
    _, err = _run(capsys, "prefill", "--checkpoint", str(hf_dir), "--dtype", "float32", "--iters", "1")
    bars = [part for part in err.replace("\n", "\r").split("\r") if part.startswith("[")]
    assert bars and "tensors" in bars[-1] and "GB/s" in bars[-1] and f"loading {hf_dir.name}" in bars[-1], err
    total = bars[-1].split()[1]  # done/total
    assert total.split("/")[0] == total.split("/")[1]
    out, err = _run(capsys, "prefill", "--checkpoint", str(hf_dir), "--dtype", "float32", "--iters", "1", "--json")
    assert "\r" not in err and "GB/s" not in err
    json.loads(out)


@pytest.mark.devices(2)
def test_stages_and_ranks_show_their_own_lines(capsys, hf_dir):
    """Two stages: each stage's load is its own line (its tensors). Two DWDP ranks: the stage is built layer by
    layer onto the ranks, one line of layers (each layer's load inside it stays silent)."""
    _, err = _run(capsys, "prefill", "--checkpoint", str(hf_dir), "--dtype", "float32", "--iters", "1",
                  "--pipeline", "2")
    finals = [line.split("\r")[-1] for line in err.split("\n") if line.lstrip("\r").startswith("[")]
    assert len(finals) == 2 and all("tensors" in f and f.split()[1].split("/")[0] == f.split()[1].split("/")[1]
                                    for f in finals), err
    _, err = _run(capsys, "prefill", "--checkpoint", str(hf_dir), "--dtype", "float32", "--iters", "1",
                  "--dwdp", "2")
    finals = [line.split("\r")[-1] for line in err.split("\n") if line.lstrip("\r").startswith("[")]
    assert len(finals) == 1 and "building layers [0, 4)" in finals[0] and "4/4 layers" in finals[0], err

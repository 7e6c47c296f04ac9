"""Every notebook under notebooks/ runs top to bottom (its cells assert what they show)."""

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # a test extra; absent on the GPU image
NotebookClient = pytest.importorskip("nbclient").NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


def test_there_is_a_notebook():
    assert NOTEBOOKS

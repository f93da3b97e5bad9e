"""Every notebook executes top to bottom (the notebooks import dpfl_tf only), each
cell that draws a figure shows it, and the committed notebooks carry their
outputs (regenerate them with ``python notebooks/run_notebooks.py``)."""

import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
#: a cell that makes a figure: pyplot figures, or dpfl_tf.plotting's helpers
DRAWS = re.compile(r"plt\.(subplots|figure)\(|\bplot_\w+\(")


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


def _missing_figures(nb) -> list[str]:
    """The first line of every figure-drawing cell that has no PNG output."""
    return [
        c.source.splitlines()[0]
        for c in _code_cells(nb)
        if DRAWS.search(c.source)
        and not any("image/png" in o.get("data", {}) for o in c.get("outputs", []))
    ]


#: a path that names the machine it was written on: /home/.., /Users/.., C:\\..
ABSOLUTE_PATH = re.compile(
    r"(?<![\w.])(/(home|root|Users|work|tmp|mnt|var|opt|srv)/|\b[A-Za-z]:\\)"
)


def _absolute_paths(nb) -> list[str]:
    """Every line of a cell's source or text output that names an absolute path
    (a notebook run on the author's machine shows the author's data path)."""
    found = []
    for cell in nb.cells:
        texts = [cell.source]
        for out in cell.get("outputs", []):
            texts.append("".join(out.get("text", "")))
            texts.append("".join(out.get("data", {}).get("text/plain", "")))
        found += [line for t in texts for line in t.splitlines() if ABSOLUTE_PATH.search(line)]
    return found


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_is_executed_with_its_figures(path):
    nb = nbformat.read(path, as_version=4)
    unexecuted = [
        c.source.splitlines()[0]
        for c in _code_cells(nb)
        if c.source.strip() and c.get("execution_count") is None
    ]
    assert not unexecuted, f"cells without outputs (run notebooks/run_notebooks.py): {unexecuted}"
    assert not [
        o for c in _code_cells(nb) for o in c.get("outputs", []) if o.get("output_type") == "error"
    ]
    assert not _missing_figures(nb)
    assert not _absolute_paths(nb), "the notebook shows its author's paths"


def test_absolute_paths_are_detected():
    """The check above can fail: a data path in an output, a home in a source."""
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("load('/home/alice/data/mnist.npz')", execution_count=1)
    cell.outputs = [nbformat.v4.new_output("stream", text="read /work/shared/data/x\nok\n")]
    win = nbformat.v4.new_code_cell("open(r'C:\\Users\\bob\\x.npz')", execution_count=3)
    nb.cells += [cell, nbformat.v4.new_code_cell("x = 'data/home/c'", execution_count=2), win]
    assert _absolute_paths(nb) == [
        "load('/home/alice/data/mnist.npz')",
        "read /work/shared/data/x",
        "open(r'C:\\Users\\bob\\x.npz')",
    ]


def test_missing_figure_is_detected():
    """The check above can fail: a drawing cell without an image output."""
    nb = nbformat.v4.new_notebook()
    nb.cells.append(
        nbformat.v4.new_code_cell("fig, ax = plt.subplots()\nax.plot([1, 2])", execution_count=1)
    )
    assert _missing_figures(nb) == ["fig, ax = plt.subplots()"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_and_shows_its_figures(path, monkeypatch):
    monkeypatch.setenv("DPFL_NOTEBOOK_SMALL", "1")  # notebooks shrink their runs for CI
    nb = nbformat.read(path, as_version=4)
    for cell in _code_cells(nb):
        cell.outputs = []
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    errors = [
        o for c in _code_cells(nb) for o in c.get("outputs", []) if o.get("output_type") == "error"
    ]
    assert not errors
    assert not _missing_figures(nb), "a figure did not render (backend changed?)"

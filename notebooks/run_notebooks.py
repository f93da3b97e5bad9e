"""Executes every notebook in this directory top to bottom and saves it with
its outputs (figures included), so the committed notebooks show their results.

    python notebooks/run_notebooks.py            # all notebooks
    python notebooks/run_notebooks.py federated  # those whose name contains "federated"

Needs the notebooks extra (``pip install -e ".[notebooks]"``).  Runs the
notebooks' own settings (``DPFL_NOTEBOOK_SMALL`` is not set); fails, without
rewriting the notebook, if a cell raises.
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
import time

import nbclient
import nbformat

HERE = pathlib.Path(__file__).resolve().parent
#: what TensorFlow's libraries print on stderr while loading (no log level hides it)
_START_UP = re.compile(r"^(WARNING: All log messages before absl::InitializeLog\(\).*|"
                       r"[IWE]\d{4} [\d:. ]+\d+ \S+:\d+\] .*)\n?", re.M)


def _tidy(nb) -> None:
    """Drops TensorFlow's start-up lines from stderr outputs."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                out["text"] = _START_UP.sub("", out["text"])
                if not out["text"].strip():
                    continue
            kept.append(out)
        cell.outputs = kept


def run(path: pathlib.Path, timeout: int = 1800) -> int:
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    _tidy(nb)
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code"
                 for o in c.get("outputs", []))
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)
    return images


def main(argv: list[str]) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")   # the kernels inherit it
    paths = sorted(HERE.glob("*.ipynb"))
    if argv:
        paths = [p for p in paths if any(a in p.stem for a in argv)]
    for path in paths:
        start = time.perf_counter()
        images = run(path)
        print(f"{path.name}: executed in {time.perf_counter() - start:.0f} s, "
              f"{images} figure(s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

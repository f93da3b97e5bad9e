"""The verification matrix: every training mode, and every combination of any three
of its factors, against the ledger.

The factors: sampling (poisson, fixed_size, shuffle) x execution (eager; graph
and XLA with steps_per_execution 1 and 3) x distribution (none,
MirroredStrategy on 2 logical CPUs) x clipping (flat, per-layer) x scenario
(plain fit; a target that stops training; a weight-rollback callback under a
target; kill and resume from a checkpoint).  The cells are a covering array of
strength 3 (`_matrix_child.cells`): every combination of values of any three
factors that the library runs is run in some cell (63 cells instead of the
product's 168; `test_the_cells_cover_every_three_factor_combination` checks it),
and every refused combination is checked.  They run in two child processes
(`tests/keras/_matrix_child.py`).  In every cell:

* lots recorded in the ledger == lots computed (released), and == the lots
  the noise shows: the zero-input kernel rows change by the DP noise alone, so
  sum(change^2) / (coords * (lr sigma C_tot / L)^2) estimates the number of
  noised lots -- it must match the lots counted, step by step in total, and a
  wrong noise scale (or noise per physical batch, or per replica) fails it;
* a step that counted no lot changed nothing;
* epsilon <= the target when one is set;
* the weights are finite.

Combinations the library refuses (MirroredStrategy with steps_per_execution > 1
or with XLA) are checked to be refused with a clear error before any lot.
"""

import itertools
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.keras import _matrix_child as matrix

ROOT = pathlib.Path(__file__).resolve().parents[2]
CELLS = list(matrix.cells())


SHARDS = 2  # one child process per core: the cells are independent


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    logs = tmp_path_factory.mktemp("matrix")
    children = []
    for k in range(SHARDS):  # output to files: a full pipe would stall a child
        out, err = open(logs / f"{k}.out", "w+"), open(logs / f"{k}.err", "w+")
        children.append(
            (
                subprocess.Popen(
                    [sys.executable, "-m", "tests.keras._matrix_child", "--shard", f"{k}/{SHARDS}"],
                    cwd=ROOT,
                    env=env,
                    text=True,
                    stdout=out,
                    stderr=err,
                ),
                out,
                err,
            )
        )
    rows = {}
    for child, out, err in children:
        child.wait(timeout=1500)
        out.seek(0), err.seek(0)
        assert child.returncode == 0, err.read()[-4000:]
        for line in out.read().splitlines():
            if line.startswith("{"):
                row = json.loads(line)
                rows[row["index"]] = row
    assert sorted(rows) == list(range(len(CELLS)))
    return [rows[i] for i in range(len(CELLS))]


def test_the_cells_cover_every_three_factor_combination():
    full = matrix.all_cells()
    running = [c for c in full if matrix.refused(c) is None]
    wanted = set().union(*(matrix.interactions(c) for c in running))
    chosen = [c for c in CELLS if matrix.refused(c) is None]
    assert set().union(*(matrix.interactions(c) for c in chosen)) == wanted
    assert len(chosen) == 63 and len(running) == 168
    # the same, by brute force, without the helper the cells were chosen with
    keys = ("sampling", "execution", "spe", "distribution", "clip", "scenario")
    factors = [("sampling",), ("execution", "spe"), ("distribution",), ("clip",), ("scenario",)]
    for trio in itertools.combinations(factors, 3):
        fields = [k for f in trio for k in f]
        need = {tuple(c[k] for k in fields) for c in running}
        have = {tuple(c[k] for k in fields) for c in chosen}
        assert need == have, (fields, need - have)
    assert all(set(c) == set(keys) for c in chosen)
    # every refused combination is still checked
    assert [c for c in CELLS if matrix.refused(c)] == [c for c in full if matrix.refused(c)]
    # each of the 5 x 4 x 3 combinations of execution, scenario and sampling is run
    assert (
        len(
            set().union(
                *({(c["execution"], c["spe"], c["scenario"], c["sampling"])} for c in chosen)
            )
        )
        == 60
    )


def _name(cell):
    return "-".join(
        str(cell[k]) for k in ("sampling", "execution", "spe", "distribution", "clip", "scenario")
    )


@pytest.mark.parametrize("index", range(len(CELLS)), ids=[_name(c) for c in CELLS])
def test_cell(results, index):
    row = results[index]
    cell = CELLS[index]
    assert all(row[k] == v for k, v in cell.items())
    reason = matrix.refused(cell)
    if reason is not None:
        assert row["refusal"] is not None and reason in row["refusal"]
        assert row["lots_computed"] == 0
        return

    # the ledger accounts for exactly the lots computed (shuffle: whole epochs)
    if cell["sampling"] == "shuffle":
        per_epoch = matrix.LOTS_PER_EPOCH
        assert row["ledger_lots"] == -(-row["lots_computed"] // per_epoch) * per_epoch
    else:
        assert row["ledger_lots"] == row["lots_computed"]
    assert row["finite"]

    steps = row["steps"]
    counted = sum(s[0] for s in steps)
    scenario = cell["scenario"]
    if scenario == "plain":
        assert row["lots_computed"] == counted == row["expected_lots"]
    elif scenario in ("target", "rollback"):
        assert row["stop_reason"] == "budget_spent"
        assert row["epsilon"] <= row["target"]
        allowed = matrix.LOTS_PER_EPOCH if cell["sampling"] == "shuffle" else 8
        assert row["lots_computed"] == counted == allowed
        if scenario == "rollback":  # weights went back one epoch; privacy did not
            assert row["lots_applied"] == row["lots_computed"] - matrix.LOTS_PER_EPOCH
    else:  # resume: the killed run's lots after the checkpoint die with it
        assert row["restored_lots"] == matrix.LOTS_PER_EPOCH * row["restored_epoch"]
        assert row["lots_computed"] == row["lots_applied"] == row["expected_lots"]
        assert counted == row["killed_at"] + row["expected_lots"] - row["restored_lots"]

    # the noise: once per lot, std lr * sigma * C_tot / L
    unit = row["noise_coords"] * row["noise_var_per_lot"]
    for lots, _, sq in steps:
        if lots == 0:
            assert sq == 0.0  # a skipped lot changes nothing
    ratio = sum(s[2] for s in steps) / (unit * counted)
    # ~2,000 coordinates x >= 6 lots: the ratio's standard error is < 1.3%
    assert 0.9 < ratio < 1.1, ratio

"""The warm ClientApp (`dpfl_tf.federated.flower_warm`): one worker process per node
answers every round with the cold ClientApp's own function, so a run is the same
run; the worker ends with the process it watches; a worker's error reaches the
ClientApp; and the ClientApp's process never imports TensorFlow."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402

import dpfl_tf.federated.flower as fl  # noqa: E402
from dpfl_tf._runs import running  # noqa: E402
from dpfl_tf.federated import flower_warm  # noqa: E402

RUN_CONFIG = {
    "clients": 2,
    "clients-per-round": 2,
    "sampling": "fixed_size",
    "rounds": 2,
    "dp": "global",
    "partition": "iid",
    "train-subset": 300,
    "hidden": "16",
    "noise-seed": 1,  # seeded noise: two runs of the same rounds are the same run
}


def _run(client_app, run_config):
    out = {}
    server = fl.make_server_app(on_finish=lambda d, r, s: out.update(d=d))
    server(
        fl.LocalGrid(client_app, 2, run_config=run_config),
        Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config),
    )
    return out["d"].server


def _workers(parent_pid: int) -> list[int]:
    """Live worker processes serving nodes of `parent_pid` (by their command line)."""
    prefix = flower_warm.worker_address(parent_pid, 0).rsplit("-", 1)[0] + "-"
    out = subprocess.run(["pgrep", "-f", prefix], capture_output=True, text=True)
    # not the zombies this process has yet to reap
    return [int(pid) for pid in out.stdout.split() if running(int(pid))]


def _wait(condition, seconds: float) -> None:
    """Until `condition()` is false, at most `seconds`."""
    deadline = time.monotonic() + seconds
    while condition() and time.monotonic() < deadline:
        time.sleep(0.2)


@pytest.fixture
def parent(monkeypatch):
    """A stand-in for the SuperNode's executor: the workers watch it."""
    proc = subprocess.Popen(["sleep", "600"])
    monkeypatch.setattr(flower_warm, "_parent_pid", lambda: proc.pid)
    yield proc
    proc.kill()
    proc.wait()
    _wait(lambda: _workers(proc.pid), 10)


def test_a_warm_run_is_the_cold_run_and_its_workers_end_with_their_node(parent, mnist):
    cold = _run(fl.client_app, RUN_CONFIG)
    warm = _run(flower_warm.client_app, RUN_CONFIG)
    assert warm.ledger == cold.ledger and warm.epsilon() == cold.epsilon()
    assert warm.history[-1].accuracy == cold.history[-1].accuracy
    for a, b in zip(warm.trainer.get_weights(), cold.trainer.get_weights()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())

    workers = _workers(parent.pid)
    assert len(workers) == 2  # one per node, kept across the rounds (and the enrolment)
    parent.kill()
    parent.wait()
    _wait(lambda: _workers(parent.pid), 10)
    assert _workers(parent.pid) == []  # they end with the process they watch
    assert not os.path.exists(flower_warm.worker_address(parent.pid, 1))  # and retire


def test_an_error_in_the_worker_reaches_the_client_app(parent, mnist):
    grid = fl.LocalGrid(flower_warm.client_app, 2, run_config=RUN_CONFIG, raise_client_errors=False)
    grid.contexts[2].node_config[fl.PARTITION_ID_KEY] = 7
    with pytest.raises(ValueError, match=r"node 2 could not enrol: WorkerError: .*\[0, 2\), got 7"):
        fl.DPStrategy.from_config(fl.config_from_run_config(RUN_CONFIG)).run(grid, 1)


def test_an_idle_worker_ends(parent, mnist, monkeypatch):
    """Workers idle for DPFL_FLOWER_WORKER_IDLE seconds end and leave no file.  A
    worker's idle time starts at its last reply: on a loaded machine (three pytest
    workers on two cores) one node's worker was already gone, idle for 8 s, when the
    other's training ended, so the check right after the run asks for a worker still
    there, not for both (test_a_warm_run_is_the_cold_run... and
    test_a_dead_worker_is_replaced... check one per node)."""
    monkeypatch.setenv("DPFL_FLOWER_WORKER_IDLE", "12")
    grid = fl.LocalGrid(flower_warm.client_app, 2, run_config=RUN_CONFIG)
    fl.DPStrategy.from_config(fl.config_from_run_config(RUN_CONFIG)).run(grid, 1)
    assert 1 <= len(_workers(parent.pid)) <= 2
    _wait(lambda: _workers(parent.pid), 40)
    assert _workers(parent.pid) == [] and parent.poll() is None  # idle, not orphaned
    directory = os.path.dirname(flower_warm.worker_address(parent.pid, 1))
    left = [f for f in os.listdir(directory) if f.startswith(f"worker-{parent.pid}-")]
    assert left == []  # they leave no file behind


def test_the_warm_client_app_imports_neither_tensorflow_nor_the_accountants():
    """Flower starts a ClientApp process for every message: what it imports is paid
    every round (TensorFlow seconds, dp-accounting about one)."""
    code = (
        "import sys, dpfl_tf.federated.flower_warm as w; assert callable(w.client_app); "
        "print([m for m in ('tensorflow', 'dp_accounting', 'keras') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_a_link_in_place_of_the_private_directory_is_refused(tmp_path, monkeypatch, request):
    """Another user could plant a symbolic link where the keys go; it is refused."""
    runtime = pathlib.Path(tempfile.mkdtemp(dir="/tmp"))  # short: a socket path's limit
    request.addfinalizer(lambda: shutil.rmtree(runtime, ignore_errors=True))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (runtime / "dpfl-flower").symlink_to(elsewhere)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    with pytest.raises(PermissionError, match="not a link"):
        flower_warm.worker_address(1, 1)
    (runtime / "dpfl-flower").unlink()
    assert os.path.dirname(flower_warm.worker_address(1, 1)) == str(runtime / "dpfl-flower")


def test_a_dead_worker_is_replaced_other_code_gets_a_new_one_and_a_terminated_one_cleans_up(
    parent, mnist, monkeypatch
):
    """One node's life: its workers killed (SIGKILL) are replaced at the next message;
    new code on the path (dpfl_tf upgraded, another app bundle) gets new workers and the
    old ones end; a worker terminated (the SuperNode's group stopped) removes its files."""
    grid = fl.LocalGrid(flower_warm.client_app, 2, run_config=RUN_CONFIG)

    def one_round():
        strategy = fl.DPStrategy.from_config(fl.config_from_run_config(RUN_CONFIG))
        strategy.run(grid, 1)
        assert strategy.server.rounds_done == 1

    one_round()
    first = _workers(parent.pid)
    for pid in first:
        os.kill(pid, signal.SIGKILL)
    one_round()
    second = _workers(parent.pid)
    assert len(second) == 2 and not set(second) & set(first)  # the dead ones replaced
    # dpfl_tf upgraded (or another app bundle on the path): the old worker is not asked
    monkeypatch.setattr(flower_warm, "code_fingerprint", lambda: "other code")
    one_round()
    _wait(lambda: set(_workers(parent.pid)) & set(second), 15)
    third = _workers(parent.pid)
    assert len(third) == 2 and not set(third) & set(second)  # replaced, and the old ended
    for pid in third:  # SIGTERM (the SuperNode's group stopped): the files go too
        os.kill(pid, signal.SIGTERM)
    _wait(lambda: _workers(parent.pid), 15)
    directory = os.path.dirname(flower_warm.worker_address(parent.pid, 1))
    assert [f for f in os.listdir(directory) if f.startswith(f"worker-{parent.pid}-")] == []

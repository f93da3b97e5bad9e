"""Kill a DP training run mid-epoch (SIGKILL, a real child process), resume it
from the last checkpoint in a new process, and check that the ledger counts
exactly the lots applied to the weights it continues from -- nothing lost,
nothing counted twice.  The same for a federated run killed during a round."""

import json
import os
import signal
import subprocess
import sys
import time

import dp_accounting
import pytest

from dpfl_tf.privacy import PrivacyLedger, compute_epsilon, dp_sgd_event
from tests import warm_python
from tests.audit._resume_child import EPOCHS, LOT, NOISE, N, federated_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOTS_PER_EPOCH = N // LOT


def _start(kind, directory, *extra):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT}
    return warm_python.Popen(
        [sys.executable, "-m", "tests.audit._resume_child", kind, str(directory), *extra],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc, timeout=240):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]


def _wait_for(condition, proc, timeout=180.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        if proc.poll() is not None:
            raise AssertionError(
                "child ended before it could be killed: " + proc.stderr.read()[-3000:]
            )
        time.sleep(0.02)
    proc.kill()
    raise AssertionError("timed out waiting for the child")


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _log(directory):
    with open(directory / "lots.log") as f:
        return [tuple(int(v) for v in line.split()) for line in f if line.strip()]


def test_keras_run_killed_mid_epoch_resumes_with_an_exact_ledger(tmp_path):
    proc = _start("keras", tmp_path, "--slow")

    def mid_second_epoch():  # a checkpoint exists and epoch 2 is under way
        state = _read_json(tmp_path / "state.json")
        if not state or not (tmp_path / "lots.log").exists():
            return False
        lots = _log(tmp_path)
        return lots and lots[-1][1] >= state["lots_applied"] + 3

    _wait_for(mid_second_epoch, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    killed_pid = proc.pid
    state = _read_json(tmp_path / "state.json")
    applied_by_killed = max(n for pid, n in _log(tmp_path) if pid == killed_pid)
    # killed mid-epoch: lots were applied after the checkpoint and before the epoch ended
    assert state["epoch"] == 1 and state["lots_applied"] == LOTS_PER_EPOCH
    assert state["lots_applied"] < applied_by_killed < (state["epoch"] + 1) * LOTS_PER_EPOCH
    assert state["ledger_count"] == state["lots_applied"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp") or p.startswith(".")]

    resumed = _start("keras", tmp_path)
    _finish(resumed)
    report = _read_json(tmp_path / "report.json")
    total = EPOCHS * LOTS_PER_EPOCH
    assert report["initial_epoch"] == 1 and report["restored_lots"] == LOTS_PER_EPOCH
    # the resumed process continued the counter of the checkpoint, not of the killed run
    resumed_log = [n for pid, n in _log(tmp_path) if pid == report["pid"]]
    assert resumed_log == list(range(LOTS_PER_EPOCH + 1, total + 1))
    # lots applied to the final weights: the model's counter and, independently,
    # the optimizer's step count (restored with the optimizer state)
    assert report["lots_applied"] == report["optimizer_iterations"] == total
    # the ledger: exactly those lots, once each, with the run's event
    assert report["ledger_count"] == total
    assert [e["count"] for e in report["ledger"]] == [total]
    expected = compute_epsilon(dp_sgd_event(NOISE, total, sampling_rate=LOT / N), 1e-5)
    assert report["epsilon"] == pytest.approx(expected, rel=1e-9)
    # what the killed process did after its checkpoint is not in the ledger
    assert report["ledger_count"] < applied_by_killed + (total - LOTS_PER_EPOCH)


def test_federated_run_killed_during_a_round_resumes_with_an_exact_ledger(tmp_path):
    proc = _start("federated", tmp_path)

    def two_rounds_done():
        state = _read_json(tmp_path / "state.json")
        return bool(state) and state["round"] >= 2

    _wait_for(two_rounds_done, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    state = _read_json(tmp_path / "state.json")
    done_before_kill = state["round"]
    assert done_before_kill < 5  # killed before the end (during round done + 1)
    assert PrivacyLedger.from_dict(state["ledger"]).count() == done_before_kill
    assert len(state["history"]) == done_before_kill

    resumed = _start("federated", tmp_path)
    _finish(resumed)
    report = _read_json(tmp_path / "report.json")
    config = federated_config()
    assert report["start_round"] == done_before_kill
    assert report["rounds"] == report["ledger_rounds"] == config.rounds
    assert report["history_rounds"] == list(range(1, config.rounds + 1))  # none twice, none lost
    # Global DP, flat clipping, Poisson client sampling at q = m / K: one
    # sampled Gaussian with the configured noise multiplier per round
    q = config.clients_per_round / config.clients
    round_event = dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(config.noise_multiplier)
    )
    expected = compute_epsilon(
        dp_accounting.SelfComposedDpEvent(round_event, config.rounds), config.delta_max
    )
    assert report["epsilon"] == pytest.approx(expected, rel=1e-9)


def test_checkpoint_restores_weights_counter_ledger_and_optimizer_state(tmp_path):
    """In-process round trip of `DPCheckpoint`: the optimizer's step count and
    momentum come back too (a loaded DPModel used to drop them, restarting the
    learning-rate schedule and momentum on resume)."""
    import numpy as np

    from dpfl_tf.keras import DPSGD, DPModel
    from dpfl_tf.keras.checkpoint import DPCheckpoint
    from tests.keras.helpers import loss, mlp, mnist_slice

    x, y = mnist_slice(300, features=60)
    model = DPModel(mlp(hidden=8))
    model.compile(
        optimizer=DPSGD(0.1, momentum=0.9, l2_norm_clip=1.0, noise_multiplier=1.0), loss=loss()
    )
    model.fit(x, y, lot_size=30, epochs=2, verbose=0, callbacks=[DPCheckpoint(tmp_path)])
    state = DPCheckpoint.latest(tmp_path)
    assert state["epoch"] == 2 and state["lots_applied"] == state["ledger_count"] == 20
    assert sorted(os.listdir(tmp_path)) == ["model-000002.keras", "state.json"]
    restored, initial_epoch = DPCheckpoint.restore(tmp_path)
    assert initial_epoch == 2 and restored.lots_applied == 20
    assert restored.privacy_ledger == model.privacy_ledger
    assert int(restored.optimizer.iterations.numpy()) == 20

    def momenta(m):  # in the order of the model's trainable variables
        return [v.numpy() for v in m.optimizer.variables if v.path.endswith("_momentum")]

    assert len(momenta(model)) == len(momenta(restored)) == 4
    for a, b in zip(momenta(model), momenta(restored)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(model.model.trainable_variables, restored.model.trainable_variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())

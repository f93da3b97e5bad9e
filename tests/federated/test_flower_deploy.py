"""Flower's Deployment Engine end to end: a SuperLink and two SuperNodes started as
processes on 127.0.0.1 with the warm ClientApp, a short Global DP run that ends with
the in-process run's epsilon and test accuracy; one SuperNode killed (SIGKILL) after
round 1 -- the run fails with its results file kept, resumes from its checkpoint
once the node is back, and ends at the in-process epsilon; with min-nodes = 1 the
killed node's client is a dropout and the run completes.  Every process started
(workers included) is stopped (`experiments/federated_flower_deploy.py`).

The SuperNodes run with a heartbeat interval of 10 s (Flower's shortest; its default
30 s), so a killed node is declared lost after ~20 s instead of a minute.  About
three minutes (slow tier)."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest

from dpfl_tf._runs import die_with_parent

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("flwr") is None or shutil.which("flower-superlink") is None,
        reason="Flower is not installed: pip install 'dpfl-tf[flower]'",
    ),
]


def test_a_killed_supernode_keeps_the_books_and_the_run_resumes(tmp_path):
    out = tmp_path / "deploy.json"
    # Popen, not run: on an error here (Ctrl-C) run() would SIGKILL the experiment at
    # once; a SIGTERM lets it stop its deployment (Deployment.__exit__, up to ~35 s)
    run = subprocess.Popen(
        [
            sys.executable,
            os.path.join(ROOT, "experiments", "federated_flower_deploy.py"),
            "--rounds",
            "3",
            "--output",
            str(out),
            "--heartbeat-interval",
            "10",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_parent,  # this process killed: the experiment stops its deployment
    )
    try:
        stdout, stderr = run.communicate(timeout=3600)
    except BaseException:
        run.terminate()
        try:
            run.wait(timeout=60)
        except subprocess.TimeoutExpired:
            run.kill()
        raise
    assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
    data = json.loads(out.read_text())
    clean, kill, dropout = data["scenarios"]
    assert data["client_app"] == "dpfl_tf.federated.flower_warm:client_app"
    assert data["heartbeat_interval"] == 10.0
    assert clean["final"]["status"] == "completed" and clean["final"]["rounds"] == 3
    assert clean["final"]["epsilon"] == data["in_process_epsilon"]
    assert clean["final"]["test_accuracy"] == data["in_process_test_accuracy"]
    first = kill["first_run"]
    # the round after the kill waited ~2 x 10 s for the node, not Flower's 2 x 30 s (48-63 s)
    assert first["round_seconds"][1] < 40 and dropout["final"]["round_seconds"][1] < 40
    assert first["status"] == "failed" and "fewer than min_nodes=2" in first["error"]
    assert first["rounds"] >= 1 and first["epsilon"] > 0  # the spent budget is kept
    assert kill["final"]["status"] == "completed" and kill["final"]["rounds"] == 3
    assert kill["final"]["epsilon"] == data["in_process_epsilon"]
    assert (
        dropout["final"]["status"] == "completed" and sum(dropout["final"]["missing_clients"]) >= 1
    )
    assert dropout["final"]["epsilon"] == data["in_process_epsilon"]
    assert data["processes_left_running"] == []  # every process it started stopped

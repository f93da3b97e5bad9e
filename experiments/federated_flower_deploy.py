"""The federated wrapper on Flower's Deployment Engine: a SuperLink and K
SuperNodes as separate processes on 127.0.0.1, the ``dpfl_tf.federated.flower``
apps run with ``flwr run``, one SuperNode killed mid-run (issue 39).

Scenarios (each a fresh results file and checkpoint directory):

* ``clean`` -- no node lost: the run must end at the in-process run's epsilon
  and test accuracy (the same rounds on another runtime).
* ``kill`` -- min-nodes = K (the default): node K-1 is killed (SIGKILL) once
  round 1 is in the results file.  The round under way completes without it
  (after the SuperLink's heartbeat timeout), the next round finds too few
  nodes and the run fails -- with its results file (status failed, the epsilon
  already spent) and its checkpoint.  The node is started again and the same
  ``flwr run`` continues from the checkpoint to the last round.
* ``dropout`` -- min-nodes = 1: the killed node's client is a dropout in every
  later round it is sampled in, and the run completes.

Each run's epsilon is compared with the in-process run of the same config
(`run_federated`: the same events, so the same epsilon).  Every process
started here is stopped at the end.

A killed node is noticed by the SuperLink when its heartbeats stop: a SuperNode
declares a heartbeat interval of 30 s (a Flower constant, no flag), sends a
heartbeat every 17.5-22.5 s, and is declared lost after twice the interval
without one, so each scenario with a kill waits about a minute.
``--heartbeat-interval S`` starts the SuperNodes with S seconds instead (Flower
accepts 10 to 1800; the test uses 10): `SUPERNODE_WITH_INTERVAL` sets the value
in the SuperNode's connection to the SuperLink and its heartbeat sender only, not
in its store of ClientApp tasks, whose processes keep Flower's 30 s.

    python experiments/federated_flower_deploy.py                 # all three scenarios
    python experiments/federated_flower_deploy.py --only clean --client-app cold
    python experiments/federated_flower_deploy.py --only dropout --rounds 3

Writes results/federated_flower_deploy.json (per scenario: status, rounds,
epsilon, seconds per round, missing clients per round).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from _common import RESULTS, ROOT, command_line, commit_of

from dpfl_tf._runs import die_with_parent, running


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _toml(value) -> str:
    return (
        json.dumps(value)
        if isinstance(value, str)
        else repr(value).lower()
        if isinstance(value, bool)
        else repr(value)
    )


class Deployment:
    """A SuperLink and K SuperNodes on 127.0.0.1 (``flower-superlink`` /
    ``flower-supernode``, insecure, no runtime dependency installation), the app
    directory and the ``flwr`` connection for them.  Use as a context manager:
    every process it started is stopped on exit."""

    def __init__(
        self,
        directory: str,
        run_config: dict,
        clients: int,
        client_app: str,
        heartbeat_interval: float | None = None,
    ):
        self.dir, self.k = directory, clients
        self.heartbeat_interval = heartbeat_interval
        self.port = _free_port()
        self.env = {
            **os.environ,
            "FLWR_HOME": os.path.join(directory, "flwr-home"),
            "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
            "FLWR_TELEMETRY_ENABLED": "0",
            "TF_CPP_MIN_LOG_LEVEL": "3",
        }
        os.makedirs(self.env["FLWR_HOME"], exist_ok=True)
        with open(os.path.join(self.env["FLWR_HOME"], "config.toml"), "w") as f:
            f.write(
                f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\n'
                f'address = "127.0.0.1:{self.port}"\ninsecure = true\n'
            )
        self.app = os.path.join(directory, "app")
        os.makedirs(self.app, exist_ok=True)
        config = "\n".join(f"{k} = {_toml(v)}" for k, v in run_config.items())
        with open(os.path.join(self.app, "pyproject.toml"), "w") as f:
            f.write(APP_PYPROJECT.format(clientapp=CLIENT_APPS[client_app]) + config + "\n")
        self.procs: dict[str, subprocess.Popen] = {}
        #: process groups started (one per SuperLink / SuperNode, with their children)
        self.groups: list[int] = []

    def _start(self, name: str, argv: list[str]) -> None:
        log = open(os.path.join(self.dir, f"{name}.log"), "a")
        self.procs[name] = subprocess.Popen(
            argv,
            env=self.env,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,  # this process killed outright: it goes too
        )
        self.groups.append(self.procs[name].pid)

    def left_running(self) -> list[int]:
        """Processes of the groups started here that are still alive (zombies aside)."""
        alive = []
        for group in self.groups:
            out = subprocess.run(["pgrep", "-g", str(group)], capture_output=True, text=True)
            alive += [int(pid) for pid in out.stdout.split() if running(int(pid))]
        return alive

    def start_node(self, k: int) -> None:
        command = (
            ["flower-supernode"]
            if self.heartbeat_interval is None
            else [
                sys.executable,
                "-c",
                SUPERNODE_WITH_INTERVAL.format(interval=float(self.heartbeat_interval)),
            ]
        )
        self._start(
            f"node{k}",
            [
                *command,
                "--insecure",
                "--superlink",
                f"127.0.0.1:{self.port}",
                "--port",
                str(_free_port()),
                "--node-config",
                f"partition-id={k} num-partitions={self.k}",
            ],
        )

    def kill_node(self, k: int) -> None:
        """SIGKILL to the SuperNode's process group (its ClientApp processes too)."""
        proc = self.procs.pop(f"node{k}")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def __enter__(self) -> "Deployment":
        self._start(
            "superlink",
            [
                "flower-superlink",
                "--insecure",
                "--port",
                str(self.port),
                "--disable-runtime-dependency-installation",
            ],
        )
        time.sleep(3)
        for k in range(self.k):
            self.start_node(k)
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        time.sleep(2)
        #: what outlived SIGTERM to its SuperNode's group (recorded, then killed)
        self.survivors = self.left_running()
        for pid in self.survivors:
            os.kill(pid, signal.SIGKILL)

    def flwr_run(self, **overrides) -> None:
        """``flwr run app deploy --run-config ...`` (returns once the run is submitted)."""
        pairs = " ".join(f"{k}={_toml(v)}" for k, v in overrides.items())
        out = subprocess.run(
            ["flwr", "run", self.app, "deploy", "--run-config", pairs],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if "Successfully started run" not in out.stdout:
            raise RuntimeError(f"flwr run failed: {out.stdout[-2000:]} {out.stderr[-2000:]}")


#: ``flower-supernode`` with another node heartbeat interval: the two modules that
#: declare and pace the node's heartbeats (flwr 1.42) read their own binding of Flower's
#: constant when called, so it is replaced there, after import; the task store keeps 30 s
SUPERNODE_WITH_INTERVAL = (
    "import sys; from flwr.supernode.cli import flower_supernode; "
    "import flwr.supernode.fleet_http_connection as f, flwr.supercore.heartbeat as h; "
    "assert f.HEARTBEAT_DEFAULT_INTERVAL == h.HEARTBEAT_DEFAULT_INTERVAL == 30, "
    "'this flwr paces its heartbeats otherwise'; "
    "f.HEARTBEAT_DEFAULT_INTERVAL = h.HEARTBEAT_DEFAULT_INTERVAL = {interval}; "
    "sys.argv[0] = 'flower-supernode'; sys.exit(flower_supernode())"
)

APP_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "dpfl-federated-app"
version = "1.0.0"
description = "dpfl_tf's federated wrapper as a Flower app"
license = "Apache-2.0"
dependencies = []

[tool.flwr.app]
publisher = "dpfl"

[tool.flwr.app.components]
serverapp = "dpfl_tf.federated.flower:server_app"
clientapp = "{clientapp}"

[tool.flwr.app.config]
"""
#: the ClientApp: warm keeps a worker per node across rounds, cold starts afresh
CLIENT_APPS = {
    "warm": "dpfl_tf.federated.flower_warm:client_app",
    "cold": "dpfl_tf.federated.flower:client_app",
}


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _wait(path: str, done, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = _read(path)
        if data is not None and done(data):
            return data
        time.sleep(2)
    raise TimeoutError(f"{path}: no result in {timeout:g} s (last: {_read(path)})")


def _summary(data: dict) -> dict:
    return {
        "status": data["status"],
        "rounds": data["rounds"],
        "epsilon": data["epsilon"],
        "error": data.get("error"),
        "test_accuracy": data["test_accuracy"],
        "round_seconds": [h["seconds"] for h in data["history"]],
        "missing_clients": [h["info"].get("missing_clients", 0) for h in data["history"]],
    }


def scenario(name: str, dep: Deployment, rounds: int, timeout: float) -> dict:
    out, ckpt = (os.path.join(dep.dir, f"{name}.json"), os.path.join(dep.dir, f"{name}.ckpt"))
    keys = {
        "results-path": out,
        "checkpoint-dir": ckpt,
        "min-nodes": dep.k if name == "kill" else 1,
    }
    start = time.perf_counter()
    dep.flwr_run(**keys)
    if name == "clean":  # no node lost: the in-process run, on Flower
        row = {"scenario": name, "min_nodes": keys["min-nodes"], "killed_node": None}
        row["final"] = _summary(_wait(out, lambda d: d["status"] != "running", timeout))
        row["minutes"] = (time.perf_counter() - start) / 60
        print(f"{name}: {json.dumps(row)}", flush=True)
        return row
    _wait(out, lambda d: d["rounds"] >= 1 or d["status"] != "running", timeout)
    dep.kill_node(dep.k - 1)
    row = {"scenario": name, "min_nodes": keys["min-nodes"], "killed_node": dep.k - 1}
    if name == "kill":
        failed = _wait(out, lambda d: d["status"] != "running", timeout)
        row["first_run"] = _summary(failed)
        dep.start_node(dep.k - 1)
        time.sleep(5)
        dep.flwr_run(**keys)
        final = _wait(
            out,
            lambda d: (
                d["status"] != "running"
                and d["rounds"] > failed["rounds"]
                or d["status"] == "failed"
                and d.get("error") != failed.get("error")
            ),
            timeout,
        )
    else:
        final = _wait(out, lambda d: d["status"] != "running", timeout)
        dep.start_node(dep.k - 1)
    row["final"] = _summary(final)
    row["minutes"] = (time.perf_counter() - start) / 60
    print(f"{name}: {json.dumps(row)}", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=["clean", "kill", "dropout"])
    p.add_argument(
        "--client-app",
        choices=sorted(CLIENT_APPS),
        default="warm",
        help="warm: one worker per node keeps TensorFlow and the model across rounds "
        "(dpfl_tf.federated.flower_warm); cold: a new ClientApp process per message",
    )
    p.add_argument("--clients", type=int, default=2, help="K SuperNodes")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per wait")
    p.add_argument(
        "--heartbeat-interval",
        type=float,
        default=None,
        help="the SuperNodes' heartbeat interval in seconds (Flower's 30; it accepts 10 to "
        "1800): a killed node is declared lost after twice the interval without one",
    )
    p.add_argument("--output", default=os.path.join(RESULTS, "federated_flower_deploy.json"))
    args = p.parse_args(argv)
    if args.heartbeat_interval is not None and not 10 <= args.heartbeat_interval <= 1800:
        p.error(f"--heartbeat-interval must be in [10, 1800], got {args.heartbeat_interval:g}")
    from dpfl_tf._io import atomic_write_json
    from dpfl_tf.federated.flower import config_from_run_config

    def stop(signum, frame):  # SIGTERM / SIGHUP: leave through Deployment.__exit__,
        for sig in handled:  # which a second signal must not cut short
            signal.signal(sig, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    handled = [signal.SIGTERM]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # not under nohup
        handled.append(signal.SIGHUP)
    for sig in handled:
        signal.signal(sig, stop)
    from dpfl_tf.federated.runner import run_federated

    run_config = {
        "clients": args.clients,
        "clients-per-round": args.clients,
        "sampling": "fixed_size",
        "rounds": args.rounds,
        "dp": "global",
        "partition": "iid",
        "train-subset": 600,
        "noise-seed": 0,  # seeded: the clean run must end with the in-process model
        "results-path": "",
        "checkpoint-dir": "",
        "min-nodes": args.clients,
        "node-timeout": 120.0,
    }
    config = config_from_run_config(run_config)
    inproc = run_federated(config, progress=False)
    out = {
        "command": command_line(),
        "commit": commit_of(),
        "run_config": run_config,
        "client_app": CLIENT_APPS[args.client_app],
        "heartbeat_interval": 30.0 if args.heartbeat_interval is None else args.heartbeat_interval,
        "in_process_epsilon": inproc["epsilon"],
        "in_process_test_accuracy": inproc["test_accuracy"],
        "scenarios": [],
    }
    with tempfile.TemporaryDirectory(prefix="dpfl-flower-") as tmp:
        with Deployment(
            tmp, run_config, args.clients, args.client_app, args.heartbeat_interval
        ) as dep:
            for name in args.only or ["clean", "kill", "dropout"]:
                row = scenario(name, dep, args.rounds, args.timeout)
                row["epsilon_equals_in_process"] = row["final"]["epsilon"] == inproc["epsilon"]
                if name == "clean":  # the same rounds, so the same model
                    row["test_accuracy_equals_in_process"] = (
                        row["final"]["test_accuracy"] == inproc["test_accuracy"]
                    )
                out["scenarios"].append(row)
                atomic_write_json(args.output, out)
        out["processes_left_running"] = dep.survivors
        atomic_write_json(args.output, out)
    print(f"wrote {args.output}")
    return (
        0
        if all(
            r["final"]["status"] == "completed"
            and r["epsilon_equals_in_process"]
            and r.get("test_accuracy_equals_in_process", True)
            for r in out["scenarios"]
        )
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())

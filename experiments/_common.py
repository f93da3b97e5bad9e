"""What the experiment scripts share: the checkout on the import path, where
results and data are, the commit a result was measured at, this process's
peak memory, and the two ways of running a child process (one measured from
outside, one that returns the JSON object it writes).

    from _common import ROOT, RESULTS, commit_of, run_measured   # in experiments/*.py

Importing this module puts the checkout first on ``sys.path`` (the package of
this checkout, installed or not) and ``experiments/`` after it.  It imports
neither TensorFlow nor the package.  The peer scripts in ``experiments/peers/``
run in other environments and share ``peers/_peer_common.py`` instead.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

__all__ = [
    "DATA_DIR",
    "ROOT",
    "RESULTS",
    "add_federated_tuning_arguments",
    "command_line",
    "commit_of",
    "evaluated_on",
    "load_runs",
    "paired_row",
    "write_result",
    "runs_to_append",
    "peak_rss_mb",
    "run_child",
    "run_writer",
    "run_measured",
    "shown",
]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "results")
# the offline data: $DPFL_DATA_DIR, else shared/data beside the checkout
DATA_DIR = os.environ.get("DPFL_DATA_DIR", os.path.join(os.path.dirname(ROOT), "shared", "data"))
for _path in (os.path.join(ROOT, "experiments"), ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from dpfl_tf._runs import peak_rss_mb  # noqa: E402 -- importable once ROOT is on the path


def add_federated_tuning_arguments(parser, tuning_file: str, *, validation_note: str = "") -> None:
    """--model-average BETA and --validation N, as the federated experiments share them:
    release the average of the global models (post-processing), and tuning trials on N
    held-out training examples, written to `tuning_file` (never beside test results)."""
    parser.add_argument(
        "--model-average",
        type=float,
        metavar="BETA",
        help="release the exponential moving average (decay BETA) of the rounds' global models "
        "(FederatedConfig.model_average; post-processing); the results also give the last "
        "global model's accuracy",
    )
    parser.add_argument(
        "--validation",
        type=int,
        default=0,
        help="hold out this many training examples (a seeded draw) and evaluate on them instead "
        f"of the test set: tuning trials (results/{tuning_file}{validation_note})",
    )


def evaluated_on(validation: int) -> str:
    """What a run's accuracy was measured on (the results' "evaluated_on")."""
    return f"validation ({validation} held-out training examples)" if validation else "test"


def commit_of(tree: str = ROOT, *, untracked: bool = False) -> str:
    """The short commit of a checkout, "(with uncommitted changes)" when a
    tracked file is changed (or, with `untracked`, when any file git does not
    ignore is new); "unknown" when git cannot tell."""
    try:
        head = subprocess.run(
            ["git", "-C", tree, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "-C",
                tree,
                "status",
                "--porcelain",
                "--untracked-files=" + ("normal" if untracked else "no"),
            ],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" (with uncommitted changes)" if dirty else "")


def shown(path: str) -> str:
    """A path as a result file records it: inside the checkout relative to
    it, elsewhere absolute."""
    path = os.path.abspath(path)
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path


def command_line() -> str:
    """This script's command line as a result file records it: the script
    relative to the checkout, then its arguments."""
    return " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])


def load_runs(path: str) -> list:
    """The runs a results file holds (a JSON list), [] when there is no file yet."""
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return []


def runs_to_append(path: str, planned: set, key, command: str, commit: str) -> tuple:
    """(earlier runs, command, commit) of a results file (a JSON object with
    "runs", "command", "commit") that new runs are appended to: its runs, and its
    command and commit joined with this one's ("; ").  `key(run)` names a run;
    a planned key the file already holds is refused before anything runs (a
    second run of it would count as another seed).  No file: ([], command, commit)."""
    if not os.path.exists(path):
        return [], command, commit
    with open(path) as f:
        previous = json.load(f)
    clash = sorted(planned & {key(r) for r in previous["runs"]}, key=str)
    if clash:
        raise SystemExit(f"{path} already holds {clash}: choose other seeds or runs")
    if previous["commit"] != commit:
        commit = f"{previous['commit']}; {commit}"
    return previous["runs"], f"{previous['command']}; {command}", commit


def run_measured(
    command: list,
    *,
    cwd: str = ROOT,
    env: dict | None = None,
    log: str | None = None,
    timeout: float | None = None,
) -> dict:
    """Runs `command` as a child process; returns its exit code, wall seconds
    and peak RSS (the child's ``ru_maxrss`` from ``wait4``: resident memory,
    mapped file pages included, as ``/usr/bin/time -v`` reports it), with the
    command line and the load average before it started."""
    load = os.getloadavg()
    start = time.perf_counter()
    out = open(log, "w") if log else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if deadline is not None and time.monotonic() > deadline:
                proc.kill()
            time.sleep(0.2)
    finally:
        if log:
            out.close()
    return {
        "command": shlex.join(command),
        "exit_code": os.waitstatus_to_exitcode(status),
        "wall_seconds": round(time.perf_counter() - start, 1),
        "peak_rss_mb": round(peak_rss_mb(usage), 1),
        "load_average_before": [round(v, 2) for v in load],
    }


def run_writer(cmd: list, timeout: float) -> tuple:
    """Runs a worker that writes JSON to the path given after ``--output``
    (appended to `cmd` here): (what it wrote, or None, and why it failed: "" on
    exit 0, else the last 2,000 characters of its stderr, else of its stdout,
    else "exit N", or "timed out after N s").  What a worker wrote before it
    died or was killed is kept.

    The child runs in the checkout with it as ``PYTHONPATH`` and TensorFlow's
    C++ logging at warnings."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = f.name
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    try:
        try:
            proc = subprocess.run(
                cmd + ["--output", out_path],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
                cwd=ROOT,
            )
            why = (
                ((proc.stderr or proc.stdout)[-2000:] or f"exit {proc.returncode}")
                if proc.returncode
                else ""
            )
        except subprocess.TimeoutExpired:
            why = f"timed out after {timeout:.0f} s"
        written = None
        if os.path.getsize(out_path) > 0:
            with open(out_path) as f:
                written = json.load(f)
        return written, why
    finally:
        os.unlink(out_path)


def run_child(cmd: list, timeout: float, *, key: str = "seconds_per_epoch") -> dict:
    """Runs a worker (`run_writer`) that writes one JSON object and returns that
    object.  One that wrote nothing, or an object with no value for `key` and
    no "error", gets `key` None and as "error" why it failed."""
    result, why = run_writer(cmd, timeout)
    result = result or {}
    if result.get(key) is None and not result.get("error"):
        result[key] = None
        result["error"] = why or "wrote no result"
    return result


def paired_row(seconds: list, baseline_seconds: list) -> dict:
    """Runs of a checkout and of a baseline taken in turn (A B A B): each run's
    seconds, the medians and the median of the paired ratios (checkout / baseline)."""
    import statistics

    return {
        "seconds": [round(s, 3) for s in seconds],
        "baseline_seconds": [round(s, 3) for s in baseline_seconds],
        "median": round(statistics.median(seconds), 3),
        "baseline_median": round(statistics.median(baseline_seconds), 3),
        "median_paired_ratio": round(
            statistics.median(a / b for a, b in zip(seconds, baseline_seconds)), 3
        ),
    }


def write_result(name: str, rows: dict, **fields) -> str:
    """results/<name>: the command, the commit, `fields`, the time and `rows`, as
    indented JSON; returns the path."""
    out = {"command": command_line(), "commit": commit_of(), **fields}
    out["when"] = time.strftime("%Y-%m-%d %H:%M")
    out["rows"] = rows
    path = os.path.join(RESULTS, name)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")
    return path

"""What the experiment scripts share: the checkout on the import path, where
results go, the commit a result was measured at, and one child process run
with its wall time and peak memory.

    from _common import ROOT, RESULTS, commit_of, run_measured   # in experiments/*.py

Importing this module puts the checkout first on ``sys.path`` (the package of
this checkout, installed or not) and ``experiments/`` after it.  It imports
neither TensorFlow nor the package.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

__all__ = ["ROOT", "RESULTS", "commit_of", "peak_rss_mb", "run_measured"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "results")
for _path in (os.path.join(ROOT, "experiments"), ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def commit_of(tree: str = ROOT) -> str:
    """The short commit of a checkout, "(with uncommitted changes)" when dirty."""
    try:
        head = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True
                               ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" (with uncommitted changes)" if dirty else "")


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (``ru_maxrss``)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_measured(command: list, *, cwd: str = ROOT, env: dict | None = None,
                 log: str | None = None, timeout: float | None = None) -> dict:
    """Runs `command` as a child process; returns its exit code, wall seconds
    and peak RSS (the child's ``ru_maxrss`` from ``wait4``: resident memory,
    mapped file pages included, as ``/usr/bin/time -v`` reports it), with the
    command line and the load average before it started."""
    load = os.getloadavg()
    start = time.perf_counter()
    out = open(log, "w") if log else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
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
    return {"command": shlex.join(command), "exit_code": os.waitstatus_to_exitcode(status),
            "wall_seconds": round(time.perf_counter() - start, 1),
            "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
            "load_average_before": [round(v, 2) for v in load]}

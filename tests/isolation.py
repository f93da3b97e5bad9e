"""Runs the test files marked ``isolated`` each in a child pytest process.

Why: what TensorFlow compiles (XLA executables, traced graphs, kernels) stays in
the process until it ends; ``keras.backend.clear_session`` releases the Python
objects but not those caches.  A worker that ran ``tests/keras/test_model.py``
holds 2.6 GB more until the suite ends, and in one worker the files add up to
8-9 GB.  A file marked ``pytestmark = pytest.mark.isolated`` instead runs in a
child ``python -m pytest <its selected tests>`` started when its first test is
due; the child's memory is returned when the file is done.

The child's reports (outcome, duration, captured output, traceback) come back as
the JSON that pytest-xdist also uses (``pytest_report_to_serializable``), and the
parent passes them on as its own: the terminal, ``--junitxml``, ``-x`` and the
exit status see them as if the tests had run in the parent.  A test the child
never reported (the child crashed, was killed, failed to collect) fails with the
end of the child's output.  The child costs a Python start-up and a TensorFlow
import (5-7 s), so only files whose memory growth is worth it are marked.

Files are the unit: run with ``--dist loadfile`` (or without xdist) so that one
process runs all of a file's tests; with ``--dist load`` each worker would start
a child for the whole file.  ``DPFL_TEST_NO_ISOLATION=1`` runs everything in the
calling process (e.g. to step through a test in a debugger).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

MARK = "isolated"
REPORTS_ENV = "DPFL_TEST_CHILD_REPORTS"  # set in the child: where it writes its reports
_RESULTS = pytest.StashKey[dict]()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{MARK}: the file's tests run in a child pytest process, one per file "
        "(tests/isolation.py)",
    )
    path = os.environ.get(REPORTS_ENV)
    if path and not config.pluginmanager.has_plugin("dpfl-child-reports"):
        config.pluginmanager.register(_ChildReports(config, path), "dpfl-child-reports")


class _ChildReports:
    """In the child: appends each test and collection report, serialised, to a file."""

    def __init__(self, config, path):
        self.config, self.path = config, path

    def _write(self, report):
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        with open(self.path, "a") as f:
            f.write(json.dumps(data) + "\n")

    def pytest_runtest_logreport(self, report):
        self._write(report)

    def pytest_collectreport(self, report):
        if report.failed:
            self._write(report)


def _isolated(item) -> bool:
    return (
        item.get_closest_marker(MARK) is not None
        and not os.environ.get(REPORTS_ENV)
        and not os.environ.get("DPFL_TEST_NO_ISOLATION")
    )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if not _isolated(item):
        return None
    results = item.session.stash.setdefault(_RESULTS, {})
    if item.path not in results:
        results[item.path] = _run_file_in_child(item)
    reports, output = results[item.path]
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    got = reports.pop(item.nodeid, [])
    if not any(report.when == "teardown" for report in got):  # the child died in the test
        got.append(_unreported(item, output))
    for report in got:
        item.ihook.pytest_runtest_logreport(report=report)
    # what the test before set up for the directories it shares with this one is ours
    # to tear down now, as the runner would have: up to what the next test needs
    item.session._setupstate.teardown_exact(nextitem)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _run_file_in_child(item):
    """Runs this process's selected tests of `item`'s file in one child pytest;
    returns ({nodeid: [its setup/call/teardown reports]}, the child's output)."""
    config = item.config
    nodeids = [other.nodeid for other in item.session.items if other.path == item.path]
    fd, path = tempfile.mkstemp(prefix="dpfl_test_child_", suffix=".jsonl")
    os.close(fd)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--tb={config.option.tbstyle}",
        "--rootdir",
        str(config.rootpath),
        *nodeids,
    ]
    if config.inipath is not None:
        command[4:4] = ["-c", str(config.inipath)]
    env = dict(os.environ, **{REPORTS_ENV: path})
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    try:
        done = subprocess.run(command, cwd=config.rootpath, env=env, capture_output=True, text=True)
        output = f"child exit status {done.returncode}\n{done.stdout[-4000:]}{done.stderr[-4000:]}"
        reports: dict[str, list] = {}
        with open(path) as f:
            for line in f:
                report = config.hook.pytest_report_from_serializable(
                    config=config, data=json.loads(line)
                )
                # JSON made the tuples (a skip's (path, line, reason), the location) lists
                if isinstance(report.longrepr, list):
                    report.longrepr = tuple(report.longrepr)
                if isinstance(getattr(report, "location", None), list):
                    report.location = tuple(report.location)
                if isinstance(report, pytest.CollectReport):
                    output = f"collecting {report.nodeid} failed:\n{report.longreprtext}\n{output}"
                    continue
                reports.setdefault(report.nodeid, []).append(report)
    finally:
        os.unlink(path)
    return reports, output


def _unreported(item, output) -> pytest.TestReport:
    """A failed report for a test the child did not report to its end."""
    return pytest.TestReport(
        nodeid=item.nodeid,
        location=item.location,
        keywords={name: 1 for name in item.keywords},
        outcome="failed",
        longrepr=f"the child process running {item.path.name} did not report this test\n" + output,
        when="call",
        sections=[],
        duration=0.0,
        start=0.0,
        stop=0.0,
    )

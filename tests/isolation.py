"""Runs the tests marked ``isolated`` in a child pytest process, one per file.

Why: what TensorFlow compiles (XLA executables, traced graphs, kernels) stays in
the process until it ends; ``keras.backend.clear_session`` releases the Python
objects but not those caches.  A worker that ran ``tests/keras/test_model.py``
holds 2.6 GB more until the suite ends, and in one worker the files add up to
8-9 GB.  A file marked ``pytestmark = pytest.mark.isolated`` instead runs in a
child ``python -m pytest <its selected tests>`` started when its first test is
due; the child's memory is returned when the file is done.

The child gets the calling pytest's options (from the command line and
``PYTEST_ADDOPTS``: ``-W``, ``-o``, ``--runxfail``, ``--timeout``, ``-s``, ``-v``,
conftest options, ...) except those that select, schedule or write files (the
positional paths, xdist's, ``--junitxml``, ``--basetemp``, the cache's ``--lf``
and ``--sw``, ``-x``; a third-party plugin's option that writes a report file would
be forwarded too, and the child would write it first); ``--pdb``, ``--trace``, ``--setup-only`` and
``--setup-plan`` run everything in the calling process instead.  Its reports
(outcome, duration, captured output, traceback) come back as the JSON that
pytest-xdist also uses (``pytest_report_to_serializable``), and the parent
passes them on as its own: the terminal, ``--junitxml``, ``-x`` and the exit
status see them as if the tests had run in the parent.  A test the child did
not report to its end (the child crashed, was killed, failed to collect) fails
with the end of the child's output.  pytest-timeout's limit applies to each test
in the child, not to the file.  The child is forked from a warm Python
(tests/warm_python.py: TensorFlow already imported); the first isolated file
of a worker costs a Python start-up and a TensorFlow import (5-7 s), and the
second waits for the warm Python's.
Only files whose memory growth is worth a process are marked.

``pytest.mark.isolated(env={"NAME": "value"})`` also adds environment variables
to the child: settings TensorFlow reads once, when it starts, which the calling
process can no longer change (``TF_ENABLE_ONEDNN_OPTS=0`` for runs that must
repeat bit for bit).  Where a file runs in the calling process (below) they are
not set.

Files are the unit: isolation is on without xdist and with ``--dist loadfile``,
where one process runs all of a file's tests; with another ``--dist`` the tests
run in the worker as usual.  ``DPFL_TEST_NO_ISOLATION=1`` runs everything in the
calling process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import pytest

from tests import warm_python

MARK = "isolated"
REPORTS_ENV = "DPFL_TEST_CHILD_REPORTS"  # set in the child: where it writes its reports
PARENT_ENV = "DPFL_TEST_CHILD_PARENT"  # set in the child: the pid of the process that started it
_RESULTS = pytest.StashKey[dict]()
_DIST_KEY = "dpfl_isolation_dist"

# options (argparse dests) the child must not get: selection and scheduling (the
# parent did both), files written (the parent writes them), stopping early (a test
# the child skips for that would fail as unreported)
_NOT_FORWARDED = {
    "file_or_dir",
    "numprocesses",
    "maxprocesses",
    "dist",
    "tx",
    "rsyncdir",
    "rsyncignore",
    "maxworkerrestart",
    "looponfail",
    "xmlpath",
    "junitprefix",
    "basetemp",
    "lf",
    "failedfirst",
    "newfirst",
    "last_failed_no_failures",
    "stepwise",
    "stepwise_skip",
    "stepwise_reset",
    "cacheclear",
    "cacheshow",
    "distload",
    "maxfail",
    "durations",
    "durations_min",
    "inifilename",
    "rootdir",
    "tbstyle",
    "debug",
    "pastebin",
    "version",
    "help",
    "collectonly",
}
# options that need the tests in this process
_IN_PROCESS = ("usepdb", "trace", "setuponly", "setupplan")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{MARK}(env={{...}}): the file's marked tests run in a child pytest process, one "
        "per file, with these environment variables added (tests/isolation.py)",
    )
    path = os.environ.get(REPORTS_ENV)
    if path and not config.pluginmanager.has_plugin("dpfl-child-reports"):
        config.pluginmanager.register(_ChildReports(config, path), "dpfl-child-reports")
    if config.pluginmanager.has_plugin("xdist") and not hasattr(config, "workerinput"):
        if not config.pluginmanager.has_plugin("dpfl-xdist-dist"):
            config.pluginmanager.register(_TellWorkersTheDist(), "dpfl-xdist-dist")


class _TellWorkersTheDist:
    """In the xdist controller: a worker's config says dist = "no"; tell it the
    mode the tests are handed out in."""

    def pytest_configure_node(self, node):
        node.workerinput[_DIST_KEY] = node.config.option.dist


class _ChildReports:
    """In the child: appends each test report, and each failed or skipped
    collection report, serialised, to a file."""

    def __init__(self, config, path):
        self.config, self.path = config, path
        from dpfl_tf._runs import die_with_parent

        # a killed or timed-out parent leaves no child running (Linux; elsewhere nothing)
        die_with_parent(parent=int(os.environ.get(PARENT_ENV, os.getppid())))

    def _write(self, report):
        data = self.config.hook.pytest_report_to_serializable(config=self.config, report=report)
        with open(self.path, "a") as f:
            f.write(json.dumps(data) + "\n")

    def pytest_runtest_logreport(self, report):
        self._write(report)

    def pytest_collectreport(self, report):
        if not report.passed:
            self._write(report)


def _isolation_on(config) -> bool:
    if os.environ.get(REPORTS_ENV) or os.environ.get("DPFL_TEST_NO_ISOLATION"):
        return False
    if any(getattr(config.option, name, False) for name in _IN_PROCESS):
        return False
    if not hasattr(config, "workerinput"):
        return True
    return config.workerinput.get(_DIST_KEY) == "loadfile"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if item.get_closest_marker(MARK) is None or not _isolation_on(item.config):
        return None
    cancel_timeout = getattr(item, "cancel_timeout", None)
    if cancel_timeout is not None:  # pytest-timeout's timer would time the whole file
        cancel_timeout()
    results = item.session.stash.setdefault(_RESULTS, {})
    if item.path not in results:
        results[item.path] = _run_file_in_child(item)
    reports, skipped_modules, output = results[item.path]
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    got = reports.pop(item.nodeid, [])
    skip = next((r for r in skipped_modules if item.nodeid.startswith(r.nodeid + "::")), None)
    if not got and skip is not None:  # skipped at collection, in the child only
        got = [_report(item, "skipped", skip.longrepr, "setup")]
    elif not any(report.when == "teardown" for report in got):  # the child died in it
        message = f"the child process running {item.path.name} did not report this test\n"
        when = "teardown" if any(r.when == "call" for r in got) else "call"
        got.append(_report(item, "failed", message + output, when))
    for report in got:
        item.ihook.pytest_runtest_logreport(report=report)
    # what the test before set up for the directories it shares with this one is ours
    # to tear down now, as the runner would have: up to what the next test needs
    call = pytest.CallInfo.from_call(
        lambda: item.session._setupstate.teardown_exact(nextitem), "teardown"
    )
    if call.excinfo is not None:
        item.ihook.pytest_runtest_logreport(report=pytest.TestReport.from_item_and_call(item, call))
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _forwarded_args(config) -> list[str]:
    """The options this pytest was given (command line, PYTEST_ADDOPTS, ini
    addopts; in an xdist worker, the controller's), rebuilt from the parsed values
    that differ from their defaults, minus those of _NOT_FORWARDED."""
    parser = getattr(getattr(config, "_parser", None), "optparser", None)
    if parser is None:  # another pytest: forward nothing rather than guess
        return []
    by_dest: dict[str, list] = {}
    for action in parser._actions:
        if action.option_strings:
            by_dest.setdefault(action.dest, []).append(action)
    args: list[str] = []
    for dest, actions in by_dest.items():
        if dest in _NOT_FORWARDED or not hasattr(config.option, dest):
            continue
        value = getattr(config.option, dest)
        if value is None or value == parser.get_default(dest):
            continue
        if dest == "verbose":  # -v and -q count up and down
            args.append("-" + ("v" * value if value > 0 else "q" * -value))
            continue
        consts = [a for a in actions if a.nargs == 0 and getattr(a, "const", None) == value]
        flag = consts[0] if consts else None
        if flag is not None:  # store_true, store_false, store_const (-s, -x)
            args.append(max(flag.option_strings, key=len))
            continue
        valued = next((a for a in actions if a.nargs != 0), None)
        if valued is None:
            continue
        name = max(valued.option_strings, key=len)
        for element in value if isinstance(value, list) else [value]:  # -W, -o, -p: each
            args += [name, str(element)]
    return args


def _marked_env(item) -> dict[str, str]:
    """The environment variables the file's mark adds to its child
    (``pytest.mark.isolated(env={...})``): settings read when TensorFlow starts,
    which the calling process, TensorFlow started, can no longer change."""
    env = {}
    for mark in item.iter_markers(MARK):
        for key, value in mark.kwargs.get("env", {}).items():
            env.setdefault(key, str(value))  # the closest mark wins
    return env


def _run_file_in_child(item):
    """Runs this process's selected isolated tests of `item`'s file in one child
    pytest; returns ({nodeid: [its reports]}, [skipped collection reports], the
    end of the child's output)."""
    config = item.config
    nodeids = [
        other.nodeid
        for other in item.session.items
        if other.path == item.path and other.get_closest_marker(MARK) is not None
    ]
    fd, reports_path = tempfile.mkstemp(prefix="dpfl_test_child_", suffix=".jsonl")
    os.close(fd)
    fd, args_path = tempfile.mkstemp(prefix="dpfl_test_child_", suffix=".args")
    with os.fdopen(fd, "w") as f:  # an @file (pytest >= 8.2): no limit on the number of tests
        f.write("\n".join(nodeids) + "\n")
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    command += _forwarded_args(config)
    command += [f"--tb={config.option.tbstyle}", "--rootdir", str(config.rootpath)]
    if config.inipath is not None:
        command += ["-c", str(config.inipath)]
    command.append(f"@{args_path}")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT")
    }
    env.update(_marked_env(item))
    env[REPORTS_ENV] = reports_path
    env[PARENT_ENV] = str(os.getpid())
    try:
        try:
            done = warm_python.run(
                command,
                cwd=config.rootpath,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
            )
        except KeyboardInterrupt:  # the tests the child finished are reported, not lost
            _log_finished(item.session, _read_reports(config, reports_path)[0])
            raise
        output = f"child exit status {done.returncode}\n{done.stdout[-8000:]}{done.stderr[-20000:]}"
        reports, skipped, failed = _read_reports(config, reports_path)
        output = failed + output
    finally:
        os.unlink(reports_path)
        os.unlink(args_path)
    return reports, skipped, output


def _read_reports(config, path) -> tuple[dict[str, list], list, str]:
    """The child's reports file: ({nodeid: [its test reports]}, [skipped collection
    reports], what failed to collect, as text)."""
    reports: dict[str, list] = {}
    skipped: list = []
    failed = ""
    with open(path, errors="replace") as f:
        for line in f:
            try:
                data = json.loads(line)
            except ValueError:  # a line cut short by the child's death
                continue
            report = config.hook.pytest_report_from_serializable(config=config, data=data)
            # JSON made the tuples (a skip's (path, line, reason), the location) lists
            if isinstance(report.longrepr, list):
                report.longrepr = tuple(report.longrepr)
            if isinstance(getattr(report, "location", None), list):
                report.location = tuple(report.location)
            if isinstance(report, pytest.CollectReport):
                if report.skipped:
                    skipped.append(report)
                else:
                    failed += f"collecting {report.nodeid} failed:\n{report.longreprtext}\n"
                continue
            reports.setdefault(report.nodeid, []).append(report)
    return reports, skipped, failed


def _log_finished(session, reports: dict[str, list]) -> None:
    """Logs, as the runner would have, each test the child ran to its end (before an
    interruption ends the session): the terminal, --junitxml and the exit status see
    them."""
    for item in session.items:
        got = reports.get(item.nodeid, [])
        if not any(report.when == "teardown" for report in got):
            continue
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for report in got:
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)


def _report(item, outcome, longrepr, when) -> pytest.TestReport:
    return pytest.TestReport(
        nodeid=item.nodeid,
        location=item.location,
        keywords={name: 1 for name in item.keywords},
        outcome=outcome,
        longrepr=longrepr,
        when=when,
        sections=[],
        duration=0.0,
        start=0.0,
        stop=0.0,
    )

"""tests/isolation.py: a file marked `isolated` runs in a child process, and what
its tests did (passed, failed, skipped, died) reaches the parent's report intact."""

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ISOLATED_FILE = """
import os
import time
import warnings

import pytest

pytestmark = pytest.mark.isolated(env={"DPFL_MARKED_ENV": "from the mark"})

@pytest.mark.timeout(2)  # the parent's timer must not time the whole file (> 2 s)
def test_first_with_a_short_timeout():
    pass

def test_sleeps():
    time.sleep(2.5)

@pytest.mark.xfail(reason="expected to fail")
def test_xpasses():  # -o xfail_strict=true, given to the parent: fails
    pass

def test_warns():  # -W "error:dpfl child warning", given to the parent: fails
    warnings.warn("dpfl child warning")

@pytest.fixture
def broken():
    raise RuntimeError("the fixture's error")

def test_with_a_broken_fixture(broken):
    pass

def _record(tag):
    with open(os.environ["PID_FILE"], "a") as f:
        f.write(f"{tag} {os.getpid()}\\n")

def test_passes():
    _record("isolated")

def test_has_the_marks_environment():
    assert os.environ.get("DPFL_MARKED_ENV") == "from the mark"

def test_fails():
    assert 1 == 2, "the child's assertion message"

def test_skips():
    pytest.skip("the child's skip reason")

@pytest.mark.parametrize("x", [1, 2])
def test_param(x):
    _record(f"isolated-param-{x}")

def test_prints_then_passes():
    print("captured in the child")

def test_kills_its_process():
    os._exit(3)

def test_after_the_death():
    pass
"""

PLAIN_FILE = """
import os

def test_plain():
    with open(os.environ["PID_FILE"], "a") as f:
        f.write(f"plain {os.getpid()}\\n")
"""


@pytest.mark.parametrize("xdist", [[], ["-n", "2", "--dist", "loadfile"]], ids=["one", "xdist"])
def test_an_isolated_file_runs_in_a_child_and_reports_every_outcome(tmp_path, xdist):
    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text('pytest_plugins = ["tests.isolation"]\n')
    # a plain file before the isolated one in its directory and one after it in another:
    # what the first set up is torn down although the isolated tests ran elsewhere
    (project / "a").mkdir()
    (project / "b").mkdir()
    (project / "a" / "test_1_plain.py").write_text(textwrap.dedent(PLAIN_FILE))
    (project / "a" / "test_2_isolated.py").write_text(textwrap.dedent(ISOLATED_FILE))
    (project / "b" / "test_3_plain.py").write_text(textwrap.dedent(PLAIN_FILE))
    pids, junit = tmp_path / "pids.txt", tmp_path / "junit.xml"
    env = dict(os.environ, PID_FILE=str(pids), PYTHONPATH=ROOT)
    env.pop("DPFL_TEST_CHILD_REPORTS", None)  # this test itself may run in a child
    env.pop("DPFL_TEST_NO_ISOLATION", None)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *xdist]
        + ["-o", "xfail_strict=true", "-W", "error:dpfl child warning"]
        + ["--rootdir", str(project), "-c", os.devnull, f"--junitxml={junit}", str(project)],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out  # tests failed

    outcomes, names = {}, []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name")
        names.append(name)
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            outcome = (
                {"failure": "failed"}.get(bad.tag, bad.tag),
                bad.get("message", "") + (bad.text or ""),
            )
        elif case.find("skipped") is not None:
            outcome = ("skipped", case.find("skipped").get("message", ""))
        else:
            outcome = ("passed", "")
        outcomes.setdefault(name, outcome)
        assert outcomes[name][0] == outcome[0], (name, out)  # the two test_plain agree
    assert sorted(names) == sorted(
        [
            "test_passes",
            "test_has_the_marks_environment",
            "test_fails",
            "test_skips",
            "test_param[1]",
            "test_param[2]",
            "test_prints_then_passes",
            "test_kills_its_process",
            "test_after_the_death",
            "test_plain",
            "test_plain",
            "test_first_with_a_short_timeout",
            "test_sleeps",
            "test_xpasses",
            "test_warns",
            "test_with_a_broken_fixture",
        ]
    ), out
    assert outcomes["test_passes"][0] == "passed"
    assert outcomes["test_has_the_marks_environment"][0] == "passed", out  # isolated(env=)
    assert outcomes["test_param[1]"][0] == outcomes["test_param[2]"][0] == "passed"
    assert outcomes["test_fails"][0] == "failed"
    assert "the child's assertion message" in outcomes["test_fails"][1]
    assert outcomes["test_skips"] == ("skipped", "the child's skip reason")
    assert outcomes["test_prints_then_passes"][0] == "passed"
    # the child died in one test: that test and the ones it never reached fail, saying so
    for name in ("test_kills_its_process", "test_after_the_death"):
        assert outcomes[name][0] == "failed", (name, out)
        assert "did not report this test" in outcomes[name][1]
        assert "child exit status 3" in outcomes[name][1]
    # the parent's options reached the child; pytest-timeout timed each test, not the file
    assert outcomes["test_first_with_a_short_timeout"][0] == "passed", out
    assert outcomes["test_sleeps"][0] == "passed", out
    assert outcomes["test_xpasses"][0] == "failed", out  # XPASS(strict)
    assert outcomes["test_warns"][0] == "failed" and "dpfl child warning" in out, out
    assert outcomes["test_with_a_broken_fixture"][0] == "error", out
    assert "the fixture's error" in outcomes["test_with_a_broken_fixture"][1]
    # both plain files passed: the one after the isolated file too (no setup error)
    assert outcomes["test_plain"][0] == "passed", out
    assert "captured in the child" in out  # -rA shows the child's captured output

    # the isolated tests ran in one process, which is neither pytest nor its worker
    rows = [line.split() for line in pids.read_text().splitlines()]
    isolated = {pid for tag, pid in rows if tag.startswith("isolated")}
    plain = {pid for tag, pid in rows if tag == "plain"}
    assert len(isolated) == 1 and not isolated & plain, rows


INTERRUPTED_FILE = """
import os
import time

import pytest

pytestmark = pytest.mark.isolated

def test_finishes():
    pass

def test_waits_for_ctrl_c():
    open(os.environ["MARKER"], "w").close()
    time.sleep(120)
"""


def test_ctrl_c_keeps_the_results_of_the_tests_the_child_finished(tmp_path):
    import signal
    import time

    project = tmp_path / "project"
    project.mkdir()
    (project / "conftest.py").write_text('pytest_plugins = ["tests.isolation"]\n')
    (project / "test_isolated.py").write_text(textwrap.dedent(INTERRUPTED_FILE))
    marker, junit = tmp_path / "marker", tmp_path / "junit.xml"
    env = dict(os.environ, MARKER=str(marker), PYTHONPATH=ROOT)
    env.pop("DPFL_TEST_CHILD_REPORTS", None)
    env.pop("DPFL_TEST_NO_ISOLATION", None)
    parent = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v"]
        + ["--rootdir", str(project), "-c", os.devnull, f"--junitxml={junit}", str(project)],
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        # as in a terminal: a suite started in the background (`cmd &`) ignores SIGINT, and
        # a Python started with SIGINT ignored keeps ignoring it (no KeyboardInterrupt)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():  # the child finished the first test, is in the second
            if parent.poll() is not None or time.monotonic() > deadline:
                parent.kill()  # so that reading its output cannot block
                pytest.fail(f"the child never reached the second test:\n{parent.stdout.read()}")
            time.sleep(0.1)
        parent.send_signal(signal.SIGINT)  # Ctrl-C, to the parent alone
        try:
            out, _ = parent.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # say where it hung
            parent.send_signal(signal.SIGABRT)  # pytest's faulthandler prints every thread
            try:
                out, _ = parent.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                parent.kill()
                out, _ = parent.communicate()
            pytest.fail(f"the parent did not end within 60 s of Ctrl-C; its threads:\n{out}")
    finally:
        parent.kill()
    assert "KeyboardInterrupt" in out, out
    assert parent.returncode == 2, out  # interrupted
    assert "test_finishes PASSED" in out and "1 passed" in out, out
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    assert "test_finishes" in cases and len(cases["test_finishes"]) == 0, out  # passed

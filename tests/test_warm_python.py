"""tests/warm_python.py: a warm child is what a cold ``python -m/-c`` would be
(arguments, streams, directory, environment, exit status, tracebacks, signals),
it is really forked from a server, and the server ends with its caller."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests import warm_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(
    os.environ.get(warm_python.COLD_ENV) == "1", reason="DPFL_TEST_COLD_CHILDREN=1: all cold"
)

PROBE = textwrap.dedent(
    """
    import os, sys
    print(sys.argv, os.getcwd(), sys.path[0], __name__, os.environ.get("PROBE_VAR"))
    print(sys.stdin.read().upper())
    print("to stderr", file=sys.stderr)
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.fixture(scope="module")
def warm_env():
    """An environment of this module's own, used twice before the tests: its
    server is running."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ROOT}
    for _ in range(2):
        warm_python.run([sys.executable, "-c", "pass"], env=env, timeout=300)
    return env


def _warm_output(code: str, env) -> str:
    done = warm_python.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    return done.stdout


def _forked(env) -> bool:
    """Whether a command with `env` runs in a server's child: its parent is not us."""
    return int(_warm_output("import os; print(os.getppid())", env)) != os.getpid()


def test_a_command_run_twice_is_forked_from_a_server_with_tensorflow_imported(warm_env):
    assert _forked(warm_env)
    assert _warm_output("import sys; print('tensorflow' in sys.modules)", warm_env) == "True\n"


@pytest.mark.parametrize("status", [0, 3])
def test_c_command_is_the_same_warm_and_cold(warm_env, tmp_path, status):
    cmd = [sys.executable, "-c", PROBE, str(status), "two words"]
    env = {**warm_env, "PROBE_VAR": "probe value"}
    runs = [
        runner(cmd, input="stdin text", capture_output=True, text=True, cwd=tmp_path, env=env)
        for runner in (warm_python.run, subprocess.run)
    ]
    assert _forked(env)
    warm, cold = runs
    assert warm.returncode == cold.returncode == status
    assert warm.stdout == cold.stdout and "STDIN TEXT" in warm.stdout
    assert warm.stderr == cold.stderr == "to stderr\n"


@pytest.mark.parametrize(
    "code",
    [
        "raise ValueError('boom')",
        "import sys; sys.exit('a message')",
        "raise KeyboardInterrupt",
        "import sys; sys.stdout.write('no newline'); sys.exit(None)",
    ],
)
def test_exits_and_tracebacks_are_the_same_warm_and_cold(warm_env, code):
    cmd = [sys.executable, "-c", code]
    warm, cold = (
        runner(cmd, capture_output=True, text=True, env=warm_env)
        for runner in (warm_python.run, subprocess.run)
    )
    assert (warm.returncode, warm.stdout, warm.stderr) == (
        cold.returncode,
        cold.stdout,
        cold.stderr,
    )


def test_m_command_runs_the_module_as_main(warm_env, tmp_path):
    cmd = [sys.executable, "-m", "dpfl_tf", "privacy", "-q", "0.01", "-s", "4", "-E", "1"]
    cmd += ["-d", "1e-5", "--json"]
    warm, cold = (
        runner(cmd, capture_output=True, text=True, cwd=tmp_path, env=warm_env, timeout=120)
        for runner in (warm_python.run, subprocess.run)
    )
    assert warm.returncode == cold.returncode == 0
    assert warm.stdout == cold.stdout and '"epsilon"' in warm.stdout
    missing = [sys.executable, "-m", "no_such_module_here"]
    warm, cold = (
        runner(missing, capture_output=True, text=True, env=warm_env)
        for runner in (warm_python.run, subprocess.run)
    )
    assert (warm.returncode, warm.stderr) == (cold.returncode, cold.stderr) == (1, cold.stderr)
    assert "No module named no_such_module_here" in warm.stderr


@pytest.mark.parametrize("draw", ["numpy.random.rand()", "random.random()"])
def test_children_draw_fresh_random_numbers(warm_env, draw):
    cmd = [sys.executable, "-c", f"import numpy, random; print({draw})"]
    draws = {
        warm_python.run(cmd, capture_output=True, text=True, env=warm_env).stdout for _ in range(3)
    }
    assert len(draws) == 3


MODULE_PROBE = """
import sys
print(sys.argv, sys.path[0], __name__, __spec__.name, __file__)
"""

END_PROBE = """
import atexit, ctypes, threading, time
atexit.register(print, "atexit ran")
ctypes.CDLL(None).printf(b"C stdio, buffered\\n")
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
def annotated(x: NotDefinedAnywhere): pass
"""


@pytest.mark.parametrize("form", ["-m", "-c"])
def test_module_runs_threads_atexit_c_output_and_annotations_as_cold(warm_env, tmp_path, form):
    """-m: argv, path, __spec__, __file__; -c: non-daemon threads joined, then the
    atexit functions; C's buffered stdio flushed; no `from __future__` of ours
    (the annotation's NameError, as cold)."""
    (tmp_path / "probe_module.py").write_text(MODULE_PROBE)
    cmd = [sys.executable, "-m", "probe_module", "x"] if form == "-m" else [
        sys.executable, "-c", END_PROBE]  # fmt: skip
    warm, cold = (
        runner(cmd, capture_output=True, text=True, cwd=tmp_path, env=warm_env, timeout=120)
        for runner in (warm_python.run, subprocess.run)
    )
    assert (warm.returncode, warm.stdout, warm.stderr) == (
        cold.returncode,
        cold.stdout,
        cold.stderr,
    )
    if form == "-m":
        assert "probe_module.py" in warm.stdout and "'x'" in warm.stdout
    else:
        assert "NameError" in warm.stderr and "C stdio, buffered" in warm.stdout
        assert warm.stdout.index("thread finished") < warm.stdout.index("atexit ran")


def test_commands_from_threads_and_from_a_child_share_the_server(warm_env):
    """Four commands at once from threads; a warm child's own warm command goes to
    the same server (DPFL_TEST_WARM_SOCKETS), as does the docs' shim."""
    import concurrent.futures

    def ppid_and(i):
        return _warm_output(f"import os; print(os.getppid(), {i})", warm_env).split()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ppid_and, range(4)))
    servers = {s.proc.pid for s in warm_python._servers.values()}
    assert [int(i) for _, i in got] == [0, 1, 2, 3]
    assert len({p for p, _ in got}) == 1 and int(got[0][0]) in servers
    nested = (
        "import os, sys\nfrom tests import warm_python\n"
        "inner = warm_python.run([sys.executable, '-c', 'import os; print(os.getppid())'],"
        " capture_output=True, text=True)\nprint(os.getppid(), inner.stdout.strip())"
    )
    done = warm_python.run([sys.executable, "-c", nested], capture_output=True, text=True,
                           env=warm_env, cwd=ROOT)  # fmt: skip
    outer, inner = done.stdout.split()
    assert outer == inner == got[0][0], done.stderr
    shim = [sys.executable, "-m", "tests.warm_python", "-c", "import os; print(os.getppid())"]
    done = subprocess.run(shim, capture_output=True, text=True,
                          env=warm_python.for_descendants(warm_env), cwd=ROOT)  # fmt: skip
    assert done.stdout.strip() == got[0][0], done.stderr


def test_signal_reaches_the_child_and_timeout_kills_it(warm_env, tmp_path):
    code = (
        "import time\ntry:\n    print('ready', flush=True); time.sleep(60)\n"
        "except KeyboardInterrupt:\n    print('interrupted'); raise SystemExit(5)\n"
    )
    proc = warm_python.Popen(
        [sys.executable, "-c", code], stdout=warm_python.PIPE, text=True, env=warm_env
    )
    assert isinstance(proc, warm_python.Popen)
    assert proc.stdout.readline() == "ready\n" and proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (5, "interrupted\n")
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([sys.executable, "-c", code], env=warm_env, timeout=2)
    from dpfl_tf._runs import running

    assert not running(int(pid_file.read_text()))  # killed, and reaped by its server
    # a grandchild that keeps the output pipe open does not stretch the timeout
    holder = (
        "import subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])"
    )
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run(
            [sys.executable, "-c", holder], env=warm_env, capture_output=True, timeout=3
        )
    assert time.monotonic() - started < 20


def _ppid_of(cmd_env) -> int:
    cmd = [
        sys.executable,
        "-c",
        "import os; print(os.environ.get('TF_WARM_PROBE', '-'), os.getppid())",
    ]
    done = warm_python.run(cmd, capture_output=True, text=True, env=cmd_env, timeout=300)
    probe, ppid = done.stdout.split()
    assert probe == cmd_env.get("TF_WARM_PROBE", "-")
    return int(ppid)


@pytest.fixture
def own_servers(monkeypatch):
    """Room for more servers; the ones the test starts are stopped after it."""
    monkeypatch.setattr(warm_python, "MAX_SERVERS", 100)
    before = set(warm_python._servers)
    yield
    for digest in set(warm_python._servers) - before:
        warm_python._servers.pop(digest).stop()


def test_an_environment_read_at_import_gets_its_own_server_or_runs_cold(
    warm_env, tmp_path, monkeypatch, own_servers
):
    env = {**warm_env, "TF_WARM_PROBE": str(tmp_path)}  # read at import, as far as it knows
    assert _ppid_of(env) == os.getpid()  # used once: cold
    assert _ppid_of(env) not in (os.getpid(), _ppid_of(warm_env))  # twice: a server of its own
    quiet_by_itself = {k: v for k, v in env.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    for _ in range(2):  # the CLI would set it before importing TensorFlow: always cold
        assert _ppid_of(quiet_by_itself) == os.getpid()
    monkeypatch.setenv(warm_python.COLD_ENV, "1")  # everything cold
    for e in (env, {**warm_env, "TF_WARM_PROBE": "x"}):
        assert _ppid_of(e) == os.getpid()


def test_an_idle_server_ends_and_the_next_command_starts_another(warm_env, tmp_path, own_servers):
    env = {**warm_env, "TF_WARM_PROBE": str(tmp_path), warm_python.IDLE_ENV: "1"}
    _ppid_of(env)
    first = _ppid_of(env)
    assert first != os.getpid()
    (server,) = [s for s in warm_python._servers.values() if s.proc.pid == first]
    assert server.proc.wait(timeout=60) == 0  # idle for a second: it ended by itself
    second = _ppid_of(env)
    assert second not in (first, os.getpid())  # a new server, not a cold run


@pytest.mark.parametrize("end", ["exits", "is killed"])
def test_the_server_and_its_children_end_with_their_caller(tmp_path, end):
    """A caller that exits (atexit: SIGTERM to the server) or is killed with SIGKILL
    (the server sees its parent gone): the server and the child it was running
    end within seconds."""
    pids, go = tmp_path / "pids", tmp_path / "go"
    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import os, sys, time
                sys.path.insert(0, {ROOT!r})
                from tests import warm_python
                code = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
                cmd = [sys.executable, "-c", code]
                warm_python.run([sys.executable, "-c", "pass"])
                p = warm_python.Popen(cmd, stdout=warm_python.PIPE, text=True)
                child = p.stdout.readline().strip()
                server = [s.proc.pid for s in warm_python._servers.values()][0]
                open({str(pids)!r}, "w").write(f"{{server}} {{child}}")
                while not os.path.exists({str(go)!r}):
                    time.sleep(0.05)
                sys.exit(0)  # atexit stops the server
                """
            ),
        ],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    deadline = time.monotonic() + 300
    while not pids.exists() or len(pids.read_text().split()) < 2:
        assert caller.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    server, child = (int(p) for p in pids.read_text().split())
    from dpfl_tf._runs import running

    assert running(server) and running(child) and child != caller.pid
    if end == "exits":
        go.write_text("")
        assert caller.wait(timeout=60) == 0
    else:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 20
    while (running(server) or running(child)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(server) and not running(child)

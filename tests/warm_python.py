"""Child Pythons that start with TensorFlow already imported, for the tests.

Why: the tests run the CLI, the docs' pages and the isolated test files in child
processes, as a user would run them, and each child spent 4-5 CPU-s importing
TensorFlow and Keras before doing anything (``python -X importtime -c "import
tensorflow, keras"``); the suite starts over a hundred of them.

How: `run` and `Popen` take the arguments of `subprocess.run` and
`subprocess.Popen`.  The second command ``[sys.executable, "-m", module, *args]``
or ``[sys.executable, "-c", code, *args]`` a process runs with an environment
starts a *server* with that environment (one command alone is not worth one):
a Python that imports TensorFlow, Keras and the package (`PRELOAD`), runs no
TensorFlow operation (no thread pool, no device is made) and then forks one
child per command.  The child becomes what the command would have started: its
standard streams, working directory and environment are the command's;
``sys.argv``, ``sys.path[0]`` and ``__main__`` are what ``python -m``/``-c``
sets; NumPy's global generator and `random` are seeded afresh; SIGINT raises
KeyboardInterrupt; at the end it waits for its threads, runs the ``atexit``
functions and exits with the status and traceback ``python`` would.  The
server waits for it and hands its exit status to the caller; the pid is the
child's, so signals reach it.  A server ends after `IDLE_SECONDS` without a
command, and when the process that started it ends (killing the children it
is running); the processes a child starts find the servers through
``DPFL_TEST_WARM_SOCKETS``.

What runs cold, as a plain ``subprocess`` call: any other command (another
program, interpreter options such as ``-X importtime``); a command whose
environment does not set what the package sets before it imports TensorFlow
(`SET_BEFORE_IMPORT`: a fresh CLI quiets TensorFlow's C++ log, a warm child
could not); the first command of each environment that differs in a variable
read at import (``TF_*``, ``KERAS_*``, ``PYTHON*``, ``HOME``, ...:
`IMPORT_TIME_ENV`); commands of further environments while `MAX_SERVERS` run;
and every command with ``DPFL_TEST_COLD_CHILDREN=1``.  What a warm child
cannot tell from a cold one: the modules are imported before its code runs
(import-time side effects happened once, in the server), and the hash seed is
the server's.  So the tests that check what start-up does (``--help`` imports
no TensorFlow, a run prints no TensorFlow start-up lines, the memory of a fresh
process) stay cold.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading

#: variables a Python reads when it starts or imports TensorFlow/Keras/matplotlib:
#: a command whose value differs from a server's needs a server of its own
IMPORT_TIME_ENV = re.compile(
    r"^(TF_|TF2_|KERAS_|XLA_|CUDA|TPU_|OMP_|KMP_|MKL|PYTHON|LD_|MPL|MATPLOTLIB|JAX_|ABSL_"
    r"|GRPC_|HOME$|TMPDIR$|LANG$|LC_)"
)
#: variables the package sets before it imports TensorFlow (``setdefault``: the CLI
#: quiets TensorFlow's C++ log); a warm child, TensorFlow imported already, is what a
#: cold one would be only if the command's environment sets them itself
SET_BEFORE_IMPORT = ("TF_CPP_MIN_LOG_LEVEL",)
#: servers one process may run at once (one per distinct import-time environment)
MAX_SERVERS = 4
#: seconds a server waits for a command before it ends (a test's own environment)
IDLE_SECONDS = 60.0
IDLE_ENV = "DPFL_TEST_WARM_IDLE"
#: what the server imports before it forks
PRELOAD = ("numpy", "tensorflow", "keras", "dpfl_tf", "dpfl_tf.cli", "dpfl_tf.keras")
COLD_ENV = "DPFL_TEST_COLD_CHILDREN"
#: tests/isolation.py's child dies with the process this names: in a warm child,
#: the server (which ends, and kills its children, when its caller ends)
CHILD_PARENT_ENV = "DPFL_TEST_CHILD_PARENT"
START_TIMEOUT = 300.0
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL


def _import_time_env(env) -> frozenset:
    return frozenset((k, v) for k, v in env.items() if IMPORT_TIME_ENV.match(k))


def _warm_form(cmd, env) -> bool:
    return (
        all(name in env for name in SET_BEFORE_IMPORT)
        and isinstance(cmd, (list, tuple))
        and len(cmd) >= 3
        and os.fspath(cmd[0]) == sys.executable
        and cmd[1] in ("-m", "-c")
        and all(isinstance(a, (str, os.PathLike)) for a in cmd)
    )


# -- the caller's side --------------------------------------------------------
class _Server:
    def __init__(self, env):
        self.dir = tempfile.mkdtemp(prefix="dpfl_warm_")
        self.path = os.path.join(self.dir, "s")
        self.log = os.path.join(self.dir, "log")
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from tests.warm_python import _serve; _serve()", self.path],
                cwd=_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )

    def tail(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


_servers: dict[str, _Server] = {}  # import-time environment's digest -> our server
_uses: dict[str, int] = {}
_lock = threading.Lock()
#: the servers a process started, for its descendants: "<digest>=<socket>;..."
SOCKETS_ENV = "DPFL_TEST_WARM_SOCKETS"
#: False in the command-line client (`_exec_main`): it only uses servers that exist
_start_servers = True


@atexit.register
def _stop_servers():
    for server in _servers.values():
        server.stop()
    _servers.clear()


def _digest(env) -> str:
    import hashlib

    return hashlib.sha1(repr(sorted(_import_time_env(env))).encode()).hexdigest()[:16]


def _inherited() -> dict[str, str]:
    items = os.environ.get(SOCKETS_ENV, "").split(";")
    return dict(item.split("=", 1) for item in items if "=" in item)


def _sockets_value() -> str:
    paths = {**_inherited(), **{d: s.path for d, s in _servers.items() if s.proc.poll() is None}}
    return ";".join(f"{d}={p}" for d, p in paths.items())


def _server_for(env) -> tuple[str, _Server | None] | None:
    """(socket path, our server or None if an ancestor's) for commands with this
    environment; None: run cold.  A process starts a server for an environment
    the second time it runs a command with it (one command alone is not worth
    a server)."""
    digest = _digest(env)
    with _lock:
        server = _servers.get(digest)
        if server is not None and server.proc.poll() is None:
            return server.path, server
        path = _inherited().get(digest)
        if path is not None and os.path.exists(path):
            return path, None
        if server is not None:
            server.stop()
            del _servers[digest]
            if server.proc.returncode != 0:  # it failed (0: it ended idle): no second one
                _uses[digest] = -(10**9)
        if not _start_servers:
            return None
        _uses[digest] = _uses.get(digest, 0) + 1
        live = sum(s.proc.poll() is None for s in _servers.values())
        if _uses[digest] < 2 or live >= MAX_SERVERS:
            return None
        server = _servers[digest] = _Server(dict(env))
        return server.path, server


def _fd_for(spec, *, mode, inherited, stdout_fd=None):
    """(fd to hand the child, fd to close once handed, our end if a pipe)"""
    if spec is None:
        return inherited, None, None
    if spec == DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        return fd, fd, None
    if spec == PIPE:
        r, w = os.pipe()
        return (r, r, w) if mode == "r" else (w, w, r)
    if spec == STDOUT:
        return stdout_fd, None, None
    if isinstance(spec, int):
        return spec, None, None
    return spec.fileno(), None, None


def for_descendants(env) -> dict:
    """`env` for a command that starts Pythons itself (a shell running the docs'
    ``dpfl-tf`` shim, which is `_exec_main`): it counts as a use of the
    environment (a server starts on the second) and names the servers."""
    env = dict(env)
    if os.environ.get(COLD_ENV) != "1":
        _server_for(env)
    env[SOCKETS_ENV] = _sockets_value()
    return env


class _Refused(Exception):
    """The server did not start the child (gone, or another environment)."""


def _connect(path, server) -> socket.socket:
    """A connection to the server at `path`; waits for a server we just started."""
    import time

    deadline = time.monotonic() + START_TIMEOUT
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if server is None or server.proc.poll() is not None or time.monotonic() > deadline:
                if server is not None and server.proc.returncode:  # ours failed: say so
                    import warnings

                    warnings.warn(f"the warm Python server ended; running cold:\n{server.tail()}")
                raise _Refused(f"no warm Python server at {path}") from None
            time.sleep(0.05)


_WARM_KWARGS = {
    "stdin",
    "stdout",
    "stderr",
    "text",
    "universal_newlines",
    "encoding",
    "errors",
    "cwd",
}


class Popen:
    """`subprocess.Popen` for ``[sys.executable, "-m"/"-c", ...]``, forked from a
    warm server; any other command, or if no server takes it, a plain
    `subprocess.Popen`."""

    def __new__(cls, cmd, **kwargs):
        env = kwargs.pop("env", None)
        env = dict(os.environ if env is None else env)
        env[SOCKETS_ENV] = _sockets_value()  # the children's children find the servers
        found = None
        if _warm_form(cmd, env) and set(kwargs) <= _WARM_KWARGS and os.environ.get(COLD_ENV) != "1":
            found = _server_for(env)
        if found is not None:
            self = super().__new__(cls)
            try:
                self._start(*found, [os.fspath(a) for a in cmd], env, **kwargs)
                return self
            except _Refused:
                pass
        return subprocess.Popen(cmd, env=env, **kwargs)

    def _start(self, path, server, cmd, env, *, stdin=None, stdout=None, stderr=None, text=False,
               universal_newlines=None, encoding=None, errors=None, cwd=None):  # fmt: skip
        self.args, self.returncode = cmd, None
        text = bool(text or universal_newlines or encoding or errors)
        if stdin is None:  # not the test process's stdin (xdist's channel): nothing
            stdin = DEVNULL
        fds, close, ours = [], [], []
        for inherited, (spec, mode) in enumerate(((stdin, "r"), (stdout, "w"), (stderr, "w"))):
            fd, to_close, our_end = _fd_for(
                spec, mode=mode, inherited=inherited, stdout_fd=fds[1] if fds[1:] else None
            )
            fds.append(fd)
            close.append(to_close)
            ours.append(our_end)
        request = {
            "argv": cmd[1:],
            "cwd": os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd(),
            "env": env,
        }
        body = json.dumps(request).encode()
        self._buf = b""
        try:
            self._sock = _connect(path, server)
            try:
                socket.send_fds(self._sock, [struct.pack("!Q", len(body))], fds)
                self._sock.sendall(body)
                reply = json.loads(self._line(None) or b'{"error": "no reply"}')
            except OSError as e:
                reply = {"error": repr(e)}
            if "pid" not in reply:
                self._sock.close()
                raise _Refused(reply.get("error"))
        except _Refused:
            for fd in ours:
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in close:
                if fd is not None:
                    os.close(fd)
        self.pid = reply["pid"]

        def wrap(fd, mode):
            if fd is None:
                return None
            if text:
                return open(fd, mode, encoding=encoding, errors=errors)
            return open(fd, mode + "b")

        self.stdin = wrap(ours[0], "w")
        self.stdout = wrap(ours[1], "r")
        self.stderr = wrap(ours[2], "r")

    def _line(self, timeout) -> bytes:
        """The server's next line (b"" if it closed); TimeoutError after `timeout` s."""
        while b"\n" not in self._buf:
            if not select.select([self._sock], [], [], timeout)[0]:
                raise TimeoutError
            chunk = self._sock.recv(4096)
            if not chunk:
                return b""
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _status(self, timeout):
        line = self._line(timeout)
        self.returncode = json.loads(line)["status"] if line else -signal.SIGKILL
        self._sock.close()

    # the subprocess.Popen interface the tests use
    def poll(self):
        if self.returncode is None:
            try:
                self._status(0)
            except TimeoutError:
                pass
        return self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            try:
                self._status(timeout)
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def communicate(self, input=None, timeout=None):
        if input is not None and self.stdin is not None:
            try:
                self.stdin.write(input)
            except BrokenPipeError:
                pass
        if self.stdin is not None:
            self.stdin.close()
            self.stdin = None
        results = {}

        def drain(name):
            stream = getattr(self, name)
            results[name] = stream.read()
            stream.close()

        threads = [
            threading.Thread(target=drain, args=(name,), daemon=True)
            for name in ("stdout", "stderr")
            if getattr(self, name) is not None and not getattr(self, name).closed
        ]
        for t in threads:
            t.start()
        self.wait(timeout)
        for t in threads:
            t.join()
        return results.get("stdout"), results.get("stderr")

    def send_signal(self, sig):
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None:
                stream.close()
        self.wait()


def run(cmd, *, input=None, capture_output=False, timeout=None, check=False, **kwargs):
    """`subprocess.run`, warm where it can be (`Popen`)."""
    if input is not None:
        kwargs["stdin"] = PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = PIPE
    proc = Popen(cmd, **kwargs)
    if isinstance(proc, subprocess.Popen):  # cold
        with proc:
            try:
                out, err = proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise
    else:
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


# -- the server ---------------------------------------------------------------
def _serve():
    """The server: listens on sys.argv[1], imports `PRELOAD`, then forks one child
    per request.  Ends when the process that started it ends."""
    import importlib
    import selectors
    import time

    path = sys.argv[1]
    owner = os.getppid()
    started_env = dict(os.environ)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    for name in PRELOAD:
        importlib.import_module(name)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    wake_r, wake_w = os.pipe()  # a child's end wakes the loop (SIGCHLD)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector.register(wake_r, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}  # pid -> the caller's connection
    idle = float(os.environ.get(IDLE_ENV, IDLE_SECONDS))
    last = time.monotonic()
    while os.getppid() == owner:
        if children:
            last = time.monotonic()
        elif time.monotonic() - last > idle:
            break
        for key, _ in selector.select(timeout=1.0):
            if key.fileobj == wake_r:
                os.read(wake_r, 4096)
            elif key.fileobj is listener:
                conn, _ = listener.accept()
                pid = _fork_child(conn, (listener, wake_r, wake_w), started_env, children)
                if pid:
                    children[pid] = conn
                    selector.register(conn, selectors.EVENT_READ, pid)
                else:
                    conn.close()
            else:  # the caller closed its end (gone, or gave up): its child goes too
                try:
                    os.kill(key.data, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                selector.unregister(conn)
                try:
                    conn.sendall(
                        json.dumps({"status": os.waitstatus_to_exitcode(status)}).encode() + b"\n"
                    )
                except OSError:
                    pass
                conn.close()
    os.unlink(path)  # no new caller waits for it
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _fork_child(conn, server_files, started_env, children) -> int:
    conn.settimeout(30)
    try:
        head, fds, _, _ = socket.recv_fds(conn, 8, 3)
        while len(head) < 8:
            head += conn.recv(8 - len(head))
        (size,) = struct.unpack("!Q", head)
        body = b""
        while len(body) < size:
            chunk = conn.recv(size - len(body))
            if not chunk:
                raise OSError("request cut short")
            body += chunk
        request = json.loads(body)
        if _import_time_env(request["env"]) != _import_time_env(started_env):
            raise ValueError("environment differs in a variable read at import")
        if len(fds) != 3:
            raise ValueError("expected 3 file descriptors")
    except Exception as e:
        try:
            conn.sendall(json.dumps({"error": repr(e)}).encode() + b"\n")
        except OSError:
            pass
        return 0
    conn.settimeout(None)
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            listener, wake_r, wake_w = server_files
            listener.close()
            os.close(wake_r)
            os.close(wake_w)
            conn.close()
            for other in children.values():
                other.close()
            _become(request, fds)
        finally:
            os._exit(70)
    for fd in fds:
        os.close(fd)
    conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def _become(request, fds):
    """In the forked child: become ``python <argv>`` and exit as it would."""
    import atexit as _atexit
    import builtins
    import random
    import runpy
    import types

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if CHILD_PARENT_ENV in os.environ:  # the process that started this one: the server
        os.environ[CHILD_PARENT_ENV] = str(os.getppid())
    tempfile.tempdir = None
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    for name in [n for n in sys.modules if n == "tests" or n.startswith("tests.")]:
        del sys.modules[name]
    flag, target, *args = request["argv"]
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    code = 0
    try:
        if flag == "-m":
            sys.argv = ["-m", *args]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(target, alter_argv=True)
        else:
            sys.argv = ["-c", *args]
            sys.path[0] = ""
            exec(compile(target, "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        code = _exit_status(e)
    except BaseException as e:  # as Python reports it: without this function's frame
        e.__traceback__ = e.__traceback__.tb_next
        sys.excepthook(type(e), e, e.__traceback__)
        code = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
    try:
        threading._shutdown()
    except Exception:
        pass
    _atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if code == -signal.SIGINT:  # as Python: killed by the signal it did not handle
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    print(e.code, file=sys.stderr)
    return 1


def _exec_main(argv):
    """``python -m tests.warm_python -m module args...``: runs ``python -m module
    args...`` in a server an ancestor started for this environment (with this
    process's standard streams), else execs it cold; exits with its status.
    The docs' ``dpfl-tf`` shim uses it."""
    global _start_servers
    _start_servers = False
    cmd = [sys.executable, *argv]
    env = {**os.environ, SOCKETS_ENV: _sockets_value()}
    found = _server_for(env) if _warm_form(cmd, env) and env.get(COLD_ENV) != "1" else None
    proc = object.__new__(Popen)
    try:
        if found is None:
            raise _Refused
        proc._start(*found, cmd, env, stdin=0, stdout=1, stderr=2)
    except _Refused:
        os.execv(sys.executable, cmd)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda sig, _: proc.send_signal(sig))
    status = proc.wait()
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    sys.exit(status)


if __name__ == "__main__":
    _exec_main(sys.argv[1:])

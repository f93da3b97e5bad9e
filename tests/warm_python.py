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
child's, so signals sent to it reach it, and the server ignores SIGINT, so a
Ctrl-C at the terminal reaches the children as it reaches cold ones.  A server
ends after `IDLE_SECONDS` without a command, on SIGTERM (the caller's exit) and
when the process that started it ends, killing the children it is running;
the processes a child starts find the servers through
``DPFL_TEST_WARM_SOCKETS``.  A server imports `PRELOAD` from its import path
(an empty directory, then ``PYTHONPATH``, which is part of its environment,
then site-packages) and refuses a command that would find one of them
elsewhere (a checkout in its directory): that command runs cold.  Unlike `subprocess`, a
child given no ``stdin`` reads nothing (``/dev/null``), not the test process's
standard input (pytest-xdist's channel).

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
the server's (children of one server iterate sets of strings in one order).
So the tests that check what start-up does (``--help`` imports no TensorFlow,
a run prints no TensorFlow start-up lines, the memory of a fresh process) stay
cold.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

#: variables a Python reads when it starts or imports TensorFlow/Keras/NumPy/
#: matplotlib: a command whose value differs from a server's needs a server of its own
IMPORT_TIME_ENV = re.compile(
    r"^(TF_|TF2_|KERAS_|XLA_|CUDA|TPU_|TFHUB_|OMP_|KMP_|MKL|OPENBLAS|NPY_|PYTHON|LD_|MPL"
    r"|MATPLOTLIB|JAX_|ABSL_|GRPC_|HOME$|TMPDIR$|TZ$|LANG$|LANGUAGE$|LC_)"
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
#: seconds to wait for a new server's imports (then the command runs cold)
START_TIMEOUT = 300.0
#: the processes' servers, for their descendants: "<digest>=<socket>;..."
SOCKETS_ENV = "DPFL_TEST_WARM_SOCKETS"

PIPE, STDOUT, DEVNULL = subprocess.PIPE, subprocess.STDOUT, subprocess.DEVNULL

# the server loads this file by its path: the package is imported from where the
# command would find it, not from this checkout because the tests live here
_BOOTSTRAP = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('_dpfl_warm_server', sys.argv[2])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "module._serve()\n"
)


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
                [sys.executable, "-c", _BOOTSTRAP, self.path, os.path.abspath(__file__)],
                cwd=self.dir,  # "" on its path finds nothing: PRELOAD from PYTHONPATH/site
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )

    def tail(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    def stop(self):
        """SIGTERM: the server kills the children it runs, then ends."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


_servers: dict[str, _Server] = {}  # import-time environment's digest -> our server
_uses: dict[str, int] = {}
_failed: set[str] = set()  # environments whose server failed: they run cold
_lock = threading.Lock()
#: False in the command-line client (`_exec_main`): it only uses servers that exist
_start_servers = True


@atexit.register
def _stop_servers():
    with _lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        server.stop()


def _digest(env) -> str:
    import hashlib

    return hashlib.sha1(repr(sorted(_import_time_env(env))).encode()).hexdigest()[:16]


def _inherited() -> dict[str, str]:
    items = os.environ.get(SOCKETS_ENV, "").split(";")
    return dict(item.split("=", 1) for item in items if "=" in item)


def _sockets_value() -> str:
    with _lock:
        ours = {d: s.path for d, s in _servers.items() if s.proc.poll() is None}
    return ";".join(f"{d}={p}" for d, p in {**_inherited(), **ours}.items())


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
                _failed.add(digest)
        if not _start_servers or digest in _failed:
            return None
        _uses[digest] = _uses.get(digest, 0) + 1
        live = sum(s.proc.poll() is None for s in _servers.values())
        if _uses[digest] < 2 or live >= MAX_SERVERS:
            return None
        server = _servers[digest] = _Server(dict(env))
        return server.path, server


def for_descendants(env) -> dict:
    """`env` for a command that starts Pythons itself (a shell running the docs'
    ``dpfl-tf`` shim, which is `_exec_main`): it counts as a use of the
    environment (a server starts on the second) and names the servers."""
    env = dict(env)
    if os.environ.get(COLD_ENV) != "1":
        _server_for(env)
    env[SOCKETS_ENV] = _sockets_value()
    return env


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


class _Refused(Exception):
    """The server did not start the child (gone, busy importing for too long, or
    the command would import the package from elsewhere)."""


def _connect(path, server) -> socket.socket:
    """A connection to the server at `path` (ours may not listen yet)."""
    deadline = time.monotonic() + 10
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return sock
        except (FileNotFoundError, ConnectionRefusedError):
            sock.close()
            if server is None or server.proc.poll() is not None or time.monotonic() > deadline:
                raise _Refused(f"no warm Python server at {path}") from None
            time.sleep(0.05)


_WARM_KWARGS = {"stdin", "stdout", "stderr", "text", "universal_newlines", "encoding", "errors"}


class Popen:
    """`subprocess.Popen` for ``[sys.executable, "-m"/"-c", ...]``, forked from a
    warm server; any other command, or if no server takes it, a plain
    `subprocess.Popen`."""

    def __new__(cls, cmd, **kwargs):
        env = kwargs.pop("env", None)
        env = dict(os.environ if env is None else env)
        cwd = kwargs.pop("cwd", None)
        where = os.path.abspath(os.fspath(cwd)) if cwd is not None else os.getcwd()
        found = None
        if (
            _warm_form(cmd, env)
            and set(kwargs) <= _WARM_KWARGS
            and os.path.isdir(where)  # else subprocess raises the error it raises
            and os.environ.get(COLD_ENV) != "1"
        ):
            found = _server_for(env)
        env[SOCKETS_ENV] = _sockets_value()  # the children's children find the servers
        if found is not None:
            self = super().__new__(cls)
            try:
                self._start(*found, [os.fspath(a) for a in cmd], env, where, **kwargs)
                return self
            except _Refused:
                pass
        return subprocess.Popen(cmd, env=env, cwd=cwd, **kwargs)

    def _start(self, path, server, cmd, env, cwd, *, stdin=None, stdout=None, stderr=None,
               text=False, universal_newlines=None, encoding=None, errors=None):  # fmt: skip
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
        body = json.dumps({"argv": cmd[1:], "cwd": cwd, "env": env}).encode()
        self._buf = b""
        try:
            self._sock = _connect(path, server)
            try:
                socket.send_fds(self._sock, [struct.pack("!Q", len(body))], fds)
                self._sock.sendall(body)
                # a server we just started answers once its imports are done
                reply = json.loads(self._line(START_TIMEOUT) or b'{"error": "no reply"}')
            except (OSError, TimeoutError) as e:
                reply = {"error": repr(e)}
            if "pid" not in reply:
                self._sock.close()
                if server is not None and server.proc.poll() not in (None, 0):
                    import warnings

                    warnings.warn(f"a warm Python server failed; running cold:\n{server.tail()}")
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
        """As subprocess's: the output read to its end, the status; TimeoutExpired
        after `timeout` s (the child keeps running, as there)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        results, failed = {}, []

        def drain(stream, name):
            try:
                results[name] = stream.read()
            except BaseException as e:  # a decoding error: still empty the pipe
                failed.append(e)
                while os.read(stream.fileno(), 65536):
                    pass
            stream.close()

        threads = []
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None and not stream.closed:
                threads.append(threading.Thread(target=drain, args=(stream, name), daemon=True))
                threads[-1].start()
        if self.stdin is not None:
            try:
                if input is not None:
                    self.stdin.write(input)
                self.stdin.close()
            except BrokenPipeError:
                pass
            self.stdin = None
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():  # a grandchild holds the pipe open
                raise subprocess.TimeoutExpired(self.args, timeout)
        if failed:
            raise failed[0]
        return results.get("stdout"), results.get("stderr")

    def send_signal(self, sig):
        if self.poll() is None:  # not once the server reaped it (its pid may be reused)
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
    """`subprocess.run`, warm where it can be (`Popen`): the child is killed if
    the wait ends in an exception (a timeout, Ctrl-C)."""
    if input is not None:
        kwargs["stdin"] = PIPE
    if capture_output:
        kwargs["stdout"] = kwargs["stderr"] = PIPE
    proc = Popen(cmd, **kwargs)
    try:  # (the readers close the pipes at their end: one a grandchild holds stays open)
        out, err = proc.communicate(input, timeout=timeout)
    except BaseException:
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
    per request.  Ends when idle, on SIGTERM and when the process that started it
    ends, killing the children it runs."""
    import gc
    import importlib
    import selectors

    path = sys.argv[1]
    owner = os.getppid()
    started_env = dict(os.environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the children

    def end(*_):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, end)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    children: dict[int, socket.socket] = {}  # pid -> the caller's connection
    try:
        for name in PRELOAD:
            importlib.import_module(name)
        gc.collect()
        gc.freeze()  # what the children share is not copied by their collections
        selector = selectors.DefaultSelector()
        selector.register(listener, selectors.EVENT_READ)
        wake_r, wake_w = os.pipe()  # a child's end wakes the loop (SIGCHLD)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        selector.register(wake_r, selectors.EVENT_READ)
        server_files = (selector, listener, wake_r, wake_w)
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
                    pid = _fork_child(conn, server_files, started_env, children)
                    if pid:
                        children[pid] = conn
                        selector.register(conn, selectors.EVENT_READ, pid)
                    else:
                        conn.close()
                else:  # the caller closed its end (gone, or gave up): its child goes too
                    selector.unregister(key.fileobj)
                    _kill(key.data)
            while children:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = children.pop(pid, None)
                if conn is None:
                    continue
                if conn.fileno() in selector.get_map():
                    selector.unregister(conn)
                try:
                    code = os.waitstatus_to_exitcode(status)
                    conn.sendall(json.dumps({"status": code}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
    except SystemExit:  # SIGTERM: an ordinary end
        pass
    except BaseException:  # a failure: its log stays for the caller
        os.unlink(path)
        raise
    finally:
        for pid in children:
            _kill(pid)
    # ended normally (idle, SIGTERM, the caller gone): nothing left behind
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _finds_preloaded_elsewhere(request) -> str | None:
    """The first of `PRELOAD` that the command, in its directory, would import from
    another file than the server did (a checkout in its directory), else None."""
    from importlib.machinery import PathFinder

    search = [request["cwd"], *sys.path[1:]]  # "" and -m's directory: the command's
    for name in sorted({n.split(".")[0] for n in PRELOAD}):
        spec = None
        for finder in sys.meta_path:  # in the import system's order (an editable
            if finder is PathFinder:  # install's finder comes after the path)
                spec = PathFinder.find_spec(name, search)
            elif hasattr(finder, "find_spec"):
                try:
                    spec = finder.find_spec(name, None)
                except Exception:
                    spec = None
            if spec is not None:
                break
        origin = getattr(sys.modules[name].__spec__, "origin", None)
        if spec is None or not spec.origin or not origin:
            return name
        if os.path.realpath(spec.origin) != os.path.realpath(origin):
            return name
    return None


def _fork_child(conn, server_files, started_env, children) -> int:
    conn.settimeout(30)
    fds = []
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
        elsewhere = _finds_preloaded_elsewhere(request)
        if elsewhere:
            raise ValueError(f"the command would import {elsewhere} from elsewhere")
    except Exception as e:
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(json.dumps({"error": repr(e)}).encode() + b"\n")
        except OSError:
            pass
        return 0
    conn.settimeout(None)
    _flush()  # nothing buffered in the server is written again by each child
    pid = os.fork()
    if pid == 0:
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            selector, listener, wake_r, wake_w = server_files
            selector.close()
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
    try:
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    except OSError:  # the caller is gone: so is the child
        _kill(pid)
    return pid


def _flush():
    """Python's and C's standard streams."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        import ctypes

        ctypes.CDLL(None).fflush(None)
    except Exception:
        pass


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
    sys.modules["numpy"].random.seed()
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
            # dont_inherit: not this module's `from __future__ import annotations`
            exec(compile(target, "<string>", "exec", dont_inherit=True), main.__dict__)
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
    _flush()
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
    env = dict(os.environ)
    warm = _warm_form(cmd, env) and env.get(COLD_ENV) != "1"
    found = _server_for(env) if warm else None
    proc = object.__new__(Popen)
    try:
        if found is None:
            raise _Refused
        proc._start(*found, cmd, env, os.getcwd(), stdin=0, stdout=1, stderr=2)
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

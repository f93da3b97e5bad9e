"""A ClientApp that stays warm across rounds on Flower's Deployment Engine.

flwr 1.42's SuperNode starts a new ClientApp process for every message
(``flwr-clientapp`` takes one token per app execution), so the cold
``dpfl_tf.federated.flower:client_app`` imports TensorFlow, loads the data set,
builds the Keras model and traces its training step in every round.  This
module's ``client_app`` does none of that: it imports only Flower and NumPy and
forwards each message to one *worker process per node*, which it starts on the
node's first message and which keeps TensorFlow, the partition, the model and
its traced step for the next rounds.  The worker answers with
`dpfl_tf.federated.flower.client_train` -- the cold ClientApp's own function --
so a warm client uploads exactly what a cold one running the same code does (a
ClientApp whose code differs from its worker's starts a new worker).

The worker
----------
* listens on a Unix socket of its own with a random key (HMAC challenges, as
  `multiprocessing.connection`), both named in an address file (with the
  ClientApp's `code_fingerprint`) in a private directory
  (``$XDG_RUNTIME_DIR/dpfl-flower`` or ``/tmp/dpfl-flower-<uid>``, a real
  directory of mode 0700), named after the ClientApp's parent process (the
  SuperNode's executor) and the node id;
* ends when that parent process ends (the SuperNode stopped or killed), on
  SIGTERM, after ``DPFL_FLOWER_WORKER_IDLE`` seconds without a message (default
  1800), or when the address file no longer names it (deleted, or a newer
  worker: a ClientApp running other code starts one);
* runs in the ClientApp's process group (the SuperNode's), so a signal to
  that group reaches it, and writes to the ClientApp's stdout/stderr (the
  SuperNode's log);
* serves one message at a time; an error in it is raised in the ClientApp
  (Flower replies with an error message, as for a cold client; the traceback
  stays in the worker's log).  If the worker
  dies, the next message starts a new one (cold once).

Use it in the app's ``pyproject.toml``::

    clientapp = "dpfl_tf.federated.flower_warm:client_app"

The server side (``dpfl_tf.federated.flower:server_app``) is unchanged.  Under
the simulation engine use the cold app: Ray already keeps one client runtime
per worker process.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import (
    Client,
    Connection,
    answer_challenge,
    deliver_challenge,
)

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from dpfl_tf.federated.flower_messages import TrainRequest, query_reply, train_reply, train_request

__all__ = ["client_app", "worker_address", "serve"]

#: seconds a worker waits for a message before it ends (env DPFL_FLOWER_WORKER_IDLE)
DEFAULT_IDLE_SECONDS = 1800.0
#: seconds the ClientApp waits for a worker it started to listen
START_TIMEOUT = 120.0


def _private_dir() -> str:
    """``$XDG_RUNTIME_DIR/dpfl-flower`` (a per-user directory), else
    ``/tmp/dpfl-flower-<uid>`` (short: a Unix socket's path must stay under ~100
    characters).  It must be a real directory (not a symbolic link) of this user
    with mode 0700: it holds the workers' keys."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and len(runtime) <= 50:
        path = os.path.join(runtime, "dpfl-flower")
    else:
        base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
        path = os.path.join(base, f"dpfl-flower-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)  # not os.stat: a symbolic link planted there is refused
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{path} must be a directory (not a link) of this user with mode 0700 "
            "(it holds the warm Flower workers' keys)"
        )
    return path


def code_fingerprint() -> str:
    """What the worker runs: the interpreter, its import path and the size and
    modification time of every dpfl_tf module.  A ClientApp whose fingerprint
    differs from its worker's (dpfl_tf upgraded, another app bundle on the path)
    starts a new worker instead of asking the old one."""
    import dpfl_tf

    h = hashlib.sha1(f"{sys.executable}\0{sys.path}\0{dpfl_tf.__version__}".encode())
    root = os.path.dirname(os.path.abspath(dpfl_tf.__file__))
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                st = os.stat(os.path.join(folder, name))
                h.update(f"{folder}/{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()


def worker_address(parent_pid: int, node_id: int) -> str:
    """The address file of the worker serving node `node_id` of the SuperNode whose
    executor process is `parent_pid`: it names the worker's socket and key."""
    return os.path.join(_private_dir(), f"worker-{parent_pid}-{node_id}.addr")


def _read_address(address_file: str) -> tuple[str, bytes, str]:
    """(socket path, key, code fingerprint) of the worker the file names."""
    with open(address_file) as f:
        entry = json.load(f)
    return entry["socket"], entry["key"].encode(), entry["code"]


def _sweep(directory: str) -> None:
    """Removes the files of workers whose SuperNode executor is gone (a worker
    killed with its node cannot remove them itself)."""
    for name in os.listdir(directory):
        m = re.fullmatch(r"worker-(\d+)-\d+\.addr", name)
        if not m or _alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError, ValueError, KeyError):
            os.unlink(_read_address(path)[0])
        for stale in (path, path + ".lock"):
            with contextlib.suppress(OSError):
                os.unlink(stale)


# ---------------------------------------------------------------------------
# The ClientApp side (no TensorFlow)


class WorkerError(RuntimeError):
    """An error raised in the node's worker process (its traceback in the message)."""


def _start_worker(address_file: str, parent_pid: int, code: str) -> subprocess.Popen:
    """A new worker on a socket of its own; the address file names it from now on
    (an older worker sees that and ends).  The worker gets its socket and key on
    its standard input, and this process's import path."""
    with contextlib.suppress(OSError, ValueError, KeyError):  # a dead worker's socket
        os.unlink(_read_address(address_file)[0])
    entry = {
        "socket": f"{address_file[: -len('.addr')]}-{secrets.token_hex(4)}.sock",
        "key": secrets.token_hex(32),
        "code": code,
    }
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    worker = subprocess.Popen(  # noqa: S603 - our own module, our interpreter
        [
            sys.executable,
            "-m",
            "dpfl_tf.federated.flower_warm",
            "--address-file",
            address_file,
            "--watch-pid",
            str(parent_pid),
        ],
        stdin=subprocess.PIPE,
        env=env,
        close_fds=True,
    )
    worker.stdin.write(json.dumps(entry).encode())
    worker.stdin.close()
    tmp = f"{address_file}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(entry, f)
    os.replace(tmp, address_file)
    return worker


def _connect(address_file: str, code: str, deadline: float | None, worker=None):
    """A connection to the worker the address file names if it runs this code,
    waiting for the `worker` just started until `deadline` (None: try once)."""
    while True:
        try:
            sock, key, worker_code = _read_address(address_file)
            if worker_code != code:  # another dpfl_tf, or another import path
                raise ConnectionRefusedError(address_file)
            return Client(sock, family="AF_UNIX", authkey=key)
        except (FileNotFoundError, ConnectionRefusedError, ValueError, KeyError):
            if deadline is None:
                raise ConnectionRefusedError(address_file) from None
            if worker is not None and worker.poll() is not None:
                raise WorkerError(
                    f"the node's worker process exited with code {worker.returncode} "
                    "before it listened (its error is in the SuperNode's log)"
                ) from None
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"the node's worker process did not listen within {START_TIMEOUT:g} s"
                ) from None
            time.sleep(0.2)


def _parent_pid() -> int:
    """The process whose end ends the worker: the ClientApp's parent, which on the
    Deployment Engine is the SuperNode's executor (it lives as long as the node)."""
    return os.getppid()


@contextlib.contextmanager
def _locked(address_file: str):
    """One process at a time starts or retires the worker of an address file."""
    with open(address_file + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _worker_connection(context: Context):
    parent_pid = _parent_pid()
    address_file = worker_address(parent_pid, context.node_id)
    code = code_fingerprint()
    try:
        return _connect(address_file, code, None)
    except ConnectionRefusedError:
        pass
    _sweep(os.path.dirname(address_file))
    with _locked(address_file):  # another ClientApp may have started it meanwhile
        try:
            return _connect(address_file, code, None)
        except ConnectionRefusedError:
            worker = _start_worker(address_file, parent_pid, code)
            return _connect(address_file, code, time.monotonic() + START_TIMEOUT, worker)


def _ask(context: Context, request: tuple):
    with _worker_connection(context) as conn:
        conn.send(request)
        try:
            ok, value = conn.recv()
        except EOFError:
            raise WorkerError(
                "the node's worker process ended while answering (its error is in the "
                "SuperNode's log); the next message starts a new one"
            ) from None
    if not ok:
        raise WorkerError(value)
    return value


client_app = ClientApp()


@client_app.train()
def _train(msg: Message, context: Context) -> Message:
    upload, metrics = _ask(context, ("train", train_request(msg, context)))
    return train_reply(msg, context, upload, metrics)


@client_app.query()
def _query(msg: Message, context: Context) -> Message:
    k = _ask(context, ("query", dict(context.run_config), dict(context.node_config)))
    return query_reply(msg, k)


# ---------------------------------------------------------------------------
# The worker side


def _answer(spec, request: tuple):
    from dpfl_tf.federated import flower

    kind = request[0]
    if kind == "train" and isinstance(request[1], TrainRequest):
        return flower.client_train(spec, request[1])
    if kind == "query":  # enrolment, before the first round: build the client now
        return flower.client_partition(spec, request[1], request[2], build=True)
    raise ValueError(f"unknown request {kind!r}")


def serve(
    address_file: str, socket_path: str, key: bytes, watch_pid: int, idle_seconds: float
) -> None:
    """Answer the node's ClientApps on `socket_path` until `watch_pid` ends, the
    address file names another worker (or is deleted), `idle_seconds` pass without
    a message, or SIGTERM."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # ends through `finally`
    from dpfl_tf.federated.flower import _ClientSpec

    spec = _ClientSpec(None, None, None, key="default:warm")
    listener = _listen(socket_path)
    last = [time.monotonic()]
    stop = threading.Event()

    def still_named() -> bool:
        try:
            return _read_address(address_file)[0] == socket_path
        except (OSError, ValueError, KeyError):
            return False

    def watch() -> None:
        while not stop.wait(1.0):
            if not still_named() or not _alive(watch_pid):
                stop.set()

    def idle() -> bool:
        # decided here, before `accept`, not by the watcher: a peer accepted just
        # as the idle time ran out is answered, not dropped unanswered (its
        # ClientApp failed with "connection reset")
        return time.monotonic() - last[0] > idle_seconds

    threading.Thread(target=watch, daemon=True).start()
    try:
        while not stop.is_set() and not idle():
            try:
                conn = _accept(listener, key)
            except Exception:  # a second without a peer, a wrong key, a peer gone
                continue
            last[0] = time.monotonic()
            with conn:
                if stop.is_set():
                    break
                try:
                    request = conn.recv()
                except (EOFError, OSError):
                    continue
                try:
                    reply = (True, _answer(spec, request))
                except Exception as exc:  # raised in the ClientApp; the traceback stays
                    traceback.print_exc()  # in the SuperNode's log, not in the reply
                    reply = (False, f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(OSError):
                    conn.send(reply)
                last[0] = time.monotonic()
    finally:
        stop.set()
        listener.close()
        with contextlib.suppress(OSError):  # this worker's own socket file
            os.unlink(socket_path)
        with _locked(address_file):
            if still_named():  # not replaced by a newer worker: retire the address
                for path in (address_file, address_file + ".lock"):
                    # (a racing starter holding the unlinked lock at worst starts a
                    # second worker; the one the address file does not name ends)
                    with contextlib.suppress(OSError):
                        os.unlink(path)


def _listen(socket_path: str) -> socket.socket:
    """A Unix socket listening on `socket_path` whose accept times out every second,
    so the serving loop sees its stop flag even when nobody connects."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(socket_path)
    os.chmod(socket_path, 0o600)
    sock.listen()
    sock.settimeout(1.0)
    return sock


def _accept(listener: socket.socket, key: bytes) -> Connection:
    """The next peer, authenticated both ways with the key (HMAC challenges, as
    `multiprocessing.connection.Listener` does)."""
    peer, _ = listener.accept()
    peer.setblocking(True)
    conn = Connection(peer.detach())
    try:
        deliver_challenge(conn, key)
        answer_challenge(conn, key)
    except BaseException:
        conn.close()
        raise
    return conn


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="dpfl_tf's warm Flower client worker")
    p.add_argument("--address-file", required=True)
    p.add_argument("--watch-pid", type=int, required=True)
    args = p.parse_args(argv)
    entry = json.loads(sys.stdin.read())  # socket and key: from the starter, not the file
    idle = float(os.environ.get("DPFL_FLOWER_WORKER_IDLE", DEFAULT_IDLE_SECONDS))
    serve(args.address_file, entry["socket"], entry["key"].encode(), args.watch_pid, idle)


if __name__ == "__main__":
    main()

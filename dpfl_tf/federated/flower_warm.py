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
so a warm client uploads exactly what a cold one does.

The worker
----------
* listens on a Unix socket in a private directory (mode 0700) under the
  system's temporary directory, named after the ClientApp's parent process
  (the SuperNode's executor) and the node id, with a random key
  (`multiprocessing.connection`'s HMAC handshake) in a file only the user can
  read;
* ends when that parent process ends (the SuperNode stopped or killed), after
  ``DPFL_FLOWER_WORKER_IDLE`` seconds without a message (default 1800), or
  when its socket file is removed;
* runs in the ClientApp's process group (the SuperNode's), so a signal to
  that group reaches it, and writes to the ClientApp's stdout/stderr (the
  SuperNode's log);
* serves one message at a time; an error in it is raised in the ClientApp
  (Flower replies with an error message, as for a cold client).  If the worker
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
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Client, Listener

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from dpfl_tf.federated.flower_messages import TrainRequest, query_reply, train_reply, train_request

__all__ = ["client_app", "worker_address", "serve"]

#: seconds a worker waits for a message before it ends (env DPFL_FLOWER_WORKER_IDLE)
DEFAULT_IDLE_SECONDS = 1800.0
#: seconds the ClientApp waits for a worker it started to listen
START_TIMEOUT = 120.0


def _private_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), f"dpfl-flower-{os.getuid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{path} must belong to this user with mode 0700 (it holds the workers' keys)"
        )
    return path


def worker_address(parent_pid: int, node_id: int) -> tuple[str, str]:
    """(socket path, key path) of the worker serving node `node_id` of the SuperNode
    whose executor process is `parent_pid`."""
    base = os.path.join(_private_dir(), f"worker-{parent_pid}-{node_id}")
    return base + ".sock", base + ".key"


# ---------------------------------------------------------------------------
# The ClientApp side (no TensorFlow)


def _start_worker(sock: str, key_path: str, parent_pid: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sock)
    key = secrets.token_hex(32)
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key)
    subprocess.Popen(  # noqa: S603 - our own module, our interpreter
        [
            sys.executable,
            "-m",
            "dpfl_tf.federated.flower_warm",
            "--socket",
            sock,
            "--key-file",
            key_path,
            "--watch-pid",
            str(parent_pid),
        ],
        stdin=subprocess.DEVNULL,
        close_fds=True,
    )


def _connect(sock: str, key_path: str, deadline: float | None):
    """A connection to the worker, waiting for it until `deadline` (None: try once)."""
    while True:
        try:
            with open(key_path) as f:
                key = f.read().encode()
            return Client(sock, family="AF_UNIX", authkey=key)
        except (FileNotFoundError, ConnectionRefusedError):
            if deadline is None or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _parent_pid() -> int:
    """The process whose end ends the worker: the ClientApp's parent, which on the
    Deployment Engine is the SuperNode's executor (it lives as long as the node)."""
    return os.getppid()


def _worker_connection(context: Context):
    parent_pid = _parent_pid()
    sock, key_path = worker_address(parent_pid, context.node_id)
    try:
        return _connect(sock, key_path, None)
    except (FileNotFoundError, ConnectionRefusedError):
        pass
    # one ClientApp starts the worker; another arriving meanwhile waits for it
    with open(sock + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _connect(sock, key_path, None)
        except (FileNotFoundError, ConnectionRefusedError):
            _start_worker(sock, key_path, parent_pid)
            return _connect(sock, key_path, time.monotonic() + START_TIMEOUT)


class WorkerError(RuntimeError):
    """An error raised in the node's worker process (its traceback in the message)."""


def _ask(context: Context, request: tuple):
    with _worker_connection(context) as conn:
        conn.send(request)
        ok, value = conn.recv()
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
        k = flower.client_partition(spec, request[1], request[2])
        flower._runtime(spec, flower.config_from_run_config(request[1]))
        return k
    raise ValueError(f"unknown request {kind!r}")


def serve(socket_path: str, key_file: str, watch_pid: int, idle_seconds: float) -> None:
    """Answer the node's ClientApps on `socket_path` until `watch_pid` ends, the
    socket file goes, or `idle_seconds` pass without a message."""
    with open(key_file) as f:
        key = f.read().encode()
    from dpfl_tf.federated.flower import _ClientSpec

    spec = _ClientSpec(None, None, None, key="default:warm")
    listener = Listener(socket_path, family="AF_UNIX", authkey=key)
    last = [time.monotonic()]
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(1.0):
            gone = not os.path.exists(socket_path) or not _alive(watch_pid)
            if gone or time.monotonic() - last[0] > idle_seconds:
                stop.set()
                with contextlib.suppress(OSError):  # wakes accept()
                    Client(socket_path, family="AF_UNIX", authkey=key).close()

    threading.Thread(target=watch, daemon=True).start()
    try:
        while not stop.is_set():
            try:
                conn = listener.accept()
            except Exception:  # a peer with the wrong key, or one that hung up
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
                except Exception as exc:  # raised in the ClientApp, with our traceback
                    reply = (False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                with contextlib.suppress(OSError):
                    conn.send(reply)
                last[0] = time.monotonic()
    finally:
        listener.close()


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
    p.add_argument("--socket", required=True)
    p.add_argument("--key-file", required=True)
    p.add_argument("--watch-pid", type=int, required=True)
    args = p.parse_args(argv)
    idle = float(os.environ.get("DPFL_FLOWER_WORKER_IDLE", DEFAULT_IDLE_SECONDS))
    serve(args.socket, args.key_file, args.watch_pid, idle)


if __name__ == "__main__":
    main()

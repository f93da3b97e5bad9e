"""What the `dpfl-tf` commands that train share: output paths checked before any
data is loaded, results written atomically as the run goes (with a `status`),
Ctrl-C / SIGTERM turned into a clean stop, and a quiet TensorFlow start-up.

Nothing here imports TensorFlow.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from typing import Any

__all__ = ["check_output_file", "check_output_dir", "ResultsFile", "Interrupts",
           "RunInterrupted", "quiet_tensorflow", "STATUSES", "EXIT_CODES"]

#: the values of a results file's ``status``
STATUSES = ("running", "completed", "budget_spent", "interrupted", "failed")
#: exit code of a run stopped by a signal: 128 + the signal number (as a shell reports it)
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def _first_existing(path: str) -> str:
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return path
        path = parent
    return path


def _probe(directory: str) -> None:
    """Creates and removes a file in `directory` (os.access is not enough: it
    says yes to root on a read-only file system)."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".dpfl-write-test.")
    os.close(fd)
    os.unlink(tmp)


def check_output_dir(flag: str, directory: str | os.PathLike) -> str:
    """Creates `directory` (and its parents) if missing and checks that files
    can be written in it; raises ValueError naming `flag` and the path."""
    directory = os.path.abspath(os.fspath(directory))
    shown = f"{flag} {os.fspath(directory)}"
    existing = _first_existing(directory)
    if os.path.lexists(existing) and not os.path.isdir(existing):
        what = "it" if existing == directory else existing
        raise ValueError(f"{shown}: cannot write there: {what} is a file, not a directory")
    try:
        os.makedirs(directory, exist_ok=True)
        _probe(directory)
    except OSError as e:
        raise ValueError(f"{shown}: cannot write there: {e.strerror or e}") from None
    return directory


def check_output_file(flag: str, path: str | os.PathLike) -> str:
    """Creates the parent directories of the file `path` if missing and checks
    that the file can be written; raises ValueError naming `flag` and the path."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a directory; give a file name such as "
                         f"{os.path.join(path, 'results.json')}")
    parent = os.path.dirname(os.path.abspath(path))
    try:
        check_output_dir(flag, parent)
    except ValueError as e:
        raise ValueError(str(e).replace(f"{flag} {parent}", f"{flag} {path}", 1)) from None
    return path


class ResultsFile:
    """A results JSON rewritten atomically whenever the run has something new:
    ``{"status": ..., <everything measured so far>}``.  Nothing is written
    before the first `write` (a run refused at the start leaves no file)."""

    def __init__(self, path: str):
        self.path = path
        self.written = False
        self.last: dict | None = None

    def write(self, status: str, result: dict, **extra: Any) -> dict:
        from dpfl_tf._io import atomic_write_json

        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        data = {"status": status, **extra, **{k: v for k, v in result.items()
                                              if k not in ("status",)}}
        data["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        atomic_write_json(self.path, data)
        self.written = True
        self.last = data
        return data


class RunInterrupted(KeyboardInterrupt):
    """Raised by `Interrupts` when a signal arrives outside a section that can
    stop by itself (or at the second signal)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Interrupts:
    """Turns SIGINT (Ctrl-C) and SIGTERM into a clean stop.

    Inside `deferred()` the first signal only sets `signum`; the training loop
    polls `requested` and stops after the current lot / client.  Outside it,
    or at a second signal, `RunInterrupted` is raised at once.

        with Interrupts() as interrupts:
            with interrupts.deferred():
                loop(stop=lambda: interrupts.requested)
    """

    def __init__(self):
        self.signum: int | None = None
        self._depth = 0
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.signum, 1)

    @property
    def name(self) -> str:
        return "Ctrl-C" if self.signum == signal.SIGINT else signal.Signals(self.signum).name

    def _handler(self, signum, frame):
        first = self.signum is None
        if first:
            self.signum = signum
        if first and self._depth > 0:
            print(f"\n{self.name}: stopping after the current step (again to stop at once)",
                  file=sys.stderr, flush=True)
            return
        raise RunInterrupted(self.signum)

    def __enter__(self) -> "Interrupts":
        for sig in EXIT_CODES:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def deferred(self):
        interrupts = self

        class _Deferred:
            def __enter__(self):
                interrupts._depth += 1
                if interrupts.requested:  # a signal came just before
                    raise RunInterrupted(interrupts.signum)

            def __exit__(self, *exc):
                interrupts._depth -= 1

        return _Deferred()


def quiet_tensorflow(verbose: bool) -> None:
    """Raises TensorFlow's C++ log level (unless `verbose` or the user set
    ``TF_CPP_MIN_LOG_LEVEL``) and imports TensorFlow with file descriptor 2
    pointed at /dev/null, which hides the lines its libraries print while they
    load (before any log level applies: oneDNN, CUDA probing).  Import errors
    still surface as Python exceptions."""
    if verbose or "tensorflow" in sys.modules:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        import tensorflow  # noqa: F401
    finally:
        os.dup2(saved, 2)
        os.close(saved)


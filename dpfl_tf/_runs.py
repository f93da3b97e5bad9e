"""What the `dpfl-tf` commands that train share: output paths checked before any
data is loaded, results written atomically as the run goes (with a `status`),
Ctrl-C / SIGTERM turned into a clean stop, a quiet TensorFlow start-up, and the
life cycle of one run of a command (`run_command`: run, results, interrupts,
failures, the resume command and the summary), written once for `train` and
`federated`.

Nothing here imports TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from typing import Any, Callable

__all__ = [
    "counted",
    "check_run_outputs",
    "peak_rss_mb",
    "die_with_parent",
    "running",
    "result_status",
    "check_output_file",
    "check_output_dir",
    "resolve_output",
    "ResultsFile",
    "Interrupts",
    "RunInterrupted",
    "quiet_tensorflow",
    "CommandRun",
    "run_command",
    "RunFailed",
    "STATUSES",
    "FINISHED",
    "EXIT_CODES",
    "DEFAULT_RUNS_DIR",
]


def counted(n, unit: str) -> str:
    """``"1 epoch"``, ``"2.5 epochs"``: `n` `unit` (a plural) in the number it takes."""
    one = isinstance(n, (int, float)) and n == 1
    shown = f"{n:g}" if isinstance(n, float) else n
    return f"{shown} {unit[:-1] if one and unit.endswith('s') else unit}"


#: the values of a results file's ``status``
STATUSES = ("running", "completed", "budget_spent", "interrupted", "failed")
#: statuses of a run that ended: its results file is not overwritten without --overwrite
FINISHED = ("completed", "budget_spent")


def result_status(stop_reason: str | None) -> str:
    """A results file's ``status`` for a finished run's stop reason: ``train``'s
    ("completed", "budget_spent", "interrupted") and the federated server's
    ("privacy budget ...", "interrupted", ...)."""
    if stop_reason == "interrupted":
        return "interrupted"
    if stop_reason == "budget_spent" or (stop_reason or "").startswith("privacy budget"):
        return "budget_spent"
    return "completed"


def peak_rss_mb(usage=None) -> float:
    """Peak resident memory in MiB (``ru_maxrss``, what ``/usr/bin/time -v`` calls
    the maximum resident set size) of this process so far, or of the
    ``resource.struct_rusage`` `usage` (a child's, from ``wait4``)."""
    import resource

    if usage is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)  # bytes / KiB


def die_with_parent(signum: int = signal.SIGTERM, parent: int | None = None) -> None:
    """For ``subprocess.Popen(preexec_fn=...)`` (called in the child, from the
    thread that starts it): the child gets `signum` from the kernel when that
    thread's process ends, however it ends (Linux: prctl PR_SET_PDEATHSIG;
    elsewhere nothing), so a killed parent leaves no child running.  A child
    whose parent (`parent`, by default the one it sees at the call) ended before
    the call exits at once."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid() if parent is None else parent
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # adopted: the parent is gone already
        os._exit(1)


def running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (ended, not yet reaped by
    its parent): Linux's /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"  # the name may hold ") "
    except OSError:
        return False


#: where a command's results go by default (relative to the working directory)
DEFAULT_RUNS_DIR = "runs"
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
        raise ValueError(
            f"{flag} {path}: is a directory; give a file name such as "
            f"{os.path.join(path, 'results.json')}"
        )
    parent = os.path.dirname(os.path.abspath(path))
    try:
        check_output_dir(flag, parent)
    except ValueError as e:
        raise ValueError(str(e).replace(f"{flag} {parent}", f"{flag} {path}", 1)) from None
    return path


def resolve_output(
    flag: str,
    path: str | None,
    default_name: str,
    *,
    overwrite: bool = False,
    resuming: bool = False,
    timed: bool = True,
) -> str:
    """The results file of a run, checked before any data is loaded.

    None: ``runs/<default_name>-<date>-<time>.json`` (a new file for every run,
    so no run's results are lost).  A directory (an existing one, or a path
    ending in a separator) takes ``<default_name>.json`` inside it.  A file
    that holds a finished run (status completed or budget_spent) is refused
    unless `overwrite` (or `resuming` that run's checkpoint).  Missing parents
    are created; raises ValueError naming `flag` and the path.  Not `timed`: the
    default name takes a random token instead of the date and time (a run whose
    duration is secret: the start time in the name and the file's modification
    time would give it)."""
    if path is None:
        stamp = time.strftime("%Y%m%d-%H%M%S") if timed else secrets.token_hex(4)
        path = os.path.join(DEFAULT_RUNS_DIR, f"{default_name}-{stamp}.json")
        n = 1
        while os.path.exists(path):
            n += 1
            path = os.path.join(DEFAULT_RUNS_DIR, f"{default_name}-{stamp}-{n}.json")
    elif os.fspath(path).endswith(("/", os.sep)) or os.path.isdir(path):
        check_output_dir(flag, path)
        path = os.path.join(path, default_name + ".json")
    path = check_output_file(flag, path)
    if os.path.isfile(path) and not (overwrite or resuming):
        try:
            with open(path) as f:
                status = json.load(f).get("status")
        except (OSError, ValueError, AttributeError):
            status = None
        if status in FINISHED:
            raise ValueError(
                f"{flag} {path} holds the results of a finished run (status "
                f"{status}); pass --overwrite to replace them, or another "
                f"{flag}"
            )
    return path


def check_run_outputs(args, default_name: str, *, timed: bool = True) -> None:
    """A command's outputs before any data is loaded (``ValueError`` names the
    flag): ``args.output`` resolved (`resolve_output`; a checkpoint directory that
    holds a run means a resume) and ``args.checkpoint_dir`` writable."""
    checkpoint = getattr(args, "checkpoint_dir", None)
    resuming = checkpoint is not None and os.path.isdir(checkpoint) and bool(os.listdir(checkpoint))
    args.output = resolve_output(
        "--output",
        args.output,
        default_name,
        overwrite=getattr(args, "overwrite", False),
        resuming=resuming,
        timed=timed,
    )
    if checkpoint is not None:
        check_output_dir("--checkpoint-dir", checkpoint)


class ResultsFile:
    """A results JSON rewritten atomically whenever the run has something new:
    ``{"status": ..., <everything measured so far>, "updated": <time>}`` (no
    ``updated`` if not `timed`).  Nothing is written before the first `write` (a
    run refused at the start leaves no file)."""

    def __init__(self, path: str, timed: bool = True):
        self.path = path
        self.timed = timed
        self.written = False
        self.last: dict | None = None

    def write(self, status: str, result: dict, **extra: Any) -> dict:
        from dpfl_tf._io import atomic_write_json

        if status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {status!r}")
        data = {
            "status": status,
            **extra,
            **{k: v for k, v in result.items() if k not in ("status",)},
        }
        if self.timed:
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
            print(
                f"\n{self.name}: stopping after the current step (again to stop at once)",
                file=sys.stderr,
                flush=True,
            )
            return
        self._raise(frame)

    def _raise(self, frame) -> None:
        """Raises `RunInterrupted` -- but not inside a finalizer (``__del__``, run by
        the garbage collector at any point), where Python prints "Exception
        ignored in ..." and drops it: there, again in 10 ms (SIGALRM)."""
        if _in_finalizer(frame):
            signal.signal(signal.SIGALRM, lambda s, f: self._raise(f))
            signal.setitimer(signal.ITIMER_REAL, 0.01)
            return
        raise RunInterrupted(self.signum)

    def __enter__(self) -> "Interrupts":
        for sig in (*EXIT_CODES, signal.SIGALRM):
            self._previous[sig] = signal.getsignal(sig)
        for sig in EXIT_CODES:
            signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
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


def _in_finalizer(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            return True
        frame = frame.f_back
    return False


def quiet_tensorflow(verbose: bool) -> None:
    """Raises TensorFlow's C++ log level (unless `verbose` or the user set
    ``TF_CPP_MIN_LOG_LEVEL``), hides absl's and TensorFlow's Python warnings
    (``-v`` shows them), and imports TensorFlow with file descriptor 2
    pointed at /dev/null, which hides the lines its libraries print while they
    load (before any log level applies: oneDNN, CUDA probing).  Import errors
    still surface as Python exceptions."""
    if verbose:
        return
    import logging

    # Python-side warnings of absl (dp_accounting's RDP orders) and TensorFlow
    for name in ("absl", "tensorflow"):
        logging.getLogger(name).setLevel(logging.ERROR)
    if "tensorflow" in sys.modules:
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


# ------------------------------------------------------------------ one run of a command


def _done(result: dict | None, unit: str, otherwise: str) -> str:
    """What a run did before it stopped: "3 epochs", or `otherwise` when its
    results do not count `unit`."""
    value = (result or {}).get(unit)
    return otherwise if value is None else counted(value, unit)


class RunFailed(Exception):
    """A run that failed after it started, with what was kept (exit code 1)."""


@dataclasses.dataclass
class CommandRun:
    """One run of a `dpfl-tf` command, as `run_command` drives it.

    run(checkpoint_dir=, checkpoint_every=, should_stop=, on_progress=,
      on_resume=) -> result: the work; `on_progress(result so far)` after
      every epoch / round, `should_stop()` polled, `on_resume(info)` once when
      it resumes from `checkpoint_dir`.  A ValueError or FileNotFoundError
      before anything was measured is a refusal (one line, exit code 2).
    unit: what `result[unit]` counts ("epochs", "rounds").
    status: the results file's status of a finished result.
    resumed: the line printed on resuming (from the info).
    progress: "after ..." of an interrupted result (lots, epsilon).
    summary: the lines printed at the end of a run.
    figure(result, path) -> bool: draws the figure (False: nothing to draw).
    resumable: False for a run that cannot be resumed (a private search: its
      budget is charged in full when it starts); `not_resumable` says why, in
      the message of an interrupted run.
    timed: False for a run whose duration is secret (a search with a random
      number of trials): its results carry no time.
    """

    command: str
    argv: list
    output: str
    checkpoint_dir: str | None
    unit: str
    run: Callable[..., dict]
    status: Callable[[dict], str]
    resumed: Callable[[dict], str]
    progress: Callable[[dict], str]
    summary: Callable[[dict], list]
    figure: Callable[[dict, str], bool] | None = None
    resumable: bool = True
    not_resumable: str = "this run cannot be resumed"
    timed: bool = True

    @property
    def checkpoint(self) -> str:
        """Where checkpoints go: --checkpoint-dir, else beside the results."""
        return self.checkpoint_dir or os.path.splitext(self.output)[0] + ".checkpoint"

    def resume_command(self) -> str:
        """The command line that resumes this run (its output and checkpoint named)."""
        import shlex

        argv = list(self.argv)
        for flag, value in (("--output", self.output), ("--checkpoint-dir", self.checkpoint)):
            if flag not in argv and not any(a.startswith(flag + "=") for a in argv):
                argv += [flag, value]
        return "dpfl-tf " + " ".join(shlex.quote(str(a)) for a in argv)


def run_command(run: CommandRun, refuse: Callable[[str], None]) -> int:
    """Runs `run.run`, writing the results after every epoch / round, and
    prints the summary.  Ctrl-C / SIGTERM stop after the current step: results
    marked interrupted, a checkpoint, the command that resumes, exit code
    130 / 143 (a second signal stops at once).  A failure after the first
    results keeps them (status failed, exit code 1); before, `refuse(message)`
    (one line, exit code 2).  Returns the exit code."""
    import gc

    out, unit = run.output, run.unit
    results = ResultsFile(out, timed=run.timed)
    figure = os.path.splitext(out)[0] + ".png"
    checkpoint = run.checkpoint
    with Interrupts() as interrupts:
        try:
            with interrupts.deferred():
                result = run.run(
                    checkpoint_dir=checkpoint,
                    checkpoint_every=run.checkpoint_dir is not None,
                    should_stop=lambda: interrupts.requested,
                    on_progress=lambda r: results.write("running", r),
                    on_resume=lambda info: print(run.resumed(info), flush=True),
                )
        except RunInterrupted:
            kept = (
                f"results of {_done(results.last, unit, 'the run so far')} in {out}"
                if results.written
                else "nothing measured yet"
            )
            results.write("interrupted", results.last or {"command": run.resume_command()})
            resumable = os.path.isdir(checkpoint) and bool(os.listdir(checkpoint))
            how = (
                f"; resume with: {run.resume_command()}"
                if resumable
                else "; no checkpoint was written yet: run the command again"
            )
            if not run.resumable:
                how = f"; {run.not_resumable}"
            print(
                f"\ninterrupted ({interrupts.name}): kept {kept} (status interrupted){how}",
                file=sys.stderr,
            )
            return interrupts.exit_code
        except Exception as e:
            from dpfl_tf.privacy.ledger import BudgetExceededError

            message = getattr(e, "cli_message", None) or str(e)
            if not isinstance(e, (ValueError, FileNotFoundError, BudgetExceededError)):
                if results.written:
                    results.write("failed", results.last, error=f"{type(e).__name__}: {e}")
                raise
            if not results.written:
                refuse(message)  # nothing ran: a refusal
                return 2
            results.write("failed", results.last, error=message)
            print(
                f"dpfl-tf {run.command}: failed after {_done(results.last, unit, 'it started')}: "
                f"{message}; results so far in {out} (status failed)",
                file=sys.stderr,
            )
            return 1
    gc.collect()  # finalise tf.data's generator iterators now, not at interpreter exit
    status = run.status(result)
    results.write(status, result)
    drew = run.figure(result, figure) if run.figure is not None else False
    if status == "interrupted" and not run.resumable:
        print(
            f"\ninterrupted ({interrupts.name}): results in {out} (status interrupted); "
            f"{run.not_resumable}",
            file=sys.stderr,
        )
        return interrupts.exit_code
    if status == "interrupted":
        print(
            f"\ninterrupted ({interrupts.name}) {run.progress(result)}: results in {out} "
            f"(status interrupted), checkpoint in {checkpoint}; resume with: "
            f"{run.resume_command()}",
            file=sys.stderr,
        )
        return interrupts.exit_code
    for line in run.summary(result):
        print(line)
    print(f"results: {out}" + (f"  figure: {figure}" if drew else ""))
    return 0

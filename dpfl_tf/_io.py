"""Atomic file writes: a crash or an error never leaves half a file behind."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike, suffix: str = ".tmp", mode: int | None = None
) -> Iterator[str]:
    """Yields a temporary path beside `path`; when the block succeeds the file
    is synced and renamed into place, when it fails it is removed.  The file
    gets `mode`, or the usual 0666 & ~umask; with a `mode`, it never has any
    other (the temporary file is created 0600 and keeps it until the rename)."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        dir=directory, prefix="." + os.path.basename(path) + ".", suffix=suffix
    )
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, (0o666 & ~_umask()) if mode is None else mode)  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write(
    path: str | os.PathLike, write: Callable[[Any], None], binary: bool = False
) -> None:
    """Calls `write(file)` on a temporary file beside `path`, then renames it into place."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb" if binary else "w") as f:
            write(f)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda f: f.write(text))


def atomic_write_json(path: str | os.PathLike, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False, default=_default) + "\n")


def read_checkpoint_json(path: str | os.PathLike) -> Any | None:
    """The JSON in a checkpoint's state file, None if the file is missing; a
    damaged file is named in the error (with what to do)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path} is damaged (not valid JSON: {e}); delete the checkpoint "
            "directory or use another one"
        ) from None


def merge_json_runs(
    path: str | os.PathLike, runs: list[dict], key: Callable[[dict], Any]
) -> list[dict]:
    """Writes `runs` into the JSON list at `path` (atomically), replacing the
    runs already there with the same `key` and keeping every other one.
    Returns the merged list.  An exclusive lock on ``path + ".lock"`` makes
    the read-merge-write safe between experiment processes sharing a file."""
    import fcntl

    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # as atomic writes do
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        previous = []
        if os.path.exists(path):
            with open(path) as f:
                previous = json.load(f)
        new_keys = {key(r) for r in runs}
        merged = [r for r in previous if key(r) not in new_keys] + list(runs)
        atomic_write_json(path, merged)
    return merged


def _default(obj: Any):
    """JSON for numpy scalars and enums."""
    if hasattr(obj, "item"):
        return obj.item()
    if hasattr(obj, "value"):
        return obj.value
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

"""Results files: merged run by run, under a lock, into directories made on demand;
files written atomically, with the mode asked for."""

import json
import os

import pytest

from dpfl_tf._io import atomic_path, merge_json_runs


def test_merge_replaces_runs_with_the_same_key_and_keeps_the_others(tmp_path):
    path = tmp_path / "not" / "yet" / "results.json"  # the directory does not exist yet
    key = lambda r: r["run"]  # noqa: E731
    merge_json_runs(path, [{"run": "a", "acc": 1}, {"run": "b", "acc": 2}], key)
    merged = merge_json_runs(path, [{"run": "b", "acc": 3}, {"run": "c", "acc": 4}], key)
    assert merged == [{"run": "a", "acc": 1}, {"run": "b", "acc": 3}, {"run": "c", "acc": 4}]
    assert json.loads(path.read_text()) == merged


def _mode(path):
    return os.stat(path).st_mode & 0o777


def test_an_atomic_file_with_a_mode_is_never_readable_by_others(tmp_path):
    path = tmp_path / "private.npy"
    old = os.umask(0o022)
    try:
        with atomic_path(path, mode=0o600) as tmp:
            open(tmp, "wb").write(b"derived from private data")
            assert _mode(tmp) == 0o600  # while it is being written
        assert _mode(path) == 0o600
        with atomic_path(tmp_path / "public.json") as tmp:
            open(tmp, "w").write("{}")
        assert _mode(tmp_path / "public.json") == 0o644  # the usual 0666 & ~umask
    finally:
        os.umask(old)


def test_a_failed_atomic_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "f", mode=0o600) as tmp:
            open(tmp, "w").write("half")
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []

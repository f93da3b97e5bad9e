"""Results files: merged run by run, under a lock, into directories made on demand."""

import json

from dpfl_tf._io import merge_json_runs


def test_merge_replaces_runs_with_the_same_key_and_keeps_the_others(tmp_path):
    path = tmp_path / "not" / "yet" / "results.json"   # the directory does not exist yet
    key = lambda r: r["run"]  # noqa: E731
    merge_json_runs(path, [{"run": "a", "acc": 1}, {"run": "b", "acc": 2}], key)
    merged = merge_json_runs(path, [{"run": "b", "acc": 3}, {"run": "c", "acc": 4}], key)
    assert merged == [{"run": "a", "acc": 1}, {"run": "b", "acc": 3}, {"run": "c", "acc": 4}]
    assert json.loads(path.read_text()) == merged

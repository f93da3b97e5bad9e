"""experiments/benchmark_layers.py and its Opacus and tensorflow-privacy peers
measure the same thing: the same architecture constants and the same data; the
issue-16 checks say "MISSED" for a missed target; rows of frameworks a run does
not measure are kept from the earlier file.  No TensorFlow or PyTorch here (the
peer runs are stubbed)."""

import importlib.util
import json
import pathlib
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(relative, name):
    """The script as a module, its directory first on sys.path as when it runs
    (for experiments/_common.py and experiments/peers/_peer_common.py)."""
    folder = str((ROOT / relative).parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ours = _load("experiments/benchmark_layers.py", "benchmark_layers")
peer = _load("experiments/peers/opacus_layers.py", "opacus_layers")
tfp = _load("experiments/peers/tfp_layers.py", "tfp_layers")

ARCHITECTURE = (
    "VOCAB",
    "SEQ_LEN",
    "WIDTH",
    "HEADS",
    "FFN",
    "BLOCKS",
    "CONV_FILTERS",
    "CONV_KERNEL",
    "CONV_STRIDE",
    "CONV_DENSE",
    "LSTM_UNITS",
    "RESNET_STAGES",
    "RESNET_BLOCKS",
    "GN_GROUPS",
    "IMAGE",
    "TEXT_CLASSES",
    "IMAGE_CLASSES",
)


def test_same_architecture_and_settings():
    for name in ARCHITECTURE:
        assert getattr(ours, name) == getattr(peer, name), name
    assert ours.MODELS == peer.MODELS
    assert (ours.CLIP, ours.NOISE, ours.LR) == (
        peer.L2_NORM_CLIP,
        peer.NOISE_MULTIPLIER,
        peer.LEARNING_RATE,
    )
    np.testing.assert_array_equal(ours._positions(), peer.positions())


def test_tfp_peer_same_transformer_and_settings():
    for name in ("VOCAB", "SEQ_LEN", "WIDTH", "HEADS", "FFN", "BLOCKS", "TEXT_CLASSES"):
        assert getattr(ours, name) == getattr(tfp, name), name
    assert tfp.MODELS == ours.TFP_MODELS == ("transformer",)
    assert set(ours.TFP_UNREGISTERED) == set(ours.MODELS) - set(ours.TFP_MODELS)
    assert (ours.CLIP, ours.NOISE, ours.LR) == (
        tfp.L2_NORM_CLIP,
        tfp.NOISE_MULTIPLIER,
        tfp.LEARNING_RATE,
    )
    np.testing.assert_array_equal(ours._positions(), tfp.positions())
    x, y = ours.make_data("transformer", 64)
    tx, ty, _ = tfp.make_data("transformer", 64)
    np.testing.assert_array_equal(x, tx)
    np.testing.assert_array_equal(y, ty)
    assert tx.dtype == x.dtype  # int32 token ids, as the Keras model's input


@pytest.mark.parametrize("model", ["transformer", "resnet20_gn"])
def test_same_data(model):
    x, y = ours.make_data(model, 64)
    px, py, _ = peer.make_data(model, 64)
    np.testing.assert_array_equal(y, py)
    if model == "resnet20_gn":
        np.testing.assert_array_equal(x.transpose(0, 3, 1, 2), px)  # NHWC -> NCHW
    else:
        np.testing.assert_array_equal(x, px)
        assert x.min() >= 1 and x.max() < ours.VOCAB  # id 0 (padding) never drawn


def test_checks_name_missed_targets():
    rows = [
        {
            "model": "lstm",
            "implementation": "dpfl_tf",
            "ratio_to_nonprivate": 5.0,
            "memory_ratio_to_nonprivate": 1.5,
            "settings": {"trainable_parameters": 10},
        },
        {"model": "lstm", "implementation": "opacus_ghost", "ratio_to_nonprivate": 6.0},
        {
            "model": "lstm",
            "implementation": "tfp_fast_clipping",
            "ratio_to_nonprivate": None,
            "not_run": "not run: LSTM not in ...",
        },
        {"model": "transformer", "implementation": "dpfl_tf", "ratio_to_nonprivate": None},
        {"model": "transformer", "implementation": "tfp_fast_clipping", "ratio_to_nonprivate": 2.5},
    ]
    checks = ours._checks(rows)
    assert checks["lstm"]["time_ok"] is False and checks["lstm"]["memory_ok"] is True
    assert checks["lstm"]["below_opacus_ghost"] is True
    assert checks["lstm"]["below_tfp_fast_clipping"] is None  # not run is not a comparison
    assert checks["transformer"]["tfp_fast_clipping_ratio"] == 2.5
    assert checks["transformer"]["below_tfp_fast_clipping"] is None  # ours failed
    assert checks["lstm"]["trainable_parameters"] == {"dpfl_tf": 10}
    assert checks["transformer"]["time_ok"] is None  # a failed run is not a pass
    assert checks["transformer"]["below_opacus_ghost"] is None


def test_peer_partial_epochs_are_validated():
    base = ["--model", "lstm", "--implementation", "opacus_ghost", "--output", "x.json"]
    assert peer.parse_args(base + ["--max-steps", "20"]).max_steps == 20
    assert peer.parse_args(base).max_steps == 0  # whole epochs by default
    with pytest.raises(SystemExit):
        peer.parse_args(base + ["--max-steps", "-1"])
    with pytest.raises(SystemExit):  # nothing to run
        ours.main(["--skip-ours", "--skip-peers", "--output", "unused.json"])
    with pytest.raises(SystemExit):  # no earlier rows of ours to reuse
        ours.main(["--skip-ours", "--output", str(ROOT / "results" / "no_such_file.json")])
    with pytest.raises(SystemExit):  # peers' rows are reused only when peers are skipped
        ours.main(["--reuse-peers", "--output", "unused.json"])
    with pytest.raises(SystemExit):  # no earlier peer rows to reuse
        ours.main(
            [
                "--skip-peers",
                "--reuse-peers",
                "--output",
                str(ROOT / "results" / "no_such_file.json"),
            ]
        )


def test_tfp_peer_options_are_validated():
    base = ["--model", "transformer", "--implementation", "fast_clipping", "--output", "x.json"]
    args = tfp.parse_args(base + ["--max-steps", "20"])
    assert args.max_steps == 20 and args.xla is None  # each library's own XLA default
    assert tfp.parse_args(base + ["--no-xla"]).xla is False
    assert tfp.parse_args(base).max_steps == 0  # whole epochs by default
    for bad in (
        ["--max-steps", "-1"],
        ["--epochs", "1"],
        ["--norm-check", "-1"],
        ["--lot-size", "300", "--examples", "200"],
    ):
        with pytest.raises(SystemExit):
            tfp.parse_args(base + bad)
    with pytest.raises(SystemExit):  # only the transformer's layers are all in its registry
        tfp.parse_args(
            ["--model", "lstm", "--implementation", "fast_clipping", "--output", "x.json"]
        )
    with pytest.raises(SystemExit):
        ours.main(["--peers", "jax_privacy", "--output", "unused.json"])


def _earlier_report(path):
    def row(model, impl, framework, seconds, **extra):
        return {
            "model": model,
            "implementation": impl,
            "framework": framework,
            "seconds_per_epoch": seconds,
            "peak_memory_mb": 1000.0,
            **extra,
        }

    rows = [
        row("transformer", "keras_nonprivate", "keras", 10.0),
        row("transformer", "dpfl_tf", "keras", 12.0, ratio_to_nonprivate=1.2),
        row("transformer", "opacus_nonprivate", "pytorch", 20.0),
        row("transformer", "opacus_ghost", "pytorch", 40.0, ratio_to_nonprivate=2.0),
        row("transformer", "tfp_nonprivate", "keras 2", 30.0),
        row("transformer", "tfp_fast_clipping", "keras 2", 90.0, ratio_to_nonprivate=3.0),
        row("lstm", "keras_nonprivate", "keras", 10.0),
        row("lstm", "tfp_fast_clipping", "keras 2", None, not_run="old reason"),
    ]
    path.write_text(json.dumps({"command": "earlier run", "rows": rows}))


def test_skip_ours_runs_only_the_chosen_peer_and_keeps_the_other_rows(tmp_path, monkeypatch):
    output = tmp_path / "layers.json"
    _earlier_report(output)
    commands = []

    def fake_run(cmd, timeout):  # the peer environment is not needed here
        commands.append(cmd)
        impl = cmd[cmd.index("--implementation") + 1]
        return {
            "seconds_per_epoch": 40.0 if impl == "nonprivate" else 100.0,
            "peak_memory_mb": 900.0 if impl == "nonprivate" else 1800.0,
            "library": "tensorflow-privacy",
            "settings": {"trainable_parameters": 2825218},
        }

    monkeypatch.setattr(ours, "run_child", fake_run)
    rows = ours.main(
        [
            "--skip-ours",
            "--peers",
            "tfp",
            "--models",
            "transformer",
            "lstm",
            "--tfp-python",
            sys.executable,
            "--opacus-python",
            "/no/such/python",
            "--output",
            str(output),
            "--figure",
            str(tmp_path / "layers.png"),
        ]
    )
    # tensorflow-privacy runs for the transformer only, whole epochs, in its interpreter
    assert [c[0] for c in commands] == [sys.executable] * 2
    assert all(c[1].endswith("tfp_layers.py") and "--max-steps" not in c for c in commands)
    assert [c[c.index("--model") + 1] for c in commands] == ["transformer"] * 2
    by = {(r["model"], r["implementation"]): r for r in rows}
    fast = by["transformer", "tfp_fast_clipping"]
    assert fast["framework"] == "keras 2" and "reused_from" not in fast
    assert fast["ratio_to_nonprivate"] == pytest.approx(100.0 / 40.0)  # same framework
    assert fast["memory_ratio_to_nonprivate"] == pytest.approx(2.0)
    assert fast["ratio_to_keras"] == pytest.approx(100.0 / 10.0)
    # ours and the peer left out (Opacus) are kept from the earlier file, marked
    for key in [
        ("transformer", "dpfl_tf"),
        ("transformer", "opacus_ghost"),
        ("lstm", "keras_nonprivate"),
    ]:
        assert by[key]["reused_from"] == "earlier run"
    # the earlier tensorflow-privacy rows are replaced, not duplicated
    assert sum(r["implementation"] == "tfp_fast_clipping" for r in rows) == 2
    assert by["lstm", "tfp_fast_clipping"]["not_run"].startswith("not run: LSTM not in")
    report = json.loads(output.read_text())
    assert report["checks"]["transformer"]["tfp_fast_clipping_ratio"] == pytest.approx(2.5)


def test_reuse_peers_keeps_both_peers_rows(tmp_path, monkeypatch):
    output = tmp_path / "layers.json"
    _earlier_report(output)
    commands = []

    def fake_run(cmd, timeout):  # our worker, stubbed
        commands.append(cmd)
        return {"seconds_per_epoch": 11.0, "peak_memory_mb": 1000.0}

    monkeypatch.setattr(ours, "run_child", fake_run)
    rows = ours.main(
        [
            "--skip-peers",
            "--reuse-peers",
            "--models",
            "transformer",
            "--output",
            str(output),
            "--figure",
            str(tmp_path / "layers.png"),
        ]
    )
    assert all(c[1].endswith("benchmark_layers.py") for c in commands)
    reused = {r["implementation"] for r in rows if r.get("reused_from") == "earlier run"}
    assert reused == {"opacus_nonprivate", "opacus_ghost", "tfp_nonprivate", "tfp_fast_clipping"}
    assert {r["implementation"] for r in rows if r["framework"] == "keras"} == {
        "keras_nonprivate",
        "dpfl_tf",
    }
    assert all("reused_from" not in r for r in rows if r["framework"] == "keras")


def test_figure_says_not_run_for_a_peer_without_the_layers_and_failed_for_a_failure(
    tmp_path, monkeypatch
):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    labels = []
    annotate = Axes.annotate
    monkeypatch.setattr(
        Axes,
        "annotate",
        lambda self, text, *a, **k: labels.append(text) or annotate(self, text, *a, **k),
    )
    rows = [
        {
            "model": "lstm",
            "implementation": "dpfl_tf",
            "ratio_to_nonprivate": 1.5,
            "memory_ratio_to_nonprivate": 1.6,
        },
        {
            "model": "lstm",
            "implementation": "tfp_fast_clipping",
            "ratio_to_nonprivate": None,
            "memory_ratio_to_nonprivate": None,
            "not_run": "not run: LSTM not in ...",
        },
        {
            "model": "lstm",
            "implementation": "opacus_ghost",
            "ratio_to_nonprivate": None,
            "memory_ratio_to_nonprivate": None,
            "error": "killed",
        },
    ]
    assert ours.plot(rows, str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").exists()
    # time and memory panels: dpfl_tf's values, opacus_ghost failed, tfp not run
    assert sorted(labels) == sorted(["1.5", "1.6", "failed", "failed", "not run", "not run"])

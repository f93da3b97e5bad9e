"""experiments/benchmark_layers.py and its Opacus peer measure the same thing:
the same architecture constants and the same data; the issue-16 checks say
"MISSED" for a missed target.  No TensorFlow or PyTorch here."""

import importlib.util
import pathlib

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load(relative, name):
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ours = _load("experiments/benchmark_layers.py", "benchmark_layers")
peer = _load("experiments/peers/opacus_layers.py", "opacus_layers")

ARCHITECTURE = ("VOCAB", "SEQ_LEN", "WIDTH", "HEADS", "FFN", "BLOCKS", "CONV_FILTERS",
                "CONV_KERNEL", "CONV_STRIDE", "CONV_DENSE", "LSTM_UNITS", "RESNET_STAGES",
                "RESNET_BLOCKS", "GN_GROUPS", "IMAGE", "TEXT_CLASSES", "IMAGE_CLASSES")


def test_same_architecture_and_settings():
    for name in ARCHITECTURE:
        assert getattr(ours, name) == getattr(peer, name), name
    assert ours.MODELS == peer.MODELS
    assert (ours.CLIP, ours.NOISE, ours.LR) == (peer.L2_NORM_CLIP, peer.NOISE_MULTIPLIER,
                                                 peer.LEARNING_RATE)
    np.testing.assert_array_equal(ours._positions(), peer.positions())


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
    rows = [{"model": "lstm", "implementation": "dpfl_tf", "ratio_to_nonprivate": 5.0,
             "memory_ratio_to_nonprivate": 1.5, "settings": {"trainable_parameters": 10}},
            {"model": "lstm", "implementation": "opacus_ghost", "ratio_to_nonprivate": 6.0},
            {"model": "transformer", "implementation": "dpfl_tf", "ratio_to_nonprivate": None}]
    checks = ours._checks(rows)
    assert checks["lstm"]["time_ok"] is False and checks["lstm"]["memory_ok"] is True
    assert checks["lstm"]["below_opacus_ghost"] is True
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
        ours.main(["--skip-peers", "--reuse-peers",
                   "--output", str(ROOT / "results" / "no_such_file.json")])

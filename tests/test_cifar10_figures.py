"""The ScatterNet privacy-utility figure of experiments/cifar10_dpsgd.py: drawn
from whatever runs the results file holds, one line per model, Tramer & Boneh's
points at what our accountant says their mechanism spends."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))

import cifar10_dpsgd  # noqa: E402

LINEAR, CNN = "linear (on ScatterNet features)", "CNN (on ScatterNet features)"
LINEAR_MIRROR = LINEAR + ", mirror views"


def _run(head, name, eps, acc):
    mirror = "mirror/" if head.endswith("mirror views") else ""
    return {
        "run": f"scatternet/{head.split()[0].lower()}/{mirror}{name}",
        "trained_layers": head,
        "lot_size": 8192,
        "target_epsilon": 3.0 if name.startswith("tb_") else eps,
        "epsilon": eps * 0.999,
        "delta": 1e-5,
        "accountant": "pld",
        "test_accuracy": acc,
        "dataset": "CIFAR-10 (JPEG copy)",
        "pretraining": "none",
        "history": [
            {"epoch": 1, "test_accuracy": acc / 2, "epsilon": eps / 3},
            {"epoch": 2, "test_accuracy": acc, "epsilon": eps * 0.999},
        ],
    }


def _runs():
    return [
        _run(LINEAR, "eps3", 3, 0.65),
        _run(LINEAR, "eps1", 1, 0.58),
        _run(LINEAR, "tb_sigma5.67", 2.38, 0.64),
        _run(CNN, "eps3", 3, 0.67),
        _run(CNN, "eps3/lr8", 3, 0.10),
        _run(LINEAR_MIRROR, "eps3", 3, 0.673),
        _run(LINEAR_MIRROR, "tb_sigma5.67", 2.38, 0.67),
    ]


def test_points_separate_calibrated_runs_their_noise_and_their_result():
    points = cifar10_dpsgd.privacy_utility_points(_runs())
    assert points[LINEAR]["ours"] == [(0.999, 0.58), (2.997, 0.65)]
    assert points[LINEAR]["ours_tb_noise"] == [(2.38 * 0.999, 0.64)]
    assert points[CNN]["ours"] == [(2.997, 0.67)]  # the lr trial is left out
    # mirror views: a line of its own; their point belongs to their recipe's line
    assert points[LINEAR_MIRROR]["ours"] == [(2.997, 0.673)]
    assert points[LINEAR_MIRROR]["ours_tb_noise"] == [(2.38 * 0.999, 0.67)]
    assert points[LINEAR_MIRROR]["tramer_boneh"] == []
    ((eps_lin, acc_lin),) = points[LINEAR]["tramer_boneh"]
    ((eps_cnn, acc_cnn),) = points[CNN]["tramer_boneh"]
    assert (acc_lin, acc_cnn) == (0.670, 0.693)
    # their sigma 5.67 after two sigma-8 releases: 3.0 by their 2020 RDP accounting,
    # less by ours
    assert eps_lin == eps_cnn == pytest.approx(2.38, abs=0.01)
    assert cifar10_dpsgd.tramer_boneh_epsilon("rdp") == pytest.approx(2.59, abs=0.01)


def test_scatternet_runs_give_both_figures(tmp_path):
    written = cifar10_dpsgd.draw_all(_runs(), str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == [
        "cifar10_scatternet.png",
        "cifar10_scatternet_curve.png",
    ]
    assert all(os.path.getsize(p) > 10_000 for p in written)


def test_their_noise_is_a_run_of_its_own():
    runs = cifar10_dpsgd.scatternet_runs()
    theirs, calibrated = runs["scatternet/linear/tb_sigma5.67"], runs["scatternet/linear/eps3"]
    assert theirs.noise_multiplier == 5.67 and calibrated.noise_multiplier is None
    assert (theirs.lot_size, theirs.epochs, theirs.feature_norm, theirs.learning_rate) == (
        calibrated.lot_size,
        calibrated.epochs,
        calibrated.feature_norm,
        calibrated.learning_rate,
    )

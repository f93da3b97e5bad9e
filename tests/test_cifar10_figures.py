"""The ScatterNet privacy-utility figure of experiments/cifar10_dpsgd.py: drawn
from whatever runs the results file holds, one line per model."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))

import cifar10_dpsgd  # noqa: E402


def _run(head, eps, acc):
    return {"run": f"scatternet/{head}/eps{eps}", "trained_layers": head, "lot_size": 8192,
            "target_epsilon": eps, "epsilon": eps * 0.999, "delta": 1e-5,
            "test_accuracy": acc, "dataset": "CIFAR-10 (JPEG copy)", "pretraining": "none",
            "history": [{"epoch": 1, "test_accuracy": acc / 2, "epsilon": eps / 3},
                        {"epoch": 2, "test_accuracy": acc, "epsilon": eps * 0.999}]}


def test_scatternet_runs_give_the_privacy_utility_curve(tmp_path):
    runs = [_run("linear (on ScatterNet features)", e, a) for e, a in ((1, .58), (3, .65))]
    runs += [_run("CNN (on ScatterNet features)", 3, .67),
             {"run": "scatternet/cnn/eps3/lr8", "trained_layers": "CNN", "history": [{}]}]
    written = cifar10_dpsgd.draw_all(runs, str(tmp_path))
    assert sorted(os.path.basename(p) for p in written) == [
        "cifar10_scatternet.png", "cifar10_scatternet_curve.png"]
    assert all(os.path.getsize(p) > 10_000 for p in written)

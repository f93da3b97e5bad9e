"""dpfl_tf.plotting never changes matplotlib's backend and saves through Agg."""

import importlib
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_importing_plotting_keeps_the_backend():
    code = (
        "import matplotlib; matplotlib.use('svg'); import dpfl_tf.plotting, dpfl_tf.cli; "
        "import matplotlib.pyplot as plt; print(matplotlib.get_backend())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "svg"
    assert "matplotlib.use(" not in (ROOT / "dpfl_tf" / "plotting.py").read_text()


def test_save_figure_writes_a_png_of_a_bare_figure(tmp_path):
    from matplotlib.figure import Figure

    plotting = importlib.import_module("dpfl_tf.plotting")
    fig = Figure()
    rounds = [{"round": t, "accuracy": 0.1 * t, "epsilon": 0.5 * t} for t in (1, 2, 3)]
    ax_acc, ax_eps = plotting.plot_federated_rounds(
        [
            {"mechanism": "global_dp", "history": rounds},
            {"mechanism": "fedavg", "history": [{**r, "epsilon": None} for r in rounds]},
        ],
        *fig.subplots(1, 2),
    )
    assert [line.get_label() for line in ax_acc.lines] == ["global_dp", "fedavg"]
    assert [line.get_label() for line in ax_eps.lines] == ["global_dp"]
    assert "fedavg: no DP, epsilon = inf" in ax_eps.get_title()
    plotting.save_figure(fig, tmp_path / "f.png")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plotting.new_axes().figure.canvas.manager is None  # not registered with pyplot


def _training_figure(monkeypatch, result, tmp_path):
    """What `dpfl-tf train` draws for `result`: (drawn?, the figure or None)."""
    from dpfl_tf import cli, plotting

    saved = []
    monkeypatch.setattr(plotting, "save_figure", lambda fig, path: saved.append(fig))
    drawn = cli._save_training_figure(result, str(tmp_path / "run.png"))
    return drawn, (saved[0] if saved else None)


def test_train_figure_of_one_epoch_shows_a_point_and_names_budget_and_noise(monkeypatch, tmp_path):
    result = {
        "dataset": "mnist",
        "model": "mlp",
        "target_epsilon": 2.0,
        "delta": 1e-5,
        "noise_multiplier": 4.0,
        "history": [{"epoch": 1, "test_accuracy": 0.81, "epsilon": 0.52}],
    }
    drawn, fig = _training_figure(monkeypatch, result, tmp_path)
    assert drawn
    ax = fig.axes[0]
    assert ax.get_title() == "mnist mlp: DP-SGD, target eps 2, delta 1e-05, sigma 4"
    (accuracy,) = [line for line in ax.lines if line.get_label() == "test accuracy"]
    # one evaluated epoch: a line of one point, visible only through its marker
    assert list(accuracy.get_xdata()) == [1] and accuracy.get_marker() not in ("None", "", None)
    (epsilon,) = [line for a in fig.axes[1:] for line in a.lines]
    assert list(epsilon.get_ydata()) == [0.52] and epsilon.get_marker() not in ("None", "", None)


def test_train_figure_is_not_drawn_before_an_evaluated_epoch(monkeypatch, tmp_path):
    result = {
        "dataset": "cifar10",
        "model": None,
        "target_epsilon": 2.0,
        "delta": 1e-5,
        "history": [{"epoch": 1, "epsilon": 0.3}],
    }
    assert _training_figure(monkeypatch, result, tmp_path) == (False, None)

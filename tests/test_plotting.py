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

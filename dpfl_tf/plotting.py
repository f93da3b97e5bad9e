"""Figures shared by experiments, the CLI and notebooks.

Object-oriented matplotlib only: importing this module never changes the global
backend (a notebook keeps its inline backend).  Each ``plot_*`` function draws
on the `ax` it is given; without one it makes a new `matplotlib.figure.Figure`
(not registered with pyplot: show it with ``ax.figure`` or pass an axis from
``plt.subplots``).  `save_figure` writes PNG through `FigureCanvasAgg`.
"""

from __future__ import annotations

__all__ = [
    "plot_epsilon_curves",
    "plot_accuracy_and_epsilon",
    "plot_best_accuracy_vs_epsilon",
    "plot_runs_accuracy_and_epsilon",
    "plot_roc_curves",
    "plot_federated_rounds",
    "new_axes",
    "save_figure",
]


def new_axes(figsize=(5, 3.5)):
    """One axis on a new `Figure` (no pyplot, no backend change)."""
    from matplotlib.figure import Figure

    return Figure(figsize=figsize).add_subplot()


_STYLE = {
    "moments": ("tab:blue", "-", "moments accountant (ours)"),
    "strong": ("tab:red", "--", "strong composition"),
    "rdp": ("tab:green", "-.", "RDP (dp-accounting)"),
    "pld": ("tab:purple", ":", "PLD (dp-accounting)"),
}


def plot_epsilon_curves(curves: dict, ax=None):
    """Epsilon versus epochs, one line per accountant (output of `epsilon_curves`)."""
    if ax is None:
        ax = new_axes((6, 4))
    for name, (color, style, label) in _STYLE.items():
        if name in curves:
            ax.plot(curves["epochs"], curves[name], style, color=color, label=label)
    ax.set_xlabel("epochs")
    ax.set_ylabel("epsilon")
    ax.set_title(
        f"q = {curves['sampling_rate']:g}, sigma = {curves['noise_multiplier']:g}, "
        f"delta = {curves['delta']:g}"
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def save_figure(fig, path) -> None:
    """Saves a figure as PNG atomically (through the Agg canvas, whatever the
    backend) and, if pyplot manages it, closes it."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from dpfl_tf._io import atomic_write

    managed = getattr(fig.canvas, "manager", None) is not None
    try:
        if managed:  # a pyplot figure, maybe on another backend: print via Agg

            def write(f):
                fig.savefig(f, format="png", dpi=120, bbox_inches="tight", backend="agg")
        else:  # a bare Figure: give it the Agg canvas
            canvas = FigureCanvasAgg(fig)

            def write(f):
                canvas.print_figure(f, format="png", dpi=120, bbox_inches="tight")

        atomic_write(path, write, binary=True)
    finally:
        if managed:
            import matplotlib.pyplot as plt

            plt.close(fig)


def plot_federated_rounds(runs, ax_accuracy=None, ax_epsilon=None, title: str = ""):
    """Test accuracy (left) and epsilon (right) per round, one line per run,
    labelled by its mechanism (results of `run_federated` / ``dpfl-tf
    federated``).  Runs without client-level DP have no epsilon line (their
    epsilon is infinite; the panel's title says so; a local-DP run is labelled with
    its per-coordinate epsilon).  The accuracy axis spans [0, 1]."""
    if ax_accuracy is None or ax_epsilon is None:
        from matplotlib.figure import Figure

        ax_accuracy, ax_epsilon = Figure(figsize=(10, 3.8)).subplots(1, 2)
    no_dp = []
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        label = run.get("mechanism", f"run {i + 1}")
        if label.startswith("ldp_") and run.get("epsilon_per_coordinate") is not None:
            label = f"{label} (local DP, eps {run['epsilon_per_coordinate']:g} per coordinate)"
        rows = run["history"]
        acc = [r for r in rows if r.get("accuracy") is not None]
        ax_accuracy.plot(
            [r["round"] for r in acc],
            [r["accuracy"] for r in acc],
            color=color,
            marker="o" if len(acc) < 20 else None,
            label=label,
        )
        eps = [r for r in rows if r.get("epsilon") is not None]
        if eps:
            ax_epsilon.plot(
                [r["round"] for r in eps],
                [r["epsilon"] for r in eps],
                color=color,
                marker="o" if len(eps) < 20 else None,
                label=label,
            )
        elif not label.startswith("ldp_"):  # local DP has no client-level epsilon
            no_dp.append(label)
    ax_accuracy.set_xlabel("round")
    ax_accuracy.set_ylabel("test accuracy")
    ax_accuracy.set_ylim(0.0, 1.0)  # chance-level noise is not blown up into big swings
    ax_accuracy.grid(alpha=0.3)
    ax_accuracy.legend(fontsize=8)
    ax_accuracy.set_title(title or "accuracy per round", fontsize=9)
    ax_epsilon.set_xlabel("round")
    ax_epsilon.set_ylabel("epsilon (client level)")
    ax_epsilon.grid(alpha=0.3)
    ax_epsilon.set_title(
        "epsilon per round" + (f" ({', '.join(no_dp)}: no DP, epsilon = inf)" if no_dp else ""),
        fontsize=9,
    )
    if ax_epsilon.lines:
        ax_epsilon.legend(fontsize=8)
    return ax_accuracy, ax_epsilon


def plot_accuracy_and_epsilon(rows, ax=None, title: str = ""):
    """Train / test accuracy (left axis) and epsilon (right axis) per epoch,
    from the per-epoch history rows of a training recipe (Abadi et al., Figure 3)."""
    if ax is None:
        ax = new_axes((5, 3.5))
    acc_rows = [r for r in rows if "test_accuracy" in r]
    mark = dict(marker="o", ms=3)  # a run of one evaluated epoch is a point, not nothing
    ax.plot(
        [r["epoch"] for r in acc_rows],
        [r["test_accuracy"] for r in acc_rows],
        color="tab:blue",
        label="test accuracy",
        **mark,
    )
    if acc_rows and "train_accuracy" in acc_rows[0]:
        ax.plot(
            [r["epoch"] for r in acc_rows],
            [r["train_accuracy"] for r in acc_rows],
            color="tab:orange",
            ls="--",
            label="train accuracy (non-private)",
            **mark,
        )
    ax.set_xlabel("epoch")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0.5, 1.0)
    ax.grid(alpha=0.3)
    if rows and "epsilon" in rows[0]:
        ax2 = ax.twinx()
        ax2.plot(
            [r["epoch"] for r in rows],
            [r["epsilon"] for r in rows],
            color="tab:red",
            label="epsilon",
            **mark,
        )
        ax2.set_ylabel("epsilon", color="tab:red")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    return ax


def plot_best_accuracy_vs_epsilon(runs, deltas, ax=None):
    """Best test accuracy reached within each epsilon, one line per delta
    (Abadi et al., Figure 4), over the epochs of all `runs`."""
    import numpy as np

    if ax is None:
        ax = new_axes((5, 3.5))
    for delta in deltas:
        key = f"epsilon@{delta:g}"
        points = [
            (r[key], r["test_accuracy"])
            for run in runs
            for r in run["history"]
            if key in r and "test_accuracy" in r
        ]
        if not points:
            continue
        points.sort()
        eps = np.array([p[0] for p in points])
        best = np.maximum.accumulate(np.array([p[1] for p in points]))
        ax.step(eps, best, where="post", label=f"delta = {delta:g}")
    ax.set_xscale("log")
    ax.set_xlabel("epsilon")
    ax.set_ylabel("best test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_runs_accuracy_and_epsilon(runs, ax=None, title: str = "", label_key: str = "lot_size"):
    """Several runs on one panel (Abadi et al., Figure 6): test accuracy per
    epoch (solid, left axis) and epsilon per epoch (dashed, right axis), one
    colour per run, labelled by ``run[label_key]``."""
    if ax is None:
        ax = new_axes((5, 3.5))
    ax2 = None
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        rows = run["history"]
        acc = [r for r in rows if "test_accuracy" in r]
        label = f"{label_key} = {run.get(label_key)}"
        final = f" ({acc[-1]['test_accuracy']:.3f})" if acc else ""
        ax.plot(
            [r["epoch"] for r in acc],
            [r["test_accuracy"] for r in acc],
            color=color,
            label=f"{label}: accuracy{final}",
        )
        eps = [r for r in rows if r.get("epsilon") is not None]
        if eps:
            ax2 = ax2 or ax.twinx()
            ax2.plot(
                [r["epoch"] for r in eps],
                [r["epsilon"] for r in eps],
                color=color,
                ls="--",
                label=f"{label}: epsilon",
            )
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (solid)")
    ax.grid(alpha=0.3)
    if ax2 is not None:
        ax2.set_ylabel("epsilon (dashed)")
        ax2.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right", fontsize=7)
    return ax


def plot_roc_curves(curves, ax=None, title: str = "", log_scale: bool = True):
    """ROC curves of membership-inference attacks, one line per entry of
    `curves` ({label: (fpr, tpr)}, or {label: object with .fpr, .tpr, .auc}),
    with the chance diagonal.  Log-log axes by default: what matters is the
    TPR at low FPR (Carlini et al. 2022)."""
    import numpy as np

    if ax is None:
        ax = new_axes((4.5, 4))
    smallest = 1.0
    for i, (label, curve) in enumerate(curves.items()):
        if hasattr(curve, "fpr"):
            fpr, tpr = curve.fpr, curve.tpr
            label = f"{label} (AUC {curve.auc:.3f})"
        else:
            fpr, tpr = curve
        fpr, tpr = np.asarray(fpr, float), np.asarray(tpr, float)
        if log_scale:
            keep = (fpr > 0) & (tpr > 0)
            fpr, tpr = fpr[keep], tpr[keep]
            if len(fpr):
                smallest = min(smallest, fpr.min(), tpr.min())
        ax.plot(fpr, tpr, color=f"C{i % 10}", label=label)
    # log axes start one decade below the smallest rate plotted (at most 1e-1)
    floor = 10.0 ** (np.floor(np.log10(min(smallest, 0.1)))) if log_scale else 0.0
    ax.plot([floor, 1], [floor, 1], color="grey", ls=":", label="chance")
    if log_scale:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(floor, 1)
        ax.set_ylim(floor, 1)
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.grid(alpha=0.3, which="both" if log_scale else "major")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return ax

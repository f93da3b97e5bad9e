"""Figures shared by experiments and notebooks (matplotlib, no screen needed)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg", force=False)
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plot_epsilon_curves", "save_figure"]

_STYLE = {"moments": ("tab:blue", "-", "moments accountant (ours)"),
          "strong": ("tab:red", "--", "strong composition"),
          "rdp": ("tab:green", "-.", "RDP (dp-accounting)"),
          "pld": ("tab:purple", ":", "PLD (dp-accounting)")}


def plot_epsilon_curves(curves: dict, ax=None):
    """Epsilon versus epochs, one line per accountant (output of `epsilon_curves`)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    for name, (color, style, label) in _STYLE.items():
        if name in curves:
            ax.plot(curves["epochs"], curves[name], style, color=color, label=label)
    ax.set_xlabel("epochs")
    ax.set_ylabel("epsilon")
    ax.set_title(f"q = {curves['sampling_rate']:g}, sigma = {curves['noise_multiplier']:g}, "
                 f"delta = {curves['delta']:g}")
    ax.grid(alpha=0.3)
    ax.legend()
    return ax


def save_figure(fig, path) -> None:
    """Saves a figure atomically (PNG) and closes it."""
    import os
    import tempfile

    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".png")
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        plt.close(fig)

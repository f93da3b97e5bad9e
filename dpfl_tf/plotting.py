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
    """Saves a figure as PNG atomically and closes it."""
    from dpfl_tf._io import atomic_write

    try:
        atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"),
                     binary=True)
    finally:
        plt.close(fig)

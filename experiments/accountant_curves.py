"""Abadi et al. 2016, Figure 2: epsilon versus epochs for the moments
accountant and strong composition, plus RDP and PLD from dp-accounting.

    python experiments/accountant_curves.py            # q=0.01, sigma=4, delta=1e-5
Writes results/accountant_curves.json and results/accountant_curves.png.
"""

from __future__ import annotations

import argparse
import os
import time

import _common  # noqa: F401  (this checkout's package first on sys.path)
import matplotlib.pyplot as plt  # noqa: E402  (after dpfl_tf.plotting set the backend)
import numpy as np

from dpfl_tf._io import atomic_write_json
from dpfl_tf.plotting import plot_epsilon_curves, save_figure
from dpfl_tf.privacy.curves import epsilon_curves

PAPER = {"moments": {100: 1.26, 400: 2.55}, "strong": {100: 9.34, 400: 24.22}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sampling-rate", type=float, default=0.01)
    p.add_argument("--noise-multiplier", type=float, default=4.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--max-epochs", type=float, default=400)
    p.add_argument("--points", type=int, default=41)
    p.add_argument("--output-dir", default="results")
    args = p.parse_args(argv)

    epochs = sorted(
        set(np.linspace(0, args.max_epochs, args.points).tolist()) | {100.0, 400.0}
        if args.max_epochs >= 400
        else np.linspace(0, args.max_epochs, args.points).tolist()
    )
    start = time.perf_counter()
    curves = epsilon_curves(args.sampling_rate, args.noise_multiplier, args.delta, epochs)
    curves["seconds"] = time.perf_counter() - start
    table = []
    for e in (100.0, 400.0):
        if e in curves["epochs"]:
            i = curves["epochs"].index(e)
            row = {"epochs": e}
            for k in ("moments", "strong", "rdp", "pld"):
                row[k] = curves[k][i]
                if k in PAPER and args.sampling_rate == 0.01 and args.noise_multiplier == 4.0:
                    row[f"{k}_paper"] = PAPER[k][int(e)]
            table.append(row)
    curves["table"] = table
    os.makedirs(args.output_dir, exist_ok=True)
    atomic_write_json(os.path.join(args.output_dir, "accountant_curves.json"), curves)
    fig, ax = plt.subplots(figsize=(6, 4))
    plot_epsilon_curves(curves, ax)
    save_figure(fig, os.path.join(args.output_dir, "accountant_curves.png"))
    for row in table:
        print(
            " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
        )
    print(f"wrote {args.output_dir}/accountant_curves.json and .png ({curves['seconds']:.1f} s)")
    return curves


if __name__ == "__main__":
    main()

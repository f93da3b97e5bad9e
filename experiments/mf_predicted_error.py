"""Predicted error of the correlated-noise strategies, no training: for n steps
under min-separation b (k = n / b participations), the loss

    sens(C)^2 x mean_t ||(A C^-1)[t]||^2

(the noise variance on the model's prefix sums at equal sigma; Choquette-Choo et
al. 2023, eq. (3)) of independent noise (DP-SGD without amplification), tree
aggregation restarted every b steps, banded MF with 2..64 bands (<= b) and BLT
with 2..4 buffers, with the noise vectors each stores.

  python experiments/mf_predicted_error.py            # about a minute
  python experiments/mf_predicted_error.py --quick    # n = 400 only

Writes results/mf_predicted_error[_quick].json.
"""

from __future__ import annotations

import argparse
import json
import os

from _common import RESULTS, command_line, commit_of


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()

    from dpfl_tf.privacy import matrix_factorization as mf

    settings = [(400, 20)] if args.quick else [(400, 20), (1000, 10), (1000, 100), (2000, 100)]
    rows = []
    for n, b in settings:
        p = mf.Participation.min_separation(n, b)
        candidates = [
            ("independent", mf.BandedToeplitz((1.0,))),
            ("tree", mf.TreeAggregation(restart_every=b)),
        ]
        candidates += [
            (f"banded_{bands}", mf.optimize_banded_toeplitz(n, bands))
            for bands in (2, 4, 8, 16, 32, 64)
            if bands <= b
        ]
        candidates += [(f"blt_{d}", mf.optimize_blt(p, buffers=d)) for d in (2, 3, 4)]
        base = None
        for name, strategy in candidates:
            loss = strategy.sensitivity_squared(p) * float(strategy.prefix_errors(n).mean())
            base = base or loss
            rows.append(
                {
                    "steps": n,
                    "min_separation": b,
                    "participations": p.participations,
                    "strategy": name,
                    "description": strategy.describe(),
                    "loss": loss,
                    "rmse_vs_independent": (loss / base) ** 0.5,
                    "stored_vectors": strategy.buffers(n),
                }
            )
            print(
                f"n={n} b={b} {name:12s} loss={loss:10.1f} "
                f"rmse/independent={(loss / base) ** 0.5:.3f} "
                f"stored={strategy.buffers(n)}",
                flush=True,
            )
    os.makedirs(RESULTS, exist_ok=True)
    out = os.path.join(RESULTS, "mf_predicted_error" + ("_quick" if args.quick else "") + ".json")
    with open(out, "w") as f:
        json.dump({"command": command_line(), "commit": commit_of(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""What ``dpfl-tf federated`` reaches with its defaults, per mode, and why the old
defaults left Global DP at chance (issue 32).

Runs `FederatedConfig(dp=mode)` -- exactly what ``dpfl-tf federated --dp MODE``
runs with no other flag -- for every mode, and, for the record, the old defaults
(K = 100, m = K/10 = 10, 784-600-100-10, lr 0.1, 100 rounds) without DP and with
Global DP.  For both settings it measures the update norm of 10 clients at the
initial model against the Global DP noise of one round,

    noise per coordinate = sigma S / m,   noise norm = sigma S sqrt(d) / m,

the norm of the averaged update being at most S.  The defaults' numbers in
``dpfl-tf federated --help`` come from this script's results file.

    python experiments/federated_defaults.py              # every mode + the old defaults
    python experiments/federated_defaults.py --only global client
    python experiments/federated_defaults.py --skip-old   # the current defaults only

Writes results/federated_defaults.json (one row per run, with its full config).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np
from _common import RESULTS, command_line, commit_of

from dpfl_tf._io import atomic_write_json
from dpfl_tf.federated.runner import FederatedConfig, build_server, run_federated

MODES = ("none", "global", "client", "local")
#: the defaults before issue 32 (FederatedConfig / CLI, as they were)
OLD = dict(
    clients=100,
    fraction=0.1,
    rounds=100,
    hidden=(600, 100),
    learning_rate=0.1,
    noise_multiplier=1.0,
)


def noise_to_signal(config: FederatedConfig, dataset) -> dict:
    """Update norms of 10 clients at the initial model vs. one round's Global DP noise."""
    server, _ = build_server(config, dataset, progress=False)
    w0 = server.trainer.get_weights()
    d = int(sum(int(np.prod(w.shape)) for w in w0))
    norms = []
    for k in range(10):
        upload, _ = server.client_upload(k, w0, 0)
        norms.append(float(math.sqrt(sum(float(np.sum(np.square(u))) for u in upload))))
    m = server.expected_clients
    sigma, clip = config.noise_multiplier, config.clip
    return {
        "parameters": d,
        "expected_clients_per_round": m,
        "client_update_norms_at_init": norms,
        "median_client_update_norm": float(np.median(norms)),
        "clip": clip,
        "noise_multiplier": sigma,
        "noise_std_per_coordinate": sigma * clip / m,
        "noise_norm_per_round": sigma * clip * math.sqrt(d) / m,
        "averaged_update_norm_at_most": clip,
    }


def _row(name: str, config: FederatedConfig, dataset) -> dict:
    start = time.perf_counter()
    r = run_federated(config, dataset, progress=False)
    minutes = (time.perf_counter() - start) / 60
    row = {
        "name": name,
        "dp": config.dp.value,
        "mechanism": r["mechanism"],
        "test_accuracy": r["test_accuracy"],
        "rounds": r["rounds"],
        "epsilon": r["epsilon"],
        "delta": r["delta"],
        "accountant": r["accountant"],
        "minutes": minutes,
        "load_average_1min_at_end": os.getloadavg()[0],
        "accuracy_per_10_rounds": [h["accuracy"] for h in r["history"] if h["round"] % 10 == 0],
        "config": config.to_dict(),
    }
    if "against_server" in r["privacy"]:
        row["epsilon_against_server_per_client"] = r["privacy"]["against_server"]["epsilon"]
    if "epsilon_per_coordinate" in r:
        row["ldp_epsilon_per_coordinate"] = r["epsilon_per_coordinate"]
    eps = "n/a" if r["epsilon"] is None else f"{r['epsilon']:.2f}"
    print(
        f"{name}: accuracy {r['test_accuracy']:.4f} after {r['rounds']} rounds, epsilon "
        f"{eps}, {minutes:.1f} min",
        flush=True,
    )
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="+", choices=MODES, help="modes to run (default: all)")
    p.add_argument("--skip-old", action="store_true", help="do not rerun the old defaults")
    p.add_argument("--output", default=os.path.join(RESULTS, "federated_defaults.json"))
    args = p.parse_args(argv)
    from dpfl_tf.data import load_dataset

    ds = load_dataset("mnist")
    out = {
        "command": command_line(),
        "commit": commit_of(),
        "runs": [],
        "noise_to_signal": {
            "defaults": noise_to_signal(FederatedConfig(dp="global"), ds),
            "old_defaults": noise_to_signal(FederatedConfig(dp="global", **OLD), ds),
        },
    }
    for key, value in out["noise_to_signal"].items():
        print(
            f"{key}: d = {value['parameters']}, m = {value['expected_clients_per_round']:g}, "
            f"median update norm {value['median_client_update_norm']:.2f} (clipped to "
            f"{value['clip']:g}), Global DP noise norm per round "
            f"{value['noise_norm_per_round']:.2f}",
            flush=True,
        )
    for mode in args.only or MODES:
        out["runs"].append(_row(f"defaults --dp {mode}", FederatedConfig(dp=mode), ds))
        atomic_write_json(args.output, out)
    if not args.skip_old:
        for mode in ("none", "global"):
            out["runs"].append(
                _row(f"old defaults --dp {mode}", FederatedConfig(dp=mode, **OLD), ds)
            )
            atomic_write_json(args.output, out)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

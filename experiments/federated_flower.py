"""The same FederatedConfig in-process (`run_federated`) and on Flower
(`run_on_flower`, Flower's Simulation Engine on Ray by default): accuracy and
epsilon of each (issue 8).

Setting: MNIST, K = 20 clients (IID partition), m = 5 drawn without
replacement per round (Flower's own sampling scheme; event
``gaussian_step_event(sigma, "fixed_size", dataset_size=20, lot_size=5)``,
rdp accountant), 5 rounds, E = 1, B = 10, SGD lr 0.1, a 784-32-10 network.

* ``fedavg``: no noise -- the runs differ only in the clients' shuffling
  streams and (on Ray) in which partition sits on which node, so accuracy
  should agree within the seed-to-seed spread;
* ``global_dp``: Global DP, S = 1, sigma = 1 -- epsilon must be *exactly* equal
  (same events).  With m = 5 the noise (sigma S / m = 0.2 per coordinate of the
  averaged update) swamps the signal: accuracy stays near chance in both
  runtimes; client-level DP needs hundreds of clients per round (see
  experiments/federated_dp.py).

    python experiments/federated_flower.py                  # ray, seeds 0 1 2
    python experiments/federated_flower.py --backend local --seeds 0

Writes results/federated_flower.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np
from _common import RESULTS

from dpfl_tf._io import atomic_write_json
from dpfl_tf.federated.runner import FederatedConfig, run_federated

SUMMARY_KEYS = (
    "mechanism",
    "rounds",
    "test_accuracy",
    "epsilon",
    "delta",
    "accountant",
    "seconds",
    "median_round_seconds",
    "stop_reason",
)


def _configs(args, seed: int) -> dict[str, FederatedConfig]:
    common = dict(
        dataset="mnist",
        clients=args.clients,
        clients_per_round=args.m,
        sampling="fixed_size",
        partition="iid",
        rounds=args.rounds,
        local_epochs=1,
        local_batch_size=10,
        learning_rate=0.1,
        hidden=tuple(args.hidden),
        seed=seed,
        accountant="rdp",
    )
    return {
        "fedavg": FederatedConfig(dp="none", **common),
        "global_dp": FederatedConfig(dp="global", clip=1.0, noise_multiplier=args.sigma, **common),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--m", type=int, default=5, help="clients per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--hidden", type=int, nargs="+", default=[32])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--backend", choices=["ray", "local"], default="ray")
    p.add_argument("--out", default=os.path.join(RESULTS, "federated_flower.json"))
    args = p.parse_args(argv)

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # before flwr is imported
    from dpfl_tf.federated.flower import FLOWER_VERSION, run_on_flower

    runs = []
    for seed in args.seeds:
        for name, config in _configs(args, seed).items():
            t0 = time.perf_counter()
            inproc = run_federated(config, progress=False)
            t1 = time.perf_counter()
            flower = run_on_flower(config, backend=args.backend)
            t2 = time.perf_counter()
            row = {
                "setting": name,
                "seed": seed,
                "config": config.to_dict(),
                "in_process": {k: inproc[k] for k in SUMMARY_KEYS},
                "flower": {k: flower[k] for k in SUMMARY_KEYS},
                "flower_backend": args.backend,
                "wall_seconds": {"in_process": t1 - t0, "flower": t2 - t1},
                "accuracy_per_round": {
                    "in_process": [r["accuracy"] for r in inproc["history"]],
                    "flower": [r["accuracy"] for r in flower["history"]],
                },
                "epsilon_per_round": {
                    "in_process": [r["epsilon"] for r in inproc["history"]],
                    "flower": [r["epsilon"] for r in flower["history"]],
                },
                "round_event": inproc["privacy"].get("round_event"),
                "epsilon_identical": inproc["epsilon"] == flower["epsilon"],
            }
            runs.append(row)
            print(
                f"{name:10s} seed {seed}: accuracy in-process {inproc['test_accuracy']:.4f} "
                f"flower {flower['test_accuracy']:.4f}; epsilon in-process "
                f"{inproc['epsilon']} flower {flower['epsilon']}",
                flush=True,
            )

    summary = {}
    for name in ("fedavg", "global_dp"):
        rows = [r for r in runs if r["setting"] == name]
        a = np.array([r["in_process"]["test_accuracy"] for r in rows])
        b = np.array([r["flower"]["test_accuracy"] for r in rows])
        summary[name] = {
            "seeds": [r["seed"] for r in rows],
            "accuracy_in_process_mean": float(a.mean()),
            "accuracy_in_process_std": float(a.std()),
            "accuracy_flower_mean": float(b.mean()),
            "accuracy_flower_std": float(b.std()),
            "accuracy_difference_mean": float((b - a).mean()),
            "epsilon_in_process": [r["in_process"]["epsilon"] for r in rows],
            "epsilon_flower": [r["flower"]["epsilon"] for r in rows],
            "epsilon_identical": all(r["epsilon_identical"] for r in rows),
        }
    out = {
        "experiment": "federated_flower",
        "command": "python "
        + " ".join([os.path.relpath(__file__)] + (argv if argv is not None else sys.argv[1:])),
        "flwr_version": FLOWER_VERSION,
        "python": platform.python_version(),
        "summary": summary,
        "runs": runs,
    }
    atomic_write_json(args.out, out)
    print(f"wrote {args.out}")
    for name, s in summary.items():
        print(
            f"{name}: accuracy in-process {s['accuracy_in_process_mean']:.4f} "
            f"+- {s['accuracy_in_process_std']:.4f}, flower {s['accuracy_flower_mean']:.4f} "
            f"+- {s['accuracy_flower_std']:.4f}; epsilon identical: {s['epsilon_identical']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Client-level DP on non-IID MNIST: DP-FedAvg with Poisson client sampling vs
correlated noise with cyclic cohorts (DP-FTRL tree, banded MF, BLT), at equal
epsilon.

Each method with the participation it needs: ``global`` samples clients by
Poisson (q = m/K) and is amplified by it; ``ftrl`` / ``banded_mf`` / ``blt``
split the K clients into b = K/m cohorts that take turns (a client every b
rounds, k = rounds/b times), one Gaussian for the run.  Sigma is calibrated
for each (method, epsilon) at the setting's delta with the RDP accountant;
the rest (network, local SGD, rounds, m) is experiments/federated_dp.py's
setting for K.

  python experiments/mf_federated.py --quick      # minutes: K = 100, 20 rounds, eps 8
  python experiments/mf_federated.py --clients 1000 10000 --epsilon 8 2 --seeds 3
  python experiments/mf_federated.py --setting small --clients 1000 10000   # ~1 hour

``--setting geyer`` (the default) is experiments/federated_dp.py's setting for K
(Geyer et al.'s network and local training; 300 / 1,000 rounds, about 20 / 90
minutes a run here).  ``--setting small`` is
experiments/federated_distributed.py's lighter one (784-32-10, E = 1, m = 100 a
round for 100 rounds at K = 1,000; m = 200 for 200 rounds at K = 10,000, so that
each client takes part k = 10 / 4 times), under a minute or two a run.

Writes results/mf_federated[_quick|_small].json (every run with its config and
history) and the .png beside it (accuracy vs round).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

from _common import RESULTS, command_line, commit_of, runs_to_append

from dpfl_tf._io import atomic_write_json

METHODS = ("global", "ftrl", "banded_mf", "blt")
#: K -> m, delta, local epochs, learning rate, rounds, hidden widths (federated_dp.py's)
SETTINGS = {
    100: dict(m=10, delta=1e-3, epochs=1, lr=0.2, rounds=100, hidden=(32,)),
    1000: dict(m=100, delta=1e-5, epochs=4, lr=0.2, rounds=300, hidden=(100,)),
    10000: dict(m=300, delta=1e-6, epochs=4, lr=0.1, rounds=1000, hidden=(600, 100)),
}
#: the same keys for ``--setting small`` (experiments/federated_distributed.py's network)
SMALL = {
    1000: dict(m=100, delta=1e-5, epochs=1, lr=0.2, rounds=100, hidden=(32,)),
    10000: dict(m=200, delta=1e-6, epochs=1, lr=0.2, rounds=200, hidden=(32,)),
}


def calibrate(method, epsilon, delta, k, m, rounds):
    """sigma for the run to cost epsilon at delta (RDP)."""
    import dp_accounting

    from dpfl_tf.privacy import calibrate_noise_multiplier, dp_sgd_event

    if method == "global":

        def make(s):
            return dp_sgd_event(s, rounds, sampling_rate=m / k)
    else:

        def make(s):
            return dp_accounting.GaussianDpEvent(s)

    return calibrate_noise_multiplier(epsilon, delta, make, "rdp")[0]


def run(method, k, epsilon, seed, args, dataset):
    from dpfl_tf.federated.runner import FederatedConfig, run_federated

    s = (SMALL if args.setting == "small" else SETTINGS)[k]
    rounds = 20 if args.quick else (args.rounds or s["rounds"])
    m = s["m"]
    sigma = calibrate(method, epsilon, s["delta"], k, m, rounds)
    common = dict(
        dataset="mnist",
        clients=k,
        partition="shards",
        rounds=rounds,
        local_epochs=1 if args.quick else s["epochs"],
        local_batch_size=10,
        learning_rate=s["lr"],
        hidden=s["hidden"],
        seed=seed,
        clip=1.0,
        noise_multiplier=sigma,
        delta_max=s["delta"],
        accountant="rdp",
        eval_every=1 if args.quick or args.setting == "small" else 5,
        dp=method,
    )
    if method == "global":
        config = FederatedConfig(**common, clients_per_round=m, sampling="poisson")
    else:
        config = FederatedConfig(**common, cohorts=k // m)
    result = run_federated(config, dataset, progress=False)
    result["calibrated_noise_multiplier"] = sigma
    result["target_epsilon_calibrated"] = epsilon
    return result


NAMES = {
    "global": "DP-FedAvg, Poisson sampling (amplified)",
    "ftrl": "DP-FTRL, tree aggregation",
    "banded_mf": "banded MF",
    "blt": "BLT",
}


def markdown_table(runs) -> str:
    """The results page's table: every (K, epsilon, method)'s mean +- std over its seeds,
    against DP-FedAvg."""
    import numpy as np

    lines = [
        "| K | epsilon | method | participation | sigma | test accuracy | vs DP-FedAvg |",
        "|---|---|---|---|---|---|---|",
    ]
    keys = sorted(
        {(r["config"]["clients"], r["target_epsilon_calibrated"]) for r in runs},
        key=lambda key: (key[0], -key[1]),
    )
    for k, eps in keys:
        base = None
        for method in METHODS:
            rr = [
                r
                for r in runs
                if (r["config"]["clients"], r["target_epsilon_calibrated"]) == (k, eps)
                and r["config"]["dp"] == method
            ]
            if not rr:
                continue
            acc = 100 * np.array([r["test_accuracy"] for r in rr])
            if method == "global":
                base = acc.mean()
                turns = f"Poisson, q = {rr[0]['clients_per_round'] / k:g}"
            else:
                b = rr[0]["config"]["cohorts"]
                turns = f"{b} cohorts in turn, {rr[0]['rounds'] // b} turns each"
            spread = f" +- {acc.std():.2f}%" if len(acc) > 1 else "%"
            seeds = f"{len(acc)} seeds" if len(acc) > 1 else "1 seed"
            versus = "--" if method == "global" or base is None else f"{acc.mean() - base:+.2f}"
            lines.append(
                f"| {k:,} | {eps:g} | {NAMES[method]} | {turns} | "
                f"{rr[0]['calibrated_noise_multiplier']:.3f} | {acc.mean():.2f}{spread} "
                f"({seeds}) | {versus} |"
            )
    return "\n".join(lines)


def figure(path, runs, quick):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["config"]["clients"], r["target_epsilon_calibrated"]) for r in runs})
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.8), squeeze=False)
    for ax, (k, eps) in zip(axes[0], keys):
        for method in METHODS:
            mine = [
                r
                for r in runs
                if r["config"]["clients"] == k
                and r["target_epsilon_calibrated"] == eps
                and r["config"]["dp"] == method
            ]
            for i, r in enumerate(mine):
                pts = [
                    (h["round"], h["accuracy"]) for h in r["history"] if h["accuracy"] is not None
                ]
                ax.plot(
                    *zip(*pts),
                    color=f"C{METHODS.index(method)}",
                    alpha=0.8,
                    label=method if i == 0 else None,
                )
        ax.set_title(f"K = {k}, epsilon = {eps:g}" + (" (quick run)" if quick else ""), fontsize=9)
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--clients", nargs="+", type=int, default=[1000, 10000], choices=sorted(SETTINGS)
    )
    parser.add_argument("--epsilon", nargs="+", type=float, default=[8.0, 2.0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", type=int, default=3, help="runs per setting")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds S, S + 1, ...")
    parser.add_argument("--rounds", type=int, default=None, help="default: the setting's")
    parser.add_argument(
        "--setting",
        choices=("geyer", "small"),
        default="geyer",
        help="geyer: federated_dp.py's network and local training; small: "
        "federated_distributed.py's (784-32-10, E = 1), minutes a run",
    )
    parser.add_argument(
        "--table", action="store_true", help="print the results file's table (markdown) and exit"
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="add the runs to the results file's instead of replacing them",
    )
    args = parser.parse_args()
    suffix = "_quick" if args.quick else ("_small" if args.setting == "small" else "")
    out = os.path.join(RESULTS, "mf_federated" + suffix)
    if args.table:
        with open(out + ".json") as f:
            print(markdown_table(json.load(f)["runs"]))
        return
    from dpfl_tf.data import load_dataset

    dataset = load_dataset("mnist")
    clients = [100] if args.quick else args.clients
    epsilons = [8.0] if args.quick else args.epsilon
    seeds = range(args.first_seed, args.first_seed + (1 if args.quick else args.seeds))
    runs, command, commit = [], command_line(), commit_of()
    if args.append:
        planned = set(itertools.product(clients, epsilons, args.methods, seeds))
        runs, command, commit = runs_to_append(
            out + ".json",
            planned,
            lambda r: (
                r["config"]["clients"],
                r["target_epsilon_calibrated"],
                r["config"]["dp"],
                r["config"]["seed"],
            ),
            command,
            commit,
        )
    for k in clients:
        for eps in epsilons:
            for method in args.methods:
                for seed in seeds:
                    result = run(method, k, eps, seed, args, dataset)
                    runs.append(result)
                    print(
                        f"K={k} eps={eps:g} {method:9s} seed={seed}: acc="
                        f"{result['history'][-1]['accuracy']:.4f} sigma="
                        f"{result['calibrated_noise_multiplier']:.3f} eps="
                        f"{result['epsilon']:.3f}",
                        flush=True,
                    )
                    os.makedirs(RESULTS, exist_ok=True)
                    atomic_write_json(  # a reader never sees half a file
                        out + ".json",
                        {
                            "command": command,
                            "commit": commit,
                            "quick": args.quick,
                            "setting": "quick" if args.quick else args.setting,
                            "shared_machine": True,
                            "runs": runs,
                        },
                    )
    figure(out + ".png", runs, args.quick)


if __name__ == "__main__":
    main()

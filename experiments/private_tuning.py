"""The price of honest hyperparameter tuning, measured on MNIST.

A search over the learning rate and the clip bound of DP-SGD (an MLP on
pixels), every method's release accounted at the same total epsilon:

* ``reported``  -- what papers report: k trials, each calibrated to the
  target epsilon on its own, the best picked on (non-private) validation
  accuracy; the printed epsilon is one trial's and does NOT cover the search;
* ``composed``  -- the same k-trial search accounted honestly: the noise is
  calibrated so that all k trials and their noised validation scores compose
  to the target (RDP);
* ``papernot_steinke`` -- a random number of trials K (geometric or
  truncated negative binomial with mean k, Papernot & Steinke 2022), only the
  best released, the noise calibrated so that RepeatAndSelectDpEvent meets the
  target (RDP);
* ``single``    -- one run at the target with a fixed, untuned setting (the
  middle of the grid): what an honest user without tuning gets.

The test accuracy of each released model is measured on the MNIST test set
(for this experiment only; the selection never sees it).

    python experiments/private_tuning.py --quick         # minutes: a smoke run
    python experiments/private_tuning.py                 # the full run (hours)

Writes results/private_tuning[_quick].json and results/private_tuning[_quick].png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np  # noqa: E402
from _common import RESULTS, commit_of


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run (small slices)")
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--mean-trials", type=float, default=8.0)
    p.add_argument("--shape", type=float, default=1.0, help="0 logarithmic, 1 geometric, ...")
    p.add_argument("--repeats", type=int, default=3, help="searches per method (seeds)")
    p.add_argument(
        "--score-noise",
        type=float,
        default=20.0,
        help="noise multiplier of the validation score's sum",
    )
    p.add_argument(
        "--noise-only",
        action="store_true",
        help="only the training noise each search needs for the target (accounting "
        "only, seconds): results/private_tuning_noise[_quick].json",
    )
    p.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=list(METHODS),
        help="the methods to run (default all)",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="add this run's searches to the results file's (same settings; the repeats "
        "numbered on) and recompute its summary and figure",
    )
    return p.parse_args(argv)


METHODS = ("single", "reported", "composed", "papernot_steinke")


def noise_table(args, s: dict) -> dict:
    """The training noise multiplier that makes each search cost the target
    epsilon, for mean numbers of trials 2..32 (RDP; no training)."""
    from dpfl_tf.privacy import calibrate_noise_multiplier, dp_sgd_event
    from dpfl_tf.tuning import TrialCount, ValidationScore, calibrate_search

    n, lot = s["train"], s["lot"]
    steps = s["epochs"] * (n // lot)
    score = ValidationScore(np.zeros((1, 2)), np.zeros(1), noise_multiplier=args.score_noise)

    def trial_event(sigma):
        return dp_sgd_event(sigma, steps, sampling_rate=lot / n)

    rows = []
    for k in (2, 4, 8, 16, 32):
        rows.append(
            {
                "trials": k,
                **{
                    name: calibrate_search(args.epsilon, args.delta, trials, trial_event, score)[0]
                    for name, trials in (
                        ("composed", k),
                        ("geometric", TrialCount.geometric(k)),
                        ("logarithmic", TrialCount.logarithmic(k)),
                    )
                },
            }
        )
    return {
        "single_run": calibrate_noise_multiplier(args.epsilon, args.delta, trial_event, "rdp")[0],
        "by_mean_trials": rows,
        "steps": steps,
        "sampling_rate": lot / n,
    }


def settings(quick: bool) -> dict:
    if quick:
        return dict(
            train=6000,
            val=1000,
            test=2000,
            epochs=2,
            lot=200,
            hidden=64,
            learning_rates=[0.05, 0.5, 2.0],
            clips=[0.5, 2.0],
        )
    return dict(
        train=50000,
        val=10000,
        test=10000,
        epochs=15,
        lot=500,
        hidden=256,
        learning_rates=[0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 4.0],
        clips=[0.1, 0.3, 1.0, 3.0],
    )


def main(argv=None):
    args = parse_args(argv)
    import keras

    from dpfl_tf.data import load_dataset
    from dpfl_tf.keras import DPSGD, DPModel
    from dpfl_tf.privacy import calibrate_noise_multiplier, compute_epsilon, dp_sgd_event
    from dpfl_tf.tuning import TrialCount, ValidationScore, calibrate_search, private_search

    s = settings(args.quick)
    if args.noise_only:
        name = "private_tuning_noise" + ("_quick" if args.quick else "")
        out = {
            "experiment": "private_tuning --noise-only",
            "quick": args.quick,
            "commit": commit_of(),
            "settings": {
                **s,
                "epsilon": args.epsilon,
                "delta": args.delta,
                "accountant": "rdp",
                "score_noise": args.score_noise,
            },
            "noise_multiplier": noise_table(args, s),
        }
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, name + ".json"), "w") as f:
            json.dump(out, f, indent=1)
        print(json.dumps(out["noise_multiplier"], indent=1))
        return
    ds = load_dataset("mnist")
    x = ds.x_train.reshape(len(ds.x_train), -1).astype("float32") / 255.0
    y = ds.y_train.astype("int64")
    x_tr, y_tr = x[: s["train"]], y[: s["train"]]
    x_val, y_val = x[s["train"] : s["train"] + s["val"]], y[s["train"] : s["train"] + s["val"]]
    x_te = ds.x_test[: s["test"]].reshape(s["test"], -1).astype("float32") / 255.0
    y_te = ds.y_test[: s["test"]].astype("int64")
    n, lot = len(y_tr), s["lot"]
    steps = s["epochs"] * (n // lot)

    def trial_event(sigma):
        return dp_sgd_event(sigma, steps, sampling_rate=lot / n)

    space = {"learning_rate": s["learning_rates"], "l2_norm_clip": s["clips"]}
    k = int(round(args.mean_trials))
    trials = TrialCount(args.mean_trials, args.shape)
    eps, delta = args.epsilon, args.delta
    score = ValidationScore(x_val, y_val, noise_multiplier=args.score_noise)
    sigmas = {
        "reported": calibrate_noise_multiplier(eps, delta, trial_event, "rdp")[0],
        "composed": calibrate_search(eps, delta, k, trial_event, score)[0],
        "papernot_steinke": calibrate_search(eps, delta, trials, trial_event, score)[0],
    }
    sigmas["single"] = sigmas["reported"]

    def trainer(sigma):
        def train(hp):
            keras.utils.set_random_seed(int.from_bytes(os.urandom(4), "little"))
            model = DPModel(
                keras.Sequential(
                    [
                        keras.Input((784,)),
                        keras.layers.Dense(s["hidden"], activation="relu"),
                        keras.layers.Dense(10),
                    ]
                )
            )
            model.compile(
                optimizer=DPSGD(
                    hp["learning_rate"], l2_norm_clip=hp["l2_norm_clip"], noise_multiplier=sigma
                ),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
            model.fit(x_tr, y_tr, lot_size=lot, epochs=s["epochs"], verbose=0)
            return model

        return train

    def test_accuracy(model):
        return float(np.mean(model.predict(x_te, verbose=0).argmax(1) == y_te))

    middle = {
        "learning_rate": s["learning_rates"][len(s["learning_rates"]) // 2],
        "l2_norm_clip": s["clips"][len(s["clips"]) // 2],
    }
    name = "private_tuning_quick" if args.quick else "private_tuning"
    path = os.path.join(RESULTS, name + ".json")
    earlier = []
    if args.append:
        with open(path) as f:
            before = json.load(f)
        now = {**s, "epsilon": eps, "delta": delta, "mean_trials": args.mean_trials}
        now.update(shape=args.shape, score_noise=args.score_noise)
        differ = sorted(k for k, v in now.items() if before["settings"].get(k) != v)
        if differ:
            raise SystemExit(f"--append: {path} holds searches of other settings ({differ})")
        earlier = [{"commit": before["commit"], **r} for r in before["runs"]]
    runs = list(earlier)
    for method in args.methods:
        sigma = sigmas[method]
        first = sum(r["method"] == method for r in earlier)
        for rep in range(first, first + args.repeats):
            start = time.time()
            if method == "single":
                result = private_search(
                    trainer(sigma),
                    {k_: [v] for k_, v in middle.items()},
                    trials=1,
                    trial_event=trial_event(sigma),
                    score=ValidationScore(x_val, y_val, noise_multiplier=0.0, public=True),
                    delta=delta,
                )
            elif method == "reported":
                result = private_search(
                    trainer(sigma),
                    space,
                    trials=k,
                    trial_event=trial_event(sigma),
                    score=ValidationScore(x_val, y_val, noise_multiplier=0.0),
                    delta=delta,
                )
            else:
                result = private_search(
                    trainer(sigma),
                    space,
                    trials=k if method == "composed" else trials,
                    trial_event=trial_event(sigma),
                    score=score,
                    delta=delta,
                )
            best = result.best
            run = {
                "method": method,
                "repeat": rep,
                "commit": commit_of(),
                "noise_multiplier": sigma,
                "epsilon_search": None if math.isinf(result.epsilon) else result.epsilon,
                "epsilon_printed": (
                    result.trial_epsilon if method in ("single", "reported") else result.epsilon
                ),
                "epsilon_covers_search": method != "reported",
                "trial_epsilon": result.trial_epsilon,
                "best": None if best is None else best.hyperparameters,
                "validation_score": None if best is None else best.score,
                "test_accuracy": None if best is None else test_accuracy(best.model),
                "seconds": round(time.time() - start, 1),
            }
            runs.append(run)
            print(json.dumps(run), flush=True)
            keras.backend.clear_session()

    summary = {}
    for method in sigmas:
        accs = [
            r["test_accuracy"]
            for r in runs
            if r["method"] == method and r["test_accuracy"] is not None
        ]
        summary[method] = {
            "noise_multiplier": sigmas[method],
            "test_accuracy_mean": float(np.mean(accs)) if accs else None,
            # the standard deviation of the searches (n - 1)
            "test_accuracy_std": float(np.std(accs, ddof=1)) if len(accs) > 1 else None,
            "searches": len(accs),
        }
    out = {
        "experiment": "private_tuning",
        "quick": args.quick,
        "commit": commit_of(),
        "settings": {
            **s,
            "epsilon": eps,
            "delta": delta,
            "mean_trials": args.mean_trials,
            "shape": args.shape,
            "fixed_trials": k,
            "score_noise": args.score_noise,
            "accountant": "rdp",
            "steps": steps,
            "one_trial_epsilon_at_papernot_steinke_sigma": compute_epsilon(
                trial_event(sigmas["papernot_steinke"]), delta, "rdp"
            ),
        },
        "summary": summary,
        "runs": runs,
    }
    os.makedirs(RESULTS, exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    figure(out, os.path.join(RESULTS, name + ".png"))
    print(json.dumps(summary, indent=1))


def figure(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "single": "one untuned run",
        "reported": "search, eps of one trial\n(not honest)",
        "composed": "search, k trials\ncomposed",
        "papernot_steinke": "search, random K\n(Papernot-Steinke)",
    }
    methods = [m for m in labels if out["summary"][m]["test_accuracy_mean"] is not None]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, m in enumerate(methods):
        accs = [
            r["test_accuracy"]
            for r in out["runs"]
            if r["method"] == m and r["test_accuracy"] is not None
        ]
        ax.scatter([i] * len(accs), accs, color="C%d" % i, alpha=0.6)
        ax.errorbar(
            i + 0.15,
            np.mean(accs),
            yerr=np.std(accs, ddof=1) if len(accs) > 1 else 0.0,
            fmt="s",
            color="C%d" % i,
        )
    ax.set_xticks(range(len(methods)), [labels[m] for m in methods], fontsize=8)
    s = out["settings"]
    ax.set_ylabel("test accuracy of the released model")
    ax.set_title(
        f"MNIST MLP, total eps {s['epsilon']:g} (delta {s['delta']:g}, RDP), "
        f"mean trials {s['mean_trials']:g}" + (" [quick]" if out["quick"] else ""),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

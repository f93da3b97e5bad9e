"""User-level DP-SGD on MNIST with simulated users: what each epsilon costs.

Users are simulated by splitting MNIST's training set among U users, either
evenly (600 users of 100 examples) or with skewed sizes (log-normal, the same
total; the examples of a user drawn at random, so users are IID).  For each
split and target epsilon (3 and 8, delta 1e-5, PLD accountant):

* ``user``    -- user-level DP-SGD (`DPModel.fit(..., user_ids=...)`): users
  Poisson-sampled, each user's summed gradient clipped, noise calibrated so
  that the run is (eps, delta)-DP for USERS; also the example-level epsilon
  the same run implies (`dpfl_tf.keras.users.example_level_epsilon`);
* ``example`` -- example-level DP-SGD at the same epsilon for EXAMPLES, and
  what that says about a user of k examples (group privacy: k * eps, with
  delta multiplied by k e^((k-1) eps) -- vacuous for k = 100).

    python experiments/user_level.py --quick     # minutes: a smoke run
    python experiments/user_level.py --seeds 0 1 2   # the full run, 3 repeats

Writes results/user_level[_quick].json and results/user_level[_quick].png.
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
    p.add_argument("--epsilons", type=float, nargs="+", default=[3.0, 8.0])
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        default=[0],
        help="one repeat per seed: it seeds the split into users (the training draws "
        "fresh entropy); the figure shows the mean and the spread",
    )
    return p.parse_args(argv)


def settings(quick: bool) -> dict:
    if quick:
        return dict(
            users=60,
            per_user=100,
            test=2000,
            user_epochs=4,
            users_per_lot=12,
            cap=None,
            skew_cap=32,
            example_epochs=4,
            example_lot=300,
            hidden=64,
            lr=1.0,
            clip=1.0,
        )
    return dict(
        users=600,
        per_user=100,
        test=10000,
        user_epochs=40,
        users_per_lot=60,
        cap=None,
        skew_cap=64,
        example_epochs=20,
        example_lot=600,
        hidden=256,
        lr=1.0,
        clip=1.0,
    )


def split_users(n: int, users: int, skewed: bool, rng) -> np.ndarray:
    """One user id per example: even sizes, or log-normal sizes (sigma 1.5,
    at least 1 each) with the same total; examples assigned at random."""
    if skewed:
        w = rng.lognormal(0.0, 1.5, size=users)
        sizes = 1 + np.floor(w / w.sum() * (n - users)).astype(int)
        sizes[: n - sizes.sum()] += 1
    else:
        sizes = np.full(users, n // users)
    ids = np.repeat(np.arange(users), sizes)
    return rng.permutation(ids)


def main(argv=None):
    args = parse_args(argv)
    import keras

    from dpfl_tf.data import load_dataset
    from dpfl_tf.keras import DPSGD, DPModel
    from dpfl_tf.keras.users import example_level_epsilon
    from dpfl_tf.privacy import calibrate_noise_multiplier, dp_sgd_event

    s = settings(args.quick)
    ds = load_dataset("mnist")
    n = s["users"] * s["per_user"]
    x = ds.x_train[:n].reshape(n, -1).astype("float32") / 255.0
    y = ds.y_train[:n].astype("int64")
    x_te = ds.x_test[: s["test"]].reshape(s["test"], -1).astype("float32") / 255.0
    y_te = ds.y_test[: s["test"]].astype("int64")
    delta = args.delta

    def model():
        keras.utils.set_random_seed(int.from_bytes(os.urandom(4), "little"))
        return keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(s["hidden"], activation="relu"),
                keras.layers.Dense(10),
            ]
        )

    def compiled(sigma):
        m = DPModel(model(), accountant="pld")
        m.compile(
            optimizer=DPSGD(s["lr"], momentum=0.9, l2_norm_clip=s["clip"], noise_multiplier=sigma),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return m

    def accuracy(m):
        return float(np.mean(m.predict(x_te, verbose=0).argmax(1) == y_te))

    def one_repeat(seed, eps, splits):
        runs = []
        for split, ids in splits.items():
            sizes = np.bincount(ids)
            q = s["users_per_lot"] / s["users"]
            lots = s["user_epochs"] * (s["users"] // s["users_per_lot"])
            sigma, _ = calibrate_noise_multiplier(
                eps, delta, lambda z: dp_sgd_event(z, lots, sampling_rate=q), "pld"
            )
            cap = s["skew_cap"] if split == "skewed" else s["cap"]
            start = time.time()
            m = compiled(sigma)
            m.fit(
                x,
                y,
                lot_size=s["users_per_lot"],
                epochs=s["user_epochs"],
                user_ids=ids,
                max_examples_per_user=cap,
                verbose=0,
            )
            run = {
                "seed": seed,
                "level": "user",
                "split": split,
                "target_epsilon": eps,
                "noise_multiplier": sigma,
                "users": s["users"],
                "users_per_lot": s["users_per_lot"],
                "lots": m.lots_computed,
                "max_examples_per_user": cap,
                "user_sizes": {
                    "min": int(sizes.min()),
                    "median": float(np.median(sizes)),
                    "max": int(sizes.max()),
                },
                "user_epsilon": m.epsilon(delta),
                "example_epsilon_implied": example_level_epsilon(sigma, q, lots, delta),
                "test_accuracy": accuracy(m),
                "seconds": round(time.time() - start, 1),
            }
            runs.append(run)
            print(json.dumps(run), flush=True)
            keras.backend.clear_session()
        # example-level DP-SGD at the same epsilon (the split does not matter)
        lot = s["example_lot"]
        lots = s["example_epochs"] * (n // lot)
        sigma, _ = calibrate_noise_multiplier(
            eps, delta, lambda z: dp_sgd_event(z, lots, sampling_rate=lot / n), "pld"
        )
        start = time.time()
        m = compiled(sigma)
        m.fit(x, y, lot_size=lot, epochs=s["example_epochs"], verbose=0)
        e = m.epsilon(delta)
        k = s["per_user"]
        # group privacy (Dwork & Roth 2014): k examples, (k eps, k e^((k-1) eps) delta)
        group_delta = math.exp(min(0.0, math.log(k) + (k - 1) * e + math.log(delta)))
        run = {
            "seed": seed,
            "level": "example",
            "split": "any",
            "target_epsilon": eps,
            "noise_multiplier": sigma,
            "lot_size": lot,
            "lots": m.lots_computed,
            "example_epsilon": e,
            "group_privacy_for_a_user_of_k_examples": {
                "k": k,
                "epsilon": k * e,
                "delta": group_delta,
            },
            "test_accuracy": accuracy(m),
            "seconds": round(time.time() - start, 1),
        }
        runs.append(run)
        print(json.dumps(run), flush=True)
        keras.backend.clear_session()
        return runs

    runs = []
    for seed in args.seeds:
        rng = np.random.default_rng(seed)
        splits = {
            "even": split_users(n, s["users"], False, rng),
            "skewed": split_users(n, s["users"], True, rng),
        }
        for eps in args.epsilons:
            runs += one_repeat(seed, eps, splits)

    out = {
        "experiment": "user_level",
        "quick": args.quick,
        "commit": commit_of(),
        "settings": {**s, "delta": delta, "accountant": "pld", "seeds": args.seeds},
        "summary": summarise(runs),
        "runs": runs,
    }
    name = "user_level_quick" if args.quick else "user_level"
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, name + ".json"), "w") as f:
        json.dump(out, f, indent=1)
    figure(out, os.path.join(RESULTS, name + ".png"))


def summarise(runs: list) -> list:
    """Mean and standard deviation of the test accuracy over the seeds, per cell."""
    cells = {}
    for r in runs:
        cells.setdefault((r["level"], r["split"], r["target_epsilon"]), []).append(r)
    return [
        {
            "level": level,
            "split": split,
            "target_epsilon": eps,
            "seeds": len(rs),
            "test_accuracy_mean": float(np.mean([r["test_accuracy"] for r in rs])),
            "test_accuracy_sd": float(np.std([r["test_accuracy"] for r in rs], ddof=1))
            if len(rs) > 1
            else 0.0,
            "example_epsilon_implied": rs[0].get("example_epsilon_implied"),
            "user_epsilon": rs[0].get("user_epsilon"),
        }
        for (level, split, eps), rs in cells.items()
    ]


def figure(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    groups = [("user", "even"), ("user", "skewed"), ("example", "any")]
    labels = ["user-level, even users", "user-level, skewed users", "example-level"]
    eps = sorted({r["target_epsilon"] for r in out["runs"]})
    width = 0.8 / len(groups)
    summary = out.get("summary") or summarise(out["runs"])
    for j, (level, split) in enumerate(groups):
        cells = [
            next(
                (
                    c
                    for c in summary
                    if c["level"] == level and c["split"] == split and c["target_epsilon"] == e
                ),
                None,
            )
            for e in eps
        ]
        acc = [np.nan if c is None else c["test_accuracy_mean"] for c in cells]
        sd = [0.0 if c is None else c["test_accuracy_sd"] for c in cells]
        xs = np.arange(len(eps)) + j * width
        ax.bar(xs, acc, width, yerr=sd, capsize=3, label=labels[j])
        for x_, a, c in zip(xs, acc, cells):
            if c is not None:
                text = f"{100 * a:.1f}%"
                if c.get("example_epsilon_implied"):
                    text += f"\n(ex. eps {c['example_epsilon_implied']:.1f})"
                ax.text(x_, a + 0.005, text, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(np.arange(len(eps)) + width, [f"eps = {e:g}" for e in eps])
    ax.set_ylabel("test accuracy")
    lows = [c["test_accuracy_mean"] for c in summary]
    ax.set_ylim(max(0.0, min(lows) - 0.1), 1.0)
    ax.set_title(
        "MNIST MLP: epsilon for users vs. for examples (delta %g, PLD; mean and sd of %d "
        "seeds)%s"
        % (
            out["settings"]["delta"],
            max(c["seeds"] for c in summary),
            " [quick]" if out["quick"] else "",
        ),
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()

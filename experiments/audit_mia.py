"""Empirical privacy audit of the MNIST models: membership inference.

    python experiments/audit_mia.py            # full run (paper noise levels, 10,000 members)
    python experiments/audit_mia.py --quick    # smoke run (1,000 members, a few epochs)

The MNIST training set is split at random (seed 0: the audit is reproducible,
the DP noise is not -- it comes from OS entropy) into *members*, the training
set of every model, and as many *non-members*, never trained on; both come
from the same distribution, as the membership game requires.  Models:

* ``nonprivate``: no projection, Dense 1000 ReLU, trained without noise for
  many epochs on the members -- the overfit-prone reference that shows the
  attacks work;
* ``dp_eps8``, ``dp_eps2``, ``dp_eps0.5``: the MNIST recipe's DP pipeline
  (Abadi et al. 2016, section 5.2): DP-PCA to 60 dimensions + Dense 1000 ReLU
  with DP-SGD, the paper's noise multipliers (sigma = 2 / 4 / 8, DP-PCA
  sigma_p = 4 / 7 / 16), trained until the accountant's epsilon reaches the
  target.  ``--quick`` calibrates sigma so that a few epochs spend the target.

Then the attacks of `dpfl_tf.audit` (loss threshold, logistic regression, MLP;
half of the members and non-members train the attack, the other half is held
out for every reported number) and the epsilon lower bounds.  A
Clopper-Pearson lower bound (95 %) above the accountant's epsilon is a
**violation**: it is printed, listed under ``"violations"`` in the results,
and the script exits with status 1 (after writing the results).

tensorflow-privacy's attack library is not compared: it does not import on
current TensorFlow, and the tensorflow-privacy 0.9.0 wheel does not ship it
either (``tensorflow_privacy.privacy.membership_inference_attack`` imports
``privacy.privacy_tests``, which the wheel lacks), even on TensorFlow 2.15.

Writes ``results/audit_mia.json`` (``results/audit_mia_quick.json`` with
``--quick`` unless ``--output`` is given) and the ROC figure beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np
from _common import RESULTS

from dpfl_tf._io import atomic_write_json

ATTACKS = ("loss_threshold", "logistic_regression", "mlp")
TARGETS = {
    "dp_eps8": ("small_noise", 8.0),
    "dp_eps2": ("medium_noise", 2.0),
    "dp_eps0.5": ("large_noise", 0.5),
}


def configs(quick: bool) -> dict:
    """The MnistConfig of each audited model."""
    from dpfl_tf.recipes.mnist import PAPER_SETTINGS, MnistConfig

    base = dict(
        hidden_units=1000,
        l2_norm_clip=4.0,
        learning_rate=0.1,
        final_learning_rate=0.052,
        decay_epochs=10,
        delta=1e-5,
        accountant="moments",
    )
    runs = {
        "nonprivate": MnistConfig(
            setting="nonprivate",
            private=False,
            projection="none",
            target_epsilon=None,
            lot_size=50,
            epochs=20 if quick else 200,
            noise_multiplier=None,
            **{**base, "final_learning_rate": 0.1, "decay_epochs": 0},
        )
    }
    for name, (setting, eps) in TARGETS.items():
        paper = PAPER_SETTINGS[setting]
        runs[name] = MnistConfig(
            setting=name,
            projection="dp_pca",
            pca_dim=60,
            pca_noise_multiplier=paper["pca_noise_multiplier"],
            target_epsilon=eps,
            # quick: sigma calibrated so that 3 epochs spend eps; full: the paper's sigma,
            # training until eps is spent (the epoch count is only a cap)
            noise_multiplier=None if quick else paper["noise_multiplier"],
            lot_size=100 if quick else 600,
            batch_size=1024,
            epochs=3 if quick else 1000,
            **base,
        )
    return runs


def train(config, data):
    """One model as the MNIST recipe builds it (same projection code, model,
    schedule, calibration and budget stop); returns the model, the projected
    (members, non-members) inputs and the ledger.  `data.x_test` holds the
    non-members, so they get exactly the members' projection."""
    import dp_accounting
    import keras

    from dpfl_tf.keras import DPSGD, DPModel
    from dpfl_tf.models import mlp
    from dpfl_tf.privacy import (
        PrivacyLedger,
        calibrate_noise_multiplier,
        dp_sgd_event,
        gaussian_step_event,
        max_steps,
    )
    from dpfl_tf.recipes.common import EpochHistory, paper_learning_rate
    from dpfl_tf.recipes.mnist import _inputs

    ledger = PrivacyLedger(config.accountant) if config.private else None
    x_members, x_nonmembers, _ = _inputs(config, data, ledger)
    y = data.y_train.astype("int64")
    n = len(y)
    lots_per_epoch = max(1, n // config.lot_size)
    net = mlp(x_members.shape[1], config.hidden_units)
    lr = paper_learning_rate(
        config.learning_rate, config.final_learning_rate, config.decay_epochs, lots_per_epoch
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if not config.private:
        net.compile(optimizer=keras.optimizers.SGD(lr), loss=loss)
        net.fit(x_members, y, batch_size=config.lot_size, epochs=config.epochs, verbose=0)
        return net, x_members, x_nonmembers, None, config
    if config.noise_multiplier is None:

        def event_for(sigma):
            return dp_accounting.ComposedDpEvent(
                [
                    ledger.event,
                    dp_sgd_event(
                        sigma, config.epochs * lots_per_epoch, sampling_rate=config.lot_size / n
                    ),
                ]
            )

        sigma, _ = calibrate_noise_multiplier(
            config.target_epsilon, config.delta, event_for, config.accountant, tolerance=1e-3
        )
        config = dataclasses.replace(config, noise_multiplier=sigma)
    lots = max_steps(
        config.target_epsilon,
        config.delta,
        gaussian_step_event(config.noise_multiplier, sampling_rate=config.lot_size / n),
        config.accountant,
        already_spent=ledger.event,
        limit=config.epochs * lots_per_epoch,  # more are never run
    )
    epochs = min(config.epochs, EpochHistory.estimated_epochs(lots, lots_per_epoch))
    model = DPModel(net, ledger=ledger)
    model.compile(
        optimizer=DPSGD(
            lr, l2_norm_clip=config.l2_norm_clip, noise_multiplier=config.noise_multiplier
        ),
        loss=loss,
    )
    model.fit(
        x_members,
        y,
        lot_size=config.lot_size,
        batch_size=config.batch_size,
        epochs=epochs,
        target_epsilon=config.target_epsilon,
        target_delta=config.delta,
        verbose=0,
    )
    return model, x_members, x_nonmembers, model.privacy_ledger, config


def split_members(dataset, members: int, seed: int = 0):
    """(members-as-train, non-members-as-test) Dataset: disjoint random halves
    of the MNIST training set."""
    if 2 * members > len(dataset.y_train):
        raise ValueError(f"--members must be <= {len(dataset.y_train) // 2}, got {members}")
    perm = np.random.default_rng(seed).permutation(len(dataset.y_train))
    m, nm = np.sort(perm[:members]), np.sort(perm[members : 2 * members])
    return dataclasses.replace(
        dataset,
        x_train=dataset.x_train[m],
        y_train=dataset.y_train[m],
        x_test=dataset.x_train[nm],
        y_test=dataset.y_train[nm],
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small and short: a smoke run")
    p.add_argument(
        "--members", type=int, default=None, help="training-set size (default 10000; --quick 1000)"
    )
    p.add_argument("--only", nargs="*", help="model names to run (default all)")
    p.add_argument("--confidence", type=float, default=0.95)
    p.add_argument("--output", default=None)
    p.add_argument("--data-dir", default=None)
    args = p.parse_args(argv)

    from dpfl_tf.audit import attack_features, run_attacks_on_features
    from dpfl_tf.data import load_dataset
    from dpfl_tf.plotting import plot_roc_curves, save_figure
    from dpfl_tf.recipes.common import accuracy, privacy_summary

    members = args.members or (1000 if args.quick else 10000)
    out = args.output or os.path.join(
        RESULTS, "audit_mia_quick.json" if args.quick else "audit_mia.json"
    )
    data = split_members(load_dataset("mnist", data_dir=args.data_dir), members)
    runs = {k: v for k, v in configs(args.quick).items() if not args.only or k in args.only}
    report = {
        "experiment": "membership inference audit of MNIST models",
        "command": " ".join(["python", "experiments/audit_mia.py", *sys.argv[1:]]),
        "quick": args.quick,
        "dataset": data.source.label,
        "members": members,
        "nonmembers": members,
        "split_seed": 0,
        "attack_split": "half of the members and half of the non-members train the "
        "attack; all numbers are on the other halves",
        "confidence": args.confidence,
        "epsilon_lower_bound_ci": "Clopper-Pearson (one-sided, (1 - confidence) / 2 "
        "per rate) at a threshold fixed on the attack's "
        "training half",
        "epsilon_lower_bound": "plug-in point estimate, max over thresholds of the "
        "held-out ROC (optimistic; not a valid bound)",
        "models": [],
        "violations": [],
    }
    figures = {}
    for name, config in runs.items():
        print(f"[{name}] training on {members} members ...", flush=True)
        start = time.perf_counter()
        model, x_m, x_n, ledger, config = train(config, data)
        seconds = time.perf_counter() - start
        y_m, y_n = data.y_train.astype("int64"), data.y_test.astype("int64")
        feats = [attack_features(model, x, y) for x, y in ((x_m, y_m), (x_n, y_n))]
        results = run_attacks_on_features(
            *feats, delta=config.delta, attacks=ATTACKS, seed=0, confidence=args.confidence
        )
        eps = ledger.epsilon(config.delta) if ledger is not None else None
        entry = {
            "name": name,
            **privacy_summary(ledger, config.delta, None),
            "epsilon": eps,
            "delta": config.delta,
            "noise_multiplier": config.noise_multiplier if config.private else None,
            "pca_noise_multiplier": (
                config.pca_noise_multiplier if config.projection == "dp_pca" else None
            ),
            "lots": model.lots_applied if config.private else None,
            "member_accuracy": accuracy(model, x_m, y_m),
            "nonmember_accuracy": accuracy(model, x_n, y_n),
            "mean_loss_members": float(feats[0].loss.mean()),
            "mean_loss_nonmembers": float(feats[1].loss.mean()),
            "train_seconds": seconds,
            "config": {**dataclasses.asdict(config), "deltas": list(config.deltas)},
            "attacks": {k: r.to_dict(roc_points=100) for k, r in results.items()},
        }
        best_ci = max(r.epsilon_lower_bound_ci for r in results.values())
        best_plugin = max(r.epsilon_lower_bound for r in results.values())
        entry["max_epsilon_lower_bound_ci"] = best_ci
        entry["max_epsilon_lower_bound_plugin"] = best_plugin
        if eps is not None:
            entry["violation"] = best_ci > eps
            entry["plugin_exceeds_epsilon"] = best_plugin > eps  # informational only
            if best_ci > eps:
                msg = (
                    f"VIOLATION: {name}: measured epsilon lower bound {best_ci:.3f} "
                    f"({args.confidence:.0%} Clopper-Pearson) exceeds the accountant's "
                    f"epsilon {eps:.3f} -- a bug to find"
                )
                print(msg, file=sys.stderr, flush=True)
                report["violations"].append(msg)
        report["models"].append(entry)
        figures[name] = results
        line = ", ".join(
            f"{k} AUC {r.auc:.3f} adv {r.advantage:.3f} eps_lb {r.epsilon_lower_bound_ci:.3f}"
            for k, r in results.items()
        )
        print(
            f"[{name}] epsilon={'inf' if eps is None else f'{eps:.3f}'} "
            f"acc member/non-member {entry['member_accuracy']:.3f}/"
            f"{entry['nonmember_accuracy']:.3f}; {line}",
            flush=True,
        )

    atomic_write_json(out, report)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(figures), figsize=(4.2 * len(figures), 4), squeeze=False)
    for ax, (name, results) in zip(axes[0], figures.items()):
        entry = next(e for e in report["models"] if e["name"] == name)
        eps = entry["epsilon"]
        plot_roc_curves(
            results,
            ax,
            title=f"{name}: eps = "
            f"{'inf' if eps is None else f'{eps:.2f}'}, lower bound "
            f"{entry['max_epsilon_lower_bound_ci']:.2f}",
        )
    fig.tight_layout()
    figure = os.path.splitext(out)[0] + "_roc.png"
    save_figure(fig, figure)
    print(f"results: {out}  figure: {figure}")
    if report["violations"]:
        print(f"{len(report['violations'])} violation(s): see {out}", file=sys.stderr)
        return 1
    print("no violation: every measured lower bound is below the accountant's epsilon")
    return 0


if __name__ == "__main__":
    sys.exit(main())

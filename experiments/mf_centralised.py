"""Centralised DP training with correlated noise vs DP-SGD, at equal epsilon.

Methods (each with the participation it needs; `docs/concepts/correlated-noise.md`):
  dpsgd       DP-SGD, Poisson lots (q = L / N), independent noise;
  banded      banded MF (16 bands or the lots of an epoch, if fewer), shuffled
              epochs: one Gaussian for the run, no amplification;
  amplified   amplified banded MF: cyclic Poisson lots over b groups, b bands,
              b chosen among 2, 4, 8, 16 by the predicted error sigma_b^2 E(c_b);
  tree        DP-FTRL tree aggregation restarted every epoch, shuffled epochs.

Sigma is calibrated for each (method, epsilon) at delta = 1e-5 with the RDP
accountant; the same recipe otherwise (lot, clip, learning rate, epochs).

  python experiments/mf_centralised.py --quick        # minutes: MNIST slice, eps 8
  python experiments/mf_centralised.py --dataset mnist --seeds 3
  python experiments/mf_centralised.py --dataset cifar10 --epsilon 3 --methods dpsgd \
      --tag cifar10 --append --seeds 1     # one CIFAR-10 run a process (~13 GB each)
  python experiments/mf_centralised.py --part cost    # a banded-MF lot vs a DP-SGD lot

Writes results/mf_centralised[_quick][_TAG].json (every run with its settings)
and the .png beside it; the cost part results/mf_cost[_quick].json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time

from _common import RESULTS, command_line, commit_of, peak_rss_mb, runs_to_append

DELTA = 1e-5
METHODS = ("dpsgd", "banded", "amplified", "tree")
#: recipe per dataset: Papernot et al. 2021's tanh CNN on MNIST; on CIFAR-10
#: `dpfl-tf train cifar10 --model scatter_linear --no-mirror-views --epochs 30`
#: (Tramer & Boneh 2021's ScatterNet + linear, channels standardised with the
#: recipe's DP statistics, whose release is composed into every epsilon)
RECIPES = {
    "mnist": dict(model="tanh_cnn", lot=256, clip=0.1, lr=4.0, momentum=0.0, epochs=15),
    "cifar10": dict(model="scatter_linear", lot=8192, clip=0.1, lr=4.0, momentum=0.9, epochs=30),
}


def load(dataset: str, train_size: int | None):
    import numpy as np

    from dpfl_tf.data import load_dataset

    ds = load_dataset(dataset)
    x, y = ds.x_train, ds.y_train.astype("int64")
    xt, yt = ds.x_test, ds.y_test.astype("int64")
    if train_size:
        x, y = x[:train_size], y[:train_size]
    if dataset == "mnist":
        x = x.astype("float32") / 255.0
        xt = xt.astype("float32") / 255.0
        return x.reshape(-1, 28, 28, 1), y, xt.reshape(-1, 28, 28, 1), yt
    from dpfl_tf.recipes.mnist import _scattered

    # the recipe's scattering features (pixels in [0, 1], J = 2, L = 8; cached on disk)
    features = _scattered((x, xt))
    return np.asarray(features[0]), y, np.asarray(features[1]), yt


def feature_statistics(dataset: str, x, shuffled: bool, epsilon: float):
    """CIFAR-10: the recipe's DP channel statistics (`feature_norm="dp_stats"`),
    as (normalisation layer, its event) under the method's neighbouring
    relation: add/remove-one, or replace-one for the shuffled methods (each of
    its Gaussian sums moves by twice its bound: the effective multiplier / 2).
    Their noise multiplier is the recipe's x max(1, 3 / epsilon), and x 2 more
    under replace-one, so that they cost every method the same epsilon: 0.69 at
    epsilon 3 and 8, 0.21 at epsilon 1 (delta 1e-5, RDP; the recipe's alone
    would cost 1.48 of epsilon 1 under replace-one).  Their noise
    is unseeded (OS entropy), as the training noise: a seeded release's noise
    could be regenerated from the seed the results file records.
    MNIST: (None, None), the tanh CNN takes the pixels."""
    if dataset != "cifar10":
        return None, None
    from dpfl_tf.privacy import to_replace_one
    from dpfl_tf.recipes.mnist import MnistConfig, feature_norm_release
    from dpfl_tf.scattering import scattering_channels

    config = MnistConfig(dataset="cifar10", model="scatter_linear", feature_norm="dp_stats")
    scale = max(1.0, 3.0 / epsilon) * (2.0 if shuffled else 1.0)
    config = dataclasses.replace(
        config, feature_norm_noise_multiplier=config.feature_norm_noise_multiplier * scale
    )
    release = feature_norm_release(config, x.shape[-1] // scattering_channels(2, 8))
    layer = release.fit(x).layer()
    event = release.planned_event()
    return layer, (to_replace_one(event) if shuffled else event)


def make_model(recipe, input_shape, normalization=None):
    from dpfl_tf import models

    if recipe["model"] == "tanh_cnn":
        return models.tanh_cnn(input_shape)
    return models.scatter_linear(input_shape, normalization=normalization)


def calibrate(method: str, epsilon: float, n: int, lot: int, epochs: int, bands: int, before=None):
    """(sigma, epsilon, event description) for the method at epsilon, after the
    release `before` (an event, or None) made before training."""
    import dp_accounting

    from dpfl_tf.privacy import (
        ReplaceOneGaussianDpEvent,
        calibrate_noise_multiplier,
        describe_event,
        dp_sgd_event,
    )

    steps = epochs * (n // lot)
    if method == "dpsgd":

        def make(s):
            return dp_sgd_event(s, steps, sampling_rate=lot / n)
    elif method == "amplified":
        q, cycles = bands * lot / n, math.ceil(steps / bands)

        def make(s):
            return dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(s)), cycles
            )
    else:  # shuffled epochs: the data's order fixes the lots, replace-one (sigma / 2)

        def make(s):
            return ReplaceOneGaussianDpEvent(s / 2)

    if before is not None:
        training = make

        def make(s):
            return dp_accounting.ComposedDpEvent([before, training(s)])

    sigma, eps = calibrate_noise_multiplier(epsilon, DELTA, make, "rdp", tolerance=1e-3)
    return sigma, eps, describe_event(make(sigma))


def choose_amplified_bands(epsilon, n, lot, epochs, candidates=(2, 4, 8, 16), before=None):
    """b minimising sigma_b^2 E(c_b) (the predicted squared error of the prefix
    sums; ||c_b|| = 1, one participation's sensitivity), after jax-privacy's
    amplified BandMF helper (Choquette-Choo et al. 2023, section 5)."""
    from dpfl_tf.privacy.matrix_factorization import optimize_banded_toeplitz

    steps = epochs * (n // lot)
    best = None
    for b in candidates:
        if b > n // lot:
            continue
        sigma = calibrate("amplified", epsilon, n, lot, epochs, b, before)[0]
        error = float(optimize_banded_toeplitz(steps, b).prefix_errors(steps).mean())
        score = sigma**2 * error
        if best is None or score < best[0]:
            best = (score, b)
    return best[1]


def run_one(dataset, method, epsilon, seed, data, recipe, epochs, verbose=0):
    import keras

    from dpfl_tf.keras import DPSGD, DPModel
    from dpfl_tf.privacy import PrivacyLedger
    from dpfl_tf.privacy.matrix_factorization import DEFAULT_MAX_BANDS, CorrelatedNoiseConfig

    x, y, xt, yt = data
    n, lot = len(x), recipe["lot"]
    per = n // lot
    norm, before = feature_statistics(
        dataset, x, shuffled=method in ("banded", "tree"), epsilon=epsilon
    )
    bands = {"banded": min(DEFAULT_MAX_BANDS, per), "tree": None, "dpsgd": None}.get(method)
    if method == "amplified":
        bands = choose_amplified_bands(epsilon, n, lot, epochs, before=before)
    sigma, eps, event = calibrate(method, epsilon, n, lot, epochs, bands or 1, before)
    config = None
    sampling = {
        "dpsgd": "poisson",
        "banded": "shuffle",
        "tree": "shuffle",
        "amplified": "cyclic_poisson",
    }[method]
    if method != "dpsgd":
        config = CorrelatedNoiseConfig("tree" if method == "tree" else "banded", bands=bands)
    keras.utils.set_random_seed(seed)
    ledger = PrivacyLedger("rdp")
    if before is not None:  # the statistics the normalisation layer was built from
        ledger.record(before, label="dp_feature_norm")
    dp = DPModel(make_model(recipe, x.shape[1:], norm), ledger=ledger)
    dp.compile(
        optimizer=DPSGD(
            recipe["lr"],
            recipe["momentum"],
            l2_norm_clip=recipe["clip"],
            noise_multiplier=sigma,
            correlated_noise=config,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    start = time.perf_counter()
    history = dp.fit(
        x,
        y,
        lot_size=lot,
        epochs=epochs,
        sampling=sampling,
        verbose=verbose,
        validation_data=(xt, yt),
        log_train_metrics=False,  # the training loss and accuracy are not private
        target_epsilon=epsilon,
        target_delta=DELTA,
    )
    seconds = time.perf_counter() - start
    run = dp.optimizer.correlated_run
    return {
        "dataset": dataset,
        "method": method,
        "target_epsilon": epsilon,
        "seed": seed,
        "epsilon": dp.epsilon(DELTA),
        "delta": DELTA,
        "noise_multiplier": sigma,
        "event": event,
        "bands": bands,
        "sampling": sampling,
        "mechanism": run.mechanism.describe() if run is not None else None,
        "test_accuracy": float(history.history["val_accuracy"][-1]),
        "accuracy_by_epoch": [float(a) for a in history.history["val_accuracy"]],
        "lots": dp.lots_computed,
        "seconds": seconds,
        "train_size": n,
        "recipe": {**recipe, "epochs": epochs},
    }


def accuracy_results(args) -> str:
    """The accuracy part's results path, without its extension (.json, .png)."""
    return os.path.join(
        RESULTS,
        "mf_centralised" + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else ""),
    )


def part_accuracy(args):
    datasets = ["mnist"] if args.quick else args.dataset
    epsilons = [8.0] if args.quick else args.epsilon
    seeds = range(args.first_seed, args.first_seed + (1 if args.quick else args.seeds))
    methods = ("dpsgd", "banded", "amplified") if args.quick else args.methods
    out = accuracy_results(args)
    runs, command, commit = [], command_line(), commit_of()
    if args.append:
        planned = {(d, e, m, s) for d in datasets for e in epsilons for m in methods for s in seeds}
        runs, command, commit = runs_to_append(
            out + ".json",
            planned,
            lambda r: (r["dataset"], r["target_epsilon"], r["method"], r["seed"]),
            command,
            commit,
        )
    for dataset in datasets:
        recipe = RECIPES[dataset]
        epochs = 2 if args.quick else (args.epochs or recipe["epochs"])
        data = load(dataset, 6000 if args.quick else args.train_size)
        for epsilon in epsilons:
            for method in methods:
                for seed in seeds:
                    result = run_one(dataset, method, epsilon, seed, data, recipe, epochs)
                    runs.append(result)
                    print(
                        f"{dataset} eps={epsilon:g} {method:9s} seed={seed}: "
                        f"acc={result['test_accuracy']:.4f} sigma="
                        f"{result['noise_multiplier']:.3f} ({result['seconds']:.0f} s)",
                        flush=True,
                    )
                    _write(out, args, runs, command, commit)
    _figure(out, runs, args.quick)


def _write(out, args, runs, command, commit):
    from dpfl_tf._io import atomic_write_json

    os.makedirs(RESULTS, exist_ok=True)
    atomic_write_json(  # a reader never sees half a file
        out + ".json",
        {
            "command": command,
            "commit": commit,
            "quick": args.quick,
            "shared_machine": args.shared_machine,
            "delta": DELTA,
            "runs": runs,
        },
    )


NAMES = {
    "dpsgd": "DP-SGD",
    "banded": "banded MF",
    "amplified": "amplified banded MF",
    "tree": "DP-FTRL (tree)",
}
SAMPLING = {
    "dpsgd": "Poisson",
    "banded": "shuffled epochs",
    "amplified": "cyclic Poisson",
    "tree": "shuffled epochs",
}


def markdown_table(runs) -> str:
    """The results page's table: every (dataset, epsilon, method)'s mean +- std
    over its seeds (and each seed's accuracy), against DP-SGD."""
    import numpy as np

    lines = [
        "| dataset | epsilon | method | lots | sigma | event | test accuracy | vs DP-SGD |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dataset in sorted({r["dataset"] for r in runs}):
        for eps in sorted({r["target_epsilon"] for r in runs if r["dataset"] == dataset}):
            base = None
            for method in METHODS:
                rr = sorted(
                    (
                        r
                        for r in runs
                        if (r["dataset"], r["target_epsilon"], r["method"])
                        == (dataset, eps, method)
                    ),
                    key=lambda r: r["seed"],
                )
                if not rr:
                    continue
                acc = 100 * np.array([r["test_accuracy"] for r in rr])
                if method == "dpsgd":
                    base = acc.mean()
                lots = SAMPLING[method] + (
                    f", {rr[0]['bands']} groups" if method == "amplified" else ""
                )
                each = " / ".join(f"{a:.2f}" for a in acc)
                cell = (
                    f"{acc.mean():.2f} +- {acc.std():.2f}% ({each})"
                    if len(acc) > 1
                    else f"{acc[0]:.2f}% (1 seed)"
                )
                versus = "--" if method == "dpsgd" or base is None else f"{acc.mean() - base:+.2f}"
                lines.append(
                    f"| {dataset} | {eps:g} | {NAMES[method]} | {lots} | "
                    f"{rr[0]['noise_multiplier']:.3f} | {rr[0]['event']} | {cell} | {versus} |"
                )
    return "\n".join(lines)


def _figure(out, runs, quick):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    datasets = sorted({r["dataset"] for r in runs})
    fig, axes = plt.subplots(1, len(datasets), figsize=(5.5 * len(datasets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        for method in METHODS:
            mine = [r for r in runs if r["dataset"] == dataset and r["method"] == method]
            if not mine:
                continue
            eps = sorted({r["target_epsilon"] for r in mine})
            acc = [[r["test_accuracy"] for r in mine if r["target_epsilon"] == e] for e in eps]
            mean = [np.mean(a) for a in acc]
            err = [np.std(a) for a in acc]
            dpsgd = method == "dpsgd"  # dashed and larger: level with amplified MF, it would hide
            ax.errorbar(
                eps,
                mean,
                yerr=err,
                marker="s" if dpsgd else "o",
                markersize=8 if dpsgd else 5,
                linestyle="--" if dpsgd else "-",
                capsize=3,
                label=method,
                zorder=1 if dpsgd else 2,
            )
        ax.set_xscale("log")
        ax.set_xlabel("epsilon (delta = 1e-5)")
        ax.set_ylabel("test accuracy")
        ax.set_title(
            f"{dataset}: DP-SGD vs correlated noise"
            + (" (quick run: a slice, 2 epochs)" if quick else ""),
            fontsize=9,
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)


def part_cost(args):
    """Time per lot and noise-state memory of banded MF against the band
    width, and DP-SGD's, on one model (the MNIST tanh CNN or a 1000-unit MLP)."""
    import keras
    import numpy as np

    from dpfl_tf import models
    from dpfl_tf.keras import DPSGD, DPModel
    from dpfl_tf.privacy.matrix_factorization import CorrelatedNoiseConfig

    n, lot = (4096, 256) if args.quick else (16384, 256)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 784)).astype("float32")
    y = rng.integers(0, 10, n).astype("int64")
    rows = []
    for bands in [None, 1, 2, 4, 8, 16, 32, 64][: 5 if args.quick else None]:
        keras.utils.set_random_seed(0)
        model = models.mlp(784, 1000)
        params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
        dp = DPModel(model)
        config = None if bands is None else CorrelatedNoiseConfig("banded", bands=bands)
        dp.compile(
            optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, correlated_noise=config),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=1,
        )
        epochs = []

        class Timer(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                self.t = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                epochs.append((time.perf_counter() - self.t) / (n // lot))

        dp.fit(
            x,
            y,
            lot_size=lot,
            epochs=3,
            verbose=0,
            callbacks=[Timer()],
            sampling="in_order" if bands else "shuffle",
            log_train_metrics=False,
        )
        steady = epochs[1:]  # after the first epoch: traced and warm
        run = dp.optimizer.correlated_run
        buffers = run.mechanism.strategy.buffers(run.mechanism.steps) if run else 0
        rows.append(
            {
                "bands": bands,
                "method": "dpsgd" if bands is None else "banded",
                "seconds_per_lot": float(np.min(steady)),
                "noise_state_bytes": buffers * params * 4,
                "parameters": params,
                "peak_rss_mb_so_far": peak_rss_mb(),
                "lot": lot,
                "train_size": n,
            }
        )
        print(rows[-1], flush=True)
    out = os.path.join(RESULTS, "mf_cost" + ("_quick" if args.quick else ""))
    os.makedirs(RESULTS, exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(
            {
                "command": command_line(),
                "commit": commit_of(),
                "quick": args.quick,
                "shared_machine": True,
                "model": "mlp(784, 1000), in-order lots",
                "note": "seconds per lot: an epoch's wall time / its lots, the faster of "
                "epochs 2 and 3 (traced and warm); noise state: "
                "(bands - 1) x parameters x 4 bytes (exact); peak RSS is the "
                "process's so far (grows monotonically across rows)",
                "rows": rows,
            },
            f,
            indent=1,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("accuracy", "cost"), default="accuracy")
    parser.add_argument("--quick", action="store_true", help="minutes: a slice, eps 8, 1 seed")
    parser.add_argument("--dataset", nargs="+", default=["mnist"], choices=sorted(RECIPES))
    parser.add_argument("--epsilon", nargs="+", type=float, default=[1.0, 3.0, 8.0])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", type=int, default=3, help="runs per cell")
    parser.add_argument("--first-seed", type=int, default=0, help="seeds S, S + 1, ...")
    parser.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--train-size", type=int, default=None)
    parser.add_argument(
        "--append",
        action="store_true",
        help="add the runs to the results file's (refusing a run it already holds)",
    )
    parser.add_argument(
        "--table", action="store_true", help="print the results file's table (markdown) and exit"
    )
    parser.add_argument(
        "--shared-machine",
        action="store_true",
        help="record that other jobs shared the cores (the seconds are not benchmarks)",
    )
    parser.add_argument(
        "--tag",
        default="",
        help="suffix of the results' file names (a partial run beside the full one)",
    )
    args = parser.parse_args()
    if args.table:
        with open(accuracy_results(args) + ".json") as f:
            print(markdown_table(json.load(f)["runs"]))
        return
    (part_cost if args.part == "cost" else part_accuracy)(args)


if __name__ == "__main__":
    main()

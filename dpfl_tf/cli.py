"""The `dpfl-tf` command line (also `python -m dpfl_tf`).

Commands:
  privacy   epsilon (or a calibrated noise multiplier) for DP-SGD-style training.
  train     DP-SGD training of the paper's baselines (MNIST / Fashion-MNIST / CIFAR-10).
  federated FedAvg with client-level DP (Global DP, DP-FedAvg) or without.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Callable, Sequence

from dpfl_tf._runs import counted, quiet_tensorflow, result_status
from dpfl_tf._validation import check_count, check_number, float_arg

__all__ = ["main", "build_parser"]


def _add_privacy_parser(sub) -> None:
    p = sub.add_parser(
        "privacy",
        help="epsilon spent by DP-SGD-style training, or the noise for a target",
        description="Privacy of T steps of the sampled Gaussian mechanism (DP-SGD lots).",
    )
    p.add_argument(
        "--sampling-rate",
        "-q",
        type=float_arg,
        help="q = lot size / dataset size, in (0, 1] (Poisson sampling)",
    )
    noise = p.add_mutually_exclusive_group(required=True)
    noise.add_argument(
        "--noise-multiplier", "-s", type=float_arg, help="sigma, noise std / clip bound (>= 0)"
    )
    noise.add_argument(
        "--target-epsilon",
        type=float_arg,
        help="print the smallest noise multiplier reaching this epsilon instead",
    )
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", "-T", type=float_arg, help="number of lots (steps)")
    length.add_argument(
        "--epochs",
        "-E",
        type=float_arg,
        help="epochs; steps = epochs / q (shuffle: epochs x (N // L), an epoch being N // L lots)",
    )
    p.add_argument("--delta", "-d", type=float_arg, required=True, help="delta in (0, 1)")
    p.add_argument(
        "--accountant",
        default="moments",
        choices=["moments", "rdp", "pld", "strong"],
        help="the accountant (default: moments, Abadi et al.'s)",
    )
    p.add_argument(
        "--sampling",
        default="poisson",
        choices=["poisson", "fixed_size", "shuffle"],
        help="how lots are drawn (default: poisson; fixed_size and shuffle need "
        "--dataset-size and --lot-size)",
    )
    p.add_argument("--dataset-size", type=float_arg, help="N (fixed_size / shuffle sampling)")
    p.add_argument("--lot-size", type=float_arg, help="L (fixed_size / shuffle sampling)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run_privacy)


def _privacy_inputs(args, error: Callable[[str], None]) -> dict:
    """Validates the privacy command's numbers; every message names the argument."""
    try:
        sampling = args.sampling
        lots_per_epoch = None
        if sampling == "poisson":
            if args.sampling_rate is None:
                if args.dataset_size is None or args.lot_size is None:
                    error("--sampling-rate is required (or --dataset-size and --lot-size)")
                n = check_count("--dataset-size", args.dataset_size, minimum=1)
                q = check_count("--lot-size", args.lot_size, minimum=1) / n
            else:
                q = check_number(
                    "--sampling-rate", args.sampling_rate, low=0.0, high=1.0, low_open=True
                )
                if args.dataset_size is not None and args.lot_size is not None:
                    n = check_count("--dataset-size", args.dataset_size, minimum=1)
                    implied = check_count("--lot-size", args.lot_size, minimum=1) / n
                    if not math.isclose(q, implied, rel_tol=1e-9):
                        error(
                            f"--sampling-rate {q:g} contradicts --lot-size / --dataset-size "
                            f"= {implied:g}; give one of them"
                        )
            sampling_args = {"sampling_rate": q}
        else:
            if args.sampling_rate is not None:
                error(
                    f"--sampling-rate is for --sampling poisson; --sampling {sampling} takes "
                    f"--dataset-size and --lot-size, got --sampling-rate "
                    f"{args.sampling_rate:g}"
                )
            if args.dataset_size is None or args.lot_size is None:
                error(f"--sampling {sampling} needs --dataset-size and --lot-size")
            n = check_count("--dataset-size", args.dataset_size, minimum=1)
            lot = check_count("--lot-size", args.lot_size, minimum=1)
            if lot > n:
                error(f"--lot-size must be <= --dataset-size ({n}), got {lot}")
            q = lot / n
            sampling_args = {"dataset_size": n, "lot_size": lot}
            if sampling == "shuffle":  # an epoch: a permutation cut into N // L lots of L
                lots_per_epoch = n // lot
        delta = check_number(
            "--delta", args.delta, low=0.0, high=1.0, low_open=True, high_open=True
        )
        if args.steps is not None:
            steps = check_count("--steps", args.steps)
            epochs = steps / lots_per_epoch if lots_per_epoch else steps * q
        else:
            epochs = check_number("--epochs", args.epochs, low=0.0)
            steps = int(round(epochs * lots_per_epoch if lots_per_epoch else epochs / q))
        # shuffle: one Gaussian per epoch touched, a partial epoch counting whole
        epochs_accounted = -(-steps // lots_per_epoch) if lots_per_epoch else None
        sigma = target = None
        if args.noise_multiplier is not None:
            sigma = check_number("--noise-multiplier", args.noise_multiplier, low=0.0)
        else:
            target = check_number("--target-epsilon", args.target_epsilon, low=0.0, low_open=True)
    except ValueError as e:
        error(str(e))
    return dict(
        sampling=sampling,
        sampling_args=sampling_args,
        q=q,
        delta=delta,
        steps=steps,
        epochs=epochs,
        lots_per_epoch=lots_per_epoch,
        epochs_accounted=epochs_accounted,
        sigma=sigma,
        target=target,
    )


def _run_privacy(args, error) -> int:
    from dpfl_tf.privacy import (
        calibrate_noise_multiplier,
        compute_epsilon,
        describe_event,
        dp_sgd_event,
    )

    v = _privacy_inputs(args, error)
    if v["sampling"] == "shuffle":

        def make_event(sigma):
            return dp_sgd_event(sigma, v["steps"], "shuffle", epochs=v["epochs_accounted"])
    else:

        def make_event(sigma):
            return dp_sgd_event(sigma, v["steps"], v["sampling"], **v["sampling_args"])

    try:
        if v["target"] is not None:
            sigma, eps = calibrate_noise_multiplier(
                v["target"], v["delta"], make_event, args.accountant
            )
        else:
            sigma = v["sigma"]
            if sigma == 0 and v["steps"] > 0:
                eps = math.inf  # no noise: said plainly below
            else:
                eps = compute_epsilon(make_event(sigma), v["delta"], args.accountant)
    except ValueError as e:
        error(str(e))
    event = make_event(sigma)
    result = {
        "epsilon": eps,
        "delta": v["delta"],
        "accountant": args.accountant,
        "steps": v["steps"],
        "epochs": v["epochs"],
        "sampling": v["sampling"],
        "sampling_rate": v["q"],
        "noise_multiplier": sigma,
        "event": describe_event(event),
    }
    if v["lots_per_epoch"] is not None:
        result["lots_per_epoch"] = v["lots_per_epoch"]
        result["epochs_accounted"] = v["epochs_accounted"]
    if v["target"] is not None:
        result["target_epsilon"] = v["target"]
    if args.json:
        print(
            json.dumps(
                {
                    k: (None if isinstance(x, float) and math.isinf(x) else x)
                    for k, x in result.items()
                }
                | {"epsilon_is_infinite": math.isinf(eps)}
            )
        )
        return 0
    if math.isinf(eps):
        print(
            "epsilon = inf: noise multiplier 0 adds no noise, so there is no privacy guarantee"
            if sigma == 0
            else "epsilon = inf"
        )
        return 0
    if v["target"] is not None:
        print(
            f"noise_multiplier = {sigma:.4f} reaches epsilon = {eps:.4f} "
            f"(target {v['target']:g}) at delta = {v['delta']:g}"
        )
    else:
        print(f"epsilon = {eps:.4f} at delta = {v['delta']:g}")
    if v["lots_per_epoch"] is not None:
        length = (
            f"{counted(v['steps'], 'steps')}: {counted(v['epochs_accounted'], 'epochs')} of "
            f"{counted(v['lots_per_epoch'], 'lots')} touched"
        )
    else:
        length = f"{counted(v['steps'], 'steps')} ({counted(v['epochs'], 'epochs')})"
    print(f"  {args.accountant} accountant, {length}: {describe_event(event)}")
    return 0


def _train_epilog() -> str:
    import textwrap

    from dpfl_tf.recipes.settings import TRAIN_DEFAULTS

    lines = textwrap.wrap(
        "Each model's defaults (its paper's recipe), and what they reach "
        "at the default epsilon 2, delta 1e-5 (test accuracy on mnist or "
        "cifar10, one run, 2 CPU cores):",
        79,
    )
    for (family, model), d in TRAIN_DEFAULTS.items():
        data = "cifar10" if family == "cifar10" else "mnist, fashion_mnist"
        lines += textwrap.wrap(
            f"{model} ({data}; {d.source}): {d.describe()}. Reaches: {d.reaches}.",
            79,
            initial_indent="  ",
            subsequent_indent="      ",
        )
    lines += textwrap.wrap(
        "Results go to runs/train_<dataset>-<date>-<time>.json unless "
        "--output is given; Ctrl-C stops after the current step and "
        "prints the command that resumes.",
        79,
    )
    return "\n".join(lines)


def _add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train",
        help="DP-SGD training of a paper baseline; prints accuracy and (eps, delta)",
        description="DP-SGD on a paper's model until the privacy budget is spent: Abadi et "
        "al. 2016 (mnist: DP-PCA + MLP; cifar10: frozen pretrained "
        "convolutions), Papernot et al. 2021 (tanh CNN), Tramer & Boneh 2021 "
        "(ScatterNet features). Settings left out take the model's defaults "
        "(below).",
        epilog=_train_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dataset", choices=["mnist", "fashion_mnist", "cifar10"])
    p.add_argument(
        "--model",
        default=None,
        choices=["mlp", "tanh_cnn", "scatter_linear", "scatter_cnn", "convnet"],
        help="default: mlp (mnist, fashion_mnist), convnet (cifar10)",
    )
    p.add_argument(
        "--epsilon",
        type=float_arg,
        default=2.0,
        help="target epsilon, the budget (default: %(default)s)",
    )
    p.add_argument("--delta", type=float_arg, default=1e-5, help="default: %(default)s")
    p.add_argument(
        "--accountant",
        default=None,
        choices=["moments", "rdp", "pld"],
        help="default: the model's (below)",
    )
    p.add_argument(
        "--noise-multiplier",
        type=float_arg,
        help="sigma (default: the model's: the paper's 2 / 4 / 8 by the budget "
        "for mlp, else calibrated so that --epochs epochs spend the budget)",
    )
    p.add_argument(
        "--pca-noise-multiplier",
        type=float_arg,
        help="mlp: sigma of DP-PCA (default: the paper's 4 / 7 / 16)",
    )
    p.add_argument(
        "--epochs",
        type=float_arg,
        default=None,
        help="epochs (an upper bound: training stops when the budget is spent)",
    )
    p.add_argument("--lot-size", type=float_arg, default=None)
    p.add_argument(
        "--clip",
        type=float_arg,
        default=None,
        help="clip bound (convnet: per hidden layer, twice that for the softmax layer)",
    )
    p.add_argument("--lr", type=float_arg, default=None, help="learning rate")
    p.add_argument(
        "--feature-norm",
        default=None,
        choices=["group", "dp_stats"],
        help="scatter models: per-example GroupNorm (group; mnist's default) or "
        "channel statistics released under DP and paid from the budget "
        "(dp_stats; cifar10's default)",
    )
    p.add_argument(
        "--mirror-views",
        default=None,
        action=argparse.BooleanOptionalAction,
        help="scatter models: train on each image and its mirror image, the "
        "model averaging its logits over both (mirror-invariant; same "
        "privacy cost); default on for cifar10, off for mnist and "
        "fashion_mnist",
    )
    p.add_argument(
        "--trained-layers",
        default=None,
        choices=["softmax", "top", "dense"],
        help="convnet: layers trained privately (the convolutions stay frozen; default: top)",
    )
    p.add_argument(
        "--pretrained",
        default=None,
        help="convnet: weights from experiments/cifar10_pretrain.py (default: "
        "models/cifar10_public_convnet.weights.h5 if present, else a short "
        "pretraining on the public split first); the public split they "
        "were trained on is held out, the rest is private",
    )
    p.add_argument("--seed", type=int, help="reproducible run (NOT for deployment)")
    p.add_argument(
        "--output",
        default=None,
        help="results JSON, rewritten after every epoch with a status (running, "
        "completed, budget_spent, interrupted, failed); the figure goes "
        "beside it (.png).  A directory takes train_<dataset>.json inside. "
        "Default: runs/train_<dataset>-<date>-<time>.json",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace the results of a finished run in --output"
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="checkpoint here after every epoch, and resume from it if it holds "
        "a checkpoint of the same run (default: beside the results, written "
        "when the run is interrupted)",
    )
    p.add_argument(
        "--tensorboard",
        default=None,
        metavar="LOG_DIR",
        help="TensorBoard logs (epsilon per lot and epoch); needs "
        "pip install 'dpfl-tf[tensorboard]'",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="where the dataset files are (default: $DPFL_DATA_DIR, the Keras "
        "cache, /usr/share/datasets, then a download)",
    )
    _add_user_level_options(p)
    _add_tune_options(p)
    _add_verbose(p)
    p.set_defaults(func=_run_train)


def _add_user_level_options(p) -> None:
    g = p.add_argument_group(
        "user-level DP-SGD",
        "The unit of privacy becomes a user, all of one person's examples: lots "
        "sample users, each user's summed gradient is clipped, epsilon is per "
        "user and --lot-size (required) counts users. Models without an "
        "example-level release only: tanh_cnn, scatter_linear, scatter_cnn "
        "(with --feature-norm group).",
    )
    who = g.add_mutually_exclusive_group()
    who.add_argument(
        "--user-ids",
        metavar="PATH",
        help="a .npy file of one user id (integers or strings) per training "
        "example, in the training set's order",
    )
    who.add_argument(
        "--users",
        type=float_arg,
        metavar="N",
        help="simulate N users: the training examples dealt to them by "
        "--user-split (seed 0: the same users every run)",
    )
    g.add_argument(
        "--user-split",
        default=None,
        choices=["iid", "unequal", "shards"],
        help="simulated users: iid (nearly equal random shares; default), "
        "unequal (log-normal sizes, sigma 1), shards (two label shards each)",
    )
    g.add_argument(
        "--max-examples-per-user",
        type=float_arg,
        metavar="K",
        help="at most K of a user's examples in a lot (a fresh random subset "
        "every lot; default: all): bounds the examples a user brings to a lot",
    )


def _float_list(text: str) -> tuple:
    """argparse type: comma-separated numbers."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}")
    if not values:
        raise argparse.ArgumentTypeError(f"no number in {text!r}")
    return values


def _add_tune_options(p) -> None:
    g = p.add_argument_group(
        "private hyperparameter search",
        "--tune searches the learning rate and the clip bound (Papernot & "
        "Steinke 2022): a random, secret number of trials, each scored with "
        "noise on training examples held out from every trial's training, "
        "only the best released. --epsilon is the budget of the WHOLE search: "
        "the training noise of every trial is calibrated for it. MNIST-family "
        "and ScatterNet recipes (not convnet); no resume.",
    )
    g.add_argument(
        "--tune", action="store_true", help="run a private search instead of one training run"
    )
    g.add_argument(
        "--tune-trials",
        type=float_arg,
        metavar="MEAN",
        help="the mean number of trials (default 10); with --tune-distribution "
        "fixed, the number of trials",
    )
    g.add_argument(
        "--tune-distribution",
        default=None,
        choices=["geometric", "logarithmic", "poisson", "fixed"],
        help="the number of trials: geometric (default), logarithmic or poisson "
        "(random, secret; rdp accountant), or fixed (all trials composed: "
        "costs far more beyond 2 or 3 trials)",
    )
    g.add_argument(
        "--tune-lr",
        type=_float_list,
        metavar="LR,LR,...",
        help="learning rates to draw from (default: the model's times 0.25, 0.5, 1, 2)",
    )
    g.add_argument(
        "--tune-clip",
        type=_float_list,
        metavar="C,C,...",
        help="clip bounds to draw from (default: the model's times 0.5, 1, 2)",
    )
    g.add_argument(
        "--tune-validation",
        type=float_arg,
        metavar="P",
        help="the probability with which each training example is held out for the "
        "trials' score, by its own content (default 0.1); they stay private: the "
        "score is released with noise",
    )
    g.add_argument(
        "--tune-show-trials",
        action="store_true",
        default=None,
        help="print a line per trial even when the number of trials is random: "
        "the output then shows how many ran, which the search keeps secret "
        "(without it, a random number of trials runs with no per-trial output)",
    )
    g.add_argument(
        "--tune-score-noise",
        type=float_arg,
        metavar="SIGMA",
        help="noise std of the score on the count of correct validation "
        "examples (default 20: accuracy +- 20 / N)",
    )


def _add_verbose(p) -> None:
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show TensorFlow's start-up and log messages",
    )


def _train_settings(args) -> dict:
    """The settings given on the command line, validated, as config fields."""
    given = {}
    for flag, attr, field in (
        ("--epochs", "epochs", "epochs"),
        ("--lot-size", "lot_size", "lot_size"),
        ("--clip", "clip", "l2_norm_clip"),
        ("--lr", "lr", "learning_rate"),
        ("--noise-multiplier", "noise_multiplier", "noise_multiplier"),
        ("--pca-noise-multiplier", "pca_noise_multiplier", "pca_noise_multiplier"),
    ):
        value = getattr(args, attr)
        if value is not None:
            given[field] = (
                check_count(flag, value, minimum=1)
                if field in ("epochs", "lot_size")
                else check_number(flag, value, low=0.0, low_open=True)
            )
    return given


def _run_train(args, error) -> int:
    from dpfl_tf.recipes.settings import defaults_for, train_config

    model = args.model or ("convnet" if args.dataset == "cifar10" else "mlp")
    scatter = model in ("scatter_linear", "scatter_cnn")
    try:
        defaults_for(args.dataset, model)
        for flag, value, ok in (
            ("--feature-norm", args.feature_norm, scatter),
            ("--mirror-views", args.mirror_views, scatter),
            ("--trained-layers", args.trained_layers, model == "convnet"),
            ("--pretrained", args.pretrained, model == "convnet"),
        ):
            if value is not None and not ok:
                raise ValueError(
                    f"{flag} is for --model "
                    + (
                        "scatter_linear and scatter_cnn"
                        if flag.startswith(("--feature", "--mirror"))
                        else "convnet (cifar10)"
                    )
                )
        epsilon = check_number("--epsilon", args.epsilon, low=0.0, low_open=True)
        delta = check_number(
            "--delta", args.delta, low=0.0, high=1.0, low_open=True, high_open=True
        )
        given = _train_settings(args)
        users = _user_level_settings(args, model, given)
        tune = _tune_settings(args, model, users)
    except ValueError as e:
        error(str(e))
    secret_length = tune is not None and tune["distribution"] != "fixed"  # secret count
    _check_outputs(args, error, f"train_{args.dataset}", timed=not secret_length)
    quiet_tensorflow(args.verbose)
    extra = dict(trained_layers=args.trained_layers, pretrained_weights=args.pretrained)
    if scatter:
        extra = dict(feature_norm=args.feature_norm, mirror_views=args.mirror_views)
    elif model != "convnet":
        extra = {}
    accountant = args.accountant
    if tune is not None and accountant is None and tune["distribution"] != "fixed":
        accountant = "rdp"  # Papernot & Steinke's bound is in Renyi DP
    try:
        config = train_config(
            args.dataset,
            model,
            target_epsilon=epsilon,
            delta=delta,
            accountant=accountant,
            seed=args.seed,
            data_dir=args.data_dir,
            **given,
            **extra,
            **users,
        )
        if tune is not None:
            import dataclasses

            from dpfl_tf.recipes.tune import TuneConfig

            # the search calibrates the training noise (mlp: not the paper's by the budget)
            config = dataclasses.replace(config, noise_multiplier=None, setting="custom")
            tune = TuneConfig(**tune)
    except ValueError as e:
        error(str(e))
    if tune is not None:
        return _run_tune(args, error, model, config, tune)
    sigma = "calibrated" if config.noise_multiplier is None else f"{config.noise_multiplier:g}"
    if model == "convnet":
        what = (
            f"convolutions frozen, training {config.trained_layers.value} layers, "
            f"sigma={sigma}, lot={config.lot_size}, clip={config.clip_bounds}"
        )
    else:
        what = (
            f"{model}, sigma={sigma}, lot={config.lot_size}, "
            f"clip={config.l2_norm_clip:g}, lr={config.learning_rate:g}"
        )
        if scatter:
            what += f", {config.feature_norm} normalisation" + (
                ", mirror views" if config.mirror_views else ""
            )
        if users:
            what = what.replace(f"lot={config.lot_size}", f"lot={config.lot_size} users")
    print(
        f"DP-SGD on {args.dataset}: {what}, up to {config.epochs} "
        f"epoch{'' if config.epochs == 1 else 's'}, target epsilon="
        f"{epsilon:g} at delta={delta:g} ({config.accountant} accountant)"
    )
    if model == "convnet" and config.pretrained_weights is None:
        print(
            "note: no pretrained weights given or found in models/; pretraining 30 epochs "
            "on the public split first (python experiments/cifar10_pretrain.py makes "
            "the full model)"
        )
    if users:
        given_by = (
            f"{config.users} simulated users ({config.user_split} split, seed {config.users_seed})"
            if config.users is not None
            else f"the users of {args.user_ids}"
        )
        cap = config.max_examples_per_user
        print(
            f"user-level DP-SGD: {given_by}; lots sample users and clip each user's summed "
            f"gradient ({'all of a user' if cap is None else f'at most {cap} of a user'}'s "
            "examples in a lot); epsilon is per user"
            + (
                " -- here per simulated user, dealt from the examples: it protects no real "
                "person, and one example's epsilon is larger (1.5-2.5 times in typical settings; "
                "dpfl_tf.keras.users.example_level_epsilon computes it)"
                if config.users is not None
                else ""
            )
        )

    def train(**kw):
        if model == "convnet":
            from dpfl_tf.recipes import cifar10

            return cifar10.train_cifar10(config, **kw)
        from dpfl_tf.recipes import mnist

        return mnist.train_mnist(config, **kw)

    def summary(r) -> list:
        line = f"test accuracy = {r['test_accuracy']:.4f} after {counted(r['epochs'], 'epochs')}"
        if model == "convnet":
            line += (
                f" on {r['dataset']} (start {r['pretrained_on_cifar10_test']:.4f}; "
                f"pretraining: {r['pretraining']})"
            )
        else:
            line += (
                f", sigma = {r['noise_multiplier']:.3f}; train accuracy = "
                f"{r['train_accuracy']:.4f} (non-private statistic)"
            )
        unit = ""
        if r.get("privacy_unit") == "user":
            unit = f" per user (user-level: {r['users']} users, {r['examples']} examples)"
        return [
            line,
            f"privacy spent: epsilon = {r['epsilon']:.4f} at delta = {delta:g}{unit} "
            f"({config.accountant}; {r['events']})",
        ]

    return _run_with_results(
        args,
        error,
        train,
        summary,
        unit="epochs",
        resumed=lambda info: (
            f"resumed from {info['directory']}: {info['lots']} lots "
            f"({info['epoch']:.2f} epochs), epsilon so far "
            f"{info['epsilon']:.4f}"
        ),
        progress=lambda r: (
            f"after {r['lots']} lots (in epoch {r['epochs']}; epsilon = {r['epsilon']:.4f})"
        ),
        figure=_save_training_figure,
    )


def _user_level_settings(args, model: str, given: dict) -> dict:
    """The config fields of a user-level run (--user-ids / --users), or {};
    refuses what the recipe cannot account at the user level."""
    import os

    from dpfl_tf.recipes.settings import defaults_for

    if args.user_ids is None and args.users is None:
        for flag, value in (
            ("--user-split", args.user_split),
            ("--max-examples-per-user", args.max_examples_per_user),
        ):
            if value is not None:
                raise ValueError(
                    f"{flag} is for user-level runs: give --users N or --user-ids PATH"
                )
        return {}
    flag = "--user-ids" if args.user_ids is not None else "--users"
    if args.user_split is not None and args.user_ids is not None:
        raise ValueError(
            "--user-split is for simulated users (--users); --user-ids gives the users"
        )
    if model == "convnet":
        raise ValueError(
            f"{flag} is not supported by the convnet recipe (its private examples are "
            "what its public split leaves of CIFAR-10); use --model scatter_linear or "
            "scatter_cnn"
        )
    if model == "mlp":
        raise ValueError(
            f"{flag}: the mlp recipe releases a DP-PCA projection whose unit of privacy "
            "is one example, not a user, so no user-level epsilon would cover it; use "
            "--model tanh_cnn, scatter_linear or scatter_cnn"
        )
    if (args.feature_norm or defaults_for(args.dataset, model).feature_norm) == "dp_stats":
        default = ", this dataset's default" if args.feature_norm is None else ""
        raise ValueError(
            f"{flag}: the DP feature statistics (--feature-norm dp_stats{default}) protect "
            "one example, not a user, so no user-level epsilon would cover them; add "
            "--feature-norm group"
        )
    if "lot_size" not in given:
        raise ValueError(
            f"{flag}: give --lot-size, the expected number of users in a lot (the "
            "model's default lot size counts examples)"
        )
    out = {}
    if args.user_ids is not None:
        if not os.path.isfile(args.user_ids):
            raise ValueError(f"--user-ids {args.user_ids}: no such file")
        out["user_ids"] = os.path.abspath(args.user_ids)
    else:
        out["users"] = check_count("--users", args.users, minimum=1)
        out["user_split"] = args.user_split or "iid"
    if args.max_examples_per_user is not None:
        out["max_examples_per_user"] = check_count(
            "--max-examples-per-user", args.max_examples_per_user, minimum=1
        )
    return out


def _tune_settings(args, model: str, users: dict) -> dict | None:
    """The `TuneConfig` fields of --tune (None without it), checked before any
    data is read; refuses what a search cannot honour."""
    flags = (
        ("--tune-trials", args.tune_trials),
        ("--tune-distribution", args.tune_distribution),
        ("--tune-lr", args.tune_lr),
        ("--tune-clip", args.tune_clip),
        ("--tune-validation", args.tune_validation),
        ("--tune-score-noise", args.tune_score_noise),
        ("--tune-show-trials", args.tune_show_trials),
    )
    if not args.tune:
        for flag, value in flags:
            if value is not None:
                raise ValueError(f"{flag} is for --tune")
        return None
    if model == "convnet":
        raise ValueError(
            "--tune runs the MNIST-family and ScatterNet recipes (mnist, fashion_mnist; "
            "cifar10 with --model scatter_linear or scatter_cnn), not convnet"
        )
    for flag, value, why in (
        (
            "--users / --user-ids",
            users or None,
            "a search of user-level runs is not supported (its validation score "
            "protects one example, not a user)",
        ),
        (
            "--noise-multiplier",
            args.noise_multiplier,
            "the training noise is calibrated so that the whole search fits in --epsilon",
        ),
        ("--lr", args.lr, "the learning rate is searched: give the values with --tune-lr"),
        ("--clip", args.clip, "the clip bound is searched: give the values with --tune-clip"),
        (
            "--checkpoint-dir",
            args.checkpoint_dir,
            "a search is not checkpointed nor resumed (its budget is charged in full "
            "when it starts)",
        ),
        (
            "--tensorboard",
            args.tensorboard,
            "the trials' logs would show how many trials ran, which the search keeps secret",
        ),
    ):
        if value is not None:
            raise ValueError(f"--tune with {flag}: {why}")
    if model == "mlp" and args.epochs is None:
        raise ValueError(
            "--tune with --model mlp needs --epochs: its recipe trains until the budget "
            "is spent (up to 1000 epochs), and every trial of a search trains a fixed number"
        )
    distribution = args.tune_distribution or "geometric"
    if distribution != "fixed" and args.accountant not in (None, "rdp"):
        raise ValueError(
            f"--tune with a random number of trials ({distribution}) is accounted in Renyi "
            f"DP only (Papernot & Steinke 2022): --accountant must be rdp (the default "
            f"with --tune), got {args.accountant}"
        )
    trials = 10.0 if args.tune_trials is None else args.tune_trials
    if distribution == "fixed":
        trials = check_count("--tune-trials", trials, minimum=1)
    else:
        trials = check_number("--tune-trials", trials, low=1.0, low_open=distribution != "poisson")
    for flag, values in (("--tune-lr", args.tune_lr), ("--tune-clip", args.tune_clip)):
        for v in values or ():
            check_number(flag, v, low=0.0, low_open=True)
    out = dict(
        trials=trials,
        distribution=distribution,
        learning_rates=tuple(args.tune_lr or ()),
        clips=tuple(args.tune_clip or ()),
    )
    if args.tune_validation is not None:
        out["validation"] = check_number(
            "--tune-validation",
            args.tune_validation,
            low=0.0,
            high=1.0,
            low_open=True,
            high_open=True,
        )
    if args.tune_score_noise is not None:
        out["score_noise_multiplier"] = check_number(
            "--tune-score-noise", args.tune_score_noise, low=0.0, low_open=True
        )
    return out


def _run_tune(args, error, model: str, config, tune) -> int:
    """`train ... --tune`: the private search of `dpfl_tf.recipes.tune`, as one
    run of the command (results written when the search is charged and when
    it ends; Ctrl-C stops it, releasing nothing; no resume)."""
    from dpfl_tf._runs import CommandRun, run_command
    from dpfl_tf.recipes import tune as tuning

    show_trials = bool(getattr(args, "tune_show_trials", None))
    space = tune.space(config)
    values = {k: "{" + ", ".join(f"{v:g}" for v in vs) + "}" for k, vs in space.items()}
    print(
        f"private hyperparameter search on {args.dataset}: {model}, lot={config.lot_size}, "
        f"{counted(config.epochs, 'epochs')} per trial, learning rate from "
        f"{values['learning_rate']}, clip from {values['l2_norm_clip']}; trials: "
        f"{tune.describe_trials()}{', secret' if tune.random else ''}; score: noised accuracy "
        f"on training examples held out, each with probability {tune.validation:g} "
        f"(noise {tune.score_noise_multiplier:g}); epsilon="
        f"{config.target_epsilon:g} at delta={config.delta:g} for the whole search "
        f"({config.accountant} accountant)"
    )
    if args.seed is not None:
        print(f"note: --seed {args.seed} makes the run reproducible; it is NOT for deployment")

    def run(*, checkpoint_dir, checkpoint_every, should_stop, on_progress, on_resume):
        def start(result):
            print(
                f"training noise: sigma = {result['noise_multiplier']:.4f} in every trial "
                f"(the search: epsilon = {result['epsilon']:.4f}; one trial's training "
                f"alone: {result['trial_epsilon']:.4f}); {result['score']['validation_examples']}"
                " examples held out",
                flush=True,
            )
            if tune.random and show_trials:
                print(
                    "note: the trial lines below show how many trials ran, which the search "
                    "keeps secret (the results file does not say): keep this output private",
                    flush=True,
                )
            elif tune.random:
                print(
                    "searching: no line per trial (they would show how many trials ran, "
                    "which the search keeps secret; --tune-show-trials prints them)",
                    flush=True,
                )
            on_progress(result)

        count = iter(range(1, 10**9))

        def trial(hp, seconds):
            if tune.random and not show_trials:
                return
            print(
                f"trial {next(count)}: learning rate {hp['learning_rate']:g}, clip "
                f"{hp['l2_norm_clip']:g} ({seconds:.0f} s)",
                flush=True,
            )

        return tuning.tune_mnist(
            config, tune, should_stop=should_stop, on_start=start, on_trial=trial
        )

    def summary(r) -> list:
        covers = f"for the whole search ({config.accountant}; {r['search']['event'][0]['event']})"
        spent = f"privacy spent: epsilon = {r['epsilon']:.4f} at delta = {config.delta:g} {covers}"
        best = r["best"]
        if best is None:
            return ["the search drew no trial (Poisson): nothing is released", spent]
        hp = best["hyperparameters"]
        return [
            f"best trial (released): learning rate {hp['learning_rate']:g}, clip "
            f"{hp['l2_norm_clip']:g}; its score (noised validation accuracy) = "
            f"{best['score']:.4f}",
            f"test accuracy = {r['test_accuracy']:.4f} (the best trial's model)",
            spent,
        ]

    def refuse(message: str) -> None:
        for field, flag in (("lot_size (", "--lot-size"), ("validation (", "--tune-validation")):
            if message.startswith(field):
                message = flag + message[len(field) - 2 :]
        error(message)

    return run_command(
        CommandRun(
            command=args.command,
            argv=list(getattr(args, "argv", None) or sys.argv[1:]),
            output=args.output,
            checkpoint_dir=None,
            unit="search",
            run=run,
            status=lambda r: result_status(r.get("stop_reason")),
            resumed=lambda info: "",
            progress=lambda r: "",
            summary=summary,
            resumable=False,
            timed=not tune.random,  # its duration would tell how many trials ran
            not_resumable="nothing is released; the search cannot be resumed: its budget "
            "was charged in full when it started, and running it again is a new search "
            "that spends the budget again",
        ),
        refuse,
    )


def _check_outputs(args, error, default_name: str, *, timed: bool = True) -> None:
    """Before any data is loaded: the results file (and checkpoint / TensorBoard
    directories) can be written -- missing parents are created -- or the run is
    refused with one line (exit code 2).  Not `timed`: a default results name
    without the time (`dpfl_tf._runs.resolve_output`)."""
    from dpfl_tf._runs import check_output_dir, check_run_outputs

    try:
        check_run_outputs(args, default_name, timed=timed)
        if getattr(args, "tensorboard", None) is not None:
            from dpfl_tf.keras.tensorboard import require_tensorboard

            try:
                require_tensorboard("--tensorboard")
            except ImportError as e:
                raise ValueError(str(e)) from None
            check_output_dir("--tensorboard", args.tensorboard)
    except ValueError as e:
        error(str(e))


def _run_with_results(
    args, error, train: Callable[..., dict], summary, *, unit: str, resumed, progress, figure
) -> int:
    """`train` as one run of the command (`dpfl_tf._runs.run_command`)."""
    from dpfl_tf._runs import CommandRun, run_command

    if args.seed is not None:
        print(f"note: --seed {args.seed} makes the run reproducible; it is NOT for deployment")
    extra = {}
    if getattr(args, "tensorboard", None) is not None:
        from dpfl_tf.keras.tensorboard import tensorboard_callback

        extra["callbacks"] = [tensorboard_callback(args.tensorboard)]

    def run(*, checkpoint_dir, checkpoint_every, should_stop, on_progress, on_resume):
        return train(
            checkpoint_dir=checkpoint_dir,
            checkpoint_every_epoch=checkpoint_every,
            on_epoch=on_progress,
            should_stop=should_stop,
            on_resume=on_resume,
            **extra,
        )

    def refuse(message: str) -> None:
        for name, flag in (
            ("lot_size (", "--lot-size ("),
            ("user_ids ", "--user-ids "),
            ("users (", "--users ("),
        ):
            if message.startswith(name):
                message = flag + message[len(name) :]
        error(message)

    return run_command(
        CommandRun(
            command=args.command,
            argv=list(getattr(args, "argv", None) or sys.argv[1:]),
            output=args.output,
            checkpoint_dir=args.checkpoint_dir,
            unit=unit,
            run=run,
            status=lambda r: result_status(r.get("stop_reason")),
            resumed=resumed,
            progress=progress,
            summary=summary,
            figure=figure,
        ),
        refuse,
    )


def _save_training_figure(result: dict, path: str) -> bool:
    """Accuracy and epsilon per epoch, titled with the budget and the noise;
    nothing is drawn (False) before an evaluated epoch."""
    from matplotlib.figure import Figure

    from dpfl_tf.plotting import plot_accuracy_and_epsilon, save_figure

    evaluated = [r for r in result["history"] if "test_accuracy" in r]
    if not evaluated:
        return False
    fig = Figure(figsize=(5.5, 3.8))
    ax = fig.add_subplot()
    sigma = result.get("noise_multiplier")
    title = (
        f"{result['dataset']} {result.get('model') or 'convnet'}: DP-SGD, target "
        f"eps {result['target_epsilon']:g}, delta {result['delta']:g}"
        + (f", sigma {sigma:.3g}" if sigma is not None else "")
    )
    plot_accuracy_and_epsilon(result["history"], ax, title)
    ax.set_ylim(0.0, 1.0)
    save_figure(fig, path)
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpfl-tf", description="Differentially private deep learning for Keras 3."
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show TensorFlow's start-up and log messages (quiet by default)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_privacy_parser(sub)
    _add_train_parser(sub)
    from dpfl_tf.federated.cli import add_federated_parser

    add_federated_parser(sub)
    return parser


def refusal(command: str) -> Callable[[str], None]:
    """The `error` of a command: one line on stderr, exit code 2 (argparse's own
    errors, for arguments that cannot be parsed, also print the usage)."""

    def error(message: str) -> None:
        print(f"dpfl-tf {command}: error: {message}", file=sys.stderr)
        sys.exit(2)

    return error


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if not args.verbose:  # before TensorFlow is imported (by the command)
        import os

        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return args.func(args, refusal(args.command))


if __name__ == "__main__":
    sys.exit(main())

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
    _add_verbose(p)
    p.set_defaults(func=_run_train)


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
    except ValueError as e:
        error(str(e))
    _check_outputs(args, error, f"train_{args.dataset}")
    quiet_tensorflow(args.verbose)
    extra = dict(trained_layers=args.trained_layers, pretrained_weights=args.pretrained)
    if scatter:
        extra = dict(feature_norm=args.feature_norm, mirror_views=args.mirror_views)
    elif model != "convnet":
        extra = {}
    try:
        config = train_config(
            args.dataset,
            model,
            target_epsilon=epsilon,
            delta=delta,
            accountant=args.accountant,
            seed=args.seed,
            data_dir=args.data_dir,
            **given,
            **extra,
        )
    except ValueError as e:
        error(str(e))
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
        return [
            line,
            f"privacy spent: epsilon = {r['epsilon']:.4f} at delta = {delta:g} "
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


def _check_outputs(args, error, default_name: str) -> None:
    """Before any data is loaded: the results file (and checkpoint / TensorBoard
    directories) can be written -- missing parents are created -- or the run is
    refused with one line (exit code 2)."""
    from dpfl_tf._runs import check_output_dir, check_run_outputs

    try:
        check_run_outputs(args, default_name)
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
        if message.startswith("lot_size ("):
            message = "--lot-size" + message[len("lot_size") :]
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

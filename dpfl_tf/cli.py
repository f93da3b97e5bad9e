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

from dpfl_tf._runs import quiet_tensorflow
from dpfl_tf._validation import check_count, check_number, float_arg

__all__ = ["main", "build_parser"]


def _add_privacy_parser(sub) -> None:
    p = sub.add_parser(
        "privacy", help="epsilon spent by DP-SGD-style training, or the noise for a target",
        description="Privacy of T steps of the sampled Gaussian mechanism (DP-SGD lots).")
    p.add_argument("--sampling-rate", "-q", type=float_arg,
                   help="q = lot size / dataset size, in (0, 1] (Poisson sampling)")
    noise = p.add_mutually_exclusive_group(required=True)
    noise.add_argument("--noise-multiplier", "-s", type=float_arg,
                       help="sigma, noise std / clip bound (>= 0)")
    noise.add_argument("--target-epsilon", type=float_arg,
                       help="print the smallest noise multiplier reaching this epsilon instead")
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", "-T", type=float_arg, help="number of lots (steps)")
    length.add_argument("--epochs", "-E", type=float_arg,
                        help="epochs; steps = epochs / q (shuffle: epochs x (N // L), an "
                             "epoch being N // L lots)")
    p.add_argument("--delta", "-d", type=float_arg, required=True, help="delta in (0, 1)")
    p.add_argument("--accountant", default="moments", choices=["moments", "rdp", "pld", "strong"])
    p.add_argument("--sampling", default="poisson",
                   choices=["poisson", "fixed_size", "shuffle"],
                   help="how lots are drawn (fixed_size and shuffle need --dataset-size "
                        "and --lot-size)")
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
                q = check_number("--sampling-rate", args.sampling_rate, low=0.0, high=1.0,
                                 low_open=True)
                if args.dataset_size is not None and args.lot_size is not None:
                    n = check_count("--dataset-size", args.dataset_size, minimum=1)
                    implied = check_count("--lot-size", args.lot_size, minimum=1) / n
                    if not math.isclose(q, implied, rel_tol=1e-9):
                        error(f"--sampling-rate {q:g} contradicts --lot-size / --dataset-size "
                              f"= {implied:g}; give one of them")
            sampling_args = {"sampling_rate": q}
        else:
            if args.sampling_rate is not None:
                error(f"--sampling-rate is for --sampling poisson; --sampling {sampling} takes "
                      f"--dataset-size and --lot-size, got --sampling-rate "
                      f"{args.sampling_rate:g}")
            if args.dataset_size is None or args.lot_size is None:
                error(f"--sampling {sampling} needs --dataset-size and --lot-size")
            n = check_count("--dataset-size", args.dataset_size, minimum=1)
            lot = check_count("--lot-size", args.lot_size, minimum=1)
            if lot > n:
                error(f"--lot-size must be <= --dataset-size ({n}), got {lot}")
            q = lot / n
            sampling_args = {"dataset_size": n, "lot_size": lot}
            if sampling == "shuffle":   # an epoch: a permutation cut into N // L lots of L
                lots_per_epoch = n // lot
        delta = check_number("--delta", args.delta, low=0.0, high=1.0, low_open=True,
                             high_open=True)
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
            target = check_number("--target-epsilon", args.target_epsilon, low=0.0,
                                  low_open=True)
    except ValueError as e:
        error(str(e))
    return dict(sampling=sampling, sampling_args=sampling_args, q=q, delta=delta, steps=steps,
                epochs=epochs, lots_per_epoch=lots_per_epoch,
                epochs_accounted=epochs_accounted, sigma=sigma, target=target)


def _run_privacy(args, error) -> int:
    from dpfl_tf.privacy import (calibrate_noise_multiplier, compute_epsilon, describe_event,
                                 dp_sgd_event)

    v = _privacy_inputs(args, error)
    if v["sampling"] == "shuffle":
        def make_event(sigma):
            return dp_sgd_event(sigma, v["steps"], "shuffle", epochs=v["epochs_accounted"])
    else:
        def make_event(sigma):
            return dp_sgd_event(sigma, v["steps"], v["sampling"], **v["sampling_args"])

    try:
        if v["target"] is not None:
            sigma, eps = calibrate_noise_multiplier(v["target"], v["delta"], make_event,
                                                    args.accountant)
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
        "epsilon": eps, "delta": v["delta"], "accountant": args.accountant,
        "steps": v["steps"], "epochs": v["epochs"], "sampling": v["sampling"],
        "sampling_rate": v["q"], "noise_multiplier": sigma, "event": describe_event(event),
    }
    if v["lots_per_epoch"] is not None:
        result["lots_per_epoch"] = v["lots_per_epoch"]
        result["epochs_accounted"] = v["epochs_accounted"]
    if v["target"] is not None:
        result["target_epsilon"] = v["target"]
    if args.json:
        print(json.dumps({k: (None if isinstance(x, float) and math.isinf(x) else x)
                          for k, x in result.items()}
                         | {"epsilon_is_infinite": math.isinf(eps)}))
        return 0
    if math.isinf(eps):
        print("epsilon = inf: noise multiplier 0 adds no noise, so there is no privacy "
              "guarantee" if sigma == 0 else "epsilon = inf")
        return 0
    if v["target"] is not None:
        print(f"noise_multiplier = {sigma:.4f} reaches epsilon = {eps:.4f} "
              f"(target {v['target']:g}) at delta = {v['delta']:g}")
    else:
        print(f"epsilon = {eps:.4f} at delta = {v['delta']:g}")
    if v["lots_per_epoch"] is not None:
        length = (f"{v['steps']} steps: {v['epochs_accounted']} epochs of "
                  f"{v['lots_per_epoch']} lots touched")
    else:
        length = f"{v['steps']} steps ({v['epochs']:g} epochs)"
    print(f"  {args.accountant} accountant, {length}: {describe_event(event)}")
    return 0


def _add_train_parser(sub) -> None:
    p = sub.add_parser(
        "train", help="DP-SGD training of a paper baseline; prints accuracy and (eps, delta)",
        description="Abadi et al. 2016 section 5.2: DP-PCA + MLP (or a tanh CNN) with "
                    "DP-SGD, trained until the privacy budget is spent; section 5.3 "
                    "(cifar10): frozen pretrained convolutions, DP-SGD on the dense layers.")
    p.add_argument("dataset", choices=["mnist", "fashion_mnist", "cifar10"])
    p.add_argument("--epsilon", type=float_arg, default=2.0, help="target epsilon (budget)")
    p.add_argument("--delta", type=float_arg, default=1e-5)
    p.add_argument("--accountant", default=None, choices=["moments", "rdp", "pld"],
                   help="default: pld for scatter_linear / scatter_cnn (the accountant of "
                        "their measured settings: the least noise for the budget), moments "
                        "(Abadi et al.) otherwise")
    p.add_argument("--model", default=None,
                   choices=["mlp", "tanh_cnn", "scatter_linear", "scatter_cnn"],
                   help="mnist: mlp (default; DP-PCA + MLP, Abadi et al.) or tanh_cnn "
                        "(Papernot et al. 2021); any dataset: scatter_linear / scatter_cnn, "
                        "ScatterNet features + a linear model / a small CNN "
                        "(Tramer & Boneh 2021; defaults lot 4096 "
                        "(cifar10: 8192), clip 0.1, lr 8 (cifar10: 4), momentum 0.9, 60 epochs, "
                        "noise calibrated for the epochs, no public data). cifar10 without "
                        "--model: the paper's convnet, frozen pretrained convolutions")
    p.add_argument("--feature-norm", default=None, choices=["group", "dp_stats"],
                   help="scatter models: the input normalisation, per-example GroupNorm "
                        "(group; default for mnist, fashion_mnist) or channel statistics "
                        "released under DP and paid from the budget (dp_stats; default for "
                        "cifar10)")
    p.add_argument("--mirror-views", default=None, action=argparse.BooleanOptionalAction,
                   help="scatter models: train on each image and its mirror image, the "
                        "model averaging its logits over both (mirror-invariant; same "
                        "privacy cost); default on for cifar10, off for mnist and "
                        "fashion_mnist")
    p.add_argument("--noise-multiplier", type=float_arg,
                   help="sigma (default: the paper's setting for the epsilon: 2 / 4 / 8; "
                        "cifar10 and scatter_linear: calibrated so that --epochs epochs "
                        "spend the budget)")
    p.add_argument("--pca-noise-multiplier", type=float_arg,
                   help="sigma_p of DP-PCA (default: the paper's 4 / 7 / 16)")
    p.add_argument("--epochs", type=float_arg, default=None,
                   help="upper bound on epochs (training stops when the budget is spent; "
                        "default 1000; cifar10: 30)")
    p.add_argument("--lot-size", type=float_arg, default=None, help="default 600; cifar10: 2000")
    p.add_argument("--clip", type=float_arg, default=None,
                   help="clip bound (default 4; cifar10: 3 per hidden layer, twice that "
                        "for the softmax layer)")
    p.add_argument("--lr", type=float_arg, default=None, help="default 0.1; cifar10: 0.05")
    p.add_argument("--trained-layers", default="top", choices=["softmax", "top", "dense"],
                   help="cifar10: layers trained privately (the convolutions stay frozen)")
    p.add_argument("--pretrained", default=None,
                   help="cifar10: weights from experiments/cifar10_pretrain.py (default: "
                        "models/cifar10_public_convnet.weights.h5 if present, else a short "
                        "pretraining on the public split first); the public split they "
                        "were trained on is held out, the rest is private")
    p.add_argument("--seed", type=int, help="reproducible run (NOT for deployment)")
    p.add_argument("--output", default=None,
                   help="results JSON (default results/train_<dataset>.json), rewritten after "
                        "every epoch with a status (running, completed, budget_spent, "
                        "interrupted, failed); the figure goes beside it (.png)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="checkpoint here after every epoch, and resume from it if it holds "
                        "a checkpoint of the same run")
    p.add_argument("--tensorboard", default=None, metavar="LOG_DIR",
                   help="TensorBoard logs (epsilon per lot and epoch); needs "
                        "pip install 'dpfl-tf[tensorboard]'")
    p.add_argument("--data-dir", default=None)
    _add_verbose(p)
    p.set_defaults(func=_run_train)


def _add_verbose(p) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="show TensorFlow's start-up and log messages")


def _paper_setting_for(epsilon: float) -> str:
    if epsilon >= 5:
        return "small_noise"
    return "medium_noise" if epsilon >= 1 else "large_noise"


def _run_train(args, error) -> int:
    scatter = args.model in ("scatter_linear", "scatter_cnn")
    cifar = args.dataset == "cifar10" and not scatter   # the paper's frozen convnet
    if args.dataset == "cifar10" and args.model in ("mlp", "tanh_cnn"):
        error(f"--model {args.model} needs 28x28 grey images (mnist, fashion_mnist); for "
              f"cifar10 use --model scatter_linear, scatter_cnn or leave --model out")
    if args.feature_norm is not None and not scatter:
        error("--feature-norm is for --model scatter_linear and scatter_cnn")
    if args.mirror_views is not None and not scatter:
        error("--mirror-views is for --model scatter_linear and scatter_cnn")
    args.model = args.model or "mlp"
    args.accountant = args.accountant or ("pld" if scatter else "moments")
    column = 1 if cifar else 2 if scatter else 0
    colour = args.dataset == "cifar10"
    for name, *defaults in (("epochs", 1000, 30, 60),
                            ("lot_size", 600, 2000, 8192 if colour else 4096),
                            ("clip", 4.0, 3.0, 0.1), ("lr", 0.1, 0.05, 4.0 if colour else 8.0)):
        if getattr(args, name) is None:  # mnist, cifar10, scatter_linear (Tramer & Boneh)
            setattr(args, name, defaults[column])
    try:
        epsilon = check_number("--epsilon", args.epsilon, low=0.0, low_open=True)
        delta = check_number("--delta", args.delta, low=0.0, high=1.0, low_open=True,
                             high_open=True)
        epochs = check_count("--epochs", args.epochs, minimum=1)
        lot = check_count("--lot-size", args.lot_size, minimum=1)
        clip = check_number("--clip", args.clip, low=0.0, low_open=True)
        lr = check_number("--lr", args.lr, low=0.0, low_open=True)
        for name in ("noise_multiplier", "pca_noise_multiplier"):
            if getattr(args, name) is not None:
                check_number("--" + name.replace("_", "-"), getattr(args, name), low=0.0,
                             low_open=True)
    except ValueError as e:
        error(str(e))
    _check_outputs(args, error, f"train_{args.dataset}")
    quiet_tensorflow(args.verbose)
    if cifar:
        return _run_train_cifar10(args, error, epsilon, delta, epochs, lot, clip, lr)
    from dpfl_tf.recipes.mnist import (MIRROR_VIEWS_BATCH, PAPER_SETTINGS, MnistConfig,
                                       train_mnist)

    common = dict(dataset=args.dataset, model=args.model, target_epsilon=epsilon, delta=delta,
                  accountant=args.accountant, epochs=epochs, lot_size=lot, l2_norm_clip=clip,
                  learning_rate=lr, seed=args.seed, data_dir=args.data_dir, eval_every=5)
    if scatter:  # Tramer & Boneh 2021: constant lr, momentum, noise calibrated for the epochs
        norm = args.feature_norm or ("dp_stats" if args.dataset == "cifar10" else "group")
        mirror = colour if args.mirror_views is None else args.mirror_views
        batch = MIRROR_VIEWS_BATCH[args.model] if mirror else 4096
        config = MnistConfig(projection="none", noise_multiplier=args.noise_multiplier,
                             batch_size=min(lot, batch),
                             final_learning_rate=lr, momentum=0.9, feature_norm=norm,
                             mirror_views=mirror, **common)
        sigma = "calibrated" if args.noise_multiplier is None else f"{args.noise_multiplier:g}"
        head = "linear" if args.model == "scatter_linear" else "CNN"
        head += " averaged over each image and its mirror image" if mirror else ""
        what = (f"scattering features (J=2, L=8), {norm} normalisation + {head}, "
                f"sigma={sigma}, lot={lot}, clip={clip:g}, lr={lr:g}, momentum 0.9, "
                f"{epochs} epochs")
    else:
        setting = _paper_setting_for(epsilon)
        paper = PAPER_SETTINGS[setting]
        config = MnistConfig(
            setting=setting if args.noise_multiplier is None else "custom",
            projection="dp_pca" if args.model == "mlp" else "none",
            noise_multiplier=args.noise_multiplier or paper["noise_multiplier"],
            pca_noise_multiplier=args.pca_noise_multiplier or paper["pca_noise_multiplier"],
            batch_size=1024 if args.model == "mlp" else 256, final_learning_rate=lr * 0.52,
            **common)
        what = f"{config.model}, sigma={config.noise_multiplier:g}, lot={lot}, clip={clip:g}"
    print(f"DP-SGD on {args.dataset}: {what}, target epsilon={epsilon:g} at delta={delta:g} "
          f"({args.accountant} accountant)")
    return _train_and_report(args, error, lambda **kw: train_mnist(config, **kw),
                             lambda r: f"test accuracy = {r['test_accuracy']:.4f} after "
                                       f"{r['epochs']} epochs"
                                       + (f", sigma = {r['noise_multiplier']:.3f}" if scatter
                                          else "")
                                       + f"; train accuracy = {r['train_accuracy']:.4f} "
                                         "(non-private statistic)")


def _run_train_cifar10(args, error, epsilon, delta, epochs, lot, clip, lr) -> int:
    """`dpfl-tf train cifar10`: DP-SGD on the private split, convolutions frozen."""
    import os

    from dpfl_tf.recipes.cifar10 import (CifarConfig, PretrainConfig, pretrain_split,
                                         read_pretrained_record, train_cifar10)

    weights = args.pretrained
    default = os.path.join("models", "cifar10_public_convnet.weights.h5")
    if weights is None and os.path.isfile(default):
        weights = default
    try:
        pretraining = dict(epochs=30, data_dir=args.data_dir, seed=args.seed)
        if weights is not None:  # hold out the public split the weights were trained on
            try:
                pretrain = pretrain_split(read_pretrained_record(weights), **pretraining)
            except (FileNotFoundError, ValueError) as e:
                raise ValueError(f"--pretrained {weights}: {e}") from None
        else:
            pretrain = PretrainConfig(**pretraining)
        config = CifarConfig(
            setting="cli", trained_layers=args.trained_layers, pretrained_weights=weights,
            pretrain=pretrain,
            noise_multiplier=args.noise_multiplier, l2_norm_clip=clip, lot_size=lot,
            batch_size=min(lot, 1000), learning_rate=lr, target_epsilon=epsilon, delta=delta,
            accountant=args.accountant, epochs=epochs, seed=args.seed, data_dir=args.data_dir)
    except ValueError as e:
        error(str(e))
    sigma = "calibrated" if args.noise_multiplier is None else f"{args.noise_multiplier:g}"
    print(f"DP-SGD on cifar10: convolutions frozen, training {args.trained_layers} layers, "
          f"sigma={sigma}, lot={lot}, clip={config.clip_bounds}, target epsilon={epsilon:g} "
          f"at delta={delta:g} ({args.accountant} accountant)")
    if weights is None:
        print("note: no pretrained weights given or found in models/; pretraining 30 epochs "
              "on the public split first (python experiments/cifar10_pretrain.py makes "
              "the full model)")
    return _train_and_report(
        args, error, lambda **kw: train_cifar10(config, **kw),
        lambda r: f"test accuracy = {r['test_accuracy']:.4f} after {r['epochs']} epochs on "
                  f"{r['dataset']} (start {r['pretrained_on_cifar10_test']:.4f}; "
                  f"pretraining: {r['pretraining']})", ylim=(0.0, 1.0))


def _check_outputs(args, error, default_name: str) -> None:
    """Before any data is loaded: the results file (and checkpoint / TensorBoard
    directories) can be written -- missing parents are created -- or the run is
    refused with one line (exit code 2)."""
    from dpfl_tf._runs import check_output_dir, check_output_file

    import os

    args.output = args.output or os.path.join("results", default_name + ".json")
    try:
        check_output_file("--output", args.output)
        if getattr(args, "checkpoint_dir", None) is not None:
            check_output_dir("--checkpoint-dir", args.checkpoint_dir)
        if getattr(args, "tensorboard", None) is not None:
            from dpfl_tf.keras.tensorboard import require_tensorboard

            try:
                require_tensorboard("--tensorboard")
            except ImportError as e:
                raise ValueError(str(e)) from None
            check_output_dir("--tensorboard", args.tensorboard)
    except ValueError as e:
        error(str(e))


def _resume_command(args, checkpoint_dir: str) -> str:
    import shlex

    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    if "--checkpoint-dir" not in argv and not any(a.startswith("--checkpoint-dir=")
                                                  for a in argv):
        argv += ["--checkpoint-dir", checkpoint_dir]
    return "dpfl-tf " + " ".join(shlex.quote(a) for a in argv)


def _status(stop_reason: str | None) -> str:
    return {"completed": "completed", "budget_spent": "budget_spent",
            "interrupted": "interrupted"}.get(stop_reason or "", "completed")


def _train_and_report(args, error, train: Callable[..., dict],
                      accuracy_line: Callable[[dict], str], ylim=None) -> int:
    """Runs a training recipe, writing its results after every epoch (and its
    figure at the end), and prints the summary.  Ctrl-C / SIGTERM stop after the
    current lot: results marked interrupted, a checkpoint, exit code 130 / 143."""
    import gc
    import os

    from dpfl_tf._runs import Interrupts, ResultsFile, RunInterrupted
    from dpfl_tf.privacy.ledger import BudgetExceededError

    if args.seed is not None:
        print(f"note: --seed {args.seed} makes the run reproducible; it is NOT for deployment")
    out = args.output
    results = ResultsFile(out)
    figure = os.path.splitext(out)[0] + ".png"
    checkpoint_dir = args.checkpoint_dir or os.path.splitext(out)[0] + ".checkpoint"

    def resumed(info):
        print(f"resumed from {info['directory']}: {info['lots']} lots "
              f"({info['epoch']:.2f} epochs), epsilon so far {info['epsilon']:.4f}", flush=True)

    extra = {}
    if args.tensorboard is not None:
        from dpfl_tf.keras.tensorboard import tensorboard_callback

        extra["callbacks"] = [tensorboard_callback(args.tensorboard)]
    with Interrupts() as interrupts:
        try:
            with interrupts.deferred():
                result = train(checkpoint_dir=checkpoint_dir,
                               checkpoint_every_epoch=args.checkpoint_dir is not None,
                               on_epoch=lambda r: results.write("running", r),
                               should_stop=lambda: interrupts.requested,
                               on_resume=resumed, **extra)
        except RunInterrupted:
            kept = "nothing measured yet"
            if results.written:
                results.write("interrupted", results.last)
                kept = f"results of {results.last.get('epochs')} epochs in {out}"
            else:
                results.write("interrupted", {"command": _resume_command(args, checkpoint_dir)})
            has_ckpt = os.path.exists(os.path.join(checkpoint_dir, "state.json"))
            how = (f"; resume with: {_resume_command(args, checkpoint_dir)}" if has_ckpt
                   else "; no checkpoint was written yet: run the command again")
            print(f"\ninterrupted ({interrupts.name}): kept {kept} (status interrupted){how}",
                  file=sys.stderr)
            return interrupts.exit_code
        except (ValueError, FileNotFoundError, BudgetExceededError) as e:
            if results.written:   # failed mid-run: no usage block, say what was kept
                results.write("failed", results.last, error=str(e))
                print(f"dpfl-tf {args.command}: failed after {results.last.get('epochs')} "
                      f"epochs: {e}; results so far in {out} (status failed)",
                      file=sys.stderr)
                return 1
            message = str(e)
            if message.startswith("lot_size ("):
                message = "--lot-size" + message[len("lot_size"):]
            error(message)
        except Exception as e:
            if results.written:
                results.write("failed", results.last, error=f"{type(e).__name__}: {e}")
            raise
    gc.collect()  # finalise tf.data's generator iterators now, not at interpreter exit
    status = _status(result.get("stop_reason"))
    results.write(status, result)
    _save_training_figure(result, figure, ylim)
    if status == "interrupted":
        print(f"\ninterrupted ({interrupts.name}) after {result['lots']} lots "
              f"(in epoch {result['epochs']}; epsilon = {result['epsilon']:.4f}): results in {out} "
              f"(status interrupted), checkpoint in {checkpoint_dir}; resume with: "
              f"{_resume_command(args, checkpoint_dir)}", file=sys.stderr)
        return interrupts.exit_code
    print(accuracy_line(result))
    print(f"privacy spent: epsilon = {result['epsilon']:.4f} at delta = {args.delta:g} "
          f"({args.accountant}; {result['events']})")
    print(f"results: {out}  figure: {figure}")
    return 0


def _save_training_figure(result: dict, path: str, ylim=None) -> None:
    from matplotlib.figure import Figure

    from dpfl_tf.plotting import plot_accuracy_and_epsilon, save_figure

    fig = Figure(figsize=(5, 3.5))
    ax = fig.add_subplot()
    plot_accuracy_and_epsilon(result["history"], ax, f"{result['dataset']} DP-SGD")
    if ylim:
        ax.set_ylim(*ylim)
    save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpfl-tf", description="Differentially private deep learning for Keras 3.")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="show TensorFlow's start-up and log messages (quiet by default)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_privacy_parser(sub)
    _add_train_parser(sub)
    from dpfl_tf.federated.cli import add_federated_parser

    add_federated_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if not args.verbose:  # before TensorFlow is imported (by the command)
        import os

        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    sub_parser = parser._subparsers._group_actions[0].choices[args.command]  # for error()
    return args.func(args, sub_parser.error)


if __name__ == "__main__":
    sys.exit(main())

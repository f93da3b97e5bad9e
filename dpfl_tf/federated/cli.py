"""The ``dpfl-tf federated`` subcommand (docs/howto/federated.md).

    dpfl-tf federated --dp global                  # the defaults: ~90% at epsilon 8.9
    dpfl-tf federated --dp global --epsilon 8 --rounds 300 --output results/run.json

Every default is `FederatedConfig`'s (``--help`` lists them and what they reach).

`add_federated_parser(subparsers)` adds the command to an existing
``argparse`` sub-parser set (``dpfl_tf.cli`` hooks it in).
"""

from __future__ import annotations

import argparse
import sys

from dpfl_tf._validation import float_arg

__all__ = ["add_federated_parser", "config_from_args"]


def _int(text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}")
    return int(value)


def _clip(text: str):
    if text in ("adaptive", "median"):  # "median" reaches the config, which names its successor
        return text
    return float_arg(text)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help, read from `FederatedConfig`; a default
    the config resolves from other settings (None here) is described in words."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


#: measured by ``python experiments/federated_defaults.py`` (results/federated_defaults.json;
#: 2 cores shared with other jobs)
DEFAULTS_REACH = (
    "The defaults (MNIST, K = 1000 clients of two label shards each, m = 100 per round, "
    "100 rounds, 784-32-10 MLP, E = 1, B = 10, lr 0.2, clip S = 1) reach: FedAvg ~92% in "
    "~0.5 min on 2 cores; --dp global (sigma = 1, m = 100 of K = 1000 as in Geyer et al. "
    "2017) ~90% at epsilon 8.9 (delta 1e-5) in ~0.5 min; --dp client (z = 0.2 per upload, "
    "so z sqrt(m) = 2 on the released mean) ~87% at epsilon 14 for the released model (and "
    "~1,300 per client against the server) in ~0.6 min; --dp local (PNPM, epsilon 2 per "
    "coordinate, signs only) ~90% in ~3 min. See docs/howto/federated.md."
)


def add_federated_parser(subparsers) -> argparse.ArgumentParser:
    """Adds ``federated`` to `subparsers` (the result of ``parser.add_subparsers()``).
    Defaults come from `FederatedConfig`, choices from its enums."""
    from dataclasses import fields

    from dpfl_tf.federated.partition import PartitionScheme
    from dpfl_tf.federated.runner import (
        CLIENT_SAMPLING,
        DEFAULT_NOISE_MULTIPLIER,
        MODELS,
        AggregatorKind,
        DPMode,
        FederatedConfig,
    )
    from dpfl_tf.federated.server_optimizers import SERVER_OPTIMIZERS
    from dpfl_tf.federated.settings import DistributedMechanism, MechanismKind
    from dpfl_tf.privacy.choices import AccountantKind

    default = {f.name: f.default for f in fields(FederatedConfig)}

    def values(enum) -> list[str]:
        return [m.value for m in enum]

    p = subparsers.add_parser(
        "federated",
        help="federated averaging with client-level DP (Geyer et al. 2017)",
        formatter_class=_HelpFormatter,
        description="FedAvg / FedMedian over simulated clients, optionally with client-level "
        "Global DP (server-side noise), DP-FedAvg with client-side noise, or "
        "local DP on every upload. " + DEFAULTS_REACH,
    )
    d = p.add_argument_group("data and clients")
    d.add_argument("--dataset", default=default["dataset"], help="registered dataset name")
    d.add_argument(
        "--clients", "-K", type=_int, default=default["clients"], help="number of clients K"
    )
    d.add_argument(
        "--partition",
        default=default["partition"].value,
        choices=values(PartitionScheme),
        help="how the training set is split",
    )
    d.add_argument(
        "--dirichlet-alpha",
        type=float_arg,
        default=default["dirichlet_alpha"],
        help="--partition dirichlet: concentration alpha",
    )
    d.add_argument(
        "--train-subset", type=_int, help="use only this many training examples (default: all)"
    )
    d.add_argument(
        "--data-dir",
        default=None,
        help="where the dataset files are, searched first (default: only $DPFL_DATA_DIR, "
        "the Keras cache, /usr/share/datasets, then a download)",
    )
    s = p.add_argument_group("rounds")
    who = s.add_mutually_exclusive_group()
    who.add_argument(
        "--clients-per-round",
        "-m",
        type=_int,
        help="m clients per round (default: --fraction 0.1, i.e. m = K/10)",
    )
    who.add_argument(
        "--fraction", "-C", type=float_arg, help="fraction C of clients per round (default 0.1)"
    )
    s.add_argument(
        "--sampling",
        choices=[m.value for m in CLIENT_SAMPLING],
        help="Poisson (rate m/K) or m without replacement (default: poisson; "
        "fixed_size with --dp client)",
    )
    s.add_argument(
        "--cohorts",
        type=_int,
        help="--dp ftrl/banded_mf/blt: b cohorts of clients (client k in cohort "
        "k mod b) take turns, so a client's rounds are b apart; --fraction is "
        "then the share of the cohort each round, default 1 (default: none; "
        "required with those modes)",
    )
    s.add_argument(
        "--rounds", "-T", type=_int, default=default["rounds"], help="maximum number of rounds"
    )
    s.add_argument(
        "--local-epochs",
        "-E",
        type=_int,
        default=default["local_epochs"],
        help="local epochs per round",
    )
    s.add_argument(
        "--local-batch-size",
        "-B",
        type=_int,
        default=default["local_batch_size"],
        help="local batch size",
    )
    s.add_argument(
        "--lr", type=float_arg, default=default["learning_rate"], help="local learning rate"
    )
    s.add_argument(
        "--lr-decay-rounds",
        type=float_arg,
        metavar="R",
        help="decay the local learning rate exponentially with the round: lr x "
        "RATE^(round / R) (default: constant)",
    )
    s.add_argument(
        "--lr-decay-rate",
        type=float_arg,
        default=default["lr_decay_rate"],
        metavar="RATE",
        help="the factor the local learning rate falls by every R rounds",
    )
    s.add_argument(
        "--momentum", type=float_arg, default=default["momentum"], help="local heavy-ball momentum"
    )
    s.add_argument(
        "--aggregator",
        default=default["aggregator"].value,
        choices=values(AggregatorKind),
        help="FedAvg mean or FedMedian",
    )
    s.add_argument(
        "--hidden",
        default=",".join(str(h) for h in default["hidden"]),
        help="--model mlp: hidden layer widths, comma separated",
    )
    s.add_argument(
        "--model",
        default=default["model"],
        choices=list(MODELS),
        help="mlp (--hidden), or the PNPM experiments' CNN with 2 or 3 conv layers",
    )
    so = p.add_argument_group(
        "server optimiser (post-processing of each round's released aggregate)"
    )
    so.add_argument(
        "--server-optimizer",
        default=default["server_optimizer"],
        choices=list(SERVER_OPTIMIZERS),
        help="sgd (with --server-momentum: FedAvgM), or FedOpt's adagrad, adam, yogi "
        "(Reddi et al. 2021)",
    )
    so.add_argument(
        "--server-lr", type=float_arg, default=default["server_lr"], help="server learning rate"
    )
    so.add_argument(
        "--server-momentum",
        type=float_arg,
        help="server momentum beta (sgd) or beta1 (adaptive) (default: 0 for sgd, 0.9 otherwise)",
    )
    so.add_argument(
        "--server-beta2",
        type=float_arg,
        default=default["server_beta2"],
        help="second-moment decay of adam and yogi",
    )
    so.add_argument(
        "--server-tau",
        type=float_arg,
        default=default["server_tau"],
        help="adaptivity tau of adagrad, adam and yogi",
    )
    so.add_argument(
        "--model-average",
        type=float_arg,
        metavar="BETA",
        help="release and evaluate the exponential moving average (decay BETA, e.g. 0.9) "
        "of the released global models; the clients train the global model (default: off)",
    )
    q = p.add_argument_group("privacy")
    q.add_argument(
        "--dp",
        default=default["dp"].value,
        choices=values(DPMode),
        help="none, global (server noise), client (client-side noise), local, "
        "distributed (discrete noise shares + secure aggregation); ftrl, "
        "banded_mf, blt: server noise correlated across rounds, with "
        "--cohorts (docs/concepts/correlated-noise.md)",
    )
    q.add_argument(
        "--clip",
        "-S",
        type=_clip,
        default=default["clip"],
        help="clip bound S > 0, or 'adaptive' (DP adaptive clipping, Andrew et al. "
        "2021; --dp global, flat)",
    )
    q.add_argument(
        "--clip-initial",
        type=float_arg,
        default=default["clip_initial"],
        help="--clip adaptive: the first round's bound C_0",
    )
    q.add_argument(
        "--clip-quantile",
        type=float_arg,
        default=default["clip_quantile"],
        help="--clip adaptive: target quantile gamma of the update norms",
    )
    q.add_argument(
        "--clip-lr",
        type=float_arg,
        default=default["clip_lr"],
        help="--clip adaptive: learning rate eta_C of the geometric update",
    )
    q.add_argument(
        "--clip-count-stddev",
        type=float_arg,
        help="--clip adaptive: noise std sigma_b of the count of unclipped clients "
        "(default 0.05 x the expected clients per round)",
    )
    q.add_argument("--per-layer", action="store_true", help="one bound S per layer")
    noise = ", ".join(f"{v:g} with --dp {k}" for k, v in DEFAULT_NOISE_MULTIPLIER.items() if v)
    q.add_argument(
        "--noise-multiplier",
        "-z",
        type=float_arg,
        help=f"sigma (global) or z per upload (client) (default: {noise})",
    )
    q.add_argument(
        "--epsilon",
        type=float_arg,
        help="target epsilon: stop before exceeding it (default: no target)",
    )
    q.add_argument(
        "--delta-max", type=float_arg, help="delta bound (< 1/K; default min(1e-5, 0.1/K))"
    )
    q.add_argument(
        "--accountant",
        choices=values(AccountantKind),
        help="default: moments; rdp with fixed_size sampling (the only one that reads it)",
    )
    q.add_argument(
        "--ddp-mechanism",
        default=default["ddp_mechanism"],
        choices=values(DistributedMechanism),
        help="--dp distributed: each client's noise share (the distributed discrete "
        "Gaussian, Kairouz et al. 2021, or Skellam, Agarwal et al. 2021)",
    )
    q.add_argument(
        "--bits",
        "-b",
        type=_int,
        default=default["bits"],
        help="--dp distributed: bits per coordinate of the secure sum (modulus 2^b)",
    )
    q.add_argument(
        "--min-clients",
        type=_int,
        help="--dp distributed: the fewest uploads the secure aggregation finishes "
        "a round with; the accounting assumes only their noise (default m)",
    )
    q.add_argument(
        "--dropout-rate",
        type=float_arg,
        default=default["dropout_rate"],
        help="--dp distributed: simulated probability that a sampled client drops "
        "out before uploading (needs --min-clients)",
    )
    q.add_argument(
        "--secure-mode",
        action="store_true",
        help="--dp global/client/distributed: noise resistant to floating-point "
        "attacks (distributed: exact discrete noise from the OS's secure "
        "source) and client sampling from os.urandom (dpfl_tf.secure_random); "
        "no seed reaches the DP randomness",
    )
    q.add_argument(
        "--ldp-mechanism",
        default=default["ldp_mechanism"],
        choices=values(MechanismKind),
        help="--dp local: the per-coordinate randomiser",
    )
    q.add_argument(
        "--ldp-epsilon",
        type=float_arg,
        default=default["ldp_epsilon"],
        help="--dp local: epsilon per coordinate (NOT per model)",
    )
    q.add_argument(
        "--ldp-bound",
        default=default["ldp_bound"],
        help="--dp local: public clip range [-r, r] of every weight, or 'init' "
        "(margin x the initial model's largest |w| per tensor)",
    )
    q.add_argument(
        "--ldp-bound-margin",
        type=float_arg,
        default=default["ldp_bound_margin"],
        help="--dp local, --ldp-bound init: the margin",
    )
    o = p.add_argument_group("run")
    o.add_argument(
        "--seed",
        type=_int,
        default=default["seed"],
        help="partition, initial model, sampling and batch order",
    )
    o.add_argument(
        "--eval-every",
        type=_int,
        default=default["eval_every"],
        help="evaluate on the test set every n rounds (and after the last)",
    )
    o.add_argument(
        "--checkpoint-dir",
        help="write (and resume from) checkpoints here "
        "(default: none; <output>.checkpoint on Ctrl-C)",
    )
    o.add_argument(
        "--output",
        "-o",
        help="results JSON file, rewritten after every round with a status "
        "(running, completed, budget_spent, interrupted, failed); the figure "
        "(accuracy and epsilon per round) goes beside it (.png).  A "
        "directory takes federated.json inside (default: "
        "runs/federated-<date>-<time>.json)",
    )
    o.add_argument(
        "--overwrite", action="store_true", help="replace the results of a finished run in --output"
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=argparse.SUPPRESS,
        help="show TensorFlow's start-up and log messages",
    )
    p.set_defaults(func=_run_federated)
    return p


def config_from_args(args, error=None):
    """A `FederatedConfig` from parsed arguments; errors go to `error(msg)` (argparse)."""
    from dpfl_tf.federated.runner import FederatedConfig

    try:
        hidden = tuple(int(h) for h in str(args.hidden).split(",") if h.strip())
    except ValueError:
        msg = f"--hidden must be comma-separated whole numbers, got {args.hidden!r}"
        if error:
            error(msg)
        raise ValueError(msg)
    kwargs = dict(
        dataset=args.dataset,
        clients=args.clients,
        partition=args.partition,
        dirichlet_alpha=args.dirichlet_alpha,
        clients_per_round=args.clients_per_round,
        fraction=args.fraction,
        sampling=args.sampling,
        cohorts=args.cohorts,
        rounds=args.rounds,
        local_epochs=args.local_epochs,
        local_batch_size=args.local_batch_size,
        learning_rate=args.lr,
        lr_decay_rounds=args.lr_decay_rounds,
        lr_decay_rate=args.lr_decay_rate,
        momentum=args.momentum,
        aggregator=args.aggregator,
        dp=args.dp,
        clip=args.clip,
        clip_initial=args.clip_initial,
        clip_quantile=args.clip_quantile,
        clip_lr=args.clip_lr,
        clip_count_stddev=args.clip_count_stddev,
        per_layer=args.per_layer,
        noise_multiplier=args.noise_multiplier,
        target_epsilon=args.epsilon,
        delta_max=args.delta_max,
        accountant=args.accountant,
        hidden=hidden,
        model=args.model,
        ldp_mechanism=args.ldp_mechanism,
        ldp_epsilon=args.ldp_epsilon,
        ldp_bound=args.ldp_bound,
        ldp_bound_margin=args.ldp_bound_margin,
        seed=args.seed,
        eval_every=args.eval_every,
        secure_mode=args.secure_mode,
        ddp_mechanism=args.ddp_mechanism,
        bits=args.bits,
        min_clients=args.min_clients,
        dropout_rate=args.dropout_rate,
        train_subset=args.train_subset,
        server_optimizer=args.server_optimizer,
        server_lr=args.server_lr,
        server_momentum=args.server_momentum,
        server_beta2=args.server_beta2,
        server_tau=args.server_tau,
        model_average=args.model_average,
    )
    try:
        config = FederatedConfig(**kwargs)
    except ValueError as e:
        first, _, rest = str(e).partition(" ")
        flag = {"learning_rate": "--lr", "target_epsilon": "--epsilon"}.get(
            first, "--" + first.replace("_", "-")
        )
        msg = f"{flag} {rest}" if first in kwargs else str(e)
        if error:
            error(msg)
        raise
    return config


def _eps(value) -> str:
    """An epsilon of a results dict for printing (None there means inf)."""
    return "inf" if value is None else f"{value:.4f}"


def _summary(config, result: dict) -> list[str]:
    """The lines printed at the end of a run: accuracy, what the run cost, notices."""
    from dpfl_tf.federated.server import rounds_text

    lines = [
        f"test accuracy = {result['test_accuracy']:.4f} after "
        f"{rounds_text(result['rounds'])} ({result['mechanism']}, K={result['clients']})"
    ]
    optimizer = config.build_server_optimizer()
    if not optimizer.is_plain_fedavg:
        settings = ", ".join(f"{k} {v:g}" for k, v in optimizer.get_config().items() if k != "kind")
        lines.append(
            f"server optimizer: {optimizer.kind} ({settings}); it reads only each round's "
            "released aggregate, so epsilon is unchanged by it"
        )
    privacy = result["privacy"]
    if config.dp.value == "local":
        from dpfl_tf.federated.local_dp import LocalPrivacyReport

        lines.append(str(LocalPrivacyReport.from_dict(privacy["local_dp"])))
    elif config.dp.value == "none":
        lines.append("epsilon = inf: no noise, no differential privacy guarantee")
    else:
        lines.append(
            f"epsilon = {_eps(result['epsilon'])} at delta = {result['delta']:g} "
            f"({result['accountant']} accountant; "
            f"{privacy.get('run_event') or privacy['round_event']}; "
            f"{privacy['relation']})"
        )
        clipping = privacy.get("clipping", {})
        if clipping.get("mode", "").startswith("adaptive"):
            lines.append(
                f"adaptive clip: {clipping['initial_clip']:g} -> "
                f"{clipping['current_clip']:.4g} (target quantile "
                f"{clipping['target_quantile']:g}; count noise std "
                f"{clipping['count_stddev']:g}; update noise multiplier "
                f"{clipping['update_noise_multiplier']:.4g})"
            )
        if "distributed" in privacy:
            ddp = privacy["distributed"]
            lines.append(
                f"distributed DP: {ddp['mechanism']} shares, {ddp['bits']} bits "
                f"({ddp['bits_per_parameter']:.2f} bits per parameter per upload), "
                f">= {ddp['min_clients']} shares per sum, norm inflation by rounding "
                f"{ddp['norm_inflation']:.4f}, wrap probability <= "
                f"{ddp['wrap_probability']:.2g} per coordinate"
            )
        if "against_server" in privacy:
            srv = privacy["against_server"]
            what = srv.get("upload_event") or srv["participation_event"]
            lines.append(
                f"against the server: epsilon = {_eps(srv['epsilon'])} per client "
                f"(up to {srv['max_participations']} rounds of {what}; "
                f"{srv['relation']})"
            )
    lines += [f"NOTE: {note}" for note in result["notices"]]
    lines.append(result["stop_reason"])
    return lines


def _run_federated(args, error) -> int:
    """One run of ``dpfl-tf federated`` (`dpfl_tf._runs.run_command`: results after every
    round, Ctrl-C, failures, the resume command); `error` refuses in one line."""
    import os

    from dpfl_tf._runs import CommandRun, check_run_outputs, quiet_tensorflow, run_command

    try:  # before any data is loaded
        check_run_outputs(args, "federated")
        if args.data_dir is not None and not os.path.isdir(args.data_dir):
            raise ValueError(f"--data-dir {args.data_dir!r} is not a directory")
    except ValueError as e:
        error(str(e))
    config = config_from_args(args, error)
    quiet_tensorflow(getattr(args, "verbose", False))
    from dpfl_tf.federated.runner import result_status, run_federated
    from dpfl_tf.federated.server import rounds_text

    def run(*, checkpoint_dir, checkpoint_every, should_stop, on_progress, on_resume):
        dataset = None
        if args.data_dir is not None:  # searched first, then the usual places
            from dpfl_tf.data import load_dataset

            dataset = load_dataset(config.dataset, data_dir=args.data_dir)
        result = run_federated(
            config,
            dataset,
            progress=not args.no_progress,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every_round=checkpoint_every,
            should_stop=should_stop,
            on_round=on_progress,
            on_resume=on_resume,
        )
        if result["rounds"] == 0 and config.rounds > 0 and result["stop_reason"] != "interrupted":
            raise ValueError(f"no round was run: {result['stop_reason']}")  # budget allows none
        return result

    def resumed(info: dict) -> str:
        eps = info["epsilon"]
        return (
            f"resumed from {info['directory']}: {info['rounds']} rounds, epsilon so far "
            f"{'n/a (no client-level DP)' if eps is None else f'{eps:.4f}'}"
        )

    return run_command(
        CommandRun(
            command="federated",
            argv=list(getattr(args, "argv", None) or sys.argv[1:]),
            output=args.output,
            checkpoint_dir=args.checkpoint_dir,
            unit="rounds",
            run=run,
            status=lambda r: result_status(r["stop_reason"]),
            resumed=resumed,
            progress=lambda r: f"after {rounds_text(r['rounds'])} (epsilon = {_eps(r['epsilon'])})",
            summary=lambda r: _summary(config, r),
            figure=lambda r, path: bool(r["history"]) and save_round_figure([r], path) is not None,
        ),
        error,
    )


def figure_title(result: dict) -> str:
    """What a run's figure shows: the mechanism with its noise, clip and sampling, and
    the epsilon spent at delta against the target (or the local-DP budget)."""
    from dpfl_tf.federated.server import rounds_text

    c = result["config"]
    setup = (
        f"{result['dataset']}, K = {c['clients']}, m = {result['clients_per_round']:g} "
        f"({c['sampling']}), {rounds_text(result['rounds'])}"
    )
    if c["dp"] == "none":
        return f"{result['mechanism']}, no DP (epsilon = inf); {setup}"
    if c["dp"] == "local":
        return (
            f"local DP: {c['ldp_mechanism']}, epsilon {c['ldp_epsilon']:g} per coordinate "
            f"(no central epsilon); {setup}"
        )
    what = {
        "global": "Global DP (server noise)",
        "client": "DP-FedAvg, client-side noise",
        "distributed": f"distributed DP ({c.get('ddp_mechanism')}, {c.get('bits')} bits)",
        "ftrl": "DP-FTRL (tree), cyclic cohorts",
        "banded_mf": "banded MF, cyclic cohorts",
        "blt": "BLT, cyclic cohorts",
    }
    target = "none" if c["target_epsilon"] is None else f"{c['target_epsilon']:g}"
    eps = "inf" if result["epsilon"] is None else f"{result['epsilon']:.3g}"
    return (
        f"{what[c['dp']]}: sigma = {c['noise_multiplier']:g}, S = {c['clip']}; "
        f"epsilon {eps} at delta = {result['delta']:g} (target {target}); {setup}"
    )


def save_round_figure(results: list, path: str):
    """Accuracy (and, for runs with a client-level epsilon, epsilon) per round, one line
    per run (labelled by mechanism), titled with what it shows (`figure_title`)."""
    from matplotlib.figure import Figure

    from dpfl_tf.plotting import plot_federated_rounds, save_figure

    with_eps = any(r.get("epsilon") is not None for run in results for r in run["history"])
    fig = Figure(figsize=(10, 4.2) if with_eps else (5.5, 4.2), layout="constrained")
    axes = fig.subplots(1, 2) if with_eps else [fig.subplots(), None]
    if axes[1] is None:  # no epsilon panel to leave empty: a hidden one for the plotter
        axes[1] = Figure().subplots()
    plot_federated_rounds(results, *axes)
    if len(results) == 1:
        fig.suptitle(figure_title(results[0]), fontsize=9, wrap=True)
    save_figure(fig, path)
    return fig


def main(argv=None) -> int:
    """Stand-alone entry point (``python -m dpfl_tf.federated.cli ...``): ``dpfl-tf
    federated ...``."""
    from dpfl_tf.cli import main as dpfl_tf_main

    return dpfl_tf_main(["federated", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())

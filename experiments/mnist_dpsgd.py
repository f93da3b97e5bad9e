"""Abadi et al. 2016, section 5.2 on real MNIST (or Fashion-MNIST), and beyond.

    python experiments/mnist_dpsgd.py                      # the paper's table + non-private
    python experiments/mnist_dpsgd.py --group beyond       # PLD accountant, tanh CNN, ScatterNet
    python experiments/mnist_dpsgd.py --group sweep        # Figure 5 points at eps = 2
    python experiments/mnist_dpsgd.py --group ceiling --seed 0   # non-private, a faster step
    python experiments/mnist_dpsgd.py --dataset fashion_mnist
    python experiments/mnist_dpsgd.py --only medium_noise --quick   # a short smoke run
    python experiments/mnist_dpsgd.py --group beyond --only medium_noise/pld --seed 0
        # one seeded run (its name ends in /seed0); run each seed in its own process
    python experiments/mnist_dpsgd.py --group tune --validation 6000 --seed 0
        # tuning trials: 6,000 training examples held out and evaluated on (/val6000)

Each run is written to results/<dataset>_dpsgd.json as soon as it finishes
(runs with the same name are replaced), then the figures are redrawn:
Figure 3 (accuracy and epsilon per epoch, one panel per setting), Figure 4
(best test accuracy versus epsilon for several delta) and Figure 5 (sweep).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from _common import RESULTS, load_runs

from dpfl_tf._io import atomic_write_json
from dpfl_tf.recipes.mnist import PAPER_SETTINGS, MnistConfig, train_mnist

PAPER_BASE = dict(
    projection="dp_pca",
    pca_dim=60,
    hidden_units=1000,
    lot_size=600,
    batch_size=1024,
    l2_norm_clip=4.0,
    learning_rate=0.1,
    final_learning_rate=0.052,
    decay_epochs=10,
    delta=1e-5,
)


def paper_runs(accountant: str = "moments") -> dict[str, MnistConfig]:
    runs = {}
    for name, s in PAPER_SETTINGS.items():
        runs[f"{name}/{accountant}"] = MnistConfig(
            setting=name,
            accountant=accountant,
            noise_multiplier=s["noise_multiplier"],
            pca_noise_multiplier=s["pca_noise_multiplier"],
            target_epsilon=s["target_epsilon"],
            **PAPER_BASE,
        )
    runs["nonprivate"] = MnistConfig(
        setting="nonprivate",
        private=False,
        projection="pca",
        epochs=100,
        target_epsilon=None,
        **{k: v for k, v in PAPER_BASE.items() if k not in ("projection",)},
    )
    return runs


def beyond_runs() -> dict[str, MnistConfig]:
    runs = {k: v for k, v in paper_runs("pld").items() if k != "nonprivate"}
    # Papernot et al. 2021: a small tanh CNN trained end to end with DP-SGD
    # (lot 256, clip 0.1, learning rate 4, 40 epochs); the noise multiplier is
    # calibrated so that 40 epochs spend exactly the target with the PLD accountant.
    cnn = dict(
        model="tanh_cnn",
        projection="none",
        lot_size=256,
        batch_size=256,
        l2_norm_clip=0.1,
        learning_rate=4.0,
        final_learning_rate=4.0,
        decay_epochs=0,
        accountant="pld",
        delta=1e-5,
        eval_every=2,
        epochs=40,
        noise_multiplier=None,
    )
    for eps in (8.0, 3.0, 2.0, 0.5):
        runs[f"tanh_cnn/eps{eps:g}"] = MnistConfig(
            setting=f"tanh_cnn_eps{eps:g}", target_epsilon=eps, **cnn
        )
    # Tramer & Boneh 2021: fixed ScatterNet features + a linear model (lot 4096,
    # clip 0.1, momentum 0.9, constant learning rate); noise calibrated so that
    # the epochs spend exactly the target with the PLD accountant.
    scatter = dict(
        model="scatter_linear",
        projection="none",
        lot_size=4096,
        batch_size=4096,
        l2_norm_clip=0.1,
        learning_rate=8.0,
        final_learning_rate=8.0,
        decay_epochs=0,
        momentum=0.9,
        accountant="pld",
        delta=1e-5,
        eval_every=5,
        epochs=60,
        noise_multiplier=None,
    )
    for eps in (8.0, 3.0, 2.0, 0.5):
        runs[f"scatter_linear/eps{eps:g}"] = MnistConfig(
            setting=f"scatter_linear_eps{eps:g}", target_epsilon=eps, **scatter
        )
    # at lr 8 the linear model still underfits (train accuracy below test): a larger step
    runs["scatter_linear/eps3/lr16"] = MnistConfig(
        setting="scatter_linear_eps3_lr16",
        target_epsilon=3.0,
        **dict(scatter, learning_rate=16.0, final_learning_rate=16.0),
    )
    return runs


def sweep_runs() -> dict[str, MnistConfig]:
    """Figure 5: vary one knob at a time around the medium-noise setting, eps = 2."""
    base = dict(
        PAPER_BASE,
        noise_multiplier=4.0,
        pca_noise_multiplier=7.0,
        target_epsilon=2.0,
        eval_every=10,
    )
    points = {
        "pca_dim": [20, 100],
        "hidden_units": [200, 1000],
        "lot_size": [300, 1200],
        "learning_rate": [0.05, 0.2],
        "l2_norm_clip": [2.0, 8.0],
        "noise_multiplier": [2.0, 8.0],
    }
    runs = {}
    for knob, values in points.items():
        for value in values:
            cfg = dict(base, **{knob: value})
            if knob == "learning_rate":
                cfg["final_learning_rate"] = value * 0.52
            if knob == "lot_size":
                cfg["batch_size"] = max(1024, 2 * value)
            runs[f"sweep/{knob}={value:g}"] = MnistConfig(setting=f"sweep:{knob}={value:g}", **cfg)
    return runs


def draw_all(results: list[dict], out_dir: str, dataset: str) -> None:
    """Figures 3, 4 and 5 from whatever runs the results file holds."""
    import matplotlib.pyplot as plt

    from dpfl_tf.plotting import (
        plot_accuracy_and_epsilon,
        plot_best_accuracy_vs_epsilon,
        save_figure,
    )

    main_runs = [  # one panel per setting: the seeded repeats (<run>/seed<N>) are left out
        r
        for r in results
        if r.get("private", True)
        and r.get("history")
        and not r["setting"].startswith("sweep")
        and "/seed" not in r.get("run", "")
        and not r.get("validation")
    ]
    if main_runs:
        fig, axes = plt.subplots(
            1, len(main_runs), figsize=(4.5 * len(main_runs), 3.5), squeeze=False
        )
        for ax, run in zip(axes[0], main_runs):
            plot_accuracy_and_epsilon(
                run["history"],
                ax,
                f"{run['run']}: {run['test_accuracy']:.3f} at eps={run['epsilon']:.2f}",
            )
        fig.tight_layout()
        save_figure(fig, os.path.join(out_dir, f"{dataset}_fig3_training.png"))
        fig, ax = plt.subplots(figsize=(5, 3.5))
        plot_best_accuracy_vs_epsilon(
            [r for r in main_runs if r["model"] == "mlp"], [1e-2, 1e-3, 1e-4, 1e-5], ax
        )
        ax.set_title(f"{dataset}: PCA + MLP, all runs")
        save_figure(fig, os.path.join(out_dir, f"{dataset}_fig4_accuracy_vs_epsilon.png"))
    sweep = [r for r in results if r["setting"].startswith("sweep:") and not r.get("validation")]
    if sweep:
        knobs = sorted({r["setting"].split(":")[1].split("=")[0] for r in sweep})
        fig, axes = plt.subplots(1, len(knobs), figsize=(3 * len(knobs), 3), squeeze=False)
        medium = next((r for r in results if r.get("run") == "medium_noise/moments"), None)
        for ax, knob in zip(axes[0], knobs):
            pts = sorted(
                (float(r["setting"].split("=")[1]), r["test_accuracy"])
                for r in sweep
                if r["setting"].split(":")[1].startswith(knob + "=")
            )
            if medium is not None:
                pts = sorted(pts + [(float(medium[knob]), medium["test_accuracy"])])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-")
            ax.set_xlabel(knob)
            ax.set_ylim(0.8, 1.0)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("test accuracy at eps = 2")
        fig.tight_layout()
        save_figure(fig, os.path.join(out_dir, f"{dataset}_fig5_sweep.png"))


def diagnose_runs() -> dict[str, MnistConfig]:
    """Why the medium-noise row (eps = 2) plateaus below the paper's 95%: the PLD
    accountant buys 357 epochs instead of 216 at the same (eps, delta), yet the
    accuracy stays at ~94.2% (the paper's constant 0.052 keeps SGD's noise floor).
    Probe: the same run with the learning rate decayed linearly 0.1 -> 0.01 over all
    357 epochs (a diagnostic on the test set, not a tuned setting)."""
    pld = paper_runs("pld")["medium_noise/pld"]
    return {
        "medium_noise/pld/anneal0.01": dataclasses.replace(
            pld, setting="medium_noise_anneal", final_learning_rate=0.01, decay_epochs=357
        )
    }


def ceiling_runs() -> dict[str, MnistConfig]:
    """The non-private ceiling of the paper's network with a step made for
    non-private training: the paper's run ("nonprivate") keeps the DP schedule
    (0.1 -> 0.052), which after 100 epochs still underfits (97.71% test, 98.19%
    train with seed 0); a constant step of 0.2 or 0.5 over the same 100 epochs of lot 600
    is what the paper's 98.3% needs (a diagnostic: nothing here is tuned for a
    private row)."""
    base = paper_runs()["nonprivate"]
    return {
        f"nonprivate/lr{lr:g}": dataclasses.replace(
            base,
            setting=f"nonprivate_lr{lr:g}",
            learning_rate=lr,
            final_learning_rate=lr,
            decay_epochs=0,
            eval_every=10,
        )
        for lr in (0.2, 0.5)
    }


def budget_epochs(config: MnistConfig, examples: int) -> int:
    """The epochs the recipe will run for `config` on `examples` training examples
    (its own `_planned_epochs`): DP-PCA over all of them (q_p = 1), then lots of
    q = L / N until the accountant reaches the target."""
    import dp_accounting

    from dpfl_tf.recipes.run import _planned_epochs

    pca = dp_accounting.PoissonSampledDpEvent(
        1.0, dp_accounting.GaussianDpEvent(config.pca_noise_multiplier)
    )
    rate, lots_per_epoch = config.lot_size / examples, max(1, examples // config.lot_size)
    return _planned_epochs(config, config.noise_multiplier, rate, pca, lots_per_epoch)


def tune_runs(validation: int = 0, wanted=lambda name: True) -> dict[str, MnistConfig]:
    """Trials for the small- and medium-noise rows (eps = 8 and 2, PLD): the step
    decayed linearly from 0.1 to a final value over the whole run the budget buys
    (`budget_epochs`, ~20 s each, computed only for a setting with a `wanted` run);
    and with a smaller clip C (2, 1, 0.5 or 0.25: `.../clip<C>/anneal<final>`), both steps
    scaled by 4 / C: the noise added to a step (step x sigma C / L) is the same, a
    gradient of norm 4 or more moves the weights as far as at C = 4, one below C
    4 / C times as far.
    Run them with --validation (tuning trials) and the chosen one without (the test)."""
    runs = {}
    for name, base in paper_runs("pld").items():
        if name not in ("small_noise/pld", "medium_noise/pld"):
            continue
        trials = {
            f"{name}/{_clip_tag(clip)}anneal{final:g}": (clip, final)
            for clip in (4.0, 2.0, 1.0, 0.5, 0.25)
            for final in (0.02, 0.01, 0.005, 0.0025)
        }
        trials = {k: v for k, v in trials.items() if wanted(k)}
        if not trials:
            continue
        epochs = budget_epochs(base, 60000 - validation)
        for run, (clip, final) in trials.items():
            scale = base.l2_norm_clip / clip  # the step of a clipped gradient is kept
            runs[run] = dataclasses.replace(
                base,
                setting=f"{base.setting}_{_clip_tag(clip)}anneal{final:g}",
                l2_norm_clip=clip,
                learning_rate=base.learning_rate * scale,
                final_learning_rate=final * scale,
                decay_epochs=epochs,
            )
    return runs


def _clip_tag(clip: float) -> str:
    """'' for the paper's clip (4), else 'clip<C>/' (the run names before clip trials stay)."""
    return "" if clip == 4.0 else f"clip{clip:g}/"


def draw_paper_comparison(results: list[dict], out_dir: str, dataset: str) -> None:
    """The paper's accuracies (Abadi et al. 2016, section 5.2) beside ours, per epsilon:
    every run of the paper's network (PCA 60 + 1000 ReLU, DP-PCA on all the training
    data, the sweep left out) as a dot, the runs of one setting (its seeds and an
    unseeded run) in one column with their mean as a bar."""
    import matplotlib.pyplot as plt

    from dpfl_tf.plotting import save_figure

    groups: dict[str, list[dict]] = {}
    for r in results:
        if (
            r.get("model") == "mlp"
            and r.get("epsilon")
            and r.get("pca_sample_size") is None
            and not r["setting"].startswith("sweep")
            and not r.get("validation")  # tuning trials: not test accuracies
        ):
            groups.setdefault(r["run"].split("/seed")[0], []).append(r)
    if not groups:
        return
    fig, ax = plt.subplots(figsize=(7.5, 4))
    targets = sorted({s["target_epsilon"] for s in PAPER_SETTINGS.values()})
    names = sorted(groups, key=lambda g: (groups[g][0]["target_epsilon"], g))
    for i, eps in enumerate(targets):
        at = [g for g in names if groups[g][0]["target_epsilon"] == eps]
        for j, g in enumerate(at):
            x = i + (j - (len(at) - 1) / 2) * 0.22
            acc = [100 * r["test_accuracy"] for r in groups[g]]
            ax.bar(x, sum(acc) / len(acc) - 85, bottom=85, width=0.2, alpha=0.35, color=f"C{j}")
            ax.plot([x] * len(acc), acc, "o", color=f"C{j}", ms=4)
            label = (g.split("/", 1)[1] if "/" in g else g).replace("/", "\n")
            ax.annotate(f"{label}\n{len(acc)} run(s)", (x, 85.3), ha="center", fontsize=5.5)
        paper = next(s for s in PAPER_SETTINGS.values() if s["target_epsilon"] == eps)
        ax.plot(
            [i - 0.45, i + 0.45],
            [100 * paper["paper_test_accuracy"]] * 2,
            "k--",
            label="Abadi et al. 2016" if i == 0 else None,
        )
    ax.set_xticks(range(len(targets)), [f"eps = {e:g}" for e in targets])
    ax.set_ylim(85, 100)
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{dataset}: DP-PCA 60 + 1000 ReLU, lot 600, delta 1e-5")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    save_figure(fig, os.path.join(out_dir, f"{dataset}_paper_vs_ours.png"))


GROUPS = {
    "paper": paper_runs,
    "beyond": beyond_runs,
    "sweep": sweep_runs,
    "diagnose": diagnose_runs,
    "ceiling": ceiling_runs,
    "tune": tune_runs,
}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="mnist", choices=["mnist", "fashion_mnist"])
    p.add_argument("--group", nargs="+", default=["paper"], choices=sorted(GROUPS))
    p.add_argument("--only", nargs="+", help="run names (or prefixes) to run")
    p.add_argument("--quick", action="store_true", help="cap every run at 3 epochs")
    p.add_argument("--output-dir", default=RESULTS)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--list", action="store_true", help="list the run names and exit")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed every run (noise, lot sampling, DP-PCA, initialisation); the run names "
        "get /seed<N>. Default: unseeded, the names as listed",
    )
    p.add_argument(
        "--validation",
        type=int,
        default=0,
        help="hold out this many training examples (the same draw every run) and evaluate "
        "on them, not on the test set: a tuning trial; the run names get /val<N>",
    )
    args = p.parse_args(argv)

    def wanted(name: str) -> bool:
        return not args.only or any(name.startswith(o) for o in args.only)

    runs = {}
    for g in args.group:
        runs.update(tune_runs(args.validation, wanted) if g == "tune" else GROUPS[g]())
    runs = {k: v for k, v in runs.items() if wanted(k)}
    if args.validation:
        runs = {
            f"{k}/val{args.validation}": dataclasses.replace(v, validation=args.validation)
            for k, v in runs.items()
        }
    if args.seed is not None:
        runs = {
            f"{k}/seed{args.seed}": dataclasses.replace(v, seed=args.seed) for k, v in runs.items()
        }
    if args.list or not runs:
        print("\n".join(runs) or "no run matches --only")
        return []
    path = os.path.join(args.output_dir, f"{args.dataset}_dpsgd.json")
    for name, config in runs.items():
        config = dataclasses.replace(config, dataset=args.dataset, data_dir=args.data_dir)
        if args.quick:
            config = dataclasses.replace(config, epochs=min(config.epochs, 3))
        print(f"== {args.dataset} {name}", flush=True)
        result = train_mnist(config)
        result["run"] = name
        result["quick"] = bool(args.quick)
        # re-read before writing: another invocation may have added runs meanwhile
        results = [r for r in load_runs(path) if r.get("run") != name] + [result]
        atomic_write_json(path, results)
        print(
            f"   {'validation' if config.validation else 'test'} accuracy "
            f"{result['test_accuracy']:.4f}  train {result['train_accuracy']:.4f}"
            " (non-private statistic)"
            + (
                f"  epsilon {result['epsilon']:.3f} (delta {config.delta:g}, {config.accountant})"
                if result["epsilon"] is not None
                else "  non-private"
            )
            + f"  epochs {result['epochs']}  {result['seconds']:.0f} s",
            flush=True,
        )
    draw_all(results, args.output_dir, args.dataset)
    draw_paper_comparison(results, args.output_dir, args.dataset)
    print(f"wrote {path} and figures in {args.output_dir}")
    return results


if __name__ == "__main__":
    main()

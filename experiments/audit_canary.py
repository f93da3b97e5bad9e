"""Canary audit of DP-SGD in one training run: the library and broken copies.

    python experiments/audit_canary.py            # full run (5,000 canaries per run)
    python experiments/audit_canary.py --quick    # smoke run (1,000 canaries)

Each run trains a softmax regression on a slice of MNIST (real data) plus
the included canaries with `dpfl_tf.keras.DPModel` (or a broken copy from
`experiments/broken_dpsgd.py`) and audits it with `dpfl_tf.audit.canary`:

* white box: m Dirac canaries in m extra input features (value 10, clip
  C = 1, so a canary's gradient has norm ~10 C), score "sum" (full-batch lots,
  where it is the likelihood-ratio test) or "spread" (Poisson lots; made to
  catch noise that does not change between lots) -- the statistic of a row is
  fixed by its setting before the run, never picked after;
* black box (library runs): 1,000 mislabelled MNIST test images in the same
  run, score = -loss of the final model;
* client level: Global DP (`dpfl_tf.federated`), 100 real clients plus one
  canary client per included canary (m canaries), every client in every
  round, clip S = 0.1, one local step of lr 0.1 (a canary update has norm
  ~10 S); the library and a Global DP that skips clipping.

The noise multiplier is calibrated so that the accountant (PLD, tight for
these events) claims exactly the target epsilon at delta = 1e-5 after the run;
broken copies claim what the library would claim.  A row's
``epsilon_lower_bound`` holds with 95 % confidence (Steinke, Nasr, Jagielski
2023, with a Bonferroni correction over the guess counts).  A library row
above its claim is a violation (exit status 1); a broken copy is *caught*
when its bound exceeds its claim.  ``ideal_gaussian`` is the bound the same
audit gives for an exactly Gaussian canary with the claimed privacy
(simulated): the ceiling of one-run auditing with m canaries.

The membership-inference audit (`experiments/audit_mia.py`) is copied in as
the black-box baseline rows from ``results/audit_mia.json`` (not rerun).

Repeated runs (``--repeats``, default 10): the library at each epsilon and
the noise-halving copy at epsilon 1 and 2, each with fresh coins, sampling and
noise seeds: how often a bound lands above the claim.

Writes ``results/audit_canary.json`` and ``results/audit_canary.png``
(``*_quick.*`` with ``--quick``).  Seeds: the canaries' coins, the data slice
and the lot sampling are seeded (reproducible audit); the DP noise is seeded
too (``noise_seed``), so every number here is reproducible -- which makes these
runs NOT for deployment.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import numpy as np  # noqa: E402

from dpfl_tf._io import atomic_write_json  # noqa: E402

DELTA = 1e-5
CONFIDENCE = 0.95
CLIP = 1.0
VALUE = 10.0
STEPS = 10


def load_mnist(n_real: int, n_black_box: int, seed: int = 0):
    from dpfl_tf.data.mnist import mnist

    data = mnist()
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(data.y_train), n_real, replace=False)
    bb = rng.choice(len(data.y_test), n_black_box, replace=False)
    x = data.x_train[idx].reshape(n_real, -1).astype(np.float32) / 255.0
    xb = data.x_test[bb].reshape(n_black_box, -1).astype(np.float32) / 255.0
    return x, data.y_train[idx].astype(np.int64), xb, data.y_test[bb].astype(np.int64)


def calibrate(target_epsilon: float, sampling: str, steps: int, q: float | None,
              accountant: str = "pld") -> tuple[float, float]:
    from dpfl_tf.privacy.calibration import calibrate_noise_multiplier
    from dpfl_tf.privacy.events import dp_sgd_event

    def make(sigma):
        kw = {"sampling_rate": q} if sampling == "poisson" else {}
        return dp_sgd_event(sigma, steps, sampling, **kw)

    return calibrate_noise_multiplier(target_epsilon, DELTA, make, accountant)


def audit_run(variant: str, target_epsilon: float, *, sampling: str, canaries: int,
              real, black_box=None, seed: int = 0, noise_seed: int | None = 1,
              accountant: str = "pld", learning_rate: float = 1.0,
              batches_per_lot: int = 16, statistic: str | None = None) -> dict:
    """One training run with canaries; returns the run's rows and facts."""
    import keras

    from broken_dpsgd import BROKEN_VARIANTS
    from dpfl_tf.audit.canary import DiracCanaries, MislabelledCanaries
    from dpfl_tf.keras import DPSGD, DPModel

    x, y, *_ = real
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    dirac = DiracCanaries(canaries, input_dim=x.shape[1], num_classes=10, value=VALUE,
                          seed=seed)
    x_train, y_train = dirac.training_data(x, y)
    bb = None
    if black_box is not None:
        bb = MislabelledCanaries(dirac.pad(black_box[0]), black_box[1], num_classes=10,
                                 seed=seed + 1)
        xb, yb = bb.included()
        x_train, y_train = np.concatenate([x_train, xb]), np.concatenate([y_train, yb])
    n = len(y_train)
    if sampling == "full_batch":
        lot, epochs, q = n, STEPS, None
    elif sampling == "poisson":
        lot, epochs, q = n // 2, STEPS // 2, (n // 2) / n   # 2 lots per epoch
    else:
        raise ValueError(f"sampling must be 'full_batch' or 'poisson', got {sampling!r}")
    sigma, claimed = calibrate(target_epsilon, sampling, STEPS, q, accountant)
    batch_size = math.ceil(lot / batches_per_lot)
    cls = DPModel if variant == "dpfl_tf" else BROKEN_VARIANTS[variant]
    model = keras.Sequential([keras.Input((dirac.total_dim,)),
                              keras.layers.Dense(10, kernel_initializer="zeros")])
    dp = cls(model, accountant=accountant)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the seeded-noise note
        opt = DPSGD(learning_rate, l2_norm_clip=CLIP, noise_multiplier=sigma, seed=noise_seed)
    dp.compile(optimizer=opt,
               loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    observer = dirac.observer(dp)
    t0 = time.perf_counter()
    dp.fit(x_train, y_train, lot_size=lot, batch_size=batch_size, epochs=epochs,
           sampling=sampling, sampling_seed=seed, verbose=0, callbacks=[observer],
           log_train_metrics=False)
    seconds = time.perf_counter() - t0
    eps = dp.epsilon(DELTA, accountant)
    if statistic is None:
        statistic = "sum" if sampling == "full_batch" else "spread"
    wb = dirac.audit(observer, delta=DELTA, confidence=CONFIDENCE, statistic=statistic)
    common = {"variant": variant, "target_epsilon": target_epsilon, "epsilon": eps,
              "delta": DELTA, "accountant": accountant, "confidence": CONFIDENCE,
              "sampling": sampling, "lots": dp.lots_computed, "noise_multiplier": sigma,
              "l2_norm_clip": CLIP, "learning_rate": learning_rate, "lot_size": lot,
              "batch_size": batch_size, "dataset_size": n, "real_examples": len(y),
              "seed": seed, "noise_seed": noise_seed, "train_seconds": round(seconds, 2)}
    rows = [{**common, "epsilon_lower_bound": wb.epsilon_lower_bound,
             "canaries": canaries, "method": f"one_run_{statistic}",
             "access": "white_box", "unit": "example", "canary": "dirac",
             "statistic": statistic, "guesses": wb.guesses, "correct": wb.correct,
             "tests": wb.tests, "caught": wb.epsilon_lower_bound > eps}]
    if bb is not None:
        res = bb.audit(dp, delta=DELTA, confidence=CONFIDENCE)
        rows.append({**common, "epsilon_lower_bound": res.epsilon_lower_bound,
                     "canaries": bb.num_canaries, "method": "one_run_loss",
                     "access": "black_box", "unit": "example", "canary": "mislabelled",
                     "statistic": "negative_loss", "guesses": res.guesses,
                     "correct": res.correct, "tests": res.tests,
                     "caught": res.epsilon_lower_bound > eps})
    return rows


def federated_run(variant: str, target_epsilon: float, *, canaries: int, real,
                  seed: int = 0, noise_seed: int = 1, rounds: int = STEPS,
                  clients: int = 100, clip: float = 0.1, local_lr: float = 0.1) -> dict:
    """Client-level audit of Global DP: `clients` real clients (equal shares of
    the real data) plus one canary client per included canary, every client in
    every round (Poisson rate 1), one local step each; clip S = `clip`, so a
    canary client's update (norm ~ local_lr * VALUE ~ 10 S) is clipped."""
    import keras

    from broken_dpsgd import SkipClippingGlobalDP
    from dpfl_tf.audit.canary import DiracCanaries, observe_rounds
    from dpfl_tf.federated.aggregators import GlobalDPAggregator
    from dpfl_tf.federated.client import LocalTrainer
    from dpfl_tf.federated.partition import ClientPartition
    from dpfl_tf.federated.server import ClientSampling, FederatedServer
    from dpfl_tf.sanitizer import GaussianSanitizer

    x, y, *_ = real
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    per = len(y) // clients
    partition = ClientPartition.from_lists([list(range(i * per, (i + 1) * per))
                                            for i in range(clients)])
    dirac = DiracCanaries(canaries, input_dim=x.shape[1], num_classes=10, value=VALUE,
                          seed=seed)
    xa, ya, pa = dirac.federated_data(x, y, partition)
    model = keras.Sequential([keras.Input((dirac.total_dim,)),
                              keras.layers.Dense(10, kernel_initializer="zeros")])
    trainer = LocalTrainer(model, xa, ya, local_epochs=1, batch_size=per,
                           learning_rate=local_lr)
    sigma, _ = calibrate(target_epsilon, "poisson", rounds, 1.0)
    cls = GlobalDPAggregator if variant == "dpfl_tf" else {
        "skip_clipping": SkipClippingGlobalDP}[variant]
    aggregator = cls(GaussianSanitizer(clip, sigma, seed=noise_seed))
    server = FederatedServer(trainer, pa, aggregator,
                             sampling=ClientSampling("poisson", fraction=1.0), test_data=None,
                             delta_max=DELTA, accountant="pld", seed=seed,
                             noise_seed=noise_seed, progress=False)
    observer = dirac.observer(trainer.model, loss=trainer.loss)
    t0 = time.perf_counter()
    observe_rounds(server, rounds, observer)
    seconds = time.perf_counter() - t0
    eps = server.epsilon()
    wb = dirac.audit(observer, delta=DELTA, confidence=CONFIDENCE, statistic="sum")
    return [{"variant": variant, "target_epsilon": target_epsilon, "epsilon": eps,
             "delta": DELTA, "accountant": "pld", "confidence": CONFIDENCE,
             "sampling": "poisson (rate 1: every client every round)", "lots": rounds,
             "noise_multiplier": sigma, "l2_norm_clip": clip, "learning_rate": local_lr,
             "clients": pa.num_clients, "real_clients": clients, "seed": seed,
             "noise_seed": noise_seed, "train_seconds": round(seconds, 2),
             "epsilon_lower_bound": wb.epsilon_lower_bound, "canaries": canaries,
             "method": "one_run_sum", "access": "white_box", "unit": "client",
             "canary": "dirac_client", "statistic": "sum", "guesses": wb.guesses,
             "correct": wb.correct, "tests": wb.tests,
             "caught": wb.epsilon_lower_bound > eps}]


def ideal_rows(targets, canaries: int) -> list[dict]:
    """The one-run bound for an exactly Gaussian canary (mu-GDP) whose PLD
    epsilon at DELTA is the target: what the method can reach with m canaries."""
    from scipy import optimize, stats

    from dpfl_tf.audit.one_run import ideal_gaussian_lower_bound

    def gdp_delta(eps, mu):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(
            -eps / mu - mu / 2)

    rows = []
    for t in targets:
        mu = optimize.brentq(lambda m: gdp_delta(t, m) - DELTA, 1e-3, 50)
        lbs = [ideal_gaussian_lower_bound(mu, canaries, delta=DELTA, confidence=CONFIDENCE,
                                          seed=s) for s in range(5)]
        rows.append({"variant": "ideal_gaussian", "epsilon": t, "mu": mu,
                     "epsilon_lower_bound": float(np.median(lbs)), "draws": lbs,
                     "confidence": CONFIDENCE, "canaries": canaries,
                     "method": "one_run_simulated", "access": "white_box",
                     "unit": "example", "delta": DELTA})
    return rows


def mia_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        mia = json.load(f)
    rows = []
    for model in mia.get("models", []):
        if model.get("epsilon") is None:
            continue
        best = model.get("max_epsilon_lower_bound_ci")
        if best is None:
            continue
        rows.append({"variant": "dpfl_tf", "epsilon": model["epsilon"],
                     "epsilon_lower_bound": best, "confidence": mia.get("confidence"),
                     "canaries": 0, "method": "membership_inference (audit_mia.json)",
                     "access": "black_box", "unit": "example", "model": model["name"]})
    return rows


def plot(rows, path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    top = max([r["epsilon"] for r in rows] + [8.0]) * 1.1
    ax.plot([0, top], [0, top], "k:", label="lower bound = claimed epsilon")
    style = {"dpfl_tf": ("tab:blue", "o"), "half_noise": ("tab:orange", "s"),
             "skip_clipping": ("tab:red", "^"), "per_batch_noise": ("tab:purple", "D"),
             "reused_noise": ("tab:brown", "v"), "ideal_gaussian": ("tab:gray", "x")}
    seen = set()
    for r in rows:
        color, marker = style.get(r["variant"], ("k", "."))
        setting = r.get("unit", "example")
        if r["variant"] == "dpfl_tf":
            if r["unit"] == "client":
                marker, setting = "P", "client, Global DP"
            elif str(r.get("sampling", "")).startswith("poisson"):
                marker, setting = "h", "example, Poisson lots"
            elif r["method"].startswith("membership"):
                color, marker, setting = "tab:gray", "s", "example, MIA baseline"
            else:
                setting = "example, full-batch lots"
        elif r["unit"] == "client":
            marker, setting = "X", "client, Global DP"
        label = f"{r['variant']} ({r['access'].replace('_', '-')}, {setting}, {r['method']})"
        filled = r["access"] == "white_box"
        ax.scatter(r["epsilon"], r["epsilon_lower_bound"], color=color, marker=marker,
                   facecolors=color if filled else "none", s=40,
                   label=None if label in seen else label)
        seen.add(label)
    ax.set_xlabel("claimed epsilon (accountant, delta = 1e-5)")
    ax.set_ylabel("epsilon lower bound (95 %)")
    ax.set_title("One-run canary audit: library vs broken DP-SGD copies")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    from dpfl_tf._io import atomic_write
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"),
                 binary=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", default=None)
    parser.add_argument("--repeats", type=int, default=None,
                        help="independent runs (new coins, sampling and noise) per repeated "
                             "setting (default 10; 3 with --quick)")
    args = parser.parse_args(argv)
    m = 1000 if args.quick else 5000
    n_real = 500 if args.quick else 1000
    real = load_mnist(n_real, 1000)
    targets = (1.0, 2.0, 4.0, 8.0)
    # (variant, claimed eps, lot sampling, white-box statistic, with black-box canaries)
    plan = [("dpfl_tf", t, "full_batch", "sum", True) for t in targets]
    plan += [("dpfl_tf", 2.0, "poisson", "spread", False),
             ("dpfl_tf", 8.0, "poisson", "sum", False)]
    plan += [("half_noise", t, "full_batch", "sum", False) for t in (1.0, 2.0)]
    plan += [("skip_clipping", 2.0, "full_batch", "sum", False),
             ("per_batch_noise", 2.0, "full_batch", "sum", False),
             ("reused_noise", 2.0, "poisson", "spread", False)]
    runs = []
    for i, (variant, t, sampling, statistic, with_bb) in enumerate(plan):
        rows = audit_run(variant, t, sampling=sampling, canaries=m, real=real,
                         black_box=real[2:] if with_bb else None, seed=i,
                         statistic=statistic)
        for r in rows:
            print(f"{variant:16s} {sampling:10s} {r['access']:9s} claimed eps "
                  f"{r['epsilon']:.3f}  lower bound {r['epsilon_lower_bound']:.2f}  "
                  f"({r['correct']}/{r['guesses']} correct, {r['train_seconds']} s)",
                  flush=True)
        runs += rows
    fed_plan = [("dpfl_tf", t) for t in targets] + [("skip_clipping", 2.0)]
    for i, (variant, t) in enumerate(fed_plan):
        rows = federated_run(variant, t, canaries=m,
                             real=real, seed=100 + i)
        for r in rows:
            print(f"{variant:16s} federated  client    claimed eps {r['epsilon']:.3f}  "
                  f"lower bound {r['epsilon_lower_bound']:.2f}  ({r['correct']}/"
                  f"{r['guesses']} correct, {r['train_seconds']} s)", flush=True)
        runs += rows
    # Repeated runs: how often the library's bound stays below its claim, and how
    # often the borderline broken copy (noise x 1/2) is caught.
    repeats_n = args.repeats or (3 if args.quick else 10)
    repeats = []
    repeat_plan = [("dpfl_tf", t) for t in targets] + [("half_noise", 1.0),
                                                        ("half_noise", 2.0)]
    for variant, t in repeat_plan:
        rows = [audit_run(variant, t, sampling="full_batch", canaries=m, real=real,
                          seed=1000 + j, noise_seed=2000 + j)[0] for j in range(repeats_n)]
        lbs = [r["epsilon_lower_bound"] for r in rows]
        rep = {"variant": variant, "epsilon": rows[0]["epsilon"], "sampling": "full_batch",
               "access": "white_box", "unit": "example", "method": "one_run_sum",
               "canaries": m, "confidence": CONFIDENCE, "runs": repeats_n,
               "seeds": [1000 + j for j in range(repeats_n)],
               "epsilon_lower_bounds": lbs, "median_lower_bound": float(np.median(lbs)),
               "above_claim": int(sum(r["caught"] for r in rows))}
        print(f"repeated {variant:12s} claimed eps {rep['epsilon']:.3f}: lower bounds "
              f"{lbs}; above the claim in {rep['above_claim']}/{repeats_n}", flush=True)
        repeats.append(rep)
    ideal = ideal_rows(targets, m)
    mia = mia_rows(os.path.join(ROOT, "results", "audit_mia.json"))
    violations = [r for r in runs if r["variant"] == "dpfl_tf" and r["caught"]]
    violations += [r for r in repeats if r["variant"] == "dpfl_tf" and r["above_claim"]]
    missed = [{"variant": r["variant"], "epsilon": r["epsilon"], "unit": r["unit"],
               "epsilon_lower_bound": r["epsilon_lower_bound"]}
              for r in runs if r["variant"] != "dpfl_tf" and not r["caught"]]
    out = args.output or os.path.join(
        ROOT, "results", "audit_canary_quick.json" if args.quick else "audit_canary.json")
    result = {"experiment": "one-run canary audit (Steinke, Nasr, Jagielski 2023)",
              "command": "python experiments/audit_canary.py" + (" --quick" if args.quick else ""),
              "quick": args.quick, "dataset": "MNIST", "model": "softmax regression on "
              "784 + m features", "steps": STEPS, "delta": DELTA, "confidence": CONFIDENCE,
              "canary_value": VALUE, "runs": runs + mia, "ideal_gaussian": ideal,
              "repeats": repeats, "violations": violations, "broken_not_caught": missed,
              "note": "seeded noise and sampling: reproducible, NOT for deployment"}
    atomic_write_json(out, result)
    plot(runs + mia + ideal, out[:-5] + ".png")
    print(f"wrote {out}; violations: {len(violations)}; broken-copy runs not caught: {missed}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())

"""Canary audit of DP-SGD: the library and broken copies, one run and many runs.

    python experiments/audit_canary.py            # full run (about 20 min on 2 shared cores)
    python experiments/audit_canary.py --quick    # smoke run (1,000 canaries, few repeats)

Each one-run training run trains a softmax regression on a slice of MNIST
(real data) plus the included canaries with `dpfl_tf.keras.DPModel` (or a
broken copy from `experiments/broken_dpsgd.py`) and audits it with
`dpfl_tf.audit.canary`:

* white box: m = 5,000 Dirac canaries per run in m extra input features
  (value 10, clip C = 1, so a canary's gradient has norm ~10 C), score "sum"
  (full-batch lots, where it is the likelihood-ratio test) or "spread"
  (Poisson lots; made to catch noise that does not change between lots) --
  the statistic of a row is fixed by its setting before the run, never picked
  after.  Two tests of the same scores: ``eps_dp`` (Steinke, Nasr, Jagielski
  2023; valid for every mechanism) and ``gdp`` (the f-DP refinement of
  Mahloujifar, Melis, Chaudhuri 2024; valid for Gaussian mechanisms, i.e. the
  full-batch and every-client-every-round rows only).  Full-batch rows pool
  ``POOL`` = 2 independent runs (fresh canaries, coins, data order and noise)
  into one audit of 10,000 canaries: each coin moves only its own run, so
  the one-run theorems hold for the pooled scores;
* black box (library runs): 1,000 mislabelled MNIST test images in the first
  run, score = -loss of the final model;
* client level: Global DP (`dpfl_tf.federated`), 100 real clients plus one
  canary client per included canary (m canaries), every client in every
  round, clip S = 0.1, one local step of lr 0.1 (a canary update has norm
  ~10 S); the library and a Global DP that skips clipping;
* multi-run (`dpfl_tf.audit.multi_run`): R independent trainings of a tiny
  model (200 MNIST images, one Dirac canary in half of the runs); the
  white-box score is standardised by the claimed noise (out-score ~ N(0, 1))
  and thresholded at mu_claimed / 2, a threshold fixed before the runs.

The noise multiplier is calibrated so that the accountant (PLD, tight for
these events) claims exactly the target epsilon at delta = 1e-5 after the run;
broken copies claim what the library would claim.  A row's
``epsilon_lower_bound`` holds with 95 % confidence.  A library row above its
claim is a violation (exit status 1); a broken copy is *caught* when its
bound exceeds its claim.  ``ideal_gaussian`` is the bound the same audit gives
for an exactly Gaussian canary with the claimed privacy (simulated): the
ceiling of one-run auditing with that many canaries.

The membership-inference audit (`experiments/audit_mia.py`) is copied in as
the black-box baseline rows from ``results/audit_mia.json`` (not rerun).

Repeated audits (``--repeats``, default 10): the noise-halving copy at claimed
epsilon 1 and 2, and (``--library-repeats``, default 5) the library at 1, 2,
4 and 8, each pooled like the main rows with fresh coins, sampling and noise seeds:
how often a bound lands above the claim.

Writes ``results/audit_canary.json`` and ``results/audit_canary.png``
(``*_quick.*`` with ``--quick``).  Seeds: the canaries' coins, the data slice
and the lot sampling are seeded (reproducible audit); the DP noise is seeded
too (``noise_seed``), so every number here is reproducible -- which makes these
runs NOT for deployment.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import numpy as np
from _common import RESULTS

from dpfl_tf._io import atomic_write_json

DELTA = 1e-5
CONFIDENCE = 0.95
CLIP = 1.0
VALUE = 10.0
STEPS = 10
POOL = 2  # runs pooled into one full-batch audit


def spread_seed(n: int) -> int:
    """A noise seed for run number n whose noise shares no draw with any other
    run's.  The sanitizer now hashes the seed into its noise key
    (`seeded_noise_key`), so any distinct seeds would do; the results in
    results/audit_canary.json were made when lot t of seed s drew from
    [s XOR t, j], where seeds differing in their low bits shared draws, and
    the run number above bit 20 kept runs apart."""
    return (int(n) + 1) << 20


TESTS = ("eps_dp", "gdp")


def load_mnist(n_real: int, n_black_box: int, seed: int = 0):
    from dpfl_tf.data.mnist import mnist

    data = mnist()
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(data.y_train), n_real, replace=False)
    bb = rng.choice(len(data.y_test), n_black_box, replace=False)
    x = data.x_train[idx].reshape(n_real, -1).astype(np.float32) / 255.0
    xb = data.x_test[bb].reshape(n_black_box, -1).astype(np.float32) / 255.0
    return x, data.y_train[idx].astype(np.int64), xb, data.y_test[bb].astype(np.int64)


@functools.lru_cache(maxsize=None)
def calibrate(
    target_epsilon: float, sampling: str, steps: int, q: float | None, accountant: str = "pld"
) -> tuple[float, float]:
    from dpfl_tf.privacy.calibration import calibrate_noise_multiplier
    from dpfl_tf.privacy.events import dp_sgd_event

    def make(sigma):
        kw = {"sampling_rate": q} if sampling == "poisson" else {}
        return dp_sgd_event(sigma, steps, sampling, **kw)

    return calibrate_noise_multiplier(target_epsilon, DELTA, make, accountant)


def audit_run(
    variant: str,
    target_epsilon: float,
    *,
    sampling: str,
    canaries: int,
    real,
    black_box=None,
    seed: int = 0,
    noise_seed: int | None = None,
    accountant: str = "pld",
    learning_rate: float = 1.0,
    batches_per_lot: int = 16,
    statistic: str | None = None,
) -> dict:
    """One training run with canaries: its facts (``common``), the white-box
    scores and coins, and the black-box canaries' scores and coins (if any)."""
    import keras
    from broken_dpsgd import BROKEN_VARIANTS

    from dpfl_tf.audit.canary import DiracCanaries, MislabelledCanaries
    from dpfl_tf.keras import DPSGD, DPModel

    x, y, *_ = real
    noise_seed = spread_seed(seed) if noise_seed is None else noise_seed
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    dirac = DiracCanaries(canaries, input_dim=x.shape[1], num_classes=10, value=VALUE, seed=seed)
    x_train, y_train = dirac.training_data(x, y)
    bb = None
    if black_box is not None:
        bb = MislabelledCanaries(
            dirac.pad(black_box[0]), black_box[1], num_classes=10, seed=seed + 1
        )
        xb, yb = bb.included()
        x_train, y_train = np.concatenate([x_train, xb]), np.concatenate([y_train, yb])
    n = len(y_train)
    if sampling == "full_batch":
        lot, epochs, q = n, STEPS, None
    elif sampling == "poisson":
        lot, epochs, q = n // 2, STEPS // 2, (n // 2) / n  # 2 lots per epoch
    else:
        raise ValueError(f"sampling must be 'full_batch' or 'poisson', got {sampling!r}")
    sigma, claimed = calibrate(target_epsilon, sampling, STEPS, q, accountant)
    batch_size = math.ceil(lot / batches_per_lot)
    cls = DPModel if variant == "dpfl_tf" else BROKEN_VARIANTS[variant]
    model = keras.Sequential(
        [keras.Input((dirac.total_dim,)), keras.layers.Dense(10, kernel_initializer="zeros")]
    )
    dp = cls(model, accountant=accountant)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the seeded-noise note
        opt = DPSGD(learning_rate, l2_norm_clip=CLIP, noise_multiplier=sigma, seed=noise_seed)
    dp.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    observer = dirac.observer(dp)
    t0 = time.perf_counter()
    # per-epoch logs from the fast RDP accountant; the claim below is PLD's
    dp.fit(
        x_train,
        y_train,
        lot_size=lot,
        batch_size=batch_size,
        epochs=epochs,
        sampling=sampling,
        sampling_seed=seed,
        verbose=0,
        callbacks=[observer],
        log_train_metrics=False,
        accountant="rdp",
    )
    seconds = time.perf_counter() - t0
    eps = dp.epsilon(DELTA, accountant)
    if statistic is None:
        statistic = "sum" if sampling == "full_batch" else "spread"
    common = {
        "variant": variant,
        "target_epsilon": target_epsilon,
        "epsilon": eps,
        "delta": DELTA,
        "accountant": accountant,
        "confidence": CONFIDENCE,
        "sampling": sampling,
        "lots": dp.lots_computed,
        "noise_multiplier": sigma,
        "l2_norm_clip": CLIP,
        "learning_rate": learning_rate,
        "lot_size": lot,
        "batch_size": batch_size,
        "dataset_size": n,
        "real_examples": len(y),
        "seed": seed,
        "noise_seed": noise_seed,
        "train_seconds": round(seconds, 2),
        "statistic": statistic,
    }
    out = {"common": common, "scores": observer.scores(statistic), "coins": dirac.coins()}
    if bb is not None:
        out["bb_scores"], out["bb_coins"] = bb.scores(dp), bb.coins()
    return out


def one_run_rows(
    runs: list, tests=TESTS, *, access="white_box", unit="example", canary="dirac"
) -> list:
    """Rows of the one-run audit of the pooled scores and coins of `runs`
    (independent runs of one setting), one row per test."""
    from dpfl_tf.audit.one_run import epsilon_lower_bound_from_scores

    key = "scores" if access == "white_box" else "bb_scores"
    scores = np.concatenate([r[key] for r in runs])
    coins = np.concatenate([r["coins" if access == "white_box" else "bb_coins"] for r in runs])
    common = dict(runs[0]["common"])
    eps = common["epsilon"]
    common.update(
        seeds=[r["common"]["seed"] for r in runs],
        noise_seeds=[r["common"]["noise_seed"] for r in runs],
        train_seconds=round(sum(r["common"]["train_seconds"] for r in runs), 2),
    )
    statistic = common["statistic"] if access == "white_box" else "negative_loss"
    rows = []
    for test in tests:
        res = epsilon_lower_bound_from_scores(
            scores, coins, delta=DELTA, confidence=CONFIDENCE, method=test
        )
        rows.append(
            {
                **common,
                "epsilon_lower_bound": res.epsilon_lower_bound,
                "mu_lower_bound": res.mu_lower_bound,
                "canaries": len(scores),
                "runs_pooled": len(runs),
                "method": f"one_run_{test}_{statistic}",
                "test": test,
                "access": access,
                "unit": unit,
                "canary": canary,
                "statistic": statistic,
                "guesses": res.guesses,
                "correct": res.correct,
                "tests": res.tests,
                "caught": res.epsilon_lower_bound > eps,
            }
        )
    return rows


def federated_run(
    variant: str,
    target_epsilon: float,
    *,
    canaries: int,
    real,
    seed: int = 0,
    noise_seed: int | None = None,
    rounds: int = STEPS,
    clients: int = 100,
    clip: float = 0.1,
    local_lr: float = 0.1,
) -> list:
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
    noise_seed = spread_seed(seed) if noise_seed is None else noise_seed
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    per = len(y) // clients
    partition = ClientPartition.from_lists(
        [list(range(i * per, (i + 1) * per)) for i in range(clients)]
    )
    dirac = DiracCanaries(canaries, input_dim=x.shape[1], num_classes=10, value=VALUE, seed=seed)
    xa, ya, pa = dirac.federated_data(x, y, partition)
    model = keras.Sequential(
        [keras.Input((dirac.total_dim,)), keras.layers.Dense(10, kernel_initializer="zeros")]
    )
    trainer = LocalTrainer(model, xa, ya, local_epochs=1, batch_size=per, learning_rate=local_lr)
    sigma, _ = calibrate(target_epsilon, "poisson", rounds, 1.0)
    cls = (
        GlobalDPAggregator
        if variant == "dpfl_tf"
        else {"skip_clipping": SkipClippingGlobalDP}[variant]
    )
    aggregator = cls(GaussianSanitizer(clip, sigma, seed=noise_seed))
    server = FederatedServer(
        trainer,
        pa,
        aggregator,
        sampling=ClientSampling("poisson", fraction=1.0),
        test_data=None,
        delta_max=DELTA,
        accountant="pld",
        seed=seed,
        noise_seed=noise_seed,
        progress=False,
    )
    observer = dirac.observer(trainer.model, loss=trainer.loss)
    t0 = time.perf_counter()
    observe_rounds(server, rounds, observer)
    seconds = time.perf_counter() - t0
    eps = server.epsilon()
    common = {
        "variant": variant,
        "target_epsilon": target_epsilon,
        "epsilon": eps,
        "delta": DELTA,
        "accountant": "pld",
        "confidence": CONFIDENCE,
        "sampling": "poisson (rate 1: every client every round)",
        "lots": rounds,
        "noise_multiplier": sigma,
        "l2_norm_clip": clip,
        "learning_rate": local_lr,
        "clients": pa.num_clients,
        "real_clients": clients,
        "seed": seed,
        "noise_seed": noise_seed,
        "train_seconds": round(seconds, 2),
        "statistic": "sum",
    }
    return one_run_rows(
        [{"common": common, "scores": observer.scores("sum"), "coins": dirac.coins()}],
        unit="client",
        canary="dirac_client",
    )


def ideal_rows(targets, canaries: int, draws: int = 5) -> list[dict]:
    """The one-run bounds for an exactly Gaussian canary (mu-GDP) whose epsilon
    at DELTA is the target: what each test can reach with that many canaries."""
    from dpfl_tf.audit.one_run import gdp_mu, ideal_gaussian_lower_bound

    rows = []
    for t in targets:
        mu = gdp_mu(t, DELTA)
        for test in TESTS:
            lbs = [
                ideal_gaussian_lower_bound(
                    mu, canaries, delta=DELTA, confidence=CONFIDENCE, seed=s, method=test
                )
                for s in range(draws)
            ]
            rows.append(
                {
                    "variant": "ideal_gaussian",
                    "epsilon": t,
                    "mu": mu,
                    "epsilon_lower_bound": float(np.median(lbs)),
                    "draws": lbs,
                    "confidence": CONFIDENCE,
                    "canaries": canaries,
                    "test": test,
                    "method": f"one_run_{test}_simulated",
                    "access": "white_box",
                    "unit": "example",
                    "delta": DELTA,
                }
            )
    return rows


def multi_run(
    variant: str, target_epsilon: float, runs: int, *, real, seed: int, n_real: int = 200
) -> list[dict]:
    """The multi-run audit of a tiny model: `runs` independent full-batch
    trainings on `n_real` MNIST images, one Dirac canary in half of them (in a
    random order).  The white-box score is standardised by the claimed noise (an out
    run's score is N(0, 1) under the claim) and thresholded at
    mu_claimed / 2, fixed before the runs."""
    import warnings

    import keras
    from broken_dpsgd import BROKEN_VARIANTS

    from dpfl_tf.audit.canary import DiracCanaries, WhiteBoxObserver
    from dpfl_tf.audit.multi_run import multi_run_epsilon_lower_bound
    from dpfl_tf.audit.one_run import gdp_mu
    from dpfl_tf.keras import DPSGD, DPModel

    x, y = real[0][:n_real], real[1][:n_real]
    sigma, claimed = calibrate(target_epsilon, "full_batch", STEPS, None)
    mu_claim = gdp_mu(claimed, DELTA)
    canary = DiracCanaries(1, input_dim=x.shape[1], num_classes=10, value=VALUE, seed=seed)
    xc, yc = canary.examples()
    xp = canary.pad(x)
    rng = np.random.default_rng(seed)
    coins = rng.permutation(np.arange(runs) < runs // 2)  # half with the canary
    cls = DPModel if variant == "dpfl_tf" else BROKEN_VARIANTS[variant]
    scores, t0 = [], time.perf_counter()
    for j, coin in enumerate(coins):
        keras.backend.clear_session()
        xt, yt = (np.concatenate([xp, xc]), np.concatenate([y, yc])) if coin else (xp, y)
        n = len(yt)
        model = keras.Sequential(
            [keras.Input((canary.total_dim,)), keras.layers.Dense(10, kernel_initializer="zeros")]
        )
        dp = cls(model, accountant="pld")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the seeded-noise note
            opt = DPSGD(
                1.0, l2_norm_clip=CLIP, noise_multiplier=sigma, seed=spread_seed(seed * 100_000 + j)
            )
        dp.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        observer = WhiteBoxObserver(dp, xc, yc, canary.rows)
        dp.fit(
            xt,
            yt,
            lot_size=n,
            batch_size=math.ceil(n / 4),
            epochs=STEPS,
            sampling="full_batch",
            sampling_seed=seed + j,
            verbose=0,
            callbacks=[observer],
            log_train_metrics=False,
            accountant="rdp",
        )
        # projection per lot = lr / L (<clipped grad, u> + N(0, sigma^2 C^2))
        scores.append(float(observer.scores("sum")[0]) * n / (sigma * CLIP * math.sqrt(STEPS)))
    seconds = time.perf_counter() - t0
    scores = np.asarray(scores)
    rows = []
    for test in TESTS:
        res = multi_run_epsilon_lower_bound(
            scores[coins],
            scores[~coins],
            delta=DELTA,
            confidence=CONFIDENCE,
            method=test,
            threshold=mu_claim / 2,
            mechanism=dp.privacy_ledger,
        )  # full batch
        rows.append(
            {
                "variant": variant,
                "target_epsilon": target_epsilon,
                "epsilon": claimed,
                "delta": DELTA,
                "accountant": "pld",
                "confidence": CONFIDENCE,
                "sampling": "full_batch",
                "lots": STEPS,
                "noise_multiplier": sigma,
                "l2_norm_clip": CLIP,
                "learning_rate": 1.0,
                "real_examples": n_real,
                "seed": seed,
                "runs": int(runs),
                "train_seconds": round(seconds, 2),
                "canaries": int(runs),
                "epsilon_lower_bound": res.epsilon_lower_bound,
                "mu_lower_bound": res.mu_lower_bound,
                "mu_claimed": mu_claim,
                "method": f"multi_run_{test}",
                "test": test,
                "access": "white_box",
                "unit": "example",
                "canary": "dirac",
                "statistic": "sum_standardised",
                "threshold": res.threshold,
                "runs_in": res.runs_in,
                "runs_out": res.runs_out,
                "false_positives": res.false_positives,
                "false_negatives": res.false_negatives,
                "fpr_upper": res.fpr_upper,
                "fnr_upper": res.fnr_upper,
                "scores_in": scores[coins].round(4).tolist(),
                "scores_out": scores[~coins].round(4).tolist(),
                "caught": res.epsilon_lower_bound > claimed,
            }
        )
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
        rows.append(
            {
                "variant": "dpfl_tf",
                "epsilon": model["epsilon"],
                "epsilon_lower_bound": best,
                "confidence": mia.get("confidence"),
                "canaries": 0,
                "method": "membership_inference (audit_mia.json)",
                "access": "black_box",
                "unit": "example",
                "model": model["name"],
            }
        )
    return rows


def plot(rows, path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 5.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    top = max([r["epsilon"] for r in rows] + [8.0]) * 1.1
    ax.plot([0, top], [0, top], "k:", label="lower bound = claimed epsilon")
    color = {
        "dpfl_tf": "tab:blue",
        "half_noise": "tab:orange",
        "skip_clipping": "tab:red",
        "per_batch_noise": "tab:purple",
        "reused_noise": "tab:brown",
        "ideal_gaussian": "tab:gray",
    }
    seen = set()
    for r in rows:
        c = color.get(r["variant"], "k")
        method = r["method"]
        if method.startswith("membership"):
            c, marker, setting = "tab:gray", "s", "MIA baseline"
        elif r["unit"] == "client":
            marker, setting = "P", "client, Global DP"
        elif method.startswith("multi_run"):
            marker, setting = "*", f"multi-run, {r['runs']} tiny models"
        elif str(r.get("sampling", "")).startswith("poisson"):
            marker, setting = "h", "Poisson lots"
        elif r["variant"] == "ideal_gaussian":
            marker = "x" if r.get("test") == "gdp" else "+"
            setting = f"simulated, {r['canaries']} canaries"
        else:
            marker, setting = ("o" if r["access"] == "white_box" else "v"), "full batch"
        test = r.get("test", "")
        label = f"{r['variant']} ({r['access'].replace('_', '-')}, {setting}, {test or method})"
        filled = test != "eps_dp" or marker in ("x", "+")  # line markers have no face
        ax.scatter(
            r["epsilon"],
            r["epsilon_lower_bound"],
            color=c,
            marker=marker,
            facecolors=c if filled else "none",
            s=45,
            label=None if label in seen else label,
        )
        seen.add(label)
    ax.set_xlabel("claimed epsilon (accountant, delta = 1e-5)")
    ax.set_ylabel("epsilon lower bound (95 %)")
    ax.set_title(
        "Canary audit: library vs broken DP-SGD copies (filled: GDP test, hollow: eps-DP test)"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    from dpfl_tf._io import atomic_write

    atomic_write(
        path, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"), binary=True
    )


def _show(rows):
    for r in rows:
        print(
            f"{r['variant']:16s} {r['unit']:7s} {r['method']:26s} claimed eps "
            f"{r['epsilon']:.3f}  lower bound {r['epsilon_lower_bound']:.2f}  "
            f"(canaries {r['canaries']}, {r['train_seconds']} s)",
            flush=True,
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--output", default=None)
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="repeated audits of the noise-halving copy at claimed eps 1 and 2 "
        "(default 10; 2 with --quick)",
    )
    parser.add_argument(
        "--library-repeats",
        type=int,
        default=None,
        help="repeated audits of the library at each eps (default 5; 1 with --quick)",
    )
    parser.add_argument(
        "--multi-runs",
        type=int,
        default=None,
        help="tiny-model runs of the multi-run audit of the library at eps 8 "
        "(default 100; 10 with --quick; 40 %% as many for the broken "
        "copy)",
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    m = 1000 if args.quick else 5000
    n_real = 500
    real = load_mnist(n_real, 1000)
    targets = (1.0, 2.0, 4.0, 8.0)
    pool = 1 if args.quick else POOL
    runs = []

    def pooled(variant, t, sampling, statistic, seeds, with_bb=False, tests=TESTS, **kw):
        got = [
            audit_run(
                variant,
                t,
                sampling=sampling,
                canaries=m,
                real=real,
                black_box=real[2:] if (with_bb and i == 0) else None,
                seed=s,
                noise_seed=spread_seed(s),
                statistic=statistic,
                batches_per_lot=kw.get("batches_per_lot", 4),
            )
            for i, s in enumerate(seeds)
        ]
        rows = one_run_rows(got, tests)
        if with_bb:
            rows += one_run_rows(got[:1], ("eps_dp",), access="black_box", canary="mislabelled")
        return rows

    # library, full batch (pooled runs; both tests), black box in the first run
    for i, t in enumerate(targets):
        rows = pooled(
            "dpfl_tf", t, "full_batch", "sum", [i * 10 + k for k in range(pool)], with_bb=True
        )
        _show(rows)
        runs += rows
    # library, Poisson lots (eps-DP test only: the claim is not GDP)
    for t, stat in ((2.0, "spread"), (8.0, "sum")):
        rows = pooled("dpfl_tf", t, "poisson", stat, [50 + int(t)], tests=("eps_dp",))
        _show(rows)
        runs += rows
    # broken copies (claimed eps 1 / 2)
    for t in (1.0, 2.0):
        rows = pooled(
            "half_noise", t, "full_batch", "sum", [60 + int(t) * 10 + k for k in range(pool)]
        )
        _show(rows)
        runs += rows
    for variant, sampling, stat, tests, bpl in (
        ("skip_clipping", "full_batch", "sum", TESTS, 4),
        ("per_batch_noise", "full_batch", "sum", TESTS, 16),
        ("reused_noise", "poisson", "spread", ("eps_dp",), 4),
    ):
        rows = pooled(
            variant, 2.0, sampling, stat, [90 + len(runs)], tests=tests, batches_per_lot=bpl
        )
        _show(rows)
        runs += rows
    # client level (every client every round: a Gaussian mechanism, both tests)
    fed_plan = [("dpfl_tf", t) for t in targets] + [("skip_clipping", 2.0)]
    for i, (variant, t) in enumerate(fed_plan):
        rows = federated_run(variant, t, canaries=m, real=real, seed=100 + i)
        _show(rows)
        runs += rows
    # multi-run: tiny models
    r_lib = args.multi_runs or (10 if args.quick else 100)
    for variant, t, r in (
        ("dpfl_tf", 8.0, r_lib),
        ("skip_clipping", 2.0, max(4, (2 * r_lib) // 5)),
    ):
        rows = multi_run(variant, t, r, real=real, seed=300 + int(t))
        _show(rows)
        runs += rows
    # repeated audits: the borderline broken copy, and the library's claim
    repeats_n = args.repeats or (2 if args.quick else 10)
    lib_n = args.library_repeats or (1 if args.quick else 5)
    repeats = []
    for variant, t, n_rep in [("half_noise", 1.0, repeats_n), ("half_noise", 2.0, repeats_n)] + [
        ("dpfl_tf", t, lib_n) for t in targets
    ]:
        per_test = {test: [] for test in TESTS}
        for j in range(n_rep):
            seeds = [1000 + 10 * j + k for k in range(pool)]
            for row in pooled(variant, t, "full_batch", "sum", seeds):
                per_test[row["test"]].append(row)
        for test, rows in per_test.items():
            lbs = [r["epsilon_lower_bound"] for r in rows]
            rep = {
                "variant": variant,
                "epsilon": rows[0]["epsilon"],
                "sampling": "full_batch",
                "access": "white_box",
                "unit": "example",
                "test": test,
                "method": rows[0]["method"],
                "canaries": rows[0]["canaries"],
                "runs_pooled": pool,
                "confidence": CONFIDENCE,
                "audits": n_rep,
                "seeds": [r["seeds"] for r in rows],
                "epsilon_lower_bounds": lbs,
                "median_lower_bound": float(np.median(lbs)),
                "above_claim": int(sum(r["caught"] for r in rows)),
            }
            print(
                f"repeated {variant:12s} {test:6s} claimed eps {rep['epsilon']:.3f}: lower "
                f"bounds {lbs}; above the claim in {rep['above_claim']}/{n_rep}",
                flush=True,
            )
            repeats.append(rep)
    ideal = ideal_rows(targets, m * pool)
    mia = mia_rows(os.path.join(RESULTS, "audit_mia.json"))
    violations = [r for r in runs if r["variant"] == "dpfl_tf" and r["caught"]]
    violations += [r for r in repeats if r["variant"] == "dpfl_tf" and r["above_claim"]]
    missed = [
        {
            "variant": r["variant"],
            "epsilon": r["epsilon"],
            "unit": r["unit"],
            "method": r["method"],
            "epsilon_lower_bound": r["epsilon_lower_bound"],
        }
        for r in runs
        if r["variant"] != "dpfl_tf" and not r["caught"]
    ]
    out = args.output or os.path.join(
        RESULTS, "audit_canary_quick.json" if args.quick else "audit_canary.json"
    )
    result = {
        "experiment": "canary audit: one run (Steinke, Nasr, Jagielski 2023; f-DP "
        "refinement of Mahloujifar, Melis, Chaudhuri 2024) and multi-run",
        "command": "python experiments/audit_canary.py" + (" --quick" if args.quick else ""),
        "quick": args.quick,
        "dataset": "MNIST",
        "model": "softmax regression on 784 + m features",
        "steps": STEPS,
        "delta": DELTA,
        "confidence": CONFIDENCE,
        "canary_value": VALUE,
        "canaries_per_run": m,
        "runs_pooled": pool,
        "runs": runs + mia,
        "ideal_gaussian": ideal,
        "repeats": repeats,
        "violations": violations,
        "broken_not_caught": missed,
        "seconds": round(time.perf_counter() - started, 1),
        "note": "seeded noise and sampling: reproducible, NOT for deployment",
    }
    atomic_write_json(out, result)
    plot(runs + mia + ideal, out[:-5] + ".png")
    print(
        f"wrote {out} in {result['seconds']} s; violations: {len(violations)}; broken-copy "
        f"rows not caught: {missed}"
    )
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())

"""Membership inference: an empirical lower bound on what a trained model leaks.

Setting.  A model was trained on the *members*; the *non-members* come from
the same distribution and were not used.  An attacker sees the model's output
on an example (x, y) and guesses "member" when a score passes a threshold.
Over all thresholds this is a ROC curve; we report

* AUC, the best attacker advantage max_t (TPR - FPR) (Yeom et al. 2018), and
  TPR at low FPR (0.1 %, 1 %), where attacks matter (Carlini et al. 2022,
  "Membership inference attacks from first principles");
* the epsilon that the observed (TPR, FPR) pairs force.  For an
  (eps, delta)-DP mechanism, *every* test between neighbouring datasets obeys
  (Kairouz, Oh, Viswanath 2015, the hypothesis-testing view of DP)

      TPR <= e^eps FPR + delta      and      1 - FPR <= e^eps (1 - TPR) + delta,

  so a test achieving (TPR, FPR) proves

      eps >= max( log((TPR - delta) / FPR), log((1 - FPR - delta) / (1 - TPR)) ).

  `epsilon_lower_bound` evaluates this (guards below).  The unit of privacy is
  one example, the neighbouring relation add/remove one example: the guarantee
  DP-SGD with Poisson lots gives.

Attacks (`AttackKind`):

* ``loss_threshold`` (Yeom et al. 2018): score = -loss(f(x), y); members have
  lower loss.  Needs no training.
* ``logistic_regression`` and ``mlp`` (scikit-learn): a classifier on
  per-example features -- loss, confidence p_y, prediction entropy, and the
  logarithms of loss and entropy (small values are where members and
  non-members differ), standardised.

Split of the attack data: members and non-members are each split at random
into an attack-*training* part (``train_fraction``, default half) and a
held-out *evaluation* part.  Learned attacks are fitted on the training part
(balanced by subsampling the larger group); **every reported number is
measured on the evaluation part**, for every attack, so the attacks are
compared on the same examples and no attack is scored on data it was fitted on.

Two epsilon lower bounds are reported (both floored at 0, since eps >= 0):

* ``epsilon_lower_bound`` (plug-in): the formula at the observed rates of
  every threshold of the held-out ROC curve, maximised over thresholds.  A
  *point estimate*, not a statistically valid bound: at small FPR the observed
  rate is noisy and the maximum over thresholds is biased upwards.  Where an
  observed denominator is 0 (FPR = 0, or TPR = 1) that ratio is skipped: a zero
  count only says the rate is small, and dividing by it says nothing.
* ``epsilon_lower_bound_ci`` (Clopper-Pearson): the threshold is chosen on the
  attack-*training* part (the one maximising the same bound there); on the
  held-out part a one-sided Clopper-Pearson lower bound TPR_lo and upper bound
  FPR_hi, each at level (1 - confidence) / 2 so that both hold together with
  probability >= ``confidence`` (union bound), are put into the formula
  (Jagielski, Ullman, Oprea 2020; Nasr et al. 2021).  Treating the held-out
  examples as independent trials is exact when each trial is its own training
  run; for many examples of *one* run it is the usual approximation (Steinke,
  Nasr, Jagielski 2023 justify one-run audits when examples are included
  independently at random).  This is the number to compare with the
  accountant's epsilon: if it exceeds it, something is wrong.

An attack only gives a *lower* bound: a weak attack on a leaky model finds
little.  A lower bound far below the accountant's epsilon is expected for
DP-SGD audited with natural (non-adversarial) examples.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from dpfl_tf._validation import ChoiceEnum, check_count, check_number

__all__ = [
    "AttackFeatures",
    "AttackKind",
    "AttackResult",
    "attack_features",
    "clopper_pearson",
    "epsilon_lower_bound",
    "epsilon_lower_bound_from_counts",
    "evaluate_scores",
    "features_from_outputs",
    "run_attacks_on_features",
    "run_membership_attacks",
    "split_attack_data",
]

DEFAULT_FPR_TARGETS = (1e-3, 1e-2)
_LOG_FLOOR = 1e-30


class AttackKind(ChoiceEnum):
    __argument__ = "attack"
    LOSS_THRESHOLD = "loss_threshold"
    LOGISTIC_REGRESSION = "logistic_regression"
    MLP = "mlp"


# -- per-example features --------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class AttackFeatures:
    """Per-example loss -log p_y, confidence p_y and entropy -sum_k p_k log p_k
    (natural logarithms) of a classifier's predictive distribution."""

    loss: np.ndarray
    confidence: np.ndarray
    entropy: np.ndarray

    def __len__(self) -> int:
        return len(self.loss)

    def subset(self, index) -> "AttackFeatures":
        return AttackFeatures(self.loss[index], self.confidence[index], self.entropy[index])

    def matrix(self) -> np.ndarray:
        """(n, 5): loss, confidence, entropy, log loss, log entropy."""
        return np.stack(
            [
                self.loss,
                self.confidence,
                self.entropy,
                np.log(np.maximum(self.loss, _LOG_FLOOR)),
                np.log(np.maximum(self.entropy, _LOG_FLOOR)),
            ],
            axis=1,
        )


def _labels(y, n_outputs: int | None = None) -> np.ndarray:
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise ValueError(f"y must be 1-D integer class indices, got shape {y.shape}")
    if y.dtype.kind not in "iub":
        if y.dtype.kind == "f" and len(y) and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
            y = y.astype(np.int64)
        else:
            raise ValueError(f"y must hold integer class indices, got dtype {y.dtype}")
    if len(y) == 0:
        raise ValueError("no examples: y is empty")
    if n_outputs is not None and (int(y.min()) < 0 or int(y.max()) >= n_outputs):
        raise ValueError(
            f"labels must lie in [0, {n_outputs}) (the model has {n_outputs} "
            f"outputs), got [{int(y.min())}, {int(y.max())}]"
        )
    return y.astype(np.int64)


def features_from_outputs(outputs, y, *, from_logits: bool = True) -> AttackFeatures:
    """`AttackFeatures` from model outputs (n, k) -- logits or probabilities --
    and integer labels (n,).  Computed in float64 with a log-softmax, so a
    confident model gives loss 1e-12, not 0 or NaN."""
    out = np.asarray(outputs, dtype=np.float64)
    if out.ndim != 2 or out.shape[1] < 2:
        raise ValueError(f"model outputs must be (n, num_classes >= 2), got shape {out.shape}")
    y = _labels(y, out.shape[1])
    if len(y) != len(out):
        raise ValueError(f"{len(out)} outputs but {len(y)} labels")
    if not np.all(np.isfinite(out)):
        raise ValueError("model outputs contain NaN or inf")
    if from_logits:
        from scipy.special import log_softmax

        logp = log_softmax(out, axis=1)
    else:
        if out.min() < 0 or out.max() > 1 or not np.allclose(out.sum(1), 1.0, atol=1e-3):
            raise ValueError(
                "from_logits=False needs probabilities (rows in [0, 1] summing "
                "to 1); pass from_logits=True for logits"
            )
        logp = np.log(np.maximum(out, _LOG_FLOOR))
    p = np.exp(logp)
    loss = -logp[np.arange(len(y)), y]
    return AttackFeatures(
        loss=loss, confidence=np.exp(-loss), entropy=np.maximum(-(p * logp).sum(axis=1), 0.0)
    )


def attack_features(
    model, x, y, *, from_logits: bool = True, batch_size: int = 1024
) -> AttackFeatures:
    """Runs `model` (any Keras model, e.g. a `DPModel`) on (x, y) and returns
    the per-example features.  `x` must already be what the model takes
    (e.g. projected by the same DP-PCA)."""
    y = _labels(y)
    n = len(y)
    for leaf in x.values() if isinstance(x, Mapping) else [x]:
        if np.shape(leaf)[:1] != (n,):
            raise ValueError(
                f"x and y disagree on the number of examples: x has shape "
                f"{np.shape(leaf)}, y has {n} labels"
            )
    batch_size = check_count("batch_size", batch_size, minimum=1)
    outputs = model.predict(x, batch_size=batch_size, verbose=0)
    return features_from_outputs(outputs, y, from_logits=from_logits)


# -- the epsilon bound ------------------------------------------------------------------
def epsilon_lower_bound(tpr, fpr, delta: float) -> float:
    """max over the given (TPR, FPR) pairs of
    max(log((TPR - delta) / FPR), log((1 - FPR - delta) / (1 - TPR))), and 0.

    Guards: a ratio whose numerator is <= 0 gives no evidence and is skipped; a
    ratio whose denominator is 0 (FPR = 0 or TPR = 1) is skipped too (see the
    module docstring: with observed rates a zero count proves nothing; with
    Clopper-Pearson bounds the denominators are never 0).  Arrays broadcast.

    Worked example: TPR = 0.5, FPR = 0.1, delta = 0:
    max(log(0.5 / 0.1), log(0.9 / 0.5)) = log 5 = 1.609.
    """
    delta = check_number("delta", delta, low=0.0, high=1.0, high_open=True)
    tpr = np.atleast_1d(np.asarray(tpr, dtype=np.float64))
    fpr = np.atleast_1d(np.asarray(fpr, dtype=np.float64))
    tpr, fpr = np.broadcast_arrays(tpr, fpr)
    if np.any((tpr < 0) | (tpr > 1) | (fpr < 0) | (fpr > 1)) or not (
        np.all(np.isfinite(tpr)) and np.all(np.isfinite(fpr))
    ):
        raise ValueError("tpr and fpr must be rates in [0, 1]")
    best = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        for num, den in ((tpr - delta, fpr), (1.0 - fpr - delta, 1.0 - tpr)):
            ok = (num > 0) & (den > 0)
            if np.any(ok):
                best = max(best, float(np.max(np.log(num[ok] / den[ok]))))
    return best


def clopper_pearson(successes, trials, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """One-sided Clopper-Pearson bounds at level alpha each: (lower, upper) with
    P(rate >= lower) >= 1 - alpha and P(rate <= upper) >= 1 - alpha.
    lower = Beta(alpha; k, n - k + 1) (0 if k = 0), upper = Beta(1 - alpha; k + 1,
    n - k) (1 if k = n)."""
    from scipy.stats import beta

    alpha = check_number("alpha", alpha, low=0.0, high=1.0, low_open=True, high_open=True)
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    if np.any(n < 1) or np.any(k < 0) or np.any(k > n):
        raise ValueError("need 0 <= successes <= trials and trials >= 1")
    with np.errstate(invalid="ignore"):
        lower = np.where(k > 0, beta.ppf(alpha, np.maximum(k, 1), n - k + 1), 0.0)
        upper = np.where(k < n, beta.ppf(1 - alpha, k + 1, np.maximum(n - k, 1)), 1.0)
    return lower, upper


def epsilon_lower_bound_from_counts(
    tp, fn, fp, tn, delta: float, confidence: float = 0.95
) -> float:
    """The epsilon lower bound that holds with probability >= `confidence`:
    `epsilon_lower_bound` at (TPR_lo, FPR_hi), each one-sided Clopper-Pearson
    at level (1 - confidence) / 2 (union bound).  Counts broadcast (the
    maximum over them is returned, which is valid only for one pre-chosen
    threshold -- see the module docstring)."""
    confidence = check_number(
        "confidence", confidence, low=0.0, high=1.0, low_open=True, high_open=True
    )
    tp, fn, fp, tn = (np.asarray(c, dtype=np.float64) for c in (tp, fn, fp, tn))
    if np.any(tp + fn < 1) or np.any(fp + tn < 1):
        raise ValueError("need at least one member (tp + fn) and one non-member (fp + tn)")
    alpha = (1.0 - confidence) / 2.0
    tpr_lo, _ = clopper_pearson(tp, tp + fn, alpha)
    _, fpr_hi = clopper_pearson(fp, fp + tn, alpha)
    return epsilon_lower_bound(tpr_lo, fpr_hi, delta)


# -- one attack's scores -> its report ----------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class AttackResult:
    """What one attack achieved on the held-out evaluation examples.

    ``tpr_at_fpr`` maps an FPR target to the largest TPR at FPR <= target (with
    n non-members FPR moves in steps of 1/n; see ``fpr_resolution``).
    ``counts`` are tp, fn, fp, tn at ``threshold`` (score >= threshold means
    "member"), the threshold fixed on the attack-training part.
    """

    attack: str
    auc: float
    advantage: float
    tpr_at_fpr: dict
    epsilon_lower_bound: float
    epsilon_lower_bound_ci: float
    confidence: float
    delta: float
    threshold: float
    counts: dict
    num_members: int
    num_nonmembers: int
    fpr: np.ndarray = dataclasses.field(repr=False)
    tpr: np.ndarray = dataclasses.field(repr=False)

    @property
    def fpr_resolution(self) -> float:
        return 1.0 / self.num_nonmembers

    def to_dict(self, roc_points: int = 0) -> dict[str, Any]:
        """JSON-ready; with `roc_points` > 0 also the ROC curve, thinned to about
        that many points (evenly in log FPR, always keeping the end points)."""
        out = {
            "attack": self.attack,
            "auc": self.auc,
            "advantage": self.advantage,
            "tpr_at_fpr": {f"{k:g}": v for k, v in self.tpr_at_fpr.items()},
            "epsilon_lower_bound": self.epsilon_lower_bound,
            "epsilon_lower_bound_ci": self.epsilon_lower_bound_ci,
            "confidence": self.confidence,
            "delta": self.delta,
            "threshold": self.threshold,
            "counts": dict(self.counts),
            "num_members": self.num_members,
            "num_nonmembers": self.num_nonmembers,
            "fpr_resolution": self.fpr_resolution,
        }
        if roc_points > 0:
            keep = _thin(self.fpr, roc_points)
            out["roc"] = {"fpr": self.fpr[keep].tolist(), "tpr": self.tpr[keep].tolist()}
        return out


def _thin(fpr: np.ndarray, points: int) -> np.ndarray:
    if len(fpr) <= points:
        return np.arange(len(fpr))
    grid = np.geomspace(max(fpr[fpr > 0].min(), 1e-6), 1.0, points)
    idx = np.unique(
        np.concatenate([[0, len(fpr) - 1], np.searchsorted(fpr, grid, side="right") - 1])
    )
    return idx[idx >= 0]


def _roc(member_scores, nonmember_scores):
    from sklearn.metrics import roc_curve

    labels = np.r_[np.ones(len(member_scores)), np.zeros(len(nonmember_scores))]
    fpr, tpr, thresholds = roc_curve(
        labels, np.r_[member_scores, nonmember_scores], drop_intermediate=False
    )
    return fpr, tpr, thresholds


def evaluate_scores(
    name: str,
    train_scores: tuple[np.ndarray, np.ndarray],
    eval_scores: tuple[np.ndarray, np.ndarray],
    *,
    delta: float,
    confidence: float = 0.95,
    fpr_targets: Sequence[float] = DEFAULT_FPR_TARGETS,
) -> AttackResult:
    """An `AttackResult` from membership scores (higher = "member").

    Args:
      train_scores: (member scores, non-member scores) on the attack-training
        part: used only to fix the threshold of the Clopper-Pearson bound.
      eval_scores: the same on the held-out part: every reported number.
    """
    from sklearn.metrics import roc_auc_score

    delta = check_number("delta", delta, low=0.0, high=1.0, high_open=True)
    (tm, tn_), (em, en) = (
        [np.asarray(s, dtype=np.float64) for s in pair] for pair in (train_scores, eval_scores)
    )
    for label, arr in (
        ("training members", tm),
        ("training non-members", tn_),
        ("evaluation members", em),
        ("evaluation non-members", en),
    ):
        if len(arr) == 0:
            raise ValueError(f"no {label}: every part of the split needs examples")
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"the scores of the {label} contain NaN or inf")
    # threshold fixed on the training part: the one with the best CP bound there
    fpr_t, tpr_t, thr_t = _roc(tm, tn_)
    tp_t, fp_t = np.round(tpr_t * len(tm)), np.round(fpr_t * len(tn_))
    alpha = (1.0 - confidence) / 2.0
    tpr_lo, _ = clopper_pearson(tp_t, len(tm), alpha)
    _, fpr_hi = clopper_pearson(fp_t, len(tn_), alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        per_threshold = np.maximum(
            np.log(np.maximum(tpr_lo - delta, 0) / fpr_hi),
            np.log(np.maximum(1 - fpr_hi - delta, 0) / (1 - tpr_lo)),
        )
    threshold = (
        float(thr_t[int(np.nanargmax(np.where(np.isfinite(thr_t), per_threshold, -np.inf)))])
        if np.any(np.isfinite(thr_t))
        else math.inf
    )
    tp = int(np.sum(em >= threshold))
    fp = int(np.sum(en >= threshold))
    counts = {"tp": tp, "fn": len(em) - tp, "fp": fp, "tn": len(en) - fp}
    eps_ci = epsilon_lower_bound_from_counts(
        counts["tp"], counts["fn"], counts["fp"], counts["tn"], delta, confidence
    )
    fpr, tpr, _ = _roc(em, en)
    labels = np.r_[np.ones(len(em)), np.zeros(len(en))]
    tpr_at = {float(t): float(tpr[fpr <= t].max()) for t in fpr_targets}
    return AttackResult(
        attack=name,
        auc=float(roc_auc_score(labels, np.r_[em, en])),
        advantage=float(np.max(tpr - fpr)),
        tpr_at_fpr=tpr_at,
        epsilon_lower_bound=epsilon_lower_bound(tpr, fpr, delta),
        epsilon_lower_bound_ci=eps_ci,
        confidence=float(confidence),
        delta=delta,
        threshold=threshold,
        counts=counts,
        num_members=len(em),
        num_nonmembers=len(en),
        fpr=fpr,
        tpr=tpr,
    )


# -- split and attacks ------------------------------------------------------------------------
def split_attack_data(
    num_members: int, num_nonmembers: int, *, train_fraction: float = 0.5, seed: int | None = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Boolean masks (members_in_training_part, nonmembers_in_training_part):
    each group is split at random, `train_fraction` of it for attack training."""
    train_fraction = check_number(
        "train_fraction", train_fraction, low=0.0, high=1.0, low_open=True, high_open=True
    )
    rng = np.random.default_rng(seed)
    masks = []
    for label, n in (("members", num_members), ("non-members", num_nonmembers)):
        n = check_count(f"number of {label}", n)
        k = int(round(train_fraction * n))
        if k < 1 or n - k < 1:
            raise ValueError(
                f"need at least one of the {label} in each part of the attack "
                f"split (train_fraction={train_fraction:g}), got {n} {label}"
            )
        mask = np.zeros(n, bool)
        mask[rng.permutation(n)[:k]] = True
        masks.append(mask)
    return masks[0], masks[1]


def _classifier(kind: AttackKind, seed):
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if kind is AttackKind.LOGISTIC_REGRESSION:
        clf = LogisticRegression(max_iter=2000)
    else:
        clf = MLPClassifier(
            hidden_layer_sizes=(32, 16), alpha=1e-3, max_iter=500, random_state=seed
        )
    return make_pipeline(StandardScaler(), clf)


def run_attacks_on_features(
    members: AttackFeatures,
    nonmembers: AttackFeatures,
    *,
    delta: float = 1e-5,
    attacks: Sequence[AttackKind | str] = tuple(AttackKind),
    train_fraction: float = 0.5,
    seed: int | None = 0,
    confidence: float = 0.95,
    fpr_targets: Sequence[float] = DEFAULT_FPR_TARGETS,
) -> dict[str, AttackResult]:
    """Runs the attacks on precomputed features; {attack name: AttackResult}."""
    import warnings

    from sklearn.exceptions import ConvergenceWarning

    if not isinstance(members, AttackFeatures) or not isinstance(nonmembers, AttackFeatures):
        raise TypeError("members and nonmembers must be AttackFeatures (see attack_features)")
    kinds = [AttackKind.parse(a) for a in attacks]
    if not kinds:
        raise ValueError("attacks must name at least one attack")
    m_train, n_train = split_attack_data(
        len(members), len(nonmembers), train_fraction=train_fraction, seed=seed
    )
    parts = {
        "train": (members.subset(m_train), nonmembers.subset(n_train)),
        "eval": (members.subset(~m_train), nonmembers.subset(~n_train)),
    }
    rng = np.random.default_rng(seed)
    results = {}
    for kind in kinds:
        if kind is AttackKind.LOSS_THRESHOLD:
            scores = {p: (-a.loss, -b.loss) for p, (a, b) in parts.items()}
        else:
            a, b = parts["train"]
            k = min(len(a), len(b))  # balanced training set
            xa = a.matrix()[rng.permutation(len(a))[:k]]
            xb = b.matrix()[rng.permutation(len(b))[:k]]
            clf = _classifier(kind, seed)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                clf.fit(np.r_[xa, xb], np.r_[np.ones(k), np.zeros(k)])
            scores = {
                p: tuple(clf.predict_proba(f.matrix())[:, 1] for f in pair)
                for p, pair in parts.items()
            }
        results[kind.value] = evaluate_scores(
            kind.value,
            scores["train"],
            scores["eval"],
            delta=delta,
            confidence=confidence,
            fpr_targets=fpr_targets,
        )
    return results


def run_membership_attacks(
    model,
    members: tuple,
    nonmembers: tuple,
    *,
    delta: float = 1e-5,
    from_logits: bool = True,
    attacks: Sequence[AttackKind | str] = tuple(AttackKind),
    train_fraction: float = 0.5,
    seed: int | None = 0,
    confidence: float = 0.95,
    fpr_targets: Sequence[float] = DEFAULT_FPR_TARGETS,
    batch_size: int = 1024,
) -> dict[str, AttackResult]:
    """Membership inference on a trained Keras model.

    Args:
      model: the trained model (a `DPModel` or any Keras classifier).
      members: (x, y) of training examples; nonmembers: (x, y) of examples from
        the same distribution that were not trained on.
      delta: the delta of the epsilon lower bound (the accountant's delta).
      from_logits: the model outputs logits (the dpfl_tf models do).
      seed: the attack split and the MLP initialisation (the attack is not a
        DP mechanism: reproducible is right here).

    Returns:
      {attack name: `AttackResult`}, every number on the held-out half.
    """
    for name, pair in (("members", members), ("nonmembers", nonmembers)):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(f"{name} must be an (x, y) pair")
    feats = [
        attack_features(model, x, y, from_logits=from_logits, batch_size=batch_size)
        for x, y in (members, nonmembers)
    ]
    return run_attacks_on_features(
        feats[0],
        feats[1],
        delta=delta,
        attacks=attacks,
        train_fraction=train_fraction,
        seed=seed,
        confidence=confidence,
        fpr_targets=fpr_targets,
    )

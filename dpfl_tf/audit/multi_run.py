"""The multi-run canary audit: R independent training runs, one canary each.

Setting (the classical audit of Jagielski, Ullman, Oprea 2020 and Nasr et al.
2021/2023, "Tight auditing of differentially private machine learning").  Run
the training R times; in each run one canary is included by a fair coin, and
the auditor computes one score per run from what the run released.  The runs
are independent, so the scores of the "in" runs are i.i.d. draws from the
mechanism's output on D + canary and the "out" scores i.i.d. draws on D: at a
threshold t the false positive rate FPR = P[score >= t | out] and the false
negative rate FNR = P[score < t | in] have exact Clopper-Pearson upper bounds
FPR_ub, FNR_ub, each at level alpha / 2 (together at level alpha).

Bounds (the unit of privacy is the canary's add/remove, as in DP-SGD):

* ``method="eps_dp"``: an (eps, delta)-DP mechanism has, for every test,
  1 - FNR <= e^eps FPR + delta and 1 - FPR <= e^eps FNR + delta, so

      eps_lb = max(log((1 - FNR_ub - delta) / FPR_ub), log((1 - FPR_ub - delta) / FNR_ub)),

  valid for every mechanism (Kairouz et al. 2015's hypothesis-testing view;
  `dpfl_tf.audit.membership.epsilon_lower_bound`, whose Clopper-Pearson
  bounds are reused here).
* ``method="gdp"``: a mu-GDP mechanism has FNR >= Phi(Phi^{-1}(1 - FPR) - mu)
  (Dong, Roth, Su 2019), so mu >= Phi^{-1}(1 - FPR) - Phi^{-1}(FNR); with the
  upper bounds this is mu_lb = Phi^{-1}(1 - FPR_ub) - Phi^{-1}(FNR_ub), reported
  as eps_lb = `gdp_epsilon(mu_lb, delta)`.  Valid for GDP claims only (full-batch
  DP-SGD, Global DP with every client every round): see `dpfl_tf.audit.one_run`.

The threshold must not be fitted to the scores that bound it.  Either pass
``threshold`` fixed before the runs (e.g. from the claimed noise scale, as
`experiments/audit_canary.py` does), or let a random ``split`` of the runs
choose it (the threshold with the best bound on the selection part) and bound
only on the rest.  Power: with R runs (R / 2 per side) the CP bounds cannot go below about
log(2 / alpha) / (R / 2), so at 95 % eps-DP bounds stay below about
log(R / (2 log 40)) -- 2.6 for R = 100 -- while the GDP bound reaches higher eps because the
Gaussian curve extrapolates from moderate error rates.  It needs many runs of a
small model; one run with many canaries (`dpfl_tf.audit.one_run`) is the cheap
alternative.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from scipy import special

from dpfl_tf._validation import check_number
from dpfl_tf.audit.membership import clopper_pearson, epsilon_lower_bound
from dpfl_tf.audit.one_run import METHODS, gdp_epsilon, refuse_gdp_on_sampling

__all__ = ["MultiRunResult", "multi_run_epsilon_lower_bound"]


@dataclasses.dataclass(frozen=True)
class MultiRunResult:
    """``epsilon_lower_bound`` holds with probability >= ``confidence``;
    ``fpr_upper`` / ``fnr_upper`` are the Clopper-Pearson bounds at
    ``threshold`` from ``runs_in`` / ``runs_out`` runs (those not used to choose
    the threshold)."""

    epsilon_lower_bound: float
    confidence: float
    delta: float
    method: str
    threshold: float
    runs_in: int
    runs_out: int
    false_positives: int
    false_negatives: int
    fpr_upper: float
    fnr_upper: float
    mu_lower_bound: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _bound(fp, n_out, fn, n_in, alpha, delta, method):
    # Clopper-Pearson at alpha / 2 each (union bound): membership.clopper_pearson
    _, fpr = clopper_pearson(fp, n_out, alpha / 2)
    _, fnr = clopper_pearson(fn, n_in, alpha / 2)
    fpr, fnr = float(fpr), float(fnr)
    if method == "gdp":
        mu = (
            max(0.0, float(special.ndtri(1.0 - fpr) - special.ndtri(fnr)))
            if fpr < 1 and fnr < 1
            else 0.0
        )
        return gdp_epsilon(mu, delta), fpr, fnr, mu
    return epsilon_lower_bound(1.0 - fnr, fpr, delta), fpr, fnr, None


def _counts(in_scores, out_scores, t):
    return int(np.sum(out_scores >= t)), int(np.sum(in_scores < t))


def multi_run_epsilon_lower_bound(
    in_scores: Sequence[float],
    out_scores: Sequence[float],
    *,
    delta: float,
    confidence: float = 0.95,
    method: str = "eps_dp",
    threshold: float | None = None,
    split: float = 0.5,
    seed: int | None = 0,
    mechanism=None,
) -> MultiRunResult:
    """The epsilon lower bound from the scores of runs with the canary
    (`in_scores`) and without it (`out_scores`); higher score = "in".

    Args:
      delta: the claim's delta.
      method: "eps_dp" (any mechanism) or "gdp" (Gaussian mechanisms; module docstring).
      mechanism: with "gdp", what one run released (its DpEvent or PrivacyLedger,
        or the DPModel / FederatedServer): a sampled mechanism is refused
        (`refuse_gdp_on_sampling`), and gdp without it too.
      threshold: fixed before the runs; if None, a random `split` fraction of
        each side's runs (seeded by `seed`) chooses it and the rest bound it.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    refuse_gdp_on_sampling(method, mechanism)
    ins = np.asarray(in_scores, np.float64).ravel()
    outs = np.asarray(out_scores, np.float64).ravel()
    if len(ins) < 1 or len(outs) < 1:
        raise ValueError(
            f"need at least one run on each side, got {len(ins)} with the "
            f"canary and {len(outs)} without"
        )
    if not (np.all(np.isfinite(ins)) and np.all(np.isfinite(outs))):
        raise ValueError("scores contain NaN or inf")
    conf = check_number("confidence", confidence, low=0.0, high=1.0, low_open=True, high_open=True)
    delta = check_number("delta", delta, low=0.0, high=1.0, high_open=True)
    if method == "gdp" and delta == 0:
        raise ValueError("method 'gdp' converts mu to epsilon at delta: delta must be > 0, got 0")
    alpha = 1.0 - conf
    if threshold is None:
        split = check_number("split", split, low=0.0, high=1.0, low_open=True, high_open=True)
        rng = np.random.default_rng(seed)
        pi, po = rng.permutation(len(ins)), rng.permutation(len(outs))
        ki, ko = int(round(split * len(ins))), int(round(split * len(outs)))
        if not (0 < ki < len(ins) and 0 < ko < len(outs)):
            raise ValueError(
                f"split {split} leaves no runs to choose or to bound with "
                f"({len(ins)} in, {len(outs)} out): pass a fixed threshold"
            )
        sel_in, sel_out = ins[pi[:ki]], outs[po[:ko]]
        ins, outs = ins[pi[ki:]], outs[po[ko:]]
        best = None
        for t in np.unique(np.concatenate([sel_in, sel_out])):
            fp, fn = _counts(sel_in, sel_out, t)
            eps = _bound(fp, len(sel_out), fn, len(sel_in), alpha, delta, method)[0]
            if best is None or eps > best[0]:
                best = (eps, float(t))
        threshold = best[1]
    else:
        threshold = check_number("threshold", threshold)
    fp, fn = _counts(ins, outs, threshold)
    eps, fpr, fnr, mu = _bound(fp, len(outs), fn, len(ins), alpha, delta, method)
    return MultiRunResult(
        epsilon_lower_bound=float(eps),
        confidence=conf,
        delta=float(delta),
        method=method,
        threshold=float(threshold),
        runs_in=len(ins),
        runs_out=len(outs),
        false_positives=fp,
        false_negatives=fn,
        fpr_upper=fpr,
        fnr_upper=fnr,
        mu_lower_bound=mu,
    )

"""The random number of trials of a private hyperparameter search.

Papernot & Steinke 2022 ("Hyperparameter tuning with Renyi differential
privacy", ICLR 2022) run a mechanism Q -- one trial: hyperparameters drawn at
random, independently of the data, then DP training and a DP score -- K times,
K drawn from a distribution independent of the data and *not released*, and
release only the best run.  If one run is (lambda, eps(lambda))-RDP for every
order lambda, the search is RDP with a cost that grows like log E[K] instead
of E[K]:

* truncated negative binomial, shape eta in (0, inf) (eta = 1 geometric,
  eta -> 0 logarithmic) and gamma in (0, 1), their eq. (3):
      P[K = k] = (1 - gamma)^k / (gamma^-eta - 1) * prod_{l=0}^{k-1} (l + eta) / (l + 1),
      P[K = k] = (1 - gamma)^k / (k log(1 / gamma))                 (eta = 0),
  for k >= 1, with mean  eta (1 - gamma) / (gamma (1 - gamma^eta))
  ((1 - gamma) / (gamma log(1 / gamma)) for eta = 0)  -- Theorem 2;
* Poisson(mu), k >= 0 (K = 0 releases nothing) -- Theorem 6.

`TrialCount` is that distribution, given by its mean and shape (dp_accounting's
parameters of `RepeatAndSelectDpEvent`; shape = inf is Poisson).  The number
of trials drawn must stay secret: releasing K with the best run would cost
the fixed-K price the theorems avoid (the wall time of the search reveals it
too, see docs/howto/private-tuning.md).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from dp_accounting import dp_event as _dp_event
from scipy import optimize, special

from dpfl_tf._validation import check_number

__all__ = ["TrialCount", "search_event"]


@dataclasses.dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials K (module docstring).

    Attributes:
      mean: E[K] (> 1 for the truncated negative binomial: K >= 1 always, and
        mean 1 is K = 1, a single run; >= 1 for Poisson).
      shape: eta: 0 logarithmic, 1 geometric, (0, inf) truncated negative
        binomial, ``math.inf`` Poisson.
    """

    mean: float
    shape: float = 1.0

    def __post_init__(self):
        shape = check_number("shape", self.shape, low=0.0, allow_inf=True)
        poisson = math.isinf(shape)
        mean = check_number("mean", self.mean, low=1.0, low_open=not poisson)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "mean", mean)

    @classmethod
    def poisson(cls, mean: float) -> "TrialCount":
        return cls(mean, math.inf)

    @classmethod
    def geometric(cls, mean: float) -> "TrialCount":
        return cls(mean, 1.0)

    @classmethod
    def logarithmic(cls, mean: float) -> "TrialCount":
        return cls(mean, 0.0)

    @property
    def is_poisson(self) -> bool:
        return math.isinf(self.shape)

    @property
    def gamma(self) -> float:
        """gamma of the truncated negative binomial with this mean and shape
        (the root of mean(gamma) = mean, which decreases from inf to 1 on (0, 1))."""
        if self.is_poisson:
            raise ValueError(
                "gamma is a parameter of the truncated negative binomial; "
                "this is the Poisson distribution (shape=inf)"
            )
        eta = self.shape

        def mean_of(g):
            if eta == 0:
                return (1 - g) / (g * math.log(1 / g))
            return eta * (1 - g) / (g * -math.expm1(eta * math.log(g)))

        lo, hi = 1e-300, 1 - 1e-15
        if mean_of(hi) >= self.mean:  # mean indistinguishable from 1 in floats
            return hi
        return optimize.brentq(
            lambda g: mean_of(g) - self.mean,
            lo,
            hi,
            xtol=1e-300,
            rtol=4 * np.finfo(float).eps,
            maxiter=1000,
        )

    def pmf(self, k) -> np.ndarray:
        """P[K = k] for an array of counts k (0 outside the support)."""
        k = np.asarray(k, dtype=float)
        if self.is_poisson:
            with np.errstate(divide="ignore"):
                log_p = k * math.log(self.mean) - self.mean - special.gammaln(k + 1)
            return np.where(k >= 0, np.exp(log_p), 0.0)
        g, eta = self.gamma, self.shape
        kk = np.maximum(k, 1.0)
        if eta == 0:
            log_p = kk * math.log1p(-g) - np.log(kk) - math.log(math.log(1 / g))
        else:
            log_p = (
                kk * math.log1p(-g)
                + special.gammaln(kk + eta)
                - special.gammaln(eta)
                - special.gammaln(kk + 1)
                - math.log(math.expm1(-eta * math.log(g)))
            )
        return np.where(k >= 1, np.exp(log_p), 0.0)

    def sample(self, rng: np.random.Generator | None = None) -> int:
        """One draw of K (inverse CDF for the truncated negative binomial).
        `rng`: a numpy Generator (tests); default seeded from OS entropy."""
        rng = np.random.default_rng() if rng is None else rng
        if self.is_poisson:
            return int(rng.poisson(self.mean))
        u, total, start, chunk = rng.random(), 0.0, 1, 1024
        while True:
            ks = np.arange(start, start + chunk)
            cdf = total + np.cumsum(self.pmf(ks))
            hit = np.flatnonzero(cdf > u)
            if hit.size:
                return int(ks[hit[0]])
            if cdf[-1] == total:  # the tail underflows: u is within rounding of 1
                return int(ks[-1])
            total, start = cdf[-1], start + chunk

    def event(self, run_event: _dp_event.DpEvent) -> _dp_event.DpEvent:
        """`RepeatAndSelectDpEvent(run_event, mean, shape)`: the best of K runs."""
        return _dp_event.RepeatAndSelectDpEvent(run_event, self.mean, self.shape)

    def describe(self) -> str:
        if self.is_poisson:
            return f"Poisson(mean={self.mean:g})"
        name = {0.0: "logarithmic", 1.0: "geometric"}.get(self.shape)
        return (
            f"{name}(mean={self.mean:g})"
            if name
            else f"truncated negative binomial(mean={self.mean:g}, shape={self.shape:g})"
        )


def search_event(
    trials: "TrialCount | int",
    trial_event: _dp_event.DpEvent,
    score_event: _dp_event.DpEvent | None = None,
) -> _dp_event.DpEvent:
    """The event of a whole search, one run being `trial_event` (its training)
    followed by `score_event` (its score's release; None or no-op: nothing).

    `trials` a `TrialCount`: the best of a random number of runs,
    ``RepeatAndSelectDpEvent`` (Papernot & Steinke 2022).  An int k: k runs,
    all composed -- releasing every run bounds releasing the best (post-
    processing), the honest price of a search with a fixed number of trials.
    """
    parts = [trial_event]
    if score_event is not None and not isinstance(score_event, _dp_event.NoOpDpEvent):
        parts.append(score_event)
    run = parts[0] if len(parts) == 1 else _dp_event.ComposedDpEvent(parts)
    if isinstance(trials, TrialCount):
        return trials.event(run)
    if isinstance(trials, bool) or not isinstance(trials, (int, np.integer)) or trials < 1:
        raise ValueError(
            f"trials must be a TrialCount (a random number of trials) or a "
            f"whole number >= 1 (a fixed number), got {trials!r}"
        )
    return _dp_event.SelfComposedDpEvent(run, int(trials))

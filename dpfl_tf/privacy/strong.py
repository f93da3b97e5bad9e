"""Strong-composition baseline (the curve Abadi et al. 2016, Figure 2, compares
the moments accountant against).

Per step (one Gaussian release with noise multiplier sigma, sensitivity 1):

1. **Gaussian mechanism** at a per-step delta0: eps0 is the smallest eps with
   Phi(1/(2 sigma) - eps sigma) - e^eps Phi(-1/(2 sigma) - eps sigma) <= delta0
   (the exact, "analytic" Gaussian bound of Balle and Wang 2018; the textbook
   eps0 = sqrt(2 ln(1.25/delta0)) / sigma is only valid for eps0 < 1 and is
   never smaller).
2. **Amplification by Poisson sampling** with rate q: the step is
   (log(1 + q (e^eps0 - 1)), q delta0)-DP.
3. **Strong composition** (Dwork, Rothblum, Vadhan 2010, in the form of
   Dwork and Roth, Theorem 3.20, extended to heterogeneous steps): k steps that
   are (eps_i, delta_i)-DP compose to (eps, sum_i delta_i + delta') with

       eps = sqrt(2 ln(1/delta') sum_i eps_i^2) + sum_i eps_i (e^eps_i - 1).

   Basic composition (sum eps_i, sum delta_i) is also valid; we report the
   smaller of the two.

The delta budget is split as delta' = f * delta for the composition slack and
(1 - f) * delta spread evenly over the T steps (delta0 = (1 - f) delta / (T q)
per Gaussian); f is optimised over a grid of 99 values and refined.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
from scipy import optimize, special

from dpfl_tf._validation import check_number
from dpfl_tf.privacy._gaussian_accountant import SampledGaussianAccountant

__all__ = ["gaussian_epsilon", "StrongCompositionAccountant"]


def _gaussian_delta(eps: float, sigma: float) -> float:
    """Exact delta(eps) of the Gaussian mechanism with sensitivity 1 (log-space safe)."""
    a = 1.0 / (2.0 * sigma) - eps * sigma
    b = -1.0 / (2.0 * sigma) - eps * sigma
    return float(special.ndtr(a) - math.exp(eps + special.log_ndtr(b)))


def gaussian_epsilon(sigma: float, delta0: float) -> float:
    """Smallest eps such that the sensitivity-1 Gaussian with std sigma is (eps, delta0)-DP."""
    if sigma == 0:
        return math.inf
    if _gaussian_delta(0.0, sigma) <= delta0:
        return 0.0
    hi = 1.0
    while _gaussian_delta(hi, sigma) > delta0:
        hi *= 2.0
        if hi > 1e6:
            return math.inf
    return optimize.brentq(lambda e: _gaussian_delta(e, sigma) - delta0, 0.0, hi, xtol=1e-12)


class StrongCompositionAccountant(SampledGaussianAccountant):
    """Strong composition of (amplified) Gaussian steps; see module docstring."""

    def __init__(
        self,
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        split_grid: int = 99,
    ):
        super().__init__(neighboring_relation)
        self._steps: dict[tuple[float, float], int] = {}  # (q, sigma) -> count
        self._grid = np.linspace(0.0, 1.0, split_grid + 2)[1:-1]

    def _compose_gaussian(self, q: float, sigma: float, count: int) -> None:
        self._steps[(q, sigma)] = self._steps.get((q, sigma), 0) + count

    def _epsilon_for_split(self, fraction: float, delta: float) -> float:
        total_q_steps = sum(q * n for (q, _), n in self._steps.items())
        delta_slack = fraction * delta
        delta0 = (1.0 - fraction) * delta / total_q_steps
        sum_eps, sum_sq, sum_lin = 0.0, 0.0, 0.0
        for (q, sigma), n in self._steps.items():
            eps0 = gaussian_epsilon(sigma, delta0)
            if math.isinf(eps0):
                return math.inf
            e = math.log1p(q * math.expm1(eps0))
            sum_eps += n * e
            sum_sq += n * e * e
            sum_lin += n * e * math.expm1(e)
        advanced = math.sqrt(2.0 * math.log(1.0 / delta_slack) * sum_sq) + sum_lin
        return min(advanced, sum_eps)

    def get_epsilon(self, target_delta: float) -> float:
        delta = check_number(
            "delta", target_delta, low=0.0, high=1.0, low_open=True, high_open=True
        )
        if self._non_private:
            return math.inf
        if not self._steps:
            return 0.0
        values = [self._epsilon_for_split(f, delta) for f in self._grid]
        i = int(np.argmin(values))
        if math.isinf(values[i]):
            return math.inf
        lo = self._grid[max(i - 1, 0)]
        hi = self._grid[min(i + 1, len(self._grid) - 1)]
        res = optimize.minimize_scalar(
            lambda f: self._epsilon_for_split(f, delta),
            bounds=(lo, hi),
            method="bounded",
            options={"xatol": 1e-6},
        )
        return float(min(values[i], res.fun))

    def get_delta(self, target_epsilon: float) -> float:
        eps = check_number("epsilon", target_epsilon, low=0.0)
        if self._non_private:
            return 1.0
        if not self._steps:
            return 0.0
        # get_epsilon is decreasing in delta: bisect on log(delta).
        if self.get_epsilon(1.0 - 1e-12) > eps:
            return 1.0
        lo, hi = -700.0, math.log(1.0 - 1e-12)
        if self.get_epsilon(math.exp(lo)) <= eps:
            return math.exp(lo)
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            if self.get_epsilon(math.exp(mid)) <= eps:
                hi = mid
            else:
                lo = mid
        return math.exp(hi)

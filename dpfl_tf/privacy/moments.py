"""The moments accountant of Abadi et al., "Deep Learning with Differential
Privacy" (CCS 2016), section 3.2, reimplemented.

For one step of the sampled Gaussian mechanism (each record is in the lot with
probability q, Gaussian noise of std sigma on a sum of sensitivity 1) the
privacy loss at an output z compares

    mu0 = N(0, sigma^2)   and   mu = (1 - q) N(0, sigma^2) + q N(1, sigma^2).

The log moment of order lambda is alpha(lambda) = log max(E1, E2) with

    E1 = E_{z ~ mu0} [(mu0(z) / mu(z))^lambda],
    E2 = E_{z ~ mu}  [(mu(z) / mu0(z))^lambda].

Both expectations are computed here by numerical integration (scipy `quad`).
For integer lambda, E2 also has an exact closed form (binomial expansion of
(mu/mu0)^(lambda+1) under mu0):

    E2 = sum_{k=0}^{lambda+1} C(lambda+1, k) (1-q)^(lambda+1-k) q^k
         exp((k^2 - k) / (2 sigma^2)),

used as a cross check (`method="closed_form"`).  Log moments compose by
addition (Theorem 2.1), so T identical steps cost T * alpha(lambda), and the
tail bound gives

    delta = min_lambda exp(alpha(lambda) - lambda * eps),
    eps   = min_lambda (alpha(lambda) + log(1/delta)) / lambda.

Orders lambda = 1..32 by default, as in the paper.  (In Renyi-DP terms,
alpha(lambda) = lambda * RDP(lambda + 1).)
"""

from __future__ import annotations

import functools
import math
from typing import Iterable, Sequence

import dp_accounting
import numpy as np
from scipy import integrate, special

from dpfl_tf._validation import check_number
from dpfl_tf.privacy._gaussian_accountant import SampledGaussianAccountant

__all__ = [
    "DEFAULT_ORDERS",
    "log_moments",
    "log_moments_closed_form",
    "epsilon_from_log_moments",
    "delta_from_log_moments",
    "MomentsAccountant",
]

DEFAULT_ORDERS: tuple[int, ...] = tuple(range(1, 33))


def log_moments_closed_form(q: float, sigma: float, orders: Sequence[int]) -> np.ndarray:
    """log E2 for integer orders, exact (binomial expansion); vectorised."""
    orders = np.asarray(orders)
    if not np.all(orders == np.round(orders)) or np.any(orders < 1):
        raise ValueError(f"closed form needs integer orders >= 1, got {orders.tolist()}")
    if sigma == 0:
        return np.full(orders.shape, math.inf)
    out = np.empty(orders.shape, dtype=np.float64)
    for i, lam in enumerate(orders.astype(int)):
        k = np.arange(lam + 2)
        if q == 1.0:
            out[i] = lam * (lam + 1) / (2 * sigma**2)
            continue
        log_terms = (
            special.gammaln(lam + 2)
            - special.gammaln(k + 1)
            - special.gammaln(lam + 2 - k)
            + (lam + 1 - k) * math.log1p(-q)
            + k * math.log(q)
            + (k * k - k) / (2 * sigma**2)
        )
        out[i] = special.logsumexp(log_terms)
    return out


def _log_mixture_ratio(z: np.ndarray, q: float, sigma: float) -> np.ndarray:
    """log(mu(z) / mu0(z)) = log(1 - q + q exp((2z - 1) / (2 sigma^2)))."""
    t = (2.0 * z - 1.0) / (2.0 * sigma**2)
    if q == 1.0:
        return t
    return np.logaddexp(math.log1p(-q), math.log(q) + t)


def _log_integral(log_f, lo: float, hi: float, points: Iterable[float]) -> float:
    """log of the integral of exp(log_f) over [lo, hi], computed stably."""
    grid = np.linspace(lo, hi, 4001)
    shift = float(np.max(log_f(grid)))
    pts = sorted(p for p in set(points) if lo < p < hi)
    value, _ = integrate.quad(
        lambda z: math.exp(float(log_f(np.asarray(z))) - shift),
        lo,
        hi,
        points=pts or None,
        limit=500,
        epsabs=0.0,
        epsrel=1e-10,
    )
    return shift + math.log(value)


@functools.lru_cache(maxsize=1024)
def _log_moment_integrated(q: float, sigma: float, lam: float) -> float:
    if sigma == 0:
        return math.inf
    log_norm = -0.5 * math.log(2 * math.pi * sigma**2)

    def log_mu0(z):
        return log_norm - z * z / (2 * sigma**2)

    def log_e1(z):  # mu0 * (mu0/mu)^lam
        return log_mu0(z) - lam * _log_mixture_ratio(z, q, sigma)

    def log_e2(z):  # mu * (mu/mu0)^lam = mu0 * (mu/mu0)^(lam+1)
        return log_mu0(z) + (lam + 1) * _log_mixture_ratio(z, q, sigma)

    # The integrands are Gaussian-like bumps centred within [-1, lam + 2];
    # 40 sigma either side leaves nothing measurable outside.
    lo, hi = -40.0 * sigma - 1.0, lam + 2.0 + 40.0 * sigma
    points = (0.0, 0.5, 1.0, lam + 1.0)
    e1 = _log_integral(log_e1, lo, hi, points)
    e2 = _log_integral(log_e2, lo, hi, points)
    return max(e1, e2)


def log_moments(
    q: float, sigma: float, orders: Sequence[float] = DEFAULT_ORDERS, method: str = "integration"
) -> np.ndarray:
    """alpha(lambda) of one sampled-Gaussian step for each order.

    Args:
      q: sampling probability in (0, 1].
      sigma: noise multiplier (>= 0; 0 gives inf).
      orders: the moment orders lambda.
      method: "integration" (numerical, E1 and E2) or "closed_form" (exact E2,
        integer orders).
    """
    q = check_number("sampling_rate", q, low=0.0, high=1.0, low_open=True)
    sigma = check_number("noise_multiplier", sigma, low=0.0)
    if method == "closed_form":
        return log_moments_closed_form(q, sigma, orders)
    if method != "integration":
        raise ValueError(f"method must be 'integration' or 'closed_form', got {method!r}")
    return np.array([_log_moment_integrated(q, sigma, float(lam)) for lam in orders])


def epsilon_from_log_moments(
    alphas: np.ndarray, orders: Sequence[float], delta: float
) -> tuple[float, float]:
    """(eps, best order) = min over lambda of (alpha + log(1/delta)) / lambda."""
    delta = check_number("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    orders = np.asarray(orders, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        eps = (np.asarray(alphas) + math.log(1.0 / delta)) / orders
    eps = np.where(np.isnan(eps), math.inf, eps)
    i = int(np.argmin(eps))
    return max(float(eps[i]), 0.0), float(orders[i])


def delta_from_log_moments(
    alphas: np.ndarray, orders: Sequence[float], epsilon: float
) -> tuple[float, float]:
    """(delta, best order) = min over lambda of exp(alpha - lambda eps), capped at 1."""
    epsilon = check_number("epsilon", epsilon, low=0.0)
    log_delta = np.asarray(alphas) - np.asarray(orders, dtype=np.float64) * epsilon
    log_delta = np.where(np.isnan(log_delta), math.inf, log_delta)
    i = int(np.argmin(log_delta))
    return min(1.0, math.exp(min(float(log_delta[i]), 0.0))), float(np.asarray(orders)[i])


class MomentsAccountant(SampledGaussianAccountant):
    """The paper's moments accountant as a `dp_accounting.PrivacyAccountant`.

    Interprets Gaussian, Poisson-sampled Gaussian, self-composed, composed,
    no-op and non-private events (add/remove-one relation).  Fixed-size
    sampling without replacement is outside the paper's analysis: use "rdp".
    """

    unsupported_message = (
        "the moments accountant handles (Poisson-sampled) Gaussian events; "
        "use the 'rdp' accountant for fixed-size sampling and other events"
    )

    def __init__(
        self,
        orders: Sequence[float] = DEFAULT_ORDERS,
        method: str = "integration",
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
    ):
        super().__init__(neighboring_relation)
        if len(orders) == 0 or any(o <= 0 for o in orders):
            raise ValueError(f"orders must be a non-empty list of positive numbers, got {orders!r}")
        self._orders = np.asarray(orders, dtype=np.float64)
        self._method = method
        self._alphas = np.zeros_like(self._orders)

    @property
    def orders(self) -> np.ndarray:
        return self._orders.copy()

    @property
    def log_moments(self) -> np.ndarray:
        """Total alpha(lambda) of everything composed so far."""
        return np.full_like(self._alphas, math.inf) if self._non_private else self._alphas.copy()

    def _compose_gaussian(self, q: float, sigma: float, count: int) -> None:
        self._alphas = self._alphas + count * log_moments(
            q, sigma, tuple(self._orders), self._method
        )

    def get_epsilon(self, target_delta: float) -> float:
        return self.get_epsilon_and_order(target_delta)[0]

    def get_epsilon_and_order(self, target_delta: float) -> tuple[float, float]:
        if self._non_private:
            return math.inf, math.nan
        return epsilon_from_log_moments(self._alphas, self._orders, target_delta)

    def get_delta(self, target_epsilon: float) -> float:
        if self._non_private:
            return 1.0
        return delta_from_log_moments(self._alphas, self._orders, target_epsilon)[0]

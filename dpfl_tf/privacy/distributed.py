"""Renyi DP of distributed DP: integer vectors, each with its own noise share, summed.

Setting (one federated round; the unit of privacy is one client).  Each
participating client turns its clipped update into an integer vector x_i of
dimension d (`dpfl_tf.federated.distributed_dp`: scale, rotate, conditional
randomized rounding) with ||x_i||_2 <= D, adds its own noise share and
uploads the result to a secure aggregation, which reveals only the sum

    S = sum_i (x_i + Y_i)        (modulo 2^b: a post-processing of S).

Replacing one client's data (the replace-one relation: the clients of a round
are m drawn without replacement from K, so their number does not depend on
the data) moves sum_i x_i by a vector Delta of integers with
||Delta||_2 <= 2D and ||Delta||_1 <= min(sqrt(d) ||Delta||_2, ||Delta||_2^2)
(for integers |a| <= a^2).  Only the sum is released: the server, and anyone
it shows the model to, learns S; no party sees another's x_i + Y_i.

Dropouts.  If clients drop out after they were sampled, fewer shares reach S.
Adding independent noise is a post-processing, so a sum holding more shares
is at least as private as one holding fewer: the events here state the
*fewest* shares the secure aggregation lets a round finish with
(``num_shares``), and that bound holds whatever happens above it.

The two mechanisms (the events live in `dpfl_tf.privacy.events`):

* Distributed discrete Gaussian (Kairouz, Liu, Steinke 2021, "The distributed
  discrete Gaussian mechanism for federated learning with secure
  aggregation", ICML).  Y_i ~ N_Z(0, s^2)^d.  A sum of n discrete Gaussians is
  *not* a discrete Gaussian; their Theorem 1 bounds it: for s >= 1/2,

      tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 s^2 k / (k + 1)),
      eps(a) = min{ a D2^2 / (2 n s^2) + tau d,
                    (a/2) (D2 / (sqrt(n) s) + tau sqrt(d))^2 },

  and their Proposition 14 (Eq. 17) adds a third term using the L1 bound,
  (a/2) (D2^2 / (n s^2) + 2 D1 tau / (sqrt(n) s) + tau^2 d).  eps(a) is the
  minimum of the three, for every real order a >= 1.

* Distributed Skellam (Agarwal, Kairouz, Liu 2021, "The Skellam mechanism for
  differentially private federated learning", NeurIPS).  Y_i ~ Sk(mu_i)^d;
  the sum of the shares is Sk(mu)^d with mu = sum_i mu_i (>= n x the share
  variance).  Their RDP bound for the multidimensional Skellam mechanism, for
  integer orders a > 1:

      eps(a) = a D2^2 / (2 mu) + min{ ((2a - 1) D2^2 + 6 D1) / (4 mu^2),
                                      3 D1 / (2 mu) }.

Sampling.  m of K clients without replacement, replace-one: the general
amplification bound of Wang, Balle, Kasiviswanathan 2019 ("Subsampled Renyi
differential privacy and analytical moments accountant", AISTATS, Theorem 9),
for integer a >= 2 and gamma = m/K, with eps(inf) = inf:

    eps'(a) <= 1/(a-1) log(1 + gamma^2 C(a,2) min{4 (e^eps(2) - 1), 2 e^eps(2)}
                            + sum_{j=3}^a 2 gamma^j C(a,j) e^{(j-1) eps(j)}),

and never more than the unsampled eps(a).  (dp-accounting's Gaussian
without-replacement bound is their Theorem 27, which is tighter but holds for
the Gaussian only.)  Non-integer orders interpolate the cumulant generating
function (a - 1) eps(a), which is convex in a, between the integers around
them (their Corollary 10); at a = 1 it is 0.

Rounding and wrap-around.  The L2 bound D after conditional randomized
rounding (`rounded_l2_norm_bound`) is part of the sensitivity above, so the
rounding error's effect on privacy is accounted.  The modular wrap-around at
b bits changes S only by a post-processing (it costs accuracy, never
privacy); its probability is computed by the mechanism
(`dpfl_tf.federated.distributed_dp`).
"""

from __future__ import annotations

import functools
import math

import dp_accounting
import numpy as np
from dp_accounting import dp_event as _dp_event
from scipy import special

from dpfl_tf._validation import check_count, check_number
from dpfl_tf.privacy.events import (
    DISTRIBUTED_EVENTS,
    DistributedDiscreteGaussianDpEvent,
    DistributedSkellamDpEvent,
)

__all__ = [
    "rounded_l2_norm_bound",
    "integer_l1_bound",
    "ddg_tau",
    "ddg_rdp",
    "skellam_rdp",
    "sampled_without_replacement_rdp",
    "rdp_curve",
    "is_distributed_event",
]


def rounded_l2_norm_bound(l2_norm: float, beta: float, dimension: int) -> float:
    """D: the L2 norm bound of a vector of norm <= `l2_norm` after conditional
    randomized rounding to the integers (Kairouz, Liu, Steinke 2021, Section 4.1).

    Randomized rounding moves each coordinate by less than 1, so ||x~|| <= c +
    sqrt(d) always.  With probability >= 1 - beta (their Proposition 22, Eq. 2),

        ||x~||_2^2 <= c^2 + d/4 + sqrt(2 log(1/beta)) (c + sqrt(d)/2),

    and *conditional* rounding redraws the rounding until the bound holds, so
    with beta in (0, 1) it holds always; D is the smaller of the two bounds
    (beta = 0: unconditional rounding, D = c + sqrt(d))."""
    c = check_number("l2_norm", l2_norm, low=0.0)
    beta = check_number("beta", beta, low=0.0, high=1.0, high_open=True)
    d = check_count("dimension", dimension, minimum=1)
    plain = c + math.sqrt(d)
    if beta == 0:
        return plain
    squared = c * c + d / 4.0 + math.sqrt(2.0 * math.log(1.0 / beta)) * (c + math.sqrt(d) / 2.0)
    return min(plain, math.sqrt(squared))


def integer_l1_bound(l2_norm: float, dimension: int) -> float:
    """An L1 bound of an integer vector of L2 norm <= l2_norm in d dimensions:
    min(sqrt(d) l2, l2^2) (Cauchy-Schwarz; |a| <= a^2 for integers)."""
    l2 = check_number("l2_norm", l2_norm, low=0.0)
    return l2 * min(math.sqrt(check_count("dimension", dimension, minimum=1)), l2)


def ddg_tau(share_variance: float, num_shares: int) -> float:
    """tau = 10 sum_{k=1}^{n-1} exp(-2 pi^2 s^2 k / (k+1)) (Kairouz et al. 2021,
    Theorem 1): how far a sum of n discrete Gaussians N_Z(0, s^2) is from one
    discrete Gaussian N_Z(0, n s^2)."""
    v = check_number("share_variance", share_variance, low=0.25)  # s >= 1/2
    n = check_count("num_shares", num_shares, minimum=1)
    k = np.arange(1, n, dtype=np.float64)
    return float(10.0 * np.sum(np.exp(-2.0 * math.pi**2 * v * k / (k + 1.0))))


def ddg_rdp(orders, event: DistributedDiscreteGaussianDpEvent) -> np.ndarray:
    """eps(a) of one release of the distributed discrete Gaussian at every order a
    (module docstring; Kairouz et al. 2021, Theorem 1 and Proposition 14)."""
    if event.share_variance < 0.25:
        raise ValueError(
            "the distributed discrete Gaussian bound needs share stddev >= 1/2 "
            f"(share_variance >= 0.25), got share_variance={event.share_variance}"
        )
    a = np.asarray(orders, dtype=np.float64)
    n, d = event.num_shares, event.dimension
    s = math.sqrt(event.share_variance)
    tau = ddg_tau(event.share_variance, n)
    l2 = event.l2_sensitivity / (math.sqrt(n) * s)  # D2 / sqrt(n s^2)
    l1 = event.l1_sensitivity / (math.sqrt(n) * s)
    term1 = a * l2**2 / 2.0 + tau * d
    term2 = a / 2.0 * (l2**2 + 2.0 * l1 * tau + tau**2 * d)
    term3 = a / 2.0 * (l2 + math.sqrt(d) * tau) ** 2
    return np.minimum(np.minimum(term1, term2), term3)


def skellam_rdp(orders, event: DistributedSkellamDpEvent) -> np.ndarray:
    """eps(a) of one release of the distributed Skellam mechanism (module docstring;
    Agarwal et al. 2021) at integer orders a >= 2 (others: `rdp_curve`)."""
    a = np.asarray(orders, dtype=np.float64)
    mu = event.num_shares * event.share_variance
    l2, l1 = event.l2_sensitivity, event.l1_sensitivity
    extra = np.minimum(((2.0 * a - 1.0) * l2**2 + 6.0 * l1) / (4.0 * mu**2), 3.0 * l1 / (2.0 * mu))
    return a * l2**2 / (2.0 * mu) + extra


def _unsampled_integer_rdp(event, alphas: np.ndarray) -> np.ndarray:
    if isinstance(event, DistributedDiscreteGaussianDpEvent):
        return ddg_rdp(alphas, event)
    return skellam_rdp(alphas, event)


def sampled_without_replacement_rdp(alpha: int, gamma: float, eps) -> float:
    """Wang, Balle, Kasiviswanathan 2019, Theorem 9 (module docstring): the RDP at
    integer order `alpha` >= 2 of a mechanism run on m of K records drawn without
    replacement (gamma = m/K, replace-one), given its RDP ``eps(j)`` at the integer
    orders j = 2..alpha (``eps`` maps an int array to an array)."""
    alpha = check_count("alpha", alpha, minimum=2)
    gamma = check_number("gamma", gamma, low=0.0, high=1.0)
    if gamma == 0:
        return 0.0
    j = np.arange(2, alpha + 1)
    e = np.asarray(eps(j), dtype=np.float64)
    if gamma == 1.0:
        return float(e[-1])
    log_comb = special.gammaln(alpha + 1) - special.gammaln(j + 1) - special.gammaln(alpha - j + 1)
    e2 = e[0]
    second = min(
        math.log(4.0) + e2 + math.log(-math.expm1(-e2)) if e2 > 0 else -math.inf, math.log(2.0) + e2
    )
    terms = [0.0, 2 * math.log(gamma) + log_comb[0] + second]
    if alpha >= 3:
        higher = math.log(2.0) + j[1:] * math.log(gamma) + log_comb[1:] + (j[1:] - 1) * e[1:]
        terms.extend(higher.tolist())
    return float(special.logsumexp(terms) / (alpha - 1))


def _cgf_interpolated(orders: np.ndarray, integer_rdp) -> np.ndarray:
    """RDP at arbitrary orders >= 1 from a bound at integer orders >= 2: the
    cumulant generating function K(a) = (a - 1) eps(a) is convex with K(1) = 0, so
    between integers it lies below the chord (Wang et al. 2019, Corollary 10)."""
    out = np.empty(len(orders))
    for i, a in enumerate(orders):
        if a < 1:
            raise ValueError(f"RDP orders must be >= 1, got {a}")
        if math.isinf(a):
            out[i] = math.inf
            continue
        lo, hi = math.floor(a), math.ceil(a)
        if lo == hi:
            out[i] = 0.0 if a == 1 else integer_rdp(int(a))
            continue
        k_lo = 0.0 if lo == 1 else (lo - 1) * integer_rdp(lo)
        k_hi = (hi - 1) * integer_rdp(hi)
        t = a - lo
        out[i] = ((1 - t) * k_lo + t * k_hi) / (a - 1)
    return out


def is_distributed_event(event: dp_accounting.DpEvent) -> bool:
    """True for a distributed DP event, alone or sampled without replacement."""
    if isinstance(event, _dp_event.SampledWithoutReplacementDpEvent):
        event = event.event
    return isinstance(event, DISTRIBUTED_EVENTS)


@functools.lru_cache(maxsize=256)
def rdp_curve(event: dp_accounting.DpEvent, orders: tuple) -> np.ndarray:
    """The RDP bound at `orders` of one distributed DP event, alone or within a
    `SampledWithoutReplacementDpEvent` (module docstring).  Cached per event."""
    gamma = 1.0
    inner = event
    if isinstance(event, _dp_event.SampledWithoutReplacementDpEvent):
        gamma = event.sample_size / event.source_dataset_size
        inner = event.event
    if not isinstance(inner, DISTRIBUTED_EVENTS):
        raise ValueError(f"not a distributed DP event: {event!r}")

    @functools.lru_cache(maxsize=None)
    def unsampled(alpha: int) -> float:
        return float(_unsampled_integer_rdp(inner, np.array([alpha]))[0])

    def integer_rdp(alpha: int) -> float:
        if gamma == 1.0:
            return unsampled(alpha)
        sampled = sampled_without_replacement_rdp(
            alpha, gamma, lambda j: _unsampled_integer_rdp(inner, j)
        )
        return min(sampled, unsampled(alpha))

    orders = np.asarray(orders, dtype=np.float64)
    if isinstance(inner, DistributedDiscreteGaussianDpEvent) and gamma == 1.0:
        return ddg_rdp(orders, inner)  # the bound holds at every real order
    return _cgf_interpolated(orders, integer_rdp)

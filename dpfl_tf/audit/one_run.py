"""The one-run epsilon lower bound of Steinke, Nasr and Jagielski (2023).

Setting ("Privacy auditing with one (1) training run", arXiv:2305.08846).
m *canaries* are each included in the training data independently with
probability 1/2 (a secret coin S_i in {-1, +1}).  The trained model (or, for a
white-box audit, every intermediate model) is the output of the mechanism M.
From that output alone -- never from the coins -- the auditor computes a score
per canary and *guesses*: T_i = +1 ("in") for the k_+ highest scores, T_i = -1
("out") for the k_- lowest, and abstains (T_i = 0) on the rest; r = k_+ + k_-
guesses are made and W of them are correct (T_i = S_i).

The bound (the paper's main theorem, Theorem 3.1, for (eps, delta)-DP with
respect to each canary's inclusion).  Let q_eps = e^eps / (1 + e^eps), the
accuracy of eps-DP randomized response, and
f(v) = P[Binomial(r, q_eps) >= v].  If M is (eps, delta)-DP then for every v

    P[W >= v] <= f(v) + 2 m delta * max_{i = 1..v} (f(v - i) - f(v)) / i.

The right-hand side is the *p-value* of observing v correct guesses under the
hypothesis "M is (eps, delta)-DP" (`one_run_p_value`).  The audit reports

    eps_lb = the largest eps of a grid (step `resolution`) such that the
             p-value is < alpha = 1 - confidence at every grid point <= eps_lb.

Why this is a valid (1 - alpha) lower bound: if M is (eps0, delta)-DP it is
also (eps_j, delta)-DP at the smallest grid point eps_j >= eps0, so eps_lb > eps0
happens only if the p-value at eps_j came out < alpha, which has probability
<= alpha.  No monotonicity of the p-value in eps is needed.

Choice of k.  The number of guesses must be fixed before looking at the
coins; choosing the best k after seeing how many guesses were right is a
multiple test.  `epsilon_lower_bound_from_scores` therefore tries a small fixed
set of guess counts and runs each test at level alpha / (number of counts)
(Bonferroni), so the maximum over them is still a (1 - alpha) lower bound.

Power (eps-DP test).  The bound can never exceed what perfect guessing of all r guesses
allows: with delta = 0 and r correct guesses, eps_lb is the eps solving
q_eps^r = alpha, i.e. about log(r / log(1 / alpha)) for large r -- about 5.8
for r = 1000 at 95 %.  For a Gaussian mechanism (DP-SGD) the guesses are
never perfect, and one run with m ~ 10^3 - 10^4 canaries certifies about
0.4-0.45 x eps at eps = 1..8 (`ideal_gaussian_lower_bound` simulates an
idealized, exactly Gaussian canary; `experiments/audit_canary.py` measures it).

The f-DP (Gaussian) refinement (Mahloujifar, Melis, Chaudhuri 2024,
"Auditing f-differential privacy in one run", arXiv:2410.22235).  Comparing
with eps-DP randomized response is the worst case over all (eps, delta)-DP
mechanisms; a Gaussian mechanism (full-batch DP-SGD, Global DP with every
client in every round) is far less revealing at the same (eps, delta), so
the eps-DP test leaves much of its power unused.  The hypothesis is instead
"M is mu-GDP with respect to each canary" (Dong, Roth, Su 2019): every test of
one canary's coin with power x (P[guess "in" | in] = x) has type I error at
least Phi(Phi^{-1}(x) - mu).  For k one-sided guesses ("in" for the k highest
scores) of which v are correct, the paper's recursive bound (its
``audit_rh_with_cap``, in the form jax-privacy's `_epsilon_one_run_fdp`
implements it) runs

    r = alpha v / m,  h = alpha (k - v) / m
    for i = v - 1, ..., 0:
        h' = max(h, Phi(Phi^{-1}(r) - mu))        # wrong-guess mass the tradeoff forces
        r  = min(1, r + i / (k - i) * (h' - h));  h = h'

and if P[W >= v] >= alpha under the hypothesis then r + h <= k / m; so
r + h > k / m rejects mu at level alpha (`gdp_one_run_rejects`, our code).
We did not re-derive the paper's proof; the validity of our code is checked
by simulation (below) and its recursion against a scalar reference.  The mu
lower bound is the end of the run of rejected grid points from 0 (step
`resolution`, the same grid argument as above), and the reported epsilon is
the Gaussian mechanism's epsilon at the claimed delta,

    eps_lb = eps_mu(delta),  delta = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)

(Dong et al. 2019, Corollary 2.13; `gdp_epsilon`).  Soundness is a statement
about GDP claims: the bound says "M is not mu-GDP for any mu <= mu_lb".  For
full-batch DP-SGD (and Global DP with every client in every round) the
accountant's claim *is* mu-GDP with mu = sqrt(T) / sigma and its PLD epsilon
equals eps_mu(delta), so eps_lb above the claim is a bug.  Poisson-sampled
mechanisms are not GDP at their claimed epsilon's mu (the subsampled
Gaussian's tradeoff curve is not Gaussian): audit them with the eps-DP test.
`tests/audit/test_one_run.py` checks the GDP bound by simulation: for an
exactly mu-GDP canary (and for randomized response, mu-GDP at its kink) it
stays below mu in >= 95 % of runs, and with 10,000 Gaussian canaries at
eps 8 it certifies about 0.6 x eps (eps-DP test: about 0.45 x).  The bound
stops improving beyond about 10^4 canaries (in simulation: 0.58 x eps at
eps 8 with 5,000 canaries, 0.62 x with 10,000 and 20,000); our reading is
that the alpha v / m start works like a Markov inequality, not a binomial
tail, so more canaries do not sharpen it the way they sharpen the eps-DP test.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import dp_accounting
import numpy as np
from scipy import optimize, special, stats

from dpfl_tf._validation import check_count, check_number
from dpfl_tf.privacy.events import describe_event, iter_events

__all__ = [
    "OneRunResult",
    "DEFAULT_GUESS_FRACTIONS",
    "GDP_GUESS_FRACTIONS",
    "METHODS",
    "one_run_p_value",
    "one_run_epsilon_lower_bound",
    "epsilon_lower_bound_from_scores",
    "guesses_from_scores",
    "ideal_gaussian_lower_bound",
    "gdp_epsilon",
    "gdp_mu",
    "gdp_one_run_rejects",
    "one_run_gdp_mu_lower_bound",
    "refuse_gdp_on_sampling",
]

#: guess counts tried by default, as fractions of the number of canaries
DEFAULT_GUESS_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
#: guess count of the GDP test (one-sided "in" for the top 5 %), fixed in advance:
#: in simulations of exactly Gaussian canaries (m = 2,000-20,000, eps 1-8 and
#: twice the mu) one count at 5 % beat every Bonferroni set of counts we tried
#: (0.5-10 %: the divisor costs more than the better count gains)
GDP_GUESS_FRACTIONS = (0.05,)
#: "eps_dp": Steinke et al.'s test against any (eps, delta)-DP mechanism;
#: "gdp": the f-DP refinement against mu-GDP (Gaussian mechanisms only)
METHODS = ("eps_dp", "gdp")
_EPS_MAX = 50.0
_MU_MAX = 12.0


def _event_of(mechanism):
    """The DpEvent of what ran: a DpEvent, a `PrivacyLedger`, or an object
    holding one (`DPModel.privacy_ledger`, `FederatedServer.ledger`); None if
    none is given."""
    from dpfl_tf.privacy.ledger import PrivacyLedger

    for attr in ("privacy_ledger", "ledger"):
        held = getattr(mechanism, attr, None)
        if isinstance(held, PrivacyLedger):
            mechanism = held
            break
    if isinstance(mechanism, PrivacyLedger):
        return mechanism.event
    if mechanism is None or isinstance(mechanism, dp_accounting.DpEvent):
        return mechanism
    raise TypeError(
        "mechanism must be a DpEvent, a PrivacyLedger, or a DPModel / "
        f"FederatedServer holding one, got {type(mechanism).__name__}"
    )


def _is_sampled(event) -> bool:
    """True if the event composes a sampled release (Poisson with q < 1, or
    sampling with or without replacement: sampled lots or sampled clients)."""
    return any(
        isinstance(
            e,
            (
                dp_accounting.SampledWithoutReplacementDpEvent,
                dp_accounting.SampledWithReplacementDpEvent,
            ),
        )
        or (isinstance(e, dp_accounting.PoissonSampledDpEvent) and e.sampling_probability < 1)
        for e in iter_events(event)
    )


def refuse_gdp_on_sampling(method: str, mechanism, *, required: bool = True) -> None:
    """Refuses ``method="gdp"`` on a sampled mechanism.  The GDP test's null
    hypothesis is mu-GDP, the trade-off curve of a plain Gaussian mechanism
    (full-batch DP-SGD, Global DP with every client every round); a sampled
    Gaussian (Poisson lots, sampled clients) has another curve, so a bound from
    that test is not a statement about the mechanism that ran.  With
    `required`, gdp without a `mechanism` to check is refused too."""
    if method != "gdp":
        return
    event = _event_of(mechanism)
    if event is None:
        if required:
            raise ValueError(
                "method='gdp' needs mechanism= (the DpEvent or PrivacyLedger of what ran, or "
                "the DPModel / FederatedServer) to refuse sampled mechanisms; or use "
                "method='eps_dp', valid for every mechanism"
            )
        return
    if _is_sampled(event):
        raise ValueError(
            f"method='gdp' is refused on a sampled mechanism ({describe_event(event)}): "
            "its privacy curve is not Gaussian, so the GDP test's null is not what ran; use "
            "method='eps_dp'"
        )


def _check_counts(canaries, guesses, correct) -> tuple[int, int, int]:
    m = check_count("canaries", canaries, minimum=1)
    r = check_count("guesses", guesses, minimum=0)
    v = check_count("correct", correct, minimum=0)
    if r > m:
        raise ValueError(f"guesses must be <= canaries ({m}), got {r}")
    if v > r:
        raise ValueError(f"correct must be <= guesses ({r}), got {v}")
    return m, r, v


def _p_value(eps: float, delta: float, m: int, r: int, v: int) -> float:
    if v == 0:
        return 1.0
    q = 1.0 / (1.0 + math.exp(-eps))  # e^eps / (1 + e^eps)
    pmf = stats.binom.pmf(np.arange(r + 1), r, q)
    tail = float(stats.binom.sf(v - 1, r, q))  # f(v) = P[Bin >= v], accurate in the tail
    # f(v - i) - f(v) = P[v - i <= Bin < v] for i = 1..v
    below = np.cumsum(pmf[:v][::-1])
    worst = float(np.max(below / np.arange(1, v + 1)))
    return min(1.0, tail + 2.0 * m * delta * worst)


def one_run_p_value(
    epsilon: float, delta: float, *, canaries: int, guesses: int, correct: int
) -> float:
    """Upper bound on P[W >= correct] for an (epsilon, delta)-DP mechanism
    (module docstring; Steinke et al. 2023, Theorem 3.1).

    Args:
      epsilon, delta: the hypothesis "M is (epsilon, delta)-DP".
      canaries: m, the number of canaries (each included with probability 1/2).
      guesses: r, the guesses made (abstentions excluded).
      correct: v, the correct guesses.
    """
    eps = check_number("epsilon", epsilon, low=0.0)
    delta = check_number("delta", delta, low=0.0, high=1.0)
    m, r, v = _check_counts(canaries, guesses, correct)
    return _p_value(eps, delta, m, r, v)


def one_run_epsilon_lower_bound(
    correct: int,
    guesses: int,
    canaries: int,
    *,
    delta: float,
    confidence: float = 0.95,
    resolution: float = 0.01,
) -> float:
    """eps_lb at `confidence` from counts (module docstring): the largest grid
    point eps such that `one_run_p_value` < 1 - confidence at every grid point
    in [0, eps]; 0 if already eps = 0 is not rejected.

    Worked example: 10 correct of 10 guesses, delta = 0, 95 %: the p-value is
    q_eps^10, which is < 0.05 iff q_eps < 0.05^(1/10) = 0.7411, i.e.
    eps < log(0.7411 / 0.2589) = 1.0517; the grid gives 1.05.
    """
    m, r, v = _check_counts(canaries, guesses, correct)
    delta = check_number("delta", delta, low=0.0, high=1.0)
    alpha = 1.0 - check_number(
        "confidence", confidence, low=0.0, high=1.0, low_open=True, high_open=True
    )
    res = check_number("resolution", resolution, low=0.0, high=1.0, low_open=True)

    def rejected(eps):
        return _p_value(eps, delta, m, r, v) < alpha

    if not rejected(0.0):
        return 0.0
    # coarse scan, then a fine scan of the first coarse interval that fails
    coarse = max(res, 0.25)
    last_ok = 0.0
    eps = coarse
    while eps <= _EPS_MAX and rejected(eps):
        last_ok = eps
        eps += coarse
    fine = last_ok
    step_eps = last_ok + res
    while step_eps < min(eps, _EPS_MAX + res) and rejected(step_eps):
        fine = step_eps
        step_eps += res
    # the coarse grid points <= last_ok were all checked, and so was every fine
    # point up to `fine`: eps_lb = fine is the end of a checked grid
    return float(round(fine, 10))


# -- the f-DP (Gaussian) refinement ---------------------------------------------------------
def gdp_epsilon(mu: float, delta: float) -> float:
    """The epsilon of a mu-GDP mechanism at `delta`: the root of
    Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) = delta (Dong, Roth, Su
    2019, Corollary 2.13), 0 if already eps = 0 meets delta."""
    mu = check_number("mu", mu, low=0.0)
    delta = check_number("delta", delta, low=0.0, high=1.0, low_open=True)
    if mu == 0.0:
        return 0.0

    def log_gap(eps):  # log(delta(eps)) - log(delta), in logs for large eps
        a = special.log_ndtr(-eps / mu + mu / 2)
        b = eps + special.log_ndtr(-eps / mu - mu / 2)
        return a + math.log1p(-math.exp(min(b - a, 0.0))) - math.log(delta) if b < a else -math.inf

    if log_gap(0.0) <= 0:
        return 0.0
    hi = max(1.0, mu * mu)
    while log_gap(hi) > 0:
        hi *= 2
    return float(optimize.brentq(log_gap, 0.0, hi, xtol=1e-10))


def gdp_mu(epsilon: float, delta: float) -> float:
    """The mu of the Gaussian mechanism whose epsilon at `delta` is `epsilon`
    (inverse of `gdp_epsilon`)."""
    eps = check_number("epsilon", epsilon, low=0.0)
    delta = check_number("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)

    def gap(mu):
        return gdp_epsilon(mu, delta) - eps

    hi = 1.0
    while gap(hi) < 0:
        hi *= 2
    return float(optimize.brentq(gap, 1e-12, hi, xtol=1e-12))


def gdp_one_run_rejects(
    mu, *, canaries: int, guesses: int, correct: int, alpha: float
) -> np.ndarray:
    """True where "M is mu-GDP" is rejected at level `alpha` by `correct` of
    `guesses` one-sided guesses among `canaries` (the recursion in the module
    docstring; Mahloujifar et al. 2024).  `mu` may be an array (one answer each)."""
    m, k, v = _check_counts(canaries, guesses, correct)
    alpha = check_number("alpha", alpha, low=0.0, high=1.0, low_open=True, high_open=True)
    mu = np.asarray(mu, dtype=np.float64)
    if np.any(mu < 0) or not np.all(np.isfinite(mu)):
        raise ValueError("mu must be finite and >= 0")
    r = np.full(mu.shape, alpha * v / m)
    h = np.full(mu.shape, alpha * (k - v) / m)
    for i in range(v - 1, -1, -1):
        h_new = np.maximum(h, special.ndtr(special.ndtri(r) - mu))
        if np.array_equal(h_new, h):
            break  # r does not move either, so nothing changes any more
        r = np.minimum(r + (i / (k - i)) * (h_new - h), 1.0)
        h = h_new
    return r + h > k / m


def one_run_gdp_mu_lower_bound(
    correct: int,
    guesses: int,
    canaries: int,
    *,
    confidence: float = 0.95,
    resolution: float = 0.005,
) -> float:
    """mu_lb at `confidence`: the largest point of the grid 0, resolution,
    2 resolution, ... such that every grid point up to it is rejected by
    `gdp_one_run_rejects`; 0 if mu = 0 is not rejected."""
    m, k, v = _check_counts(canaries, guesses, correct)
    alpha = 1.0 - check_number(
        "confidence", confidence, low=0.0, high=1.0, low_open=True, high_open=True
    )
    res = check_number("resolution", resolution, low=0.0, high=1.0, low_open=True)
    grid = np.arange(0.0, _MU_MAX + res / 2, res)
    rejected = gdp_one_run_rejects(grid, canaries=m, guesses=k, correct=v, alpha=alpha)
    if not rejected[0]:
        return 0.0
    first_kept = np.flatnonzero(~rejected)
    last = (first_kept[0] - 1) if len(first_kept) else len(grid) - 1
    return float(round(grid[last], 10))


def guesses_from_scores(scores: np.ndarray, k_in: int, k_out: int) -> np.ndarray:
    """T in {-1, 0, +1}^m: +1 for the k_in highest scores, -1 for the k_out
    lowest (ties broken by position), 0 elsewhere."""
    scores = np.asarray(scores, dtype=np.float64)
    m = len(scores)
    if k_in + k_out > m:
        raise ValueError(
            f"k_in + k_out must be <= the number of scores ({m}), got {k_in} + {k_out}"
        )
    order = np.argsort(-scores, kind="stable")
    guess = np.zeros(m, np.int8)
    guess[order[:k_in]] = 1
    if k_out:
        guess[order[m - k_out :]] = -1
    return guess


@dataclasses.dataclass(frozen=True)
class OneRunResult:
    """The audit's lower bound and how it was obtained.

    ``epsilon_lower_bound`` holds with probability >= ``confidence`` for every
    (eps, delta)-DP mechanism with eps < epsilon_lower_bound (at ``delta``).
    ``guesses`` / ``correct`` are those of the guess count that gave the bound;
    ``tests`` the number of guess counts tried (Bonferroni divisor).  With
    ``method="gdp"`` the statement is about mu-GDP claims: ``mu_lower_bound``
    is the 95 % bound on mu and ``epsilon_lower_bound`` its epsilon at
    ``delta`` (`gdp_epsilon`)."""

    epsilon_lower_bound: float
    confidence: float
    delta: float
    canaries: int
    guesses: int
    correct: int
    tests: int
    per_test: tuple = ()
    method: str = "eps_dp"
    mu_lower_bound: float | None = None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["per_test"] = [list(t) for t in self.per_test]
        return d


def epsilon_lower_bound_from_scores(
    scores: Sequence[float],
    coins: Sequence[bool],
    *,
    delta: float,
    confidence: float = 0.95,
    guess_fractions: Sequence[float] | None = None,
    sides: str | None = None,
    resolution: float | None = None,
    method: str = "eps_dp",
    mechanism=None,
) -> OneRunResult:
    """The one-run lower bound from per-canary scores (higher = "more likely
    in") and the secret coins (True = included).

    For each fraction f of `guess_fractions`, k = max(1, round(f m)) guesses are
    made: with ``sides="both"`` the ceil(k/2) highest scores are guessed "in"
    and the floor(k/2) lowest "out"; with ``sides="in"`` only the k highest are
    guessed "in".  Each test runs at level (1 - confidence) / len(guess_fractions)
    and the largest bound is returned (Bonferroni: still a `confidence` bound).

    ``method="eps_dp"`` (default; guess fractions `DEFAULT_GUESS_FRACTIONS`,
    both sides, eps grid step 0.01) tests (eps, delta)-DP and is valid for any
    mechanism.  ``method="gdp"`` (`GDP_GUESS_FRACTIONS`, "in" guesses only, mu
    grid step 0.005) tests mu-GDP (module docstring): much tighter, but valid
    only for a claim that is a Gaussian mechanism (full-batch DP-SGD, Global
    DP with every client every round), not for Poisson-sampled lots: given
    `mechanism` (what ran: `refuse_gdp_on_sampling`), a sampled one is refused.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    refuse_gdp_on_sampling(method, mechanism, required=False)
    gdp = method == "gdp"
    if guess_fractions is None:
        guess_fractions = GDP_GUESS_FRACTIONS if gdp else DEFAULT_GUESS_FRACTIONS
    if sides is None:
        sides = "in" if gdp else "both"
    if resolution is None:
        resolution = 0.005 if gdp else 0.01
    scores = np.asarray(scores, dtype=np.float64).ravel()
    coins = np.asarray(coins).ravel()
    if len(scores) != len(coins):
        raise ValueError(
            f"scores and coins must have the same length, got {len(scores)} and {len(coins)}"
        )
    if len(scores) == 0:
        raise ValueError("scores is empty: at least one canary is needed")
    if not np.all(np.isfinite(scores)):
        raise ValueError("scores contain NaN or inf")
    if coins.dtype != bool:
        if not np.all(np.isin(coins, (0, 1))):
            raise ValueError("coins must be booleans (or 0/1), got other values")
        coins = coins.astype(bool)
    if sides not in ("both", "in"):
        raise ValueError(f"sides must be 'both' or 'in', got {sides!r}")
    if gdp and sides != "in":
        raise ValueError(f"method 'gdp' makes one-sided guesses: sides must be 'in', got {sides!r}")
    fractions = [
        check_number(f"guess_fractions[{i}]", f, low=0.0, high=1.0, low_open=True)
        for i, f in enumerate(guess_fractions)
    ]
    if not fractions:
        raise ValueError("guess_fractions must not be empty")
    conf = check_number("confidence", confidence, low=0.0, high=1.0, low_open=True, high_open=True)
    delta = check_number("delta", delta, low=0.0, high=1.0)
    if gdp and delta == 0:
        raise ValueError("method 'gdp' converts mu to epsilon at delta: delta must be > 0, got 0")
    tests = len(fractions)
    per_test_conf = 1.0 - (1.0 - conf) / tests
    m = len(scores)
    truth = np.where(coins, 1, -1)
    best = None
    per_test = []
    for f in fractions:
        k = max(1, int(round(f * m)))
        k_in, k_out = ((k + 1) // 2, k // 2) if sides == "both" else (k, 0)
        guess = guesses_from_scores(scores, k_in, k_out)
        r = int(np.count_nonzero(guess))
        v = int(np.sum(guess == truth))
        if gdp:
            bound = one_run_gdp_mu_lower_bound(
                v, r, m, confidence=per_test_conf, resolution=resolution
            )
        else:
            bound = one_run_epsilon_lower_bound(
                v, r, m, delta=delta, confidence=per_test_conf, resolution=resolution
            )
        per_test.append((r, v, bound))
        if best is None or bound > best[2]:
            best = (r, v, bound)
    if gdp:
        return OneRunResult(
            epsilon_lower_bound=gdp_epsilon(best[2], delta),
            confidence=conf,
            delta=float(delta),
            canaries=m,
            guesses=best[0],
            correct=best[1],
            tests=tests,
            per_test=tuple(per_test),
            method="gdp",
            mu_lower_bound=best[2],
        )
    return OneRunResult(
        epsilon_lower_bound=best[2],
        confidence=conf,
        delta=float(delta),
        canaries=m,
        guesses=best[0],
        correct=best[1],
        tests=tests,
        per_test=tuple(per_test),
    )


def ideal_gaussian_lower_bound(
    mu: float, canaries: int, *, delta: float, confidence: float = 0.95, seed: int = 0, **kwargs
) -> float:
    """The bound this audit gives for an idealized canary whose score is
    N(mu, 1) if included and N(0, 1) if not (a mu-GDP mechanism, which DP-SGD
    with full-batch lots and Dirac canaries is, with mu = sqrt(T) / sigma):
    one simulated draw, to show what the method can reach with m canaries.
    `kwargs` go to `epsilon_lower_bound_from_scores` (e.g. ``method="gdp"``)."""
    mu = check_number("mu", mu, low=0.0)
    m = check_count("canaries", canaries, minimum=1)
    rng = np.random.default_rng(seed)
    coins = rng.random(m) < 0.5
    scores = rng.normal(mu * coins, 1.0)
    return epsilon_lower_bound_from_scores(
        scores, coins, delta=delta, confidence=confidence, **kwargs
    ).epsilon_lower_bound

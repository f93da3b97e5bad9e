"""Tests of the one-run lower bound (Steinke, Nasr, Jagielski 2023) against
closed forms, brute-force binomial sums and its own 95 % validity."""

import math
from fractions import Fraction

import numpy as np
import pytest

from dpfl_tf.audit.one_run import (
    epsilon_lower_bound_from_scores,
    guesses_from_scores,
    ideal_gaussian_lower_bound,
    one_run_epsilon_lower_bound,
    one_run_p_value,
)


def _brute_p_value(eps, delta, m, r, v):
    """The theorem's right-hand side with exact binomial sums (math.comb)."""
    q = Fraction(math.exp(eps)) / (1 + Fraction(math.exp(eps)))

    def f(u):  # P[Bin(r, q) >= u]
        return sum(math.comb(r, j) * q**j * (1 - q) ** (r - j) for j in range(max(u, 0), r + 1))

    worst = max((f(v - i) - f(v)) / i for i in range(1, v + 1))
    return min(1.0, float(f(v) + 2 * m * Fraction(delta) * worst))


@pytest.mark.parametrize(
    "eps,delta,m,r,v",
    [
        (0.5, 0.0, 30, 20, 15),
        (1.0, 1e-3, 30, 20, 18),
        (2.0, 1e-2, 40, 30, 29),
        (0.0, 0.0, 10, 10, 7),
        (3.0, 1e-5, 50, 12, 12),
    ],
)
def test_p_value_matches_brute_force(eps, delta, m, r, v):
    got = one_run_p_value(eps, delta, canaries=m, guesses=r, correct=v)
    assert got == pytest.approx(_brute_p_value(eps, delta, m, r, v), rel=1e-9, abs=1e-15)


@pytest.mark.parametrize("k", [10, 100, 1000])
def test_perfect_guessing_closed_form(k):
    # delta = 0, k of k correct: p = q_eps^k < alpha iff eps < log(a / (1 - a)), a = alpha^(1/k)
    a = 0.05 ** (1 / k)
    exact = math.log(a / (1 - a))
    got = one_run_epsilon_lower_bound(k, k, k, delta=0.0, confidence=0.95)
    assert exact - 0.01 <= got < exact + 1e-9


def test_worked_example_and_monotonicity():
    assert one_run_epsilon_lower_bound(10, 10, 10, delta=0.0) == pytest.approx(1.05)
    base = one_run_epsilon_lower_bound(180, 200, 1000, delta=0.0)
    assert one_run_epsilon_lower_bound(190, 200, 1000, delta=0.0) > base
    assert one_run_epsilon_lower_bound(180, 200, 1000, delta=1e-4) < base
    assert one_run_epsilon_lower_bound(180, 200, 1000, delta=0.0, confidence=0.99) < base
    # half the guesses right is exactly what eps = 0 predicts
    assert one_run_epsilon_lower_bound(100, 200, 1000, delta=0.0) == 0.0
    assert one_run_epsilon_lower_bound(0, 0, 10, delta=0.0) == 0.0


def test_random_guessing_gives_about_zero_and_is_valid():
    # scores independent of the coins: an eps = 0 mechanism.  The bound must be
    # > 0 in at most ~5 % of runs (Bonferroni over the guess counts included).
    rng = np.random.default_rng(0)
    lbs = []
    for _ in range(200):
        coins = rng.random(500) < 0.5
        lbs.append(
            epsilon_lower_bound_from_scores(
                rng.normal(size=500), coins, delta=0.0
            ).epsilon_lower_bound
        )
    lbs = np.array(lbs)
    assert np.mean(lbs > 0) <= 0.09  # 200 draws of a 5 % event: 18 is > 3 sd out
    assert np.median(lbs) == 0.0 and lbs.max() < 0.5


def test_bound_is_valid_for_randomized_response():
    # eps-DP randomized response on each coin (the mechanism the bound is tight
    # for): the bound exceeds the true eps in at most ~5 % of runs, and is not
    # trivially small.
    eps, m = 1.0, 1000
    rng = np.random.default_rng(1)
    keep = math.exp(eps) / (1 + math.exp(eps))
    lbs = []
    for _ in range(100):
        coins = rng.random(m) < 0.5
        report = np.where(rng.random(m) < keep, coins, ~coins)
        scores = report + 1e-3 * rng.random(m)  # ties broken at random
        lbs.append(epsilon_lower_bound_from_scores(scores, coins, delta=0.0).epsilon_lower_bound)
    lbs = np.array(lbs)
    assert np.mean(lbs > eps) <= 0.1
    assert np.median(lbs) > 0.5


def test_ideal_gaussian_stays_below_its_epsilon():
    # mu = 1.666 is the GDP curve through (eps 8, delta 1e-5)
    lb = ideal_gaussian_lower_bound(1.666, 2000, delta=1e-5, seed=0)
    assert 1.5 < lb < 8.0


def test_guesses_from_scores():
    g = guesses_from_scores(np.array([0.1, 5.0, -3.0, 2.0, 0.0]), 2, 1)
    assert g.tolist() == [0, 1, -1, 1, 0]
    with pytest.raises(ValueError, match="k_in \\+ k_out must be <= the number of scores"):
        guesses_from_scores(np.zeros(3), 2, 2)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(correct=5, guesses=4, canaries=10), "correct must be <= guesses"),
        (dict(correct=1, guesses=11, canaries=10), "guesses must be <= canaries"),
        (dict(correct=-1, guesses=4, canaries=10), "correct must be a whole number >= 0"),
    ],
)
def test_count_errors_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        one_run_epsilon_lower_bound(delta=0.0, **kwargs)


def test_score_errors():
    with pytest.raises(ValueError, match="same length"):
        epsilon_lower_bound_from_scores([1.0, 2.0], [True], delta=0.0)
    with pytest.raises(ValueError, match="NaN or inf"):
        epsilon_lower_bound_from_scores([1.0, np.nan], [True, False], delta=0.0)
    with pytest.raises(ValueError, match="sides must be"):
        epsilon_lower_bound_from_scores([1.0, 2.0], [True, False], delta=0.0, sides="out")
    with pytest.raises(ValueError, match="confidence must be in"):
        epsilon_lower_bound_from_scores([1.0, 2.0], [True, False], delta=0.0, confidence=1.0)


# -- the f-DP (Gaussian) refinement ------------------------------------------------------
from statistics import NormalDist  # noqa: E402

from dpfl_tf.audit.one_run import (  # noqa: E402
    GDP_GUESS_FRACTIONS,
    gdp_epsilon,
    gdp_mu,
    gdp_one_run_rejects,
    one_run_gdp_mu_lower_bound,
)


@pytest.mark.parametrize("eps", [0.5, 1.0, 2.0, 4.0, 8.0, 16.0])
def test_gdp_conversion_matches_dp_accounting(eps):
    import dp_accounting

    # a sensitivity-1 Gaussian with std sigma is (1/sigma)-GDP
    sigma = dp_accounting.get_sigma_gaussian(eps, 1e-5)
    assert gdp_mu(eps, 1e-5) == pytest.approx(1.0 / sigma, rel=1e-6)
    assert gdp_epsilon(1.0 / sigma, 1e-5) == pytest.approx(eps, rel=1e-6)


def test_gdp_epsilon_is_the_full_batch_accountants():
    # full-batch DP-SGD, T lots of noise multiplier sigma, is sqrt(T)/sigma-GDP:
    # the library's PLD epsilon must match the closed form
    from dpfl_tf.privacy.accountants import compute_epsilon
    from dpfl_tf.privacy.events import dp_sgd_event

    for sigma, steps in [(2.0, 10), (0.6, 1), (5.0, 100)]:
        eps = compute_epsilon(dp_sgd_event(sigma, steps, "full_batch"), 1e-5, "pld")
        assert gdp_epsilon(math.sqrt(steps) / sigma, 1e-5) == pytest.approx(eps, abs=0.01)


def _scalar_rejects(mu, m, k, v, alpha):
    """The recursion with scalars and the standard library's normal (reference)."""
    nd = NormalDist()
    cdf = lambda z: nd.cdf(z)  # noqa: E731
    ppf = lambda p: -math.inf if p <= 0 else (math.inf if p >= 1 else nd.inv_cdf(p))  # noqa
    r, h = alpha * v / m, alpha * (k - v) / m
    for i in range(v - 1, -1, -1):
        z = ppf(r) - mu
        h_new = max(h, 0.0 if z == -math.inf else (1.0 if z == math.inf else cdf(z)))
        if h_new == h:
            break
        r, h = min(r + i / (k - i) * (h_new - h), 1.0), h_new
    return r + h > k / m


@pytest.mark.parametrize(
    "m,k,v", [(1000, 50, 50), (1000, 100, 80), (5000, 250, 240), (200, 200, 120), (100, 10, 3)]
)
def test_gdp_recursion_matches_scalar_reference(m, k, v):
    grid = np.arange(0.0, 4.0, 0.05)
    got = gdp_one_run_rejects(grid, canaries=m, guesses=k, correct=v, alpha=0.05)
    want = [_scalar_rejects(mu, m, k, v, 0.05) for mu in grid]
    assert got.tolist() == want


def test_gdp_rejection_basics():
    # no correct guess rejects nothing; all-correct guesses reject small mu only
    assert not gdp_one_run_rejects(0.0, canaries=100, guesses=10, correct=0, alpha=0.05)
    lb = one_run_gdp_mu_lower_bound(100, 100, 1000, confidence=0.95)
    assert 0.5 < lb < _MU_CAP
    assert not gdp_one_run_rejects(lb + 0.5, canaries=1000, guesses=100, correct=100, alpha=0.05)
    assert one_run_gdp_mu_lower_bound(60, 100, 1000) < lb
    assert one_run_gdp_mu_lower_bound(50, 100, 1000) == 0.0


_MU_CAP = 12.0


def _rr_scores(rng, coins, eps):
    keep = math.exp(eps) / (1 + math.exp(eps))
    report = np.where(rng.random(len(coins)) < keep, coins, ~coins)
    return report + 1e-3 * rng.random(len(coins))


@pytest.mark.parametrize(
    "kind,param", [("gaussian", 0.5), ("gaussian", 1.666), ("randomized_response", 1.0)]
)
def test_gdp_bound_is_valid_by_simulation(kind, param):
    # A mechanism that is exactly mu-GDP per canary: Gaussian scores N(mu S, 1),
    # and eps-DP randomized response, which is mu-GDP for mu = 2 Phi^-1(e^eps/(1+e^eps))
    # (the Gaussian curve touches its kink).  The 95 % bound on mu must exceed
    # the true mu in at most ~5 % of runs (200 runs: at most 18 is < 3 sd out).
    rng = np.random.default_rng(7)
    m = 2000
    mu = (
        param
        if kind == "gaussian"
        else 2 * NormalDist().inv_cdf(math.exp(param) / (1 + math.exp(param)))
    )
    above = 0
    lbs = []
    for _ in range(200):
        coins = rng.random(m) < 0.5
        scores = (
            rng.normal(mu * coins, 1.0) if kind == "gaussian" else _rr_scores(rng, coins, param)
        )
        res = epsilon_lower_bound_from_scores(scores, coins, delta=1e-5, method="gdp")
        lbs.append(res.mu_lower_bound)
        above += res.mu_lower_bound > mu
    assert above <= 18, (above, np.max(lbs))
    if kind == "gaussian":  # and it is not trivially small
        assert np.median(lbs) > 0.3 * mu


def test_gdp_bound_is_close_with_many_canaries():
    # eps 8 at delta 1e-5 is mu = 1.666.  With 10,000 exactly Gaussian canaries
    # the GDP test certifies about 0.6 x eps; the eps-DP test about 0.45 x.
    mu = gdp_mu(8.0, 1e-5)
    gdp, epsdp = [], []
    for seed in range(4):
        gdp.append(ideal_gaussian_lower_bound(mu, 10000, delta=1e-5, seed=seed, method="gdp"))
        epsdp.append(ideal_gaussian_lower_bound(mu, 10000, delta=1e-5, seed=seed))
    assert 4.0 < np.median(gdp) < 8.0
    assert np.median(gdp) > np.median(epsdp) + 0.5


def test_gdp_errors():
    with pytest.raises(ValueError, match="method must be one of"):
        epsilon_lower_bound_from_scores([1.0, 2.0], [True, False], delta=1e-5, method="fdp")
    with pytest.raises(ValueError, match="delta must be > 0, got 0"):
        epsilon_lower_bound_from_scores([1.0, 2.0], [True, False], delta=0.0, method="gdp")
    with pytest.raises(ValueError, match="sides must be 'in'"):
        epsilon_lower_bound_from_scores(
            [1.0, 2.0], [True, False], delta=1e-5, method="gdp", sides="both"
        )
    res = epsilon_lower_bound_from_scores(
        np.arange(100.0), np.arange(100) % 2 == 0, delta=1e-5, method="gdp"
    )
    assert res.tests == len(GDP_GUESS_FRACTIONS) and res.guesses == 5 and res.method == "gdp"

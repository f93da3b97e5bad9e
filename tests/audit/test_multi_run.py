"""Tests of the multi-run audit: exact Clopper-Pearson counts, and its 95 %
validity and power by simulation (ideal Gaussian and randomized-response runs)."""

import math

import dp_accounting
import numpy as np
import pytest

from dpfl_tf.audit.multi_run import multi_run_epsilon_lower_bound
from dpfl_tf.audit.one_run import gdp_epsilon, gdp_mu
from dpfl_tf.privacy import PrivacyLedger, dp_sgd_event

#: what one simulated run released: a plain Gaussian mechanism (mu-GDP)
GAUSSIAN = dp_accounting.GaussianDpEvent(1.0)


def _runs(rng, mu, n_in, n_out):
    return rng.normal(mu, 1.0, n_in), rng.normal(0.0, 1.0, n_out)


def test_counts_and_bounds_by_hand():
    from scipy import stats

    ins, outs = np.array([3.0, 2.0, 1.0, 0.2]), np.array([0.1, -1.0, 1.5, -2.0])
    res = multi_run_epsilon_lower_bound(ins, outs, delta=0.0, threshold=0.5)
    assert (res.false_positives, res.false_negatives) == (1, 1)
    # the CP upper bound p solves P[Bin(4, p) <= 1] = 0.025
    assert stats.binom.cdf(1, 4, res.fpr_upper) == pytest.approx(0.025, rel=1e-6)
    want = max(
        0.0,
        math.log((1 - res.fnr_upper) / res.fpr_upper),
        math.log((1 - res.fpr_upper) / res.fnr_upper),
    )
    assert res.epsilon_lower_bound == pytest.approx(want)
    g = multi_run_epsilon_lower_bound(
        ins, outs, delta=1e-5, threshold=0.5, method="gdp", mechanism=GAUSSIAN
    )
    assert g.mu_lower_bound == 0.0 and g.epsilon_lower_bound == 0.0  # 4 runs prove nothing
    # perfect separation with 50 + 50 runs: mu_lb = 2 Phi^-1(1 - (1 - 0.025^(1/50)))
    from scipy.stats import norm

    ins, outs = np.full(50, 5.0), np.zeros(50)
    g = multi_run_epsilon_lower_bound(
        ins, outs, delta=1e-5, threshold=2.5, method="gdp", mechanism=GAUSSIAN
    )
    p = 1 - 0.025 ** (1 / 50)
    assert g.mu_lower_bound == pytest.approx(2 * norm.isf(p), rel=1e-6)
    assert g.epsilon_lower_bound == pytest.approx(gdp_epsilon(2 * norm.isf(p), 1e-5))


@pytest.mark.parametrize(
    "method,split", [("gdp", False), ("gdp", True), ("eps_dp", False), ("eps_dp", True)]
)
def test_valid_for_a_gaussian_mechanism(method, split):
    # mu = 1 (eps 4.39 at 1e-5).  The bound must exceed the truth in <= ~5 % of
    # 300 audits of 100 runs each (at most 25 is > 3 sd above 15).
    rng = np.random.default_rng(3)
    mu = 1.0
    truth = gdp_epsilon(mu, 1e-5)
    above, lbs = 0, []
    for i in range(300):
        ins, outs = _runs(rng, mu, 50, 50)
        res = multi_run_epsilon_lower_bound(
            ins,
            outs,
            delta=1e-5,
            method=method,
            threshold=None if split else mu / 2,
            seed=i,
            mechanism=GAUSSIAN,
        )
        lbs.append(res.epsilon_lower_bound)
        above += res.epsilon_lower_bound > truth
    assert above <= 25, above
    if method == "gdp" and not split:  # and the fixed-threshold GDP bound has power
        assert np.median(lbs) > 0.3


def test_valid_for_randomized_response():
    # eps-DP randomized response: the eps-DP bound must stay below eps.
    rng = np.random.default_rng(4)
    eps, above = 2.0, 0
    keep = math.exp(eps) / (1 + math.exp(eps))
    for _ in range(300):
        ins = (rng.random(200) < keep).astype(float)
        outs = (rng.random(200) >= keep).astype(float)
        res = multi_run_epsilon_lower_bound(ins, outs, delta=0.0, threshold=0.5)
        above += res.epsilon_lower_bound > eps
    assert above <= 25


def test_power_with_many_runs():
    # 4,000 runs of a mu-GDP mechanism at eps 4: the GDP bound comes close.
    rng = np.random.default_rng(5)
    mu = gdp_mu(4.0, 1e-5)
    ins, outs = _runs(rng, mu, 2000, 2000)
    res = multi_run_epsilon_lower_bound(
        ins, outs, delta=1e-5, method="gdp", threshold=mu / 2, mechanism=GAUSSIAN
    )
    assert 3.0 < res.epsilon_lower_bound < 4.0
    res = multi_run_epsilon_lower_bound(ins, outs, delta=1e-5, method="eps_dp")
    assert 0.3 < res.epsilon_lower_bound < 2.0  # eps-DP tests need far more runs


def test_errors():
    with pytest.raises(ValueError, match="method must be one of"):
        multi_run_epsilon_lower_bound([1.0], [0.0], delta=1e-5, method="x", threshold=0.5)
    with pytest.raises(ValueError, match="at least one run on each side"):
        multi_run_epsilon_lower_bound([], [0.0], delta=1e-5, threshold=0.5)
    with pytest.raises(ValueError, match="NaN or inf"):
        multi_run_epsilon_lower_bound([np.nan], [0.0], delta=1e-5, threshold=0.5)
    with pytest.raises(ValueError, match="leaves no runs"):
        multi_run_epsilon_lower_bound([1.0], [0.0], delta=1e-5)
    with pytest.raises(ValueError, match="delta must be > 0"):
        multi_run_epsilon_lower_bound(
            [1.0], [0.0], delta=0.0, method="gdp", threshold=0.5, mechanism=GAUSSIAN
        )


def test_the_gdp_test_is_refused_on_sampled_mechanisms_and_without_one():
    ins, outs = np.full(50, 5.0), np.zeros(50)
    sampled = [
        dp_sgd_event(1.0, 100, sampling_rate=0.01),
        dp_sgd_event(1.0, 100, "fixed_size", dataset_size=1000, lot_size=10),
    ]
    ledger = PrivacyLedger("rdp")
    ledger.record(sampled[0], 1)
    for mechanism in sampled + [ledger]:
        with pytest.raises(ValueError, match="refused on a sampled mechanism") as err:
            multi_run_epsilon_lower_bound(
                ins, outs, delta=1e-5, threshold=2.5, method="gdp", mechanism=mechanism
            )
        assert "method='eps_dp'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="needs mechanism="):
        multi_run_epsilon_lower_bound(ins, outs, delta=1e-5, threshold=2.5, method="gdp")
    full_batch = dp_sgd_event(1.0, 100, "full_batch")
    assert (
        multi_run_epsilon_lower_bound(
            ins, outs, delta=1e-5, threshold=2.5, method="gdp", mechanism=full_batch
        ).mu_lower_bound
        > 0
    )
    for mechanism in sampled + [None]:  # the eps-DP test is valid for every mechanism
        multi_run_epsilon_lower_bound(ins, outs, delta=1e-5, threshold=2.5, mechanism=mechanism)

"""The number of trials of a private search: its distribution and its event."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp_module
from scipy import stats

from dpfl_tf.privacy import PrivacyLedger, compute_epsilon, describe_event, dp_sgd_event
from dpfl_tf.tuning import TrialCount, search_event

SHAPES = [0.0, 0.5, 1.0, 3.0]


def _chi2_pvalue(samples, dist: TrialCount, top=40):
    """Chi-square goodness of fit of integer samples to dist's pmf (bins k <=
    top, the tail in one bin)."""
    samples = np.asarray(samples)
    low = 0 if dist.is_poisson else 1
    ks = np.arange(low, top + 1)
    expected = np.append(dist.pmf(ks), 1 - dist.pmf(ks).sum()) * len(samples)
    observed = np.append([(samples == k).sum() for k in ks], (samples > top).sum())
    keep = expected > 5  # sparse bins merged into one
    if (~keep).any():
        observed = np.append(observed[keep], observed[~keep].sum())
        expected = np.append(expected[keep], expected[~keep].sum())
    return stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize("shape", SHAPES + [math.inf])
def test_pmf_sums_to_one_with_the_mean_asked(shape):
    dist = TrialCount(8.0, shape)
    ks = np.arange(0, 20000)
    p = dist.pmf(ks)
    assert p.sum() == pytest.approx(1.0, abs=1e-9)
    assert (ks * p).sum() == pytest.approx(8.0, rel=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_gamma_matches_dp_accounting(shape):
    for mean in (1.5, 5.0, 10.0, 50.0):
        ours = TrialCount(mean, shape).gamma
        theirs = rdp_module._gamma_truncated_negative_binomial(shape, mean)
        assert ours == pytest.approx(theirs, rel=1e-6)


def test_pmf_is_papernot_steinke_eq3():
    """Geometric (eta = 1): P[K = k] = gamma (1 - gamma)^(k - 1); logarithmic
    (eta = 0): (1 - gamma)^k / (k log(1/gamma))."""
    geo = TrialCount.geometric(10.0)
    assert geo.gamma == pytest.approx(0.1)
    ks = np.arange(1, 30)
    np.testing.assert_allclose(geo.pmf(ks), 0.1 * 0.9 ** (ks - 1), rtol=1e-12)
    log = TrialCount.logarithmic(10.0)
    g = log.gamma
    np.testing.assert_allclose(log.pmf(ks), (1 - g) ** ks / (ks * math.log(1 / g)), rtol=1e-10)
    assert geo.pmf([0, -1]).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("shape", SHAPES + [math.inf])
def test_samples_follow_the_distribution(shape):
    dist = TrialCount(6.0, shape)
    rng = np.random.default_rng(1234)
    samples = [dist.sample(rng) for _ in range(6000)]
    assert _chi2_pvalue(samples, dist) > 1e-3
    assert np.mean(samples) == pytest.approx(6.0, rel=0.06)


def test_the_fit_test_rejects_another_distribution():
    """The goodness-of-fit test can fail: logarithmic draws with the same mean
    are rejected as geometric, and a geometric of another mean too."""
    rng = np.random.default_rng(7)
    log_draws = [TrialCount.logarithmic(6.0).sample(rng) for _ in range(6000)]
    assert _chi2_pvalue(log_draws, TrialCount.geometric(6.0)) < 1e-6
    geo_draws = [TrialCount.geometric(6.6).sample(rng) for _ in range(6000)]
    assert _chi2_pvalue(geo_draws, TrialCount.geometric(6.0)) < 1e-6


def test_samples_are_at_least_one_except_poisson():
    rng = np.random.default_rng(0)
    assert min(TrialCount(1.2, 0.0).sample(rng) for _ in range(500)) == 1
    assert min(TrialCount.poisson(1.0).sample(rng) for _ in range(500)) == 0


@pytest.mark.parametrize(
    "mean,shape,match",
    [
        (1.0, 1.0, "mean must be > 1"),
        (0.5, math.inf, "mean must be >= 1"),
        (5.0, -0.5, "shape must be >= 0"),
        (float("nan"), 1.0, "mean must be"),
        ("ten", 1.0, "mean must be a number"),
    ],
)
def test_refusals_name_the_argument(mean, shape, match):
    with pytest.raises(ValueError, match=match):
        TrialCount(mean, shape)


@pytest.mark.parametrize("shape", SHAPES + [math.inf])
def test_search_epsilon_is_dp_accountings_rdp_of_repeat_and_select(shape):
    trial = dp_sgd_event(1.1, 500, sampling_rate=0.02)
    score = dp_accounting.GaussianDpEvent(10.0)
    event = search_event(TrialCount(10.0, shape), trial, score)
    assert isinstance(event, dp_event.RepeatAndSelectDpEvent)
    reference = rdp_module.RdpAccountant()
    reference.compose(
        dp_event.RepeatAndSelectDpEvent(dp_event.ComposedDpEvent([trial, score]), 10.0, shape)
    )
    assert compute_epsilon(event, 1e-5, "rdp") == pytest.approx(
        reference.get_epsilon(1e-5), rel=1e-12
    )
    # the search costs more than one trial, and (Papernot & Steinke) far less
    # than composing its expected 10 trials
    one = compute_epsilon(dp_accounting.ComposedDpEvent([trial, score]), 1e-5, "rdp")
    ten = compute_epsilon(search_event(10, trial, score), 1e-5, "rdp")
    assert one < compute_epsilon(event, 1e-5, "rdp") < ten


def test_fixed_count_composes_the_runs():
    trial = dp_sgd_event(1.1, 500, sampling_rate=0.02)
    event = search_event(4, trial, dp_event.NoOpDpEvent())
    assert event == dp_event.SelfComposedDpEvent(trial, 4)
    with pytest.raises(ValueError, match="trials must be a TrialCount .* got 0"):
        search_event(0, trial)


def test_only_rdp_accounts_the_search_and_says_so():
    event = search_event(TrialCount.geometric(10.0), dp_sgd_event(1.1, 500, sampling_rate=0.02))
    for kind in ("moments", "pld", "strong"):
        with pytest.raises(
            ValueError,
            match=f"accountant '{kind}' cannot account best of "
            r"geometric\(mean=10\) runs .*Renyi DP only; use accountant='rdp'",
        ):
            compute_epsilon(event, 1e-5, kind)


def test_the_ledger_records_and_restores_the_search():
    event = search_event(TrialCount.poisson(5.0), dp_sgd_event(1.1, 500, sampling_rate=0.02))
    ledger = PrivacyLedger("rdp")
    ledger.record(event, label="search")
    again = PrivacyLedger.from_json(ledger.to_json())
    assert again == ledger
    assert again.epsilon(1e-5) == pytest.approx(compute_epsilon(event, 1e-5, "rdp"))
    assert "best of Poisson(mean=5) runs of [500 x Poisson(q=0.02)" in describe_event(event)
    assert describe_event(event).endswith("(add/remove-one)")


def test_replace_one_runs_stay_replace_one():
    trial = dp_sgd_event(1.1, 500, "fixed_size", dataset_size=1000, lot_size=20)
    event = search_event(TrialCount.geometric(5.0), trial)
    assert describe_event(event).endswith("(replace-one)")
    ledger = PrivacyLedger("rdp")
    ledger.record(event)
    with pytest.raises(ValueError, match="different neighbouring relations"):
        ledger.record(dp_sgd_event(1.0, 10, sampling_rate=0.1))
    reference = rdp_module.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    reference.compose(dp_event.RepeatAndSelectDpEvent(trial, 5.0, 1.0))
    assert ledger.epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-12)

"""Moments accountant: the paper's numbers, closed form vs integration, dp-accounting."""

import math
import time

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp

from dpfl_tf.privacy import MomentsAccountant, dp_sgd_event, log_moments
from dpfl_tf.privacy.moments import delta_from_log_moments, epsilon_from_log_moments

DELTA = 1e-5


@pytest.mark.parametrize("epochs, expected", [(100, 1.259), (400, 2.576)])
def test_paper_figure2_moments_rows(epochs, expected):
    """Abadi et al. 2016 (q=0.01, sigma=4, delta=1e-5): exact values 1.259 / 2.576."""
    acc = MomentsAccountant().compose(dp_sgd_event(4.0, int(epochs / 0.01), sampling_rate=0.01))
    assert acc.get_epsilon(DELTA) == pytest.approx(expected, abs=0.02)
    assert abs(acc.get_epsilon(DELTA) - expected) < 0.002  # our own exactness


@pytest.mark.parametrize(
    "q, sigma", [(0.01, 4.0), (0.01, 1.1), (0.05, 2.0), (0.001, 0.8), (1.0, 3.0)]
)
def test_integration_matches_closed_form(q, sigma):
    a = log_moments(q, sigma, method="integration")
    b = log_moments(q, sigma, method="closed_form")
    np.testing.assert_allclose(a, b, rtol=1e-7)


def test_log_moment_equals_lambda_times_rdp_of_dp_accounting():
    """alpha(lambda) = lambda * RDP(lambda + 1) for the sampled Gaussian."""
    orders = np.arange(1, 33)
    ours = log_moments(0.02, 1.5, orders)
    acc = rdp.RdpAccountant(orders=list(orders + 1.0))
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.5)))
    np.testing.assert_allclose(ours, orders * acc._rdp, rtol=1e-8)


def test_gaussian_without_sampling_closed_form():
    orders = np.arange(1, 33)
    expected = orders * (orders + 1) / (2 * 3.0**2)
    acc = MomentsAccountant().compose(dp_accounting.GaussianDpEvent(3.0))
    np.testing.assert_allclose(acc.log_moments, expected, rtol=1e-9)


def test_composition_is_additive():
    step = dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(2.0))
    one = MomentsAccountant().compose(step).log_moments
    many = MomentsAccountant().compose(step, 250).log_moments
    np.testing.assert_allclose(many, 250 * one, rtol=1e-12)
    mixed = MomentsAccountant().compose(
        dp_accounting.ComposedDpEvent(
            [dp_accounting.SelfComposedDpEvent(step, 100), dp_accounting.GaussianDpEvent(7.0)]
        )
    )
    np.testing.assert_allclose(
        mixed.log_moments,
        100 * one + MomentsAccountant().compose(dp_accounting.GaussianDpEvent(7.0)).log_moments,
    )


def test_tail_bound_forward_and_inverse_agree():
    acc = MomentsAccountant().compose(dp_sgd_event(2.0, 5000, sampling_rate=0.01))
    eps = acc.get_epsilon(DELTA)
    # delta at that eps is at most the target (same tail bound, inverted)
    assert acc.get_delta(eps) <= DELTA * (1 + 1e-9)
    assert acc.get_delta(eps * 0.9) > DELTA
    eps_opt, order = acc.get_epsilon_and_order(DELTA)
    assert eps_opt == eps and 1 <= order <= 32


def test_moments_never_tighter_than_pld_and_never_looser_than_strong():
    event = dp_sgd_event(4.0, 10000, sampling_rate=0.01)
    from dpfl_tf.privacy import compute_epsilon

    m = compute_epsilon(event, DELTA, "moments")
    assert compute_epsilon(event, DELTA, "pld") < m < compute_epsilon(event, DELTA, "strong")


def test_forty_thousand_steps_in_well_under_a_second():
    log_moments.__wrapped__ if hasattr(log_moments, "__wrapped__") else None
    from dpfl_tf.privacy.moments import _log_moment_integrated

    _log_moment_integrated.cache_clear()  # cold: includes the 64 integrations
    start = time.perf_counter()
    eps = (
        MomentsAccountant().compose(dp_sgd_event(4.0, 40000, sampling_rate=0.01)).get_epsilon(DELTA)
    )
    assert time.perf_counter() - start < 1.0
    assert math.isfinite(eps)


def test_zero_noise_is_infinite_and_unsupported_events_are_refused():
    assert (
        MomentsAccountant().compose(dp_sgd_event(0.0, 10, sampling_rate=0.1)).get_epsilon(DELTA)
        == math.inf
    )
    assert (
        MomentsAccountant().compose(dp_accounting.NonPrivateDpEvent()).get_epsilon(DELTA)
        == math.inf
    )
    wor = dp_sgd_event(1.0, 10, "fixed_size", dataset_size=100, lot_size=10)
    assert not MomentsAccountant().supports(wor)
    with pytest.raises(dp_accounting.UnsupportedEventError, match="rdp"):
        MomentsAccountant().compose(wor)


def test_conversion_helpers_validate_inputs():
    with pytest.raises(ValueError, match="delta must be in"):
        epsilon_from_log_moments(np.ones(3), [1, 2, 3], 0.0)
    with pytest.raises(ValueError, match="epsilon must be >= 0"):
        delta_from_log_moments(np.ones(3), [1, 2, 3], -1.0)
    with pytest.raises(ValueError, match="sampling_rate"):
        log_moments(1.5, 1.0)

"""Strong-composition baseline."""

import math

import dp_accounting
import pytest
from scipy import stats

from dpfl_tf.privacy import StrongCompositionAccountant, dp_sgd_event
from dpfl_tf.privacy.strong import gaussian_epsilon


def test_gaussian_epsilon_is_the_exact_gaussian_tradeoff():
    sigma, delta0 = 2.0, 1e-6
    eps = gaussian_epsilon(sigma, delta0)
    d = stats.norm.cdf(1 / (2 * sigma) - eps * sigma) - math.exp(eps) * stats.norm.cdf(
        -1 / (2 * sigma) - eps * sigma
    )
    assert d == pytest.approx(delta0, rel=1e-6)
    # never looser than the textbook bound where that bound is valid (eps < 1)
    assert eps <= math.sqrt(2 * math.log(1.25 / delta0)) / sigma
    assert gaussian_epsilon(0.0, 1e-5) == math.inf


def test_single_unsampled_step_matches_gaussian_and_basic_composition():
    acc = StrongCompositionAccountant().compose(dp_accounting.GaussianDpEvent(3.0))
    # one step: basic composition with (nearly) the whole delta is the better branch
    assert acc.get_epsilon(1e-5) == pytest.approx(gaussian_epsilon(3.0, 1e-5), rel=0.05)
    assert acc.get_epsilon(1e-5) >= gaussian_epsilon(3.0, 1e-5)


def test_paper_setting_is_far_looser_than_moments():
    """Figure 2 setting. Our derivation gives 16.8 / 50.7 (paper plots 9.34 / 24.22)."""
    for epochs, expected in [(100, 16.84), (400, 50.74)]:
        acc = StrongCompositionAccountant().compose(
            dp_sgd_event(4.0, int(epochs / 0.01), sampling_rate=0.01)
        )
        assert acc.get_epsilon(1e-5) == pytest.approx(expected, abs=0.05)


def test_strong_inverse_and_monotonicity():
    acc = StrongCompositionAccountant().compose(dp_sgd_event(4.0, 1000, sampling_rate=0.01))
    eps = acc.get_epsilon(1e-5)
    assert acc.get_delta(eps) == pytest.approx(1e-5, rel=1e-3)
    assert acc.get_epsilon(1e-6) > eps
    acc.compose(dp_sgd_event(4.0, 1000, sampling_rate=0.01))
    assert acc.get_epsilon(1e-5) > eps

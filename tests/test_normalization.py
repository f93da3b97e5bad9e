"""Feature normalisation with statistics released under DP (Tramer & Boneh's
frozen "BN"): the exact baseline, the release's event in the ledger, its
sensitivity (one example moves each sum by at most its bound), its noise
scale, and the frozen Keras layer."""

import dp_accounting
import numpy as np
import pytest
from scipy import stats

from dpfl_tf.data import load_dataset
from dpfl_tf.normalization import DPFeatureNormalization, FeatureNormalization, channel_moments
from dpfl_tf.privacy import PrivacyLedger
from dpfl_tf.scattering import Scattering2D, scattering_orders


@pytest.fixture(scope="module")
def features():
    """Scattering features of 600 real MNIST digits: [600, 7, 7, 81]."""
    digits = load_dataset("mnist").x_test[:600].astype("float32") / 255.0
    return Scattering2D(J=2, L=8, shape=(28, 28)).transform(digits)


def test_exact_statistics_are_the_pooled_channel_mean_and_variance(features):
    norm = FeatureNormalization().fit(features)
    flat = features.reshape(-1, features.shape[-1]).astype(np.float64)
    np.testing.assert_allclose(norm.mean, flat.mean(axis=0), rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(norm.variance, flat.var(axis=0), rtol=1e-6, atol=1e-12)
    out = norm.transform(features).reshape(-1, features.shape[-1])
    live = norm.variance > 1e-3
    np.testing.assert_allclose(out.mean(axis=0)[live], 0.0, atol=1e-4)
    np.testing.assert_allclose(out.std(axis=0)[live], 1.0, atol=1e-2)
    first, second = channel_moments(features, batch_size=7)  # batches do not matter
    np.testing.assert_allclose(first.mean(axis=0), norm.mean, rtol=1e-12)


def test_the_release_is_recorded_as_two_gaussians_of_multiplier_sigma(features):
    ledger = PrivacyLedger("rdp")
    norm = DPFeatureNormalization(
        noise_multiplier=8.0, mean_clip=0.5, second_moment_clip=0.2, seed=1
    ).fit(features, ledger=ledger)
    assert len(ledger) == 1 and ledger.count("dp_feature_norm") == 1
    two = dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(8.0)] * 2)
    reference = dp_accounting.rdp.RdpAccountant()
    reference.compose(two)
    assert ledger.epsilon(1e-5) == pytest.approx(reference.get_epsilon(1e-5), rel=1e-6)
    assert norm.event == dp_accounting.GaussianDpEvent(8.0 / np.sqrt(2))


def test_one_example_moves_each_sum_by_at_most_its_bound(features):
    """Same seed, same noise: the released sums of D and D + {x} differ by x's
    clipped moments, whose norms are the bounds when x is large."""
    clips = dict(mean_clip=0.05, second_moment_clip=0.01)
    outlier = 50.0 * features[:1]
    a = DPFeatureNormalization(seed=3, **clips).fit(features)
    b = DPFeatureNormalization(seed=3, **clips).fit(np.concatenate([features, outlier]))
    n = len(features)
    m2 = lambda f: f.variance + np.square(f.mean)  # noqa: E731 (where var > 0)
    d_mean = b.mean * (n + 1) - a.mean * n
    assert np.linalg.norm(d_mean) == pytest.approx(clips["mean_clip"], rel=1e-6)
    both = (a.variance > 0) & (b.variance > 0)
    d_second = (m2(b) * (n + 1) - m2(a) * n)[both]
    assert np.linalg.norm(d_second) <= clips["second_moment_clip"] * (1 + 1e-6)
    # the outlier is one more clipped example
    assert b.clipped_fraction[0] * (n + 1) == pytest.approx(a.clipped_fraction[0] * n + 1)


def test_noise_has_the_stated_scale(features):
    """mean - exact mean ~ N(0, (sigma C_a / N)^2) per channel, pooled over
    seeds; the test fails for noise off by 20% either way."""
    x = features[:200]
    n, sigma, clip = len(x), 2.0, 10.0  # a bound above every norm: no clipping
    exact = FeatureNormalization().fit(x).mean
    z = np.concatenate(
        [
            (DPFeatureNormalization(sigma, clip, 10.0, seed=s).fit(x).mean - exact)
            / (sigma * clip / n)
            for s in range(40)
        ]
    )
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert 0.97 < z.std() < 1.03
    for wrong in (0.8, 1.2):
        assert stats.kstest(z / wrong, "norm").pvalue < 1e-6


def test_the_keras_layer_standardises_as_transform_does(features):
    norm = DPFeatureNormalization(seed=0, mean_clip=1.0, second_moment_clip=0.05).fit(features)
    assert (norm.variance == 0).any(), "want a channel whose noisy variance was clamped"
    layer = norm.layer()
    out = np.asarray(layer(features[:16]))
    np.testing.assert_allclose(out, norm.transform(features[:16]), rtol=1e-4, atol=1e-4)
    assert np.abs(out[..., norm.variance == 0]).max() < 1e-6
    assert not layer.trainable_weights


@pytest.mark.parametrize("epsilon", [1e-5, 5e-7])
def test_epsilon_is_added_to_the_variance_in_transform_and_layer(features, epsilon):
    norm = FeatureNormalization(epsilon=epsilon).fit(features)
    flat = features.reshape(-1, features.shape[-1]).astype(np.float64)
    live = norm.variance > 0
    expected = (flat[:, live] - flat.mean(axis=0)[live]) / np.sqrt(flat.var(axis=0)[live] + epsilon)
    out = norm.transform(features).reshape(-1, features.shape[-1])
    np.testing.assert_allclose(out[:, live], expected, rtol=1e-3, atol=1e-4)
    layer_out = np.asarray(norm.layer()(features)).reshape(-1, features.shape[-1])
    np.testing.assert_allclose(layer_out[:, live], expected, rtol=1e-3, atol=1e-4)
    # the small channels (MNIST's order 2) are near unit scale only for a small epsilon
    small = live & (norm.variance < 1e-5)
    assert small.any()
    shrink = np.median(out[:, small].std(axis=0))
    assert (shrink < 0.8) if epsilon == 1e-5 else (shrink > 0.8)


def test_bad_arguments_raise_clear_errors(features):
    with pytest.raises(ValueError, match="noise_multiplier"):
        DPFeatureNormalization(noise_multiplier=0.0)
    for bad in (0.0, -1e-5, float("nan")):
        with pytest.raises(ValueError, match="epsilon"):
            DPFeatureNormalization(epsilon=bad)
        with pytest.raises(ValueError, match="epsilon"):
            FeatureNormalization(epsilon=bad)
    with pytest.raises(ValueError, match="mean_clip"):
        DPFeatureNormalization(mean_clip=-1.0)
    with pytest.raises(RuntimeError, match="not fitted"):
        FeatureNormalization().transform(features)
    norm = FeatureNormalization().fit(features)
    with pytest.raises(ValueError, match="channels"):
        norm.transform(features[..., :10])


def test_channel_groups_get_their_own_bounds_and_noise(features):
    """Scattering orders as groups: 2G = 6 sums, each a Gaussian of multiplier
    sigma; one example moves each group's part by at most that group's bound."""
    orders = scattering_orders(2, 8)
    assert orders.tolist()[:18] == [0] + [1] * 16 + [2] and len(orders) == 81
    assert scattering_orders(2, 8, colours=3).tolist()[81:99] == orders.tolist()[:18]
    clips = dict(mean_clip=(0.05, 0.01, 0.002), second_moment_clip=(0.01, 1e-4, 1e-6))
    ledger = PrivacyLedger("rdp")
    a = DPFeatureNormalization(13.0, channel_groups=orders, seed=5, **clips).fit(
        features, ledger=ledger
    )
    assert isinstance(a.event, dp_accounting.GaussianDpEvent)
    assert a.event.noise_multiplier == pytest.approx(13.0 / np.sqrt(6), rel=1e-12)
    assert a.effective_noise_multiplier == pytest.approx(13.0 / np.sqrt(6))
    six = dp_accounting.rdp.RdpAccountant()
    six.compose(dp_accounting.ComposedDpEvent([dp_accounting.GaussianDpEvent(13.0)] * 6))
    assert ledger.epsilon(1e-5) == pytest.approx(six.get_epsilon(1e-5), rel=1e-6)
    b = DPFeatureNormalization(13.0, channel_groups=orders, seed=5, **clips).fit(
        np.concatenate([features, 50.0 * features[:1]])
    )
    n = len(features)
    d_mean = b.mean * (n + 1) - a.mean * n
    for g in range(3):
        assert np.linalg.norm(d_mean[orders == g]) == pytest.approx(clips["mean_clip"][g], rel=1e-4)
    # the noise of each group is at its own scale: order 2's means are within
    # a few sigma C_a^2 / N of the exact ones, far below order 0's noise
    loose = (2.0, 0.5, 0.1)  # above every example's norms: no clipping bias
    c = DPFeatureNormalization(13.0, loose, loose, channel_groups=orders, seed=6).fit(features)
    assert max(c.clipped_fraction) == 0.0
    z = (c.mean - FeatureNormalization().fit(features).mean) * n / 13.0
    assert abs(z[0]) < 5 * loose[0]  # one channel
    for g in (1, 2):  # 16 and 64 channels
        assert 0.6 < np.sqrt(np.mean(z[orders == g] ** 2)) / loose[g] < 1.5
    with pytest.raises(ValueError, match="one bound per channel group"):
        DPFeatureNormalization(mean_clip=(1.0, 1.0), channel_groups=orders)
    with pytest.raises(ValueError, match="group id"):
        DPFeatureNormalization(channel_groups=[0, 2, 2])
    with pytest.raises(ValueError, match="channels"):
        DPFeatureNormalization(channel_groups=orders[:10]).fit(features)

"""DP-PCA: orthonormal output, statistically right noise, event in the ledger."""

import dp_accounting
import numpy as np
import pytest
from scipy import stats

from dpfl_tf.pca import DPPCA, PCAProjection, RandomProjection, normalize_rows
from dpfl_tf.privacy import PrivacyLedger, compute_epsilon
from tests.keras.helpers import mnist_slice


def test_components_are_orthonormal_and_event_is_recorded():
    x, _ = mnist_slice(3000)
    ledger = PrivacyLedger("moments")
    pca = DPPCA(k=20, noise_multiplier=7.0, sample_size=1000, seed=0).fit(x, ledger=ledger)
    v = pca.components
    assert v.shape == (784, 20)
    np.testing.assert_allclose(v.T @ v, np.eye(20), atol=1e-8)
    assert ledger.count("dp_pca") == 1
    assert pca.event == dp_accounting.PoissonSampledDpEvent(
        1000 / 3000, dp_accounting.GaussianDpEvent(7.0)
    )
    assert ledger.epsilon(1e-5) == compute_epsilon(pca.event, 1e-5)
    assert pca.transform(x[:5]).shape == (5, 20)


def test_noise_scale_is_right_and_the_test_can_fail():
    """On an all-zero dataset A^T A = 0, so the noisy covariance is the noise."""
    sigma = 4.0
    samples = []
    for seed in range(300):
        noise, q = DPPCA(k=6, noise_multiplier=sigma, sample_size=50, seed=seed).noisy_covariance(
            np.zeros((50, 6))
        )
        assert q == 1.0
        np.testing.assert_array_equal(noise, noise.T)  # symmetric
        samples.append(noise[np.triu_indices(6)])
    z = np.concatenate(samples) / sigma
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert stats.kstest(z / 1.1, "norm").pvalue < 1e-4  # a 10% wrong scale is rejected


def test_dp_pca_recovers_the_top_subspace_when_noise_is_small():
    x, _ = mnist_slice(5000)
    exact = PCAProjection(k=10).fit(x).components
    noisy = DPPCA(k=10, noise_multiplier=0.5, sample_size=5000, seed=1).fit(x).components
    # principal angles: the subspaces nearly coincide
    overlap = np.linalg.svd(exact.T @ noisy, compute_uv=False)
    assert overlap.min() > 0.9
    very_noisy = DPPCA(k=10, noise_multiplier=500.0, sample_size=5000, seed=1).fit(x).components
    assert np.linalg.svd(exact.T @ very_noisy, compute_uv=False).min() < 0.9


def test_rows_are_normalised_for_the_covariance():
    x = np.array([[3.0, 4.0], [0.0, 0.0]])
    np.testing.assert_allclose(normalize_rows(x), [[0.6, 0.8], [0.0, 0.0]])


def test_baselines_and_bad_inputs():
    x, _ = mnist_slice(500)
    ledger = PrivacyLedger()
    PCAProjection(k=5).fit(x, ledger=ledger)
    assert ledger.epsilon(1e-5) == float("inf")  # non-private PCA is said to be so
    r = RandomProjection(k=5).fit(x).components
    np.testing.assert_allclose(r.T @ r, np.eye(5), atol=1e-8)
    with pytest.raises(ValueError, match="noise_multiplier must be > 0"):
        DPPCA(k=5, noise_multiplier=0.0)
    with pytest.raises(ValueError, match="k must be <= the number of features"):
        DPPCA(k=1000, noise_multiplier=1.0).fit(x)
    with pytest.raises(RuntimeError, match="not fitted"):
        DPPCA(k=5, noise_multiplier=1.0).transform(x)
    with pytest.raises(ValueError, match="empty"):
        DPPCA(k=5, noise_multiplier=1.0).fit(x[:0])

"""Input projections: differentially private PCA and its baselines.

DP-PCA after Abadi et al. 2016 (section 4), i.e. covariance perturbation
("Analyze Gauss", Dwork, Talwar, Thakurta, Zhang 2014):

1. Poisson-sample training examples with rate q_p (sample_size / N; the MNIST
   recipe uses every example, q_p = 1, which is what reproduces the paper's
   accuracies -- a 10,000-example sample costs 1.5-3 points).
2. Normalise each sampled row to unit L2 norm: ||x|| = 1.
3. Form A^T A = sum_i x_i x_i^T and add symmetric Gaussian noise: each entry
   on or above the diagonal gets N(0, sigma_p^2), mirrored below it.
4. Project onto the top-k eigenvectors of the noisy matrix.

Privacy: adding or removing one row changes A^T A by x x^T, whose upper
triangle (with the diagonal) has L2 norm at most ||x x^T||_F = ||x||^2 = 1.
The released upper triangle is a Gaussian mechanism with noise multiplier
sigma_p, sampled with rate q_p:

    PoissonSampledDpEvent(q_p, GaussianDpEvent(sigma_p))

recorded once in the same `PrivacyLedger` as the DP-SGD lots, so the reported
epsilon covers both.
"""

from __future__ import annotations

import dataclasses

import dp_accounting
import numpy as np

from dpfl_tf._validation import check_count, check_number
from dpfl_tf.privacy.ledger import PrivacyLedger

__all__ = ["DPPCA", "PCAProjection", "RandomProjection", "normalize_rows"]


def normalize_rows(x: np.ndarray) -> np.ndarray:
    """Each row divided by its L2 norm (all-zero rows stay zero)."""
    x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


class _Projection:
    components: np.ndarray  # [d, k], orthonormal columns

    def transform(self, x) -> np.ndarray:
        """Projects x (flattened) onto the components.  Rows are projected as
        they are (not normalised): normalising is only needed for the privacy
        of the covariance, and keeping the scale of the inputs keeps per-example
        gradients large next to the DP-SGD noise."""
        if getattr(self, "components", None) is None:
            raise RuntimeError(f"{type(self).__name__} is not fitted; call fit() first")
        flat = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
        if flat.shape[1] != self.components.shape[0]:
            raise ValueError(
                f"x has {flat.shape[1]} features, the projection expects {self.components.shape[0]}"
            )
        return (flat @ self.components).astype(np.float32)

    def fit_transform(self, x, *args, **kwargs) -> np.ndarray:
        return self.fit(x, *args, **kwargs).transform(x)


def _top_eigenvectors(matrix: np.ndarray, k: int) -> np.ndarray:
    values, vectors = np.linalg.eigh(matrix)  # ascending
    order = np.argsort(values)[::-1][:k]
    return vectors[:, order]


@dataclasses.dataclass
class DPPCA(_Projection):
    """Differentially private PCA to `k` dimensions (see module docstring).

    Args:
      k: output dimension.
      noise_multiplier: sigma_p (> 0).
      sample_size: expected number of examples sampled (Poisson rate
        q_p = sample_size / N).
      seed: seeds sampling and noise (tests only; default OS entropy).
    """

    k: int = 60
    noise_multiplier: float = 7.0
    sample_size: int = 10000
    seed: int | None = None

    def __post_init__(self):
        self.k = check_count("k", self.k, minimum=1)
        self.noise_multiplier = check_number(
            "noise_multiplier", self.noise_multiplier, low=0.0, low_open=True
        )
        self.sample_size = check_count("sample_size", self.sample_size, minimum=1)
        self.components = None
        self.event = None

    def noisy_covariance(self, x) -> tuple[np.ndarray, float]:
        """(A^T A + symmetric noise, sampling rate q_p) for private data x."""
        n = len(x)
        if n == 0:
            raise ValueError("x is empty")
        d = int(np.prod(np.shape(x)[1:]))
        if self.k > d:
            raise ValueError(f"k must be <= the number of features ({d}), got {self.k}")
        q = min(1.0, self.sample_size / n)
        rng = np.random.default_rng(self.seed)
        sample = normalize_rows(np.asarray(x)[rng.random(n) < q])
        upper = np.triu(rng.normal(0.0, self.noise_multiplier, size=(d, d)))
        noise = upper + np.triu(upper, 1).T  # symmetric, N(0, sigma_p^2) per upper entry
        return sample.T @ sample + noise, q

    def planned_event(self, num_examples: int) -> dp_accounting.DpEvent:
        """The event `fit` records for `num_examples` private rows, known before
        any data is read: the Gaussian mechanism on rows sampled with rate
        q_p = min(1, sample_size / N)."""
        n = check_count("num_examples", num_examples, minimum=1)
        return dp_accounting.PoissonSampledDpEvent(
            min(1.0, self.sample_size / n), dp_accounting.GaussianDpEvent(self.noise_multiplier)
        )

    def fit(self, x, ledger: PrivacyLedger | None = None) -> "DPPCA":
        """Fits on private data `x` ([N, ...]) and records the event in `ledger`."""
        noisy, q = self.noisy_covariance(x)
        self.components = _top_eigenvectors(noisy, self.k)
        self.event = self.planned_event(len(x))
        if ledger is not None:
            ledger.record(self.event, label="dp_pca")
        return self


@dataclasses.dataclass
class PCAProjection(_Projection):
    """Non-private PCA (top-k eigenvectors of A^T A of unit-normalised rows)."""

    k: int = 60

    def fit(self, x, ledger: PrivacyLedger | None = None) -> "PCAProjection":
        if ledger is not None:
            ledger.record(dp_accounting.NonPrivateDpEvent(), label="pca")
        flat = normalize_rows(x)
        self.components = _top_eigenvectors(flat.T @ flat, check_count("k", self.k, minimum=1))
        return self


@dataclasses.dataclass
class RandomProjection(_Projection):
    """A data-independent random orthonormal projection (costs no privacy)."""

    k: int = 60
    seed: int | None = 0

    def fit(self, x, ledger: PrivacyLedger | None = None) -> "RandomProjection":
        d = int(np.prod(np.shape(x)[1:]))
        gaussian = np.random.default_rng(self.seed).normal(
            size=(d, check_count("k", self.k, minimum=1))
        )
        self.components, _ = np.linalg.qr(gaussian)
        return self

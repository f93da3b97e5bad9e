"""Input normalisation with dataset statistics, released under DP.

Tramer & Boneh 2021 ("Differentially private learning needs better features",
section 3 and their code's frozen "BN") normalise ScatterNet features per
channel with the training set's mean and variance, estimated privately and
paid for in the same budget as DP-SGD.  For features x_i of shape [..., K]
(channels last), per example i:

    a_i = mean over positions of x_i          (K values: the channel means)
    b_i = mean over positions of x_i^2        (K values: the channel second moments)

each clipped to an L2 bound (C_a, C_b): a_i <- a_i min(1, C_a / ||a_i||), and
likewise b_i.  The release is the two noised sums

    mu = (sum_i a_i + N(0, sigma^2 C_a^2 I)) / N
    m2 = (sum_i b_i + N(0, sigma^2 C_b^2 I)) / N,      var = max(m2 - mu^2, 0),

N, the dataset size, being public as everywhere in the library (the lot size
of DP-SGD is q N).  Adding or removing one example moves each sum by at most
its bound, so the release is two Gaussian mechanisms of multiplier sigma,
i.e. one of multiplier sigma / sqrt(2) on the joint record; every example is
used (no sampling):

    GaussianDpEvent(sigma / sqrt(2))   (= ComposedDpEvent of two GaussianDpEvent(sigma))

recorded in the same `PrivacyLedger` as the DP-SGD lots.  The noising is
`GaussianSanitizer`'s, with per-component bounds (C_a, C_b) and proportional
noise.  The features are then standardised, (x - mu) / sqrt(var + 1e-5), and a
channel whose noisy variance is 0 is set to 0 (its scale is unknown), as
Tramer & Boneh do.

The clip bounds are fixed numbers (hyperparameters, like DP-SGD's clip).
Tramer & Boneh set them to the median norm of the private data, a data-dependent
choice their accounting leaves out; here they are never read off the data.
`FeatureNormalization` is the non-private baseline (exact statistics).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dpfl_tf._validation import check_count, check_number
from dpfl_tf.privacy.ledger import PrivacyLedger

__all__ = ["DPFeatureNormalization", "FeatureNormalization", "channel_moments"]

#: added to the variance before the square root (Tramer & Boneh's value)
EPSILON = 1e-5


def channel_moments(x, batch_size: int = 4096):
    """Per example, the mean over positions of x and of x^2: two float64 [N, K]
    arrays for x of shape [N, ..., K] (read in batches, so x may be a memmap)."""
    n = len(x)
    k = int(np.shape(x)[-1])
    first = np.empty((n, k))
    second = np.empty((n, k))
    for i in range(0, n, batch_size):
        part = np.asarray(x[i:i + batch_size], dtype=np.float64)
        part = part.reshape(len(part), -1, k)
        first[i:i + batch_size] = part.mean(axis=1)
        second[i:i + batch_size] = np.square(part).mean(axis=1)
    return first, second


class _Standardise:
    mean: np.ndarray | None = None
    variance: np.ndarray | None = None

    def _check_fitted(self):
        if self.mean is None:
            raise RuntimeError(f"{type(self).__name__} is not fitted; call fit() first")

    def transform(self, x) -> np.ndarray:
        """(x - mean) / sqrt(var + 1e-5) per channel, 0 where var = 0; float32."""
        self._check_fitted()
        x = np.asarray(x, dtype=np.float32)
        if x.shape[-1] != len(self.mean):
            raise ValueError(f"x has {x.shape[-1]} channels, the statistics have "
                             f"{len(self.mean)}")
        scale = np.where(self.variance > 0, 1.0 / np.sqrt(self.variance + EPSILON), 0.0)
        return ((x - self.mean.astype(np.float32)) * scale.astype(np.float32)).astype(np.float32)

    def fit_transform(self, x, *args, **kwargs) -> np.ndarray:
        return self.fit(x, *args, **kwargs).transform(x)

    def layer(self, name: str = "feature_norm"):
        """The same standardisation as a frozen Keras layer (no trainable weights,
        so it costs DP-SGD nothing): `keras.layers.Normalization` with this mean
        and variance + 1e-5; a channel of variance 0 gets variance 1e30, which
        sends it to 0 as `transform` does."""
        import keras

        self._check_fitted()
        variance = np.where(self.variance > 0, self.variance + EPSILON, 1e30)
        return keras.layers.Normalization(axis=-1, mean=self.mean.astype(np.float32),
                                          variance=variance.astype(np.float32), name=name)

    def state(self) -> dict:
        self._check_fitted()
        return {"mean": self.mean, "variance": self.variance}


@dataclasses.dataclass
class DPFeatureNormalization(_Standardise):
    """Per-channel mean and variance released under DP (module docstring).

    Args:
      noise_multiplier: sigma (> 0) of each of the two sums (Tramer & Boneh: 8).
      mean_clip: C_a, the L2 bound on each example's channel means.
      second_moment_clip: C_b, the L2 bound on each example's channel second
        moments.
      seed: seeds the noise (tests only; default OS entropy).
    """

    noise_multiplier: float = 8.0
    mean_clip: float = 1.0
    second_moment_clip: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        self.noise_multiplier = check_number("noise_multiplier", self.noise_multiplier,
                                             low=0.0, low_open=True)
        self.mean_clip = check_number("mean_clip", self.mean_clip, low=0.0, low_open=True)
        self.second_moment_clip = check_number("second_moment_clip", self.second_moment_clip,
                                               low=0.0, low_open=True)
        self.mean = self.variance = self.event = None
        self.clipped_fraction = None

    def sanitizer(self):
        from dpfl_tf.sanitizer import GaussianSanitizer

        return GaussianSanitizer([self.mean_clip, self.second_moment_clip],
                                 self.noise_multiplier, noise_allocation="proportional",
                                 seed=self.seed)

    def fit(self, x, ledger: PrivacyLedger | None = None) -> "DPFeatureNormalization":
        """Releases the statistics of private features `x` ([N, ..., K]) and
        records the event in `ledger`."""
        import tensorflow as tf

        n = check_count("len(x)", len(x), minimum=1)
        first, second = channel_moments(x)
        sanitizer = self.sanitizer()
        sums = sanitizer.clip_and_sum([tf.constant(first), tf.constant(second)])
        noisy = [t.numpy() / n for t in sanitizer.add_noise(sums)]
        self.mean = noisy[0]
        self.variance = np.maximum(noisy[1] - np.square(self.mean), 0.0)
        # how often the bounds bit (a non-private diagnostic, like dropped_examples)
        self.clipped_fraction = (
            float(np.mean(np.linalg.norm(first, axis=1) > self.mean_clip)),
            float(np.mean(np.linalg.norm(second, axis=1) > self.second_moment_clip)))
        self.event = sanitizer.event(2, "full_batch")
        if ledger is not None:
            ledger.record(self.event, label="dp_feature_norm")
        return self


@dataclasses.dataclass
class FeatureNormalization(_Standardise):
    """Non-private baseline: the exact per-channel mean and variance."""

    def fit(self, x, ledger: PrivacyLedger | None = None) -> "FeatureNormalization":
        import dp_accounting

        if ledger is not None:
            ledger.record(dp_accounting.NonPrivateDpEvent(), label="feature_norm")
        first, second = channel_moments(x)
        self.mean = first.mean(axis=0)
        self.variance = np.maximum(second.mean(axis=0) - np.square(self.mean), 0.0)
        return self

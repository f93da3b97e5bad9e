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
noise.  The features are then standardised, (x - mu) / sqrt(var + epsilon), and
a channel whose noisy variance is 0 is set to 0 (its scale is unknown), as
Tramer & Boneh do.  epsilon is in the features' squared units: Tramer & Boneh's
1e-5 is on features of ImageNet-standardised pixels (about 4.4 times those of
pixels in [0, 1]), i.e. about 5e-7 on features of [0, 1] pixels, where 1e-5
would shrink the ScatterNet's order-2 channels (variances ~1e-6) to a third of
unit scale.

Channel groups (an extension): with ``channel_groups`` (a group id per
channel, e.g. the scattering order, `dpfl_tf.scattering.scattering_orders`)
each group g gets its own bounds (C_a^g, C_b^g) and its own noise sigma C^g on
its part of the two sums: 2G Gaussian releases of multiplier sigma, jointly
one of multiplier sigma / sqrt(2G).  Channels whose scales differ by orders of
magnitude (ScatterNet: order-0 means ~0.5, order-2 second moments ~1e-5) then
each get noise at their own scale instead of the largest group's.

The clip bounds are fixed numbers (hyperparameters, like DP-SGD's clip): this
module never reads them off the data.  Tramer & Boneh set them at run time to
the median norm of the private data, a data-dependent choice their accounting
leaves out.  Fixed defaults chosen by looking at a dataset are the same kind
of choice, made once (the CIFAR-10 recipe's are, see `MnistConfig`).
`FeatureNormalization` is the non-private baseline (exact statistics).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dpfl_tf._validation import check_count, check_number
from dpfl_tf.privacy.ledger import PrivacyLedger

__all__ = ["DPFeatureNormalization", "FeatureNormalization", "channel_moments"]

#: added to the variance before the square root (Tramer & Boneh's value, in the
#: squared units of their features: see the module docstring)
EPSILON = 1e-5


def channel_moments(x, batch_size: int = 4096):
    """Per example, the mean over positions of x and of x^2: two float64 [N, K]
    arrays for x of shape [N, ..., K] (read in batches of at most `batch_size`
    examples and ~64 MB of float64, so x may be a file read by rows)."""
    n = len(x)
    k = int(np.shape(x)[-1])
    batch_size = max(1, min(batch_size, 2**23 // max(1, int(np.prod(np.shape(x)[1:])))))
    first = np.empty((n, k))
    second = np.empty((n, k))
    for i in range(0, n, batch_size):
        part = np.asarray(x[i : i + batch_size], dtype=np.float64)
        part = part.reshape(len(part), -1, k)
        first[i : i + batch_size] = part.mean(axis=1)
        second[i : i + batch_size] = np.square(part).mean(axis=1)
    return first, second


class _Standardise:
    mean: np.ndarray | None = None
    variance: np.ndarray | None = None
    epsilon: float = EPSILON

    def _check_fitted(self):
        if self.mean is None:
            raise RuntimeError(f"{type(self).__name__} is not fitted; call fit() first")

    def transform(self, x) -> np.ndarray:
        """(x - mean) / sqrt(var + epsilon) per channel, 0 where var = 0; float32."""
        self._check_fitted()
        x = np.asarray(x, dtype=np.float32)
        if x.shape[-1] != len(self.mean):
            raise ValueError(f"x has {x.shape[-1]} channels, the statistics have {len(self.mean)}")
        scale = np.where(self.variance > 0, 1.0 / np.sqrt(self.variance + self.epsilon), 0.0)
        return ((x - self.mean.astype(np.float32)) * scale.astype(np.float32)).astype(np.float32)

    def fit_transform(self, x, *args, **kwargs) -> np.ndarray:
        return self.fit(x, *args, **kwargs).transform(x)

    def layer(self, name: str = "feature_norm"):
        """The same standardisation as a frozen Keras layer (no trainable weights,
        so it costs DP-SGD nothing): `keras.layers.Normalization` with this mean
        and variance + epsilon; a channel of variance 0 gets variance 1e30, which
        sends it to 0 as `transform` does."""
        import keras

        self._check_fitted()
        variance = np.where(self.variance > 0, self.variance + self.epsilon, 1e30)
        return keras.layers.Normalization(
            axis=-1,
            mean=self.mean.astype(np.float32),
            variance=variance.astype(np.float32),
            name=name,
        )

    def state(self) -> dict:
        self._check_fitted()
        return {"mean": self.mean, "variance": self.variance}


@dataclasses.dataclass
class DPFeatureNormalization(_Standardise):
    """Per-channel mean and variance released under DP (module docstring).

    Args:
      noise_multiplier: sigma (> 0) of each noised sum (Tramer & Boneh: 8, for
        their two sums).  The release as a whole has multiplier
        sigma / sqrt(2 G) (`effective_noise_multiplier`).
      mean_clip: C_a, the L2 bound on each example's channel means (one float,
        or one per channel group).
      second_moment_clip: C_b, the same for the channel second moments.
      channel_groups: optional group id (0 .. G-1) of every channel; None is
        one group.
      seed: seeds the noise (tests only; default OS entropy).
      epsilon: added to the variance before the square root (> 0), in the
        features' squared units.
    """

    noise_multiplier: float = 8.0
    mean_clip: float | tuple = 1.0
    second_moment_clip: float | tuple = 1.0
    channel_groups: tuple | None = None
    seed: int | None = None
    epsilon: float = EPSILON

    def __post_init__(self):
        self.noise_multiplier = check_number(
            "noise_multiplier", self.noise_multiplier, low=0.0, low_open=True
        )
        self.epsilon = check_number("epsilon", self.epsilon, low=0.0, low_open=True)
        if self.channel_groups is not None:
            groups = np.asarray(self.channel_groups)
            if (
                groups.ndim != 1
                or not np.issubdtype(groups.dtype, np.integer)
                or groups.min() < 0
                or set(np.unique(groups)) != set(range(groups.max() + 1))
            ):
                raise ValueError(
                    "channel_groups must give every channel a group id 0 .. G-1, "
                    f"each used, got {self.channel_groups!r}"
                )
            self.channel_groups = tuple(int(g) for g in groups)
        self.mean_clip = self._bounds("mean_clip", self.mean_clip, self.groups)
        self.second_moment_clip = self._bounds(
            "second_moment_clip", self.second_moment_clip, self.groups
        )
        self.mean = self.variance = self.event = None
        self.clipped_fraction = None

    @staticmethod
    def _bounds(name, value, count):
        values = value if isinstance(value, (list, tuple)) else (value,) * count
        if len(values) != count:
            raise ValueError(
                f"{name} needs one bound per channel group ({count}), got {len(values)}"
            )
        out = tuple(
            check_number(f"{name}[{i}]", v, low=0.0, low_open=True) for i, v in enumerate(values)
        )
        return out[0] if not isinstance(value, (list, tuple)) else out

    def _group_masks(self, k: int) -> list[np.ndarray]:
        if self.channel_groups is None:
            return [np.ones(k, bool)]
        if len(self.channel_groups) != k:
            raise ValueError(
                f"channel_groups has {len(self.channel_groups)} entries but the "
                f"features have {k} channels"
            )
        groups = np.asarray(self.channel_groups)
        return [groups == g for g in range(groups.max() + 1)]

    def _clips(self, name: str, count: int) -> tuple:
        value = getattr(self, name)
        return value if isinstance(value, tuple) else (value,) * count

    @property
    def groups(self) -> int:
        """G, the number of channel groups."""
        return 1 if self.channel_groups is None else max(self.channel_groups) + 1

    @property
    def effective_noise_multiplier(self) -> float:
        """sigma / sqrt(2 G): the multiplier of the release as one Gaussian."""
        return self.noise_multiplier / np.sqrt(2 * self.groups)

    def planned_event(self):
        """The event `fit` records, known before any data is read."""
        return self.sanitizer(self.groups).event(2 * self.groups, "full_batch")

    def sanitizer(self, groups: int = 1):
        from dpfl_tf.sanitizer import GaussianSanitizer

        clips = self._clips("mean_clip", groups) + self._clips("second_moment_clip", groups)
        return GaussianSanitizer(
            list(clips), self.noise_multiplier, noise_allocation="proportional", seed=self.seed
        )

    def fit(self, x, ledger: PrivacyLedger | None = None) -> "DPFeatureNormalization":
        """Releases the statistics of private features `x` ([N, ..., K]) and
        records the event in `ledger`."""
        import tensorflow as tf

        n = check_count("len(x)", len(x), minimum=1)
        first, second = channel_moments(x)
        masks = self._group_masks(first.shape[1])
        records = [first[:, m] for m in masks] + [second[:, m] for m in masks]
        sanitizer = self.sanitizer(len(masks))
        sums = sanitizer.clip_and_sum([tf.constant(r) for r in records])
        noisy = [t.numpy() / n for t in sanitizer.add_noise(sums)]
        self.mean = np.empty(first.shape[1])
        square = np.empty(first.shape[1])
        for g, m in enumerate(masks):
            self.mean[m], square[m] = noisy[g], noisy[len(masks) + g]
        self.variance = np.maximum(square - np.square(self.mean), 0.0)
        # how often the bounds bit, per sum (a non-private diagnostic, like
        # dropped_examples)
        bounds = sanitizer.clip_bounds(len(records))
        self.clipped_fraction = tuple(
            float(np.mean(np.linalg.norm(r, axis=1) > c)) for r, c in zip(records, bounds)
        )
        self.event = self.planned_event()
        if ledger is not None:
            ledger.record(self.event, label="dp_feature_norm")
        return self


@dataclasses.dataclass
class FeatureNormalization(_Standardise):
    """Non-private baseline: the exact per-channel mean and variance
    (standardised with `epsilon` added to the variance, as the DP release)."""

    epsilon: float = EPSILON

    def __post_init__(self):
        self.epsilon = check_number("epsilon", self.epsilon, low=0.0, low_open=True)

    def fit(self, x, ledger: PrivacyLedger | None = None) -> "FeatureNormalization":
        import dp_accounting

        if ledger is not None:
            ledger.record(dp_accounting.NonPrivateDpEvent(), label="feature_norm")
        first, second = channel_moments(x)
        self.mean = first.mean(axis=0)
        self.variance = np.maximum(second.mean(axis=0) - np.square(self.mean), 0.0)
        return self

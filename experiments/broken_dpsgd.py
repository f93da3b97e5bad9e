"""Deliberately BROKEN copies of DP-SGD, for the canary audit to catch.

Never import these outside tests and experiments: they are not part of the
library and are not reachable from `dpfl_tf`.  Each is a `DPModel` subclass
that changes one small piece after the library has fixed the fit's settings
(`_prepare`), so the privacy *claim* (the ledger's event, computed from the
honest sanitizer) stays what the library would say, while the mechanism leaks
more:

* ``half_noise``: the lot's noise is multiplied by 1/2 (sigma/2 used, sigma claimed).
* ``skip_clipping``: per-example gradients are not clipped (every clip factor 1);
  a canary whose gradient has norm ~10 C enters the sum at full size.
* ``per_batch_noise``: noise is added to each physical batch's clipped sum with
  standard deviation sigma C / k, k = ceil(L / B) batches per lot ("divided by
  the lot"), instead of N(0, sigma^2 C^2) once per lot: the lot's total noise
  has std sigma C / sqrt(k).
* ``reused_noise``: the noise is drawn once and the same draw is added to every
  lot (stream position 0 for every lot).

Client level (Global DP, `dpfl_tf.federated`): ``SkipClippingGlobalDP`` is a
`GlobalDPAggregator` whose sanitizer never clips the client updates (the round's
event, from the honest noise multiplier, is unchanged).
"""

from __future__ import annotations

import math

import tensorflow as tf

from dpfl_tf.federated.aggregators import GlobalDPAggregator
from dpfl_tf.keras import DPModel
from dpfl_tf.sanitizer import GaussianSanitizer

__all__ = [
    "BROKEN_VARIANTS",
    "HalfNoiseDPModel",
    "SkipClippingDPModel",
    "PerBatchNoiseDPModel",
    "ReusedNoiseDPModel",
    "SkipClippingGlobalDP",
]


class _HalfNoiseSanitizer(GaussianSanitizer):
    def add_noise(self, summed, groups=None, *, step=None):
        noised = super().add_noise(summed, groups, step=step)
        return [s + 0.5 * (n - s) for s, n in zip(summed, noised)]


class _NoClipSanitizer(GaussianSanitizer):
    def clip_factors(self, squared_norms):
        return [tf.ones_like(tf.convert_to_tensor(s)) for s in squared_norms]


class _ReusedNoiseSanitizer(GaussianSanitizer):
    def add_noise(self, summed, groups=None, *, step=None):
        return super().add_noise(summed, groups, step=tf.constant(0, tf.int64))


class _NoNoiseSanitizer(GaussianSanitizer):
    def add_noise(self, summed, groups=None, *, step=None):
        return list(summed)


def _swap(sanitizer: GaussianSanitizer, cls) -> GaussianSanitizer:
    return cls.from_config(sanitizer.get_config())


class _Broken(DPModel):
    sanitizer_class = None

    def _prepare(self, sampler, batch_size, **kwargs):
        super()._prepare(sampler, batch_size, **kwargs)  # the claim (event) is the honest one
        if self.sanitizer_class is not None:
            self._sanitizer = _swap(self._sanitizer, self.sanitizer_class)


class HalfNoiseDPModel(_Broken):
    sanitizer_class = _HalfNoiseSanitizer


class SkipClippingDPModel(_Broken):
    sanitizer_class = _NoClipSanitizer


class ReusedNoiseDPModel(_Broken):
    sanitizer_class = _ReusedNoiseSanitizer


class _PerBatchNoise:
    """Wraps PerExampleGradients: each physical batch's clipped sum gets
    N(0, (sigma C / k)^2) noise."""

    def __init__(self, inner, stddev: float):
        self.inner = inner
        self.stddev = stddev

    def clipped(self, x, y, weights, clip_factors_fn, training=True):
        batch = self.inner.clipped(x, y, weights, clip_factors_fn, training)
        return batch._replace(
            sums=[
                s + self.stddev * tf.random.normal(tf.shape(s), dtype=s.dtype) for s in batch.sums
            ]
        )


class PerBatchNoiseDPModel(DPModel):
    def _prepare(self, sampler, batch_size, **kwargs):
        super()._prepare(sampler, batch_size, **kwargs)
        honest = self._sanitizer
        k = max(1, math.ceil(sampler.lot_size / batch_size))
        std = honest.noise_multiplier * honest.total_clip(max(self._groups) + 1) / k
        self._per_example = _PerBatchNoise(self._per_example, std)
        self._sanitizer = _swap(honest, _NoNoiseSanitizer)
        self.batches_per_lot = k


BROKEN_VARIANTS = {
    "half_noise": HalfNoiseDPModel,
    "skip_clipping": SkipClippingDPModel,
    "per_batch_noise": PerBatchNoiseDPModel,
    "reused_noise": ReusedNoiseDPModel,
}


class SkipClippingGlobalDP(GlobalDPAggregator):
    """Global DP that forgets to clip the client updates (fixed clip only)."""

    def __init__(self, sanitizer: GaussianSanitizer, **kwargs):
        super().__init__(_swap(sanitizer, _NoClipSanitizer), **kwargs)

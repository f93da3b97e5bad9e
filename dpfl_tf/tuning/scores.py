"""Scores a private search selects on: computed on held-out data, released with noise.

A trial's score is part of what the search's privacy analysis covers (one run
of Papernot & Steinke's mechanism Q is the training *and* the score), so it is
released by a DP mechanism with its own `DpEvent`:

    score = (sum_{i in V} m_i + N(0, sigma^2)) / |V|,   m_i = metric(x_i, y_i) clipped to [0, 1],

over a held-out validation set V of the private data (e.g. m_i = 1 if the
model's top-1 prediction for example i is right: accuracy).  Adding or removing
one validation example moves the sum by at most 1 and replacing one by at most
1, so the release is the Gaussian mechanism with multiplier sigma under either
relation: ``GaussianDpEvent(sigma)`` (add/remove-one) or
``ReplaceOneGaussianDpEvent(sigma)`` (replace-one, for a search whose training
is stated under replace-one).  |V| is treated as public, like the dataset
size N that sets DP-SGD's sampling rate.  The validation examples are part of
the private data: their contribution is composed with training's
(conservative: a record in V is not in the training set).

``noise_multiplier=0`` is the usual, non-private score (``NonPrivateDpEvent``:
a search selecting on it has no finite epsilon); ``public=True`` states that V
is public data (``NoOpDpEvent``, no cost): only true if V holds no private
record.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from dp_accounting import dp_event as _dp_event

from dpfl_tf._validation import check_count, check_number
from dpfl_tf.privacy.events import NeighboringRelation, ReplaceOneGaussianDpEvent

__all__ = ["ValidationScore", "top1_correct"]


def top1_correct(y_true: np.ndarray, y_pred: np.ndarray) -> np.ndarray:
    """1.0 where the arg-max of the model's output is the label, else 0.0
    (labels as integers [n] / [n, 1], or one-hot [n, classes])."""
    y_pred = np.asarray(y_pred)
    if y_pred.ndim != 2 or y_pred.shape[1] < 2:
        raise ValueError(
            f"top-1 accuracy needs outputs of shape [n, classes >= 2], got "
            f"{y_pred.shape}; pass metric=a function (y_true, y_pred) -> "
            "per-example values in [0, 1]"
        )
    y_true = np.asarray(y_true)
    if y_true.ndim == 2 and y_true.shape[1] == y_pred.shape[1] and y_true.shape[1] > 1:
        y_true = y_true.argmax(axis=1)
    return (y_pred.argmax(axis=1) == y_true.reshape(-1)).astype(np.float64)


class ValidationScore:
    """A trial's score: a metric's mean over validation data, released with
    Gaussian noise (module docstring).

    Args:
      x, y: the validation examples (arrays; part of the private data unless
        `public`).
      noise_multiplier: sigma, noise std / sensitivity 1 of the metric's sum
        (> 0: private; 0: the plain, non-private score).
      metric: "accuracy" (top-1) or a function (y_true, y_pred) -> per-example
        values, clipped to [0, 1].
      public: the validation data is public (no privacy cost; noise_multiplier
        must then be 0).
      seed: seeds the noise (tests only); default OS entropy.
      batch_size: prediction batch size.
    """

    def __init__(
        self,
        x,
        y,
        *,
        noise_multiplier: float,
        metric: str | Callable = "accuracy",
        public: bool = False,
        seed: int | None = None,
        batch_size: int = 1024,
    ):
        self.x, self.y = x, np.asarray(y)
        self.size = check_count("len(y)", len(self.y), minimum=1)
        self.noise_multiplier = check_number("noise_multiplier", noise_multiplier, low=0.0)
        if metric == "accuracy":
            metric = top1_correct
        if not callable(metric):
            raise ValueError(
                f"metric must be 'accuracy' or a function (y_true, y_pred) -> "
                f"per-example values, got {metric!r}"
            )
        self.metric = metric
        self.public = bool(public)
        if self.public and self.noise_multiplier:
            raise ValueError(
                f"public=True needs noise_multiplier=0 (public data costs "
                f"nothing), got {noise_multiplier!r}"
            )
        self._rng = np.random.default_rng(seed)
        self.batch_size = check_count("batch_size", batch_size, minimum=1)

    @property
    def private(self) -> bool:
        """True if the score is a DP release or reads only public data."""
        return self.public or self.noise_multiplier > 0

    def event(
        self, relation: NeighboringRelation = NeighboringRelation.ADD_OR_REMOVE_ONE
    ) -> _dp_event.DpEvent:
        """The score's release under `relation` (module docstring)."""
        if self.public:
            return _dp_event.NoOpDpEvent()
        if self.noise_multiplier == 0:
            return _dp_event.NonPrivateDpEvent()
        if relation is NeighboringRelation.REPLACE_ONE:
            return ReplaceOneGaussianDpEvent(self.noise_multiplier)
        return _dp_event.GaussianDpEvent(self.noise_multiplier)

    def __call__(self, model) -> float:
        """The noised mean metric of `model` (its ``predict``) on the validation set."""
        y_pred = model.predict(self.x, batch_size=self.batch_size, verbose=0)
        values = np.asarray(self.metric(self.y, y_pred), dtype=np.float64).reshape(-1)
        if values.shape != (self.size,):
            raise ValueError(
                f"metric returned {values.shape[0]} values for {self.size} "
                "validation examples: it must return one per example"
            )
        total = float(np.clip(np.nan_to_num(values, nan=0.0), 0.0, 1.0).sum())
        if self.noise_multiplier > 0:
            total += float(self._rng.normal(0.0, self.noise_multiplier))
        return total / self.size

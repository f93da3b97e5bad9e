"""Shared event traversal for the accountants written here (moments, strong,
and the cached RDP accountant of `dpfl_tf.privacy.accountants`).

`walk_composition` unfolds compositions into (leaf event, count) pairs.  The
moments and strong accountants interpret the same family of leaf events -- Gaussian, Poisson-sampled
Gaussian, their self-compositions and compositions, no-ops and non-private
events -- and differ only in what one (q, sigma) step costs.
"""

from __future__ import annotations

import abc
from typing import Callable, Optional

import dp_accounting
from dp_accounting import dp_event as _dp_event


def walk_composition(
    event: dp_accounting.DpEvent,
    count: int,
    leaf: Callable[[dp_accounting.DpEvent, int], Optional[object]],
) -> Optional[object]:
    """Calls ``leaf(e, n)`` for every non-composite event e of `event`, n being
    `count` times the product of the self-composition counts above it; returns
    the first non-None result of `leaf` (an error), else None."""
    if isinstance(event, _dp_event.SelfComposedDpEvent):
        return walk_composition(event.event, event.count * count, leaf)
    if isinstance(event, _dp_event.ComposedDpEvent):
        for e in event.events:
            err = walk_composition(e, count, leaf)
            if err is not None:
                return err
        return None
    return leaf(event, count)


class SampledGaussianAccountant(dp_accounting.PrivacyAccountant, abc.ABC):
    """Walks an event tree and hands each (q, sigma, count) to `_compose_gaussian`."""

    unsupported_message = "handles (Poisson-sampled) Gaussian events only"

    def __init__(self, neighboring_relation):
        super().__init__(neighboring_relation)
        self._non_private = False

    @abc.abstractmethod
    def _compose_gaussian(self, q: float, sigma: float, count: int) -> None:
        """Adds `count` steps of the sampled Gaussian (rate q, multiplier sigma)."""

    def _maybe_compose(
        self, event, count: int, do_compose: bool
    ) -> Optional[dp_accounting.PrivacyAccountant.CompositionErrorDetails]:
        return walk_composition(event, count, lambda e, n: self._compose_leaf(e, n, do_compose))

    def _compose_leaf(
        self, event, count: int, do_compose: bool
    ) -> Optional[dp_accounting.PrivacyAccountant.CompositionErrorDetails]:
        if isinstance(event, _dp_event.NoOpDpEvent):
            return None
        if isinstance(event, _dp_event.NonPrivateDpEvent):
            if do_compose:
                self._non_private = True
            return None
        q, inner = 1.0, event
        if isinstance(event, _dp_event.PoissonSampledDpEvent):
            q, inner = event.sampling_probability, event.event
        if isinstance(inner, _dp_event.GaussianDpEvent):
            if do_compose and count > 0 and q > 0:
                self._compose_gaussian(float(q), float(inner.noise_multiplier), count)
            return None
        return self.CompositionErrorDetails(
            invalid_event=event, error_message=self.unsupported_message
        )

"""Calibration: the smallest noise multiplier for a target epsilon, and the
number of steps a budget allows.

Both search monotone functions (epsilon grows with steps and shrinks with
noise) and return the side of the bracket that never exceeds the target.
"""

from __future__ import annotations

from typing import Callable

import dp_accounting

from dpfl_tf._validation import check_count, check_number
from dpfl_tf.privacy.accountants import AccountantKind, compute_epsilon

__all__ = ["calibrate_noise_multiplier", "max_steps"]


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    make_event: Callable[[float], dp_accounting.DpEvent],
    accountant: AccountantKind | str = AccountantKind.MOMENTS,
    *,
    tolerance: float = 1e-3,
    max_noise: float = 1e4,
) -> tuple[float, float]:
    """(sigma, eps) with sigma the smallest noise (to `tolerance`) whose event
    `make_event(sigma)` has eps <= target_epsilon at `delta`.

    The returned eps is never above the target.
    """
    target = check_number("target_epsilon", target_epsilon, low=0.0, low_open=True)
    check_number("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)

    def eps(sigma: float) -> float:
        return compute_epsilon(make_event(sigma), delta, accountant)

    hi = 1.0
    while eps(hi) > target:
        hi *= 2.0
        if hi > max_noise:
            raise ValueError(
                f"no noise multiplier <= {max_noise:g} reaches epsilon "
                f"{target:g} at delta {delta:g}"
            )
    lo = 0.0
    while hi - lo > tolerance * max(1.0, hi) * 0.5:
        mid = 0.5 * (lo + hi)
        if eps(mid) <= target:
            hi = mid
        else:
            lo = mid
    return hi, eps(hi)


def max_steps(
    target_epsilon: float,
    delta: float,
    step_event: dp_accounting.DpEvent,
    accountant: AccountantKind | str = AccountantKind.MOMENTS,
    *,
    already_spent: dp_accounting.DpEvent | None = None,
    limit: int | None = None,
) -> int:
    """The largest T such that `already_spent` + T x `step_event` stays within
    (target_epsilon, delta).  0 if even one step would exceed it.

    `limit`: at most this many steps are wanted (the answer is min(T, limit)); when
    they fit, one evaluation answers (a run of 8 lots under a budget of eps 100 need
    not find the millions the budget allows: ~20 s of PLD accounting).  Without
    it, T is searched up to 10^8."""
    target = check_number("target_epsilon", target_epsilon, low=0.0)
    check_number("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    prior = [already_spent] if already_spent is not None else []

    def fits(t: int) -> bool:
        event = dp_accounting.ComposedDpEvent(
            prior + [dp_accounting.SelfComposedDpEvent(step_event, t)]
        )
        return compute_epsilon(event, delta, accountant) <= target

    if limit is not None:
        limit = check_count("limit", limit, minimum=1)
        if fits(limit):
            return limit
        limit_fits = False  # known: not evaluated again
    else:
        limit, limit_fits = 10**8, None
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > limit:
            if limit_fits is None:
                limit_fits = fits(limit)
            return limit if limit_fits else _bisect(fits, lo, limit)
    return _bisect(fits, lo, hi)


def _bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """Largest t in [lo, hi) with fits(t), given fits(lo) and not fits(hi)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo

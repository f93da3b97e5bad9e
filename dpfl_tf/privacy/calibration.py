"""Calibration: the smallest noise multiplier for a target epsilon, and the
number of steps a budget allows.

Both search monotone functions (epsilon grows with steps and shrinks with
noise) and return the side of the bracket that never exceeds the target.
"""

from __future__ import annotations

import math
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

    The returned eps is never above the target, and eps(sigma - tolerance *
    max(1, sigma) / 2) is.  Each probe accounts for the whole event (seconds for a
    long run under PLD): secant steps in log-log take ~6-9 probes where a bisection
    took 13-17.
    """
    target = check_number("target_epsilon", target_epsilon, low=0.0, low_open=True)
    check_number("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)

    def eps(sigma: float) -> float:
        return compute_epsilon(make_event(sigma), delta, accountant)

    # the bracket: eps(lo) > target >= eps(hi) (eps(0) is infinite); hi at least
    # doubles, or jumps past where the power law of the last two points is on target
    # (at most 16-fold)
    lo, eps_lo = 0.0, math.inf
    hi, eps_hi = 1.0, eps(1.0)
    while eps_hi > target:
        if hi >= max_noise:
            raise ValueError(
                f"no noise multiplier <= {max_noise:g} reaches epsilon "
                f"{target:g} at delta {delta:g}"
            )
        guess = _log_log_root(lo, eps_lo, hi, eps_hi, target) or 0.0
        lo, eps_lo = hi, eps_hi
        hi = min(max_noise, max(2.0 * hi, min(1.25 * guess, 16.0 * hi)))
        eps_hi = eps(hi)
    # then probes where the line through the last two points in log-log reaches the
    # target (epsilon falls roughly as a power of sigma: the secant converges in a few
    # probes), kept at least width / 2 inside the bracket, so that near the root the
    # probes land on alternate sides; a bisection when two probes did not halve it
    last = [(lo, eps_lo), (hi, eps_hi)]
    widths = [math.inf, math.inf]  # the bracket's width before the last two probes
    while hi - lo > (width := tolerance * max(1.0, hi) * 0.5):
        probe = _log_log_root(*last[-2], *last[-1], target)
        if probe is None or not lo < probe < hi or hi - lo > 0.5 * widths[-2]:
            probe = 0.5 * (lo + hi)
        probe = min(max(probe, lo + 0.5 * width), hi - 0.5 * width)
        widths = [widths[-1], hi - lo]
        eps_probe = eps(probe)
        last.append((probe, eps_probe))
        if eps_probe <= target:
            hi, eps_hi = probe, eps_probe
        else:
            lo, eps_lo = probe, eps_probe
    return hi, eps_hi


def _log_log_root(s1: float, e1: float, s2: float, e2: float, target: float) -> float | None:
    """Where the line through (log s1, log e1) and (log s2, log e2) reaches log
    target; None where that line is undefined (sigma 0, an infinite or zero epsilon,
    equal points)."""
    if not (s1 > 0.0 and s2 > 0.0 and s1 != s2 and 0.0 < min(e1, e2) and max(e1, e2) < math.inf):
        return None
    if e1 == e2:
        return None
    t = math.log(target / e1) / math.log(e2 / e1)
    return math.exp(min(math.log(s1) + t * math.log(s2 / s1), 700.0))  # no overflow


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

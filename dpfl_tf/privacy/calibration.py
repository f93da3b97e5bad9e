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
    max(1, sigma) / 2) is (a root below tolerance / 2: that sigma is <= 0, where eps
    is infinite).  Each probe accounts for the whole event (up to about a second for a
    long run under PLD): regula falsi in log-log took 4-9 probes on DP-SGD runs where
    a bisection took 12-16 (``experiments/calibration_probes.py``); a curve that drops
    to just below the target can take about three times a bisection's.
    """
    target = check_number("target_epsilon", target_epsilon, low=0.0, low_open=True)
    check_number("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
    tolerance = check_number("tolerance", tolerance, low=1e-12, high=1.0)
    max_noise = check_number("max_noise", max_noise, low=1.0)

    def eps(sigma: float) -> float:
        return compute_epsilon(make_event(sigma), delta, accountant)

    # the bracket: eps(lo) > target >= eps(hi) (eps(0) is infinite); hi doubles, then
    # jumps a quarter past where the power law of the last two points is on target
    # (1.25- to 16-fold), up to max_noise
    lo, eps_lo = 0.0, math.inf
    hi, eps_hi = 1.0, eps(1.0)
    while eps_hi > target:
        if hi >= max_noise:
            raise ValueError(
                f"no noise multiplier <= {max_noise:g} reaches epsilon "
                f"{target:g} at delta {delta:g}"
            )
        guess = _log_log_root(lo, _far(eps_lo, target), hi, _far(eps_hi, target))
        lo, eps_lo = hi, eps_hi
        step = 2.0 if guess is None else min(max(1.25 * guess / hi, 1.25), 16.0)
        hi = min(max_noise, step * hi)
        eps_hi = eps(hi)
    # then regula falsi in log-log (epsilon falls roughly as a power of sigma): the
    # probe where the line through (lo, eps_lo) and (hi, eps_hi) meets the target,
    # with the Illinois rule (an end kept twice in a row counts half as far from the
    # target: the other end moves too), kept at least width / 2 inside the bracket,
    # so that near the root the probes close it from both sides; from lo = 0, halving
    # hi; a bisection when three probes did not halve the bracket
    far_lo, far_hi = _far(eps_lo, target), _far(eps_hi, target)  # Illinois halves them
    kept = None  # the end the last probe did not move
    widths = [math.inf] * 3  # the bracket's width before the last three probes
    while hi - lo > (width := tolerance * max(1.0, hi) * 0.5):
        if lo == 0.0:  # eps(0) is infinite: no line to follow
            probe = 0.5 * hi
        else:
            probe = _log_log_root(lo, far_lo, hi, far_hi)
        if probe is None or not lo < probe < hi or hi - lo > 0.5 * widths[-3]:
            probe = 0.5 * (lo + hi)
        probe = min(max(probe, lo + 0.5 * width), hi - 0.5 * width)
        if not lo < probe < hi:  # the bracket is as narrow as floats go
            break
        widths = [*widths[1:], hi - lo]
        eps_probe = eps(probe)
        far = _far(eps_probe, target)
        if eps_probe <= target:
            hi, eps_hi, far_hi = probe, eps_probe, far
            if kept == "lo" and far_lo is not None:  # lo kept twice in a row: Illinois
                far_lo *= 0.5
            kept = "lo"
        else:
            lo, eps_lo, far_lo = probe, eps_probe, far
            if kept == "hi" and far_hi is not None:
                far_hi *= 0.5
            kept = "hi"
    return hi, eps_hi


def _far(eps: float, target: float) -> float | None:
    """log(eps / target), None where it is infinite."""
    return math.log(eps) - math.log(target) if 0.0 < eps < math.inf else None


def _log_log_root(lo: float, far_lo: float | None, hi: float, far_hi: float | None):
    """Where the line through (log lo, far_lo) and (log hi, far_hi) crosses 0 (far:
    log(eps / target), > 0 at lo, <= 0 at hi); None where that line is undefined."""
    if far_lo is None or far_hi is None or not 0.0 < lo < hi or far_lo <= far_hi:
        return None
    t = far_lo / (far_lo - far_hi)  # in [0, 1] inside a bracket; > 1: past hi
    return math.exp(min(math.log(lo) + t * math.log(hi / lo), 700.0))  # no overflow


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

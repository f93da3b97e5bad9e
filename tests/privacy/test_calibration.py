"""Calibration lands within tolerance of the target and never above it."""

import math

import pytest

from dpfl_tf.privacy import (
    calibrate_noise_multiplier,
    compute_epsilon,
    dp_sgd_event,
    gaussian_step_event,
    max_steps,
)


@pytest.mark.parametrize("accountant", ["moments", "rdp", "pld"])
@pytest.mark.parametrize("target", [0.5, 2.0, 8.0])
def test_noise_calibration(accountant, target):
    def make(sigma):
        return dp_sgd_event(sigma, 3000, sampling_rate=0.01)

    sigma, eps = calibrate_noise_multiplier(target, 1e-5, make, accountant)
    assert eps <= target
    assert eps == pytest.approx(compute_epsilon(make(sigma), 1e-5, accountant))
    assert target - eps < 0.02 * target  # close to the target...
    # ...and minimal: a little less noise overshoots
    assert compute_epsilon(make(sigma * 0.99), 1e-5, accountant) > target


@pytest.mark.parametrize("accountant", ["moments", "rdp"])
def test_noise_calibration_is_minimal_to_its_tolerance_in_few_probes(accountant, monkeypatch):
    """Each probe accounts for the whole event (up to a second under PLD for a long run):
    the search takes at most 10 (a bisection took 12-16), and the noise is the smallest
    to the tolerance: half the tolerance less overshoots."""
    from dpfl_tf.privacy import calibration

    real = calibration.compute_epsilon
    probes = []
    monkeypatch.setattr(
        calibration, "compute_epsilon", lambda *a, **k: probes.append(1) or real(*a, **k)
    )
    for target in (0.5, 1.0, 3.0, 10.0, 40.0):
        for rate, steps in ((0.004, 10_000), (0.1, 50), (1.0, 5)):

            def make(sigma, rate=rate, steps=steps):
                return dp_sgd_event(sigma, steps, sampling_rate=rate)

            probes.clear()
            sigma, eps = calibration.calibrate_noise_multiplier(target, 1e-5, make, accountant)
            assert eps <= target and len(probes) <= 10, (target, rate, len(probes))
            below = sigma - 1e-3 * max(1.0, sigma) / 2
            assert real(make(below), 1e-5, accountant) > target


@pytest.mark.parametrize(
    "curve, root",
    [
        (lambda s: 5.0 / s, 5.0),
        (lambda s: 5.0 / s**3, 5.0 ** (1 / 3)),
        (lambda s: 100.0 * math.exp(-s), math.log(100.0)),
        (lambda s: float(math.ceil(4.0 / s)), 4.0),  # steps: epsilon is 1 from 4 on
        (lambda s: max(5.0 / s, 1.0), 5.0),  # flat from the root on
        (lambda s: 0.0 if s >= 0.3 else math.inf, 0.3),
        (lambda s: 9000.0 / s, 9000.0),  # between the last doubling (8192) and max_noise
        (lambda s: 50.0 / s**2 if s < 3.0 else 0.999, 3.0),  # a drop to just below target
        (lambda s: math.inf if s < 1e-6 else 0.999, 1e-6),  # a root below the tolerance
    ],
    ids=[
        "1/s",
        "1/s^3",
        "exp",
        "steps",
        "flat",
        "zero-or-inf",
        "near-max-noise",
        "drop",
        "tiny-root",
    ],
)
def test_noise_calibration_on_any_falling_curve(curve, root, monkeypatch):
    """Epsilon curves of every shape the accountants give (steep, flat, steps, zero,
    infinite): the noise returned is within the tolerance above the root, its epsilon
    is the curve's and within the target, in at most 40 probes (a bisection: 12-15)."""
    from dpfl_tf.privacy import calibration

    probes = []
    monkeypatch.setattr(
        calibration, "compute_epsilon", lambda s, d, a: probes.append(s) or curve(s)
    )
    sigma, eps = calibration.calibrate_noise_multiplier(1.0, 1e-5, lambda s: s)
    assert eps == curve(sigma) <= 1.0 and len(probes) <= 40
    assert root <= sigma <= root + 1e-3 * max(1.0, sigma) / 2 * (1 + 1e-9)
    assert curve(sigma - 1e-3 * max(1.0, sigma) / 2) > 1.0


def test_calibration_refuses_what_it_cannot_search(monkeypatch):
    from dpfl_tf.privacy import calibration

    monkeypatch.setattr(calibration, "compute_epsilon", lambda s, d, a: 9000.0 / s)
    with pytest.raises(ValueError, match="no noise multiplier <= 8000 reaches epsilon 1"):
        calibration.calibrate_noise_multiplier(1.0, 1e-5, lambda s: s, max_noise=8000)
    for bad in (dict(tolerance=0.0), dict(tolerance=2.0), dict(max_noise=0.5)):
        with pytest.raises(ValueError, match=f"{next(iter(bad))} must be"):
            calibration.calibrate_noise_multiplier(1.0, 1e-5, lambda s: s, **bad)


@pytest.mark.parametrize("accountant", ["moments", "rdp", "pld"])
def test_max_steps(accountant):
    step = gaussian_step_event(4.0, sampling_rate=0.01)
    t = max_steps(2.0, 1e-5, step, accountant)
    assert compute_epsilon(dp_sgd_event(4.0, t, sampling_rate=0.01), 1e-5, accountant) <= 2.0
    assert compute_epsilon(dp_sgd_event(4.0, t + 1, sampling_rate=0.01), 1e-5, accountant) > 2.0


@pytest.mark.parametrize("accountant", ["moments", "pld"])
def test_max_steps_with_a_limit_answers_min_of_the_budget_and_the_limit(accountant, monkeypatch):
    """A limit below what the budget allows is the answer after one evaluation of epsilon
    (the recipes ask for their planned lots: a large budget is not searched to its end);
    a limit above it changes nothing."""
    from dpfl_tf.privacy import calibration

    step = gaussian_step_event(4.0, sampling_rate=0.01)
    t = max_steps(2.0, 1e-5, step, accountant)
    calls = []
    real = calibration.compute_epsilon
    monkeypatch.setattr(
        calibration, "compute_epsilon", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    assert max_steps(2.0, 1e-5, step, accountant, limit=t - 3) == t - 3
    assert len(calls) == 1
    assert max_steps(2.0, 1e-5, step, accountant, limit=t) == t
    calls.clear()
    assert max_steps(2.0, 1e-5, step, accountant, limit=t + 5) == t
    unlimited = len(calls)
    calls.clear()
    assert max_steps(2.0, 1e-5, step, accountant) == t
    assert unlimited <= len(calls) + 1  # the limit's evaluation is not repeated
    spent = dp_sgd_event(4.0, 100, sampling_rate=0.01)  # and with a prior spending
    left = max_steps(2.0, 1e-5, step, accountant, already_spent=spent)
    assert 0 < left < t
    assert max_steps(2.0, 1e-5, step, accountant, already_spent=spent, limit=t) == left
    assert max_steps(2.0, 1e-5, step, accountant, already_spent=spent, limit=left - 1) == left - 1
    costly = gaussian_step_event(0.5, sampling_rate=1.0)  # one step: eps > 1
    assert max_steps(1.0, 1e-5, costly, accountant, limit=10) == 0
    with pytest.raises(ValueError, match="limit must be a whole number >= 1"):
        max_steps(2.0, 1e-5, step, accountant, limit=0)


def test_max_steps_with_prior_spending_and_exhausted_budget():
    step = gaussian_step_event(2.0, sampling_rate=0.01)
    spent = dp_sgd_event(2.0, 1000, sampling_rate=0.01)
    total = max_steps(2.0, 1e-5, step)
    assert max_steps(2.0, 1e-5, step, already_spent=spent) == total - 1000
    assert max_steps(0.01, 1e-5, step) == 0


def test_calibration_rejects_bad_targets():
    with pytest.raises(ValueError, match="target_epsilon must be > 0"):
        calibrate_noise_multiplier(0.0, 1e-5, lambda s: dp_sgd_event(s, 10, sampling_rate=0.1))
    with pytest.raises(ValueError, match="no noise multiplier"):
        calibrate_noise_multiplier(
            1e-6, 1e-5, lambda s: dp_sgd_event(s, 10, sampling_rate=1.0), max_noise=10.0
        )

"""Matrix-factorization strategies: factorizations, sensitivity against brute
force, epsilon against dp-accounting's tree event, optimisation, refusals."""

import itertools
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import rdp

from dpfl_tf.privacy import ReplaceOneGaussianDpEvent, compute_epsilon, neighboring_relation_of
from dpfl_tf.privacy import matrix_factorization as mf

STRATEGIES = [
    mf.TreeAggregation(),
    mf.TreeAggregation(restart_every=5),
    mf.BandedToeplitz((1.0, 0.6, 0.3)),
    mf.BandedToeplitz((0.8, -0.3, 0.2)),
    mf.BufferedToeplitz((0.9, 0.4), (0.3, 0.2)),
]


def _patterns(p: mf.Participation):
    """Every set of steps a unit may take part in under `p` (small n only)."""
    n, k = p.steps, p.participations
    for size in range(1, k + 1):
        for steps in itertools.combinations(range(n), size):
            gaps = np.diff(steps)
            if p.kind is mf.ParticipationKind.MIN_SEPARATION and np.any(gaps < p.separation):
                continue
            if p.kind is mf.ParticipationKind.EPOCHS:
                epochs = [s // p.separation for s in steps]
                if len(set(epochs)) < len(epochs):
                    continue
            yield list(steps)


def _brute_force(c: np.ndarray, p: mf.Participation) -> float:
    """max over patterns of sum_{i,j} |X_ij| (the bound (*)), and of ||C u||^2."""
    gram = np.abs(c.T @ c)
    return max(gram[np.ix_(s, s)].sum() for s in _patterns(p))


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.describe())
def test_noise_matrix_inverts_the_strategy_and_factors_prefix_sums(strategy):
    n = 13
    c, m = strategy.strategy_matrix(n), strategy.noise_matrix(n)
    np.testing.assert_allclose(m @ c, np.eye(n), atol=1e-10)
    a = np.tri(n)
    # prefix sums of (x + M zeta) = A x + (A M) zeta with B = A M: A = B C
    np.testing.assert_allclose((a @ m) @ c, a, atol=1e-10)
    np.testing.assert_allclose(strategy.prefix_errors(n), ((a @ m) ** 2).sum(axis=1), rtol=1e-10)


PARTICIPATIONS = [
    mf.Participation.min_separation(10, 1, 3),
    mf.Participation.min_separation(11, 3),
    mf.Participation.min_separation(12, 4, 2),
    mf.Participation.epochs(12, 4),
    mf.Participation.epochs(10, 3, 2),
    mf.Participation.epochs(12, 5),
]


@pytest.mark.parametrize("participation", PARTICIPATIONS, ids=lambda p: p.describe())
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.describe())
def test_sensitivity_bounds_brute_force_and_is_exact_where_claimed(strategy, participation):
    n = participation.steps
    c = strategy.strategy_matrix(n)
    brute = _brute_force(c, participation)
    ours = strategy.sensitivity_squared(participation)
    assert ours >= brute - 1e-9
    gram = c.T @ c
    minsep = participation.kind is mf.ParticipationKind.MIN_SEPARATION
    if isinstance(strategy, mf.TreeAggregation):
        period = min(strategy.restart_every or n, n)
        # the closed form k (floor(log2 m) + 1): no two participations share a tree
        exact = (
            participation.separation >= period if minsep else participation.separation % period == 0
        )
    elif isinstance(strategy, mf.BandedToeplitz):
        exact = minsep and (min(strategy.coefs) >= 0 or strategy.bands <= participation.separation)
    else:
        exact = minsep  # BLT with non-negative, non-increasing coefficients
    if exact:
        assert ours == pytest.approx(brute, rel=1e-9)
    if np.all(gram >= -1e-12):
        # with X >= 0, the bound is the sensitivity itself: some pattern's ||C u||^2
        assert brute == pytest.approx(
            max(np.sum((c[:, s].sum(axis=1)) ** 2) for s in _patterns(participation))
        )


def test_tree_sensitivity_within_a_tree_is_a_close_bound():
    """Participations 2 apart share nodes of a tree of 8: the two-stage bound on
    the dense Gram matrix holds and is within 15% of the brute force."""
    tree = mf.TreeAggregation(restart_every=8)
    p = mf.Participation.min_separation(16, 2, 3)
    brute = _brute_force(tree.strategy_matrix(16), p)
    assert brute <= tree.sensitivity_squared(p) <= 1.15 * brute


def test_a_wrong_sensitivity_would_be_caught():
    """Bands beyond the separation correlate a unit's participations: the
    sensitivity grows, and the brute force sees it (the cheap diagonal sum
    would be wrong)."""
    banded = mf.BandedToeplitz((1.0, 0.9, 0.8, 0.7))
    close = mf.Participation.min_separation(12, 2, 3)
    apart = mf.Participation.min_separation(12, 4, 3)
    diagonal_only = 3 * sum(x * x for x in banded.coefs)
    assert banded.sensitivity_squared(apart) == pytest.approx(diagonal_only)
    assert banded.sensitivity_squared(close) > 1.5 * diagonal_only
    assert banded.sensitivity_squared(close) == pytest.approx(
        _brute_force(banded.strategy_matrix(12), close)
    )


@pytest.mark.parametrize("period, epochs", [(1, 3), (7, 2), (8, 3), (100, 4), (1000, 1)])
def test_tree_epsilon_equals_dp_accounting_tree_event(period, epochs):
    """Kairouz et al. 2021, Appendix D: dp-accounting's event for restarted trees
    with one participation per tree, against our Gaussian event with the
    strategy's sensitivity, both through dp-accounting's RDP accountant."""
    node_sigma = 3.0  # noise std per node / clip, dp-accounting's noise_multiplier
    tree = mf.TreeAggregation(restart_every=period)
    participation = mf.Participation.epochs(period * epochs, period)
    sens = math.sqrt(tree.sensitivity_squared(participation))
    assert sens == pytest.approx(math.sqrt(epochs * math.ceil(math.log2(period + 1))))
    mech = mf.MatrixMechanism(tree, participation, node_sigma / sens)
    assert mech.noise_stddev(clip=1.0) == pytest.approx(node_sigma)
    ours = rdp.RdpAccountant().compose(mech.event()).get_epsilon(1e-5)
    theirs_event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.SingleEpochTreeAggregationDpEvent(node_sigma, period), epochs
    )
    theirs = (
        rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
        .compose(theirs_event)
        .get_epsilon(1e-5)
    )
    assert ours == pytest.approx(theirs, rel=1e-9)
    # the project's own accountants read the event too
    assert compute_epsilon(mech.event(), 1e-5, "rdp") == pytest.approx(ours, rel=1e-6)


def test_mechanism_noise_and_event():
    banded = mf.BandedToeplitz((2.0, 1.0))
    mech = mf.MatrixMechanism(banded, mf.Participation.min_separation(20, 5), 1.5)
    assert mech.sensitivity == pytest.approx(math.sqrt(4 * 5.0))
    assert mech.noise_stddev(clip=0.5) == pytest.approx(1.5 * 0.5 * math.sqrt(20.0))
    assert mech.event() == dp_accounting.GaussianDpEvent(1.5)
    assert mf.MatrixMechanism.from_config(mech.to_config()) == mech


def test_an_order_fixed_by_the_data_is_accounted_under_replace_one():
    """Shuffled epochs or a fixed order: a replaced unit moves each of its
    contributions by up to 2 clip, so sigma / 2 under replace-one."""
    p = mf.Participation.epochs(20, 5, relation="replace_one")
    mech = mf.MatrixMechanism(mf.BandedToeplitz((1.0, 0.5)), p, 3.0)
    assert mech.event() == ReplaceOneGaussianDpEvent(1.5)
    assert neighboring_relation_of(mech.event()) is dp_accounting.NeighboringRelation.REPLACE_ONE
    assert mf.MatrixMechanism.from_config(mech.to_config()) == mech
    with pytest.raises(ValueError, match="relation must be one of"):
        mf.Participation.epochs(20, 5, relation="zero_out")
    with pytest.raises(ValueError, match="cyclic_poisson' is analysed under add/remove-one"):
        mf.Participation("cyclic_poisson", 20, 5, sampling_rate=0.5, relation="replace_one")


def test_amplified_event_is_k_cycles_of_a_sampled_gaussian():
    banded = mf.BandedToeplitz((3.0, 4.0))
    p = mf.Participation.cyclic_poisson(10, 4, 0.25)
    mech = mf.MatrixMechanism(banded, p, 2.0)
    assert mech.sensitivity == pytest.approx(5.0)  # one participation's column norm
    assert mech.event() == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(2.0)), 3
    )
    with pytest.raises(ValueError, match="bands <= the cycle length"):
        mf.MatrixMechanism(
            mf.BandedToeplitz((1.0, 0.5, 0.2)), mf.Participation.cyclic_poisson(10, 2, 0.5), 1.0
        )
    with pytest.raises(ValueError, match="cyclic_poisson.*BandedToeplitz"):
        mf.MatrixMechanism(mf.TreeAggregation(), p, 1.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(kind="minsep", steps=10, separation=2), "participation must be one of"),
        (dict(kind="epochs", steps=0, separation=2), "steps must be a whole number >= 1, got 0"),
        (dict(kind="epochs", steps=10, separation=0), "separation must be"),
        (dict(kind="cyclic_poisson", steps=10, separation=2), "needs sampling_rate"),
        (
            dict(kind="cyclic_poisson", steps=10, separation=2, sampling_rate=1.5),
            r"sampling_rate must be in \(0, 1\], got 1.5",
        ),
        (dict(kind="epochs", steps=10, separation=2, sampling_rate=0.1), "cyclic_poisson' only"),
    ],
)
def test_participation_refuses_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mf.Participation(**kwargs)


def test_strategies_refuse_bad_arguments():
    with pytest.raises(ValueError, match=r"coefs\[0\] > 0"):
        mf.BandedToeplitz((0.0, 1.0))
    with pytest.raises(ValueError, match=r"buf_decay\[0\] must be in \[0, 1\), got 1.2"):
        mf.BufferedToeplitz((1.2,), (0.1,))
    with pytest.raises(ValueError, match="noise_multiplier must be > 0, got 0"):
        mf.MatrixMechanism(mf.TreeAggregation(), mf.Participation.epochs(4, 2), 0)
    with pytest.raises(ValueError, match="strategy name must be one of"):
        mf.strategy_from_config({"name": "dense"})
    big = mf.Participation.epochs(mf.MAX_DENSE_STEPS + 1, 10)
    with pytest.raises(ValueError, match=f"steps must be <= {mf.MAX_DENSE_STEPS}"):
        mf.BufferedToeplitz((0.5,), (0.2,)).sensitivity_squared(big)


def test_structured_sensitivities_scale_to_long_runs():
    """No dense matrix where the structure gives the answer (n = 20,000)."""
    n = 20_000
    banded = mf.BandedToeplitz((1.0, 0.5, 0.25))
    assert banded.sensitivity_squared(mf.Participation.epochs(n, 200)) >= 100 * 1.3125
    assert (
        mf.TreeAggregation(restart_every=200).sensitivity_squared(mf.Participation.epochs(n, 200))
        == 100 * 8
    )


def test_banded_epochs_bound_matches_the_dense_bound():
    banded = mf.BandedToeplitz((1.0, 0.7, -0.2, 0.1))
    for p in [mf.Participation.epochs(40, 6), mf.Participation.epochs(30, 3, 4)]:
        c = banded.strategy_matrix(p.steps)
        assert banded.sensitivity_squared(p) == pytest.approx(
            mf.sensitivity_squared_bound(c.T @ c, p)
        )


def test_error_gradient_matches_finite_differences():
    rng = np.random.default_rng(0)
    c = np.concatenate([[1.0], rng.uniform(-0.3, 0.5, 5)])
    _, grad = mf._mean_error_and_grad(c, 50)
    eps = 1e-6
    numeric = [
        (
            mf._mean_error_and_grad(c + eps * np.eye(6)[j], 50)[0]
            - mf._mean_error_and_grad(c - eps * np.eye(6)[j], 50)[0]
        )
        / (2 * eps)
        for j in range(6)
    ]
    np.testing.assert_allclose(grad, numeric, rtol=1e-5)


def _loss(strategy, p):
    return strategy.sensitivity_squared(p) * strategy.prefix_errors(p.steps).mean()


def test_optimised_strategies_beat_independent_noise_and_the_tree():
    n, b = 400, 20
    p = mf.Participation.min_separation(n, b)
    banded = mf.optimize_banded_toeplitz(n, b)
    assert np.linalg.norm(banded.coefs) == pytest.approx(1.0)
    dpsgd = mf.BandedToeplitz((1.0,))
    start = mf.BandedToeplitz(
        tuple(np.cumprod([1.0] + [(2 * j - 1) / (2 * j) for j in range(1, b)]))
    )
    tree = mf.TreeAggregation(restart_every=b)
    blt = mf.optimize_blt(p, buffers=3)
    losses = {
        name: _loss(s, p)
        for name, s in dict(banded=banded, dpsgd=dpsgd, start=start, tree=tree, blt=blt).items()
    }
    assert losses["banded"] < 0.2 * losses["dpsgd"]
    assert losses["banded"] <= losses["start"] * (1 + 1e-9)
    assert losses["banded"] < losses["tree"]
    assert losses["blt"] < losses["tree"]
    # BLT coefficients stay non-negative and non-increasing: the sensitivity is exact
    coefs = blt.coefficients(n)
    assert np.all(coefs >= 0) and np.all(np.diff(coefs) <= 1e-12)


def test_guard_refuses_what_breaks_the_pattern_before_recording_it():
    guard = mf.ParticipationGuard(mf.Participation.min_separation(10, 3, 2))
    guard.record(0, ["a", "b"])
    guard.record(1, ["c"])
    with pytest.raises(
        mf.PatternViolation,
        match="unit 'a' took part at step 0; step 2 is 2 later, the declared min separation is 3",
    ):
        guard.record(2, ["d", "a"])
    assert guard.steps_released == 2 and "d" not in guard.get_state()["last"]
    guard.record(2, ["d"])
    guard.record(3, ["a"])
    for step in range(4, 6):
        guard.record(step, [])
    with pytest.raises(mf.PatternViolation, match=r"already took part 2 times \(max_"):
        guard.record(6, ["a"])
    with pytest.raises(mf.PatternViolation, match="not the next step"):
        guard.record(3, ["z"])
    with pytest.raises(mf.PatternViolation, match="twice in step 6"):
        guard.record(6, ["z", "z"])
    with pytest.raises(mf.PatternViolation, match="replay released steps"):
        guard.set_state({"last": {}, "count": {}, "steps_released": 2})
    for step in range(6, 10):
        guard.record(step, [])
    with pytest.raises(mf.PatternViolation, match="beyond the mechanism's horizon of 10"):
        guard.record(10, [])


def test_guard_epochs_and_cyclic_groups():
    guard = mf.ParticipationGuard(mf.Participation.epochs(8, 4))
    guard.record(0, [1])
    with pytest.raises(mf.PatternViolation, match="already took part in epoch 0"):
        guard.record(1, [1])
    for step in range(1, 4):
        guard.record(step, [])
    guard.record(4, [1])  # next epoch: allowed, even 4 steps later
    cyclic = mf.ParticipationGuard(
        mf.Participation.cyclic_poisson(6, 3, 0.5), group_of=lambda u: u % 3
    )
    cyclic.record(0, [3, 6])
    with pytest.raises(mf.PatternViolation, match="unit 4 of group 1 cannot join step 2"):
        cyclic.record(1, [4]) or cyclic.record(2, [4])
    with pytest.raises(ValueError, match="needs group_of"):
        mf.ParticipationGuard(mf.Participation.cyclic_poisson(6, 3, 0.5))

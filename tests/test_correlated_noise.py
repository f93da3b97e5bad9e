"""Step-by-step correlated noise: exactly M zeta, the strategy's covariance (a
test that can fail), resume, replay refusals, secure mode, the sanitizer."""

import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from dpfl_tf.correlated_noise import CorrelatedNoise, CorrelatedSanitizer
from dpfl_tf.privacy import matrix_factorization as mf
from dpfl_tf.sanitizer import noise_seed

STRATEGIES = [
    mf.TreeAggregation(),
    mf.TreeAggregation(restart_every=5),
    mf.BandedToeplitz((1.0, 0.6, -0.2)),
    mf.BufferedToeplitz((0.9, 0.4), (0.3, 0.2)),
]


def _mechanism(strategy, n=13):
    return mf.MatrixMechanism(strategy, mf.Participation.min_separation(n, 1), 1.0)


def _run(noise, steps, start=0):
    return np.stack([[w.numpy() for w in noise.next(start + i)][0] for i in range(steps)])


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.describe())
def test_noise_is_exactly_m_zeta_from_key_and_step(strategy):
    n = 13
    noise = CorrelatedNoise(_mechanism(strategy, n), [(3, 2), (4,)], seed=7)
    assert len(noise.buffers) == 2 and noise.buffers[0].shape[0] == strategy.buffers(n)
    outs = [noise.next(i) for i in range(n)]
    # both tensors' zeta are one draw of 6 + 4 values (`stateless_normals`)
    draws = np.stack(
        [
            tf.random.stateless_normal([10], seed=noise_seed(noise.noise_key, i, 0), alg="philox")
            for i in range(n)
        ]
    )
    m = strategy.noise_matrix(n)
    want = np.einsum("ts,sab->tab", m, draws[:, :6].reshape(n, 3, 2))
    np.testing.assert_allclose(np.stack([o[0] for o in outs]), want, atol=2e-5)
    np.testing.assert_allclose(np.stack([o[1] for o in outs]), m @ draws[:, 6:], atol=2e-5)


def _whitened_lrt(samples, cov):
    """p-value of the likelihood-ratio test that samples (d x n) have covariance
    `cov`: whiten with chol(cov), then d (tr S - log det S - n) ~ chi2(n(n+1)/2)
    (mean known to be 0)."""
    d, n = samples.shape
    white = np.linalg.solve(np.linalg.cholesky(cov), samples.T).T
    s = white.T @ white / d
    statistic = d * (np.trace(s) - np.linalg.slogdet(s)[1] - n)
    return stats.chi2.sf(statistic, n * (n + 1) // 2)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.describe())
def test_covariance_is_the_strategys_and_a_wrong_strategy_is_rejected(strategy):
    """20,000 coordinates of n = 10 steps: the covariance M M^T is accepted; the
    covariance of another strategy (or of independent noise) is rejected."""
    n, d = 10, 20_000
    noise = CorrelatedNoise(_mechanism(strategy, n), [(d,)], seed=11)
    samples = _run(noise, n).T  # d x n
    m = strategy.noise_matrix(n)
    assert _whitened_lrt(samples, m @ m.T) > 1e-3
    others = [
        mf.BandedToeplitz((1.0, 0.5)),
        mf.BandedToeplitz((1.0,)),
        mf.TreeAggregation(restart_every=4),
    ]
    for other in others:
        if other == strategy:
            continue
        m2 = other.noise_matrix(n)
        assert _whitened_lrt(samples, m2 @ m2.T) < 1e-6, other.describe()


def test_resumed_noise_continues_the_same_stream_and_replays_are_refused():
    strategy = mf.BufferedToeplitz((0.8,), (0.3,))
    mech = _mechanism(strategy, 12)
    whole = _run(CorrelatedNoise(mech, [(5,)], seed=3), 12)
    first = CorrelatedNoise(mech, [(5,)], seed=3)
    head = _run(first, 6)
    state = first.get_state()
    second = CorrelatedNoise(mech, [(5,)], seed=3)
    second.set_state(state)
    tail = _run(second, 6, start=6)
    np.testing.assert_array_equal(np.concatenate([head, tail]), whole)
    # the same index is never drawn twice; an earlier state is never restored
    with pytest.raises(ValueError, match="noise index 11 was already drawn"):
        second.next(11)
    with pytest.raises(ValueError, match="behind the 12 steps already released"):
        second.set_state(state)
    with pytest.raises(ValueError, match="horizon of 12 steps is reached"):
        second.next(100)


def test_unseeded_runs_draw_fresh_keys():
    mech = _mechanism(mf.BandedToeplitz((1.0, 0.5)), 3)
    a = CorrelatedNoise(mech, [(4,)])
    b = CorrelatedNoise(mech, [(4,)])
    assert a.noise_key != b.noise_key
    assert not np.allclose(_run(a, 1), _run(b, 1))


def test_graph_mode_steps_match_eager():
    mech = _mechanism(mf.TreeAggregation(restart_every=4), 9)
    eager = _run(CorrelatedNoise(mech, [(3,)], seed=5), 9)
    graph_noise = CorrelatedNoise(mech, [(3,)], seed=5)
    step = tf.function(lambda i: graph_noise.next(i)[0])
    graph = np.stack([step(tf.constant(i, tf.int64)).numpy() for i in range(9)])
    np.testing.assert_allclose(graph, eager, atol=1e-6)


def test_secure_mode_refuses_a_seed_and_keeps_float64_buffers():
    mech = _mechanism(mf.BandedToeplitz((1.0, 0.5)), 6)
    with pytest.raises(ValueError, match="secure_mode=True refuses a seed"):
        CorrelatedNoise(mech, [(3,)], seed=1, secure_mode=True)
    noise = CorrelatedNoise(mech, [(4000,)], secure_mode=True)
    assert noise.buffers[0].dtype == tf.float64
    samples = np.stack([noise.next(i)[0].numpy() for i in range(6)]).T
    m = mech.strategy.noise_matrix(6)
    assert _whitened_lrt(samples, m @ m.T) > 1e-3


def test_sanitizer_scales_by_the_sensitivity_and_reports_the_run_event():
    banded = mf.BandedToeplitz((1.0, 0.5))
    mech = mf.MatrixMechanism(banded, mf.Participation.min_separation(8, 4), 2.0)
    san = CorrelatedSanitizer(0.5, mech, seed=0)
    assert san.noise_stddevs(1) == pytest.approx((2.0 * 0.5 * mech.sensitivity,))
    assert mech.sensitivity == pytest.approx(math.sqrt(2 * 1.25))
    assert san.event(1) == dp_accounting.GaussianDpEvent(2.0)
    zero = [tf.zeros((20_000,))]
    out = san.add_noise(zero, step=0)[0].numpy()
    assert np.std(out) == pytest.approx(2.0 * 0.5 * mech.sensitivity, rel=0.03)
    # eager without a step: the position is the index (a federated round)
    second = san.add_noise(zero)[0].numpy()
    assert san.noise.position.numpy() == 2 and not np.allclose(second, out)
    with pytest.raises(ValueError, match="needs step"):
        tf.function(lambda: san.add_noise(zero))()
    per_layer = CorrelatedSanitizer([1.0, 1.0], mech, noise_allocation="proportional", seed=0)
    assert per_layer.event(2) == dp_accounting.GaussianDpEvent(2.0 / math.sqrt(2))
    again = CorrelatedSanitizer.from_config(san.get_config())
    assert again.mechanism == mech and again.l2_norm_clip == 0.5

"""The shared sanitizer: clipping bounds, noise scale (a test that can fail), events."""

import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from dpfl_tf.privacy import gaussian_step_event
from dpfl_tf.sanitizer import GaussianSanitizer


def _records(batch=64, seed=0):
    rng = np.random.default_rng(seed)
    scales = rng.lognormal(0.0, 1.5, size=(batch, 1))
    return [
        tf.constant(rng.normal(size=(batch, 5, 3)) * scales[:, :, None], tf.float32),
        tf.constant(rng.normal(size=(batch, 7)) * scales, tf.float32),
    ]


def _norms(clipped):
    flat = tf.concat([tf.reshape(c, [c.shape[0], -1]) for c in clipped], axis=1)
    return tf.norm(flat, axis=1).numpy()


def test_flat_clipping_bound_holds_and_small_records_are_untouched():
    records = _records()
    s = GaussianSanitizer(1.5, 1.0)
    clipped = s.clip_batch(records)
    norms_before, norms_after = _norms(records), _norms(clipped)
    assert np.all(norms_after <= 1.5 * (1 + 1e-6))
    small = norms_before <= 1.5
    assert small.any() and (~small).any()
    np.testing.assert_allclose(norms_after[small], norms_before[small], rtol=1e-6)
    np.testing.assert_allclose(norms_after[~small], 1.5, rtol=1e-5)
    # direction is kept
    for r, c in zip(records, clipped):
        cos = tf.reduce_sum(tf.reshape(r * c, [r.shape[0], -1]), 1)
        assert np.all(cos.numpy() >= 0)


def test_per_layer_clipping_bounds_hold_per_component():
    records = _records()
    s = GaussianSanitizer([0.5, 2.0], 1.0)
    clipped = s.clip_batch(records)
    for c, bound in zip(clipped, [0.5, 2.0]):
        n = tf.norm(tf.reshape(c, [c.shape[0], -1]), axis=1).numpy()
        assert np.all(n <= bound * (1 + 1e-6))
    assert np.all(_norms(clipped) <= s.total_clip(2) * (1 + 1e-6))
    assert s.total_clip(2) == pytest.approx(math.sqrt(0.25 + 4.0))


@pytest.mark.parametrize("clip", [0.1, [0.1, 0.3]], ids=["flat", "per_layer"])
def test_float64_records_are_clipped_to_the_bound_in_float64(clip):
    """The bound enters in the records' dtype: 0.1 rounded through float32 is
    0.10000000149, which let a float64 record keep a norm above C."""
    records = [tf.cast(r, tf.float64) * 100.0 for r in _records()]
    clipped = GaussianSanitizer(clip, 1.0).clip_batch(records)
    if isinstance(clip, list):
        for c, bound in zip(clipped, clip):
            norms = tf.norm(tf.reshape(c, [c.shape[0], -1]), axis=1).numpy()
            assert np.all(norms <= bound * (1 + 1e-15))
    else:
        assert np.all(_norms(clipped) <= 0.1 * (1 + 1e-15))


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("clip", [1.0, [1.0, 2.0]])
def test_non_finite_records_are_zeroed_and_counted_in_every_mode(mode, clip):
    """A NaN or inf record is dropped (zeroed, factor 0); the others are clipped
    as usual, and the sum stays finite -- without asserts, so also under XLA."""
    s = GaussianSanitizer(clip, 1.0)
    a = tf.constant([[1.0, float("nan")], [3.0, 4.0], [0.0, 0.0], [float("inf"), 1.0]])
    b = tf.constant([[1.0], [0.0], [0.0], [2.0]])

    def run(a, b):
        records = [a, b] if isinstance(clip, list) else [tf.concat([a, b], 1)]
        sq = [tf.reduce_sum(tf.square(r), 1) for r in records]
        factors = s.clip_factors(sq)
        sums = [tf.reduce_sum(s.apply_factors(r, f), 0) for r, f in zip(records, factors)]
        return sums, s.dropped_records(factors)

    if mode != "eager":
        run = tf.function(run, jit_compile=mode == "xla")
    sums, dropped = run(a, b)
    assert int(dropped) == 2
    total = np.concatenate([t.numpy().ravel() for t in sums])
    assert np.all(np.isfinite(total))
    # only record 1 ([3, 4] | [0]) contributes, clipped to its bound
    bound = 1.0 if not isinstance(clip, list) else 1.0
    np.testing.assert_allclose(total[:2], np.array([3.0, 4.0]) * bound / 5.0, rtol=1e-6)
    np.testing.assert_allclose(total[2:], 0.0)


def test_zero_records_are_guarded():
    s = GaussianSanitizer(1.0, 1.0)
    out = s.clip_batch([tf.zeros((3, 4))])
    assert np.all(np.isfinite(out[0].numpy())) and np.all(out[0].numpy() == 0)
    bad = tf.constant([[1.0, float("nan")], [1.0, 2.0]])
    out = s.clip_batch([bad])[0].numpy()
    np.testing.assert_array_equal(out[0], [0.0, 0.0])
    np.testing.assert_allclose(out[1], np.array([1.0, 2.0]) / math.sqrt(5.0), rtol=1e-6)


def test_clip_and_sum_equals_sum_of_single_clips():
    records = _records(batch=8)
    s = GaussianSanitizer(1.0, 0.0)
    total = s.clip_and_sum(records)
    singles = [s.clip([r[i] for r in records]) for i in range(8)]
    for j in range(2):
        np.testing.assert_allclose(
            total[j].numpy(), sum(x[j].numpy() for x in singles), rtol=1e-5, atol=1e-6
        )


def _noise_ks_pvalue(sanitizer, claimed_std, n=20000):
    state = sanitizer.initial_state([tf.zeros((n,))])
    noised, _ = sanitizer.noised_sum(state, sampling_rate=0.1)
    return stats.kstest(noised[0].numpy() / claimed_std, "norm").pvalue


def test_noise_has_the_right_scale_and_the_test_can_fail():
    s = GaussianSanitizer(2.0, 1.5, seed=1)
    true_std = 3.0  # sigma * C
    assert _noise_ks_pvalue(s, true_std) > 1e-3
    # the same test rejects a 10% wrong scale, and a wrong noise multiplier
    assert _noise_ks_pvalue(GaussianSanitizer(2.0, 1.5, seed=1), true_std * 1.1) < 1e-6
    assert _noise_ks_pvalue(GaussianSanitizer(2.0, 1.65, seed=1), true_std) < 1e-6


def test_per_layer_noise_allocation_and_event():
    glob = GaussianSanitizer([3.0, 4.0], 2.0)
    assert glob.noise_stddevs(2) == (10.0, 10.0)  # sigma * sqrt(9 + 16)
    assert glob.effective_noise_multiplier(2) == pytest.approx(2.0)
    prop = GaussianSanitizer([3.0, 4.0, 5.0], 2.0, noise_allocation="proportional")
    assert prop.noise_stddevs(3) == (6.0, 8.0, 10.0)
    # each component contributes (C_j / s_j)^2 = 1/sigma^2: sigma_eff = sigma / sqrt(3)
    assert prop.effective_noise_multiplier(3) == pytest.approx(2.0 / math.sqrt(3))
    assert prop.event(3, sampling_rate=0.01) == gaussian_step_event(
        2.0 / math.sqrt(3), sampling_rate=0.01
    )
    # the emitted multiplier is the worst case: a record that puts its whole
    # allowance into every layer moves the whitened sum by exactly 1/sigma_eff
    worst = math.sqrt(sum((c / s) ** 2 for c, s in zip([3.0, 4.0, 5.0], prop.noise_stddevs(3))))
    assert 1.0 / worst == pytest.approx(prop.effective_noise_multiplier(3))
    prop_noise = _noise_ks_pvalue(
        GaussianSanitizer([3.0], 2.0, noise_allocation="proportional", seed=3), 6.0
    )
    assert prop_noise > 1e-3


def test_seeded_noise_is_reproducible_and_default_is_not():
    state = [tf.zeros((100,))]
    a = GaussianSanitizer(1.0, 1.0, seed=7).add_noise(state)[0].numpy()
    b = GaussianSanitizer(1.0, 1.0, seed=7).add_noise(state)[0].numpy()
    c = GaussianSanitizer(1.0, 1.0).add_noise(state)[0].numpy()
    d = GaussianSanitizer(1.0, 1.0).add_noise(state)[0].numpy()
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(c, d)


def test_zero_noise_is_non_private_event():
    s = GaussianSanitizer(1.0, 0.0)
    assert isinstance(s.event(1, sampling_rate=0.1), dp_accounting.NonPrivateDpEvent)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="l2_norm_clip must be > 0, got 0"):
        GaussianSanitizer(0.0, 1.0)
    with pytest.raises(ValueError, match=r"l2_norm_clip\[1\] must be > 0"):
        GaussianSanitizer([1.0, -2.0], 1.0)
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        GaussianSanitizer(1.0, -0.5)
    with pytest.raises(ValueError, match="noise_allocation"):
        GaussianSanitizer([1.0], 1.0, noise_allocation="uniform")
    with pytest.raises(ValueError, match="2 bounds but the record has 3 components"):
        GaussianSanitizer([1.0, 1.0], 1.0).clip_batch([tf.zeros((2, 1))] * 3)


def test_config_round_trip():
    s = GaussianSanitizer([1.0, 2.0], 1.3, noise_allocation="proportional", seed=4)
    assert GaussianSanitizer.from_config(s.get_config()).get_config() == s.get_config()


def test_works_inside_tf_function():
    s = GaussianSanitizer(1.0, 1.0, seed=0)

    @tf.function
    def step(records):
        return s.add_noise(s.clip_and_sum(records))

    out = step(_records(batch=4))
    assert [o.shape for o in out] == [(5, 3), (7,)]


def test_neighbouring_seeds_give_independent_streams():
    """Seeds k and k+1 must not be shifted copies of one stream."""
    from dpfl_tf.sanitizer import make_generator

    a = make_generator(100).normal([2000]).numpy()
    b = make_generator(101).normal([2000]).numpy()
    for shift in range(0, 8):
        assert abs(np.corrcoef(a[shift:], b[: len(b) - shift])[0, 1]) < 0.1
        assert abs(np.corrcoef(b[shift:], a[: len(a) - shift])[0, 1]) < 0.1


def test_flat_clipping_event_does_not_depend_on_the_number_of_components():
    s = GaussianSanitizer(2.0, 1.5)
    for k in (1, 2, 7):
        assert s.effective_noise_multiplier(k) == 1.5
        assert s.event(k, sampling_rate=0.1) == gaussian_step_event(1.5, sampling_rate=0.1)
    noised, event = s.noised_sum([tf.zeros((3,)), tf.zeros((4, 2))], sampling_rate=0.1)
    assert event == gaussian_step_event(1.5, sampling_rate=0.1)


@pytest.mark.parametrize("stateless", [False, True])
def test_secure_mode_noise_has_the_claimed_scale_and_refuses_a_seed(stateless):
    from scipy import stats

    s = GaussianSanitizer(1.5, 2.0, secure_mode=True)
    assert s.secure_mode and "secure_mode=True" in repr(s)
    step = tf.constant(7, tf.int64) if stateless else None
    z = s.add_noise([tf.zeros((20000,))], step=step)[0].numpy() / 3.0
    assert z.dtype == np.float32
    # unseedable draws: 1e-6, not 1e-3 (which fails one run in a thousand by chance);
    # a 10% wrong scale is rejected by the same test at that threshold (it can fail)
    assert stats.kstest(z, "norm").pvalue > 1e-6
    assert stats.kstest(z * 1.1, "norm").pvalue < 1e-6
    with pytest.raises(ValueError, match="secure_mode=True refuses a seed"):
        GaussianSanitizer(1.0, 1.0, seed=1, secure_mode=True)


def test_secure_keys_differ_and_are_not_in_the_config():
    a, b = GaussianSanitizer(1.0, 1.0, secure_mode=True), GaussianSanitizer(1.0, 1.0)
    assert a.noise_key != b.noise_key
    assert "noise_key" not in a.get_config() and a.get_config()["secure_mode"] is True


def test_stateless_noise_continues_the_seeded_stream_by_step():
    s = GaussianSanitizer(1.0, 1.0, seed=11)
    draw = lambda t: s.add_noise([tf.zeros((8,))], step=tf.constant(t, tf.int64))[0].numpy()
    np.testing.assert_array_equal(draw(3), draw(3))  # position t is reproducible
    assert not np.allclose(draw(3), draw(4))  # and never reused for t + 1
    other = GaussianSanitizer(1.0, 1.0, seed=12)
    assert not np.allclose(
        draw(3), other.add_noise([tf.zeros((8,))], step=tf.constant(3, tf.int64))[0].numpy()
    )


def test_secure_uniform_is_uniform_and_fresh():
    from scipy import stats

    from dpfl_tf.secure_random import secure_uniform

    u = secure_uniform(20000)
    assert u.dtype == np.float64 and u.min() >= 0.0 and u.max() < 1.0
    assert stats.kstest(u, "uniform").pvalue > 1e-6  # unseedable: see above
    assert stats.kstest(u**1.1, "uniform").pvalue < 1e-6
    assert not np.array_equal(secure_uniform(16), secure_uniform(16))
    with pytest.raises(ValueError, match="n must be >= 0"):
        secure_uniform(-1)


@pytest.mark.parametrize("secure", [False, True])
def test_every_noise_draw_is_seeded_by_the_whole_key(secure, monkeypatch):
    """Each lot's noise is drawn from 2 x 64-bit seeds into which both 63-bit
    words of the key enter (a seed of 32 random bits -- what folding a Python int
    into the key gave -- could be searched exhaustively by an observer of the
    released update, and the noise subtracted): one seed per chunk of tensors
    (`stateless_normals`; here both tensors fit one chunk), in secure mode one
    per tensor."""
    seeds = []
    real = tf.random.stateless_normal

    def spy(shape, seed, **kwargs):
        seeds.append(seed)
        return real(shape, seed=seed, **kwargs)

    monkeypatch.setattr(tf.random, "stateless_normal", spy)
    s = GaussianSanitizer(1.0, 1.0, secure_mode=secure)
    k0, k1 = s.noise_key
    assert k0 >= 2**40 or k1 >= 2**40  # 63 random bits each (fails with p ~ 2^-45)
    for step in (0, 5):
        s.add_noise([tf.zeros((3,)), tf.zeros((2, 2))], step=tf.constant(step, tf.int64))
    per_lot = (0, 1) if secure else (0,)
    assert len(seeds) == 2 * len(per_lot)
    assert all(seed.dtype == tf.int64 for seed in seeds)
    got = [tuple(int(v) for v in seed.numpy()) for seed in seeds]
    assert got == [(k0 ^ t, k1 ^ j) for t in (0, 5) for j in per_lot]
    assert len(set(got)) == len(got)


def test_stateless_normals_cut_one_draw_per_chunk_of_one_dtype(monkeypatch):
    """The tensors are packed in order into chunks of one dtype and at most
    NOISE_CHUNK values; a larger tensor, or one of unknown size, is a chunk of its
    own.  Chunk k is the draw of seed noise_seed(key, step, k), cut in order
    (checked against drawing each chunk by hand), and the draws are N(0, 1)."""
    from dpfl_tf import sanitizer
    from dpfl_tf.sanitizer import noise_seed, stateless_normals

    monkeypatch.setattr(sanitizer, "NOISE_CHUNK", 10)
    key = (123456789012345, 987654321098765)
    step = tf.constant(7, tf.int64)
    like = [
        tf.zeros([2, 3]),  # chunk 0
        tf.zeros([4]),  # chunk 0 (6 + 4 = 10 values)
        tf.zeros([1]),  # chunk 1: the cap is reached
        tf.zeros([3], tf.float64),  # chunk 2: another dtype
        tf.zeros([12]),  # chunk 3: larger than a chunk
        tf.zeros([2]),  # chunk 4
    ]
    unknown = tf.function(
        lambda t: stateless_normals([tf.zeros([2]), t, tf.zeros([2])], key, step),
        input_signature=[tf.TensorSpec([None], tf.float32)],
    )
    got = stateless_normals(like, key, step)

    def draw(k, n, dtype=tf.float32):
        return tf.random.stateless_normal(
            [n], seed=noise_seed(key, step, k), dtype=dtype, alg="philox"
        ).numpy()

    c0 = draw(0, 10)
    want = [
        c0[:6].reshape(2, 3),
        c0[6:],
        draw(1, 1),
        draw(2, 3, tf.float64),
        draw(3, 12),
        draw(4, 2),
    ]
    for g, w, t in zip(got, want, like):
        assert g.dtype == t.dtype and g.shape == t.shape
        np.testing.assert_array_equal(g.numpy(), w)
    # a tensor of unknown size is a chunk of its own, between two others
    a, b, c = unknown(tf.zeros([5]))
    np.testing.assert_array_equal(b.numpy(), draw(1, 5))
    np.testing.assert_array_equal(c.numpy(), draw(2, 2))
    # another lot draws other values
    assert not np.array_equal(stateless_normals(like, key, step + 1)[0].numpy(), want[0])
    # add_noise: each tensor of a chunk scaled by its own group's std (per-layer bounds,
    # proportional allocation: s_j = sigma C_j)
    s = GaussianSanitizer([1.0, 3.0], 2.0, noise_allocation="proportional", seed=5)
    out = s.add_noise([tf.zeros([3]), tf.zeros([2])], [0, 1], step=step)
    z = tf.random.stateless_normal([5], seed=noise_seed(s.noise_key, step, 0), alg="philox").numpy()
    np.testing.assert_allclose(out[0].numpy(), 2.0 * 1.0 * z[:3], rtol=1e-6)
    np.testing.assert_allclose(out[1].numpy(), 2.0 * 3.0 * z[3:], rtol=1e-6)
    # the cut pieces are standard normal (with the real chunk size: one draw)
    monkeypatch.setattr(sanitizer, "NOISE_CHUNK", 1 << 22)
    z = np.concatenate(
        [t.numpy().ravel() for t in stateless_normals([tf.zeros([300, 100])] * 4, key, step)]
    )
    assert stats.kstest(z, "norm").pvalue > 1e-3
    assert not np.array_equal(z[:30000], z[30000:60000])


def test_seeded_noise_streams_of_different_seeds_do_not_overlap():
    """Seeds that differ in a few bits get unrelated keys: no (seed, lot) pair
    reuses another seed's noise (with the key (seed, 0), lot t of seed s drew
    [s XOR t, j]: seed 1's lot 0 was seed 2's lot 3)."""
    from dpfl_tf.sanitizer import noise_seed, seeded_noise_key

    draws = {}
    for seed in range(8):
        s = GaussianSanitizer(1.0, 1.0, seed=seed)
        assert s.noise_key == seeded_noise_key(seed)
        for step in range(8):
            got = tuple(int(v) for v in noise_seed(s.noise_key, step, 0).numpy())
            assert got not in draws, (seed, step, draws.get(got))
            draws[got] = (seed, step)
    # the same seed is the same stream (reproducible runs stay reproducible)
    a = GaussianSanitizer(1.0, 1.0, seed=7).add_noise(
        [tf.zeros((4,))], step=tf.constant(3, tf.int64)
    )
    b = GaussianSanitizer(1.0, 1.0, seed=7).add_noise(
        [tf.zeros((4,))], step=tf.constant(3, tf.int64)
    )
    np.testing.assert_array_equal(a[0].numpy(), b[0].numpy())
    k0, k1 = seeded_noise_key(0)
    assert k0 >= 2**40 and k1 >= 2**40  # both words carry hashed bits (p ~ 2^-22 to fail)

"""Aggregators: FedAvg weighted mean, FedMedian, per-client clipping bounds."""

import math

import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.federated.aggregators import (
    ClientNoiseDPAggregator,
    GlobalDPAggregator,
    MeanAggregator,
    MedianAggregator,
    update_norms,
)
from dpfl_tf.sanitizer import GaussianSanitizer


def _updates(n=5, seed=0, scale=3.0):
    rng = np.random.default_rng(seed)
    return [
        [
            tf.constant(rng.normal(size=(4, 3)) * scale, tf.float32),
            tf.constant(rng.normal(size=(3,)) * scale, tf.float32),
        ]
        for _ in range(n)
    ]


def _template():
    return [tf.zeros((4, 3)), tf.zeros((3,))]


def test_mean_is_the_hand_computed_weighted_average():
    ups = _updates(3)
    weights = [10.0, 30.0, 60.0]
    res = MeanAggregator().aggregate(zip(ups, weights), _template())
    for j in range(2):
        want = sum(w * u[j].numpy() for u, w in zip(ups, weights)) / 100.0
        np.testing.assert_allclose(res.update[j].numpy(), want, rtol=1e-5, atol=1e-6)
    assert res.num_clients == 3
    plain = MeanAggregator(weighted=False).aggregate(zip(ups, weights), _template())
    np.testing.assert_allclose(
        plain.update[0].numpy(), np.mean([u[0].numpy() for u in ups], axis=0), rtol=1e-5
    )


def test_median_is_coordinatewise_and_robust_to_an_outlier():
    ups = _updates(5)
    res = MedianAggregator().aggregate(((u, 1.0) for u in ups), _template())
    np.testing.assert_allclose(
        res.update[0].numpy(), np.median(np.stack([u[0].numpy() for u in ups]), axis=0)
    )
    bad = ups[:4] + [[tf.fill((4, 3), 1e6), tf.fill((3,), 1e6)]]
    robust = MedianAggregator().aggregate(((u, 1.0) for u in bad), _template())
    assert np.abs(robust.update[0].numpy()).max() < 20
    even = MedianAggregator().aggregate(((u, 1.0) for u in ups[:4]), _template())
    np.testing.assert_allclose(
        even.update[1].numpy(), np.median(np.stack([u[1].numpy() for u in ups[:4]]), axis=0)
    )
    empty = MedianAggregator().aggregate(iter(()), _template())
    assert empty.num_clients == 0 and float(tf.reduce_sum(empty.update[0])) == 0.0


def test_global_dp_clips_every_client_to_S_flat_and_per_layer():
    ups = _updates(6, scale=5.0)
    s = GaussianSanitizer(1.0, 0.0)  # no noise: the aggregate is the mean of clipped updates
    res = GlobalDPAggregator(s).aggregate(((u, 1.0) for u in ups), _template(), expected_clients=6)
    clipped = [s.clip(u) for u in ups]
    for c in clipped:
        assert np.linalg.norm(np.concatenate([t.numpy().ravel() for t in c])) <= 1.0 + 1e-5
    for j in range(2):
        np.testing.assert_allclose(
            res.update[j].numpy(), sum(c[j].numpy() for c in clipped) / 6, rtol=1e-5, atol=1e-6
        )
    # what the round reports is what the mechanism released: the bound, no statistic of
    # the raw norms (a fraction clipped would be an un-noised release outside the ledger)
    assert res.info == {"clip": 1.0}
    # per-layer: each component of each client within its own bound
    per = GaussianSanitizer([0.5, 0.2], 0.0)
    agg = GlobalDPAggregator(per)
    # with one client the sum is that client's clipped update: check the bounds on each
    for u in ups:
        single = agg.aggregate(iter([(u, 1.0)]), _template(), expected_clients=1)
        norms = update_norms(single.update)
        assert norms[0] <= 0.5 + 1e-5 and norms[1] <= 0.2 + 1e-5
    # one layer spanning both tensors (groups): one bound on their joint norm
    grouped = GlobalDPAggregator(GaussianSanitizer([0.7], 0.0), groups=[0, 0])
    single = grouped.aggregate(iter([(ups[0], 1.0)]), _template(), expected_clients=1)
    assert update_norms(single.update, [0, 0])[0] == pytest.approx(0.7, rel=1e-5)


def test_small_updates_are_not_changed_by_clipping():
    ups = _updates(2, scale=0.01)
    res = GlobalDPAggregator(GaussianSanitizer(10.0, 0.0)).aggregate(
        ((u, 1.0) for u in ups), _template(), expected_clients=2
    )
    np.testing.assert_allclose(
        res.update[0].numpy(), (ups[0][0] + ups[1][0]).numpy() / 2, rtol=1e-5
    )
    assert "fraction_clipped" not in res.info


def test_client_side_clip_bound_holds_per_upload():
    agg = ClientNoiseDPAggregator(GaussianSanitizer(0.8, 0.0))
    for u in _updates(4, scale=4.0):
        up = agg.client_transform(u)
        assert update_norms(up).__pow__(2).sum() ** 0.5 <= 0.8 + 1e-5


def test_median_clip_is_refused_and_names_adaptive_clipping():
    """The median of the raw update norms is not private: refused, with its successor."""
    with pytest.raises(
        ValueError,
        match=r"clip='median'.*not differentially private.*"
        r"use clip='adaptive'",
    ):
        GlobalDPAggregator(GaussianSanitizer(1.0, 1.0), clip="median")


def test_adaptive_clip_update_rule_by_hand():
    """C_1 = C_0 exp(-eta (b - gamma)), b = the fraction of clients with norm <= C_0
    (no update noise, a negligible count noise: the rule itself)."""
    ups = _updates(8, scale=1.0)
    norms = np.array([math.sqrt((update_norms(u) ** 2).sum()) for u in ups])
    c0 = float(np.quantile(norms, 0.3))
    agg = GlobalDPAggregator(
        GaussianSanitizer(c0, 0.0, seed=1),
        clip="adaptive",
        target_quantile=0.5,
        clip_learning_rate=0.2,
        count_stddev=1e-9,
    )
    assert agg.streaming
    res = agg.aggregate(((u, 1.0) for u in ups), _template(), expected_clients=8)
    below = float(np.mean(norms <= c0))
    assert res.info["clip"] == c0
    assert res.info["unclipped_fraction_noised"] == pytest.approx(below, abs=1e-6)
    assert agg.clip_bound == pytest.approx(c0 * math.exp(-0.2 * (below - 0.5)), rel=1e-6)
    assert res.info["clip_next"] == agg.clip_bound > c0  # too few under C_0: it grows
    assert "fraction_clipped" not in res.info  # no raw statistic is released
    # the round clipped at C_0: the mean of the clipped updates
    clipped = [GaussianSanitizer(c0, 0.0).clip(u) for u in ups]
    np.testing.assert_allclose(
        res.update[0].numpy(), sum(c[0].numpy() for c in clipped) / 8, rtol=1e-5, atol=1e-6
    )
    # the next round uses C_1
    res2 = agg.aggregate(((u, 1.0) for u in ups), _template(), expected_clients=8)
    assert res2.info["clip"] == pytest.approx(res.info["clip_next"])


def test_adaptive_clip_noise_multipliers():
    """The count's sanitizer adds N(0, sigma_b^2) (bound 1/2, multiplier 2 sigma_b); the
    update's multiplier is chosen so the pair is one Gaussian of multiplier z."""
    from dpfl_tf.privacy.events import joint_noise_multiplier

    agg = GlobalDPAggregator(GaussianSanitizer(0.5, 1.2), clip="adaptive", count_stddev=2.0)
    assert agg._count.noise_stddevs(1) == (2.0,)
    assert agg.count_noise_multiplier() == 4.0
    z_delta = agg.update_noise_multiplier()
    assert z_delta == pytest.approx((1.2**-2 - 4.0**-2) ** -0.5) and z_delta > 1.2
    assert joint_noise_multiplier([z_delta, 4.0]) == pytest.approx(1.2, rel=1e-12)
    with pytest.raises(ValueError, match=r"count_stddev must be > noise_multiplier / 2 = 0.6"):
        GlobalDPAggregator(GaussianSanitizer(0.5, 1.2), clip="adaptive", count_stddev=0.5)
    with pytest.raises(ValueError, match="needs count_stddev"):
        GlobalDPAggregator(GaussianSanitizer(0.5, 1.2), clip="adaptive")
    with pytest.raises(ValueError, match="one flat bound"):
        GlobalDPAggregator(GaussianSanitizer([0.5, 0.5], 1.2), clip="adaptive", count_stddev=2)
    with pytest.raises(ValueError, match="target_quantile must be in"):
        GlobalDPAggregator(
            GaussianSanitizer(0.5, 1.2), clip="adaptive", count_stddev=2, target_quantile=1.5
        )


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: GaussianSanitizer(0.0, 1.0), "l2_norm_clip must be > 0"),
        (lambda: GaussianSanitizer(-1.0, 1.0), "l2_norm_clip must be > 0"),
        (lambda: GlobalDPAggregator(GaussianSanitizer(1.0, 1.0), clip="mean"), "clip must be"),
        (lambda: GlobalDPAggregator("not a sanitizer"), "must be a GaussianSanitizer"),
        (
            lambda: GlobalDPAggregator(GaussianSanitizer(1.0, 1.0)).aggregate(
                iter(()), _template(), expected_clients=0
            ),
            "expected_clients must be > 0",
        ),
        (
            lambda: GlobalDPAggregator(GaussianSanitizer([1.0, 1.0, 1.0], 1.0)).aggregate(
                iter(()), _template(), expected_clients=1
            ),
            "3 bounds but the record has 2",
        ),
    ],
)
def test_bad_aggregator_inputs(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


@pytest.mark.parametrize("kind", ["fixed", "adaptive", "client"])
def test_a_non_finite_client_update_is_zeroed_not_published(kind):
    """One client's update holds NaN / inf: it contributes nothing (factor 0 applied
    with tf.where), and the released aggregate stays finite."""
    template = [tf.zeros([3]), tf.zeros([2])]
    good = [tf.ones([3]), tf.ones([2])]
    bad = [tf.constant([np.nan, 1.0, np.inf]), tf.ones([2])]
    if kind == "client":
        upload = ClientNoiseDPAggregator(GaussianSanitizer(1.0, 0.0)).client_transform(bad)
        for t in upload:
            np.testing.assert_array_equal(t.numpy(), 0.0)
        return
    extra = {"count_stddev": 1.0} if kind == "adaptive" else {}
    agg = GlobalDPAggregator(GaussianSanitizer(1.0, 0.0), clip=kind, **extra)
    result = agg.aggregate([(good, 1.0), (bad, 1.0)], template, expected_clients=2)
    flat = np.concatenate([t.numpy().ravel() for t in result.update])
    assert np.all(np.isfinite(flat))
    # no noise: the mean over 2 expected clients of the good update clipped to 1
    np.testing.assert_allclose(flat, np.ones(5) / np.sqrt(5) / 2, rtol=1e-5)

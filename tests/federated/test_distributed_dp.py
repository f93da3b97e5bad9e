"""The distributed DP mechanism: the rotation is orthogonal; the decoded secure sum is
the sum of the clipped updates plus the noise within the rounding bound; the
wrap-around happens as often as computed; dropouts leave the noise of the
survivors' shares; secure mode; parameters are validated."""

import math

import dp_accounting
import numpy as np
import pytest
from scipy import stats

from dpfl_tf import discrete_noise as dn
from dpfl_tf.federated import distributed_dp as ddp
from dpfl_tf.federated.distributed_dp import DistributedDP
from dpfl_tf.privacy import compute_epsilon


def updates(n, d, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=d) * rng.uniform(0.1, 0.1 + 3 / math.sqrt(d)) for _ in range(n)]


def test_rotation_is_orthogonal_and_blocks_keep_padding_small():
    assert ddp.block_size_for(79_400) == 16_384  # 81,920 coordinates: 3.2% padding
    assert ddp.block_size_for(531_400) == 32_768
    assert ddp.block_size_for(100) == 128
    assert ddp.block_size_for(1 << 20) == 1 << 20
    x = np.random.default_rng(1).normal(size=3000)
    y = ddp.rotate(x, 42, 4096, 1024)
    assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x))
    assert np.allclose(ddp.unrotate(y, 42, 3000, 1024), x)
    assert not np.allclose(ddp.rotate(x, 43, 4096, 1024), y)  # the seed picks D
    # a spike is spread over its block: no coordinate keeps more than 1/sqrt(B) of it
    spike = np.zeros(3000)
    spike[5] = 1.0
    assert np.abs(ddp.rotate(spike, 1, 4096, 1024)).max() == pytest.approx(1 / 32)


@pytest.mark.parametrize("mechanism", ["discrete_gaussian", "skellam"])
def test_decoded_sum_is_clipped_sum_plus_noise_within_the_rounding_bound(mechanism):
    d, m, seed = 1000, 5, 99
    dp = DistributedDP(mechanism, 20, 1.0, 1.0, m, d)
    ups = updates(m, d)
    uploads, noise, rounding = [], np.zeros(dp.padded_dimension), []
    for i, u in enumerate(ups):  # the client steps one by one ...
        src = ddp.seeded_source(7, i)
        x = ddp.rotate(dp.clip(u), seed, dp.padded_dimension, dp.block_size) * dp.scale
        r = dp.round_conditionally(x, src)
        y = dp.noise_share(src)
        assert np.linalg.norm(r) <= dp.l2_bound
        uploads.append(dp.wrap(r + y))
        noise += y
        rounding.append(r - x)
        # ... are what encode does
        assert np.array_equal(uploads[-1], dp.encode(u, seed, ddp.seeded_source(7, i)))
    total, count = dp.secure_sum(uploads)
    assert count == m and total.min() >= 0 and total.max() < 2**20
    decoded = dp.decode(total, seed)
    clipped = sum(dp.clip(u) for u in ups)
    assert all(np.linalg.norm(dp.clip(u)) <= 1.0 + 1e-12 for u in ups)
    error = decoded - clipped - ddp.unrotate(noise / dp.scale, seed, d, dp.block_size)
    bound = sum(np.linalg.norm(r) for r in rounding) / dp.scale
    assert 0 < np.linalg.norm(error) <= bound <= m * math.sqrt(dp.padded_dimension) / dp.scale
    # the error is exactly the rounding, rotated back
    assert np.allclose(error, ddp.unrotate(sum(rounding) / dp.scale, seed, d, dp.block_size))
    # the noise has the share variance: n shares, d' coordinates
    assert np.var(noise) == pytest.approx(m * dp.share_variance, rel=0.15)


def test_wrap_around_happens_as_often_as_computed():
    # no signal, 4 discrete Gaussian shares, 8 bits: P(wrap) per coordinate is exact by
    # convolving the share's pmf, matches the frequency, and is below the mechanism's bound
    dp = DistributedDP("discrete_gaussian", 8, 1.0, 1.0, 4, 4096, overflow_probability=0.5)
    half = 2000
    k = np.arange(-half, half + 1)
    one = dn.discrete_gaussian_pmf(dp.share_variance, k)
    total = one
    for _ in range(3):
        total = np.convolve(total, one)[half : 3 * half + 1]
    m2 = dp.modulus // 2
    exact = float(total[(k < -m2) | (k >= m2)].sum())
    assert 0.02 < exact < 0.3
    wrapped, coords = 0, 0
    for r in range(3):
        shares = [dp.noise_share(ddp.seeded_source(5, r, i)) for i in range(4)]
        true_sum = sum(shares)
        mod_sum, _ = dp.secure_sum(dp.wrap(y) for y in shares)
        centred = np.where(mod_sum >= m2, mod_sum - dp.modulus, mod_sum)
        wrapped += int(np.sum(centred != true_sum))
        coords += true_sum.size
        assert np.all((centred - true_sum) % dp.modulus == 0)  # off by whole moduli
    assert stats.binomtest(wrapped, coords, exact).pvalue > 1e-3
    assert exact <= dp.wrap_probability(4)
    assert dp.wrap_probability(4) <= 0.5 * (1 + 1e-6)  # share variance rounded up


@pytest.mark.parametrize("mechanism", ["discrete_gaussian", "skellam"])
def test_scale_keeps_the_wrap_bound_at_its_target(mechanism):
    dp = DistributedDP(mechanism, 16, 1.0, 2.0, 50, 79_400, min_clients=40)
    p = dp.wrap_probability()
    if mechanism == "discrete_gaussian":
        assert p == pytest.approx(1e-4, rel=1e-6)
    else:  # Skellam's tails are heavier than sub-Gaussian
        assert 1e-4 <= p < 1e-3
    assert dp.report()["norm_inflation"] < 1.01
    assert dp.bits_per_parameter == pytest.approx(16 * 81_920 / 79_400)
    low = DistributedDP(mechanism, 12, 1.0, 2.0, 50, 79_400, min_clients=40)
    assert low.report()["norm_inflation"] > 1.2  # 12 bits: rounding inflates the norm


def test_dropouts_leave_the_survivors_noise_and_are_accounted_at_the_minimum():
    d, m, n_min = 4000, 10, 6
    dp = DistributedDP("discrete_gaussian", 24, 1.0, 1.5, m, d, min_clients=n_min)
    assert dp.event().num_shares == n_min
    ups = updates(m, d, seed=3)
    for survivors in (n_min, m):
        uploads = [
            dp.encode(u, 11, ddp.seeded_source(1, survivors, i))
            for i, u in enumerate(ups[:survivors])
        ]
        total, count = dp.secure_sum(uploads)
        noise = dp.decode(total, 11) - sum(dp.clip(u) for u in ups[:survivors])
        # central noise (z c)^2 with the fewest shares, more with more survivors
        target = 1.5**2 * survivors / n_min
        assert np.var(noise) * dp.padded_dimension / d == pytest.approx(target, rel=0.1)
    full = DistributedDP("discrete_gaussian", 24, 1.0, 1.5, m, d, min_clients=m)
    assert compute_epsilon(dp.event(), 1e-5, "rdp") > compute_epsilon(full.event(), 1e-5, "rdp")


def test_secure_source_draws_fresh_rounding_and_noise():
    dp = DistributedDP("discrete_gaussian", 16, 1.0, 1.0, 3, 512)
    u = updates(1, 512)[0]
    a = dp.encode(u, 5, dn.SecureSource())
    b = dp.encode(u, 5, dn.SecureSource())
    assert not np.array_equal(a, b)
    total, _ = dp.secure_sum([a])
    assert np.linalg.norm(dp.decode(total, 5) - dp.clip(u)) < 10 * math.sqrt(512)


def test_events_calibration_and_errors():
    dp = DistributedDP("skellam", 16, 0.5, 2.0, 50, 10_000, min_clients=45)
    event = dp.round_event("fixed_size", dataset_size=1000, lot_size=50)
    assert isinstance(event, dp_accounting.SampledWithoutReplacementDpEvent)
    assert event.event.l2_sensitivity == pytest.approx(2 * dp.l2_bound)
    with pytest.raises(ValueError, match="fixed-size client sampling only"):
        dp.round_event("poisson", sampling_rate=0.05)
    with pytest.raises(ValueError, match="lot_size .30. must equal clients_per_round .50."):
        dp.round_event("fixed_size", dataset_size=1000, lot_size=30)
    tuned = dp.calibrated(4.0, 1e-5, 30, 1000, tolerance=1e-3)
    eps = compute_epsilon(
        dp_accounting.SelfComposedDpEvent(
            tuned.round_event("fixed_size", dataset_size=1000, lot_size=50), 30
        ),
        1e-5,
        "rdp",
    )
    assert 3.95 < eps <= 4.0
    assert tuned.noise_multiplier != dp.noise_multiplier
    bad = [
        ({"bits": 1}, "bits must be a whole number >= 2, got 1"),
        ({"bits": 31}, r"bits must be in \[2, 30\]"),
        ({"mechanism": "binomial"}, "mechanism must be one of discrete_gaussian, skellam"),
        ({"min_clients": 51}, r"min_clients must be <= clients_per_round \(50\), got 51"),
        ({"noise_multiplier": 0}, "noise_multiplier must be > 0, got 0"),
        ({"beta": 1.0}, r"beta must be in \[0, 1\), got 1.0"),
        ({"block_size": 1000}, "block_size must be a power of two, got 1000"),
        ({"bits": 4}, "bits=4 is too few for 50 clients per round"),
        (
            {"bits": 8, "noise_multiplier": 1e-4, "mechanism": "ddg"},
            "discrete Gaussian shares would have stddev",
        ),
    ]
    base = dict(
        mechanism="skellam",
        bits=16,
        l2_norm_clip=0.5,
        noise_multiplier=2.0,
        clients_per_round=50,
        dimension=10_000,
    )
    for change, message in bad:
        with pytest.raises(ValueError, match=message):
            DistributedDP(**{**base, **change})
    with pytest.raises(ValueError, match="the update has 9 parameters"):
        dp.clip(np.ones(9))
    assert np.array_equal(dp.clip(np.full(10_000, np.nan)), np.zeros(10_000))


# ---------------------------------------------------------------------------
# In the federated loop (simulated secure sum)


def _config(**kw):
    from dpfl_tf.federated.runner import FederatedConfig

    base = dict(
        dp="distributed",
        clients=20,
        clients_per_round=10,
        min_clients=7,
        dropout_rate=0.1,
        rounds=3,
        hidden=(16,),
        noise_multiplier=1.0,
        noise_seed=5,
        partition="iid",
        bits=16,
    )
    base.update(kw)
    return FederatedConfig(**base)


def test_federated_rounds_decode_the_sum_and_report_both_guarantees(mnist_small):
    from dpfl_tf.federated.runner import run_federated

    cfg = _config()
    a = run_federated(cfg, mnist_small, progress=False)
    b = run_federated(cfg, mnist_small, progress=False)
    assert [h["accuracy"] for h in a["history"]] == [h["accuracy"] for h in b["history"]]
    assert a["mechanism"] == "distributed_discrete_gaussian" and a["bits"] == 16
    privacy = a["privacy"]
    assert privacy["distributed"]["min_clients"] == 7
    assert "fixed-size(L=10 of N=20) distributed discrete Gaussian" in privacy["round_event"]
    # the server knows who took part: no amplification, so more than the released model
    assert privacy["against_server"]["epsilon"] > a["epsilon"] > 0
    assert all(h["info"]["uploads"] <= 10 for h in a["history"])
    assert a["bits_per_parameter"] == pytest.approx(
        16 * privacy["distributed"]["padded_dimension"] / privacy["distributed"]["dimension"]
    )


def test_the_release_is_the_mean_of_the_clipped_updates_plus_noise(mnist_small):
    """One round by hand: the server's new weights are w + decode(secure sum) / n."""
    from dpfl_tf.federated.runner import build_server

    server, _ = build_server(
        _config(noise_multiplier=0.05, bits=24, dropout_rate=0.0, min_clients=10),
        mnist_small,
        progress=False,
    )
    agg = server.aggregator
    w0 = server.trainer.get_weights()
    t, selected = server.open_round()
    deltas = [server.client_upload(int(k), w0, t, client_step=False)[0] for k in selected]
    clipped = sum(agg.mechanism.clip(ddp.flatten(d)) for d in deltas) / len(deltas)
    uploads = [(agg.client_transform(d), 1.0) for d in deltas]
    result = agg.aggregate(uploads, w0, expected_clients=10)
    got = ddp.flatten([np.asarray(u) for u in result.update])
    noise_std = 0.05 * 1.0 / len(deltas)  # z c / n per coordinate
    assert np.std(got - clipped) == pytest.approx(noise_std, rel=0.1)


def test_secure_mode_in_the_federated_loop(mnist_small):
    from dpfl_tf.federated.runner import FederatedConfig, run_federated

    with pytest.raises(ValueError, match="refuses a seed"):
        _config(secure_mode=True)
    out = run_federated(
        _config(secure_mode=True, noise_seed=None, rounds=1), mnist_small, progress=False
    )
    assert out["privacy"]["secure_mode"] is True
    from dpfl_tf.federated.runner import build_server

    server, _ = build_server(
        _config(secure_mode=True, noise_seed=None), mnist_small, progress=False
    )
    assert isinstance(server.aggregator._source, dn.SecureSource)
    with pytest.raises(ValueError, match="refuses a seed"):
        server.aggregator.reseed(1)
    for bad, message in [
        (dict(sampling="poisson"), "needs sampling='fixed_size'"),
        (dict(min_clients=None), "needs min_clients"),
        (dict(min_clients=11), r"min_clients must be <= the clients per round"),
        (dict(ddp_mechanism="laplace"), "ddp_mechanism must be one of"),
        (dict(dp="global"), "is a setting of dp='distributed'"),
    ]:
        with pytest.raises(ValueError, match=message):
            _config(**bad)
    assert FederatedConfig(dp="distributed").noise_multiplier == 2.0


def test_the_command_line_takes_the_distributed_flags():
    import argparse

    from dpfl_tf.federated.cli import add_federated_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_federated_parser(parser.add_subparsers())
    args = parser.parse_args(
        [
            "federated",
            "--dp",
            "distributed",
            "--ddp-mechanism",
            "skellam",
            "--bits",
            "12",
            "-m",
            "50",
            "--min-clients",
            "40",
            "--dropout-rate",
            "0.1",
        ]
    )
    c = config_from_args(args)
    assert (c.dp.value, c.ddp_mechanism, c.bits, c.min_clients, c.dropout_rate) == (
        "distributed",
        "skellam",
        12,
        40,
        0.1,
    )
    bad = parser.parse_args(["federated", "--dp", "distributed", "--bits", "40"])
    with pytest.raises(ValueError, match="bits must be in"):
        config_from_args(bad)

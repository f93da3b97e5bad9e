"""Client-level DP: noise scales (KS tests that can fail), the DP-FedAvg event,
one ledger event per round and the stop rule."""

import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from dpfl_tf.federated.aggregators import ClientNoiseDPAggregator, GlobalDPAggregator
from dpfl_tf.federated.client import LocalTrainer
from dpfl_tf.federated.local_dp import gaussian_upload_report
from dpfl_tf.federated.partition import iid_partition, unequal_partition
from dpfl_tf.federated.server import ClientSampling, FederatedServer
from dpfl_tf.privacy import (
    ReplaceOneGaussianDpEvent,
    compute_delta,
    compute_epsilon,
    gaussian_step_event,
)
from dpfl_tf.privacy.events import ReplaceOneGaussianDpEvent
from dpfl_tf.sanitizer import GaussianSanitizer
from tests.federated.conftest import tiny_model

SIZE = 20000  # coordinates pooled for the KS tests


def _zero_uploads(m):
    return [([tf.zeros((SIZE // 2,)), tf.zeros((SIZE // 2,))], 1.0) for _ in range(m)]


def _ks(values, std):
    return stats.kstest(np.asarray(values).ravel() / std, "norm").pvalue


def _global_noise(sigma, clip, m, seed=1):
    agg = GlobalDPAggregator(GaussianSanitizer(clip, sigma, seed=seed))
    res = agg.aggregate(iter(_zero_uploads(m)), [tf.zeros((SIZE // 2,))] * 2, expected_clients=m)
    return np.concatenate([t.numpy() for t in res.update])


def test_global_dp_noise_is_sigma_S_over_m():
    sigma, clip, m = 1.2, 0.5, 8
    want = sigma * clip / m  # N(0, sigma^2 S^2) on the sum, divided by m
    noise = _global_noise(sigma, clip, m)
    assert _ks(noise, want) > 1e-3
    assert _ks(noise, want * 1.1) < 1e-6  # a 10% wrong scale is rejected
    assert _ks(_global_noise(sigma * 1.1, clip, m), want) < 1e-6  # and a wrong sigma


def test_client_side_noise_sum_has_std_z_sqrt_m_S():
    z, clip, m = 0.7, 2.0, 9
    agg = ClientNoiseDPAggregator(GaussianSanitizer(clip, z, seed=3))
    uploads = [(agg.client_transform(u), w) for u, w in _zero_uploads(m)]
    single = np.concatenate([t.numpy() for t in uploads[0][0]])
    assert _ks(single, z * clip) > 1e-3  # each upload: N(0, z^2 S^2)
    assert _ks(single, z * clip * 1.1) < 1e-6
    res = agg.aggregate(iter(uploads), [tf.zeros((SIZE // 2,))] * 2, expected_clients=m)
    total = np.concatenate([t.numpy() for t in res.update]) * m  # the sum of uploads
    assert _ks(total, z * math.sqrt(m) * clip) > 1e-3
    assert _ks(total, z * clip) < 1e-6  # not the single-upload scale


def test_client_side_noise_events():
    z, K, m = 0.8, 1000, 50
    agg = ClientNoiseDPAggregator(GaussianSanitizer(1.0, z))
    event = agg.round_event(1, "fixed_size", dataset_size=K, lot_size=m)
    assert event == gaussian_step_event(z * math.sqrt(m), "fixed_size", dataset_size=K, lot_size=m)
    assert event == dp_accounting.SampledWithoutReplacementDpEvent(
        K, m, dp_accounting.GaussianDpEvent(z * math.sqrt(m) / 2)
    )
    assert agg.upload_event(1) == ReplaceOneGaussianDpEvent(z / 2)  # replace-one
    # per-layer with proportional noise: z is the sanitizer's effective multiplier
    per = ClientNoiseDPAggregator(
        GaussianSanitizer([1.0, 1.0, 1.0], z, noise_allocation="proportional")
    )
    assert per.aggregate_noise_multiplier(3, m) == pytest.approx(z / math.sqrt(3) * math.sqrt(m))
    with pytest.raises(ValueError, match="fixed-size client sampling only"):
        agg.round_event(1, "poisson", sampling_rate=0.05)
    # the released model is much more private than each upload is against the server
    released = compute_epsilon(dp_accounting.SelfComposedDpEvent(event, 100), 1e-5, "rdp")
    upload = compute_epsilon(dp_accounting.SelfComposedDpEvent(agg.upload_event(1), 5), 1e-5, "rdp")
    assert released < upload


@pytest.fixture(scope="module")
def small_setup(mnist_small):
    model = tiny_model(hidden=8)
    x, y = mnist_small.x_train[:1000], mnist_small.y_train[:1000]
    trainer = LocalTrainer(model, x, y, local_epochs=1, batch_size=25, learning_rate=0.1)
    return trainer, iid_partition(len(y), 20, seed=0), mnist_small


def _server(setup, aggregator, **kw):
    trainer, partition, ds = setup
    defaults = dict(
        sampling=ClientSampling("poisson", clients_per_round=10),
        test_data=(ds.x_test[:200], ds.y_test[:200]),
        progress=False,
        seed=0,
    )
    defaults.update(kw)
    return FederatedServer(trainer, partition, aggregator, **defaults)


def test_ledger_has_one_event_per_round_and_the_stop_rule_fires_on_time(small_setup):
    sigma, q, eps, delta_max = 1.5, 0.5, 5.0, 1e-3
    event = gaussian_step_event(sigma, "poisson", sampling_rate=q)
    # by hand: the last T with delta(eps) <= delta_max after T rounds
    deltas = [
        compute_delta(dp_accounting.SelfComposedDpEvent(event, t), eps, "moments")
        for t in range(1, 30)
    ]
    t_star = next(t for t, d in enumerate(deltas, 1) if d > delta_max) - 1
    assert 2 <= t_star <= 20
    server = _server(
        small_setup,
        GlobalDPAggregator(GaussianSanitizer(1.0, sigma)),
        target_epsilon=eps,
        delta_max=delta_max,
        noise_seed=0,
    )
    server.run(100)
    assert server.rounds_done == t_star
    assert server.ledger.count() == t_star
    assert server.ledger.entries == [
        {
            "event": "Poisson(q=0.5) Gaussian(sigma=1.5) (add/remove-one)",
            "count": t_star,
            "label": "federated round",
        }
    ]
    assert "privacy budget" in server.stop_reason
    for rec, d in zip(server.history, deltas):
        assert rec.delta == pytest.approx(d, rel=1e-9)
    assert server.history[-1].epsilon == pytest.approx(
        compute_epsilon(dp_accounting.SelfComposedDpEvent(event, t_star), delta_max, "moments")
    )
    assert server.privacy_report()["epsilon"] <= eps
    # the stop rule checks before the round: one more round would have exceeded
    assert server.delta_after(1) > delta_max >= server.delta_after(0)


def test_fixed_size_sampling_is_accounted_with_replace_one(small_setup):
    agg = GlobalDPAggregator(GaussianSanitizer(1.0, 2.0))
    fixed = ClientSampling("fixed_size", clients_per_round=5)
    with pytest.raises(ValueError, match="'rdp' only"):
        _server(small_setup, agg, sampling=fixed, delta_max=1e-3, accountant="moments")
    server = _server(small_setup, agg, sampling=fixed, delta_max=1e-3, accountant="rdp")
    server.run(2)
    assert all(r.clients == 5 for r in server.history)
    assert server.round_event == dp_accounting.SampledWithoutReplacementDpEvent(
        20, 5, dp_accounting.GaussianDpEvent(1.0)
    )
    assert server.privacy_report()["relation"] == "replace-one client (fixed-size client sampling)"


def test_one_upload_against_the_server_is_replace_one_gaussian_z_over_2():
    """The server sees every upload and who sent it, so the only neighbouring
    relation one upload can be private under is replace-one: one clipped update
    (norm <= S) replaced by another moves it by up to 2S, Gaussian(z/2).  At
    z = 1, delta = 1e-5 (RDP) that is 10.73, not Gaussian(z)'s 4.73."""
    z, delta = 1.0, 1e-5
    agg = ClientNoiseDPAggregator(GaussianSanitizer(1.0, z))
    assert agg.upload_event(1) == ReplaceOneGaussianDpEvent(0.5)
    rep = gaussian_upload_report(z, 1, delta=delta, accountant="rdp")
    assert rep.accountant_epsilon_per_upload == pytest.approx(10.7255, abs=1e-3)
    assert rep.accountant_epsilon_per_upload == pytest.approx(
        compute_epsilon(dp_accounting.GaussianDpEvent(0.5), delta, "rdp")
    )
    assert rep.relation == "replace-one (one client's update replaced)"
    # z = 0: the upload is the clipped update itself, eps = inf
    bare = gaussian_upload_report(0.0, 2, delta=delta)
    assert math.isinf(bare.epsilon_per_upload) and math.isinf(bare.epsilon_total)


def test_client_dp_run_reports_server_view_and_released_model(small_setup):
    agg = ClientNoiseDPAggregator(GaussianSanitizer(1.0, 1.0))
    server = _server(
        small_setup,
        agg,
        sampling=ClientSampling("fixed_size", clients_per_round=5),
        delta_max=1e-3,
        accountant="rdp",
    )
    server.run(3)
    rep = server.privacy_report()
    assert rep["released_model_noise_multiplier"] == pytest.approx(math.sqrt(5))
    assert rep["relation"] == "replace-one client (fixed-size client sampling)"
    srv = rep["against_server"]
    assert srv["upload_event"] == "Gaussian(sigma=0.5) (replace-one)"
    assert srv["relation"] == "replace-one (one client's update replaced)"
    n_max = int(server.participations.max())
    assert srv["max_participations"] == n_max >= 1
    assert server.participations.sum() == 15
    # the one function that computes a client's upload guarantee
    want = gaussian_upload_report(1.0, n_max, delta=1e-3, accountant="rdp")
    assert srv["epsilon"] == pytest.approx(want.accountant_epsilon_total, rel=1e-12)
    assert srv["epsilon_per_upload"] == pytest.approx(want.accountant_epsilon_per_upload, rel=1e-12)
    assert srv["epsilon"] > rep["epsilon"]


@pytest.fixture(scope="module")
def real_updates(mnist_small):
    """30 clients' real local updates (one epoch of local SGD on MNIST from one model;
    unequal client sizes, so the norms spread)."""
    trainer = LocalTrainer(
        tiny_model(hidden=16, seed=2),
        mnist_small.x_train[:1500],
        mnist_small.y_train[:1500],
        local_epochs=1,
        batch_size=10,
        learning_rate=0.1,
    )
    partition = unequal_partition(1500, 30, seed=1)
    w0 = trainer.get_weights()
    rng = np.random.default_rng(0)
    ups = [list(trainer.train(w0, partition.client(k), rng)) for k in range(30)]
    trainer.set_weights(w0)
    norms = np.array([math.sqrt(sum(float(tf.reduce_sum(t * t)) for t in u)) for u in ups])
    return ups, norms, w0


@pytest.mark.parametrize("gamma", [0.2, 0.5, 0.8])
@pytest.mark.parametrize("start", [0.05, 20.0])
def test_adaptive_clip_moves_to_the_target_quantile_of_real_update_norms(
    real_updates, gamma, start
):
    """Andrew et al. 2021: from far below or far above, C_t settles near the
    gamma-quantile of the clients' update norms (noised count, sigma_b = 1)."""
    ups, norms, w0 = real_updates
    c0 = start * float(np.median(norms))
    agg = GlobalDPAggregator(
        GaussianSanitizer(c0, 1.0, seed=3),
        clip="adaptive",
        target_quantile=gamma,
        clip_learning_rate=0.5,
        count_stddev=1.0,
    )
    bounds = []
    for _ in range(45):
        agg.aggregate(((u, 1.0) for u in ups), w0, expected_clients=len(ups))
        bounds.append(agg.clip_bound)
    settled = np.median(bounds[-10:])
    low, high = np.quantile(norms, [gamma - 0.1, gamma + 0.1])
    assert low <= settled <= high, (gamma, start, settled, np.quantile(norms, gamma))
    assert abs(np.mean(norms <= settled) - gamma) <= 0.1


def test_adaptive_clip_round_is_one_sampled_event_over_both_releases(small_setup, tmp_path):
    """The ledger holds the update release and the count release, under the one
    sampling they share; epsilon is dp-accounting's RDP on that composed event
    and equals a fixed-clip round's at the joint multiplier."""
    from dp_accounting import rdp

    z, sigma_b, q, delta = 1.0, 2.0, 0.5, 1e-3
    agg = GlobalDPAggregator(GaussianSanitizer(0.05, z), clip="adaptive", count_stddev=sigma_b)
    z_delta = (z**-2 - (2 * sigma_b) ** -2) ** -0.5
    server = _server(small_setup, agg, delta_max=delta, accountant="rdp", noise_seed=4)
    server.run(2)
    event = dp_accounting.PoissonSampledDpEvent(
        q,
        dp_accounting.ComposedDpEvent(
            [dp_accounting.GaussianDpEvent(z_delta), dp_accounting.GaussianDpEvent(2 * sigma_b)]
        ),
    )
    assert server.round_event == event
    assert server.ledger.event == dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(event, 2)]
    )
    assert server.ledger.entries[0]["event"] == (
        f"Poisson(q=0.5) [Gaussian(sigma={z_delta:g}) + Gaussian(sigma=4)] (add/remove-one)"
    )
    acc = rdp.RdpAccountant()
    acc.compose(dp_accounting.SelfComposedDpEvent(event, 2))
    assert server.epsilon() == pytest.approx(acc.get_epsilon(delta), rel=1e-12)
    fixed = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), 2
    )
    for kind in ("rdp", "moments", "pld"):  # the joint multiplier is z
        assert compute_epsilon(server.ledger.event, delta, kind) == pytest.approx(
            compute_epsilon(fixed, delta, kind), rel=1e-9
        )
    clips = [r.info["clip"] for r in server.history]
    assert clips[0] == 0.05 and clips[1] == pytest.approx(server.history[0].info["clip_next"])
    rep = server.privacy_report()
    assert rep["clipping"]["mode"].startswith("adaptive")
    assert rep["clipping"]["update_noise_multiplier"] == pytest.approx(z_delta)
    # the bound is round state: checkpointed and restored
    server.save_checkpoint(tmp_path)
    again = _server(
        small_setup,
        GlobalDPAggregator(GaussianSanitizer(0.05, z), clip="adaptive", count_stddev=sigma_b),
        delta_max=delta,
        accountant="rdp",
        noise_seed=4,
    )
    again.load_checkpoint(tmp_path)
    assert again.aggregator.clip_bound == agg.clip_bound != 0.05


def test_adaptive_clip_with_an_exact_count_reports_infinite_epsilon(small_setup):
    agg = GlobalDPAggregator(GaussianSanitizer(0.5, 1.0), clip="adaptive", count_stddev=0.0)
    assert agg.round_event(1, "poisson", sampling_rate=0.5) == dp_accounting.NonPrivateDpEvent()
    server = _server(small_setup, agg, delta_max=1e-3, noise_seed=0)
    server.run(1)
    assert math.isinf(server.epsilon())
    rep = server.privacy_report()
    assert rep["epsilon"] is None and rep["epsilon_is_infinite"] is True


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(sampling=ClientSampling("fixed_size", clients_per_round=21)),
            r"clients_per_round \(m=21\) must be <= the number of clients \(K=20\)",
        ),
        (dict(delta_max=0.06), r"delta_max must be < 1/K = 0.05"),
        (dict(delta_max=None), "needs delta_max"),
        (dict(delta_max=0.0), "delta_max must be in"),
        (dict(target_epsilon=-1.0, delta_max=1e-3), "target_epsilon must be > 0"),
    ],
)
def test_bad_server_inputs(small_setup, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _server(small_setup, GlobalDPAggregator(GaussianSanitizer(1.0, 1.0)), **kwargs)


def test_bad_sampling_inputs():
    with pytest.raises(ValueError, match="exactly one of clients_per_round and fraction"):
        ClientSampling("poisson")
    with pytest.raises(ValueError, match="fraction must be in"):
        ClientSampling("poisson", fraction=1.5)
    with pytest.raises(
        ValueError, match="client sampling must be 'poisson', 'fixed_size' or 'cyclic_poisson'"
    ):
        ClientSampling("shuffle", clients_per_round=3)
    assert ClientSampling("fixed_size", fraction=0.1).clients_for(1000) == 100


def _bn_trainer(mnist_small, trainable=True):
    import keras

    keras.utils.set_random_seed(0)
    bn = keras.layers.BatchNormalization(name="bn")
    bn.trainable = trainable
    model = keras.Sequential(
        [
            keras.Input((28, 28)),
            keras.layers.Flatten(),
            keras.layers.Dense(8),
            bn,
            keras.layers.Dense(10),
        ]
    )
    x, y = mnist_small.x_train[:400], mnist_small.y_train[:400]
    return LocalTrainer(model, x, y, local_epochs=1, batch_size=20, learning_rate=0.1), bn


def test_batch_norm_is_refused_under_client_level_dp(mnist_small):
    """BatchNormalization's moving mean/variance are updated from the clients' raw
    data in local training, never clipped or noised, and used by the released
    model's evaluation: client-level DP refuses such models."""
    from dpfl_tf.federated.aggregators import MeanAggregator
    from dpfl_tf.federated.local_dp import DomainPolicy, DuchiMechanism, LocalDPUpload

    trainer, bn = _bn_trainer(mnist_small)
    partition = iid_partition(400, 4, seed=0)
    kw = dict(
        sampling=ClientSampling("fixed_size", clients_per_round=2),
        test_data=None,
        progress=False,
        delta_max=1e-3,
        accountant="rdp",
    )
    # why: one non-private round moves the statistics with the clients' data
    before = bn.moving_mean.numpy().copy()
    plain = FederatedServer(
        trainer,
        partition,
        MeanAggregator(),
        sampling=kw["sampling"],
        test_data=None,
        progress=False,
    )
    plain.run(1)
    assert not np.allclose(bn.moving_mean.numpy(), before)
    for aggregator, extra in [
        (GlobalDPAggregator(GaussianSanitizer(1.0, 1.0)), {}),
        (ClientNoiseDPAggregator(GaussianSanitizer(1.0, 1.0)), {}),
        (
            MeanAggregator(),
            dict(
                local_dp=LocalDPUpload(DuchiMechanism(1.0), DomainPolicy.clip(1.0)), delta_max=None
            ),
        ),
    ]:
        with pytest.raises(
            ValueError,
            match=r"layer 'bn' is BatchNormalization.*moving "
            r"mean and variance.*LayerNormalization",
        ):
            FederatedServer(trainer, partition, aggregator, **{**kw, **extra})
    # frozen (trainable=False: inference mode, statistics never updated) is fine
    frozen, _ = _bn_trainer(mnist_small, trainable=False)
    FederatedServer(frozen, partition, GlobalDPAggregator(GaussianSanitizer(1.0, 1.0)), **kw)


# --------------------------------------------------------------------------
# secure mode


def test_secure_mode_noise_has_the_right_scale():
    """Secure draws (os.urandom-keyed, four-draw float64 normals): the released
    noise is still N(0, sigma^2 S^2)/m (Global DP) and N(0, z^2 S^2) per upload
    (DP-FedAvg); a 10% wrong scale is rejected."""
    sigma, clip, m = 1.2, 0.5, 8
    agg = GlobalDPAggregator(GaussianSanitizer(clip, sigma, secure_mode=True), secure_mode=True)
    res = agg.aggregate(iter(_zero_uploads(m)), [tf.zeros((SIZE // 2,))] * 2, expected_clients=m)
    noise = np.concatenate([t.numpy() for t in res.update])
    want = sigma * clip / m
    # unseedable draws: a threshold of 1e-3 fails one run in a thousand by chance (it
    # did in a whole-suite run); 1e-6 makes that negligible, and a 10% wrong scale still
    # gives p below it at this size (8,000 simulated draws of 20,000: at most 6e-7)
    assert _ks(noise, want) > 1e-6
    assert _ks(noise, want * 1.1) < 1e-6 and _ks(noise, want / 1.1) < 1e-6
    z = 0.7
    client = ClientNoiseDPAggregator(GaussianSanitizer(2.0, z, secure_mode=True), secure_mode=True)
    single = np.concatenate([t.numpy() for t in client.client_transform(_zero_uploads(1)[0][0])])
    assert _ks(single, z * 2.0) > 1e-6
    assert _ks(single, z * 2.0 * 1.1) < 1e-6
    # adaptive clipping's count release is secure too
    adaptive = GlobalDPAggregator(
        GaussianSanitizer(clip, sigma, secure_mode=True),
        clip="adaptive",
        count_stddev=2.0,
        secure_mode=True,
    )
    assert adaptive._count.secure_mode and adaptive._round_sanitizer().secure_mode


def test_secure_mode_refuses_seeds(small_setup):
    with pytest.raises(ValueError, match="secure_mode=True refuses a seed"):
        GaussianSanitizer(1.0, 1.0, seed=3, secure_mode=True)
    agg = GlobalDPAggregator(GaussianSanitizer(1.0, 1.0, secure_mode=True), secure_mode=True)
    with pytest.raises(ValueError, match=r"secure_mode=True refuses a seed \(got seed=5\)"):
        agg.reseed(5)
    with pytest.raises(ValueError, match="needs the sanitizer built with secure_mode=True"):
        GlobalDPAggregator(GaussianSanitizer(1.0, 1.0), secure_mode=True)
    with pytest.raises(ValueError, match="needs the sanitizer built with secure_mode=True"):
        ClientNoiseDPAggregator(GaussianSanitizer(1.0, 1.0), secure_mode=True)
    with pytest.raises(ValueError, match=r"refuses a seed \(got noise_seed=2\)"):
        _server(small_setup, agg, delta_max=1e-3, noise_seed=2, secure_mode=True)
    with pytest.raises(ValueError, match="needs the aggregator in secure mode"):
        _server(
            small_setup,
            GlobalDPAggregator(GaussianSanitizer(1.0, 1.0)),
            delta_max=1e-3,
            secure_mode=True,
        )
    from dpfl_tf.federated.runner import FederatedConfig

    with pytest.raises(ValueError, match=r"refuses a seed \(got noise_seed=1\)"):
        FederatedConfig(dp="global", secure_mode=True, noise_seed=1)
    with pytest.raises(ValueError, match="noise of dp='distributed'; got dp='local'"):
        FederatedConfig(dp="local", secure_mode=True)


def test_secure_mode_samples_clients_from_os_entropy(small_setup):
    """Without secure mode a round's clients follow (seed, round, key); in secure
    mode every draw is fresh OS randomness, with the right inclusion rates."""
    agg = GlobalDPAggregator(GaussianSanitizer(1.0, 1.0, secure_mode=True), secure_mode=True)
    server = _server(
        small_setup,
        agg,
        delta_max=1e-3,
        secure_mode=True,
        sampling=ClientSampling("poisson", clients_per_round=5),
    )  # q = 1/4
    plain = _server(
        small_setup, GlobalDPAggregator(GaussianSanitizer(1.0, 1.0)), delta_max=1e-3, noise_seed=1
    )
    assert [tuple(plain.sample_clients(plain.round_rng(0))) for _ in range(3)] == [
        tuple(plain.sample_clients(plain.round_rng(0)))
    ] * 3
    draws = [server.sample_clients(server.round_rng(0)) for _ in range(2000)]
    assert len({tuple(d) for d in draws[:20]}) > 15  # not a function of the round
    counts = np.bincount(np.concatenate(draws), minlength=20)
    # each client joins with q = 0.25: 2000 draws, binomial sd ~ 19
    assert np.all(np.abs(counts - 500) < 100), counts
    fixed = ClientSampling("fixed_size", clients_per_round=5)
    sets = [fixed.sample(None, 20) for _ in range(2000)]
    assert all(len(set(x)) == 5 and list(x) == sorted(x) for x in sets)
    counts = np.bincount(np.concatenate(sets), minlength=20)
    assert np.all(np.abs(counts - 500) < 100), counts
    server.run(1)
    assert server.privacy_report()["secure_mode"] is True

"""CI canary audit (about a minute on 2 cores): the library must never show a
lower bound above its claimed epsilon (eps-DP test everywhere, GDP test where
the claim is a Gaussian mechanism), and every broken DP-SGD copy of
experiments/broken_dpsgd.py must be caught -- noise x 1/2 included, by the GDP
test on 10,000 canaries pooled from two runs (caught in 99 of 100 simulated
audits of an exactly Gaussian canary with that leak).  Real MNIST (a slice),
real TensorFlow training, seeded noise and coins (reproducible)."""

import functools
import importlib.util
import math
import pathlib
import warnings

import keras
import numpy as np
import pytest

from dpfl_tf.audit import DiracCanaries, MislabelledCanaries, epsilon_lower_bound_from_scores
from dpfl_tf.keras import DPSGD, DPModel
from dpfl_tf.privacy.calibration import calibrate_noise_multiplier
from dpfl_tf.privacy.events import dp_sgd_event

# what XLA and TensorFlow compile here stays until the process ends (+0.6 GB in a
# whole-suite worker): the file runs in a process of its own (tests/isolation.py)
pytestmark = pytest.mark.isolated

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "broken_dpsgd", ROOT / "experiments" / "broken_dpsgd.py"
)
broken = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(broken)

DELTA = 1e-5
STEPS = 10
M = 2000


@pytest.fixture(scope="module")
def mnist_slice():
    from dpfl_tf.data.mnist import mnist

    data = mnist()
    rng = np.random.default_rng(0)
    idx = rng.choice(len(data.y_train), 300, replace=False)
    bb = rng.choice(len(data.y_test), 400, replace=False)
    flat = lambda a: a.reshape(len(a), -1).astype(np.float32) / 255.0  # noqa: E731
    return (
        flat(data.x_train[idx]),
        data.y_train[idx].astype(np.int64),
        flat(data.x_test[bb]),
        data.y_test[bb].astype(np.int64),
    )


def _train(model_cls, canaries, x, y, *, sigma, sampling, seed, lr=1.0, black_box=None):
    """Trains softmax regression on x, y with `model_cls`; returns (dp, observer)."""
    keras.utils.set_random_seed(seed)
    n = len(y)
    lot, epochs = (n, STEPS) if sampling == "full_batch" else (n // 2, STEPS // 2)
    model = keras.Sequential(
        [keras.Input((canaries.total_dim,)), keras.layers.Dense(10, kernel_initializer="zeros")]
    )
    dp = model_cls(model, accountant="pld")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # seeded noise: not for deployment
        # distinct seeds, distinct noise (the key is hashed from the seed); spread
        # above bit 20 as in experiments/audit_canary.py
        opt = DPSGD(lr, l2_norm_clip=1.0, noise_multiplier=sigma, seed=(seed + 100) << 20)
    dp.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    observer = canaries.observer(dp)
    dp.fit(
        x,
        y,
        lot_size=lot,
        batch_size=math.ceil(lot / 16),
        epochs=epochs,
        sampling=sampling,
        sampling_seed=seed,
        verbose=0,
        callbacks=[observer],
        log_train_metrics=False,
        accountant="rdp",
    )  # fast logs; claims below are PLD's
    return dp, observer


@functools.lru_cache(maxsize=None)
def _sigma(eps, sampling):
    kw = {"sampling_rate": 0.5} if sampling == "poisson" else {}
    return calibrate_noise_multiplier(
        eps, DELTA, lambda s: dp_sgd_event(s, STEPS, sampling, **kw), "pld"
    )[0]


def _audit(
    model_cls, eps, sampling, mnist_slice, seed=0, black_box=False, method="eps_dp", m=M, raw=False
):
    x, y, xb, yb = mnist_slice
    canaries = DiracCanaries(m, input_dim=784, num_classes=10, value=10.0, seed=seed)
    x_train, y_train = canaries.training_data(x, y)
    bb = None
    if black_box:
        bb = MislabelledCanaries(canaries.pad(xb), yb, num_classes=10, seed=seed + 1)
        xi, yi = bb.included()
        x_train, y_train = np.concatenate([x_train, xi]), np.concatenate([y_train, yi])
    dp, observer = _train(
        model_cls,
        canaries,
        x_train,
        y_train,
        sigma=_sigma(eps, sampling),
        sampling=sampling,
        seed=seed,
    )
    claimed = dp.epsilon(DELTA, "pld")
    assert claimed == pytest.approx(eps, abs=0.01)
    assert observer.lots_observed == dp.lots_computed == STEPS
    statistic = "sum" if sampling == "full_batch" else "spread"
    if raw:
        return claimed, observer.scores(statistic), canaries.coins()
    result = canaries.audit(observer, delta=DELTA, statistic=statistic, method=method)
    bb_result = bb.audit(dp, delta=DELTA) if bb is not None else None
    return claimed, result, bb_result


# -- the audit's parts ------------------------------------------------------------------
def test_projection_is_the_clipped_canary_gradient(mnist_slice):
    # without noise an included canary's row moves by lr * C * a / sqrt(a^2 + 1) / L
    # along its direction each lot (its clipped gradient's share in its row;
    # the rest is in the bias), an excluded canary's row does not move at all
    x, y, *_ = mnist_slice
    canaries = DiracCanaries(50, input_dim=784, num_classes=10, value=10.0, seed=3)
    x_train, y_train = canaries.training_data(x[:100], y[:100])
    dp, observer = _train(
        DPModel, canaries, x_train, y_train, sigma=0.0, sampling="full_batch", seed=3, lr=0.5
    )
    p = np.stack(observer.projections, axis=1)
    coins = canaries.coins()
    expected = 0.5 * 1.0 * (10.0 / math.sqrt(101.0)) / len(y_train)
    np.testing.assert_allclose(p[coins], expected, rtol=2e-3)
    np.testing.assert_allclose(p[~coins], 0.0, atol=1e-9)
    scores = observer.scores("sum")
    assert scores[coins].min() > scores[~coins].max()


def test_canary_data_and_errors():
    canaries = DiracCanaries(5, input_dim=4, num_classes=3, value=2.0, seed=0)
    xc, yc = canaries.examples()
    assert xc.shape == (5, 9) and np.all(xc[:, :4] == 0)
    assert np.all(xc[np.arange(5), canaries.rows] == 2.0) and np.count_nonzero(xc) == 5
    x, y = canaries.training_data(np.ones((3, 2, 2)), [0, 1, 2])
    assert x.shape == (3 + canaries.coins().sum(), 9) and np.all(x[:3, 4:] == 0)
    with pytest.raises(ValueError, match="x must have input_dim = 4 features"):
        canaries.pad(np.ones((2, 5)))
    with pytest.raises(ValueError, match="num_canaries must be a whole number >= 1"):
        DiracCanaries(0, input_dim=4, num_classes=3)
    bb = MislabelledCanaries(np.zeros((50, 2)), np.arange(50) % 3, num_classes=3, seed=0)
    assert np.all(bb.labels != np.arange(50) % 3)
    with pytest.raises(ValueError, match="y must lie in"):
        MislabelledCanaries(np.zeros((2, 2)), [0, 3], num_classes=3)


def test_observer_errors():
    canaries = DiracCanaries(5, input_dim=4, num_classes=3, seed=0)
    model = keras.Sequential([keras.Input((canaries.total_dim,)), keras.layers.Dense(3)])
    observer = canaries.observer(DPModel(model))
    with pytest.raises(RuntimeError, match="no lot was observed"):
        observer.scores()
    observer.projections.append(np.zeros(5))
    with pytest.raises(ValueError, match="statistic must be one of"):
        observer.scores("max")
    with pytest.raises(ValueError, match="'spread' needs at least 2 observed lots, got 1"):
        observer.scores("spread")
    other = keras.Sequential([keras.Input((3,)), keras.layers.Dense(3)])
    with pytest.raises(ValueError, match="no trainable kernel with 9 rows"):
        canaries.observer(DPModel(other)).directions()


# -- the library never shows a bound above its claim ------------------------------------
@pytest.mark.parametrize(
    "eps,sampling", [(2.0, "full_batch"), (8.0, "full_batch"), (2.0, "poisson")]
)
def test_library_stays_within_its_claim(mnist_slice, eps, sampling):
    claimed, scores, coins = _audit(DPModel, eps, sampling, mnist_slice, raw=True)
    epsdp = epsilon_lower_bound_from_scores(scores, coins, delta=DELTA)
    assert epsdp.epsilon_lower_bound <= claimed
    if sampling == "full_batch":  # a Gaussian mechanism: the GDP test applies
        gdp = epsilon_lower_bound_from_scores(scores, coins, delta=DELTA, method="gdp")
        assert gdp.epsilon_lower_bound <= claimed
        if eps == 8.0:  # and has power: ~4.3 for an exactly Gaussian canary, m = 2,000
            assert gdp.epsilon_lower_bound > 3.0
            assert gdp.epsilon_lower_bound > epsdp.epsilon_lower_bound
    if eps == 2.0 and sampling == "full_batch":
        _, _, bb = _audit(DPModel, eps, sampling, mnist_slice, seed=1, black_box=True)
        assert bb.epsilon_lower_bound <= claimed


# -- every broken copy is caught ------------------------------------------------------
@pytest.mark.parametrize(
    "variant,sampling,method",
    [
        ("skip_clipping", "full_batch", "gdp"),
        ("per_batch_noise", "full_batch", "gdp"),
        ("reused_noise", "poisson", "eps_dp"),
    ],
)
def test_broken_copy_is_caught(mnist_slice, variant, sampling, method):
    claimed, result, _ = _audit(
        broken.BROKEN_VARIANTS[variant], 2.0, sampling, mnist_slice, method=method
    )
    assert result.epsilon_lower_bound > claimed, (variant, result)


def test_half_noise_is_caught(mnist_slice):
    # Noise x 1/2 doubles the canary's mu (claimed eps 2, true eps 4.4).  Two
    # independent runs of 5,000 canaries are pooled into one GDP audit of 10,000
    # (each coin moves only its own run, so the one-run bound still holds).
    claims, scores, coins = [], [], []
    for seed in (11, 12):
        c, s_, k = _audit(
            broken.HalfNoiseDPModel, 2.0, "full_batch", mnist_slice, seed=seed, m=5000, raw=True
        )
        claims.append(c)
        scores.append(s_)
        coins.append(k)
    result = epsilon_lower_bound_from_scores(
        np.concatenate(scores), np.concatenate(coins), delta=DELTA, method="gdp"
    )
    assert result.canaries == 10000
    assert result.epsilon_lower_bound > max(claims), result


# -- client level: Global DP with canary clients ---------------------------------------
def _federated_audit(aggregator_cls, eps, mnist_slice, seed=0):
    from dpfl_tf.audit.canary import observe_rounds
    from dpfl_tf.federated.client import LocalTrainer
    from dpfl_tf.federated.partition import ClientPartition
    from dpfl_tf.federated.server import ClientSampling, FederatedServer
    from dpfl_tf.sanitizer import GaussianSanitizer

    x, y, *_ = mnist_slice
    keras.utils.set_random_seed(seed)
    partition = ClientPartition.from_lists([list(range(i * 10, (i + 1) * 10)) for i in range(30)])
    canaries = DiracCanaries(1000, input_dim=784, num_classes=10, value=10.0, seed=seed)
    xa, ya, pa = canaries.federated_data(x, y, partition)
    assert pa.num_clients == 30 + canaries.coins().sum()
    model = keras.Sequential(
        [keras.Input((canaries.total_dim,)), keras.layers.Dense(10, kernel_initializer="zeros")]
    )
    trainer = LocalTrainer(model, xa, ya, local_epochs=1, batch_size=10, learning_rate=0.1)
    sigma = calibrate_noise_multiplier(
        eps, DELTA, lambda s: dp_sgd_event(s, STEPS, "poisson", sampling_rate=1.0), "pld"
    )[0]
    server = FederatedServer(
        trainer,
        pa,
        aggregator_cls(GaussianSanitizer(0.1, sigma, seed=7)),
        sampling=ClientSampling("poisson", fraction=1.0),
        test_data=None,
        delta_max=DELTA,
        accountant="pld",
        seed=seed,
        noise_seed=7,
        progress=False,
    )
    observer = canaries.observer(trainer.model, loss=trainer.loss)
    observe_rounds(server, STEPS, observer)
    assert observer.lots_observed == server.rounds_done == STEPS
    return (
        server.epsilon(),
        canaries.audit(observer, delta=DELTA),
        canaries.audit(observer, delta=DELTA, method="gdp"),
    )


def test_global_dp_stays_within_its_claim(mnist_slice):
    from dpfl_tf.federated.aggregators import GlobalDPAggregator

    # every client in every round: a Gaussian mechanism, so both tests apply
    claimed, result, gdp = _federated_audit(GlobalDPAggregator, 4.0, mnist_slice)
    assert claimed == pytest.approx(4.0, abs=0.01)
    assert 0.5 < result.epsilon_lower_bound <= claimed
    assert 0.5 < gdp.epsilon_lower_bound <= claimed


def test_global_dp_without_clipping_is_caught(mnist_slice):
    claimed, result, gdp = _federated_audit(broken.SkipClippingGlobalDP, 2.0, mnist_slice)
    assert result.epsilon_lower_bound > claimed
    assert gdp.epsilon_lower_bound > claimed


def test_the_gdp_test_is_refused_on_sampled_lots(mnist_slice):
    """On Poisson lots the GDP test's null (a plain Gaussian) is not the
    mechanism that ran: the audit refuses it and names the test that applies;
    full-batch lots take it."""
    x, y, *_ = mnist_slice
    for sampling in ("poisson", "full_batch"):
        canaries = DiracCanaries(20, input_dim=784, num_classes=10, value=10.0, seed=5)
        x_train, y_train = canaries.training_data(x[:200], y[:200])
        dp, observer = _train(
            DPModel, canaries, x_train, y_train, sigma=1.0, sampling=sampling, seed=5
        )
        if sampling == "poisson":
            with pytest.raises(ValueError, match="method='eps_dp'"):
                canaries.audit(observer, delta=DELTA, method="gdp")
        else:
            canaries.audit(observer, delta=DELTA, method="gdp")
        canaries.audit(observer, delta=DELTA)  # the eps-DP test applies to both


def test_the_gdp_test_is_refused_for_black_box_canaries_on_sampled_lots(mnist_slice):
    """MislabelledCanaries.audit took method='gdp' on any model: it now reads
    the mechanism from the DPModel (or mechanism=) and refuses sampled lots, and
    a plain model with no mechanism to check."""
    x, y, xb, yb = mnist_slice
    for sampling in ("poisson", "full_batch"):
        canaries = DiracCanaries(20, input_dim=784, num_classes=10, value=10.0, seed=6)
        bb = MislabelledCanaries(canaries.pad(xb[:40]), yb[:40], num_classes=10, seed=6)
        x_train, y_train = canaries.training_data(x[:200], y[:200])
        xi, yi = bb.included()
        dp, _ = _train(
            DPModel,
            canaries,
            np.concatenate([x_train, xi]),
            np.concatenate([y_train, yi]),
            sigma=1.0,
            sampling=sampling,
            seed=6,
        )
        with pytest.raises(ValueError, match="needs mechanism="):
            bb.audit(dp.model, delta=DELTA, method="gdp")
        if sampling == "poisson":
            for model, mechanism in ((dp, None), (dp.model, dp.privacy_ledger)):
                with pytest.raises(ValueError, match="sampled mechanism") as err:
                    bb.audit(model, delta=DELTA, method="gdp", mechanism=mechanism)
                assert "method='eps_dp'" in str(err.value) and "\n" not in str(err.value)
        else:
            bb.audit(dp, delta=DELTA, method="gdp")
            bb.audit(dp.model, delta=DELTA, method="gdp", mechanism=dp.privacy_ledger)
        bb.audit(dp.model, delta=DELTA)  # the eps-DP test applies to both


def test_the_gdp_test_is_refused_for_the_federated_observer_on_sampled_clients(mnist_slice):
    """The white-box observer of federated rounds took method='gdp' with sampled
    clients (its model has no ledger): observe_rounds now tells it the server,
    whose ledger says the clients were sampled."""
    from dpfl_tf.audit.canary import observe_rounds
    from dpfl_tf.federated.aggregators import GlobalDPAggregator
    from dpfl_tf.federated.client import LocalTrainer
    from dpfl_tf.federated.partition import ClientPartition
    from dpfl_tf.federated.server import ClientSampling, FederatedServer
    from dpfl_tf.sanitizer import GaussianSanitizer

    x, y, *_ = mnist_slice
    partition = ClientPartition.from_lists([list(range(i * 10, (i + 1) * 10)) for i in range(10)])
    for fraction in (0.5, 1.0):
        keras.utils.set_random_seed(7)
        canaries = DiracCanaries(10, input_dim=784, num_classes=10, value=10.0, seed=7)
        xa, ya, pa = canaries.federated_data(x[:100], y[:100], partition)
        model = keras.Sequential(
            [keras.Input((canaries.total_dim,)), keras.layers.Dense(10, kernel_initializer="zeros")]
        )
        trainer = LocalTrainer(model, xa, ya, local_epochs=1, batch_size=10, learning_rate=0.1)
        server = FederatedServer(
            trainer,
            pa,
            GlobalDPAggregator(GaussianSanitizer(0.1, 1.0, seed=7)),
            sampling=ClientSampling("poisson", fraction=fraction),
            test_data=None,
            delta_max=DELTA,
            accountant="rdp",
            seed=7,
            noise_seed=7,
            progress=False,
        )
        observer = canaries.observer(trainer.model, loss=trainer.loss)
        observe_rounds(server, 2, observer)
        if fraction < 1:
            with pytest.raises(ValueError, match="sampled mechanism.*method='eps_dp'"):
                canaries.audit(observer, delta=DELTA, method="gdp")
        else:
            canaries.audit(observer, delta=DELTA, method="gdp")
        canaries.audit(observer, delta=DELTA)

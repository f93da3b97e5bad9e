"""DPModel: lots, noise once per lot, sampling events, ledger, budget, resume,
serialisation, bad inputs -- on small slices of real MNIST."""

import gc
import math
import re

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from dpfl_tf.keras import DPSGD, DPAdam, DPModel, DPOptimizer
from dpfl_tf.privacy import (
    BudgetExceededError,
    PrivacyLedger,
    compute_epsilon,
    dp_sgd_event,
    gaussian_step_event,
    max_steps,
)
from dpfl_tf.privacy.calibration import calibrate_noise_multiplier
from tests.keras.helpers import loss, mlp, mnist_slice, mnist_test_slice

# what XLA and TensorFlow compile here stays until the process ends (+2.6 GB in a
# whole-suite worker): the file runs in a process of its own (tests/isolation.py)
pytestmark = pytest.mark.isolated


def dp_model(noise=1.0, clip=1.0, lr=0.5, model=None, seed=0, **opt):
    dp = DPModel(model if model is not None else mlp())
    dp.compile(
        optimizer=DPSGD(lr, l2_norm_clip=clip, noise_multiplier=noise, seed=seed, **opt),
        loss=loss(),
        metrics=["accuracy"],
    )
    return dp


def weights(model):
    return [v.numpy().copy() for v in model.trainable_variables]


def test_dp_training_learns_and_ledger_matches_accountant():
    x, y = mnist_slice(2000, features=60)
    xt, yt = mnist_test_slice(1000, features=60)
    dp = dp_model(noise=1.0, clip=1.0, lr=0.5)
    hist = dp.fit(x, y, lot_size=100, epochs=5, verbose=0)
    acc = dp.evaluate(xt, yt, verbose=0)[1]
    assert acc > 0.5  # chance is 0.1
    assert dp.lots_applied == 5 * 20
    expected = compute_epsilon(dp_sgd_event(1.0, 100, sampling_rate=100 / 2000), 1e-5, "moments")
    assert dp.epsilon(1e-5) == pytest.approx(expected, rel=1e-12)
    assert hist.history["epsilon"][-1] == pytest.approx(expected, rel=1e-12)
    assert dp.privacy_ledger.count() == 100
    assert dp.lot_event == gaussian_step_event(1.0, sampling_rate=0.05)


def _one_lot_update(batch_size, noise, seed, n=600):
    x, y = mnist_slice(n, features=60)
    dp = dp_model(noise=noise, clip=1.0, lr=1.0, model=mlp(hidden=300), seed=seed)
    w0 = weights(dp.model)
    dp.fit(x, y, lot_size=n, batch_size=batch_size, epochs=1, verbose=0, sampling="full_batch")
    return [b - a for a, b in zip(w0, weights(dp.model))]


def test_a_fit_with_the_same_settings_reuses_the_traced_function_and_a_change_retraces():
    """Fits in one process reuse the training function while its settings hold
    (each retrace kept the old function: ~20 MB a fit); a changed noise
    multiplier, lot size or clip retraces, and the new setting is what trains."""
    x, y = mnist_slice(400, features=60)
    dp = dp_model(noise=0.0, clip=1.0, lr=0.5)
    dp.fit(x, y, lot_size=100, epochs=1, verbose=0, sampling_seed=0)
    first = dp.train_function
    dp.fit(x, y, lot_size=100, epochs=1, verbose=0, sampling_seed=0)
    assert dp.train_function is first
    w0 = weights(dp.model)
    dp.fit(x, y, lot_size=100, epochs=1, verbose=0, sampling_seed=0)
    noiseless = max(np.abs(b - a).max() for a, b in zip(w0, weights(dp.model)))
    dp.optimizer.noise_multiplier = 1000.0
    w0 = weights(dp.model)
    dp.fit(x, y, lot_size=100, epochs=1, verbose=0, sampling_seed=0)
    assert dp.train_function is not first
    noised = max(np.abs(b - a).max() for a, b in zip(w0, weights(dp.model)))
    assert noised > 100 * noiseless  # sigma C / L = 1000 x 1 / 100 per lot
    second = dp.train_function
    for change in ({"lot_size": 200}, {"lot_size": 200, "batch_size": 50}):
        dp.fit(x, y, epochs=1, verbose=0, sampling_seed=0, **change)
        assert dp.train_function is not second
        second = dp.train_function
    dp.optimizer.l2_norm_clip = 0.5
    dp.fit(x, y, lot_size=200, batch_size=50, epochs=1, verbose=0, sampling_seed=0)
    assert dp.train_function is not second


def test_the_graphs_a_fit_traced_are_freed_with_its_model():
    """No traced graph outlives its model's fit: Keras' optimizers sum the
    gradients over the replicas with `ReplicaContext.all_reduce`, which in a
    traced step registers a gradient function in TensorFlow's global registry
    that holds the step's graphs for good (24 graphs, ~8,000 Python objects a
    fit); with one replica the inner optimizer does not call it."""
    x, y = mnist_slice(200, features=60)

    def fit_a_model_and_drop_it():
        dp = dp_model(noise=1.0, clip=1.0, lr=0.5)
        dp.fit(x, y, lot_size=100, epochs=1, verbose=0, sampling_seed=0)
        keras.backend.clear_session()

    def graphs_alive():
        gc.collect()
        return sum(isinstance(o, tf.__internal__.FuncGraph) for o in gc.get_objects())

    fit_a_model_and_drop_it()  # what the first fit of a process builds once
    alive = graphs_alive()
    for _ in range(2):
        fit_a_model_and_drop_it()
    assert graphs_alive() <= alive


@pytest.fixture
def traced_steps(monkeypatch):
    """Whether each call of `DPModel.train_step` ran eagerly (in graph mode: one
    entry per trace of the training step)."""
    step, steps = DPModel.train_step, []

    def counted_step(self, *args, **kwargs):
        steps.append(tf.executing_eagerly())
        return step(self, *args, **kwargs)

    monkeypatch.setattr(DPModel, "train_step", counted_step)
    return steps


@pytest.mark.parametrize("batch_size", [None, 40], ids=["lot-fits", "three-batches"])
def test_the_training_function_traces_the_per_example_gradients_once(
    batch_size, monkeypatch, traced_steps
):
    """A lot of run-time size (every lot of fit) is traced through one path: per
    trace of the training step, the per-example gradients once -- not once more
    for a second branch (a tf.cond between "one batch" and "the loop" traced
    both), nor for the one-example rerun of a batch with a non-finite example
    (the loop redoes such a batch through the same pass)."""
    from dpfl_tf.keras.per_example import PerExampleGradients

    clipped, calls, steps = PerExampleGradients.clipped, [], traced_steps

    def counted_clipped(self, *args, **kwargs):
        calls.append(tf.executing_eagerly())
        return clipped(self, *args, **kwargs)

    monkeypatch.setattr(PerExampleGradients, "clipped", counted_clipped)
    x, y = mnist_slice(400, features=60)
    dp_model().fit(x, y, lot_size=100, batch_size=batch_size, epochs=1, verbose=0)
    assert steps and not any(steps) and not any(calls)  # traced, never run eagerly
    assert len(calls) == len(steps), (len(calls), len(steps))


@pytest.mark.parametrize(
    "optimizer, metrics, slots",
    [
        (lambda: DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0), ["accuracy"], 0),
        (lambda: DPSGD(0.5, momentum=0.9, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0), [], 1),
        (  # the metric object made in the test: made at collection it starts TensorFlow
            lambda: DPAdam(0.01, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
            ["accuracy", "sparse_top_k_categorical_accuracy"],
            2,
        ),
    ],
    ids=["accuracy", "momentum-slots", "adam-slots-two-metrics"],
)
def test_a_fit_traces_the_training_step_once(optimizer, metrics, slots, traced_steps):
    """The optimizer's slots and the compiled metrics' variables exist before the
    training step is traced: a `tf.function` whose first trace creates variables
    is traced a second time (Keras 3 builds them in the trace when no
    distribution strategy is set), which doubled every fit's start-up.  The
    metrics still report, and the slots are the ones the optimizer updates."""
    x, y = mnist_slice(400, features=60)
    dp = DPModel(mlp())
    made = [
        keras.metrics.SparseTopKCategoricalAccuracy(3) if m.startswith("sparse") else m
        for m in metrics
    ]
    dp.compile(optimizer=optimizer(), loss=loss(), metrics=made or None)
    history = dp.fit(x, y, lot_size=100, epochs=2, verbose=0)
    assert traced_steps == [False]  # one trace, in graph mode, for both epochs
    reported = set(history.history) - {"loss", "epsilon", "delta", "lots", "dropped_examples"}
    assert reported == set(metrics)
    assert all(0.0 <= history.history[n][-1] <= 1.0 for n in metrics)
    first_kernel = [v for v in dp.optimizer.inner_optimizer.variables if v.shape == (60, 32)]
    assert len(first_kernel) == slots  # momentum; Adam's two moments
    assert all(np.any(v.numpy() != 0) for v in first_kernel)  # updated in fit


def _seeded_adam_fit():
    x, y = mnist_slice(400, features=60)
    dp = DPModel(mlp())
    dp.compile(
        optimizer=DPAdam(0.01, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=loss(),
        metrics=["accuracy"],
    )
    history = dp.fit(x, y, lot_size=100, epochs=2, verbose=0, sampling_seed=0)
    return dp, history.history


def _slots(dp):
    """(scope, kind, shape) of each optimizer variable, auto-numbered names aside
    ("adam_1/sequential_3_dense_6_kernel_momentum" -> ("adam", "momentum", shape))."""
    out = []
    for v in dp.optimizer.variables:
        scope, name = v.path.split("/")
        out.append((re.sub(r"_\d+$", "", scope), name.rsplit("_", 1)[-1], tuple(v.shape)))
    return out


def test_building_before_the_trace_changes_no_result(monkeypatch):
    """The early build makes what the trace would have made: with it switched off
    (Keras's way: built in the trace, traced twice) the same seeded fit ends with
    the same weights, optimizer variables and history, bit for bit."""
    early, history = _seeded_adam_fit()
    monkeypatch.setattr(DPModel, "_build_state_before_tracing", lambda self, spec: None)
    late, late_history = _seeded_adam_fit()
    assert history == late_history
    for a, b in zip(early.get_weights(), late.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert _slots(early) == _slots(late) and len(_slots(early)) == 2 + 2 + 4 * 2
    for a, b in zip(early.optimizer.variables, late.optimizer.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_a_model_without_a_symbolic_output_builds_its_metrics_in_the_trace(
    monkeypatch, traced_steps
):
    """If the model's output spec cannot be computed, the metrics are built where
    Keras builds them (a second trace) and still report."""

    def no_spec(self, *args, **kwargs):
        raise NotImplementedError("no symbolic output")

    monkeypatch.setattr(DPModel, "compute_output_spec", no_spec)
    dp, history = _seeded_adam_fit()
    assert traced_steps == [False, False]
    assert 0.0 <= history["accuracy"][-1] <= 1.0


def test_physical_batches_sum_to_the_same_lot_update_without_noise():
    one = _one_lot_update(600, 0.0, 0)
    four = _one_lot_update(150, 0.0, 0)
    seven = _one_lot_update(97, 0.0, 0)  # last physical batch is partial
    for a, b, c in zip(one, four, seven):
        np.testing.assert_allclose(a, b, atol=1e-6)
        np.testing.assert_allclose(a, c, atol=1e-6)


def _transformer(seed=0):
    """Embedding + MultiHeadAttention + LayerNorm + FFN on MNIST pixel tokens."""
    keras.utils.set_random_seed(seed)
    inp = keras.Input((16,), dtype="int32")
    h = keras.layers.Embedding(16, 32)(inp)
    h = keras.layers.LayerNormalization()(h + keras.layers.MultiHeadAttention(2, 8)(h, h))
    f = keras.layers.Dense(32)(keras.layers.Dense(24, activation="relu")(h))
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization()(h + f))
    return keras.Model(inp, keras.layers.Dense(10)(h))


@pytest.mark.parametrize("fast", [False, True])
def test_a_transformer_in_physical_batches_smaller_than_the_lot(fast):
    """fast_gradients=False with batch_size < lot_size crashed with "Cannot convert
    a partially known TensorShape (None, 32) to a Tensor" (the Jacobian taken in
    the loop over physical batches had lost its static shape)."""
    x, y = mnist_slice(64, flat=True)
    tokens = np.floor(x[:, 400:416] * 15.99).astype("int32")
    updates = []
    for batch_size in (64, 24):
        dp = DPModel(_transformer(), fast_gradients=fast)
        dp.compile(optimizer=DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=0.0), loss=loss())
        w0 = weights(dp.model)
        dp.fit(
            tokens,
            y,
            lot_size=64,
            batch_size=batch_size,
            epochs=1,
            verbose=0,
            sampling="full_batch",
        )
        assert dp.lots_computed == 1
        updates.append([b - a for a, b in zip(w0, weights(dp.model))])
    for a, b in zip(*updates):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_noise_is_added_once_per_lot_not_once_per_physical_batch():
    """Update = -(lr / L) (sum + N(0, sigma^2 C^2)): noise std per coordinate is
    sigma C / L whatever the physical batch size.  Adding it per physical batch
    (tensorflow-privacy's behaviour with gradient accumulation) would give
    sqrt(4) times more for B = L / 4; the test detects that."""
    sigma, lot = 2.0, 600
    clean = np.concatenate([u.ravel() for u in _one_lot_update(150, 0.0, 0)])
    noisy = np.concatenate([u.ravel() for u in _one_lot_update(150, sigma, 11)])
    noise = (noisy - clean) / (sigma * 1.0 / lot)  # standardised by the claimed scale
    assert stats.kstest(noise, "norm").pvalue > 1e-3
    assert noise.std() == pytest.approx(1.0, abs=0.02)
    assert stats.kstest(noise / 2.0, "norm").pvalue < 1e-6  # per-batch noise is rejected


def test_sampling_modes_record_honest_events():
    x, y = mnist_slice(1000, features=60)
    fixed = dp_model()
    fixed.fit(x, y, lot_size=100, epochs=1, verbose=0, sampling="fixed_size", accountant="rdp")
    assert fixed.lot_event == gaussian_step_event(
        1.0, "fixed_size", dataset_size=1000, lot_size=100
    )
    shuffled = dp_model()
    shuffled.ledger.accountant = shuffled.ledger.accountant.parse("rdp")
    shuffled.fit(x, y, lot_size=100, epochs=2, verbose=0, sampling="shuffle")
    ledger = shuffled.privacy_ledger
    # two epochs of disjoint lots: two Gaussians with sensitivity 2C, no amplification
    assert ledger.count() == 2
    assert ledger.epsilon(1e-5) == pytest.approx(
        compute_epsilon(
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(0.5), 2), 1e-5, "rdp"
        )
    )


def test_poisson_lots_have_variable_size_and_expected_rate():
    from dpfl_tf.keras import LotSampler

    sampler = LotSampler(10000, 100, seed=0)
    sizes = np.array([len(i) for i in sampler.lots(400)])
    assert sizes.std() > 5 and abs(sizes.mean() - 100) < 2
    assert stats.binomtest(int(sizes.sum()), 400 * 10000, 0.01).pvalue > 1e-3


def test_budget_stops_before_the_lot_that_would_exceed():
    x, y = mnist_slice(1000, features=60)
    dp = dp_model(noise=2.0)
    dp.fit(x, y, lot_size=100, epochs=50, verbose=0, target_epsilon=1.0, target_delta=1e-5)
    allowed = max_steps(1.0, 1e-5, gaussian_step_event(2.0, sampling_rate=0.1))
    assert dp.lots_applied == allowed < 500
    assert dp.epsilon(1e-5) <= 1.0
    assert compute_epsilon(dp_sgd_event(2.0, allowed + 1, sampling_rate=0.1), 1e-5) > 1.0
    with pytest.raises(BudgetExceededError):
        dp.fit(x, y, lot_size=100, epochs=1, verbose=0, target_epsilon=1.0)
    assert dp.lots_applied == allowed


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_in_graph_lot_limit_skips_a_lot_without_error(mode):
    """The guard is a branch of the computation: a lot at the limit is skipped
    (nothing applied, nothing counted), with no assert (XLA would drop one)."""
    x, y = mnist_slice(200, features=60)
    dp = dp_model()
    if mode != "graph":
        dp.compile(
            optimizer=dp.optimizer,
            loss=loss(),
            run_eagerly=mode == "eager",
            jit_compile=mode == "xla",
        )
    dp.fit(x, y, lot_size=100, epochs=1, verbose=0)
    computed = dp.lots_computed
    dp.set_lot_limit(computed)
    w = weights(dp.model)
    dp._prepare(dp.sampler, 100)
    data = dp.sampler.dataset(x, y, pad_to=100 if mode == "xla" else 1, epochs=1)
    step = (
        dp.train_step if mode == "eager" else tf.function(dp.train_step, jit_compile=mode == "xla")
    )
    step(next(iter(data)))
    for a, b in zip(w, weights(dp.model)):
        np.testing.assert_array_equal(a, b)
    assert dp.lots_computed == dp.lots_applied == computed
    assert dp.privacy_ledger.count() == computed


def test_paper_learning_rate_schedule_is_a_keras_schedule():
    steps_per_epoch = 10
    schedule = keras.optimizers.schedules.PolynomialDecay(0.1, 10 * steps_per_epoch, 0.052)
    opt = DPSGD(schedule, l2_norm_clip=4.0, noise_multiplier=2.0)
    lrs = [float(schedule(s)) for s in [0, 50, 100, 150, 1000]]
    np.testing.assert_allclose(lrs, [0.1, 0.076, 0.052, 0.052, 0.052], rtol=1e-6)
    restored = DPSGD.from_config(opt.get_config())
    assert float(restored.inner_optimizer._learning_rate(50)) == pytest.approx(0.076)


def test_frozen_layers_are_unchanged_and_functional_and_subclassed_models_train():
    x, y = mnist_slice(600, flat=False)
    keras.utils.set_random_seed(0)
    inp = keras.Input((28, 28, 1))
    h = keras.layers.Conv2D(4, 5, strides=2, activation="relu", name="frozen_conv")(inp)
    h = keras.layers.Flatten()(h)
    functional = keras.Model(inp, keras.layers.Dense(10)(h))
    functional.get_layer("frozen_conv").trainable = False
    frozen_before = [w.copy() for w in functional.get_layer("frozen_conv").get_weights()]
    dp = dp_model(model=functional, noise=0.5)
    dp.fit(x, y, lot_size=100, epochs=2, verbose=0)
    for a, b in zip(frozen_before, functional.get_layer("frozen_conv").get_weights()):
        np.testing.assert_array_equal(a, b)

    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.hidden = keras.layers.Dense(16, activation="tanh")
            self.out = keras.layers.Dense(10)

        def call(self, z, training=None):
            return self.out(self.hidden(z))

    xf, yf = mnist_slice(600, features=60)
    net = Net()
    net(xf[:1])
    before = weights(net)
    dp2 = dp_model(model=net, noise=0.5)
    dp2.fit(xf, yf, lot_size=100, epochs=1, verbose=0)
    assert dp2.lots_applied == 6
    assert any(not np.allclose(a, b) for a, b in zip(before, weights(net)))


def test_per_layer_clipping_by_layer_name():
    x, y = mnist_slice(600, features=60)
    model = mlp()
    names = [layer.name for layer in model.layers]
    dp = DPModel(model)
    opt = DPSGD(
        0.5,
        l2_norm_clip={names[0]: 1.0, names[1]: 2.0},
        noise_multiplier=1.0,
        noise_allocation="proportional",
    )
    dp.compile(optimizer=opt, loss=loss())
    dp.fit(x, y, lot_size=100, epochs=1, verbose=0)
    # two groups with proportional noise: sigma_eff = sigma / sqrt(2)
    assert dp.lot_event == gaussian_step_event(1.0 / math.sqrt(2), sampling_rate=100 / 600)
    bad = DPModel(mlp())
    bad.compile(
        optimizer=DPSGD(0.5, l2_norm_clip={names[0]: 1.0}, noise_multiplier=1.0), loss=loss()
    )
    with pytest.raises(ValueError, match="must name every trainable layer"):
        bad.fit(x, y, lot_size=100, verbose=0)


def test_save_load_keeps_ledger_and_resume_neither_forgets_nor_double_counts(tmp_path):
    x, y = mnist_slice(1000, features=60)
    dp = dp_model(noise=1.5)
    dp.fit(x, y, lot_size=100, epochs=2, verbose=0)
    path = tmp_path / "dp.keras"
    dp.save(path)
    restored = keras.saving.load_model(path)
    assert isinstance(restored, DPModel) and isinstance(restored.optimizer, DPSGD)
    assert restored.lots_applied == 20
    assert restored.privacy_ledger == dp.privacy_ledger
    np.testing.assert_allclose(
        restored.predict(x[:5], verbose=0), dp.predict(x[:5], verbose=0), rtol=1e-6
    )
    restored.fit(x, y, lot_size=100, epochs=1, verbose=0)
    assert restored.lots_applied == 30
    assert restored.privacy_ledger.count() == 30
    assert restored.epsilon(1e-5) == pytest.approx(
        compute_epsilon(dp_sgd_event(1.5, 30, sampling_rate=0.1), 1e-5)
    )

    # weights-only checkpoint: the lot counter travels with the weights
    weights_path = tmp_path / "ckpt.weights.h5"
    dp.save_weights(weights_path)
    fresh = dp_model(noise=1.5)
    fresh.build((None, 60))
    fresh.load_weights(weights_path)
    assert fresh.lots_applied == 20
    with pytest.warns(RuntimeWarning, match="20 lots restored with the weights"):
        fresh.fit(x, y, lot_size=100, epochs=1, verbose=0)  # same settings: resume
    assert fresh.privacy_ledger.count() == 30


def test_optimizer_serialisation_round_trip():
    for opt in [
        DPSGD(0.1, momentum=0.9, l2_norm_clip=[1.0, 2.0], noise_multiplier=1.1),
        DPAdam(1e-3, l2_norm_clip=3.0, noise_multiplier=0.7),
        DPOptimizer(keras.optimizers.RMSprop(0.01), l2_norm_clip={"a": 1.0}, noise_multiplier=2.0),
    ]:
        config = keras.saving.serialize_keras_object(opt)
        again = keras.saving.deserialize_keras_object(config)
        assert type(again) is type(opt)
        assert again.get_config() == opt.get_config()


def test_bad_inputs_give_clear_errors():
    x, y = mnist_slice(300, features=60)
    with pytest.raises(TypeError, match="DP optimizer"):
        DPModel(mlp()).compile(optimizer=keras.optimizers.SGD(0.1), loss=loss())
    plain = mlp()
    plain.compile(optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=loss())
    with pytest.raises(RuntimeError, match="ordinary .unclipped, un-noised. gradients"):
        plain.fit(x, y, epochs=1, verbose=0)
    opt = DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0)
    with pytest.raises(RuntimeError, match="custom training loop.*dp_gradients"):
        opt.apply_gradients(zip([tf.zeros(3)], [tf.Variable(tf.zeros(3))]))
    with pytest.raises(ValueError, match="l2_norm_clip must be > 0"):
        DPSGD(0.1, l2_norm_clip=-1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0"):
        DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=-1.0)
    dp = dp_model()
    with pytest.raises(TypeError, match="random access .* a tf.data.Dataset only streams"):
        dp.fit(tf.data.Dataset.from_tensor_slices((x, y)), lot_size=10)
    with pytest.raises(ValueError, match="lot_size must be <= the number of examples"):
        dp.fit(x, y, lot_size=301)
    with pytest.raises(ValueError, match="disagree on the number of examples"):
        dp.fit(x[:10], y[:11], lot_size=5)
    with pytest.raises(ValueError, match="empty"):
        dp.fit(x[:0], y[:0], lot_size=1)
    with pytest.raises(ValueError, match="does not support validation_split"):
        dp.fit(x, y, lot_size=10, validation_split=0.1)
    with pytest.raises(ValueError, match="sampling must be one of"):
        dp.fit(x, y, lot_size=10, sampling="bootstrap")
    bn = keras.Sequential(
        [keras.Input((60,)), keras.layers.BatchNormalization(), keras.layers.Dense(10)]
    )
    with pytest.raises(ValueError, match="BatchNormalization"):
        DPModel(bn).compile(
            optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=loss()
        )


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_nan_example_is_dropped_and_counted_and_the_update_stays_finite(mode):
    """One NaN pixel: that example's contribution is zeroed (sensitivity stays C),
    the lot is applied and counted, weights stay finite, the drop is reported."""
    x, y = mnist_slice(200, features=60)
    x = x.copy()
    x[3, 0] = np.nan
    x[150, 5] = np.inf
    dp = dp_model(noise=0.0)
    dp.compile(
        optimizer=dp.optimizer,
        loss=loss(),
        metrics=["accuracy"],
        run_eagerly=mode == "eager",
        jit_compile=mode == "xla",
    )
    w = weights(dp.model)
    with pytest.warns(RuntimeWarning, match="2 training examples had a NaN or inf gradient"):
        dp.fit(x, y, lot_size=200, epochs=1, verbose=0, sampling="full_batch", batch_size=64)
    assert dp.lots_computed == dp.lots_applied == dp.privacy_ledger.count() == 1
    assert dp.dropped_examples == 2
    after = weights(dp.model)
    assert all(np.all(np.isfinite(a)) for a in after)
    # without noise the update equals the clipped sum of the 198 finite examples
    keep = np.isfinite(x).all(axis=1)
    clean = DPModel(mlp())
    clean.model.set_weights([np.asarray(v) for v in w])
    clean.compile(optimizer=DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=0.0), loss=loss())
    clean.fit(
        x[keep], y[keep], lot_size=int(keep.sum()), epochs=1, verbose=0, sampling="full_batch"
    )
    # same sum, but normalised by L = 200 vs 198
    for a, b, c in zip(w, after, weights(clean.model)):
        np.testing.assert_allclose((b - a) * 200, (c - a) * keep.sum(), rtol=1e-4, atol=1e-5)


def test_restoring_best_weights_refunds_no_privacy_and_the_limit_still_holds():
    """EarlyStopping(restore_best_weights) and a plain set_weights move the lot
    counter in the weights back; lots computed afterwards are all recorded and the
    target still stops training (the old counter gave 20 computed -> 10 recorded)."""
    x, y = mnist_slice(1000, features=60)
    dp = dp_model(noise=1.0)
    target = compute_epsilon(dp_sgd_event(1.0, 25, sampling_rate=0.1), 1e-5) + 1e-9

    class Rewind(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.start = self.model.get_weights()

        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                self.model.set_weights(self.start)

    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=100, restore_best_weights=True)
    dp.fit(
        x, y, lot_size=100, epochs=10, verbose=0, target_epsilon=target, callbacks=[Rewind(), stop]
    )
    assert dp.lots_computed == dp.privacy_ledger.count() == 25
    assert dp.lots_applied < 25
    assert dp.epsilon(1e-5) <= target
    assert dp.stop_reason == "budget_spent"


def test_a_seeded_optimizer_continues_its_noise_stream_across_fits(tmp_path):
    """Seeded noise is position t of the seed's stream for lot t: a second fit (and
    a reloaded model) continues the stream instead of repeating it."""
    x, y = mnist_slice(100, features=60)
    x = np.zeros_like(x)  # no gradient reaches the first kernel: its change is noise

    def first_lot_noise(dp):
        before = dp.model.layers[0].kernel.numpy().copy()
        dp.fit(x, y, lot_size=100, epochs=1, verbose=0, sampling="full_batch")
        return dp.model.layers[0].kernel.numpy() - before

    dp = dp_model(noise=1.0, seed=7)
    first, second = first_lot_noise(dp), first_lot_noise(dp)
    assert np.abs(first).max() > 0 and not np.allclose(first, second)
    np.testing.assert_allclose(
        first_lot_noise(dp_model(noise=1.0, seed=7)), first, rtol=1e-5, atol=1e-7
    )  # reproducible from the seed
    path = tmp_path / "seeded.keras"
    dp.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.lots_computed == 2
    third = first_lot_noise(loaded)
    assert not np.allclose(third, first) and not np.allclose(third, second)


def test_fixed_size_with_the_moments_accountant_is_refused_before_any_lot():
    x, y = mnist_slice(200, features=60)
    dp = dp_model()
    w = weights(dp.model)
    with pytest.raises(ValueError, match="accountant 'moments' cannot account .*'rdp'"):
        dp.fit(x, y, lot_size=20, epochs=1, verbose=0, sampling="fixed_size")
    assert dp.lots_computed == 0 and dp.privacy_ledger.count() == 0
    for a, b in zip(w, weights(dp.model)):
        np.testing.assert_array_equal(a, b)
    dp.fit(x, y, lot_size=20, epochs=1, verbose=0, sampling="fixed_size", accountant="rdp")
    assert dp.lots_computed == 10


def test_budget_stop_says_so_and_records_why(capsys):
    x, y = mnist_slice(1000, features=60)
    dp = dp_model(noise=2.0)
    history = dp.fit(x, y, lot_size=100, epochs=50, verbose=1, target_epsilon=1.0)
    out = capsys.readouterr().out
    assert "privacy budget spent: epsilon = " in out and "training stopped" in out
    assert history.stop_reason == dp.stop_reason == "budget_spent"
    done = dp.fit(x, y, lot_size=100, epochs=1, verbose=0)
    assert done.stop_reason == "completed"


@pytest.mark.parametrize("verbose", [1, 2])
def test_the_progress_bar_shows_counts_as_integers(capsys, verbose):
    """Keras's bar formats every log as a float (``lots: 10.0000``); the lot and
    drop counts are integers, and the history keeps them as integers."""
    x, y = mnist_slice(200, features=60)
    dp = dp_model()
    history = dp.fit(x, y, lot_size=20, epochs=1, verbose=verbose)
    out = capsys.readouterr().out
    assert re.search(r"lots: 10(\s|$)", out), out
    assert re.search(r"dropped_examples: 0(\s|$)", out), out
    assert "lots: 10.0" not in out and "dropped_examples: 0.0" not in out
    assert re.search(r"epsilon: \d+\.\d{4}", out), out  # other values as Keras shows them
    assert history.history["lots"] == [10] and isinstance(history.history["lots"][0], int)


@pytest.mark.parametrize("steps_per_execution", [1, 2])
def test_train_metrics_can_be_switched_off_and_validation_is_still_reported(
    steps_per_execution,
):
    x, y = mnist_slice(400, features=60)
    dp = dp_model()
    dp.compile(
        optimizer=dp.optimizer,
        loss=loss(),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )
    history = dp.fit(
        x[:200],
        y[:200],
        lot_size=50,
        epochs=2,
        verbose=0,
        log_train_metrics=False,
        validation_data=(x[200:], y[200:]),
    )
    assert "loss" not in history.history and "accuracy" not in history.history
    assert "epsilon" in history.history and dp.lots_computed == 8
    assert len(history.history["val_accuracy"]) == 2 and len(history.history["val_loss"]) == 2
    assert dp.evaluate(x[200:], y[200:], verbose=0, return_dict=True)["accuracy"] == (
        pytest.approx(history.history["val_accuracy"][-1])
    )


def test_backup_and_restore_in_a_new_model_records_the_restored_lots(tmp_path):
    """BackupAndRestore restores weights (and their lot counter) in on_train_begin,
    after fit's own checks: the lots behind those weights are still recorded."""
    x, y = mnist_slice(1000, features=60)
    backup = str(tmp_path / "backup")

    class Crash(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("crash")

    first = dp_model(noise=1.0, seed=None)
    first.build((None, 60))
    with pytest.raises(RuntimeError, match="crash"):
        first.fit(
            x,
            y,
            lot_size=100,
            epochs=4,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup), Crash()],
        )
    second = dp_model(noise=1.0, seed=None)
    second.build((None, 60))
    with pytest.warns(RuntimeWarning, match="lots restored with the weights"):
        second.fit(
            x,
            y,
            lot_size=100,
            epochs=4,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup)],
        )
    assert second.lots_applied == second.lots_computed == second.privacy_ledger.count()
    assert second.lots_computed >= 30


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("n, nan_rows", [(8, (3,)), (10, (5, 9))], ids=["first", "later"])
def test_a_nan_example_cannot_drop_its_neighbours_on_the_generic_path(mode, fast, n, nan_rows):
    """LayerNormalization (generic Jacobian path, and everything with
    fast_gradients=False): a batched backward pass spreads 0 x NaN to every
    example of the batch; the batch is then recomputed one example at a time, so
    exactly the NaN examples are dropped and the clipped sum of the others has
    norm (n - dropped) C (it was 0 for n = 8: one record moved the sum by 8 C).
    "later": NaN rows in the second and in the last, partial batch (batches of 4),
    so the redo starts past row 0 and ends before the lot does."""
    _nan_neighbours(mode, fast, n, nan_rows, batch_size=4)


@pytest.mark.parametrize("fast", [True, False])
def test_a_nan_example_in_a_static_lot_of_one_batch_under_xla(fast):
    """The same under XLA for a lot of static size that fits one physical batch
    (full_batch, padded to 64 rows, batches of 64): one batch and its `tf.cond`
    rerun one example at a time (`clip_physical_batch`), not the loop."""
    _nan_neighbours("xla", fast, 10, (5, 9), batch_size=64)


def _nan_neighbours(mode, fast, n, nan_rows, batch_size):
    x = np.tile(np.array([[3.0, -2.0, 1.0, 5.0]], "float32"), (n, 1))
    x[list(nan_rows), 0] = np.nan
    y = np.zeros(n, "int64")
    keras.utils.set_random_seed(0)
    inner = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(2),
        ]
    )
    w0 = weights(inner)
    dp = DPModel(inner, fast_gradients=fast)
    dp.compile(
        optimizer=DPSGD(1.0, l2_norm_clip=1.0, noise_multiplier=0.0),
        loss=loss(),
        metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy(from_logits=True)],
        run_eagerly=mode == "eager",
        jit_compile=mode == "xla",
    )
    bad = len(nan_rows)
    with pytest.warns(RuntimeWarning, match=f"{bad} training examples had a NaN"):
        dp.fit(x, y, lot_size=n, batch_size=batch_size, epochs=1, verbose=0, sampling="full_batch")
    assert dp.dropped_examples == bad
    norm = np.sqrt(sum(np.sum((b - a) ** 2) for a, b in zip(w0, weights(inner)))) * n
    assert norm == pytest.approx(n - bad, rel=1e-4)
    # the one-example passes of a redone batch add no statistics: the loss and the
    # compiled accuracy count each kept example once, and neither the NaN examples
    # nor (under XLA, where the lot is padded to 64 rows, `XLA_PAD`) the padding
    # rows: Keras gives its `metrics` no sample weight, `_update_metrics` does
    counts = {m.name: float(m.variables[1].numpy()) for m in dp.metrics}
    assert counts["loss"] == n - bad
    assert counts["compile_metrics"] == n - bad
    # a value metric of the kept examples: finite (a NaN row times its weight 0 is NaN),
    # and the loss's value (the same cross-entropy, before the step)
    logs = {k: float(v) for k, v in dp.get_metrics_result().items()}
    assert np.isfinite(logs["sparse_categorical_crossentropy"])
    assert logs["sparse_categorical_crossentropy"] == pytest.approx(logs["loss"], rel=1e-5)


def test_shuffled_lots_restored_from_weights_are_epochs_of_their_own(tmp_path):
    """7 shuffled lots (2 permutations) restored into a new model, then 3 lots of a
    new permutation: 3 epochs touched, not 2 (one accounting epoch must not
    straddle two permutations)."""
    x, y = mnist_slice(50, features=60)

    class StopAfter(keras.callbacks.Callback):
        def __init__(self, lots):
            super().__init__()
            self.lots = lots

        def on_train_batch_end(self, batch, logs=None):
            self.lots -= 1
            if self.lots == 0:
                self.model.stop_training = True

    first = dp_model(noise=2.0, seed=None)
    first.build((None, 60))
    first.fit(
        x,
        y,
        lot_size=10,
        sampling="shuffle",
        epochs=2,
        verbose=0,
        callbacks=[StopAfter(7)],
        accountant="rdp",
    )
    assert first.privacy_ledger.count() == 2
    path = tmp_path / "w.weights.h5"
    first.save_weights(path)
    second = dp_model(noise=2.0, seed=None)
    second.build((None, 60))
    second.load_weights(path)
    with pytest.warns(RuntimeWarning, match="7 lots restored"):
        second.fit(
            x,
            y,
            lot_size=10,
            sampling="shuffle",
            epochs=1,
            verbose=0,
            callbacks=[StopAfter(3)],
            accountant="rdp",
        )
    assert second.lots_computed == 10
    assert second.privacy_ledger.count() == 3
    assert second.epsilon(1e-5, "rdp") == pytest.approx(
        compute_epsilon(dp_sgd_event(2.0, 0, "shuffle", epochs=3), 1e-5, "rdp")
    )


def test_auto_steps_per_execution_divides_the_epoch():
    from dpfl_tf.keras.model import auto_steps_per_execution

    assert auto_steps_per_execution(100) == 10  # MNIST, lot 600
    assert auto_steps_per_execution(195) == 15  # 50,000 / 256: 13 calls an epoch
    assert auto_steps_per_execution(20) == 2
    assert auto_steps_per_execution(19) == 1  # fewer than 20 lots an epoch
    assert auto_steps_per_execution(97) == 1  # prime: only 1 divides it
    assert auto_steps_per_execution(100, distributed=True) == 1
    for lots in range(1, 400):
        spe = auto_steps_per_execution(lots)
        assert lots % spe == 0 and (spe == 1 or lots // spe >= 10)


def test_auto_steps_per_execution_trains_exactly_the_epochs_asked():
    """The default compile runs several lots per call (here 2 of an epoch's 20),
    trains exactly epochs x lots (no call past an epoch's end), and keeps "auto"
    when saved and loaded."""
    x, y = mnist_slice(400, features=60)

    class Calls(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.lots = []

        def on_train_batch_end(self, batch, logs=None):
            self.lots.append(self.model.lots_computed)

    dp = dp_model()
    calls = Calls()
    dp.fit(x, y, lot_size=20, epochs=2, verbose=0, callbacks=[calls])
    assert dp.steps_per_execution == 2
    assert dp.lots_computed == dp.lots_applied == 40
    assert calls.lots == list(range(2, 41, 2))  # one callback per call of 2 lots
    assert dp.privacy_ledger.entries[0]["count"] == 40
    assert dp.get_compile_config()["steps_per_execution"] == "auto"
    one = dp_model()
    one.compile(optimizer=one.optimizer, loss=loss(), steps_per_execution=1)
    calls = Calls()
    one.fit(x, y, lot_size=20, epochs=1, verbose=0, callbacks=[calls])
    assert calls.lots == list(range(1, 21))


def test_steps_per_execution_that_does_not_divide_the_epoch_is_refused():
    x, y = mnist_slice(120, features=60)
    dp = dp_model()
    dp.compile(optimizer=dp.optimizer, loss=loss(), steps_per_execution=4)
    with pytest.raises(ValueError, match=r"steps_per_execution=4 does not divide the 6 lots"):
        dp.fit(x, y, lot_size=20, epochs=1, verbose=0)
    assert dp.lots_computed == 0 and not dp.privacy_ledger.entries
    with pytest.raises(ValueError, match="steps_per_execution must be an integer|>= 1"):
        dp.compile(optimizer=dp.optimizer, loss=loss(), steps_per_execution=0)


def test_evaluate_and_predict_cover_every_example_after_fit_changes_the_steps():
    """Keras builds evaluate / predict for the steps_per_execution of their first
    trace (a one-step predict function keeps one batch of each call): a fit that
    changes it drops them, so every example is still predicted and evaluated."""
    x, y = mnist_slice(400, features=60)
    dp = dp_model()
    before = dp.predict(x, batch_size=20, verbose=0)
    dp.evaluate(x, y, batch_size=20, verbose=0)
    dp.fit(x, y, lot_size=20, epochs=1, verbose=0, validation_data=(x[:100], y[:100]))
    assert dp.steps_per_execution == 2
    after = dp.predict(x, batch_size=20, verbose=0)
    assert before.shape == after.shape == (400, 10)
    logits = dp.model(x, training=False).numpy()
    np.testing.assert_allclose(after, logits, rtol=1e-4, atol=1e-5)
    loss_value = dp.evaluate(x, y, batch_size=20, verbose=0)[0]
    expected = float(np.mean(loss().call(y, logits).numpy()))
    assert loss_value == pytest.approx(expected, rel=1e-4)


def test_auto_steps_per_execution_trains_the_same_lots_and_noise_as_one_per_call():
    """Seeded: several lots per call draw the same lots and the same noise
    positions as one lot per call -- the same weights and ledger."""
    x, y = mnist_slice(400, features=60)
    runs = []
    for steps in ("auto", 1):
        keras.utils.set_random_seed(4)
        dp = DPModel(mlp())
        dp.compile(
            optimizer=DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.0, seed=11),
            loss=loss(),
            steps_per_execution=steps,
        )
        dp.fit(x, y, lot_size=20, epochs=2, verbose=0, sampling_seed=5)
        runs.append((dp.steps_per_execution, weights(dp), dp.privacy_ledger.to_dict()))
    (k_auto, w_auto, ledger_auto), (k_one, w_one, ledger_one) = runs
    assert (k_auto, k_one) == (2, 1)
    for a, b in zip(w_auto, w_one):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert ledger_auto == ledger_one


def test_a_planned_end_inside_a_call_of_several_lots_is_exact():
    """The recipes' LotStopper ends training after exactly its lots, also when a
    call of the training function holds several (an in-graph limit)."""
    from dpfl_tf.recipes.common import LotStopper

    x, y = mnist_slice(400, features=60)
    dp = dp_model()
    dp.fit(x, y, lot_size=20, epochs=3, verbose=0, callbacks=[LotStopper(27)])
    assert dp.steps_per_execution == 2
    assert dp.lots_computed == dp.lots_applied == 27
    assert dp.privacy_ledger.entries[0]["count"] == 27
    dp.fit(x, y, lot_size=20, epochs=1, verbose=0)  # the limit is gone afterwards
    assert dp.lots_computed == 47


def test_several_lots_per_call_under_a_one_replica_strategy_are_refused():
    x, y = mnist_slice(400, features=60)
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        dp = dp_model()
        dp.compile(optimizer=dp.optimizer, loss=loss(), steps_per_execution=2)
    with pytest.raises(ValueError, match="steps_per_execution must be 1 under a distribution"):
        dp.fit(x, y, lot_size=20, epochs=1, verbose=0)
    assert dp.lots_computed == 0
    with strategy.scope():
        auto = dp_model()
    auto.fit(x, y, lot_size=20, epochs=1, verbose=0)  # "auto" is 1 there
    assert auto.steps_per_execution == 1 and auto.lots_computed == 20


# -- calibration in fit, and refusals that say what a lot costs -------------------------
def test_fit_calibrates_an_unset_noise_multiplier_to_the_target():
    """fit(target_epsilon=, epochs=) with noise_multiplier=None: the smallest sigma
    whose planned lots spend <= the target (close to it), stored on the optimizer."""
    x, y = mnist_slice(1000, features=60)
    dp = DPModel(mlp(), accountant="rdp")
    opt = DPSGD(0.5, l2_norm_clip=1.0)
    assert opt.noise_multiplier is None
    dp.compile(optimizer=opt, loss=loss())
    dp.fit(x, y, lot_size=50, epochs=3, target_epsilon=2.0, verbose=0)
    sigma = opt.noise_multiplier
    assert dp.lots_computed == 60 and dp.calibration["noise_multiplier"] == sigma
    assert 1.98 < dp.epsilon(1e-5) <= 2.0
    assert dp.calibration["epsilon"] == pytest.approx(dp.epsilon(1e-5), rel=1e-12)
    want, _ = calibrate_noise_multiplier(
        2.0, 1e-5, lambda s: dp_sgd_event(s, 60, sampling_rate=0.05), "rdp"
    )
    assert sigma == pytest.approx(want, rel=1e-12)
    assert DPSGD.from_config(opt.get_config()).noise_multiplier == sigma
    dp.fit(x, y, lot_size=50, epochs=1, verbose=0)  # set now: no recalibration
    assert opt.noise_multiplier == sigma and dp.calibration is None


def test_calibration_accounts_for_what_the_ledger_already_holds():
    x, y = mnist_slice(1000, features=60)
    ledger = PrivacyLedger("rdp")
    ledger.record(dp_accounting.GaussianDpEvent(4.0), 1, label="dp-pca")
    sigmas = []
    for held in (None, ledger):
        dp = DPModel(mlp(), accountant="rdp", ledger=held)
        dp.compile(optimizer=DPSGD(0.5, l2_norm_clip=1.0), loss=loss())
        dp.fit(x, y, lot_size=50, epochs=2, target_epsilon=2.0, verbose=0)
        assert dp.lots_computed == 40 and 1.98 < dp.epsilon(1e-5) <= 2.0
        sigmas.append(dp.optimizer.noise_multiplier)
    assert dp.calibration["epsilon_before"] > 0.5
    assert sigmas[1] > sigmas[0]


def test_an_unset_noise_multiplier_without_a_target_is_refused():
    x, y = mnist_slice(200, features=60)
    dp = DPModel(mlp())
    dp.compile(optimizer=DPSGD(0.5, l2_norm_clip=1.0), loss=loss())
    with pytest.raises(ValueError, match="noise_multiplier is unset.*target_epsilon=") as err:
        dp.fit(x, y, lot_size=50, verbose=0)
    assert "\n" not in str(err.value)
    assert dp.lots_computed == 0 and len(dp.privacy_ledger) == 0


def test_a_budget_too_small_for_one_lot_says_what_a_lot_costs_per_accountant():
    """sigma 1.1, q 0.01, target 1: the moments accountant says one lot costs
    1.088, PLD 0.142; the refusal says so and what to change."""
    x, y = mnist_slice(1000, features=60)
    dp = dp_model(noise=1.1)
    with pytest.raises(BudgetExceededError) as err:
        dp.fit(x, y, lot_size=10, epochs=1, target_epsilon=1.0, verbose=0)
    text = str(err.value)
    assert "\n" not in text
    assert "1.088 (moments)" in text and "0.1423 (pld)" in text
    assert "fit(accountant='pld')" in text and "noise_multiplier >= 1.1" in text
    assert "noise_multiplier=None" in text
    assert dp.lots_computed == 0 and len(dp.privacy_ledger) == 0

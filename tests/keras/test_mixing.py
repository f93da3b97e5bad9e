"""The guard against cross-example dependence: Keras losses and layers known
to mix the batch are refused at compile; the probe at fit start catches the
rest and names the layer or the loss; nothing trains, the ledger stays empty."""

import random
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.keras import DPSGD, DPModel
from dpfl_tf.keras.mixing import BatchMixingLayerError, BatchMixingLossError, probe_batch_mixing
from tests.keras.helpers import loss, mlp, mnist_slice
from tests.keras.test_per_example import Subclassed


def _dp(model, loss_fn=None, **compile_kwargs):
    dp = DPModel(model)
    dp.compile(
        optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=loss_fn or loss(),
        **compile_kwargs,
    )
    return dp


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize(
    "loss_fn, named",
    [
        (keras.losses.Circle(), "Circle"),
        ("circle", "circle"),
        (keras.losses.Dice(), "axis=None"),
        (keras.losses.Tversky(), "axis=None"),
        (keras.losses.CosineSimilarity(axis=0), "axis=0"),
        (keras.losses.CategoricalCrossentropy(axis=0), "axis=0"),
    ],
)
def test_keras_losses_that_mix_the_batch_are_refused_at_compile(loss_fn, named):
    with pytest.raises(BatchMixingLossError) as err:
        _dp(mlp(), loss_fn)
    text = _one_line(err)
    assert named in text and ("use a per-example loss" in text or "pass axis=" in text)


def test_per_example_forms_of_those_losses_are_accepted():
    for loss_fn in (keras.losses.Dice(axis=(1,)), keras.losses.CosineSimilarity(axis=-1)):
        _dp(mlp(), loss_fn)


@pytest.mark.parametrize(
    "layer, named",
    [
        (lambda: keras.layers.Softmax(axis=0), "axis=0"),
        (lambda: keras.layers.UnitNormalization(axis=[0, 1]), "axis=[0, 1]"),
        (lambda: keras.layers.MixUp(), "MixUp"),
    ],
)
def test_keras_layers_that_mix_the_batch_are_refused_at_compile(layer, named):
    model = keras.Sequential([keras.Input((60,)), keras.layers.Dense(10), layer()])
    with pytest.raises(BatchMixingLayerError) as err:
        _dp(model)
    assert named in _one_line(err)


def _centred(seed=0):
    """An MLP whose hidden layer subtracts the batch mean (the issue's Lambda)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((60,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Lambda(lambda t: t - keras.ops.mean(t, axis=0), name="batch_centre"),
            keras.layers.Dense(10),
        ]
    )


def _refused_by_probe(dp, model, error=BatchMixingLayerError, **fit_kwargs):
    x, y = mnist_slice(200, features=60)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(error) as err:
        dp.fit(x, y, lot_size=50, epochs=1, verbose=0, **fit_kwargs)
    assert dp.lots_computed == 0 and dp.privacy_ledger.count() == 0
    assert len(dp.privacy_ledger) == 0
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    return _one_line(err)


@pytest.mark.parametrize("compile_kwargs", [{}, {"jit_compile": True}, {"steps_per_execution": 2}])
def test_a_lambda_centring_the_batch_is_refused_before_any_lot(compile_kwargs):
    model = _centred()
    message = _refused_by_probe(_dp(model, **compile_kwargs), model)
    assert "'batch_centre'" in message and "Lambda" in message
    assert "nothing was trained" in message


def test_lots_that_repeat_their_examples_do_not_blind_the_probe():
    """Full-batch lots of 5 examples: the probe read the same 5 examples from each
    of its lots, so its two halves were equal and a batch-centring Lambda trained
    (the model-zoo fuzzer's seeds 13, 34, 148, 196, 251).  It now probes distinct
    records only."""
    model = _centred()
    dp = _dp(model)
    x, y = mnist_slice(5, features=60)
    with pytest.raises(BatchMixingLayerError, match="batch_centre"):
        dp.fit(x, y, lot_size=5, epochs=1, verbose=0, sampling="full_batch")
    assert dp.lots_computed == 0 and len(dp.privacy_ledger) == 0


def test_the_probe_runs_under_a_mirrored_strategy():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    with strategy.scope():
        model = _centred()
        dp = _dp(model)
    assert "'batch_centre'" in _refused_by_probe(dp, model)


class BatchCentred(Subclassed):
    """Mixing in the model's own call, between its layers."""

    def call(self, x, training=None):
        h = self.d1(x)
        return self.d2(h - keras.ops.mean(h, axis=0))


def test_mixing_in_a_subclassed_models_call_names_the_model():
    model = BatchCentred()
    model(np.zeros((1, 60), "float32"))
    assert "model" in _refused_by_probe(_dp(model), model)


def _scaled_by_the_batch(statistic):
    """A loss that mixes the batch: each example's cross-entropy divided by
    `statistic` (keras.ops.mean, keras.ops.max) of the batch's."""
    base = loss()

    def relative_loss(y_true, y_pred):
        values = base.call(y_true, y_pred)
        return values / statistic(values)

    return relative_loss


def test_a_custom_loss_normalised_by_the_batch_is_refused_and_named():
    model = mlp()
    message = _refused_by_probe(
        _dp(model, _scaled_by_the_batch(keras.ops.mean)), model, BatchMixingLossError
    )
    assert "'relative_loss'" in message


def test_a_loss_normalised_by_the_batch_is_refused_when_both_halves_have_the_same_mean():
    # The second half is the first half reordered: the batch's mean loss is the first
    # half's, so comparing against [first half, first half] alone sees no change.
    x, y = mnist_slice(8, features=60)
    order = np.array([3, 0, 7, 5, 1, 6, 2, 4])
    x, y = np.concatenate([x, x[order]]), np.concatenate([y, y[order]])
    with pytest.raises(BatchMixingLossError):
        probe_batch_mixing(mlp(), _scaled_by_the_batch(keras.ops.mean), x, y)
    probe_batch_mixing(mlp(), loss(), x, y)  # the per-example loss passes on the same batch


def test_a_loss_scaled_by_the_batchs_largest_loss_is_refused_when_the_first_half_holds_it():
    # The example with the largest loss comes first: every replacement of the second half
    # keeps the batch's largest loss, so only replacing the first half shows the mixing.
    model = mlp()
    x, y = mnist_slice(16, features=60)
    order = np.argsort(-loss().call(y, model(x)).numpy())
    x, y = x[order], y[order]
    with pytest.raises(BatchMixingLossError):
        probe_batch_mixing(model, _scaled_by_the_batch(keras.ops.max), x, y)


def test_dropout_and_a_per_example_model_pass_and_the_probe_leaves_randomness_as_it_was():
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((60,)),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dropout(0.5),
            keras.layers.LayerNormalization(),
            keras.layers.Dense(10),
        ]
    )
    x, y = mnist_slice(16, features=60)
    seeds = [v.numpy().copy() for v in model.variables if not v.trainable]
    state = random.getstate()
    probe_batch_mixing(model, loss(), x, y)
    assert random.getstate() == state
    for a, v in zip(seeds, [v for v in model.variables if not v.trainable]):
        np.testing.assert_array_equal(a, v.numpy())
    dp = _dp(model)
    dp.fit(*mnist_slice(200, features=60), lot_size=50, epochs=1, verbose=0)
    assert dp.lots_computed == 4


def test_randomness_outside_keras_seed_generators_gives_a_warning_not_a_refusal():
    keras.utils.set_random_seed(4)
    model = keras.Sequential(
        [
            keras.Input((60,)),
            keras.layers.Dense(16),
            keras.layers.Lambda(lambda t: t + tf.random.normal(tf.shape(t)), name="tf_noise"),
            keras.layers.Dense(10),
        ]
    )
    x, y = mnist_slice(16, features=60)
    with pytest.warns(RuntimeWarning, match="could not check"):
        probe_batch_mixing(model, loss(), x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        probe_batch_mixing(mlp(), loss(), x, y)  # a deterministic model: silent

"""The MNIST recipe on a real slice: learns, and its epsilon is the accountant's."""

import json
import os

import numpy as np
import pytest

from dpfl_tf.privacy import compute_epsilon, dp_sgd_event
from dpfl_tf.recipes import mnist as recipe
from dpfl_tf.recipes.mnist import MnistConfig, train_mnist
from tests.keras.helpers import cut_recipe_data

# what XLA and TensorFlow compile here stays until the process ends (+0.8 GB in a
# whole-suite worker): the file runs in a process of its own (tests/isolation.py)
pytestmark = pytest.mark.isolated


@pytest.fixture
def small_mnist(monkeypatch):
    """The real MNIST cut to its first 6,000 training and 2,000 test examples."""
    cut_recipe_data(monkeypatch, 6000, 2000)


def test_short_dp_run_learns_and_reports_the_accountants_epsilon(small_mnist):
    config = MnistConfig(
        noise_multiplier=1.5,
        pca_noise_multiplier=8.0,
        pca_sample_size=2000,
        lot_size=200,
        batch_size=512,
        target_epsilon=None,
        epochs=4,
        learning_rate=0.2,
        final_learning_rate=0.2,
        seed=0,
    )
    result = train_mnist(config, verbose=False)
    assert result["test_accuracy"] > 0.6  # chance is 0.1
    assert result["lots"] == 4 * 30
    # DP-PCA (one sampled Gaussian) + 120 lots, composed in one ledger
    import dp_accounting

    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.PoissonSampledDpEvent(2000 / 6000, dp_accounting.GaussianDpEvent(8.0)),
            dp_sgd_event(1.5, 120, sampling_rate=200 / 6000),
        ]
    )
    assert result["epsilon"] == pytest.approx(compute_epsilon(event, 1e-5, "moments"), rel=1e-9)
    assert "NOT for deployment" in result["note"]
    # train accuracy is measured on the private data without noise: labelled as such
    assert "train_accuracy" in result["non_private_statistics"]
    assert "not covered by epsilon" in result["non_private_statistics_note"]
    json.dumps(result)  # JSON-ready
    for key in [
        "dataset",
        "setting",
        "noise_multiplier",
        "pca_noise_multiplier",
        "epsilon",
        "delta",
        "accountant",
        "epochs",
        "test_accuracy",
        "train_accuracy",
        "seconds",
    ]:
        assert key in result


def test_budget_is_respected(small_mnist):
    config = MnistConfig(
        noise_multiplier=2.0,
        pca_noise_multiplier=8.0,
        pca_sample_size=2000,
        lot_size=600,
        batch_size=1024,
        target_epsilon=1.0,
        epochs=50,
        hidden_units=50,
        seed=1,
        eval_every=10,
    )
    result = train_mnist(config, verbose=False)
    assert result["epsilon"] <= 1.0
    assert result["epochs"] < 50


def test_bad_configs():
    with pytest.raises(ValueError, match="projection='pca' is not private"):
        MnistConfig(projection="pca")
    with pytest.raises(ValueError, match="model must be"):
        MnistConfig(model="resnet")
    with pytest.raises(ValueError, match="validation must be a whole number"):
        MnistConfig(validation=-1)


class _SmallSlice:
    """The real MNIST, cut to 4000 / 1000 examples (the scattering runs on all)."""

    def __init__(self, full):
        self.x_train, self.y_train = full.x_train[:4000], full.y_train[:4000]
        self.x_test, self.y_test = full.x_test[:1000], full.y_test[:1000]


def test_scatter_linear_learns_and_costs_only_the_dp_sgd_lots(monkeypatch):
    real = recipe.load_dataset
    monkeypatch.setattr(recipe, "load_dataset", lambda *a, **k: _SmallSlice(real(*a, **k)))
    config = MnistConfig(
        model="scatter_linear",
        noise_multiplier=1.0,
        l2_norm_clip=0.1,
        lot_size=400,
        batch_size=400,
        learning_rate=2.0,
        final_learning_rate=2.0,
        momentum=0.9,
        target_epsilon=None,
        epochs=4,
        accountant="pld",
        seed=0,
        eval_every=4,
    )
    result = train_mnist(config, verbose=False)
    assert result["test_accuracy"] > 0.8  # chance is 0.1
    assert result["lots"] == 4 * 10
    assert result["pca_noise_multiplier"] is None
    # the scattering is data-independent: the ledger holds the DP-SGD lots alone
    assert len(result["ledger"]) == 1
    assert result["epsilon"] == pytest.approx(
        compute_epsilon(dp_sgd_event(1.0, 40, sampling_rate=400 / 4000), 1e-5, "pld"), rel=1e-9
    )


def test_mirror_views_are_for_the_scattering_models():
    with pytest.raises(ValueError, match="mirror_views is for the scattering models"):
        MnistConfig(mirror_views=True)
    MnistConfig(model="scatter_cnn", mirror_views=True)


def test_only_the_scatternet_takes_colour_images():
    with pytest.raises(ValueError, match="model='mlp' needs 28x28 grey images"):
        MnistConfig(dataset="cifar10")
    MnistConfig(dataset="cifar10", model="scatter_linear")


def test_exact_feature_statistics_are_refused_for_private_runs():
    with pytest.raises(ValueError, match="feature_norm='stats' is not private"):
        MnistConfig(dataset="cifar10", model="scatter_linear", feature_norm="stats")
    with pytest.raises(ValueError, match="is for the scattering models"):
        MnistConfig(feature_norm="dp_stats")
    with pytest.raises(ValueError, match="feature_norm must be one of"):
        MnistConfig(model="scatter_linear", feature_norm="batch")


def test_scattering_features_are_computed_in_memory_when_the_cache_is_read_only(
    monkeypatch, read_only_dir
):
    directory, _ = read_only_dir
    monkeypatch.setenv("DPFL_CACHE_DIR", str(directory))
    full = recipe.load_dataset("mnist")

    class Tiny:
        x_train, x_test = full.x_train[:12], full.x_test[:4]

    with pytest.warns(RuntimeWarning, match="scattering features not cached"):
        train, test = recipe._scattering_features(Tiny, mirror=True)
    assert not isinstance(train, np.memmap) and train.shape == (12, 2, 7, 7, 81)
    np.testing.assert_allclose(
        train[:, 1],
        recipe.Scattering2D(J=2, L=8, shape=(28, 28)).transform(
            full.x_train[:12, :, ::-1].astype("float32") / 255.0
        ),
        rtol=1e-5,
        atol=1e-6,
    )
    assert test.shape == (4, 2, 7, 7, 81) and os.listdir(directory) == []


def test_a_validation_run_trains_on_the_rest_and_evaluates_on_the_held_out(monkeypatch):
    import dataclasses

    import dp_accounting

    real = recipe.load_dataset
    splits = []

    def sliced(*a, **k):
        full = real(*a, **k)
        return dataclasses.replace(full, x_train=full.x_train[:6000], y_train=full.y_train[:6000])

    def spy(self, n, **kw):
        splits.append(original(self, n, **kw))
        return splits[-1]

    def inputs(*a, **k):  # what the run trains and evaluates on
        prepared.append(real_inputs(*a, **k))
        return prepared[-1]

    original, real_inputs, prepared = type(real("mnist")).validation_split, recipe._inputs, []
    monkeypatch.setattr(recipe, "load_dataset", sliced)
    monkeypatch.setattr(type(real("mnist")), "validation_split", spy)
    monkeypatch.setattr(recipe, "_inputs", inputs)
    config = MnistConfig(
        validation=1000,
        noise_multiplier=1.5,
        pca_noise_multiplier=8.0,
        lot_size=200,
        batch_size=512,
        target_epsilon=None,
        epochs=1,
        seed=0,
    )
    result, model = train_mnist(config, verbose=False, return_model=True)
    assert result["evaluated_on"] == "validation (1000 training examples held out)"
    assert result["lots"] == 25  # 5,000 training examples / lot 200: the rest of the 6,000
    event = dp_accounting.ComposedDpEvent(  # DP-PCA and DP-SGD both over the 5,000
        [
            dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(8.0)),
            dp_sgd_event(1.5, 25, sampling_rate=200 / 5000),
        ]
    )
    assert result["epsilon"] == pytest.approx(compute_epsilon(event, 1e-5, "moments"), rel=1e-9)
    # "test_accuracy" is the accuracy on the 1,000 held-out training examples
    (split,) = splits
    assert len(split.y_test) == 1000 and len(split.y_train) == 5000
    ((x_train, x_held, _),) = prepared
    assert len(x_train) == 5000 and len(x_held) == 1000
    predicted = np.argmax(model.predict(x_held, verbose=0), axis=1)
    assert result["test_accuracy"] == pytest.approx(np.mean(predicted == split.y_test), abs=1e-6)

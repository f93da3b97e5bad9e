"""The MNIST recipe on a real slice: learns, and its epsilon is the accountant's."""

import dataclasses
import json
import os

import dp_accounting
import numpy as np
import pytest

from dpfl_tf.privacy import compute_epsilon, dp_sgd_event
from dpfl_tf.recipes import mnist as recipe
from dpfl_tf.recipes.mnist import MnistConfig, train_mnist

# what XLA and TensorFlow compile here stays until the process ends (+2.3 GB in a
# whole-suite worker): the file runs in a process of its own (tests/isolation.py)
pytestmark = pytest.mark.isolated


class _Slice:
    """The real MNIST, cut to 6000 / 2000 examples to keep the test short."""

    def __init__(self, full):
        self.x_train, self.y_train = full.x_train[:6000], full.y_train[:6000]
        self.x_test, self.y_test = full.x_test[:2000], full.y_test[:2000]


@pytest.fixture
def small_mnist(monkeypatch):
    real = recipe.load_dataset
    monkeypatch.setattr(recipe, "load_dataset", lambda *a, **k: _Slice(real(*a, **k)))


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


class _CifarSlice:
    """The real CIFAR-10 (JPEG copy), cut to n / 500 images taken evenly across the
    copy (its images are stored class by class: a leading slice is one class)."""

    def __init__(self, full, n=2000):
        self.source = full.source
        step = len(full.y_train) // n
        self.x_train, self.y_train = full.x_train[::step][:n], full.y_train[::step][:n]
        self.x_test, self.y_test = full.x_test[::20], full.y_test[::20]
        assert np.bincount(self.y_train).min() >= n // 20  # every class, chance 0.1


def test_scatter_linear_on_cifar10_learns_and_reuses_the_features(monkeypatch, tmp_path):
    """Colour images: 8x8x243 features; the scattering of the same pixels runs once
    (the features are kept in the cache directory), other pixels get their own."""
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path))
    real = recipe.load_dataset
    sizes = iter([2000, 2000, 1000, 1000])
    monkeypatch.setattr(
        recipe, "load_dataset", lambda *a, **k: _CifarSlice(real(*a, **k), next(sizes))
    )
    calls = []
    transform = recipe.Scattering2D.transform
    monkeypatch.setattr(
        recipe.Scattering2D,
        "transform",
        lambda self, x, **k: calls.append(len(x)) or transform(self, x, **k),
    )
    config = MnistConfig(
        dataset="cifar10",
        model="scatter_linear",
        noise_multiplier=1.0,
        l2_norm_clip=0.1,
        lot_size=200,
        batch_size=200,
        learning_rate=4.0,
        final_learning_rate=4.0,
        momentum=0.9,
        target_epsilon=None,
        epochs=3,
        accountant="pld",
        seed=0,
        eval_every=3,
    )
    result = train_mnist(config, verbose=False)
    assert result["test_accuracy"] > 0.2  # chance is 0.1
    assert result["dataset_source"] == "CIFAR-10 (JPEG copy)"
    # images scattered: 2000 train + 500 test, in chunks of at most SCATTER_CHUNK
    assert sum(calls) == 2500 and max(calls) <= recipe.SCATTER_CHUNK < 2000
    assert len(result["ledger"]) == 1 and result["lots"] == 3 * 10
    train_mnist(config, verbose=False)  # the same pixels: no new scattering
    assert sum(calls) == 2500
    train_mnist(dataclasses.replace(config, epochs=1), verbose=False)  # 1000 images: new
    assert sum(calls) == 3500  # the same 500 test images: read back
    files = sorted(tmp_path.joinpath("scattering").iterdir())
    assert len(files) == 3 and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    for f in files:  # a file that is not what the key promises is computed again
        np.save(f, np.zeros((3, 8, 8, 243), np.float32))
    train_mnist(dataclasses.replace(config, epochs=1), verbose=False)
    assert sum(calls) == 5000


def test_mirror_views_train_a_mirror_invariant_model_at_the_same_privacy_cost(
    monkeypatch, tmp_path
):
    """mirror_views: features of each image and its mirror image ([N, 2, 8, 8, 243],
    cached on disk and read as memmaps), the model averages its logits over both; the
    ledger is the same as without views (one release, the DP-SGD lots)."""
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path))
    real = recipe.load_dataset
    monkeypatch.setattr(recipe, "load_dataset", lambda *a, **k: _CifarSlice(real(*a, **k)))
    config = MnistConfig(
        dataset="cifar10",
        model="scatter_linear",
        feature_norm="dp_stats",
        noise_multiplier=1.0,
        l2_norm_clip=0.1,
        lot_size=200,
        batch_size=200,
        learning_rate=4.0,
        final_learning_rate=4.0,
        momentum=0.9,
        target_epsilon=None,
        epochs=3,
        accountant="pld",
        seed=0,
        eval_every=3,
        mirror_views=True,
    )
    nets = []
    build = recipe.scatter_linear
    monkeypatch.setattr(
        recipe, "scatter_linear", lambda *a, **k: nets.append(build(*a, **k)) or nets[-1]
    )
    result = train_mnist(config, verbose=False)
    assert result["mirror_views"] is True
    assert result["test_accuracy"] > 0.2  # chance is 0.1
    assert nets[0].input_shape == (None, 2, 8, 8, 243)
    assert [e["label"] for e in result["ledger"]] == ["dp_feature_norm", "dpsgd"]
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.GaussianDpEvent(config.feature_norm_noise_multiplier / 6**0.5),
            dp_sgd_event(1.0, 30, sampling_rate=200 / 2000),
        ]
    )
    assert result["epsilon"] == pytest.approx(compute_epsilon(event, 1e-5, "pld"), rel=1e-9)
    files = sorted(os.listdir(tmp_path / "scattering"))
    shapes = sorted(np.load(tmp_path / "scattering" / f, mmap_mode="r").shape for f in files)
    assert shapes == [(500, 2, 8, 8, 243), (2000, 2, 8, 8, 243)]
    calls = []
    monkeypatch.setattr(recipe.Scattering2D, "transform", lambda *a, **k: calls.append(1))
    again = train_mnist(config, verbose=False)  # read from the cache
    assert calls == [] and again["test_accuracy"] == result["test_accuracy"]


def test_mirror_views_are_for_the_scattering_models():
    with pytest.raises(ValueError, match="mirror_views is for the scattering models"):
        MnistConfig(mirror_views=True)
    MnistConfig(model="scatter_cnn", mirror_views=True)


def test_only_the_scatternet_takes_colour_images():
    with pytest.raises(ValueError, match="model='mlp' needs 28x28 grey images"):
        MnistConfig(dataset="cifar10")
    MnistConfig(dataset="cifar10", model="scatter_linear")


def test_scatter_cnn_with_dp_statistics_pays_for_them_and_resumes_without_a_second_release(
    monkeypatch, tmp_path
):
    """feature_norm='dp_stats': the normalisation is one release in the ledger
    before the lots, the noise is calibrated for what remains of the budget, and
    a resumed run restores the released statistics with the model (no second
    release, the same normalisation)."""
    real = recipe.load_dataset
    monkeypatch.setattr(recipe, "load_dataset", lambda *a, **k: _CifarSlice(real(*a, **k)))
    config = MnistConfig(
        dataset="cifar10",
        model="scatter_cnn",
        feature_norm="dp_stats",
        noise_multiplier=None,
        target_epsilon=3.0,
        l2_norm_clip=0.1,
        lot_size=400,
        batch_size=400,
        learning_rate=2.0,
        final_learning_rate=2.0,
        momentum=0.9,
        epochs=4,
        accountant="pld",
        seed=0,
        eval_every=2,
    )
    stops = iter([False] * 9 + [True] + [False] * 100)  # stop after 10 lots (2 epochs)
    first = train_mnist(
        config, verbose=False, checkpoint_dir=str(tmp_path), should_stop=lambda: next(stops)
    )
    assert first["stop_reason"] == "interrupted" and first["lots"] == 10
    labels = [e["label"] for e in first["ledger"]]
    assert labels[0] == "dp_feature_norm" and labels.count("dp_feature_norm") == 1
    norm_event = dp_accounting.GaussianDpEvent(config.feature_norm_noise_multiplier / 6**0.5)
    sigma = first["noise_multiplier"]
    lots_event = dp_sgd_event(sigma, 20, sampling_rate=400 / 2000)
    full = compute_epsilon(dp_accounting.ComposedDpEvent([norm_event, lots_event]), 1e-5, "pld")
    assert full <= 3.0 and full > 2.9  # calibrated for the remainder, to tolerance
    assert compute_epsilon(lots_event, 1e-5, "pld") < full
    from dpfl_tf.keras.checkpoint import DPCheckpoint

    def released_statistics():
        model, _ = DPCheckpoint.restore(str(tmp_path))
        norm = next(layer for layer in model.model.layers if layer.name == "feature_norm")
        return np.asarray(norm.mean).ravel(), np.asarray(norm.variance).ravel()

    mean, variance = released_statistics()
    assert mean.shape == (243,) and np.abs(mean).max() > 0.1 and (variance > 0).any()
    # a checkpoint written before mirror_views existed resumes (the field's default)
    from dpfl_tf.recipes.common import RUN_STATE

    state_path = tmp_path / RUN_STATE
    state = json.loads(state_path.read_text())
    del state["config"]["mirror_views"]
    state_path.write_text(json.dumps(state))
    resumed = train_mnist(config, verbose=False, checkpoint_dir=str(tmp_path))
    assert resumed["lots"] == 20
    for before, after in zip((mean, variance), released_statistics()):
        np.testing.assert_array_equal(before, after)
    assert [e["label"] for e in resumed["ledger"]].count("dp_feature_norm") == 1
    assert resumed["epsilon"] == pytest.approx(full, rel=1e-6)
    assert resumed["test_accuracy"] > 0.2  # chance is 0.1


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

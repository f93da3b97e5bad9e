"""The MNIST recipe's ScatterNet models on colour images: real CIFAR-10 (the offline
JPEG copy) through the scattering transform, its feature cache, mirror views and DP
feature statistics."""

import dataclasses
import json
import os
import pathlib
import shutil

import dp_accounting
import numpy as np
import pytest

from dpfl_tf.privacy import compute_epsilon, dp_sgd_event
from dpfl_tf.recipes import mnist as recipe
from dpfl_tf.recipes.mnist import MnistConfig, train_mnist

# the scattering of CIFAR-10 images leaves the process 2.2 GB larger: the file runs in a
# process of its own (tests/isolation.py)
pytestmark = pytest.mark.isolated


def _cifar_slice(full, n=2000):
    """The real CIFAR-10 (JPEG copy) cut to n / 500 images taken evenly across the
    copy (its images are stored class by class: a leading slice is one class)."""
    step = len(full.y_train) // n
    cut = dataclasses.replace(
        full,
        x_train=full.x_train[::step][:n],
        y_train=full.y_train[::step][:n],
        x_test=full.x_test[::20],
        y_test=full.y_test[::20],
    )
    assert np.bincount(cut.y_train).min() >= n // 20  # every class, chance 0.1
    return cut


def _cache_without_features(monkeypatch, directory):
    """DPFL_CACHE_DIR -> `directory`, where no scattering features are cached yet but
    the decoded CIFAR-10 is (hard links to the test session's cache, filled once): the
    features are computed afresh, the 50,000 JPEGs are not decoded again (~10 s)."""
    recipe.load_dataset("cifar10")  # decodes into the session's cache, once a session
    session = pathlib.Path(os.environ["DPFL_CACHE_DIR"], "image_folder")
    (directory / "image_folder").mkdir()
    for source in session.glob("*.npz"):
        target = directory / "image_folder" / source.name
        try:
            os.link(source, target)
        except OSError:  # another file system
            shutil.copyfile(source, target)
    monkeypatch.setenv("DPFL_CACHE_DIR", str(directory))


def test_scatter_linear_on_cifar10_learns_and_reuses_the_features(monkeypatch, tmp_path):
    """Colour images: 8x8x243 features; the scattering of the same pixels runs once
    (the features are kept in the cache directory), other pixels get their own."""
    _cache_without_features(monkeypatch, tmp_path)
    real = recipe.load_dataset
    sizes = iter([2000, 2000, 1000, 1000])
    monkeypatch.setattr(
        recipe, "load_dataset", lambda *a, **k: _cifar_slice(real(*a, **k), next(sizes))
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
    # the same pixels, in a run of one epoch: no new scattering
    train_mnist(dataclasses.replace(config, epochs=1), verbose=False)
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
    _cache_without_features(monkeypatch, tmp_path)
    real = recipe.load_dataset
    monkeypatch.setattr(recipe, "load_dataset", lambda *a, **k: _cifar_slice(real(*a, **k)))
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


def test_scatter_cnn_with_dp_statistics_pays_for_them_and_resumes_without_a_second_release(
    monkeypatch, tmp_path
):
    """feature_norm='dp_stats': the normalisation is one release in the ledger
    before the lots, the noise is calibrated for what remains of the budget, and
    a resumed run restores the released statistics with the model (no second
    release, the same normalisation)."""
    real = recipe.load_dataset
    monkeypatch.setattr(recipe, "load_dataset", lambda *a, **k: _cifar_slice(real(*a, **k)))
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


@pytest.mark.slow
def test_a_search_of_scatter_linear_declares_each_trials_dp_statistics(monkeypatch, tmp_path):
    """`dpfl-tf train cifar10 --model scatter_linear --tune` (`tune_mnist`): every
    trial releases its own DP feature statistics (on its training examples, the
    held-out ones excluded), so the declared trial -- checked against each trial's
    ledger -- is [statistics, lots, score], and one trial (fixed k = 1) costs
    their composition in PLD (dp-accounting's accountant); the released model is
    scored on the test set through its own trial's normalisation."""
    from dpfl_tf.normalization import DPFeatureNormalization
    from dpfl_tf.recipes.tune import TuneConfig, tune_mnist

    fitted_on = []  # the examples each release of the statistics reads
    fit = DPFeatureNormalization.fit

    def recorded_fit(self, x, *args, **kwargs):
        fitted_on.append(len(x))
        return fit(self, x, *args, **kwargs)

    monkeypatch.setattr(DPFeatureNormalization, "fit", recorded_fit)

    # the session's cache: the features of this slice, if the scatter_cnn test above
    # computed them, are read back (what is checked here is the search, not the cache)
    real = recipe.load_dataset
    monkeypatch.setattr(recipe, "load_dataset", lambda *a, **k: _cifar_slice(real(*a, **k)))
    config = MnistConfig(
        dataset="cifar10",
        model="scatter_linear",
        feature_norm="dp_stats",
        noise_multiplier=None,
        target_epsilon=4.0,
        l2_norm_clip=0.1,
        lot_size=200,
        batch_size=200,
        learning_rate=4.0,
        final_learning_rate=4.0,
        momentum=0.9,
        epochs=2,
        accountant="pld",
        seed=0,
        eval_every=2,
    )
    tune = TuneConfig(trials=1, distribution="fixed", validation=0.2, learning_rates=(4.0,))
    result = tune_mnist(config, tune)
    assert result["stop_reason"] == "completed" and result["trials"] == "1 (fixed)"
    n, held = result["trial"]["training_examples"], result["score"]["validation_examples"]
    assert n + held == 2000 and abs(held - 400) < 100  # each held out with p = 0.2
    lots = 2 * (n // 200)
    assert result["trial"]["lots"] == lots
    norm_event = dp_accounting.GaussianDpEvent(config.feature_norm_noise_multiplier / 6**0.5)
    trial = dp_accounting.ComposedDpEvent(
        [
            norm_event,
            dp_sgd_event(result["noise_multiplier"], lots, sampling_rate=200 / n),
            dp_accounting.GaussianDpEvent(20.0),
        ]
    )
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.SelfComposedDpEvent(trial, 1))
    assert result["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    assert 3.9 < result["epsilon"] <= 4.0  # calibrated for the whole search
    assert fitted_on == [n]  # the statistics of the trial's training examples only
    assert result["best"]["hyperparameters"]["learning_rate"] == 4.0
    assert 0.2 < result["test_accuracy"] <= 1.0  # chance is 0.1

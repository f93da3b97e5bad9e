"""The CIFAR-10 recipe on a real slice of the offline JPEG copy: the public /
private split, frozen layers, a short DP run that learns, the results record,
pretrained-weight files and the CIFAR-100 pretraining path (generated file)."""

import dataclasses
import json

import keras
import numpy as np
import pytest

from dpfl_tf.cli import main as cli_main
from dpfl_tf.keras import DPSGD, DPModel
from dpfl_tf.privacy import compute_epsilon, dp_sgd_event
from dpfl_tf.recipes.augment import Augmentation
from dpfl_tf.recipes.cifar10 import (
    CifarConfig,
    PretrainConfig,
    TrainedLayers,
    build_private_model,
    clip_bounds_for,
    load_pretrained,
    pretrain_public,
    public_private_split,
    save_pretrained,
    stratified_split,
    train_cifar10,
)
from tests.data import CIFAR10_JPEG_ARCHIVE, isolate, real_cifar10_jpeg_slice, write_cifar100
from tests.keras.helpers import BIT_EXACT

# what XLA and TensorFlow compile here stays until the process ends (+0.4 GB in a
# whole-suite worker): the file runs in a process of its own (tests/isolation.py)
pytestmark = pytest.mark.isolated(env=BIT_EXACT)

needs_jpeg_copy = pytest.mark.skipif(
    not CIFAR10_JPEG_ARCHIVE.is_file(), reason=f"no offline JPEG copy at {CIFAR10_JPEG_ARCHIVE}"
)

N_TRAIN, N_TEST = 60, 30  # real images per class: 600 train, 300 test
PUBLIC = 200  # of the 600 training images; 400 are private


# ---------------------------------------------------------------------- splits


def test_split_is_disjoint_stratified_and_seeded():
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 5000))
    public, private = public_private_split(labels, 10000, seed=0)
    assert len(public) == 10000 and len(private) == 40000
    assert np.intersect1d(public, private).size == 0
    np.testing.assert_array_equal(np.union1d(public, private), np.arange(50000))
    assert np.bincount(labels[public]).tolist() == [1000] * 10
    assert np.all(np.diff(public) > 0) and np.all(np.diff(private) > 0)
    again, _ = public_private_split(labels, 10000, seed=0)
    np.testing.assert_array_equal(public, again)
    other, _ = public_private_split(labels, 10000, seed=1)
    assert not np.array_equal(public, other)
    # uneven classes: proportional counts (largest remainders), never more than a class has
    uneven = np.array([0] * 7 + [1] * 3 + [2] * 10)
    first, rest = stratified_split(uneven, 5, seed=3)
    assert np.bincount(uneven[first], minlength=3).tolist() == [2, 1, 2]  # 1.75, 0.75, 2.5
    assert len(rest) == 15
    with pytest.raises(ValueError, match=r"first_size must be <= the number of examples \(20\)"):
        stratified_split(uneven, 21, seed=0)


def test_config_validation_names_the_argument():
    with pytest.raises(ValueError, match="trained_layers must be one of softmax, top, dense, all"):
        CifarConfig(trained_layers="conv")
    with pytest.raises(ValueError, match="init='scratch' .* trained_layers must be 'all'"):
        CifarConfig(init="scratch", trained_layers="top")
    with pytest.raises(ValueError, match="give a target_epsilon or a noise_multiplier"):
        CifarConfig(target_epsilon=None, noise_multiplier=None)
    with pytest.raises(ValueError, match="noise_multiplier must be > 0"):
        CifarConfig(noise_multiplier=-1.0)
    with pytest.raises(ValueError, match="lot_size must be a whole number >= 1"):
        CifarConfig(lot_size=0)
    with pytest.raises(ValueError, match="delta must be in"):
        CifarConfig(delta=1.0)
    with pytest.raises(ValueError, match="public_data must be one of cifar10_split, cifar100"):
        PretrainConfig(public_data="imagenet")
    with pytest.raises(TypeError):
        CifarConfig(False)  # keyword-only
    config = CifarConfig(trained_layers="DENSE", l2_norm_clip=4.0, softmax_clip_ratio=2.0)
    assert config.trained_layers is TrainedLayers.DENSE
    assert config.clip_bounds == {"fc1": 4.0, "fc2": 4.0, "logits": 8.0}
    assert clip_bounds_for("softmax", 3.0) == {"logits": 6.0}
    assert clip_bounds_for("top", 3.0) == {"fc2": 3.0, "logits": 6.0}


# ---------------------------------------------------------------------- real slice


@pytest.fixture(scope="module")
def slice_dir(tmp_path_factory):
    """<dir>/cifar10_jpg/{train,test}/<class>/*.jpg: real images of the JPEG copy."""
    if not CIFAR10_JPEG_ARCHIVE.is_file():
        pytest.skip(f"no offline JPEG copy at {CIFAR10_JPEG_ARCHIVE}")
    root = tmp_path_factory.mktemp("cifar")
    real_cifar10_jpeg_slice(root / "cifar10_jpg", n_test=N_TEST, n_train=N_TRAIN)
    return root


@pytest.fixture
def env(monkeypatch, tmp_path, slice_dir):
    isolate(monkeypatch, tmp_path)
    return slice_dir


@pytest.fixture(scope="module")
def pretrained(slice_dir, tmp_path_factory):
    """A short non-private pretraining on the 200-image public split of the slice."""
    with pytest.MonkeyPatch.context() as mp:
        isolate(mp, tmp_path_factory.mktemp("pre"))
        config = PretrainConfig(
            public_size=PUBLIC,
            epochs=6,
            batch_size=25,
            eval_every=3,
            seed=0,
            data_dir=str(slice_dir),
        )
        net, info = pretrain_public(config, verbose=False)
    return net, info, config


def _config(slice_dir, pre_config, **kw):
    base = dict(
        pretrain=pre_config,
        lot_size=50,
        batch_size=50,
        epochs=2,
        seed=0,
        data_dir=str(slice_dir),
        train_eval_size=100,
        target_epsilon=None,
        noise_multiplier=1.0,
        learning_rate=0.1,
    )
    return CifarConfig(**{**base, **kw})


@needs_jpeg_copy
def test_pretraining_record(pretrained):
    net, info, _ = pretrained
    assert net.output_shape == (None, 10)
    assert info["public_data"] == "cifar10_split" and info["public_examples"] == PUBLIC
    assert info["public_source"] == "CIFAR-10 (JPEG copy)" and info["classes"] == 10
    assert info["test_examples"] == 10 * N_TEST and info["epochs"] == 6
    assert info["test_accuracy"] > 0.15  # 200 images, 6 epochs; chance is 0.1
    json.dumps(info)


@needs_jpeg_copy
def test_short_dp_run_learns_and_reports_everything(env, pretrained):
    net, info, pre = pretrained
    # dense layers freshly initialised (init="convs"): what is learned beyond chance
    # is learned by DP-SGD on the private split
    config = _config(
        env,
        pre,
        trained_layers="dense",
        init="convs",
        epochs=5,
        noise_multiplier=0.3,
        deltas=(1e-3, 1e-5),
    )
    result = train_cifar10(config, pretrained=(net, info), verbose=False)
    assert result["pretrained_on_cifar10_test"] < 0.2  # random head: about chance
    # chance is 0.1: on 300 images 0.2 is 5.8 standard deviations above it (this run
    # reaches about 0.27)
    assert result["test_accuracy"] > 0.2
    n_private = 10 * N_TRAIN - PUBLIC
    assert result["private_examples"] == n_private and result["test_examples"] == 10 * N_TEST
    assert result["lots"] == 5 * (n_private // 50)
    event = dp_sgd_event(0.3, result["lots"], sampling_rate=50 / n_private)
    assert result["epsilon"] == pytest.approx(compute_epsilon(event, 1e-5, "moments"), rel=1e-9)
    assert result["initialized_from_pretrained"] == ["conv1", "conv2"]
    assert result["frozen_layers"] == ["conv1", "conv2"] and result["frozen_layers_unchanged"]
    assert result["trainable_layers"] == ["fc1", "fc2", "logits"]
    assert result["clip_bounds"] == {"fc1": 3.0, "fc2": 3.0, "logits": 6.0}
    assert result["dataset"] == "CIFAR-10 (JPEG copy)"
    assert result["pretraining"].startswith(
        "public split: 200 CIFAR-10 train images (in-distribution substitute for CIFAR-100)"
    )
    for key in [
        "dataset",
        "pretraining",
        "trained_layers",
        "lot_size",
        "noise_multiplier",
        "clip_bounds",
        "epsilon",
        "delta",
        "accountant",
        "epochs",
        "test_accuracy",
        "seconds",
        "history",
    ]:
        assert key in result
    assert result["epochs"] == 5 and len(result["history"]) == 6
    assert result["history"][0]["epoch"] == 0 and result["history"][0]["epsilon"] == 0.0
    eps = [row["epsilon"] for row in result["history"]]
    assert eps == sorted(eps) and eps[-1] == result["epsilon"]
    assert all("epsilon@0.001" in row and "test_accuracy" in row for row in result["history"])
    assert "NOT for deployment" in result["note"]
    assert "train_accuracy" in result["non_private_statistics"]  # private data, no noise
    assert "not covered by epsilon" in result["non_private_statistics_note"]
    json.dumps(result, allow_nan=False)  # strict JSON


@needs_jpeg_copy
def test_training_stops_at_the_budget(env, pretrained):
    net, info, pre = pretrained
    result = train_cifar10(
        _config(
            env,
            pre,
            trained_layers="softmax",
            noise_multiplier=1.0,
            target_epsilon=3.0,
            epochs=50,
            eval_every=100,
        ),
        pretrained=(net, info),
        verbose=False,
    )
    assert result["epsilon"] <= 3.0 and 1 <= result["epochs"] < 50
    assert "test_accuracy" in result["history"][-1]  # evaluated where the budget stopped it


@needs_jpeg_copy
def test_frozen_layers_are_really_frozen(env, pretrained):
    net, _, _ = pretrained
    model, copied = build_private_model(net, "top")
    assert copied == ["conv1", "conv2", "fc1", "fc2", "logits"]
    before = {layer.name: [w.copy() for w in layer.get_weights()] for layer in model.layers}
    for name in ("conv1", "conv2", "fc1", "fc2", "logits"):  # starts from the pretrained net
        for a, b in zip(before[name], net.get_layer(name).get_weights()):
            np.testing.assert_array_equal(a, b)
    assert [v.path.split("/")[-2] for v in model.trainable_variables] == [
        "fc2",
        "fc2",
        "logits",
        "logits",
    ]
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (200, 32, 32, 3), dtype=np.uint8)
    y = rng.integers(0, 10, 200)
    dp = DPModel(model)
    dp.compile(
        optimizer=DPSGD(
            0.5, l2_norm_clip=clip_bounds_for("top", 3.0), noise_multiplier=1.0, seed=0
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    dp.fit(
        x,
        y,
        lot_size=50,
        batch_size=50,
        epochs=1,
        preprocess=Augmentation(seed=0),
        verbose=0,
        sampling_seed=0,
    )
    assert dp.lots_applied == 4
    for name in ("conv1", "conv2", "fc1"):
        for a, b in zip(before[name], model.get_layer(name).get_weights()):
            np.testing.assert_array_equal(a, b)
    for name in ("fc2", "logits"):
        assert not np.array_equal(before[name][0], model.get_layer(name).get_weights()[0])

    # non-private training of the dense layers leaves the convolutions alone too
    result, trained = train_cifar10(
        _config(env, pretrained[2], private=False, trained_layers="dense", lot_size=32, epochs=1),
        pretrained=pretrained[:2],
        verbose=False,
        return_model=True,
    )
    assert result["epsilon"] is None and result["noise_multiplier"] is None
    assert result["frozen_layers_unchanged"] and result["frozen_layers"] == ["conv1", "conv2"]
    for name in ("conv1", "conv2"):
        for a, b in zip(net.get_layer(name).get_weights(), trained.get_layer(name).get_weights()):
            np.testing.assert_array_equal(a, b)
    assert not np.array_equal(
        net.get_layer("fc1").get_weights()[0], trained.get_layer("fc1").get_weights()[0]
    )


@needs_jpeg_copy
def test_weights_file_round_trip_and_split_guard(env, pretrained, tmp_path):
    net, info, pre = pretrained
    path = tmp_path / "models" / "pub.weights.h5"
    save_pretrained(net, info, path)
    loaded, meta = load_pretrained(path)
    for a, b in zip(net.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert meta["public_indices_sha256"] == info["public_indices_sha256"]
    assert "history" not in meta
    # the same weights with another split would have seen private images: refused
    other = dataclasses.replace(pre, split_seed=1)
    with pytest.raises(ValueError, match="another public split"):
        train_cifar10(_config(env, other, pretrained_weights=str(path)), verbose=False)
    with pytest.raises(
        ValueError, match="public_data='cifar10_split', but this run uses 'cifar100'"
    ):
        train_cifar10(
            _config(
                env, dataclasses.replace(pre, public_data="cifar100"), pretrained_weights=str(path)
            ),
            verbose=False,
        )
    with pytest.raises(FileNotFoundError, match="cifar10_pretrain.py"):
        load_pretrained(tmp_path / "missing.weights.h5")
    with pytest.raises(ValueError, match="must end with '.weights.h5'"):
        save_pretrained(net, info, tmp_path / "x.h5")


@needs_jpeg_copy
def test_cifar100_pretraining_path(env, tmp_path):
    """The paper's setting on a small generated CIFAR-100 file in the canonical format:
    convs and hidden layers transferred, a new 10-class softmax, all of CIFAR-10 private."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "cifar10_jpg").symlink_to(env / "cifar10_jpg")
    write_cifar100(data_dir, n_train=120, n_test=40, tarball=True)
    pre = PretrainConfig(
        public_data="cifar100", epochs=1, batch_size=40, seed=0, data_dir=str(data_dir)
    )
    net, info = pretrain_public(pre, verbose=False)
    assert net.output_shape == (None, 100)
    assert info["public_data"] == "cifar100" and info["public_examples"] == 120
    assert info["test_dataset"] == "CIFAR-100"
    # noise calibrated so that the 2 epochs spend exactly the target
    result = train_cifar10(
        _config(
            data_dir,
            pre,
            trained_layers="softmax",
            epochs=2,
            lot_size=100,
            batch_size=100,
            noise_multiplier=None,
            target_epsilon=3.0,
        ),
        pretrained=(net, info),
        verbose=False,
    )
    assert result["noise_calibrated"] and result["epochs"] == 2
    assert 2.9 < result["epsilon"] <= 3.0
    assert result["initialized_from_pretrained"] == ["conv1", "conv2", "fc1", "fc2"]
    assert result["private_examples"] == 10 * N_TRAIN  # every CIFAR-10 train image
    assert result["pretraining"].startswith("CIFAR-100: 120 train images, 100 fine classes")
    assert result["dataset"] == "CIFAR-10 (JPEG copy)" and result["frozen_layers_unchanged"]


def test_cli_train_cifar10_validates_before_training(capsys):
    for args, message in (
        (["--lot-size", "0"], "--lot-size must be a whole number >= 1"),
        (["--epsilon", "-1"], "--epsilon must be > 0"),
    ):
        with pytest.raises(SystemExit) as info:
            cli_main(["train", "cifar10", *args])
        assert info.value.code != 0 and message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["train", "cifar10", "--trained-layers", "conv"])
    assert "invalid choice" in capsys.readouterr().err


@needs_jpeg_copy
def test_a_resumed_run_ends_with_the_weights_of_the_uninterrupted_run(env, pretrained, tmp_path):
    """Augmentation included: its draws are keyed by the lot, so a seeded run
    interrupted inside an epoch and resumed ends where the uninterrupted one does."""
    net, info, pre = pretrained
    config = _config(env, pre, trained_layers="top", epochs=2, noise_multiplier=0.5)
    whole, whole_model = train_cifar10(
        config, pretrained=(net, info), verbose=False, return_model=True
    )
    lots = whole["lots"]
    assert lots == 2 * ((10 * N_TRAIN - PUBLIC) // 50) and lots >= 4
    polls = iter(range(10**6))
    ckpt = str(tmp_path / "ckpt")
    first = train_cifar10(
        config,
        pretrained=(net, info),
        verbose=False,
        checkpoint_dir=ckpt,
        checkpoint_every_epoch=False,
        should_stop=lambda: next(polls) >= lots // 2,
    )
    assert first["stop_reason"] == "interrupted" and first["lots"] == lots // 2 + 1
    # a checkpoint of the old data subsets (split_seed + k: no "subset_seeds") is refused
    import json
    import shutil

    from dpfl_tf.recipes.common import RUN_STATE

    old = tmp_path / "old"
    shutil.copytree(ckpt, old)
    state = json.loads((old / RUN_STATE).read_text())
    assert state["config"].pop("subset_seeds") == "derive_seed"
    (old / RUN_STATE).write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"different run \(differs in: subset_seeds\)"):
        train_cifar10(config, verbose=False, checkpoint_dir=str(old))
    resumed, resumed_model = train_cifar10(
        config, verbose=False, checkpoint_dir=ckpt, return_model=True
    )
    assert resumed["lots"] == lots
    for a, b in zip(whole_model.model.get_weights(), resumed_model.model.get_weights()):
        np.testing.assert_array_equal(b, a)  # bit for bit: oneDNN is off here (BIT_EXACT)
    assert resumed["test_accuracy"] == whole["test_accuracy"]

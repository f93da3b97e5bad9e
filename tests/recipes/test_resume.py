"""Resume is tested on the model, not only on the books: a seeded `train` run
interrupted inside an epoch and resumed ends with the weights and the test
accuracy of the same run uninterrupted, for every model of the MNIST recipe
and with the CIFAR-10 scattering recipes' settings (DP feature statistics,
mirror views; the CIFAR-10 convnet's resume is in test_cifar10.py)."""

import dataclasses

import numpy as np
import pytest

from dpfl_tf.recipes.mnist import MnistConfig, train_mnist
from tests.keras.helpers import BIT_EXACT, cut_recipe_data

# what XLA and TensorFlow compile here stays until the process ends (+0.8 GB in a
# whole-suite worker): the file runs in a process of its own (tests/isolation.py)
pytestmark = pytest.mark.isolated(env=BIT_EXACT)


@pytest.fixture
def small_mnist(monkeypatch):
    """The real MNIST cut to 2000 / 500 examples (10 lots of 200 an epoch)."""
    cut_recipe_data(monkeypatch, 2000, 500)


#: the scattering models' settings (Tramer & Boneh's clip, lr and momentum)
_SCATTER = dict(
    projection="none", l2_norm_clip=0.1, learning_rate=4.0, final_learning_rate=4.0, momentum=0.9
)

CONFIGS = {
    "mlp": dict(
        model="mlp",
        hidden_units=64,
        pca_sample_size=1000,
        l2_norm_clip=4.0,
        learning_rate=0.1,
        final_learning_rate=0.05,
        decay_epochs=2,
    ),
    "tanh_cnn": dict(
        model="tanh_cnn",
        projection="none",
        l2_norm_clip=0.5,
        learning_rate=0.5,
        final_learning_rate=0.5,
    ),
    "scatter_linear": dict(model="scatter_linear", **_SCATTER),
    "scatter_cnn": dict(model="scatter_cnn", **_SCATTER),
    # the CIFAR-10 scattering recipes' settings (a DP release of the feature
    # statistics before the first lot, mirror views) on the MNIST slice
    "scatter_linear_dp_stats_mirror": dict(
        model="scatter_linear", feature_norm="dp_stats", mirror_views=True, **_SCATTER
    ),
}
#: the user-level runs: what they check (the sampler's state, the users' digest, the
#: user-level ledger) does not depend on the model, and per-user norms cost U x B
#: per-example work (`PerUserGradients`), so a dense model on the pixels keeps them
#: short; the per-user rules of convolutions are checked in tests/keras/test_users.py
USER_LEVEL = dict(
    model="mlp",
    projection="none",
    hidden_units=64,
    l2_norm_clip=0.5,
    learning_rate=0.5,
    final_learning_rate=0.5,
)


def _stop_after(polls: int):
    calls = iter(range(10**6))
    return lambda: next(calls) >= polls - 1


def _interrupted_after_13_lots(config, ckpt: str) -> None:
    """`config`'s run stopped after 13 lots (inside an epoch), its checkpoint in `ckpt`."""
    first = train_mnist(
        config,
        verbose=False,
        checkpoint_dir=ckpt,
        checkpoint_every_epoch=False,
        should_stop=_stop_after(13),
    )
    assert first["stop_reason"] == "interrupted" and first["lots"] == 13


def _assert_same_weights(resumed_model, whole_model) -> None:
    """Bit for bit: the file runs with oneDNN off (BIT_EXACT)."""
    for a, b in zip(whole_model.model.get_weights(), resumed_model.model.get_weights()):
        np.testing.assert_array_equal(b, a)


@pytest.mark.parametrize("model", sorted(CONFIGS))
def test_a_resumed_run_ends_with_the_weights_of_the_uninterrupted_run(small_mnist, tmp_path, model):
    config = MnistConfig(
        noise_multiplier=1.0,
        lot_size=200,
        batch_size=256,
        target_epsilon=None,
        epochs=3,
        seed=3,
        eval_every=1,
        **CONFIGS[model],
    )
    whole, whole_model = train_mnist(config, verbose=False, return_model=True)
    assert whole["lots"] == 30
    # interrupted after 13 lots (inside the second epoch), then the same call again
    ckpt = str(tmp_path / "ckpt")
    _interrupted_after_13_lots(config, ckpt)
    resumed, resumed_model = train_mnist(
        config, verbose=False, checkpoint_dir=ckpt, return_model=True
    )
    assert resumed["lots"] == 30 and resumed["stop_reason"] == "completed"
    _assert_same_weights(resumed_model, whole_model)
    assert resumed["test_accuracy"] == whole["test_accuracy"]
    assert resumed["epsilon"] == pytest.approx(whole["epsilon"], rel=1e-9)
    # the resumed history has a row at every epoch end, at the same lots
    assert [r["lots"] for r in resumed["history"]] == [10, 20, 30]
    assert [r["test_accuracy"] for r in resumed["history"]][1:] == [
        r["test_accuracy"] for r in whole["history"]
    ][1:]


def test_a_resumed_user_level_run_ends_with_the_weights_of_the_uninterrupted_run(
    small_mnist, tmp_path
):
    """500 simulated users of 4 examples, lots of 50 users (10 lots an epoch), at
    most 3 examples of a user a lot (a fresh subset keyed by the lot): a run
    interrupted inside its second epoch and resumed ends with the weights, the
    test accuracy and the user-level ledger of the run uninterrupted; a
    checkpoint of other users is refused."""
    config = MnistConfig(
        noise_multiplier=1.0,
        lot_size=50,
        target_epsilon=None,
        epochs=2,
        seed=3,
        eval_every=2,
        users=500,
        max_examples_per_user=3,
        **USER_LEVEL,
    )
    whole, whole_model = train_mnist(config, verbose=False, return_model=True)
    assert whole["lots"] == 20 and (whole["privacy_unit"], whole["users"]) == ("user", 500)
    ckpt = str(tmp_path / "ckpt")
    _interrupted_after_13_lots(config, ckpt)
    other_users = dataclasses.replace(config, users_seed=1)
    with pytest.raises(ValueError, match="differs in: users_seed"):
        train_mnist(other_users, verbose=False, checkpoint_dir=ckpt)
    resumed, resumed_model = train_mnist(
        config, verbose=False, checkpoint_dir=ckpt, return_model=True
    )
    assert resumed["lots"] == 20 and resumed["stop_reason"] == "completed"
    _assert_same_weights(resumed_model, whole_model)
    assert resumed["test_accuracy"] == whole["test_accuracy"]
    assert (
        resumed["ledger"]
        == whole["ledger"]
        == [
            {
                "event": "Poisson(q=0.1) Gaussian(sigma=1) (add/remove-one)",
                "count": 20,
                "label": "dpsgd (user-level)",
            }
        ]
    )
    assert resumed["epsilon"] == pytest.approx(whole["epsilon"], rel=1e-9)


def test_a_checkpoint_of_other_user_ids_is_refused(small_mnist, tmp_path):
    """The same settings and file name, but the file now says other users: the
    digest of the users kept beside the checkpoint refuses the resume.  The same
    users in a file elsewhere resume (the path is not the users)."""
    ids = tmp_path / "ids.npy"
    np.save(ids, np.arange(2000) % 500)
    config = MnistConfig(
        noise_multiplier=1.0,
        lot_size=50,
        target_epsilon=None,
        epochs=2,
        seed=3,
        user_ids=str(ids),
        **USER_LEVEL,
    )
    ckpt = str(tmp_path / "ckpt")
    first = train_mnist(config, verbose=False, checkpoint_dir=ckpt, should_stop=_stop_after(3))
    assert first["stop_reason"] == "interrupted"
    moved = tmp_path / "elsewhere" / "the_users.npy"
    moved.parent.mkdir()
    np.save(moved, np.arange(2000) % 500)
    resumed = train_mnist(
        dataclasses.replace(config, user_ids=str(moved)),
        verbose=False,
        checkpoint_dir=ckpt,
        should_stop=_stop_after(2),
    )
    assert resumed["stop_reason"] == "interrupted" and resumed["lots"] == first["lots"] + 2
    np.save(ids, np.arange(2000) // 4)  # 500 users again, other examples each
    with pytest.raises(ValueError, match="holds a run of other users"):
        train_mnist(config, verbose=False, checkpoint_dir=ckpt)

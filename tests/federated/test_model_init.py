"""The federated model's initial weights come from the config's seed alone.

A Flower ServerApp builds the global model in a thread while Flower's own threads
(the heartbeat's jitter, the SecAgg+ workflow) draw from Python's global `random`,
the state `keras.utils.set_random_seed` seeds and Keras draws an unseeded
initializer's seed from.  A draw between two layers moved the initial model: the
Ray SecAgg+ run then differed from the in-process run (its file failed in 3 of 10
runs after test_flower.py).  The builders now draw the initializers' seeds from a
private stream (`dpfl_tf.models.glorot_uniform_kernels`), with the weights of before."""

import random

import keras
import numpy as np
import pytest

from dpfl_tf._seeds import derive_seed
from dpfl_tf.federated.runner import FederatedConfig, build_model, fully_connected_model
from dpfl_tf.models import pnpm_cnn

CONFIGS = {
    "mlp": FederatedConfig(hidden=(16, 8), seed=4),
    "cnn2": FederatedConfig(model="cnn2", seed=4),
    "cnn3": FederatedConfig(model="cnn3", seed=4),
}
SHAPE = (28, 28)


@pytest.fixture(autouse=True)
def _global_random_state_restored():
    """The old path seeds Python's and numpy's global generators: put them back."""
    python, legacy = random.getstate(), np.random.get_state()
    yield
    random.setstate(python)
    np.random.set_state(legacy)


def _weights(model):
    return [np.asarray(w) for w in model.get_weights()]


def _same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def _built_as_before(config):
    """What `build_model` gave before: the global seeds set, then an unseeded build."""
    keras.utils.set_random_seed(derive_seed(config.seed, "model-init") >> 31)
    if config.model == "mlp":
        return fully_connected_model(SHAPE, config.hidden, 10)
    return pnpm_cnn(SHAPE, 10, depth=int(config.model[-1]))


@pytest.fixture
def draws_between_layers(monkeypatch):
    """Another thread's `random.uniform` before every Dense / Conv2D is made."""

    def drawing_first(init):
        def wrapped(self, *args, **kwargs):
            random.uniform(0.7, 0.9)
            init(self, *args, **kwargs)

        return wrapped

    for layer in (keras.layers.Dense, keras.layers.Conv2D):
        monkeypatch.setattr(layer, "__init__", drawing_first(layer.__init__))


@pytest.mark.parametrize("model", sorted(CONFIGS))
def test_the_initial_model_is_the_one_set_random_seed_gave(model):
    """Recorded seeded runs (results/) keep their initial weights."""
    config = CONFIGS[model]
    assert _same(_weights(build_model(config, SHAPE, 10)), _weights(_built_as_before(config)))


def test_a_seeded_mlp_with_biases_is_the_one_set_random_seed_gave():
    """The tests' `tiny_model` (tests/federated/conftest.py): biases draw no seed."""
    seeded = fully_connected_model(SHAPE, (8,), 10, use_bias=True, seed=9)
    keras.utils.set_random_seed(9)
    assert _same(_weights(seeded), _weights(fully_connected_model(SHAPE, (8,), 10, use_bias=True)))


@pytest.mark.parametrize("model", sorted(CONFIGS))
def test_draws_from_the_global_random_between_layers_do_not_move_the_initial_model(model, request):
    config = CONFIGS[model]
    reference = _weights(build_model(config, SHAPE, 10))
    request.getfixturevalue("draws_between_layers")
    assert _same(_weights(build_model(config, SHAPE, 10)), reference)
    # the control: the old way, seeding the global state, moves under the same draws
    assert not _same(_weights(_built_as_before(config)), reference)


def test_the_builders_touch_no_global_random_state():
    random.seed(11)
    np.random.seed(11)
    expected = (random.random(), np.random.random())
    random.seed(11)
    np.random.seed(11)
    for config in CONFIGS.values():
        build_model(config, SHAPE, 10)
    assert (random.random(), np.random.random()) == expected

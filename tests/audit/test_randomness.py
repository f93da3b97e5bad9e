"""DP noise comes from OS entropy unless a seed is given on purpose, and a
seeded run says in its results and its log that it is not for deployment."""

import numpy as np
import pytest

from dpfl_tf.federated.runner import FederatedConfig, build_server, run_federated
from dpfl_tf.keras import DPSGD, DPModel, LotSampler
from dpfl_tf.recipes.common import privacy_summary
from dpfl_tf.sanitizer import make_generator
from tests.keras.helpers import loss, mlp, mnist_slice


def test_generators_use_os_entropy_unless_seeded():
    a, b = (make_generator().normal([1000]).numpy() for _ in range(2))
    assert not np.allclose(a, b)
    s1, s2 = (make_generator(7).normal([1000]).numpy() for _ in range(2))
    np.testing.assert_array_equal(s1, s2)
    assert not np.allclose(s1, make_generator(8).normal([1000]).numpy())
    lots = [next(LotSampler(1000, 100).lots(1)) for _ in range(2)]
    assert not np.array_equal(*lots)


def _dp_sgd_weights(noise_seed):
    x, y = mnist_slice(200, features=60)
    model = DPModel(mlp(hidden=8, seed=0))  # same initial weights every time
    model.compile(
        optimizer=DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.0, seed=noise_seed), loss=loss()
    )
    model.fit(x, y, lot_size=100, epochs=1, verbose=0, sampling_seed=0)  # same lots
    return np.concatenate([v.numpy().ravel() for v in model.model.trainable_variables])


def test_two_unseeded_dp_sgd_runs_differ_and_seeded_runs_repeat():
    """Same data, same initial weights, same lots: only the noise can differ."""
    assert not np.allclose(_dp_sgd_weights(None), _dp_sgd_weights(None))
    np.testing.assert_array_equal(_dp_sgd_weights(3), _dp_sgd_weights(3))


@pytest.fixture(scope="module")
def tiny_mnist():
    from dpfl_tf.data import load_dataset

    return load_dataset("mnist")


def _config(**kw):
    return FederatedConfig(
        clients=10,
        train_subset=300,
        clients_per_round=4,
        sampling="fixed_size",
        rounds=1,
        hidden=(8,),
        dp="global",
        noise_multiplier=1.0,
        delta_max=1e-3,
        accountant="rdp",
        **kw,
    )


def _one_round(dataset, **kw):
    server, _ = build_server(_config(**kw), dataset, progress=False)
    server.run_round()
    return np.concatenate([v.numpy().ravel() for v in server.trainer.variables])


def test_federated_noise_is_os_entropy_unless_noise_seed(tiny_mnist):
    # same clients, same local training (seed=0): only the server's noise differs
    assert not np.allclose(_one_round(tiny_mnist), _one_round(tiny_mnist))
    np.testing.assert_array_equal(
        _one_round(tiny_mnist, noise_seed=5), _one_round(tiny_mnist, noise_seed=5)
    )


def test_seeded_runs_say_not_for_deployment(tiny_mnist, capsys):
    result = run_federated(_config(noise_seed=5), tiny_mnist, progress=False)
    assert "NOT for deployment" in result["note"]
    assert any("NOT for deployment" in n for n in result["notices"])
    assert "NOT for deployment" in capsys.readouterr().err  # the log
    unseeded = run_federated(_config(), tiny_mnist, progress=False)
    assert "note" not in unseeded
    assert not any("deployment" in n for n in unseeded["notices"])
    # the MNIST / CIFAR recipes' results carry the same note (dpfl-tf train prints it)
    assert "NOT for deployment" in privacy_summary(None, 1e-5, seed=3)["note"]
    assert "note" not in privacy_summary(None, 1e-5, seed=None)


def test_federated_cli_cannot_seed_the_noise():
    """`dpfl-tf federated --seed` seeds client sampling and local shuffling only;
    there is no flag that seeds the DP noise."""
    import argparse

    from dpfl_tf.federated.cli import add_federated_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_federated_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["federated", "--dp", "global", "--seed", "3"])
    assert config_from_args(args).noise_seed is None
    assert not any(
        "noise-seed" in a.option_strings[0]
        for a in parser._subparsers._group_actions[0].choices["federated"]._actions
        if a.option_strings
    )


def test_a_seeded_dp_optimizer_warns_that_it_is_not_for_deployment():
    import warnings

    from dpfl_tf.keras import DPSGD

    with pytest.warns(UserWarning, match="seed=7: .* NOT for deployment"):
        DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning without a seed
        DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0)

"""Shared fixtures: a small slice of real MNIST, a tiny Keras model and a small
seeded Global DP configuration."""

import dataclasses

import numpy as np
import pytest


@pytest.fixture(scope="session")
def mnist():
    from dpfl_tf.data import load_dataset

    return load_dataset("mnist")


@pytest.fixture(scope="session")
def mnist_small(mnist):
    """3,000 training and 1,000 test examples of real MNIST (a fixed random slice)."""
    rng = np.random.default_rng(0)
    tr = np.sort(rng.permutation(len(mnist.y_train))[:3000])
    te = np.sort(rng.permutation(len(mnist.y_test))[:1000])
    return dataclasses.replace(
        mnist,
        x_train=mnist.x_train[tr],
        y_train=mnist.y_train[tr],
        x_test=mnist.x_test[te],
        y_test=mnist.y_test[te],
    )


def tiny_model(hidden=16, seed=0, input_shape=(28, 28), use_bias=True):
    from dpfl_tf.federated.runner import fully_connected_model

    return fully_connected_model(input_shape, (hidden,), 10, use_bias=use_bias, seed=seed)


def small_global_dp_config(**kw):
    """A FederatedConfig for a few quick seeded Global DP rounds (6 clients, 3 a round,
    fixed-size sampling, the RDP accountant, a hidden layer of 8); `kw` overrides."""
    from dpfl_tf.federated.runner import FederatedConfig

    base = dict(
        clients=6,
        clients_per_round=3,
        sampling="fixed_size",
        accountant="rdp",
        rounds=3,
        partition="iid",
        hidden=(8,),
        dp="global",
        noise_multiplier=1.0,
        noise_seed=5,
        seed=1,
    )
    base.update(kw)
    return FederatedConfig(**base)

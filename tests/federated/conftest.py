"""Shared fixtures: a small slice of real MNIST and a tiny Keras model."""

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

"""Small real-MNIST slices and models for the Keras DP-SGD tests."""

import functools
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.data import load_dataset

#: the environment of a test process whose runs must repeat bit for bit: oneDNN's kernels (on by
#: default on Linux x86 CPUs with AVX-512 VNNI or BF16, AVX-VNNI or AMX) are not deterministic from
#: run to run -- a seeded tanh_cnn run of the MNIST recipe differed from its twin in 1 of ~6 runs
#: by one float32 ulp at the first lot, and after 30 lots by 8e-5 (tests/recipes/test_resume.py
#: failed that way, on a machine where oneDNN was on by default); with TF_ENABLE_ONEDNN_OPTS=0, 9
#: of 9 runs were identical. Read when TensorFlow starts: give it to a file's child,
#: `pytest.mark.isolated(env=...)`
BIT_EXACT = {"TF_ENABLE_ONEDNN_OPTS": "0"}

#: the environment of a test process that needs oneDNN's CPU kernels and allocator.
#: TensorFlow (Linux x86) turns oneDNN on by default only on CPUs with AVX-512 VNNI/BF16,
#: AVX-VNNI or AMX (off on this machine's AMD EPYC: AVX2, no AVX-512); without it the CPU
#: has no kernel for a channels_first Conv2D or a dilated transposed convolution, and
#: keeps no memory statistics.  Read when TensorFlow starts: `pytest.mark.isolated(env=...)`
WITH_ONEDNN = {"TF_ENABLE_ONEDNN_OPTS": "1"}


def onednn_requested() -> bool:
    """Whether this process was started with `WITH_ONEDNN` (a file's child process; not
    when its tests run in the calling process: ``DPFL_TEST_NO_ISOLATION=1``, ``-n``
    without ``--dist loadfile``, ``--pdb``)."""
    return os.environ.get("TF_ENABLE_ONEDNN_OPTS") == WITH_ONEDNN["TF_ENABLE_ONEDNN_OPTS"]


def skip_without_onednn(error: Exception, lacking: str, reason) -> None:
    """For a test that needs what only oneDNN gives (`error`: TensorFlow saying it lacks
    it): where oneDNN was asked for (`WITH_ONEDNN`), raises `error` (a failure, not a
    skip); elsewhere skips, saying how to run the test with oneDNN."""
    if onednn_requested():
        raise error
    pytest.skip(
        f"this TensorFlow {lacking} without oneDNN (run the file in its child process, "
        f"or with TF_ENABLE_ONEDNN_OPTS=1): {reason}"
    )


def skip_unless_the_cpu_runs(run, what: str) -> None:
    """Calls `run` (plain Keras/TensorFlow, none of the package's code); if this TensorFlow
    has no CPU kernel for it, `skip_without_onednn`."""
    try:
        run()
    except (tf.errors.UnimplementedError, tf.errors.InvalidArgumentError) as e:
        # TensorFlow's own sentence, without Keras's "Exception encountered when calling"
        # line, the {{function_node ...}} prefix and the terminal colour codes
        text = re.sub(r"\x1b\[[0-9;]*m|\{\{function_node [^}]*\}\}", "", str(e.message))
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        reason = next((line for line in lines if "Exception encountered" not in line), "")
        skip_without_onednn(e, f"has no CPU kernel for {what}", reason)


@functools.lru_cache(maxsize=1)
def _mnist():
    return load_dataset("mnist")


def mnist_slice(n=1000, flat=True, features=None, offset=0):
    """The first n MNIST training images in [0, 1] (flattened, optionally
    projected to `features` dimensions by a fixed random matrix) and labels."""
    ds = _mnist()
    x = ds.x_train[offset : offset + n].astype("float32") / 255.0
    y = ds.y_train[offset : offset + n].astype("int64")
    if flat:
        x = x.reshape(n, -1)
        if features:
            proj = np.random.default_rng(0).normal(size=(784, features)).astype("float32")
            x = x @ (proj / np.sqrt(784))
    else:
        x = x[..., None]
    return x, y


def mnist_test_slice(n=1000, features=None):
    ds = _mnist()
    x = ds.x_test[:n].astype("float32").reshape(n, -1) / 255.0
    if features:
        proj = np.random.default_rng(0).normal(size=(784, features)).astype("float32")
        x = x @ (proj / np.sqrt(784))
    return x, ds.y_test[:n].astype("int64")


def mlp(inputs=60, hidden=32, seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def cut_recipe_data(monkeypatch, n_train: int, n_test: int) -> None:
    """The MNIST recipe (and so `dpfl-tf train`) loads the real dataset cut to its
    first `n_train` training and `n_test` test examples."""
    import dataclasses

    from dpfl_tf.recipes import mnist as recipe

    real = recipe.load_dataset

    def cut(*args, **kwargs):
        full = real(*args, **kwargs)
        return dataclasses.replace(
            full,
            x_train=full.x_train[:n_train],
            y_train=full.y_train[:n_train],
            x_test=full.x_test[:n_test],
            y_test=full.y_test[:n_test],
        )

    monkeypatch.setattr(recipe, "load_dataset", cut)

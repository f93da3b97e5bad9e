"""`Dataset.validation_split`: held-out training examples for tuning, never the test set."""

import numpy as np
import pytest

from dpfl_tf.data import Dataset, DataSource


def _dataset(n=100):
    x = np.arange(n, dtype=np.uint8).reshape(n, 1, 1).repeat(2, axis=1)
    return Dataset(
        x_train=x,
        y_train=np.arange(n) % 3,
        x_test=np.zeros((7, 2, 1), np.uint8),
        y_test=np.zeros(7, np.int64),
        num_classes=3,
        class_names=("a", "b", "c"),
        name="toy",
        source=DataSource("toy", "/nowhere", "npz"),
    )


def test_the_held_out_examples_are_training_examples_and_the_rest_keep_their_order():
    full = _dataset()
    split = full.validation_split(30)
    kept, held = split.x_train[:, 0, 0].astype(int), split.x_test[:, 0, 0].astype(int)
    assert len(kept) == 70 and len(held) == 30
    assert sorted(np.concatenate([kept, held])) == list(range(100))  # disjoint, complete
    assert np.all(np.diff(kept) > 0)  # the kept examples in their original order
    np.testing.assert_array_equal(split.y_train, kept % 3)  # labels travel with their images
    np.testing.assert_array_equal(split.y_test, held % 3)
    assert not set(held) <= set(range(30))  # a random draw, not the first 30
    # the same draw every time (trials compare on one set); another seed, another draw
    np.testing.assert_array_equal(full.validation_split(30).x_test, split.x_test)
    assert not np.array_equal(full.validation_split(30, seed=1).x_test, split.x_test)
    assert "30 held out" in split.name


@pytest.mark.parametrize("n", [0, 100, 101, -1, 2.5, True])
def test_impossible_sizes_are_refused(n):
    with pytest.raises(ValueError, match="hold out|whole number"):
        _dataset().validation_split(n)

"""`Dataset.validation_split`: held-out training examples for tuning, never the test set."""

import dataclasses

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


def test_a_split_by_hash_moves_no_other_example_when_one_is_added_or_removed():
    """by="hash": whether an example is held out depends on that example alone (what
    the add/remove-one analysis of a private search needs); a draw of exactly n
    reshuffles the others when N changes (which the hash split is there to avoid)."""
    from dpfl_tf.data import held_out_by_hash

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(2000, 4, 4), dtype=np.uint8)
    y = rng.integers(0, 10, size=2000)
    full = held_out_by_hash(x, y, 0.2)
    assert abs(full.sum() - 400) < 4 * 18  # Binomial(2000, 0.2): sd ~18
    for i in (0, 777, 1999):  # remove one example: every other stays on its side
        np.testing.assert_array_equal(
            held_out_by_hash(np.delete(x, i, 0), np.delete(y, i), 0.2), np.delete(full, i)
        )
    added = held_out_by_hash(np.concatenate([x, x[:1] + 1]), np.append(y, 3), 0.2)
    np.testing.assert_array_equal(added[:-1], full)
    # the label is part of the hash; the seeded draw is not stable under removal
    assert not np.array_equal(held_out_by_hash(x, (y + 1) % 10, 0.2), full)
    draw = _dataset(100)
    smaller = dataclasses.replace(draw, x_train=draw.x_train[1:], y_train=draw.y_train[1:])
    assert set(draw.validation_split(30).x_test[:, 0, 0]) - {0} != set(
        smaller.validation_split(30).x_test[:, 0, 0]
    )


def test_the_hash_split_of_a_dataset_holds_out_about_n_and_keeps_the_order():
    full = _dataset(100)
    split = full.validation_split(30, by="hash")
    kept, held = split.x_train[:, 0, 0].astype(int), split.x_test[:, 0, 0].astype(int)
    assert sorted(np.concatenate([kept, held])) == list(range(100))
    assert np.all(np.diff(kept) > 0) and 10 <= len(held) <= 50
    np.testing.assert_array_equal(split.y_test, held % 3)
    with pytest.raises(ValueError, match="by must be 'draw' or 'hash'"):
        full.validation_split(30, by="random")

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


def test_a_hash_split_moves_no_other_example_when_one_is_added_or_removed():
    """hash_split(p): whether an example is held out depends on that example alone, with
    p fixed (never derived from N) -- what the add/remove-one analysis of a private
    search needs; a draw of exactly n reshuffles the others when N changes."""
    from dpfl_tf.data import held_out_by_hash

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(2000, 4, 4), dtype=np.uint8)
    y = rng.integers(0, 10, size=2000)
    full = _toy(x, y)
    split = full.hash_split(0.2)
    held = {bytes(e) for e in split.x_test}
    assert abs(len(held) - 400) < 4 * 18  # Binomial(2000, 0.2): sd ~18
    for i in (0, 777, 1999):  # remove one example: every other stays on its side
        smaller = _toy(np.delete(x, i, 0), np.delete(y, i)).hash_split(0.2)
        assert {bytes(e) for e in smaller.x_test} == held - {bytes(x[i])}
    larger = _toy(np.concatenate([x, x[:1] + 1]), np.append(y, 3)).hash_split(0.2)
    assert {bytes(e) for e in larger.x_test} - {bytes(x[0] + 1)} == held
    # the label is part of the hash
    assert not np.array_equal(held_out_by_hash(x, (y + 1) % 10, 0.2), held_out_by_hash(x, y, 0.2))
    # a draw of exactly n: removing one example moves others
    draw = {bytes(e) for e in full.validation_split(400).x_test}
    drawn_smaller = {bytes(e) for e in _toy(x[1:], y[1:]).validation_split(400).x_test}
    assert len(drawn_smaller - draw) > 1


def _toy(x, y):
    return Dataset(
        x_train=x,
        y_train=y,
        x_test=x[:1],
        y_test=y[:1],
        num_classes=10,
        class_names=tuple("abcdefghij"),
        name="toy",
        source=DataSource("toy", "/nowhere", "npz"),
    )


def test_the_hash_split_holds_out_about_p_and_keeps_the_order():
    full = _dataset(100)
    split = full.hash_split(0.3)
    kept, held = split.x_train[:, 0, 0].astype(int), split.x_test[:, 0, 0].astype(int)
    assert sorted(np.concatenate([kept, held])) == list(range(100))
    assert np.all(np.diff(kept) > 0) and 10 <= len(held) <= 50
    np.testing.assert_array_equal(split.y_test, held % 3)
    for p in (0.0, 1.0):
        with pytest.raises(ValueError, match="fraction must be"):
            full.hash_split(p)

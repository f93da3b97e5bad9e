"""Client partitions: sizes, label skew, determinism, errors."""

import numpy as np
import pytest

from dpfl_tf.federated.partition import (
    ClientPartition,
    dirichlet_partition,
    iid_partition,
    make_partition,
    shard_partition,
    unequal_partition,
)


def _is_partition_of(p, n):
    assert len(p.indices) == n
    np.testing.assert_array_equal(np.sort(p.indices), np.arange(n))  # disjoint and complete


def test_iid_sizes_are_equal_and_cover_the_data():
    p = iid_partition(1003, 10, seed=1)
    assert p.num_clients == 10 and len(p) == 10
    assert set(p.sizes.tolist()) == {100, 101} and p.sizes.sum() == 1003
    _is_partition_of(p, 1003)


def test_shards_two_per_client_on_mnist(mnist):
    y = mnist.y_train
    p = shard_partition(y, 100, seed=0)
    _is_partition_of(p, len(y))
    assert np.all(p.sizes == 600)  # 60,000 / 200 shards * 2
    counts = p.label_counts(y, 10)
    assert counts.sum() == len(y)
    labels_per_client = (counts > 0).sum(axis=1)
    # a shard holds one digit unless it straddles a class boundary (9 boundaries)
    assert labels_per_client.max() <= 4
    assert np.mean(labels_per_client <= 2) >= 0.85
    assert np.all(labels_per_client >= 1)
    # each client's examples are shuffled, not sorted by label
    first = p.client(0)
    assert not np.all(np.diff(y[first].astype(int)) >= 0) or labels_per_client[0] == 1


def test_shards_at_large_K_are_tiny_and_nearly_pure(mnist):
    p = shard_partition(mnist.y_train, 10000, seed=0)
    assert np.all(p.sizes == 6) and p.num_clients == 10000
    assert p.indices.nbytes == 8 * 60000  # flat storage: O(N), not O(K x model)


def test_partitions_are_deterministic_with_a_seed(mnist):
    y = mnist.y_train[:5000]
    for scheme, kw in [("iid", {}), ("shards", {}), ("dirichlet", {"alpha": 0.5}), ("unequal", {})]:
        a = make_partition(y, 50, scheme, seed=7, **kw)
        b = make_partition(y, 50, scheme, seed=7, **kw)
        c = make_partition(y, 50, scheme, seed=8, **kw)
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_array_equal(a.offsets, b.offsets)
        assert not np.array_equal(a.indices, c.indices)
        assert a.scheme == scheme


def test_dirichlet_skew_grows_as_alpha_shrinks(mnist):
    y = mnist.y_train[:6000]

    def skew(alpha):
        p = dirichlet_partition(y, 30, alpha, seed=0)
        _is_partition_of(p, len(y))
        assert p.sizes.min() >= 1
        c = p.label_counts(y, 10)
        return np.mean(c.max(axis=1) / c.sum(axis=1))

    assert skew(0.1) > skew(1.0) > skew(100.0)
    assert skew(100.0) < 0.25  # near-IID


def test_unequal_sizes_vary_and_cover_the_data():
    p = unequal_partition(5000, 40, size_sigma=1.0, seed=0)
    _is_partition_of(p, 5000)
    assert p.sizes.min() >= 1 and p.sizes.max() > 3 * np.median(p.sizes) * 0.5
    assert p.sizes.std() > 0.3 * p.sizes.mean()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda y: make_partition(y, 10, "by_magic"), "partition must be one of iid, shards"),
        (lambda y: make_partition(y, 0, "iid"), "num_clients must be a whole number >= 1"),
        (lambda y: make_partition(y, 101, "iid"), "num_clients must be <= the number of examples"),
        (lambda y: make_partition(y, 60, "shards"), "shards exceed the 100 examples"),
        (lambda y: make_partition(y, 10, "dirichlet"), "needs alpha"),
        (lambda y: make_partition(y, 10, "dirichlet", alpha=0), "alpha must be > 0"),
        (lambda y: ClientPartition.from_lists([]), "at least one client"),
        (lambda y: ClientPartition.from_lists([[0, 1], []]), "hold no examples"),
    ],
)
def test_bad_inputs_give_clear_errors(call, message):
    y = np.arange(100) % 10
    with pytest.raises(ValueError, match=message):
        call(y)

"""Client partitions: which training examples each simulated client holds.

A partition is a list of index arrays into one training set, stored flat
(one int array of all indices, client by client, plus K + 1 offsets), so K =
10,000 clients cost O(N) integers and no per-client copy of the data.

Schemes (all seeded; the same seed gives the same partition):

* ``iid``: a random permutation cut into K nearly equal shares.
* ``shards``: McMahan et al. 2017 (section 3) and Geyer, Klein, Nabi 2017
  (section 4): sort the examples by label, cut the sorted list into
  ``shards_per_client * K`` equal contiguous shards, give each client
  ``shards_per_client`` shards chosen at random.  With two shards per client
  most clients see at most two digits.
* ``dirichlet``: label skew after Hsu, Qi, Brown 2019: for every class c draw
  p_c ~ Dir(alpha * 1_K) and deal the class-c examples to clients in these
  proportions.  Small alpha = strong skew.  Redrawn until every client holds
  at least ``min_size`` examples.
* ``unequal``: IID labels but log-normal client sizes, n_k proportional to
  exp(N(0, size_sigma^2)), every client holding at least one example.

Unit of privacy for client-level DP: one client, i.e. one index array.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from dpfl_tf._validation import ChoiceEnum, check_count, check_number

__all__ = [
    "ClientPartition",
    "PartitionScheme",
    "dirichlet_partition",
    "iid_partition",
    "make_partition",
    "shard_partition",
    "unequal_partition",
]


class PartitionScheme(ChoiceEnum):
    __argument__ = "partition"
    IID = "iid"
    SHARDS = "shards"
    DIRICHLET = "dirichlet"
    UNEQUAL = "unequal"


@dataclasses.dataclass(frozen=True, eq=False)
class ClientPartition:
    """K clients' index arrays, stored flat.

    Attributes:
      indices: all clients' example indices, client 0's first (int64).
      offsets: K + 1 non-decreasing offsets; client k holds
        ``indices[offsets[k]:offsets[k + 1]]``.
      scheme: how the partition was made (for reports).
      seed: the seed it was made with (None if unseeded).
    """

    indices: np.ndarray
    offsets: np.ndarray
    scheme: str = "custom"
    seed: int | None = None

    def __post_init__(self):
        idx = np.ascontiguousarray(self.indices, dtype=np.int64)
        off = np.ascontiguousarray(self.offsets, dtype=np.int64)
        if off.ndim != 1 or len(off) < 2:
            raise ValueError(
                "a partition needs at least one client (offsets of length >= 2), "
                f"got offsets of shape {off.shape}"
            )
        if off[0] != 0 or off[-1] != len(idx) or np.any(np.diff(off) < 0):
            raise ValueError("offsets must start at 0, end at len(indices) and never decrease")
        if idx.ndim != 1 or (len(idx) and idx.min() < 0):
            raise ValueError("indices must be a 1-D array of non-negative example indices")
        empty = np.flatnonzero(np.diff(off) == 0)
        if len(empty):
            raise ValueError(
                f"{len(empty)} client(s) hold no examples (first: client "
                f"{int(empty[0])}); every client needs at least one example"
            )
        object.__setattr__(self, "indices", idx)
        object.__setattr__(self, "offsets", off)

    @classmethod
    def from_lists(
        cls, clients: Sequence[Sequence[int]], scheme: str = "custom", seed: int | None = None
    ) -> "ClientPartition":
        """From one index list per client."""
        if len(clients) == 0:
            raise ValueError("clients must hold at least one client, got an empty list")
        sizes = np.array([len(c) for c in clients], dtype=np.int64)
        flat = (
            np.concatenate([np.asarray(c, dtype=np.int64).ravel() for c in clients])
            if sizes.sum()
            else np.zeros(0, np.int64)
        )
        return cls(flat, np.concatenate([[0], np.cumsum(sizes)]), scheme, seed)

    @property
    def num_clients(self) -> int:
        return len(self.offsets) - 1

    def __len__(self) -> int:
        return self.num_clients

    def client(self, k: int) -> np.ndarray:
        """Client k's example indices (a read-only view)."""
        if not 0 <= int(k) < self.num_clients:
            raise IndexError(f"client must be in [0, {self.num_clients}), got {k}")
        view = self.indices[self.offsets[k] : self.offsets[k + 1]]
        view.flags.writeable = False
        return view

    @property
    def sizes(self) -> np.ndarray:
        """n_k, the number of examples of each client."""
        return np.diff(self.offsets)

    def label_counts(self, labels: np.ndarray, num_classes: int | None = None) -> np.ndarray:
        """[K, C] matrix: how many examples of each class each client holds."""
        labels = np.asarray(labels)
        c = int(labels.max()) + 1 if num_classes is None else int(num_classes)
        owner = np.repeat(np.arange(self.num_clients), self.sizes)
        out = np.zeros((self.num_clients, c), dtype=np.int64)
        np.add.at(out, (owner, labels[self.indices]), 1)
        return out

    def __repr__(self) -> str:
        s = self.sizes
        return (
            f"ClientPartition(scheme={self.scheme!r}, clients={self.num_clients}, "
            f"examples={len(self.indices)}, size min/median/max="
            f"{int(s.min())}/{int(np.median(s))}/{int(s.max())})"
        )


def _rng(seed):
    return np.random.default_rng(seed)


def _check_clients(num_clients, num_examples) -> int:
    k = check_count("num_clients", num_clients, minimum=1)
    if k > num_examples:
        raise ValueError(
            f"num_clients must be <= the number of examples ({num_examples}) so "
            f"that no client is empty, got {k}"
        )
    return k


def _split_counts(n: int, k: int) -> np.ndarray:
    """k nearly equal parts of n (the first n % k parts one larger)."""
    base = np.full(k, n // k, dtype=np.int64)
    base[: n % k] += 1
    return base


def iid_partition(
    num_examples: int, num_clients: int, *, seed: int | None = None
) -> ClientPartition:
    """A random permutation of range(num_examples) cut into K nearly equal shares."""
    n = check_count("num_examples", num_examples, minimum=1)
    k = _check_clients(num_clients, n)
    perm = _rng(seed).permutation(n)
    return ClientPartition(perm, np.concatenate([[0], np.cumsum(_split_counts(n, k))]), "iid", seed)


def shard_partition(
    labels: np.ndarray, num_clients: int, *, shards_per_client: int = 2, seed: int | None = None
) -> ClientPartition:
    """Sort by label, cut into shards_per_client * K shards, deal them at random.

    Ties in the label sort are broken at random (a stable sort of a random
    permutation), so a shard is a random subset of one or two classes.
    """
    labels = np.asarray(labels).ravel()
    n = len(labels)
    if n == 0:
        raise ValueError("labels must not be empty")
    per = check_count("shards_per_client", shards_per_client, minimum=1)
    k = _check_clients(num_clients, n)
    num_shards = per * k
    if num_shards > n:
        raise ValueError(
            f"shards_per_client * num_clients = {num_shards} shards exceed the "
            f"{n} examples; lower num_clients or shards_per_client"
        )
    rng = _rng(seed)
    perm = rng.permutation(n)
    order = perm[np.argsort(labels[perm], kind="stable")]
    shard_sizes = _split_counts(n, num_shards)
    shard_starts = np.concatenate([[0], np.cumsum(shard_sizes)])
    assignment = rng.permutation(num_shards).reshape(k, per)
    pieces, sizes = [], np.zeros(k, dtype=np.int64)
    for c in range(k):
        client = np.concatenate(
            [order[shard_starts[s] : shard_starts[s + 1]] for s in assignment[c]]
        )
        pieces.append(rng.permutation(client))
        sizes[c] = len(client)
    return ClientPartition(
        np.concatenate(pieces), np.concatenate([[0], np.cumsum(sizes)]), "shards", seed
    )


def dirichlet_partition(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    *,
    min_size: int = 1,
    seed: int | None = None,
    max_tries: int = 1000,
) -> ClientPartition:
    """Label skew: class c is dealt to clients in proportions p_c ~ Dir(alpha)."""
    labels = np.asarray(labels).ravel()
    n = len(labels)
    if n == 0:
        raise ValueError("labels must not be empty")
    k = _check_clients(num_clients, n)
    a = check_number("alpha", alpha, low=0.0, low_open=True)
    min_size = check_count("min_size", min_size, minimum=1)
    if min_size * k > n:
        raise ValueError(f"min_size * num_clients = {min_size * k} exceeds the {n} examples")
    rng = _rng(seed)
    classes = np.unique(labels)
    by_class = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    for _ in range(check_count("max_tries", max_tries, minimum=1)):
        owners = np.empty(n, dtype=np.int64)
        for idx in by_class:
            p = rng.dirichlet(np.full(k, a))
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
            owners[idx] = np.repeat(np.arange(k), np.diff(np.concatenate([[0], cuts, [len(idx)]])))
        sizes = np.bincount(owners, minlength=k)
        if sizes.min() >= min_size:
            order = np.argsort(owners, kind="stable")
            # shuffle within each client so a client's classes are interleaved
            pieces = np.split(order, np.cumsum(sizes)[:-1])
            flat = np.concatenate([rng.permutation(p) for p in pieces])
            return ClientPartition(flat, np.concatenate([[0], np.cumsum(sizes)]), "dirichlet", seed)
    raise ValueError(
        f"no Dirichlet(alpha={a:g}) draw in {max_tries} tries gave every one of "
        f"{k} clients >= {min_size} examples; raise alpha or lower num_clients"
    )


def unequal_partition(
    num_examples: int, num_clients: int, *, size_sigma: float = 1.0, seed: int | None = None
) -> ClientPartition:
    """IID examples, log-normal client sizes (each client >= 1 example)."""
    n = check_count("num_examples", num_examples, minimum=1)
    k = _check_clients(num_clients, n)
    s = check_number("size_sigma", size_sigma, low=0.0)
    rng = _rng(seed)
    w = rng.lognormal(0.0, s, size=k)
    extra = n - k
    sizes = 1 + np.floor(w / w.sum() * extra).astype(np.int64)
    short = n - sizes.sum()
    if short:
        sizes[rng.choice(k, size=short, replace=False, p=w / w.sum())] += 1
    perm = rng.permutation(n)
    return ClientPartition(perm, np.concatenate([[0], np.cumsum(sizes)]), "unequal", seed)


def make_partition(
    labels: np.ndarray,
    num_clients: int,
    scheme: PartitionScheme | str = PartitionScheme.IID,
    *,
    seed: int | None = None,
    **kwargs,
) -> ClientPartition:
    """One front end: ``make_partition(y_train, 1000, "shards", seed=0)``.

    kwargs go to the scheme's function (``shards_per_client``, ``alpha``,
    ``min_size``, ``size_sigma``)."""
    scheme = PartitionScheme.parse(scheme)
    labels = np.asarray(labels).ravel()
    if scheme is PartitionScheme.IID:
        return iid_partition(len(labels), num_clients, seed=seed, **kwargs)
    if scheme is PartitionScheme.SHARDS:
        return shard_partition(labels, num_clients, seed=seed, **kwargs)
    if scheme is PartitionScheme.DIRICHLET:
        if "alpha" not in kwargs:
            raise ValueError("the dirichlet partition needs alpha (e.g. alpha=0.5)")
        return dirichlet_partition(labels, num_clients, seed=seed, **kwargs)
    return unequal_partition(len(labels), num_clients, seed=seed, **kwargs)

"""Lot sampling for DP-SGD, as a `tf.data` pipeline of whole lots.

One element is one lot (the privacy unit), padded with masked examples up to a
multiple of `pad_to` (XLA's fixed shapes; equal shares for the replicas of a
distribution strategy) so that `DPModel.train_step` can add noise once for the
whole lot.

* ``poisson`` (default, what the moments accountant analyses): each of the N
  examples joins the lot independently with probability q = L / N, so lot
  sizes vary around L; the update is normalised by the expected size L.
* ``fixed_size``: L examples drawn uniformly without replacement for each lot.
* ``shuffle``: each epoch a fresh permutation is cut into N // L lots of L.
* ``in_order``: the same order every epoch, lot j of an epoch being examples
  [j L, (j + 1) L) (a source that can only be read in order); with correlated
  noise only (an example's participations are exactly N // L lots apart).
* ``cyclic_poisson``: each example is assigned once, independently and
  uniformly, to one of b groups (b = ``cycle_length``); lot t Poisson-samples
  group t mod b with probability q = b L / N (Choquette-Choo et al. 2023,
  section 5; the independent assignment keeps the add/remove-one analysis);
  with correlated noise only.

The sampling runs in the graph: lot t's decisions are the stateless Philox
uniforms keyed by (sampler key, t), so no Python runs per lot for in-memory
data.  The key comes from OS entropy unless a seed is given.  In secure mode
every decision is drawn from ``os.urandom`` instead (`dpfl_tf.secure_random`),
in Python.  Records are read by the `dpfl_tf.keras.sources` reader of the data
(in-memory arrays, memmaps, random-access sources), lots in parallel and the
next ones prefetched.
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Callable, Iterator

import numpy as np
import tensorflow as tf

from dpfl_tf._validation import check_count
from dpfl_tf.keras.sources import ArrayReader, IndexedReader, make_reader
from dpfl_tf.privacy.events import SamplingMethod
from dpfl_tf.secure_random import refuse_seed, secure_uniform

__all__ = ["LotSampler", "READ_AHEAD_BYTES"]

#: lots read ahead of the one in training hold at most this many bytes (at least one lot)
READ_AHEAD_BYTES = 2**29


class LotSampler:
    """Draws lots of example indices.

    Args:
      dataset_size: N.
      lot_size: L (expected lot size for Poisson sampling).
      sampling: a `SamplingMethod` (or its name).
      seed: seeds the sampler (tests only); default OS entropy.
      secure_mode: draw every sampling decision from ``os.urandom`` (refuses a seed).
      first_lot: the number of the first lot drawn (keyed draws; shuffle: of
        the first permutation).
    """

    def __init__(
        self,
        dataset_size: int,
        lot_size: int,
        sampling: SamplingMethod | str = SamplingMethod.POISSON,
        seed: int | None = None,
        secure_mode: bool = False,
        first_lot: int = 0,
        cycle_length: int | None = None,
    ):
        self.dataset_size = check_count("dataset_size", dataset_size, minimum=1)
        self.lot_size = check_count("lot_size", lot_size, minimum=1)
        if self.lot_size > self.dataset_size:
            raise ValueError(
                f"lot_size must be <= the number of examples "
                f"({self.dataset_size}), got {self.lot_size}"
            )
        self.sampling = SamplingMethod.parse(sampling)
        if self.sampling is SamplingMethod.FULL_BATCH and self.lot_size != self.dataset_size:
            raise ValueError("full_batch sampling needs lot_size == dataset_size")
        self.secure_mode = bool(secure_mode)
        refuse_seed(self.secure_mode, seed, "sampling_seed")
        self.seed = seed
        # lot numbers start here (a model's lots computed so far): a seeded fit
        # that continues a model draws new lots, not its first lots again
        self.first_lot = check_count("first_lot", first_lot, minimum=0)
        # the key of the in-graph stateless draws (63 bits of OS entropy by default)
        self.key = int(seed) if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.cycle_length = None
        if self.sampling is SamplingMethod.CYCLIC_POISSON:
            if cycle_length is None:
                raise ValueError(
                    "sampling='cyclic_poisson' needs cycle_length (the number of "
                    "groups b), got None"
                )
            self.cycle_length = check_count("cycle_length", cycle_length, minimum=1)
            if self.cycle_length > self.lots_per_epoch:
                raise ValueError(
                    f"cycle_length must be <= N // L = {self.lots_per_epoch} (so that "
                    f"q = b L / N <= 1), got {self.cycle_length}"
                )
            # the group of each example: fixed for this sampler, uniform and independent
            self._secure_groups = (
                np.floor(secure_uniform(self.dataset_size) * self.cycle_length).astype(np.int64)
                if self.secure_mode
                else None
            )
        elif cycle_length is not None:
            raise ValueError(
                f"cycle_length is for sampling='cyclic_poisson' only, got "
                f"{cycle_length!r} with sampling={self.sampling.value!r}"
            )

    @property
    def sampling_rate(self) -> float:
        """q = L / N; b L / N for cyclic Poisson (within the group whose turn it is)."""
        return self.lot_size * (self.cycle_length or 1) / self.dataset_size

    def participation(self, steps: int):
        """The `Participation` of one example over `steps` lots from the first
        lot of this sampler, for correlated-noise accounting.  Refuses Poisson
        and fixed-size lots: they can put one example in consecutive lots, and
        the mechanisms here claim no amplification from them."""
        from dpfl_tf.privacy.matrix_factorization import Participation

        per = self.lots_per_epoch
        # the data's order fixes the lots: the neighbours are datasets with one
        # example replaced (removing one would move the others' lots)
        if self.sampling is SamplingMethod.SHUFFLE:  # epochs start with this sampler's lots
            return Participation.epochs(steps, per, relation="replace_one")
        if self.sampling is SamplingMethod.IN_ORDER:
            return Participation.min_separation(steps, per, relation="replace_one")
        if self.sampling is SamplingMethod.FULL_BATCH:
            return Participation.min_separation(steps, 1)
        if self.sampling is SamplingMethod.CYCLIC_POISSON:
            return Participation.cyclic_poisson(steps, self.cycle_length, self.sampling_rate)
        raise ValueError(
            f"correlated noise needs sampling 'shuffle', 'in_order', 'cyclic_poisson' or "
            f"'full_batch', got {self.sampling.value!r}: its lots can hold one example in "
            "consecutive lots, and no amplification by sampling is claimed for it"
        )

    def lot_examples_bound(self) -> int:
        """The examples of all but ~3e-7 of lots: a Poisson lot has L +- sqrt(L (1 - q))
        examples, so L + 5 standard deviations; other samplings draw L."""
        lot = self.lot_size
        if self.sampling is SamplingMethod.POISSON:
            lot += math.ceil(5 * math.sqrt(lot * (1 - self.sampling_rate)))
        return lot

    @property
    def lots_per_epoch(self) -> int:
        """N // L lots make one epoch (for Poisson: 1/q lots in expectation)."""
        return max(1, self.dataset_size // self.lot_size)

    def sampling_args(self) -> dict:
        """Keyword arguments of `gaussian_step_event` for this sampler."""
        if self.sampling is SamplingMethod.POISSON:
            return {"sampling_rate": self.sampling_rate}
        if self.sampling is SamplingMethod.FIXED_SIZE:
            return {"dataset_size": self.dataset_size, "lot_size": self.lot_size}
        return {}

    # -- the lots --------------------------------------------------------------
    def _uniforms(self, stream, t, dtype=tf.float64) -> tf.Tensor:
        """N uniforms, stateless in (key, stream, t): floats on [0, 1), or
        for int32 the full range of 32-bit integers (2^32 equally likely values)."""
        seed = tf.random.experimental.stateless_fold_in(
            tf.constant([self.key, stream], tf.int64), tf.cast(t, tf.int64)
        )
        if dtype == tf.int32:
            return tf.random.stateless_uniform(
                [self.dataset_size],
                seed=seed,
                dtype=tf.int32,
                minval=None,
                maxval=None,
                alg="philox",
            )
        return tf.random.stateless_uniform(
            [self.dataset_size], seed=seed, dtype=dtype, alg="philox"
        )

    @property
    def inclusion_threshold(self) -> int | None:
        """Poisson in the graph: record i joins lot t when its 32-bit draw, read
        as an integer u in [0, 2^32), is below T = floor(q 2^32): a true rate
        T / 2^32 <= q, below q by less than 2.4e-10 (the accountant analyses q:
        conservative, as a smaller rate is more private).  None when q is so
        small that this rounding would exceed 1e-4 of q, or q = 1: float64
        draws are compared with q then."""
        threshold = math.floor(self.sampling_rate * 2**32)
        return threshold if 10_000 <= threshold < 2**32 else None

    def _lot_in_graph(self, t) -> tf.Tensor:
        """Indices (sorted, int64) of lot t, Poisson or fixed-size, in the graph."""
        t = tf.cast(t, tf.int64) + self.first_lot
        if self.sampling is SamplingMethod.CYCLIC_POISSON:
            groups = tf.cast(tf.floor(self._uniforms(2, 0) * self.cycle_length), tf.int64)
            turn = tf.equal(groups, tf.math.floormod(t, self.cycle_length))
            return tf.where(turn & (self._uniforms(0, t) < self.sampling_rate))[:, 0]
        if self.sampling is SamplingMethod.POISSON:
            threshold = self.inclusion_threshold
            if threshold is None:
                return tf.where(self._uniforms(0, t) < self.sampling_rate)[:, 0]
            u = tf.cast(self._uniforms(0, t, tf.int32), tf.int64) + 2**31  # [0, 2^32)
            return tf.where(u < threshold)[:, 0]
        u = self._uniforms(0, t)
        # fixed size: the L largest of N uniforms are a uniform L-subset
        top = tf.math.top_k(u, self.lot_size, sorted=False).indices
        return tf.sort(tf.cast(top, tf.int64))

    def _permutation(self, epoch) -> tf.Tensor:
        return tf.argsort(self._uniforms(1, epoch), stable=True)

    def _secure_lots(self, num_lots: int, start: int = 0) -> Iterator[np.ndarray]:
        """Secure mode: every decision from ``os.urandom`` (53 bits each); lots
        number start, start + 1, ... after the first lot."""
        n, lot = self.dataset_size, self.lot_size
        perm = None
        for i in range(start, start + num_lots):
            if self.sampling is SamplingMethod.POISSON:
                yield np.flatnonzero(secure_uniform(n) < lot / n)
            elif self.sampling is SamplingMethod.FIXED_SIZE:
                yield np.sort(np.argpartition(secure_uniform(n), lot - 1)[:lot])
            elif self.sampling is SamplingMethod.FULL_BATCH:
                yield np.arange(n)
            elif self.sampling is SamplingMethod.IN_ORDER:
                j = (self.first_lot + i) % self.lots_per_epoch
                yield np.arange(j * lot, (j + 1) * lot)
            elif self.sampling is SamplingMethod.CYCLIC_POISSON:
                turn = self._secure_groups == (self.first_lot + i) % self.cycle_length
                yield np.flatnonzero(turn & (secure_uniform(n) < self.sampling_rate))
            else:
                j = i % self.lots_per_epoch
                if j == 0:
                    perm = np.argsort(secure_uniform(n), kind="stable")
                yield np.sort(perm[j * lot : (j + 1) * lot])

    def index_dataset(self, num_lots: int | None = None) -> tf.data.Dataset:
        """A `tf.data.Dataset` of lots, each a sorted int64 vector of example
        indices: `num_lots` of them, or endless (None; `fit` takes the lots it
        trains on, and a dataset of unknown end lets Keras stop without
        waiting on the end of the pipeline)."""
        if num_lots is not None:
            num_lots = check_count("num_lots", num_lots, minimum=0)
            return self.index_dataset(None).take(num_lots)
        if self.secure_mode:

            def endless():
                start = 0
                while True:
                    yield from self._secure_lots(self.lots_per_epoch, start)
                    start += self.lots_per_epoch

            return tf.data.Dataset.from_generator(
                endless, output_signature=tf.TensorSpec([None], tf.int64)
            )
        if self.sampling is SamplingMethod.FULL_BATCH:
            return tf.data.Dataset.from_tensors(
                tf.range(self.dataset_size, dtype=tf.int64)
            ).repeat()
        if self.sampling is SamplingMethod.IN_ORDER:
            per, lot = self.lots_per_epoch, self.lot_size
            return tf.data.Dataset.counter(start=self.first_lot).map(
                _no_autograph(lambda t: tf.range(t % per * lot, (t % per + 1) * lot))
            )
        if self.sampling is SamplingMethod.SHUFFLE:
            per, lot = self.lots_per_epoch, self.lot_size

            def epoch_lots(e):  # one permutation per epoch, cut into lots
                perm = tf.cast(self._permutation(e)[: per * lot], tf.int64)
                return tf.data.Dataset.from_tensor_slices(
                    tf.sort(tf.reshape(perm, [per, lot]), axis=1)
                )

            return tf.data.Dataset.counter(start=self.first_lot).flat_map(_no_autograph(epoch_lots))
        return tf.data.Dataset.counter().map(
            _no_autograph(self._lot_in_graph), num_parallel_calls=tf.data.AUTOTUNE
        )

    def lots(self, num_lots: int) -> Iterator[np.ndarray]:
        """Yields `num_lots` arrays of indices (sorted): the lots `dataset` reads."""
        for idx in self.index_dataset(num_lots).as_numpy_iterator():
            yield idx

    def dataset(
        self,
        x,
        y=None,
        *,
        epochs: int | None = None,
        pad_to: int = 1,
        preprocess: Callable | None = None,
        prefetch: int = 2,
    ) -> tf.data.Dataset:
        """A `tf.data.Dataset` of (x_lot, y_lot, mask): `epochs * lots_per_epoch`
        lots (endless for None), each padded with zero-weight examples to a multiple of `pad_to`
        (at least `pad_to` examples, so that a distribution strategy splits
        every lot, even of size 0 or 1, into equal per-replica shares).

        `x, y` are arrays, or `x` is a random-access source (`y` None), or a
        reader from `dpfl_tf.keras.sources.make_reader`.  `preprocess` maps the
        lot's x (its real examples) inside tf.data, e.g. augmentation; it must
        act on each example independently.  `prefetch` lots are read ahead (a
        call of the training function that trains k lots takes k at once), at
        most `READ_AHEAD_BYTES` of them (at least one): lots of large records
        (a lot of 8,192 CIFAR-10 scattering features with mirror views is 1 GB)
        are read one ahead, not several."""
        pad_to = check_count("pad_to", pad_to, minimum=1)
        prefetch = check_count("prefetch", prefetch, minimum=1)
        reader, total = self._reader_and_total(x, y, epochs)
        ahead = self.lots_ahead(reader, prefetch)
        weak = not tf.inside_function()  # a dataset built in a graph is not kept

        def load(t, idx):
            n = idx.shape[0]  # static for a lot of fixed size: then so is the padded size
            if n is None:
                n = tf.shape(idx, out_type=tf.int64)[0]
            return _read_padded(reader, idx, _padded(n, pad_to), preprocess, t, weak=weak)

        # the parallel map runs `ahead` lots ahead of the one in training
        return _holding(
            reader,
            self.index_dataset(total)
            .enumerate(self.first_lot)
            .map(_no_autograph(load, preprocess), num_parallel_calls=ahead, deterministic=True),
        )

    def lots_ahead(self, reader, prefetch: int) -> int:
        """Lots to read ahead: `prefetch`, or fewer when they would hold more
        than `READ_AHEAD_BYTES` (the expected lot, padded for Poisson's spread)."""
        lot = self.lot_size + (
            math.ceil(5 * math.sqrt(self.lot_size))
            if self.sampling is SamplingMethod.POISSON
            else 0
        )
        lot_bytes = max(1, lot * reader.example_bytes())
        return max(1, min(prefetch, READ_AHEAD_BYTES // lot_bytes))

    def _reader_and_total(self, x, y, epochs):
        """The reader of the data, and the number of lots (None: endless)."""
        total = (
            None
            if epochs is None
            else check_count("epochs", epochs, minimum=1) * self.lots_per_epoch
        )
        reader = x if isinstance(x, (ArrayReader, IndexedReader)) else make_reader(x, y)
        if reader.size != self.dataset_size:
            raise ValueError(
                f"the data has {reader.size} examples but the sampler was "
                f"made for {self.dataset_size}"
            )
        return reader, total

    def replica_shares(
        self,
        x,
        y=None,
        *,
        epochs: int | None = None,
        replicas: int,
        first_replica: int = 0,
        local_replicas: int = 1,
        preprocess: Callable | None = None,
    ) -> tf.data.Dataset:
        """One worker's shares of every lot, for multi-worker training
        (`tf.distribute.Strategy.distribute_datasets_from_function`).

        Every worker draws the same lots (the sampler key must be the same on
        all of them).  Lot t of n examples is split, in the order of its sorted
        indices, into `replicas` = R equal shares of S = max(1, ceil(n / R))
        positions: replica r takes positions [r S, (r + 1) S), padded with
        masked examples -- the split `dataset(pad_to=R)` leaves to a
        single-machine strategy.  The R shares are disjoint and together
        exactly the lot; no example is dropped or read twice.

        The dataset yields, lot after lot, the shares of replicas
        `first_replica`, ..., `first_replica + local_replicas - 1` (one
        (x, y, mask) element each, in that order: the strategy hands a worker's
        elements to its local replicas in turn), and reads only their records."""
        replicas = check_count("replicas", replicas, minimum=1)
        local_replicas = check_count("local_replicas", local_replicas, minimum=1)
        first_replica = check_count("first_replica", first_replica, minimum=0)
        if first_replica + local_replicas > replicas:
            raise ValueError(
                f"replicas {first_replica}..{first_replica + local_replicas - 1} "
                f"do not exist among {replicas}"
            )
        reader, total = self._reader_and_total(x, y, epochs)
        weak = not tf.inside_function()  # a dataset built in a graph is not kept

        def with_replica(t, idx):  # (lot, replica) for each local replica, in order
            mine = tf.range(first_replica, first_replica + local_replicas, dtype=tf.int64)
            return tf.data.Dataset.zip(
                (
                    tf.data.Dataset.from_tensors((t, idx)).repeat(local_replicas),
                    tf.data.Dataset.from_tensor_slices(mine),
                )
            )

        def load(lot, replica):
            t, idx = lot
            n = tf.shape(idx, out_type=tf.int64)[0]
            share = tf.maximum(tf.constant(1, tf.int64), (n + replicas - 1) // replicas)
            start = tf.minimum(replica * share, n)
            return _read_padded(
                reader, idx[start : tf.minimum(start + share, n)], share, preprocess, t, weak=weak
            )

        return _holding(
            reader,
            self.index_dataset(total)
            .enumerate(self.first_lot)
            .flat_map(_no_autograph(with_replica))
            .map(
                _no_autograph(load, preprocess),
                num_parallel_calls=2 * local_replicas,
                deterministic=True,
            )
            .prefetch(2 * local_replicas),
        )


def _no_autograph(fn: Callable, preprocess: Callable | None = None) -> Callable:
    """`fn`, our own function for tf.data's `map`/`flat_map`, not converted by AutoGraph
    (it has no Python control flow on tensors; the conversion was most of the cost of
    building a process's first lot dataset), unless it calls a user's `preprocess`,
    which may branch on tensors with Python's ``if``."""
    return fn if preprocess is not None else tf.autograph.experimental.do_not_convert(fn)


def _holding(reader, dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset`, keeping `reader` alive as long as it (and its iterators: they
    hold their dataset) lives; the reader's graph op holds it only weakly.

    Without tf.data's autotuning: the lot pipeline sets its own parallelism (the
    lots read ahead), and the autotuner's thread, which has nothing to tune here,
    made each iterator's destruction wait for it -- seconds on a busy machine, up to
    15 s (a fit's iterator is destroyed when the garbage collector reaches it)."""
    options = tf.data.Options()
    options.autotune.enabled = False
    dataset = dataset.with_options(options)
    dataset._dpfl_reader = reader
    return dataset


def takes_lot(preprocess: Callable) -> bool:
    """Whether `preprocess` takes the lot's number (``preprocess(x, lot=t)``)."""
    try:
        return "lot" in inspect.signature(preprocess).parameters
    except (TypeError, ValueError):
        return False


def _padded(n, pad_to: int):
    """n (a Python int, or an int64 tensor) rounded up to a multiple of pad_to, at
    least pad_to; a Python int for a Python int."""
    rounded = (n + pad_to - 1) // pad_to * pad_to
    if isinstance(n, int):
        return max(pad_to, rounded)
    return tf.maximum(tf.constant(pad_to, tf.int64), rounded)


def _read_padded(reader, idx, size, preprocess, lot, weak=False):
    """(x, y, mask) of the records `idx` of lot number `lot`, `preprocess`ed
    (given the lot number when it takes one: randomness keyed by the lot),
    padded with zero (masked) examples to `size`; `weak`: see `IndexedReader.read`.
    A Python int `size` is also the lot's static size (the training step then
    knows it when it is traced: under XLA, a lot that fits one physical batch is
    compiled as one)."""
    xb, yb = reader.read(idx, weak=weak)
    if preprocess is not None:
        xb = preprocess(xb, lot=lot) if takes_lot(preprocess) else preprocess(xb)
    real = tf.shape(idx, out_type=tf.int64)[0]
    static = size if isinstance(size, int) else None

    def pad(t):
        t = tf.convert_to_tensor(t)
        t = tf.pad(t, [[0, size - real]] + [[0, 0]] * (t.shape.rank - 1))
        return tf.ensure_shape(t, [static, *t.shape[1:]])

    mask = tf.ensure_shape(tf.sequence_mask(real, size, dtype=tf.float32), [static])
    return (tf.nest.map_structure(pad, xb), pad(yb), mask)

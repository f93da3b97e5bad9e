"""Lot sampling for DP-SGD, as a `tf.data` pipeline of whole lots.

One element is one lot (the privacy unit), padded with masked examples up to a
multiple of the physical batch size B so that `DPModel.train_step` can walk it
in physical batches of B and add noise once for the whole lot.

* ``poisson`` (default, what the moments accountant analyses): each of the N
  examples joins the lot independently with probability q = L / N, so lot
  sizes vary around L; the update is normalised by the expected size L.
* ``fixed_size``: L examples drawn uniformly without replacement for each lot.
* ``shuffle``: each epoch a fresh permutation is cut into N // L lots of L.

Sampling randomness comes from OS entropy unless a seed is given; in secure
mode every decision is drawn from ``os.urandom`` (`dpfl_tf.secure_random`).
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import numpy as np
import tensorflow as tf

from dpfl_tf._validation import check_count
from dpfl_tf.privacy.events import SamplingMethod
from dpfl_tf.secure_random import refuse_seed, secure_uniform

__all__ = ["LotSampler"]


class LotSampler:
    """Draws lots of example indices.

    Args:
      dataset_size: N.
      lot_size: L (expected lot size for Poisson sampling).
      sampling: a `SamplingMethod` (or its name).
      seed: seeds the sampler (tests only); default OS entropy.
      secure_mode: draw every sampling decision from ``os.urandom`` (refuses a seed).
    """

    def __init__(self, dataset_size: int, lot_size: int,
                 sampling: SamplingMethod | str = SamplingMethod.POISSON,
                 seed: int | None = None, secure_mode: bool = False):
        self.dataset_size = check_count("dataset_size", dataset_size, minimum=1)
        self.lot_size = check_count("lot_size", lot_size, minimum=1)
        if self.lot_size > self.dataset_size:
            raise ValueError(f"lot_size must be <= the number of examples "
                             f"({self.dataset_size}), got {self.lot_size}")
        self.sampling = SamplingMethod.parse(sampling)
        if self.sampling is SamplingMethod.FULL_BATCH and self.lot_size != self.dataset_size:
            raise ValueError("full_batch sampling needs lot_size == dataset_size")
        self.secure_mode = bool(secure_mode)
        refuse_seed(self.secure_mode, seed, "sampling_seed")
        self.seed = seed
        self._rng = np.random.default_rng(seed)

    def _uniform(self, n: int) -> np.ndarray:
        return secure_uniform(n) if self.secure_mode else self._rng.random(n)

    @property
    def sampling_rate(self) -> float:
        return self.lot_size / self.dataset_size

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

    def lots(self, num_lots: int) -> Iterator[np.ndarray]:
        """Yields `num_lots` arrays of indices (sorted for locality)."""
        n, lot = self.dataset_size, self.lot_size
        perm = None
        for i in range(num_lots):
            if self.sampling is SamplingMethod.POISSON:
                yield np.flatnonzero(self._uniform(n) < lot / n)
            elif self.sampling is SamplingMethod.FIXED_SIZE:
                # the L smallest of N uniforms: a uniform L-subset
                yield np.sort(np.argpartition(self._uniform(n), lot - 1)[:lot])
            elif self.sampling is SamplingMethod.FULL_BATCH:
                yield np.arange(n)
            else:  # shuffle: a new permutation each epoch
                j = i % self.lots_per_epoch
                if j == 0:
                    perm = np.argsort(self._uniform(n), kind="stable")
                yield np.sort(perm[j * lot:(j + 1) * lot])

    def dataset(self, x, y, *, batch_size: int, epochs: int,
                preprocess: Callable | None = None, replicas: int = 1) -> tf.data.Dataset:
        """A `tf.data.Dataset` of (x_lot, y_lot, mask), lots padded with
        zero-weight examples to a multiple of `batch_size` x `replicas` (so that
        a distribution strategy splits every lot, even of size 0 or 1, into equal
        per-replica shares); `epochs * lots_per_epoch` lots."""
        batch_size = check_count("batch_size", batch_size, minimum=1) * \
            check_count("replicas", replicas, minimum=1)
        total = check_count("epochs", epochs, minimum=1) * self.lots_per_epoch
        if isinstance(x, list):  # a multi-input model's inputs given as a list: a
            x = tuple(x)         # structure tf.data keeps (a list would be stacked)
        x_t = tf.nest.map_structure(tf.convert_to_tensor, x)
        y_t = tf.convert_to_tensor(y)

        def index_gen():
            for idx in self.lots(total):
                padded = max(batch_size, int(math.ceil(len(idx) / batch_size)) * batch_size)
                mask = np.zeros(padded, np.float32)
                mask[:len(idx)] = 1.0
                full = np.zeros(padded, np.int64)
                full[:len(idx)] = idx
                yield full, mask

        ds = tf.data.Dataset.from_generator(
            index_gen, output_signature=(tf.TensorSpec([None], tf.int64),
                                         tf.TensorSpec([None], tf.float32)))

        def gather(idx, mask):
            xb = tf.nest.map_structure(lambda t: tf.gather(t, idx), x_t)
            yb = tf.gather(y_t, idx)
            if preprocess is not None:
                xb = preprocess(xb)
            return xb, yb, mask

        return ds.map(gather, num_parallel_calls=tf.data.AUTOTUNE).prefetch(2)

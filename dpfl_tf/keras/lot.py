"""One lot of DP-SGD in named steps (Abadi et al. 2016, Algorithm 1).

    g~ = ( sum_i clip(g_i) + N(0, sigma^2 C^2 I) ) / L,   clip(g) = g min(1, C / ||g||)

in the spirit of Opacus's ``DPOptimizer.pre_step`` (``clip_and_accumulate``,
``add_noise``, ``scale_grad``): the lot's physical batches are clipped per
example and summed (`LotStep.clip_and_accumulate`), Gaussian noise is added
once for the lot (`add_noise`) and the sum divided by the expected lot size L
(`scale_grad`).  A physical batch in which some example is non-finite is
redone one example (or one user) at a time, so that only that example is
dropped: inside the loop over physical batches, by the loop itself
(`_sum_batches`), elsewhere by a rerun (`rerun_one_by_one`).  `DPModel`
trains with it; `dpfl_tf.keras.dp_gradients` gives the same step to a custom
training loop.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from dpfl_tf.keras.per_example import PerExampleGradients
from dpfl_tf.keras.users import rerun_user_by_user
from dpfl_tf.sanitizer import GaussianSanitizer

__all__ = ["LotStep"]


def _rows(t, start, size):
    """Rows [start, start + size) of t, keeping its static feature shape (layers
    such as GroupNormalization need it)."""
    begin = tf.concat([[start], tf.zeros([t.shape.rank - 1], tf.int32)], 0)
    sizes = tf.concat([[size], -tf.ones([t.shape.rank - 1], tf.int32)], 0)
    return tf.ensure_shape(tf.slice(t, begin, sizes), [None, *t.shape[1:]])


class LotStep:
    """The noised, normalised gradient of one lot for `variables`.

    Args:
      variables: the trainable variables (the model's), in order.
      per_example: the model's `PerExampleGradients`.
      sanitizer: clipping rule and noise (`GaussianSanitizer`).
      groups: the clip group of each variable (`DPOptimizer.clip_groups`).
      batch_size: physical batch size (memory only).
      expected_lot: L, the divisor (the expected lot size the accounting uses).
      pad_to_batch: pad every physical batch to `batch_size` (XLA's static shapes).
      update_metrics: called as (y, y_pred, sample_weight) per physical batch
        with the kept examples' weights; None computes no statistics.
    """

    def __init__(
        self,
        variables,
        per_example: PerExampleGradients,
        sanitizer: GaussianSanitizer,
        groups,
        *,
        batch_size: int,
        expected_lot: float,
        pad_to_batch: bool = False,
        update_metrics: Callable | None = None,
    ):
        self.variables = list(variables)
        self.per_example = per_example
        self.sanitizer = sanitizer
        self.groups = list(groups)
        self.batch_size = int(batch_size)
        self.expected_lot = float(expected_lot)
        self.pad_to_batch = bool(pad_to_batch)
        self.update_metrics = update_metrics

    def __call__(self, x, y, mask, step, gate=None):
        """Returns (noised gradient / L, loss sum, examples kept, examples
        dropped) for the lot (x, y, mask: 1 for real examples, 0 for padding);
        `step` is the lot's position in the noise stream; `gate` (0 or 1)
        zeroes the statistics of a lot the budget skips."""
        clipped_sum, loss_sum, count, dropped = self.clip_and_accumulate(x, y, mask, gate)
        if gate is not None:
            loss_sum, count = loss_sum * gate, count * gate
        return self.scale_grad(self.add_noise(clipped_sum, step)), loss_sum, count, dropped

    def clip_factors(self, sq_norms):
        """Per-variable clip factors from per-variable squared norms: the norms
        summed within each clip group, the sanitizer's rule per group (an
        example with a non-finite norm gets 0 in every group)."""
        groups = self.groups
        grouped = [None] * (max(groups) + 1)
        if len({s.dtype for s in sq_norms}) > 1:  # layers of several dtypes: the widest
            wide = max((s.dtype for s in sq_norms), key=lambda d: d.size)
            sq_norms = [tf.cast(s, wide) for s in sq_norms]
        for g, s in zip(groups, sq_norms):
            grouped[g] = s if grouped[g] is None else grouped[g] + s
        factors = self.sanitizer.clip_factors(grouped)
        return [factors[g] for g in groups]

    def clip_batch(self, xb, yb, mb):
        """Clipped sums of one physical batch (cast to the variables' dtypes),
        its per-example losses and predictions, and whether each example was
        dropped (a real example whose clip factor is 0: non-finite)."""
        batch = self.per_example.clipped(xb, yb, mb, self.clip_factors)
        sums = [tf.cast(t, v.dtype) for t, v in zip(batch.sums, self.variables)]
        dropped = tf.logical_and(mb > 0, tf.equal(batch.factors[0], 0.0))
        return sums, batch.losses, batch.y_pred, dropped

    def rerun_one_by_one(self, xb, yb, mb):
        """The batch's clipped sum recomputed one example at a time (no
        example's values can reach another's gradient), and the examples
        dropped."""

        def one(i):
            sums, _, _, dropped = self.clip_batch(
                tf.nest.map_structure(lambda t: _rows(t, i, 1), xb),
                _rows(yb, i, 1),
                _rows(mb, i, 1),
            )
            return sums + [tf.cast(dropped[0], tf.int64)]

        spec = [tf.TensorSpec(v.shape, v.dtype) for v in self.variables] + [
            tf.TensorSpec([], tf.int64)
        ]
        out = tf.map_fn(
            one, tf.range(tf.shape(mb)[0]), fn_output_signature=spec, parallel_iterations=1
        )
        return [tf.reduce_sum(t, axis=0) for t in out[:-1]], tf.reduce_sum(out[-1])

    @property
    def segments(self):
        """User-level lots (`PerUserGradients`): the user slot of each example."""
        return getattr(self.per_example, "segments", None)

    def rerun_user_by_user(self, xb, yb, mb):
        """User-level lots: the clipped sum recomputed one user at a time, and
        the examples dropped."""
        per_example, segments = self.per_example, self.segments

        def clip_user(xu, yu, mu, su):
            per_example.segments = su
            try:
                sums, _, _, dropped = self.clip_batch(xu, yu, mu)
            finally:
                per_example.segments = segments
            return sums, tf.reduce_sum(tf.cast(dropped, tf.int64))

        return rerun_user_by_user(clip_user, self.variables, xb, yb, mb, segments)

    def clip_physical_batch(self, xb, yb, mb, gate):
        """One physical batch: (clipped sums, loss sum, examples kept, examples
        dropped).  A non-finite value can cross examples inside one batched
        backward pass (0 x NaN in a shared matmul of the generic path): then
        every example looks non-finite.  Whenever any example is non-finite,
        the batch is rerun one example at a time, so only the offending
        examples are dropped and the sensitivity stays C (user-level lots: rerun
        one user at a time).  The loop over physical batches does the same
        redo without this `tf.cond` (`_sum_batches`)."""
        sums, loss_sum, count, n_bad = self.clip_batch_once(xb, yb, mb, gate)
        rerun = self.rerun_one_by_one if self.segments is None else self.rerun_user_by_user
        sums, n_bad = tf.cond(n_bad > 0, lambda: rerun(xb, yb, mb), lambda: (sums, n_bad))
        return sums, loss_sum, count, n_bad

    def clip_batch_once(self, xb, yb, mb, gate, statistics=None):
        """`clip_physical_batch` without the rerun: the batched pass's clipped
        sums (not to be used when an example was dropped), its statistics and the
        number of examples found non-finite.  `statistics` (a boolean tensor):
        when false, no statistics (zeros, and the metrics are not updated: a redo
        pass sees rows whose statistics the batched pass already gave)."""
        sums, losses, y_pred, dropped = self.clip_batch(xb, yb, mb)
        n_bad = tf.reduce_sum(tf.cast(dropped, tf.int64))

        def stats():
            return self.batch_statistics(yb, y_pred, losses, mb, gate)

        if statistics is None:
            return (sums, *stats(), n_bad)
        none = (tf.constant(0.0), tf.constant(0.0))
        return (sums, *tf.cond(statistics, stats, lambda: none), n_bad)

    def batch_statistics(self, yb, y_pred, losses, mb, gate):
        """(loss sum, examples kept) of a physical batch, and its metrics:
        non-private statistics of the kept examples (zeros when not kept)."""
        if self.update_metrics is None:
            return tf.constant(0.0), tf.constant(0.0)
        kept = tf.cast(tf.logical_and(mb > 0, tf.math.is_finite(losses)), tf.float32)
        if gate is not None:
            kept = kept * gate
        self.update_metrics(yb, y_pred, kept)
        losses = tf.where(kept > 0, tf.cast(losses, tf.float32), 0.0)
        return tf.reduce_sum(losses), tf.reduce_sum(kept)

    def clip_and_accumulate(self, x, y, mask, gate=None):
        """The lot's clipped sum over its physical batches of `batch_size`
        examples: a loop over batches (user-level lots: batches of whole users,
        `sum_user_batches`), one pass when the lot fits.  The loop redoes a
        batch with a non-finite example itself, so the per-example gradients
        are traced once; a `tf.cond` around a rerun, or between one batch and
        the loop, would trace them once per branch (a small model's first fit
        took ~1.2 s instead of ~0.8 s).  Under XLA (`pad_to_batch`) the loop
        pads every batch to `batch_size` rows, more work than a lot that fits
        needs, and cannot redo with dynamic sizes: there a lot of static size
        (fixed-size and shuffled lots, `LotSampler.dataset`) is one batch
        (`clip_physical_batch`) when it fits and the loop when it does not; a
        lot of unknown size (Poisson) takes a `tf.cond` between the two (XLA
        compiles both branches)."""
        static = mask.shape[0]
        if self.pad_to_batch and static is not None and static <= self.batch_size:
            return self.clip_physical_batch(x, y, mask, gate)
        if self.segments is not None:
            return self.sum_user_batches(x, y, mask, gate)
        if not self.pad_to_batch or static is not None:
            return self.sum_physical_batches(x, y, mask, gate)
        return tf.cond(
            tf.shape(mask)[0] <= self.batch_size,
            lambda: self.clip_physical_batch(x, y, mask, gate),
            lambda: self.sum_physical_batches(x, y, mask, gate),
        )

    def sum_user_batches(self, x, y, mask, gate=None):
        """A user-level lot in physical batches of whole users: each batch runs
        from its first row to the last user that ends within `batch_size` rows (a
        user larger than that alone), its slots renumbered from 0.  Every user's
        examples are in one batch, so each batch's clipped sum is sum_u clip(G_u)
        over its users and the lot's is their sum.  The slots must be in
        non-decreasing order (`UserLotSampler.lot`; checked: out of order, a
        user could be cut in two and clipped twice)."""
        segments = tf.cast(self.segments, tf.int32)
        ordered = tf.debugging.assert_greater_equal(
            segments[1:],
            segments[:-1],
            message="user-level lot: the user slots must be in non-decreasing order "
            "(a user's examples together), or a physical batch could split a user",
        )
        with tf.control_dependencies([ordered]):
            segments = tf.identity(segments)
        n = tf.shape(mask)[0]
        bsz = self.batch_size
        per_example = self.per_example

        def rows_before(slot):  # the first row of user `slot` (slots sorted)
            return tf.reduce_sum(tf.cast(segments < slot, tf.int32))

        def batch_end(start):
            first = segments[start]
            end_of_first = rows_before(first + 1)
            by_rows = tf.cond(
                start + bsz >= n, lambda: n, lambda: rows_before(segments[start + bsz])
            )
            return tf.maximum(by_rows, end_of_first)

        def clip_users(start, size, statistics):
            per_example.segments = _rows(segments, start, size) - segments[start]
            try:
                return self._clip_rows(x, y, mask, gate, start, size, statistics=statistics)
            finally:
                per_example.segments = segments

        def batch(start):
            end = batch_end(start)
            return end, end - start

        def one_user(start):  # the rows of the user that starts at `start`
            end = rows_before(segments[start] + 1)
            return end, end - start

        return self._sum_batches(n, batch, clip_users, redo=one_user)

    def sum_physical_batches(self, x, y, mask, gate=None):
        """The loop over physical batches (under XLA every slice padded to the
        static size `batch_size`)."""
        bsz = self.batch_size
        n = tf.shape(mask)[0]
        if self.pad_to_batch:
            padded = (n + bsz - 1) // bsz * bsz

            def pad(t):
                return tf.pad(t, [[0, padded - n]] + [[0, 0]] * (t.shape.rank - 1))

            x, y, mask = tf.nest.map_structure(pad, x), pad(y), pad(mask)

        def batch(start):  # under XLA the static size (the rows are padded)
            if self.pad_to_batch:
                return start + bsz, bsz
            return tf.minimum(start + bsz, n), tf.minimum(bsz, n - start)

        def clip_rows(start, size, statistics):
            # under XLA (static shapes) the batch's tf.cond reruns it
            return self._clip_rows(
                x, y, mask, gate, start, size, statistics=statistics, rerun=self.pad_to_batch
            )

        def one_example(start):
            return start + 1, tf.ones_like(start)

        return self._sum_batches(
            n, batch, clip_rows, redo=None if self.pad_to_batch else one_example
        )

    def _clip_rows(self, x, y, mask, gate, start, size, statistics=None, rerun=False):
        """`clip_batch_once` (rerun: `clip_physical_batch`) of rows [start, start + size)."""
        rows = (
            tf.nest.map_structure(lambda t: _rows(t, start, size), x),
            _rows(y, start, size),
            _rows(mask, start, size),
            gate,
        )
        if rerun:
            return self.clip_physical_batch(*rows)
        return self.clip_batch_once(*rows, statistics=statistics)

    def _sum_batches(self, n, batch, clip_rows, redo=None):
        """(clipped sums, loss sum, examples kept, examples dropped) summed over
        the physical batches cut from rows [0, n): `batch(start)` gives the
        next batch's (end, size), `clip_rows(start, size, statistics)` its four
        values (`statistics`: a boolean tensor, whether to compute them).

        `redo(start)` (the (end, size) of the one example, or the one user, that
        starts at `start`): a batch in which some example is non-finite is not
        added; the loop goes over its rows again one unit at a time, through the
        same `clip_rows`, so the per-example gradients are traced once (a
        `tf.cond` around a rerun would trace them twice).  The discarded pass
        still gives the batch's statistics (a forward pass does not mix
        examples); the units' passes give none.  Without `redo`, `clip_rows`
        reruns such a batch itself."""

        def body(start, redo_end, acc, loss_sum, count, dropped):
            if redo is None:
                end, size = batch(start)
                sums, b_loss, b_count, n_bad = clip_rows(start, size, None)
                again = tf.constant(False)
            else:
                redoing = start < redo_end  # rows [start, redo_end) are being redone
                end, size = tf.cond(redoing, lambda: redo(start), lambda: batch(start))
                sums, b_loss, b_count, n_bad = clip_rows(start, size, tf.logical_not(redoing))
                again = tf.logical_not(redoing) & (n_bad > 0) & (size > 1)
            return (
                tf.where(again, start, end),
                tf.where(again, end, redo_end),
                [tf.where(again, a, a + s) for a, s in zip(acc, sums)],
                loss_sum + b_loss,
                count + b_count,
                dropped + tf.where(again, tf.zeros_like(n_bad), n_bad),
            )

        acc0 = [tf.zeros(v.shape, v.dtype) for v in self.variables]
        state = (tf.constant(0), tf.constant(0), acc0, tf.constant(0.0), tf.constant(0.0))
        _, _, *out = tf.while_loop(
            lambda start, *_: start < n,
            body,
            state + (tf.constant(0, tf.int64),),
            parallel_iterations=1,
        )
        return tuple(out)

    def add_noise(self, clipped_sum, step):
        """sum + N(0, sigma^2 C^2 I), once per lot.  Lot t's noise is stream
        position `step` = t of the sanitizer's key: a seeded run continues its
        stream across fits and resumes and never reuses a position.  Under a
        distribution strategy each replica sums its share of the lot and the
        optimizer all-reduces the sums, so exactly one replica contributes the
        (single) noise draw.  The sums take the variables' static shapes first:
        the noise's chunks (`stateless_normals`) then do not depend on which
        path (loop, `tf.cond`) computed them."""
        clipped_sum = [tf.ensure_shape(c, v.shape) for c, v in zip(clipped_sum, self.variables)]
        noised = self.sanitizer.add_noise(clipped_sum, self.groups, step=step)
        replica = tf.distribute.get_replica_context()
        if replica is not None and replica.num_replicas_in_sync > 1:
            first = tf.equal(replica.replica_id_in_sync_group, 0)
            noised = [tf.where(first, z, c) for c, z in zip(clipped_sum, noised)]
        return noised

    def scale_grad(self, noised):
        """(sum + noise) / L: L the expected lot size (the accounting's)."""
        return [g / self.expected_lot for g in noised]

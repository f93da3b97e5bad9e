"""User-level DP-SGD: the unit of privacy is a user, all of one person's examples.

When one person contributes many records, example-level DP says little about
that person.  User-level DP-SGD (McMahan et al. 2018, "Learning differentially
private recurrent language models", DP-FedSGD; the centralised form of
jax-privacy's user-level training) changes the record of DP-SGD from an example
to a user:

* neighbouring datasets differ by adding or removing ONE USER with all their
  examples (add/remove-one at the user level);
* lot t samples users: each of the U users joins independently with
  probability q = L_u / U (Poisson, `UserLotSampler`); a sampled user brings
  their examples -- all of them, or a uniformly random subset of at most
  ``max_examples_per_user`` drawn afresh for every lot -- together in the lot;
* a user's contribution is the gradient of the sum of their examples' losses,
  G_u = sum_{i in u} grad_i, clipped as one: clip(G_u) = G_u min(1, C / ||G_u||)
  (`PerUserGradients`);
* noise once per lot: (sum_u clip(G_u) + N(0, sigma^2 C^2 I)) / L_u.

Removing one user removes one clipped term, so the noised sum moves by at most
C: the lot is ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))`` with q the
*user* sampling rate, and the ledger counts user-level lots.  The epsilon is
a guarantee for users.  It does not carry over to one example unchanged:
removing one example of a user *changes* that user's clipped term (a
replace-one step of sensitivity 2C), so the same run's example-level epsilon
is larger (1.5-2.5 times in typical settings, more at high sampling rates:
`example_level_epsilon` computes it).

How the per-user norm is computed.  The per-layer rules give each example's
gradient implicitly (its squared norm and the clipped sum c -> sum_i c_i g_i).
The clipped sum needs nothing new: every example of user u takes u's factor,
sum_u c_u G_u = sum_i c_{u(i)} g_i.  The norm ||G_u|| needs the per-user sum,
which the ghost-norm rules never form: `PerUserGradients` forms it, for each
variable in turn, as the rule's clipped sum with the indicator of u's
examples (vectorised over a few of the batch's users at a time), i.e. it
materialises the per-user gradient of one variable at a time -- for every
rule, the generic path too.
Cost: the per-user sums of (users at a time) x (largest variable), and the
rules' per-user intermediates of (users at a time) x (rows) x (a layer's
activations); a user-level ghost norm (Gram matrices over a user's examples)
is not implemented.

A lot is computed in physical batches of whole users (a user's examples in
the same backward pass, `LotStep.sum_user_batches`): at most `batch_size`
examples, or one user's examples if they are more; the result is the same sum.
Within a batch, the per-user norms are computed for a few users at a time
(`USER_ROWS` user-rows, `PerUserGradients`), so memory is bounded by the
largest of `batch_size` and one user's examples in a lot (which
``max_examples_per_user`` caps).  An example with a non-finite gradient makes
its user's G_u non-finite: the physical batch is then recomputed user by user
(by the loop over physical batches, `LotStep._sum_batches`, or by
`rerun_user_by_user`, so one user's NaN cannot reach another user's
gradient) and that user is dropped.
"""

from __future__ import annotations

import math
from typing import Callable

import numpy as np
import tensorflow as tf

from dpfl_tf._validation import check_count
from dpfl_tf.keras.per_example import PerExampleGradients
from dpfl_tf.keras.sampling import LotSampler, _holding, _no_autograph, _read_padded
from dpfl_tf.keras.sources import ArrayReader, IndexedReader, make_reader
from dpfl_tf.privacy.events import SamplingMethod
from dpfl_tf.secure_random import secure_uniform

__all__ = [
    "UserLotSampler",
    "PerUserGradients",
    "group_users",
    "rerun_user_by_user",
    "user_level_sampler",
    "refuse_mixed_units",
    "example_level_epsilon",
]

#: the ledger label of user-level lots (example-level lots are "dpsgd")
USER_LEVEL_LABEL = "dpsgd (user-level)"
#: per-user norms are computed for k users at a time, k x (rows of the physical
#: batch) <= USER_ROWS (the rules' intermediates are per user and row: about 100 KB
#: each for a 28x28 convolution of 16 channels) and k x (variable size) <= USER_SUMS
USER_ROWS = 4096
USER_SUMS = 2**28  # floats: 1 GiB of per-user sums


def group_users(user_ids, num_examples: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, offsets): user k holds ``indices[offsets[k]:offsets[k + 1]]``.

    `user_ids` is one id per example (an array of N ints or strings), or a
    partition: a `dpfl_tf.federated.ClientPartition` (the same users as a
    federated run) or a list of index lists, one per user.  Every example must
    belong to exactly one user and every user must hold an example.
    """
    n = check_count("the number of examples", num_examples, minimum=1)
    if user_ids is None:
        raise ValueError(
            "user_ids is missing: user-level DP-SGD needs the user of every "
            "example (an array of N ids, or a partition)"
        )
    if hasattr(user_ids, "indices") and hasattr(user_ids, "offsets"):  # ClientPartition
        indices = np.asarray(user_ids.indices, dtype=np.int64)
        offsets = np.asarray(user_ids.offsets, dtype=np.int64)
        return _checked_partition(indices, offsets, n)
    if (
        isinstance(user_ids, (list, tuple))
        and user_ids
        and all(isinstance(u, (list, tuple, np.ndarray)) for u in user_ids)
    ):
        sizes = np.array([len(u) for u in user_ids], dtype=np.int64)
        indices = np.concatenate([np.asarray(u, dtype=np.int64).ravel() for u in user_ids])
        return _checked_partition(indices, np.concatenate([[0], np.cumsum(sizes)]), n)
    ids = np.asarray(user_ids)
    if ids.ndim != 1 or len(ids) != n:
        raise ValueError(f"user_ids must hold one id per example ({n}), got shape {ids.shape}")
    missing = _missing(ids)
    if missing.size:
        raise ValueError(
            f"user_ids is missing for {missing.size} example(s) (first: example "
            f"{int(missing[0])}, {ids[missing[0]]}); every example needs a user"
        )
    _, owner = np.unique(ids, return_inverse=True)
    order = np.argsort(owner, kind="stable")
    sizes = np.bincount(owner)
    return order.astype(np.int64), np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def _missing(ids: np.ndarray) -> np.ndarray:
    if ids.dtype.kind == "f":
        return np.flatnonzero(~np.isfinite(ids))
    if ids.dtype.kind == "O":
        return np.flatnonzero([v is None or (isinstance(v, float) and v != v) for v in ids])
    return np.zeros(0, np.int64)


def _checked_partition(indices, offsets, n):
    sizes = np.diff(offsets)
    empty = np.flatnonzero(sizes == 0)
    if empty.size:
        raise ValueError(
            f"{empty.size} user(s) hold no examples (first: user {int(empty[0])}); "
            "every user needs at least one example"
        )
    if indices.size and (indices.min() < 0 or indices.max() >= n):
        raise ValueError(
            f"the user partition names example indices outside [0, {n}) "
            f"(got {int(indices.min())}..{int(indices.max())})"
        )
    counts = np.bincount(indices, minlength=n)
    if (counts > 1).any():
        raise ValueError(
            f"example {int(np.flatnonzero(counts > 1)[0])} belongs to several "
            "users: each example must belong to exactly one"
        )
    if (counts == 0).any():
        raise ValueError(
            f"{int((counts == 0).sum())} example(s) belong to no user (first: "
            f"example {int(np.flatnonzero(counts == 0)[0])}); every example "
            "needs a user"
        )
    return indices, offsets


class UserLotSampler(LotSampler):
    """Draws user-level lots: Poisson sampling of users (module docstring).

    Args:
      user_ids: see `group_users`.
      num_examples: N.
      users_per_lot: L_u, the expected number of users in a lot; q = L_u / U.
      max_examples_per_user: cap k (a fresh uniform subset of k examples of a
        larger user in every lot); None: all of a user's examples.
      seed: seeds the sampling (tests only; default OS entropy).
      secure_mode: draw every decision from ``os.urandom`` (refuses a seed).
      first_lot: the number of the first lot drawn.

    A `LotSampler` over the U users (its dataset_size, lot_size, sampling
    rate, lots per epoch and event arguments count users); `lot(t)` gives
    lot t's examples and `dataset` reads them.
    """

    ledger_label = USER_LEVEL_LABEL

    def __init__(
        self,
        user_ids,
        num_examples: int,
        users_per_lot: int,
        *,
        max_examples_per_user: int | None = None,
        seed: int | None = None,
        secure_mode: bool = False,
        first_lot: int = 0,
    ):
        self.indices, self.offsets = group_users(user_ids, num_examples)
        self.num_examples = int(num_examples)
        users = len(self.offsets) - 1
        lot = check_count("lot_size (users per lot)", users_per_lot, minimum=1)
        if lot > users:
            raise ValueError(
                f"lot_size (users per lot) must be <= the number of users ({users}), got {lot}"
            )
        super().__init__(
            users,
            lot,
            SamplingMethod.POISSON,
            seed=seed,
            secure_mode=secure_mode,
            first_lot=first_lot,
        )
        self.max_examples_per_user = (
            None
            if max_examples_per_user is None
            else check_count("max_examples_per_user", max_examples_per_user, minimum=1)
        )

    @property
    def sizes(self) -> np.ndarray:
        """Examples of each user."""
        return np.diff(self.offsets)

    def index_dataset(self, num_lots=None):
        raise NotImplementedError(
            "user-level lots are (examples, user slots): use lot(t) or dataset()"
        )

    def replica_shares(self, *args, **kwargs):
        raise NotImplementedError("user-level lots are not split among replicas")

    def expected_lot_examples(self) -> float:
        """E[examples in a lot] = q sum_u min(n_u, k)."""
        sizes = (
            self.sizes
            if self.max_examples_per_user is None
            else np.minimum(self.sizes, self.max_examples_per_user)
        )
        return float(self.sampling_rate * sizes.sum())

    def lot_examples_bound(self) -> int:
        """The examples of all but a tiny fraction of lots: E + 5 sd, with
        E = q sum_u s_u and Var = q (1 - q) sum_u s_u^2 (s_u = min(n_u, k))."""
        sizes = self.sizes
        if self.max_examples_per_user is not None:
            sizes = np.minimum(sizes, self.max_examples_per_user)
        q = self.sampling_rate
        sizes = sizes.astype(np.float64)
        return math.ceil(q * sizes.sum() + 5 * math.sqrt(q * (1 - q) * np.square(sizes).sum()))

    def lot(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Lot t: (example indices, user slot of each: 0..m-1 for its m users),
        a user's examples together and the slots in increasing order (the
        physical batches cut the lot between users)."""
        rng = np.random.default_rng([self.key, int(t)])
        u = secure_uniform(self.dataset_size) if self.secure_mode else rng.random(self.dataset_size)
        users = np.flatnonzero(u < self.sampling_rate)
        cap = self.max_examples_per_user
        parts = []
        for user in users:
            mine = self.indices[self.offsets[user] : self.offsets[user + 1]]
            if cap is not None and len(mine) > cap:
                keys = secure_uniform(len(mine)) if self.secure_mode else rng.random(len(mine))
                mine = np.sort(mine[np.argpartition(keys, cap - 1)[:cap]])
            parts.append(mine)
        if not parts:
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        counts = [len(p) for p in parts]
        return (
            np.concatenate(parts).astype(np.int64),
            np.repeat(np.arange(len(parts), dtype=np.int32), counts),
        )

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
        """A `tf.data.Dataset` of (x_lot, y_lot, mask, user_slots), padded to a
        multiple of `pad_to`; padding examples have mask 0 and a slot of their
        own (m, after the lot's m users)."""
        pad_to = check_count("pad_to", pad_to, minimum=1)
        reader = x if isinstance(x, (ArrayReader, IndexedReader)) else make_reader(x, y)
        if reader.size != self.num_examples:
            raise ValueError(
                f"the data has {reader.size} examples but user_ids were given "
                f"for {self.num_examples}"
            )
        total = (
            None
            if epochs is None
            else check_count("epochs", epochs, minimum=1) * self.lots_per_epoch
        )
        first = self.first_lot

        def lots():
            t = first
            while total is None or t < first + total:
                yield (t, *self.lot(t))
                t += 1

        def load(t, idx, slots):
            n = tf.shape(idx, out_type=tf.int64)[0]
            size = tf.maximum(tf.constant(pad_to, tf.int64), (n + pad_to - 1) // pad_to * pad_to)
            xb, yb, mask = _read_padded(reader, idx, size, preprocess, t)
            users = tf.reduce_max(tf.concat([slots, [-1]], 0)) + 1
            slots = tf.pad(slots, [[0, size - n]], constant_values=users)
            return xb, yb, mask, slots

        spec = (
            tf.TensorSpec([], tf.int64),
            tf.TensorSpec([None], tf.int64),
            tf.TensorSpec([None], tf.int32),
        )
        return _holding(
            reader,
            tf.data.Dataset.from_generator(lots, output_signature=spec)
            .map(_no_autograph(load, preprocess), num_parallel_calls=prefetch, deterministic=True)
            .prefetch(prefetch),
        )


class PerUserGradients(PerExampleGradients):
    """`PerExampleGradients` whose clipping reads each example's USER's squared
    norm ||G_u||^2, G_u = sum_{i in u} g_i (module docstring), so that the
    clipped sum is sum_u clip(G_u).  Set `segments` (the user slot of every
    example of the batch, int32 [B]) before `compute`."""

    segments = None

    def _clipped_norms(self, variables, sq_norms, sum_fns):
        if self.segments is None:
            raise RuntimeError(
                "PerUserGradients.segments is not set: give the user slot of "
                "every example of the batch"
            )
        seg = tf.cast(self.segments, tf.int32)
        users = tf.reduce_max(seg) + 1
        rows = tf.shape(seg)[0]
        indicators = tf.transpose(tf.one_hot(seg, users, dtype=tf.float32))  # [U, B]
        out = []
        for v in variables:
            # k users at a time: the rules' per-user intermediates are [k, B, ...] and
            # the per-user sums [k, *v.shape], bounded whatever U is; and no more than
            # the batch's users (the chunk is padded with empty users up to k: a batch
            # of one user of 10 rows computed 409 users' sums, 408 of them zero)
            size = max(1, int(np.prod(v.shape)))
            bound = tf.minimum(USER_ROWS // tf.maximum(rows, 1), USER_SUMS // size)
            k = tf.maximum(1, tf.minimum(bound, users))
            chunks = (users + k - 1) // k
            padded = tf.pad(indicators, [[0, chunks * k - users], [0, 0]])  # zero users
            fn = sum_fns[id(v)]

            def chunk_norms(c, fn=fn):
                per_user = tf.vectorized_map(fn, c)  # [k, *v.shape]
                return tf.reduce_sum(
                    tf.reshape(tf.square(tf.cast(per_user, tf.float32)), [tf.shape(c)[0], -1]),
                    axis=1,
                )

            sq = tf.map_fn(
                chunk_norms,
                tf.reshape(padded, [chunks, k, rows]),
                fn_output_signature=tf.TensorSpec([None], tf.float32),
                parallel_iterations=1,
            )
            out.append(tf.gather(tf.reshape(sq, [-1])[:users], seg))
        return out


def rerun_user_by_user(clip_user: Callable, variables, x, y, mask, segments):
    """The lot's clipped sum recomputed one user at a time (no user's values
    can reach another's gradient), and the number of examples dropped.

    `clip_user(x_u, y_u, mask_u, slots_u)` returns (clipped sums of one user's
    examples, examples dropped) for a batch holding that user only."""
    users = tf.reduce_max(segments) + 1

    def one(u):
        rows = tf.where(tf.equal(segments, u))[:, 0]
        sums, dropped = clip_user(
            tf.nest.map_structure(lambda t: tf.gather(t, rows), x),
            tf.gather(y, rows),
            tf.gather(mask, rows),
            tf.zeros_like(tf.gather(segments, rows)),
        )
        return [tf.cast(s, v.dtype) for s, v in zip(sums, variables)] + [tf.cast(dropped, tf.int64)]

    spec = [tf.TensorSpec(v.shape, v.dtype) for v in variables] + [tf.TensorSpec([], tf.int64)]
    out = tf.map_fn(one, tf.range(users), fn_output_signature=spec, parallel_iterations=1)
    return [tf.reduce_sum(t, axis=0) for t in out[:-1]], tf.reduce_sum(out[-1])


def refuse_mixed_units(ledger, *, user_level: bool) -> None:
    """ValueError if `ledger` holds lots of the other unit of privacy: an
    epsilon composed from example-level and user-level lots bounds neither."""
    held_label, held, new, fix = (
        ("dpsgd", "example", "user", "leave out user_ids=")
        if user_level
        else (USER_LEVEL_LABEL, "user", "example", "pass user_ids=")
    )
    count = ledger.count(held_label)
    if count:
        raise ValueError(
            f"this model's ledger holds {count} {held}-level lots: {new}-level lots composed "
            "with them give an epsilon that bounds neither unit of privacy. Train from a "
            f"fresh DPModel, or keep to one unit ({fix})"
        )


def user_level_sampler(
    model,
    num_examples: int,
    lot_size: int,
    *,
    sampling,
    user_ids,
    max_examples_per_user,
    seed,
    first_lot,
) -> UserLotSampler:
    """The sampler of ``DPModel.fit(..., user_ids=...)``, after the refusals
    that keep its lots user-level: Poisson sampling only, no XLA, one replica,
    and a ledger that holds no example-level lots (an example-level and a
    user-level epsilon do not compose into either)."""
    if user_ids is None:
        raise ValueError(
            f"max_examples_per_user={max_examples_per_user!r} needs user_ids (the "
            "user of every example)"
        )
    if SamplingMethod.parse(sampling) is not SamplingMethod.POISSON:
        raise ValueError(
            f"user-level DP-SGD samples users with Poisson sampling: sampling "
            f"must be 'poisson', got {sampling!r}"
        )
    if model.jit_compile:
        raise ValueError(
            "user-level DP-SGD needs jit_compile=False: the number of users in a "
            "lot changes from lot to lot, a shape XLA would compile anew (this "
            "mode is not supported, so it is refused)"
        )
    replicas = model.distribute_strategy.num_replicas_in_sync
    if replicas > 1:
        raise ValueError(
            f"user-level DP-SGD runs on one replica, got a distribution strategy "
            f"with {replicas} (a user's examples would be split; not supported)"
        )
    refuse_mixed_units(model.ledger, user_level=True)
    return UserLotSampler(
        user_ids,
        num_examples,
        lot_size,
        max_examples_per_user=max_examples_per_user,
        seed=seed,
        secure_mode=model.optimizer.secure_mode,
        first_lot=first_lot,
    )


def example_level_epsilon(
    noise_multiplier: float, sampling_rate: float, lots: int, delta: float
) -> float:
    """The example-level epsilon a user-level run implies (add/remove one example).

    Removing one example of user u changes u's clipped contribution
    clip(G_u) -> clip(G_u - g_i): two vectors of norm <= C, so the noised sum
    moves by up to 2C when u is sampled (probability q) and not at all
    otherwise -- the replace-one relation of the Poisson-sampled Gaussian
    (a removal, u's only example, is the case clip(G_u - g_i) = 0).  dp-
    accounting's PLD accountant analyses exactly that pair under
    ``REPLACE_ONE`` (its multiplier is std / C, the sensitivity doubled
    inside).  The cap's extra sampling of a large user's examples is ignored
    (conservative).  So a user-level epsilon does not carry over to examples
    unchanged: the example-level one is larger (1.5-2.5 times in typical settings, at the same
    delta), while an example-level epsilon says nothing useful about a user
    of many examples (group privacy multiplies it by their number).
    """
    import dp_accounting
    from dp_accounting import pld

    accountant = pld.PLDAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE
    )
    accountant.compose(
        dp_accounting.PoissonSampledDpEvent(
            sampling_rate, dp_accounting.GaussianDpEvent(noise_multiplier)
        ),
        int(lots),
    )
    return float(accountant.get_epsilon(delta))

"""User-level DP-SGD: per-user clipping against brute force, the user sampler,
DPModel.fit(user_ids=...) and its refusals, on small slices of real MNIST."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.keras import DPSGD, DPModel
from dpfl_tf.keras.lot import LotStep
from dpfl_tf.keras.per_example import per_example_loss
from dpfl_tf.keras.users import PerUserGradients, UserLotSampler, group_users
from dpfl_tf.privacy import compute_epsilon, dp_sgd_event
from tests.keras.helpers import loss, mlp, mnist_slice

# what XLA and TensorFlow compile here stays until the process ends (+1.2 GB in a
# whole-suite worker): the file runs in a process of its own (tests/isolation.py)
pytestmark = pytest.mark.isolated

C = 0.5


def _clip(sq_norms):
    total = tf.add_n(sq_norms)
    factor = C / tf.maximum(tf.sqrt(total), C)
    return [factor] * len(sq_norms)


def _models():
    keras.utils.set_random_seed(0)
    conv = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(4, 5, strides=3, activation="tanh"),
            keras.layers.LayerNormalization(),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ]
    )
    seq = keras.Sequential(
        [
            keras.Input((12,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.Dense(6, activation="relu"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(10),
        ]
    )
    return {"conv": conv, "sequence": seq}


def _data(kind, n=24):
    if kind == "conv":
        x, y = mnist_slice(n, flat=False)
    else:
        x = (mnist_slice(n)[0][:, 200:212] * 49).astype("int32")
        y = mnist_slice(n)[1]
    return tf.constant(x), tf.constant(y)


def _brute_force(model, x, y, segments, drop=None, clip=C):
    """sum over users of clip(gradient of the sum of the user's losses)."""
    lossf = loss()
    total = [tf.zeros_like(v) for v in model.trainable_variables]
    for u in np.unique(segments):
        if u == drop:
            continue
        rows = np.flatnonzero(segments == u)
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(
                per_example_loss(
                    lossf, tf.gather(y, rows), model(tf.gather(x, rows), training=True)
                )
            )
        grads = [
            tf.convert_to_tensor(g)  # an Embedding's IndexedSlices repeat rows
            for g in tape.gradient(value, model.trainable_variables)
        ]
        norm = tf.linalg.global_norm(grads)
        factor = clip / tf.maximum(norm, clip)
        total = [t + factor * g for t, g in zip(total, grads)]
    return total


@pytest.mark.parametrize("kind", ["conv", "sequence"])
@pytest.mark.parametrize("fast", [True, False])
def test_per_user_clipped_sum_equals_brute_force(kind, fast):
    model = _models()[kind]
    x, y = _data(kind)
    segments = np.array([0] * 7 + [1] * 1 + [2] * 10 + [3] * 6, dtype=np.int32)
    grads = PerUserGradients(model, loss(), fast=fast)
    grads.segments = tf.constant(segments)
    sums, _, _ = grads.compute(x, y, tf.ones([len(segments)]), _clip)
    expected = _brute_force(model, x, y, segments)
    for s, e in zip(sums, expected):
        np.testing.assert_allclose(s.numpy(), e.numpy(), rtol=2e-4, atol=2e-6)


def test_per_user_norms_are_computed_for_the_batchs_users_only(monkeypatch):
    """The per-user sums are vectorised over a chunk of k users, padded with empty
    users up to k: k is at most the batch's users (4 here), not USER_ROWS / rows (170
    for these 24 rows, which made a one-user batch of 10 rows compute 409 users'
    sums: a user-level lot of small batches ran 20-80x slower)."""
    model = _models()["conv"]
    x, y = _data("conv")
    segments = np.array([0] * 7 + [1] * 1 + [2] * 10 + [3] * 6, dtype=np.int32)
    chunks = []
    vectorized_map = tf.vectorized_map

    def recording(fn, elems, **kwargs):
        chunks.append(int(elems.shape[0]))
        return vectorized_map(fn, elems, **kwargs)

    monkeypatch.setattr(tf, "vectorized_map", recording)
    grads = PerUserGradients(model, loss())
    grads.segments = tf.constant(segments)
    sums, _, _ = grads.compute(x, y, tf.ones([len(segments)]), _clip)
    # eagerly: one chunk of the 4 users for each variable
    assert len(chunks) == len(model.trainable_variables) and set(chunks) == {4}
    for s, e in zip(sums, _brute_force(model, x, y, segments)):
        np.testing.assert_allclose(s.numpy(), e.numpy(), rtol=2e-4, atol=2e-6)


@pytest.mark.parametrize("kind", ["conv", "sequence"])
def test_removing_one_user_moves_the_sum_by_at_most_c(kind):
    """User-level sensitivity: with the user's examples removed (masked out),
    the clipped sum moves by exactly that user's clipped gradient, <= C; while
    per-example clipping of the same lot lets one user move it by more."""
    model = _models()[kind]
    x, y = _data(kind)
    segments = np.array([0] * 7 + [1] * 1 + [2] * 10 + [3] * 6, dtype=np.int32)
    grads = PerUserGradients(model, loss())
    grads.segments = tf.constant(segments)
    full, _, _ = grads.compute(x, y, tf.ones([24]), _clip)
    moves = []
    for u in range(4):
        mask = tf.constant((segments != u).astype("float32"))
        without, _, _ = grads.compute(x, y, mask, _clip)
        move = math.sqrt(sum(float(tf.reduce_sum(tf.square(a - b))) for a, b in zip(full, without)))
        assert move <= C * (1 + 1e-4)
        brute = _brute_force(model, x, y, segments, drop=u)
        assert max(float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(without, brute)) < 1e-4
        moves.append(move)
    assert max(moves) == pytest.approx(C, rel=1e-3)  # a large user is clipped to exactly C
    from dpfl_tf.keras.per_example import PerExampleGradients

    per_example = PerExampleGradients(model, loss())
    full_e, _, _ = per_example.compute(x, y, tf.ones([24]), _clip)
    mask = tf.constant((segments != 2).astype("float32"))
    without_e, _, _ = per_example.compute(x, y, mask, _clip)
    move_e = math.sqrt(
        sum(float(tf.reduce_sum(tf.square(a - b))) for a, b in zip(full_e, without_e))
    )
    assert move_e > 1.5 * C  # 10 examples clipped one by one: up to 10 C


def test_group_users_from_ids_and_partitions():
    ids = np.array(["b", "a", "b", "c", "a"])
    indices, offsets = group_users(ids, 5)
    groups = [indices[offsets[k] : offsets[k + 1]].tolist() for k in range(3)]
    assert groups == [[1, 4], [0, 2], [3]]
    from dpfl_tf.federated import ClientPartition

    part = ClientPartition.from_lists([[0, 2], [1], [3, 4]])
    idx, off = group_users(part, 5)
    assert idx.tolist() == [0, 2, 1, 3, 4] and off.tolist() == [0, 2, 3, 5]
    idx, off = group_users([[4, 3], [0, 1, 2]], 5)
    assert off.tolist() == [0, 2, 5]


@pytest.mark.parametrize(
    "user_ids,match",
    [
        (None, "user_ids is missing: user-level DP-SGD needs the user of every example"),
        (np.arange(4), r"user_ids must hold one id per example \(5\), got shape \(4,\)"),
        (
            np.array([0, 1, np.nan, 1, 0]),
            r"user_ids is missing for 1 example\(s\) \(first: "
            r"example 2, nan\)",
        ),
        (np.array([0, 1, None, 1, 0], dtype=object), "missing for 1 example"),
        ([[0, 1], [], [2, 3, 4]], r"1 user\(s\) hold no examples \(first: user 1\)"),
        ([[0, 1], [1, 2, 3, 4]], "example 1 belongs to several users"),
        ([[0, 1], [2, 3]], r"1 example\(s\) belong to no user \(first: example 4\)"),
        ([[0, 1], [2, 3, 9]], r"example indices outside \[0, 5\)"),
    ],
)
def test_group_users_refusals(user_ids, match):
    with pytest.raises(ValueError, match=match):
        group_users(user_ids, 5)


def test_user_sampler_poisson_over_users_and_the_cap():
    ids = np.repeat(np.arange(200), np.arange(200) % 7 + 1)  # 1..7 examples per user
    n = len(ids)
    sampler = UserLotSampler(ids, n, 20, max_examples_per_user=3, seed=1)
    assert sampler.dataset_size == 200 and sampler.sampling_rate == 0.1
    counts = []
    for t in range(300):
        idx, slots = sampler.lot(t)
        users = np.unique(ids[idx])
        counts.append(len(users))
        # a user's examples together, in one slot each, at most 3 of them
        assert len(np.unique(slots)) == len(users)
        for s in np.unique(slots):
            assert len(np.unique(ids[idx[slots == s]])) == 1
            assert (slots == s).sum() == min(3, int(np.sum(ids == ids[idx[slots == s][0]])))
    # the number of users in a lot is Binomial(200, 0.1)
    assert np.mean(counts) == pytest.approx(20, rel=0.05)
    assert np.var(counts) == pytest.approx(200 * 0.1 * 0.9, rel=0.25)
    again = UserLotSampler(ids, n, 20, max_examples_per_user=3, seed=1)
    assert all(np.array_equal(again.lot(t)[0], sampler.lot(t)[0]) for t in range(5))
    with pytest.raises(
        ValueError,
        match="lot_size \\(users per lot\\) must be <= the number of users \\(200\\), got 201",
    ):
        UserLotSampler(ids, n, 201)
    with pytest.raises(ValueError, match="max_examples_per_user must be a whole number >= 1"):
        UserLotSampler(ids, n, 20, max_examples_per_user=0)


N_USERS, PER_USER = 60, 10


@pytest.fixture(scope="module")
def mnist_users():
    x, y = mnist_slice(N_USERS * PER_USER, features=60)
    return x, y, np.repeat(np.arange(N_USERS), PER_USER)


def _dp_model(sigma=1.0, seed=0):
    model = DPModel(mlp(seed=0))
    model.compile(
        optimizer=DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=sigma, seed=seed),
        loss=loss(),
        metrics=["accuracy"],
    )
    return model


def test_fit_with_user_ids_trains_and_accounts_users(mnist_users):
    x, y, users = mnist_users
    model = _dp_model()
    history = model.fit(
        x,
        y,
        lot_size=12,
        epochs=2,
        user_ids=users,
        max_examples_per_user=5,
        sampling_seed=0,
        verbose=0,
    )
    assert history.history["loss"][-1] < history.history["loss"][0]
    # 2 epochs of U / L_u = 5 lots, each a Poisson(q = 12 / 60) sample of users
    assert model.lots_computed == 10
    assert model.ledger.entries == [
        {
            "event": "Poisson(q=0.2) Gaussian(sigma=1) (add/remove-one)",
            "count": 10,
            "label": "dpsgd (user-level)",
        }
    ]
    expected = dp_sgd_event(1.0, 10, sampling_rate=12 / 60)
    assert model.epsilon(1e-5) == pytest.approx(compute_epsilon(expected, 1e-5))
    # more training on the same users continues the user-level ledger
    model.fit(x, y, lot_size=12, epochs=1, user_ids=users, sampling_seed=1, verbose=0)
    assert model.ledger.count("dpsgd (user-level)") == 15


def _assert_one_sgd_lot(model, before, x, y, slots):
    """The model's weights are `before` after one noiseless DPSGD(0.5) lot of
    these users (clip 1, L_u = N_USERS), computed by brute force."""
    ref = mlp(seed=0)
    ref.set_weights(before)
    clipped = _brute_force(ref, tf.constant(x), tf.constant(y), slots, clip=1.0)
    for b, after, g in zip(before, model.model.trainable_variables, clipped):
        np.testing.assert_allclose(
            after.numpy(), b - 0.5 * g.numpy() / N_USERS, rtol=1e-4, atol=1e-6
        )


@pytest.mark.parametrize(
    "batch_size, user_rows",
    [(None, None), (3, None), (10, None), (None, 8), (None, 7 * 240)],
    ids=[
        "one-batch",
        "a-user-larger-than-a-batch",
        "two-users-a-batch",
        "norms-user-by-user",
        "norms-7-users-at-a-time",
    ],
)
def test_user_level_lot_equals_per_user_brute_force(
    mnist_users, batch_size, user_rows, monkeypatch
):
    """One lot through fit, no noise: the update is -lr * (sum over the lot's
    users of clip(gradient of the user's loss sum)) / L_u, with the examples the
    sampler drew (q = 1: one lot an epoch, every user, at most 4 examples each),
    whether the lot is one physical batch or batches of whole users cut by
    `batch_size` examples (3: each user of 4 alone; 10: two users), and whether
    the per-user norms are computed for all users at once, one at a time
    (`users.USER_ROWS` patched to 8 user-rows for a batch of 240 rows) or 7 at a time
    (the last of the 9 chunks padded with empty users)."""
    from dpfl_tf.keras import users as users_module

    if user_rows is not None:
        monkeypatch.setattr(users_module, "USER_ROWS", user_rows)
    x, y, users = mnist_users
    model = _dp_model(sigma=0.0)
    before = [v.numpy() for v in model.model.trainable_variables]
    idx, slots = UserLotSampler(users, len(y), N_USERS, max_examples_per_user=4, seed=3).lot(0)
    assert len(idx) == 4 * N_USERS and len(np.unique(slots)) == N_USERS
    model.fit(
        x,
        y,
        lot_size=N_USERS,
        epochs=1,
        user_ids=users,
        max_examples_per_user=4,
        sampling_seed=3,
        batch_size=batch_size,
        verbose=0,
    )
    assert model.lots_computed == 1
    assert model._batch_size == (batch_size or 240)  # by default the whole lot (q = 1)
    _assert_one_sgd_lot(model, before, x[idx], y[idx], slots)


class _RecordedBatches(LotStep):
    """A LotStep whose physical batches only record their rows and user slots."""

    def __init__(self, batch_size):
        class PerUser:
            segments = None

        super().__init__(
            [tf.Variable(tf.zeros([1]))], PerUser(), None, [0], batch_size=batch_size,
            expected_lot=1.0,
        )  # fmt: skip
        self.batches = []

    def clip_batch_once(self, xb, yb, mb, gate, statistics=None):
        self.batches.append((xb.numpy(), self.per_example.segments.numpy()))
        return [tf.zeros([1])], tf.constant(0.0), tf.constant(0.0), tf.constant(0, tf.int64)


def test_a_user_level_lot_is_cut_between_users_and_refused_out_of_order():
    """Users of 3, 2, 4, 1, 2, 6 and 1 examples and two padding rows (slot 7), batch
    size 4: every row in exactly one batch, in order; every user in one batch (its
    slots renumbered from 0); a batch over 4 rows holds one user (the 6).  Slots out
    of order, which could split a user, are refused."""
    sizes = [3, 2, 4, 1, 2, 6, 1]
    slots = np.concatenate([np.repeat(np.arange(7), sizes), [7, 7]]).astype(np.int32)
    n = len(slots)
    step = _RecordedBatches(batch_size=4)
    step.per_example.segments = tf.constant(slots)
    rows = tf.range(n)[:, None]
    step.clip_and_accumulate(rows, tf.zeros([n]), tf.ones([n]))
    assert np.concatenate([b[0][:, 0] for b in step.batches]).tolist() == list(range(n))
    seen = []
    for xb, seg in step.batches:
        users = slots[xb[:, 0]]
        assert (seg == users - users[0]).all()
        assert len(xb) <= 4 or len(set(users)) == 1, (xb[:, 0], users)
        seen += sorted(set(users.tolist()))
    assert seen == list(range(8))  # each user (and the padding) in exactly one batch
    assert [len(b[0]) for b in step.batches] == [3, 2, 4, 3, 6, 3]  # greedy, whole users
    shuffled = slots.copy()
    shuffled[[2, 4]] = shuffled[[4, 2]]  # user 0's third row after user 1's first
    step.per_example.segments = tf.constant(shuffled)
    with pytest.raises(tf.errors.InvalidArgumentError, match="non-decreasing order"):
        step.clip_and_accumulate(rows, tf.zeros([n]), tf.ones([n]))


def test_the_default_physical_batch_covers_nearly_every_user_level_lot():
    """`UserLotSampler.lot_examples_bound` (E + 5 sd of a lot's examples, the
    default physical batch) is above every one of 3,000 lots of users of skewed
    sizes, capped or not, and not far above their largest (under 1.5 times)."""
    rng = np.random.default_rng(0)
    sizes = 1 + rng.lognormal(1.5, 1.0, size=200).astype(int)
    ids = np.repeat(np.arange(200), sizes)
    for cap in (None, 6):
        sampler = UserLotSampler(ids, len(ids), 20, max_examples_per_user=cap, seed=0)
        largest = max(len(sampler.lot(t)[0]) for t in range(3000))
        capped = sizes if cap is None else np.minimum(sizes, cap)
        mean = 0.1 * capped.sum()
        sd = math.sqrt(0.1 * 0.9 * np.square(capped.astype(float)).sum())
        assert sampler.lot_examples_bound() == math.ceil(mean + 5 * sd)
        assert largest <= sampler.lot_examples_bound() < 1.5 * largest, (cap, largest)


def test_fit_refusals(mnist_users):
    x, y, users = mnist_users
    model = _dp_model()
    with pytest.raises(
        ValueError,
        match=r"user_ids must hold one id per example \(600\), got "
        r"shape \(599,\)",
    ):
        model.fit(x, y, lot_size=12, user_ids=users[:-1], verbose=0)
    with pytest.raises(ValueError, match="max_examples_per_user=3 needs user_ids"):
        model.fit(x, y, lot_size=12, max_examples_per_user=3, verbose=0)
    with pytest.raises(ValueError, match="sampling must be 'poisson', got 'shuffle'"):
        model.fit(x, y, lot_size=12, user_ids=users, sampling="shuffle", verbose=0)
    with pytest.raises(ValueError, match=r"1 user\(s\) hold no examples"):
        model.fit(x, y, lot_size=12, user_ids=[list(range(600)), []], verbose=0)
    xla = DPModel(mlp(seed=0))
    xla.compile(
        optimizer=DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=1.0), loss=loss(), jit_compile=True
    )
    with pytest.raises(ValueError, match="user-level DP-SGD needs jit_compile=False"):
        xla.fit(x, y, lot_size=12, user_ids=users, verbose=0)
    assert model.lots_computed == 0  # nothing trained
    model.fit(x, y, lot_size=60, epochs=1, verbose=0)  # example-level lots
    with pytest.raises(
        ValueError,
        match="ledger holds 10 example-level lots: user-level lots "
        "composed with them give an epsilon that bounds neither",
    ):
        model.fit(x, y, lot_size=12, user_ids=users, verbose=0)
    user_model = _dp_model()
    user_model.fit(x, y, lot_size=30, user_ids=users, verbose=0)
    with pytest.raises(
        ValueError,
        match=r"ledger holds 2 user-level lots: example-level lots "
        r".*\(pass user_ids=\)",
    ):
        user_model.fit(x, y, lot_size=60, verbose=0)


@pytest.mark.parametrize("fast, batch_size", [(True, None), (False, None), (True, 25), (False, 25)])
def test_a_non_finite_example_drops_its_user_only(mnist_users, fast, batch_size):
    x, y, users = mnist_users
    x = x.copy()
    x[25, 3] = np.nan  # user 2's example
    model = DPModel(mlp(seed=0), fast_gradients=fast)
    model.compile(optimizer=DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=0.0), loss=loss())
    before = [v.numpy() for v in model.model.trainable_variables]
    idx, slots = UserLotSampler(users, len(y), N_USERS, max_examples_per_user=10, seed=4).lot(0)
    with pytest.warns(RuntimeWarning, match="10 training examples had a NaN or inf gradient"):
        model.fit(
            x,
            y,
            lot_size=N_USERS,
            epochs=1,
            user_ids=users,
            sampling_seed=4,
            max_examples_per_user=10,
            batch_size=batch_size,
            verbose=0,
        )
    assert model.dropped_examples == 10  # all of user 2's examples, no one else's
    keep = slots != 2
    _assert_one_sgd_lot(model, before, x[idx][keep], y[idx][keep], slots[keep])


def test_random_access_source_gives_the_same_lot_as_arrays(mnist_users):
    """fit(source, user_ids=...) reads the same user-level lot as fit(x, y, ...)."""
    from dpfl_tf.data import ArraySource

    x, y, users = mnist_users
    weights = []
    for data in ((x, y), (ArraySource(x, y),)):
        model = _dp_model(sigma=0.0)
        model.fit(
            *data,
            lot_size=N_USERS,
            epochs=1,
            user_ids=users,
            max_examples_per_user=3,
            sampling_seed=5,
            verbose=0,
        )
        weights.append([v.numpy() for v in model.model.trainable_variables])
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match=r"user_ids must hold one id per example \(600\)"):
        _dp_model().fit(ArraySource(x, y), lot_size=12, user_ids=users[:10], verbose=0)


def test_example_level_epsilon_of_a_user_level_run():
    """One example moves its user's clipped contribution by up to 2C: without
    sampling that is the Gaussian mechanism of sensitivity 2C (multiplier
    sigma / 2); with sampling it exceeds the user-level epsilon."""
    from dpfl_tf.keras.users import example_level_epsilon

    every = dp_sgd_event(2.0 / 2, 50, "full_batch")
    assert example_level_epsilon(2.0, 1.0, 50, 1e-5) == pytest.approx(
        compute_epsilon(every, 1e-5, "pld"), rel=1e-3
    )
    user = compute_epsilon(dp_sgd_event(2.0, 300, sampling_rate=0.1), 1e-5, "pld")
    example = example_level_epsilon(2.0, 0.1, 300, 1e-5)
    assert user < example < 2.5 * user

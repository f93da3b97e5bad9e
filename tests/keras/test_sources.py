"""Random-access sources for DPModel.fit (issue 15): every kind of source trains
exactly as in-memory arrays do (same lots, same update), a memmap is read lot by
lot (bytes counted through the mapping), and bad sources give clear errors
with nothing applied or counted for the lot they break."""

import gc
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

from dpfl_tf.keras import DPSGD, DPModel, LotSampler
from dpfl_tf.keras.sources import IndexedReader, SourceError, make_reader
from dpfl_tf.keras.users import UserLotSampler
from tests.keras.helpers import loss, mlp, mnist_slice


def dp_model(seed=0, noise=1.0):
    dp = DPModel(mlp(seed=0))
    dp.compile(
        optimizer=DPSGD(0.5, l2_norm_clip=1.0, noise_multiplier=noise, seed=seed), loss=loss()
    )
    return dp


def weights(dp):
    return [v.numpy().copy() for v in dp.model.trainable_variables]


class ItemSource:
    """__len__ + __getitem__ only (records read by the thread pool)."""

    def __init__(self, x, y):
        self.x, self.y = x, y
        self.threads = set()

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        self.threads.add(threading.current_thread().name)
        return self.x[i], self.y[i]


class RecordListSource(ItemSource):
    """__getitems__ returning a list of records (the PyTorch / HF convention)."""

    def __getitems__(self, indices):
        return [(self.x[i], self.y[i]) for i in indices]


class BatchSource(ItemSource):
    """__getitems__ returning stacked (x_batch, y_batch)."""

    def __getitems__(self, indices):
        return self.x[indices], self.y[indices]


def memmap_of(tmp_path, x, y):
    xm = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=x.dtype, shape=x.shape)
    xm[:] = x
    xm.flush()
    del xm
    return np.load(tmp_path / "x.npy", mmap_mode="r"), y


@pytest.mark.parametrize("kind", ["items", "record_list", "batch", "memmap"])
def test_every_source_trains_exactly_like_in_memory_arrays(kind, tmp_path):
    """Same sampling seed and noise seed: the same lots are drawn and the same
    update results, whichever way the records are read."""
    x, y = mnist_slice(300, features=60)
    reference = dp_model()
    reference.fit(x, y, lot_size=30, epochs=2, verbose=0, sampling_seed=4)
    if kind == "memmap":
        args = memmap_of(tmp_path, x, y)
    else:
        args = (
            {"items": ItemSource, "record_list": RecordListSource, "batch": BatchSource}[kind](
                x, y
            ),
            None,
        )
    dp = dp_model()
    dp.fit(*args, lot_size=30, epochs=2, verbose=0, sampling_seed=4)
    for a, b in zip(weights(reference), weights(dp)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert dp.lots_computed == dp.lots_applied == dp.privacy_ledger.count() == 20
    assert dp.privacy_ledger.to_dict() == reference.privacy_ledger.to_dict()


def test_records_of_a_lot_are_read_by_several_threads():
    x, y = mnist_slice(400, features=60)
    source = ItemSource(x, y)
    dp_model().fit(source, None, lot_size=200, epochs=1, verbose=0)
    assert len({t for t in source.threads if t.startswith("dpfl-read")}) >= 2


def test_a_dict_input_source_trains_a_multi_input_model():
    x, y = mnist_slice(120, features=60)

    class DictSource:
        def __len__(self):
            return len(y)

        def __getitem__(self, i):
            return {"a": x[i, :40], "b": x[i, 40:]}, y[i]

    a, b = keras.Input((40,), name="a"), keras.Input((20,), name="b")
    out = keras.layers.Dense(10)(keras.layers.Concatenate()([a, b]))
    dp = DPModel(keras.Model({"a": a, "b": b}, out))
    dp.compile(optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=loss())
    dp.fit(DictSource(), lot_size=30, epochs=1, verbose=0)
    assert dp.lots_computed == dp.privacy_ledger.count() == 4


def _mapped_bytes(path) -> int:
    """Bytes of `path` this process has mapped in (Rss of its mappings in
    /proc/self/smaps): the pages read through a memmap."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
                inside = len(head) >= 6 and head[-1] == str(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def test_a_memmap_is_read_lot_by_lot_never_whole(tmp_path):
    """A 655 MB on-disk array (rows of 64 KiB, so the kernel's 64 KiB
    fault-around adds little), 2 Poisson lots of ~50 rows trained: the bytes
    mapped in through the memmap are the rows of those lots and of the few
    prefetched ones, a few percent of the file -- not the file.  The same count
    after reading the array whole is the whole file, so the measure can fail."""
    n, d = 10_000, 16_384
    path = tmp_path / "big.npy"
    xm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, d))
    xm[::1000] = 1.0  # a sparse file: a few rows written, then the mapping dropped
    xm.flush()
    del xm
    x = np.load(path, mmap_mode="r")
    y = np.zeros(n, np.int64)
    assert isinstance(make_reader(x, y), IndexedReader)
    dp = DPModel(mlp(inputs=d, hidden=8))
    dp.compile(
        optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0),
        loss=loss(),
        steps_per_execution=1,
    )  # a callback after every lot
    assert _mapped_bytes(path) == 0
    dp.fit(x, y, lot_size=50, epochs=1, verbose=0, callbacks=[_StopAfter(2)])
    read = _mapped_bytes(path)
    size = n * d * 4
    assert dp.lots_computed == 2
    assert 0 < read < 0.1 * size, (read, size)
    np.asarray(x).sum()  # now read it whole: the count must see it
    assert _mapped_bytes(path) > 0.9 * size


class _StopAfter(keras.callbacks.Callback):
    def __init__(self, lots):
        super().__init__()
        self.lots = lots

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 >= self.lots:
            self.model.stop_training = True


def _reader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("dpfl-read")]


def _settled_reader_threads(at_most, seconds=10.0):
    """The reader threads still alive once they have had `seconds` to end."""
    import gc
    import time

    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        alive = _reader_threads()
        if len(alive) <= at_most or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def test_the_read_threads_of_a_source_end_with_its_fit():
    """Each fit over a source without __getitems__ reads records in a thread
    pool; the pool ends when the fit's input pipeline is released, so a long
    process (a notebook, a test worker) does not pile up threads."""
    x, y = mnist_slice(40, features=60)
    before = len(_settled_reader_threads(at_most=0))
    dp = dp_model()
    for _ in range(3):
        source = ItemSource(x.astype(np.float32), y)
        dp.fit(source, lot_size=20, epochs=1, verbose=0)
        assert any(name.startswith("dpfl-read") for name in source.threads)
    del source
    assert len(_settled_reader_threads(at_most=before)) <= before


def test_a_lot_pipeline_runs_without_the_autotuner():
    """The lot pipeline sets its own parallelism; tf.data's autotuner (on by default)
    had nothing to tune and made each iterator's destruction wait for its thread
    (12-16 s with the other core busy).  The one-device, multi-worker and
    user-level pipelines have it off."""
    x, y = mnist_slice(40, features=60)
    sampler = LotSampler(40, 10, seed=0)
    users = UserLotSampler(np.arange(40) // 4, 40, 3, seed=0)
    for data in (
        sampler.dataset(x, y, epochs=1),
        sampler.replica_shares(x, y, epochs=1, replicas=2),
        users.dataset(x, y, epochs=1),
    ):
        assert data.options().autotune.enabled is False
        assert sum(int(tf.reduce_sum(lot[2])) for lot in data) > 0  # it still reads lots


def test_a_dataset_built_inside_a_tf_function_reads_its_source():
    """A dataset built while tracing is thrown away after tracing: its reader
    must not depend on it to stay alive (only eagerly built ones do)."""
    x, y = mnist_slice(40, features=60)
    source = ItemSource(x.astype(np.float32), y)

    @tf.function
    def first_lot():
        lots = LotSampler(40, 20, seed=0).dataset(source, epochs=1)
        return lots.take(1).get_single_element()

    xb, yb, mask = first_lot()
    real = mask.numpy() > 0
    assert real.sum() > 0
    rows = [np.flatnonzero((x.astype(np.float32) == r).all(axis=1))[0] for r in xb.numpy()[real]]
    np.testing.assert_array_equal(yb.numpy()[real], y[rows])


# -- bad sources ----------------------------------------------------------------


class Broken(ItemSource):
    def __init__(self, x, y, bad, problem):
        super().__init__(x, y)
        self.bad, self.problem = bad, problem
        self.n = len(y)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            if self.problem == "raises":
                raise OSError("disk on fire")
            if self.problem == "shape":
                return self.x[i][:-1], self.y[i]
            if self.problem == "dtype":
                return self.x[i].astype(np.float64), self.y[i]
            if self.problem == "length":
                self.n -= 1
        return self.x[i], self.y[i]


BAD_RECORDS = [
    ("raises", r"reading record 7 raised OSError: disk on fire"),
    ("shape", r"record 7: x has shape \(59,\) dtype float32, but record 0 has shape \(60,\)"),
    ("dtype", r"record 7: x has shape \(60,\) dtype float64, but record 0 has .* float32"),
    ("length", r"the source changed length during training: it had 40 records, now 3\d"),
]


@pytest.mark.parametrize("problem,message", BAD_RECORDS)
def test_a_bad_record_names_its_index_and_its_lot_is_neither_applied_nor_counted(problem, message):
    x, y = mnist_slice(40, features=60)
    x = x.astype(np.float32)
    dp = dp_model()
    w0 = weights(dp)
    source = Broken(x, y, bad=7 if problem != "length" else 0, problem=problem)
    if problem == "length":
        source.bad = 7  # record 0 (read to learn the record's shape) is fine
    with pytest.raises(SourceError, match=message):
        # full batch: the first lot contains record 7, so nothing may be applied
        dp.fit(source, lot_size=40, epochs=3, verbose=0, sampling="full_batch")
    assert dp.lots_computed == dp.lots_applied == dp.privacy_ledger.count() == 0
    for a, b in zip(w0, weights(dp)):
        np.testing.assert_array_equal(a, b)


def _live_iterators() -> int:
    from tensorflow.python.data.ops.iterator_ops import OwnedIterator

    return sum(isinstance(o, OwnedIterator) for o in gc.get_objects())


@pytest.mark.parametrize("failure", ["bad record", "callback", "interrupt"])
def test_a_failed_fit_leaves_no_input_pipeline_to_the_garbage_collector(failure):
    """With the collector off, a failed fit (a bad record, a callback that
    raises, Ctrl-C) must not leave its tf.data iterator behind as garbage: it
    would be destroyed wherever the next collection runs (the deadlock below).
    Deterministic: without `end_failed_pipeline` the iterator survives."""

    class Raise(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise KeyboardInterrupt if failure == "interrupt" else RuntimeError("callback")

    x, y = mnist_slice(40, features=60)
    x = x.astype(np.float32)
    dp = dp_model()
    source = Broken(x, y, bad=7 if failure == "bad record" else -1, problem="raises")
    expected = {"bad record": SourceError, "callback": RuntimeError}.get(failure, KeyboardInterrupt)
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(expected):
            dp.fit(
                source,
                lot_size=40,
                epochs=2,
                verbose=0,
                sampling="full_batch",
                callbacks=[] if failure == "bad record" else [Raise()],
            )
        # the iterators only a collection frees (a live one, such as the model's,
        # ends by reference counting when it is replaced)
        garbage = _live_iterators()
        gc.collect()
        garbage -= _live_iterators()
    finally:
        gc.enable()
    assert garbage == 0, f"{garbage} tf.data iterators left to the garbage collector"


def test_failed_fits_one_after_another_end_their_pipelines_without_a_deadlock():
    """A failed read left its tf.data iterator (reads in flight) to the garbage
    collector, which could destroy it inside another reader thread's
    `ThreadPoolExecutor.submit`, holding the lock those reads waited for: the
    process hung in `get_next` (in 2 of 2 tries, within the first 21 failed fits
    of this loop).  The fits run in a child process, bounded by a timeout."""
    import subprocess
    import sys

    code = (
        "import faulthandler, sys\n"
        "faulthandler.dump_traceback_later(150, exit=True)\n"
        "from tests.keras import test_sources as t\n"
        "for _ in range(12):\n"
        "    for problem, message in t.BAD_RECORDS:\n"
        "        t.test_a_bad_record_names_its_index_and_its_lot_is_neither_applied_nor_counted(\n"
        "            problem, message)\n"
        "print('48 failed fits')\n"
    )
    root = __file__.rsplit("/tests/", 1)[0]
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0 and "48 failed fits" in run.stdout, run.stderr[-4000:]


def test_lots_before_a_bad_record_are_counted_and_the_bad_lot_is_not():
    """Poisson lots over 200 records, record 150 raises: the lots before the
    first lot holding it are applied and recorded; that lot is not."""
    x, y = mnist_slice(200, features=60)
    lots = list(LotSampler(200, 20, seed=9).lots(10))
    first_bad = next(t for t, idx in enumerate(lots) if 150 in idx)
    dp = dp_model()
    with pytest.raises(SourceError, match="record 150"):
        dp.fit(
            Broken(x, y, bad=150, problem="raises"),
            lot_size=20,
            epochs=1,
            verbose=0,
            sampling_seed=9,
        )
    assert dp.lots_computed == dp.lots_applied == dp.privacy_ledger.count() == first_bad


def test_sources_without_random_access_and_empty_sources_are_refused():
    x, y = mnist_slice(40, features=60)
    dp = dp_model()
    with pytest.raises(TypeError, match="a tf.data.Dataset only streams"):
        dp.fit(tf.data.Dataset.from_tensor_slices((x, y)), lot_size=10)
    with pytest.raises(TypeError, match="a generator or iterator only streams"):
        dp.fit(((a, b) for a, b in zip(x, y)), lot_size=10)

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return x[i * 10 : (i + 1) * 10], y[i * 10 : (i + 1) * 10]

    with pytest.raises(TypeError, match="PyDataset .* only streams"):
        dp.fit(Batches(), lot_size=10)
    with pytest.raises(ValueError, match="the training source is empty"):
        dp.fit(ItemSource(x[:0], y[:0]), lot_size=1)
    with pytest.raises(ValueError, match="lot_size must be <= the number of examples"):
        dp.fit(ItemSource(x, y), lot_size=41)
    with pytest.raises(SourceError, match="record 0: expected a pair"):
        dp.fit(
            type("Bare", (), {"__len__": lambda s: 3, "__getitem__": lambda s, i: x[i]})(),
            lot_size=1,
        )
    assert dp.lots_computed == 0


def test_a_seeded_fit_that_continues_a_model_draws_new_lots():
    """Lot numbers continue from the model's lots computed: a second seeded fit
    (or a resume) does not replay the first fit's lots, which the accountant
    would count as fresh ones."""
    x, y = mnist_slice(200, features=60)
    dp = dp_model()
    first = list(LotSampler(200, 20, seed=3).lots(10))
    dp.fit(x, y, lot_size=20, epochs=1, verbose=0, sampling_seed=3)
    assert dp.sampler.first_lot == 0
    dp.fit(x, y, lot_size=20, epochs=1, verbose=0, sampling_seed=3)
    assert dp.sampler.first_lot == 10
    second = list(dp.sampler.lots(10))
    assert all(not np.array_equal(a, b) for a, b in zip(first, second))
    np.testing.assert_array_equal(
        second[0], list(LotSampler(200, 20, seed=3, first_lot=10).lots(1))[0]
    )


def test_poisson_threshold_rate_is_at_most_q_and_lots_have_rate_q():
    """Record i joins when its full-range 32-bit draw is below T = floor(q 2^32)
    (rate T / 2^32 <= q); the lots drawn have the rate q (4-sigma bounds, so a
    wrong threshold -- e.g. q 2^31 -- fails)."""
    sampler = LotSampler(100_000, 1_000, seed=1)
    assert sampler.inclusion_threshold == int(0.01 * 2**32)
    assert 0 < 0.01 - sampler.inclusion_threshold / 2**32 < 2.4e-10
    sizes = np.array([len(i) for i in sampler.lots(60)])
    # lot size ~ Binomial(100000, 0.01): sd 31.5, so the mean of 60 has sd 4.1
    assert abs(sizes.mean() - 1000) < 16.3, sizes.mean()
    big = LotSampler(100_000, 30_000, seed=2)
    frac = np.mean([len(i) for i in big.lots(20)]) / 100_000
    assert abs(frac - 0.3) < 0.0013, frac  # sd of the mean fraction: 3.2e-4


def test_a_record_with_other_dict_keys_is_refused_not_misassigned():
    """Same number of inputs, other names: the record's values would land in the
    wrong inputs if only the count were compared."""
    x, y = mnist_slice(40, features=60)

    class Renamed:
        def __len__(self):
            return len(y)

        def __getitem__(self, i):
            keys = ("a", "b") if i != 5 else ("a", "c")
            return {keys[0]: x[i, :40], keys[1]: x[i, 40:]}, y[i]

    a, b = keras.Input((40,), name="a"), keras.Input((20,), name="b")
    dp = DPModel(
        keras.Model({"a": a, "b": b}, keras.layers.Dense(10)(keras.layers.Concatenate()([a, b])))
    )
    dp.compile(optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0), loss=loss())
    with pytest.raises(SourceError, match="record 5: x has another structure than record 0"):
        dp.fit(Renamed(), lot_size=40, epochs=1, verbose=0, sampling="full_batch")
    assert dp.lots_computed == dp.privacy_ledger.count() == 0


def test_a_preprocess_may_branch_on_tensors_while_our_lot_functions_skip_autograph():
    """The lot datasets' own functions are not converted by AutoGraph (`_no_autograph`);
    a user's `preprocess` called inside them still is, so its Python ``if`` on a tensor
    works."""
    from dpfl_tf.keras.sampling import _no_autograph

    def sign_of(t):  # a Python `if` on a tensor: traceable only through AutoGraph
        if t > 2:
            return t
        return -t

    numbers = tf.data.Dataset.range(5)
    with pytest.raises(TypeError, match="bool"):  # not converted: `if` on a symbolic tensor
        numbers.map(_no_autograph(sign_of))
    converted = numbers.map(_no_autograph(sign_of, preprocess=sign_of))
    assert list(converted.as_numpy_iterator()) == [0, -1, -2, 3, 4]

    x = np.arange(24, dtype=np.float32).reshape(12, 2)
    y = np.zeros(12, np.int64)

    def negate_large(xb):
        if tf.reduce_max(xb) > 12.0:
            return -xb
        return xb

    sampler = LotSampler(12, 4, "in_order")  # lots 0-3, 4-7, 8-11: maxima 7, 15, 23
    lots = list(sampler.lots(3))
    dataset = sampler.dataset(x, y, epochs=1, preprocess=negate_large)
    for idx, (xb, _, mask) in zip(lots, dataset):
        real = x[idx]
        want = -real if real.max() > 12.0 else real
        np.testing.assert_array_equal(xb.numpy()[mask.numpy() > 0], want)
    assert {bool(x[idx].max() > 12.0) for idx in lots} == {True, False}  # both branches ran

    def signs(elements):  # each element's real rows: negated iff their largest is > 12
        seen = set()
        for xb, _, mask, *_ in elements:
            real = xb.numpy()[mask.numpy() > 0]
            large = bool(np.abs(real).max() > 12.0)
            assert (real <= 0).all() if large else (real >= 0).all()
            seen.add(large)
        return seen

    # the other two pipelines that call a preprocess: replicas' shares, user-level lots
    shares = sampler.replica_shares(x, y, epochs=1, replicas=2, preprocess=negate_large)
    assert signs(shares) == {True, False}  # shares [0, 1], [2, 3], ..., [10, 11]
    users = UserLotSampler(np.arange(12) // 2, 12, 3, seed=0)
    assert signs(users.dataset(x, y, epochs=1, preprocess=negate_large))


def test_lots_of_fixed_size_have_a_static_shape_and_poisson_lots_do_not():
    """`LotSampler.dataset`: a lot of fixed size (fixed_size, shuffle, full_batch)
    is padded to a size known when the training step is traced (under XLA a lot
    that fits one physical batch is then compiled as one, not as a `tf.cond`
    between one batch and the loop); a Poisson lot's size is known only at run
    time.  The rows are the same either way."""
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    y = np.arange(20)
    for sampling, lot, static in (
        ("fixed_size", 5, 64),
        ("shuffle", 5, 64),
        ("full_batch", 20, 64),
        ("poisson", 5, None),
    ):
        sampler = LotSampler(20, lot, sampling, seed=1)
        data = sampler.dataset(x, y, epochs=1, pad_to=64)
        xs, ys, mask = data.element_spec
        assert xs.shape.as_list() == [static, 2] and ys.shape[0] == mask.shape[0] == static
        for (xb, yb, mb), idx in zip(data, sampler.lots(sampler.lots_per_epoch)):
            assert xb.shape[0] == 64 and int(tf.reduce_sum(mb)) == len(idx)
            np.testing.assert_array_equal(xb[: len(idx)].numpy(), x[idx])
            np.testing.assert_array_equal(yb[: len(idx)].numpy(), y[idx])
            assert not xb[len(idx) :].numpy().any()
    fixed = LotSampler(20, 5, "fixed_size", seed=1).dataset(x, y, epochs=1)
    assert fixed.element_spec[2].shape[0] == 5  # pad_to=1: the lot's own size

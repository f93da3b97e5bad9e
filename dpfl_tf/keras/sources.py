"""Training data for DP-SGD: anything whose records can be read by index.

DP-SGD's privacy analysis assumes the lots its sampler draws (Poisson: each
record joins a lot independently with probability q), so the data must allow
*random access*: the sampler picks indices, the reader fetches those records.
Three kinds of data are read:

* in-memory arrays (numpy, tensors; dicts / tuples of them for several
  inputs): gathered in the graph, no Python per lot (`ArrayReader`);
* ``np.memmap`` arrays and `dpfl_tf.data.NpyRows` (a ``.npy`` file read row
  by row, not mapped: nothing of it stays resident in the process): only the
  rows of each lot are read from disk, never the whole array (`IndexedReader`);
* any object with ``__len__`` and ``__getitem__(i) -> (x, y)`` (x a tensor,
  tuple or dict): ``tfds.data_source(...)``, Hugging Face style datasets,
  `dpfl_tf.data.ImageFolderSource`, your own class (`IndexedReader`).  An
  optional ``__getitems__(indices)`` is used for batched reads; it returns a
  *list* of ``(x, y)`` records (the PyTorch / Hugging Face convention), or a
  *tuple* ``(x_batch, y_batch)`` of arrays stacked along a first axis.  Without
  it the records of a lot are read by a thread pool.

Indexed reads run in `tf.data` worker threads (`tf.numpy_function`), lots are
read in parallel and prefetched while the current lot trains, so memory is
O(lot + prefetch), not O(N).  Every record is checked against the first one
(structure, shape, dtype) and the length of the source against N; a bad record
raises `SourceError` naming the index, and the lot it belongs to is neither
applied nor counted (its read fails before the training step runs).

A `tf.data.Dataset`, a generator or a `keras.utils.PyDataset` has no random
access: it is refused, with what to pass instead.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import weakref
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["SourceError", "ArrayReader", "IndexedReader", "make_reader"]


class SourceError(ValueError):
    """A record of the training source could not be read or is malformed."""


_NO_RANDOM_ACCESS = (
    "DPModel.fit needs random access to the training records, so that its sampler "
    "can draw the lots the privacy analysis assumes (Poisson: each record joins a lot "
    "independently); {what} only streams records in its own order. Pass in-memory "
    "arrays fit(x, y, ...), an np.memmap, or a source with __len__ and "
    "__getitem__(i) -> (x, y) (e.g. tfds.data_source(...), a Hugging Face dataset "
    "wrapped to return (x, y), dpfl_tf.data.ImageFolderSource) as fit(source, ...)"
)


def make_reader(x, y=None):
    """The reader for `fit`'s data: arrays (x, y), or a random-access source x."""
    if isinstance(x, tf.data.Dataset):
        raise TypeError(_NO_RANDOM_ACCESS.format(what="a tf.data.Dataset"))
    if _is_pydataset(x):
        raise TypeError(
            _NO_RANDOM_ACCESS.format(what="a keras.utils.PyDataset (a sequence of batches)")
        )
    if y is None:
        if hasattr(x, "__next__") or (hasattr(x, "__iter__") and not hasattr(x, "__getitem__")):
            raise TypeError(_NO_RANDOM_ACCESS.format(what="a generator or iterator"))
        if hasattr(x, "__len__") and hasattr(x, "__getitem__") and not _is_array(x):
            return IndexedReader.from_source(x)
        raise TypeError(
            "DPModel.fit needs the training data as arrays fit(x, y, ...) or as a "
            "random-access source fit(source, ...) with __len__ and __getitem__(i) -> "
            f"(x, y); got x of type {type(x).__name__} and no y"
        )
    if isinstance(x, list):  # a multi-input model's inputs given as a list: a
        x = tuple(x)  # structure tf.data keeps (a list would be stacked)
    leaves = tf.nest.flatten(x) + [y]
    n = _num_examples(x, y)
    if any(
        isinstance(leaf, np.memmap) or getattr(leaf, "read_on_demand", False) for leaf in leaves
    ):  # memmaps, `dpfl_tf.data.NpyRows`: read lot by lot
        return IndexedReader.from_arrays(x, y, n)
    return ArrayReader(x, y, n)


def _is_pydataset(x) -> bool:
    try:
        import keras

        return isinstance(x, keras.utils.PyDataset)
    except (ImportError, AttributeError):
        return False


def _is_array(x) -> bool:
    return isinstance(x, (np.ndarray, tf.Tensor)) or hasattr(x, "__array__")


def _num_examples(x, y) -> int:
    ys = np.shape(y)
    if len(ys) == 0:
        raise ValueError(f"y must have one label per example, got shape {ys}")
    n = int(ys[0])
    if n == 0:
        raise ValueError("the training data is empty (0 examples)")
    for leaf in tf.nest.flatten(x):
        if np.shape(leaf)[:1] != (n,):
            raise ValueError(
                f"x and y disagree on the number of examples: x has shape "
                f"{np.shape(leaf)}, y has {n} labels"
            )
    return n


def _check_numeric(name: str, dtype) -> None:
    if isinstance(dtype, tf.DType):
        numeric = dtype.is_floating or dtype.is_integer or dtype.is_bool
    else:
        numeric = np.dtype(dtype).kind in "biuf"
    if not numeric:
        raise ValueError(f"{name} must be numeric (float, int or bool), got dtype {dtype}")


class ArrayReader:
    """In-memory arrays: a lot is a `tf.gather` of its indices (in the graph)."""

    def __init__(self, x, y, n: int):
        self.size = n
        for name, leaf in [("y", y)] + [("x", t) for t in tf.nest.flatten(x)]:
            dtype = getattr(leaf, "dtype", None)
            _check_numeric(name, np.asarray(leaf).dtype if dtype is None else dtype)
        self._x = tf.nest.map_structure(tf.convert_to_tensor, x)
        self._y = tf.convert_to_tensor(y)

    def element_shapes(self):
        """([per-example shape of each leaf of x], per-example shape of y)."""
        return [tuple(t.shape[1:]) for t in tf.nest.flatten(self._x)], tuple(self._y.shape[1:])

    def example_bytes(self) -> int:
        """Bytes of one record (x and y)."""
        return sum(
            int(np.prod(t.shape[1:], dtype=np.int64)) * t.dtype.size
            for t in tf.nest.flatten(self._x) + [self._y]
        )

    def read(self, idx: tf.Tensor, *, weak: bool = False):  # tensors: no Python to hold
        return tf.nest.map_structure(lambda t: tf.gather(t, idx), self._x), tf.gather(self._y, idx)

    def raise_pending(self) -> None:
        """Nothing is read outside the graph: no source error to report."""


class IndexedReader:
    """Records read by index in Python (memmaps, random-access sources),
    inside `tf.data` worker threads; see the module docstring."""

    def __init__(self, read_records, size: int, length_fn, x_spec, y_spec):
        self.size = size
        self._read_records = read_records  # np indices -> (x leaves list, y) stacked
        self._length_fn = length_fn
        self._x_spec = x_spec  # structure of (shape, dtype) per leaf
        self._y_spec = y_spec
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    # -- construction ---------------------------------------------------------
    @classmethod
    def from_arrays(cls, x, y, n: int) -> "IndexedReader":
        """Arrays of which some are `np.memmap`: rows are read lot by lot."""
        leaves = tf.nest.flatten(x)
        for name, leaf in [("y", y)] + [("x", t) for t in leaves]:
            _check_numeric(name, np.asarray(leaf[:0]).dtype)
        x_spec = tf.nest.pack_sequence_as(
            x, [_Spec(tuple(np.shape(t)[1:]), np.asarray(t[:0]).dtype) for t in leaves]
        )
        y_spec = _Spec(tuple(np.shape(y)[1:]), np.asarray(y[:0]).dtype)

        for leaf in leaves + [y]:
            _random_access(leaf)

        def read_records(idx: np.ndarray):
            # sorted indices: a memmap reads just these rows' pages
            return [np.asarray(t[idx]) for t in leaves], np.asarray(y[idx])

        return cls(read_records, n, lambda: n, x_spec, y_spec)

    @classmethod
    def from_source(cls, source) -> "IndexedReader":
        """An object with __len__ and __getitem__(i) -> (x, y)."""
        n = len(source)
        if n == 0:
            raise ValueError("the training source is empty (len(source) == 0)")
        first = _as_record(_call(source.__getitem__, 0), 0)
        x_spec = tf.nest.map_structure(lambda a: _Spec(a.shape, a.dtype), first[0])
        y_spec = _Spec(first[1].shape, first[1].dtype)
        for name, spec in [("y", y_spec)] + [("x", s) for s in tf.nest.flatten(x_spec)]:
            _check_numeric(name, spec.dtype)
        getitems = getattr(source, "__getitems__", None)
        workers = min(16, 4 * (os.cpu_count() or 1))
        pool = (
            None
            if getitems is not None
            else concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="dpfl-read")
        )
        x_leaves_spec = tf.nest.flatten(x_spec)

        def read_records(idx: np.ndarray):
            ints = [int(i) for i in idx]
            if getitems is not None:
                got = _call(getitems, ints)
                if isinstance(got, tuple):  # (x_batch, y_batch); a list is records
                    if len(got) != 2:
                        raise SourceError(
                            f"__getitems__ returned a tuple of {len(got)} "
                            "items; expected (x_batch, y_batch)"
                        )
                    xs = tf.nest.flatten(got[0])
                    return _check_batch(xs, np.asarray(got[1]), ints, x_leaves_spec, y_spec)
                records = [_as_record(r, i) for r, i in zip(_as_list(got, ints), ints)]
            else:
                records = list(
                    pool.map(lambda i: _as_record(_call(source.__getitem__, i), i), ints)
                )
            return _stack(records, ints, x_spec, y_spec)

        reader = cls(read_records, n, lambda: len(source), x_spec, y_spec)
        if pool is not None:
            # the pool's threads end with the reader (a long process builds many)
            weakref.finalize(reader, pool.shutdown, wait=False, cancel_futures=True)
        return reader

    # -- reading ----------------------------------------------------------------
    def element_shapes(self):
        """([per-example shape of each leaf of x], per-example shape of y)."""
        return [s.shape for s in tf.nest.flatten(self._x_spec)], self._y_spec.shape

    def example_bytes(self) -> int:
        """Bytes of one record (x and y)."""
        return sum(
            int(np.prod(s.shape, dtype=np.int64)) * s.dtype.itemsize
            for s in tf.nest.flatten(self._x_spec) + [self._y_spec]
        )

    def _check_length(self) -> None:
        length = self._length_fn()
        if length != self.size:
            raise SourceError(
                f"the source changed length during training: it had "
                f"{self.size} records, now {length}"
            )

    def _read_numpy(self, idx: np.ndarray):
        try:
            self._check_length()
            xs, ys = self._read_records(np.asarray(idx, np.int64))
            self._check_length()  # also while this lot was read: the lot is not used
            return [*xs, ys]
        except BaseException as e:
            with self._lock:
                if self.error is None:
                    self.error = (
                        e
                        if isinstance(e, SourceError)
                        else SourceError(f"reading a lot failed: {type(e).__name__}: {e}")
                    )
                    if self.error is not e:
                        self.error.__cause__ = e
            raise

    def read(self, idx: tf.Tensor, *, weak: bool = False):
        """The records `idx` (read in a `tf.numpy_function`).  TensorFlow keeps
        every numpy_function's callable for the life of the process (in its
        global graph); with `weak` it holds this reader weakly, so the reader, its
        source and its thread pool end with the dataset that holds them
        (`LotSampler.dataset` and `replica_shares` built eagerly keep their
        reader on the dataset)."""
        leaves = tf.nest.flatten(self._x_spec) + [self._y_spec]
        read_numpy = self._read_numpy
        if weak:
            reader = weakref.ref(self)

            def read_numpy(idx):
                alive = reader()
                if alive is None:
                    raise SourceError(
                        "the dataset's reader was garbage-collected: keep the dataset of "
                        "LotSampler.dataset() referenced while it is read"
                    )
                return alive._read_numpy(idx)

        out = tf.numpy_function(
            read_numpy, [idx], [tf.as_dtype(s.dtype) for s in leaves], stateful=False
        )
        for t, s in zip(out, leaves):
            t.set_shape([None, *s.shape])
        return tf.nest.pack_sequence_as(self._x_spec, out[:-1]), out[-1]

    def raise_pending(self) -> None:
        """Re-raises, as itself, the first source error the input pipeline hit."""
        if self.error is not None:
            error, self.error = self.error, None
            raise error


def end_failed_pipeline(error: BaseException) -> None:
    """Ends, now and in this thread, the input pipelines a failed read left
    behind.  The error's traceback holds the frames that iterated them (a
    `tf.data` iterator with reads in flight); left to the garbage collector,
    the iterator is destroyed in whichever thread next allocates -- possibly a
    `tf.data` reader thread inside `ThreadPoolExecutor.submit`, holding the lock
    that the iterator's own reads in flight wait for: a deadlock.  Clearing the
    finished frames of the traceback (and of the errors it chains) and collecting
    here ends them holding no lock.

    What it costs, on the error path only: the finished frames below `fit`
    (Keras's and TensorFlow's) lose their locals (``pdb.pm()``, ``%debug`` and
    ``--showlocals`` show none; the traceback keeps its lines, the caller's
    frames keep theirs), and the error reaches the caller once the reads in
    flight have finished."""
    import gc

    # the frames of the traceback and their callers: Keras filters its own frames
    # out of the traceback, but a frame left in it (a callback's) still links to
    # them through f_back.  Running frames (this one and its callers) cannot be
    # cleared and keep their locals.
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            while frame is not None and id(frame) not in seen:
                seen.add(id(frame))
                try:
                    frame.clear()
                except RuntimeError:  # still running
                    pass
                frame = frame.f_back
            tb = tb.tb_next
        error = error.__context__
    gc.collect()


def _random_access(array) -> None:
    """Tells the kernel a memmap is read at random (MADV_RANDOM): no read-ahead
    around each row, so a lot reads its rows' pages, not 16x more (which
    thrashes once the file does not fit in memory)."""
    import mmap

    mapping = getattr(array, "_mmap", None)
    if mapping is not None and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_RANDOM"):
        try:
            mapping.madvise(mmap.MADV_RANDOM)
        except (OSError, ValueError):
            pass  # advice only


class _Spec:
    """Shape and dtype of one leaf of a record (without the example axis)."""

    def __init__(self, shape, dtype):
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)

    def __repr__(self):
        return f"shape {self.shape} dtype {self.dtype}"


def _call(fn, arg):
    try:
        return fn(arg)
    except SourceError:
        raise
    except Exception as e:
        where = f"record {arg}" if isinstance(arg, int) else f"a lot of {len(arg)} records"
        raise SourceError(f"reading {where} raised {type(e).__name__}: {e}") from e


def _as_list(got, ints):
    got = list(got)
    if len(got) != len(ints):
        raise SourceError(f"__getitems__ returned {len(got)} records for {len(ints)} indices")
    return got


def _as_record(record, index: int):
    if isinstance(record, dict) and "x" in record and "y" in record:
        record = (record["x"], record["y"])
    if not (isinstance(record, (tuple, list)) and len(record) == 2):
        raise SourceError(f"record {index}: expected a pair (x, y), got {type(record).__name__}")
    x, y = record
    return tf.nest.map_structure(np.asarray, x), np.asarray(y)


def _check_leaf(value: np.ndarray, spec: _Spec, what: str, index) -> None:
    if tuple(value.shape) != spec.shape or value.dtype != spec.dtype:
        raise SourceError(
            f"record {index}: {what} has shape {tuple(value.shape)} dtype "
            f"{value.dtype}, but record 0 has {spec}"
        )


def _stack(records, ints, x_spec, y_spec):
    leaves_spec = tf.nest.flatten(x_spec)
    columns: list[list[Any]] = [[] for _ in leaves_spec]
    ys = []
    for (x, y), i in zip(records, ints):
        try:  # same nesting and the same dict keys as record 0
            tf.nest.assert_same_structure(x_spec, x)
        except (ValueError, TypeError):
            raise SourceError(f"record {i}: x has another structure than record 0") from None
        leaves = tf.nest.flatten(x)
        for col, leaf, spec in zip(columns, leaves, leaves_spec):
            _check_leaf(leaf, spec, "x", i)
            col.append(leaf)
        _check_leaf(y, y_spec, "y", i)
        ys.append(y)
    shape_of = lambda s: (0, *s.shape)  # noqa: E731
    xs = [
        np.stack(c) if c else np.zeros(shape_of(s), s.dtype) for c, s in zip(columns, leaves_spec)
    ]
    return xs, (np.stack(ys) if ys else np.zeros(shape_of(y_spec), y_spec.dtype))


def _check_batch(xs, y, ints, leaves_spec, y_spec):
    n = len(ints)
    if len(xs) != len(leaves_spec):
        raise SourceError(
            f"records {ints[:8]}: __getitems__ returned x with another structure than record 0"
        )
    for leaf, spec in zip(xs + [y], leaves_spec + [y_spec]):
        leaf = np.asarray(leaf)
        if leaf.shape != (n, *spec.shape) or leaf.dtype != spec.dtype:
            bad = next((i for i, row in zip(ints, leaf) if np.shape(row) != spec.shape), ints[0])
            raise SourceError(
                f"record {bad}: __getitems__ returned a batch of shape "
                f"{leaf.shape} dtype {leaf.dtype} for {n} records, expected "
                f"({n}, {', '.join(map(str, spec.shape))}) dtype {spec.dtype}"
            )
    return [np.asarray(a) for a in xs], np.asarray(y)

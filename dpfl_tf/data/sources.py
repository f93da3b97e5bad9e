"""Random-access sources of labelled records, read by index on demand.

A source is what ``DPModel.fit(source, lot_size=...)`` reads (see
`dpfl_tf.keras.sources`): ``len(source)``, ``source[i] -> (x, y)`` and
``source.__getitems__(indices) -> (x_batch, y_batch)`` (stacked arrays).
DP-SGD's sampler draws the indices of a lot and the source reads only those
records, so the records in memory at any time are the lots being read and
prefetched, O(lot) -- not the N records of the dataset (Opacus's
`DPDataLoader` over a map-style dataset, ``tfds.data_source``, grain).

The sources here add what the recipes need without reading any record:

* ``labels``: every label, in memory (int64, one per record): splits and
  stratified subsets are drawn from the labels alone;
* ``subset(indices)``: a view on some records (nothing is read or copied
  but the index);
* ``to_arrays()``: the records decoded into memory -- for small subsets only
  (an evaluation slice, public data), never for the private training set.

Kinds: `ArraySource` (in-memory arrays, e.g. the canonical CIFAR pickles) and
`dpfl_tf.data.ImageFolderSource` (image files decoded on demand).
`SourceDataset` holds the train and test sources of one dataset, as
`dpfl_tf.data.Dataset` holds its arrays.

Unit of privacy: one record (index) is one example; a source never merges,
drops or reorders records, and ``subset`` keeps the order of its indices.
"""

from __future__ import annotations

import copy
import dataclasses
import operator

import numpy as np

from dpfl_tf._validation import check_count
from dpfl_tf.data import DataSource, check_classes, check_labels

__all__ = ["ArraySource", "IndexedSource", "SourceDataset"]


class IndexedSource:
    """Base of the sources here: index checks, labels, views, decoding to arrays.

    Subclasses read *rows* of their underlying storage: ``_read_record(pos,
    row)`` one record, ``_read_batch(positions, rows)`` several, stacked
    (default: one by one); ``pos`` is the index in this source (for error
    messages), ``row`` the index in the storage (a `subset` maps positions to
    rows).  They define ``element_shape`` and ``dtype`` of ``x``.
    """

    def __init__(self, labels):
        labels = np.asarray(labels)
        if labels.ndim != 1 or labels.dtype.kind not in "iu":
            raise ValueError(
                f"labels must be 1-D integer class indices, got dtype "
                f"{labels.dtype} shape {labels.shape}"
            )
        self._labels = labels.astype(np.int64)
        self._labels.flags.writeable = False
        self._rows = None  # positions -> storage rows (None: the identity)

    # -- the source protocol ---------------------------------------------------
    def __len__(self) -> int:
        return len(self._labels)

    def __getitem__(self, index):
        """Record `index` as ``(x, label)``, label a Python int."""
        pos = self._position(index)
        return self._read_record(pos, self._row(pos)), int(self._labels[pos])

    def __getitems__(self, indices):
        """Records `indices` as ``(x_batch, y_batch)``: arrays stacked along a
        first axis, in the order of `indices` (repeats allowed)."""
        positions = self._positions(indices)
        rows = positions if self._rows is None else self._rows[positions]
        x = self._read_batch(positions, rows)
        return x, self._labels[positions]

    # -- without reading records ------------------------------------------------
    @property
    def labels(self) -> np.ndarray:
        """Every record's label (int64, read-only), without reading any record."""
        return self._labels

    @property
    def element_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def dtype(self) -> np.dtype:
        raise NotImplementedError

    def subset(self, indices) -> "IndexedSource":
        """A view on records `indices` of this source, in that order (nothing is read)."""
        positions = self._positions(indices)
        view = copy.copy(self)
        view._rows = positions if self._rows is None else self._rows[positions]
        view._labels = self._labels[positions]
        view._labels.flags.writeable = False
        return view

    def to_arrays(self, batch_size: int = 1024) -> tuple[np.ndarray, np.ndarray]:
        """All records of this source in memory, ``(x (N, ...), y (N,))``.

        Memory O(N): for small subsets (evaluation slices, public data)."""
        batch_size = check_count("batch_size", batch_size, minimum=1)
        n = len(self)
        x = np.empty((n, *self.element_shape), self.dtype)
        for lo in range(0, n, batch_size):
            x[lo : lo + batch_size] = self.__getitems__(np.arange(lo, min(n, lo + batch_size)))[0]
        return x, self._labels.copy()

    # -- helpers ----------------------------------------------------------------
    def _row(self, pos: int) -> int:
        return pos if self._rows is None else int(self._rows[pos])

    def _position(self, index) -> int:
        try:
            i = operator.index(index)
        except TypeError:
            raise TypeError(
                f"a source is indexed by one integer, got "
                f"{type(index).__name__}; use __getitems__(indices) or "
                "subset(indices) for several records"
            ) from None
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} is out of range for a source of {n} records")
        return i + n if i < 0 else i

    def _positions(self, indices) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.ndim != 1 or (idx.size and idx.dtype.kind not in "iu"):
            raise TypeError(
                f"indices must be a 1-D sequence of integers, got dtype "
                f"{idx.dtype} shape {idx.shape}"
            )
        idx = idx.astype(np.int64)
        n = len(self)
        bad = idx[(idx < -n) | (idx >= n)]
        if bad.size:
            raise IndexError(f"index {int(bad[0])} is out of range for a source of {n} records")
        return np.where(idx < 0, idx + n, idx)

    def _read_record(self, pos: int, row: int) -> np.ndarray:
        raise NotImplementedError

    def _read_batch(self, positions: np.ndarray, rows: np.ndarray) -> np.ndarray:
        out = np.empty((len(rows), *self.element_shape), self.dtype)
        for k, (pos, row) in enumerate(zip(positions, rows)):
            out[k] = self._read_record(int(pos), int(row))
        return out


class ArraySource(IndexedSource):
    """In-memory (or memory-mapped) arrays ``x (N, ...)``, ``y (N,)`` as a source.

    The records already are in memory; this gives them the interface of the
    other sources (``labels``, ``subset``) so that code can take either."""

    def __init__(self, x, y):
        super().__init__(y)
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            x = np.asarray(x)
        if len(x) != len(self._labels):
            raise ValueError(f"x has {len(x)} records but y has {len(self._labels)} labels")
        self._x = x

    @property
    def element_shape(self) -> tuple[int, ...]:
        return tuple(self._x.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self._x.dtype)

    def _read_record(self, pos, row):
        return np.asarray(self._x[row])

    def _read_batch(self, positions, rows):
        return np.asarray(self._x[rows])

    def __repr__(self) -> str:
        return f"ArraySource({len(self)} records of shape {self.element_shape} {self.dtype})"


@dataclasses.dataclass(frozen=True, eq=False)
class SourceDataset:
    """A train/test split of one labelled dataset as sources (records read on demand).

    The counterpart of `dpfl_tf.data.Dataset`, whose fields it shares but for
    ``train`` / ``test`` (sources) in place of the four arrays; ``y_train`` /
    ``y_test`` are the sources' labels (in memory)."""

    train: IndexedSource
    test: IndexedSource
    num_classes: int
    class_names: tuple[str, ...]
    name: str
    source: DataSource

    def __post_init__(self):
        check_classes(self.num_classes, self.class_names)
        for split in ("train", "test"):
            check_labels(f"{split} labels", getattr(self, split).labels, self.num_classes)

    @property
    def y_train(self) -> np.ndarray:
        return self.train.labels

    @property
    def y_test(self) -> np.ndarray:
        return self.test.labels

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train.element_shape)

    def __repr__(self) -> str:
        return (
            f"SourceDataset(name={self.name!r}, train={self.train!r}, test={self.test!r}, "
            f"num_classes={self.num_classes}, source={str(self.source)!r})"
        )

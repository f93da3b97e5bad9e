"""An array in a ``.npy`` file, read and written row by row through the file.

`NpyRows` behaves like a read-only array for what training needs (``len``,
``shape``, ``dtype``, ``x[i]``, ``x[a:b]``, ``x[indices]``) but keeps nothing
of the file in the process: each access reads its rows with ``os.pread``
(contiguous runs of sorted indices in one call each).  The kernel's page cache
holds the file, outside the process's resident memory, and gives it back under
pressure; a memory map of the same file instead counts every page it has
touched in the process (a 6.2 GB feature file read once an epoch ends up
resident whole).  `DPModel.fit` reads its lots from one (`IndexedReader`), the
recipes keep their cached features in them, evaluation reads slices.

`NpyRows.create` makes a file of a given shape (its header written, its room
reserved), which ``write(start, rows)`` fills chunk by chunk: a large array is
computed into the file without ever being whole in memory.
"""

from __future__ import annotations

import os
import threading

import numpy as np

__all__ = ["NpyRows"]


class NpyRows:
    """The rows of a C-ordered ``.npy`` file (`np.save` / `np.lib.format`)."""

    #: `dpfl_tf.keras.sources` reads objects with this flag by index, lot by lot
    read_on_demand = True

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(f)
            self.offset = f.tell()
        if fortran:
            raise ValueError(f"{self.path}: a Fortran-ordered array cannot be read by rows")
        if dtype.hasobject:
            raise ValueError(f"{self.path}: an array of Python objects cannot be read by rows")
        if not shape:
            raise ValueError(f"{self.path}: a 0-d array has no rows")
        self.shape, self.dtype = tuple(int(d) for d in shape), np.dtype(dtype)
        self.row_shape = self.shape[1:]
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        expected = self.offset + self.shape[0] * self.row_bytes
        if os.path.getsize(self.path) < expected:
            raise ValueError(
                f"{self.path}: the file is shorter ({os.path.getsize(self.path)} "
                f"bytes) than its header says ({expected})"
            )
        self._fd = None
        self._lock = threading.Lock()

    @classmethod
    def create(cls, path: str | os.PathLike, shape, dtype=np.float32) -> "NpyRows":
        """A new file of `shape` (zeros until written), its room reserved now: a
        full disk is an `OSError` here, not later."""
        path = os.fspath(path)
        header = {
            "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
            "fortran_order": False,
            "shape": tuple(int(d) for d in shape),
        }
        with open(path, "wb") as f:
            np.lib.format.write_array_header_2_0(f, header)
            offset = f.tell()
        rows = cls.__new__(cls)
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize
        with open(path, "r+b") as f:
            os.posix_fallocate(f.fileno(), 0, offset + int(shape[0]) * row_bytes)
        rows.__init__(path)
        return rows

    # -- the array protocol training needs --------------------------------------
    def __len__(self) -> int:
        return self.shape[0]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"NpyRows({self.path!r}, shape={self.shape}, dtype={self.dtype})"

    def _file(self) -> int:
        if self._fd is None:
            with self._lock:
                if self._fd is None:
                    self._fd = os.open(
                        self.path, os.O_RDWR if os.access(self.path, os.W_OK) else os.O_RDONLY
                    )
        return self._fd

    def _read_run(self, start: int, count: int, out: np.ndarray) -> None:
        want = count * self.row_bytes
        view = memoryview(out.reshape(-1).view(np.uint8))
        done = 0
        while done < want:
            got = os.preadv(
                self._file(), [view[done:want]], self.offset + start * self.row_bytes + done
            )
            if got <= 0:
                raise OSError(f"{self.path}: short read at row {start}")
            done += got

    def read(self, rows) -> np.ndarray:
        """The rows `rows` (any order, repeats allowed) as a new array."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        n = len(self)
        if rows.size and (rows.min() < -n or rows.max() >= n):
            raise IndexError(f"row index out of range for {n} rows")
        rows = np.where(rows < 0, rows + n, rows)
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        out = np.empty((len(rows), *self.row_shape), self.dtype)
        if not len(rows):
            return out
        staged = out if np.all(order[:-1] < order[1:]) else np.empty_like(out)
        # one read per run of consecutive rows (a repeated row is read again)
        breaks = np.flatnonzero(np.diff(ordered) != 1) + 1
        for lo, hi in zip(np.r_[0, breaks], np.r_[breaks, len(rows)]):
            self._read_run(int(ordered[lo]), int(hi - lo), staged[lo:hi])
        if staged is not out:
            out[order] = staged
        return out

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, (int, np.integer)):
            return self.read([key])[0]
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self.read(np.arange(start, stop, step))
            out = np.empty((max(0, stop - start), *self.row_shape), self.dtype)
            if stop > start:
                self._read_run(start, stop - start, out)
            return out
        if isinstance(key, tuple):
            return self[key[0]][(slice(None), *key[1:])]
        key = np.asarray(key)
        if key.dtype == bool:
            key = np.flatnonzero(key)
        return self.read(key)

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    # -- writing ------------------------------------------------------------------
    def write(self, start: int, rows) -> None:
        """Writes `rows` (of this file's row shape and dtype) from row `start` on."""
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if rows.shape[1:] != self.row_shape or start < 0 or start + len(rows) > len(self):
            raise ValueError(f"rows of shape {rows.shape} do not fit at {start} in {self}")
        data = memoryview(rows.reshape(-1).view(np.uint8))
        done = 0
        while done < len(data):
            done += os.pwrite(
                self._file(), data[done:], self.offset + start * self.row_bytes + done
            )

    def flush(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 -- interpreter shutdown
            pass

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])

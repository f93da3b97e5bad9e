"""MNIST and Fashion-MNIST: 60,000 train + 10,000 test grey 28x28 images, 10 classes.

Two on-disk layouts are read:

* the Keras ``mnist.npz`` layout: arrays ``x_train (60000, 28, 28) uint8``,
  ``y_train (60000,) uint8``, ``x_test``, ``y_test`` (read with pickles
  disabled);
* the four official IDX files ``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
  ``t10k-labels-idx1-ubyte``, gzip-compressed (``.gz``) or not.  This is what
  the Debian package ``dataset-fashion-mnist`` installs in
  ``/usr/share/datasets/fashion-mnist/``.

IDX format (LeCun et al., http://yann.lecun.com/exdb/mnist/): a 4-byte magic
number ``0x00 0x00 <type> <ndim>``, then ``ndim`` big-endian uint32 sizes, then
the data in row-major (C) order, big-endian.  Type codes: 0x08 uint8, 0x09
int8, 0x0B int16, 0x0C int32, 0x0D float32, 0x0E float64.  `read_idx` is
strict: a wrong magic number, an unknown type, a short or over-long file all
raise `DatasetFormatError` naming the file.
"""

from __future__ import annotations

import gzip
import os
import zlib

import numpy as np

from dpfl_tf.data import Dataset, DataSource
from dpfl_tf.data.locate import (
    FASHION_MNIST_FILES,
    MNIST_FILES,
    DatasetFiles,
    DatasetFormatError,
    locate,
)

__all__ = [
    "MNIST_CLASSES",
    "FASHION_MNIST_CLASSES",
    "fashion_mnist",
    "mnist",
    "read_idx",
    "read_mnist_npz",
]

MNIST_CLASSES = tuple(str(d) for d in range(10))
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)

_IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Reads one IDX file (gzip-compressed or not, detected from its first bytes).

    Returns a native-byte-order, writable array of the declared type and shape.

    Raises:
      DatasetFormatError: corrupt gzip stream, bad magic number, unknown type
        code, or a data section shorter/longer than the header declares.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as e:
            raise DatasetFormatError(f"{path}: truncated or corrupt gzip stream ({e})") from e
    if len(raw) < 4:
        raise DatasetFormatError(
            f"{path}: not an IDX file: only {len(raw)} bytes, the magic number alone needs 4"
        )
    zero0, zero1, type_code, ndim = raw[0], raw[1], raw[2], raw[3]
    if zero0 != 0 or zero1 != 0:
        raise DatasetFormatError(
            f"{path}: not an IDX file: magic number 0x{raw[:4].hex()} must start with 0x0000"
        )
    if type_code not in _IDX_DTYPES:
        raise DatasetFormatError(
            f"{path}: unknown IDX type code 0x{type_code:02x}; allowed: "
            + ", ".join(f"0x{c:02x}" for c in _IDX_DTYPES)
        )
    if ndim == 0:
        raise DatasetFormatError(f"{path}: IDX header declares 0 dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DatasetFormatError(
            f"{path}: truncated IDX header: {ndim} dimensions need "
            f"{header} bytes, file has {len(raw)}"
        )
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    actual = len(raw) - header
    if actual < expected:
        raise DatasetFormatError(
            f"{path}: truncated IDX file: shape {dims} of {dtype.name} "
            f"needs {expected} data bytes, found {actual}"
        )
    if actual > expected:
        raise DatasetFormatError(
            f"{path}: corrupt IDX file: {actual - expected} bytes beyond the declared shape {dims}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return data.astype(dtype.newbyteorder("="), copy=True)


def read_mnist_npz(
    path: str | os.PathLike,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x_train, y_train, x_test, y_test)`` from a Keras ``mnist.npz``-layout file."""
    path = os.fspath(path)
    try:
        with np.load(path, allow_pickle=False) as f:
            missing = [k for k in ("x_train", "y_train", "x_test", "y_test") if k not in f]
            if missing:
                raise DatasetFormatError(
                    f"{path}: missing arrays {missing}; the mnist.npz "
                    f"layout has x_train, y_train, x_test, y_test "
                    f"(found {sorted(f.files)})"
                )
            return f["x_train"], f["y_train"], f["x_test"], f["y_test"]
    except DatasetFormatError:
        raise
    except Exception as e:  # noqa: BLE001 -- BadZipFile, truncated member, pickled arrays, ...
        raise DatasetFormatError(f"{path}: cannot read as .npz ({type(e).__name__}: {e})") from e


def _check(path: str, x_train, y_train, x_test, y_test) -> None:
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if x.dtype != np.uint8 or x.ndim != 3 or x.shape[1:] != (28, 28):
            raise DatasetFormatError(
                f"{path}: {split} images must be uint8 (N, 28, 28), got {x.dtype} {x.shape}"
            )
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise DatasetFormatError(
                f"{path}: {split} labels must be 1-D integers, got {y.dtype} {y.shape}"
            )
        if len(x) != len(y):
            raise DatasetFormatError(f"{path}: {len(x)} {split} images but {len(y)} labels")
        if len(y) and (int(y.min()) < 0 or int(y.max()) > 9):
            raise DatasetFormatError(
                f"{path}: {split} labels must be in 0..9, got {int(y.min())}..{int(y.max())}"
            )


def _load(spec: DatasetFiles, class_names: tuple[str, ...], data_dir, download) -> Dataset:
    found = locate(spec, data_dir, download=download)
    if found.file_set.name == "npz":
        path = found.paths[0]
        arrays = read_mnist_npz(path)
    else:  # idx: train images, train labels, test images, test labels
        path = found.directory
        arrays = tuple(read_idx(p) for p in found.paths)
    _check(path, *arrays)
    x_train, y_train, x_test, y_test = arrays
    return Dataset(
        x_train,
        y_train,
        x_test,
        y_test,
        num_classes=10,
        class_names=class_names,
        name=spec.name,
        source=DataSource(
            spec.display_name, path, found.file_set.name, downloaded=found.downloaded
        ),
    )


def mnist(data_dir: str | os.PathLike | None = None, *, download: bool | None = None) -> Dataset:
    """MNIST: images uint8 (N, 28, 28), labels uint8 0..9 (as stored), official order.

    Searches ``mnist.npz`` or the four IDX files (those only in ``data_dir`` or a
    ``mnist/`` subfolder) in the order of `dpfl_tf.data.locate`; then downloads
    ``mnist.npz`` unless ``download=False`` / ``DPFL_NO_DOWNLOAD=1``.
    """
    return _load(MNIST_FILES, MNIST_CLASSES, data_dir, download)


def fashion_mnist(
    data_dir: str | os.PathLike | None = None, *, download: bool | None = None
) -> Dataset:
    """Fashion-MNIST (Xiao et al. 2017): uint8 (N, 28, 28) images, uint8 labels 0..9.

    Reads the four IDX files (``data_dir`` itself, or a ``fashion-mnist/``
    subfolder of any searched directory, e.g. the Debian package's
    ``/usr/share/datasets/fashion-mnist/``) or a ``fashion-mnist.npz`` in the
    mnist.npz layout.
    """
    return _load(FASHION_MNIST_FILES, FASHION_MNIST_CLASSES, data_dir, download)

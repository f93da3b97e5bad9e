"""Datasets for dpfl_tf experiments, found offline first.

``load_dataset(name, data_dir=None, **kw)`` returns a `Dataset`: the train and
test arrays, the class names and where the data really came from
(``dataset.source``).  Files are searched for in ``data_dir``, then
``$DPFL_DATA_DIR``, ``~/.keras/datasets`` and ``/usr/share/datasets``, then
downloaded if possible (see `dpfl_tf.data.locate`).

``source.label`` is the name to report results under.  It differs from the
dataset's usual name when the copy is not the canonical one: CIFAR-10 read
from the JPEG image-folder copy is labelled ``"CIFAR-10 (JPEG copy)"`` (its
pixels differ slightly from the original arrays).

Known datasets: ``"mnist"``, ``"fashion_mnist"``, ``"cifar10"``,
``"cifar100"`` and ``"image_folder"`` (any ``<root>/<split>/<class>/*.png``
tree; ``data_dir`` is the root).  Register more with `register_dataset`.

Data too large to decode into memory is read as random-access *sources*
(`dpfl_tf.data.sources`): `ImageFolderSource` (one split of an image folder,
images decoded on demand), `ArraySource` (arrays), and `SourceDataset` (the
train and test sources of one dataset; ``cifar.cifar10_sources`` gives
CIFAR-10 so).  ``DPModel.fit(source, lot_size=...)`` reads only the lots.

Unit of privacy: the loaders return one row per example; nothing here
groups, deduplicates or shuffles examples (DP sampling happens later).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os
from typing import Callable, Union

import numpy as np

from dpfl_tf._validation import check_count, check_number
from dpfl_tf.data.locate import DatasetFormatError, DatasetNotFoundError

__all__ = [
    "ArraySource",
    "DataSource",
    "Dataset",
    "DatasetFormatError",
    "DatasetNotFoundError",
    "ImageFolderSource",
    "NpyRows",
    "SourceDataset",
    "available_datasets",
    "held_out_by_hash",
    "load_dataset",
    "register_dataset",
]


@dataclasses.dataclass(frozen=True)
class DataSource:
    """Where a `Dataset` was read from.

    Attributes:
      label: the name to report results under, e.g. ``"MNIST"`` or
        ``"CIFAR-10 (JPEG copy)"``.
      path: the file or directory actually read.
      format: the on-disk layout that was read (``"npz"``, ``"idx"``,
        ``"tarball"``, ``"extracted"``, ``"image_folder"``).
      downloaded: True if the files were downloaded during this call.
      note: caveats worth reporting (e.g. lossy JPEG re-encoding).
    """

    label: str
    path: str
    format: str
    downloaded: bool = False
    note: str = ""

    def __str__(self) -> str:
        return f"{self.label} ({self.format}: {self.path})"


def check_classes(num_classes: int, class_names) -> None:
    """num_classes >= 1 and one class name per class."""
    check_count("num_classes", num_classes, minimum=1)
    if len(class_names) != num_classes:
        raise ValueError(
            f"class_names must have num_classes={num_classes} entries, got {len(class_names)}"
        )


def check_labels(name: str, y: np.ndarray, num_classes: int) -> None:
    """Labels are class indices in [0, num_classes)."""
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(
            f"{name} must lie in [0, {num_classes}), got [{int(y.min())}, {int(y.max())}]"
        )


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split of one labelled dataset.

    Images are uint8, ``(N, H, W)`` for MNIST-family data and ``(N, H, W, C)``
    (channels last) otherwise; labels are 1-D integer class indices into
    ``class_names``.  ``eq=False``: arrays have no single truth value.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    class_names: tuple[str, ...]
    name: str
    source: DataSource

    def __post_init__(self):
        check_classes(self.num_classes, self.class_names)
        for split in ("train", "test"):
            x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
            if len(x) != len(y):
                raise ValueError(f"x_{split} has {len(x)} examples but y_{split} has {len(y)}")
            if y.ndim != 1:
                raise ValueError(f"y_{split} must be 1-D class indices, got shape {y.shape}")
            check_labels(f"y_{split}", y, self.num_classes)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    def validation_split(self, n: int, *, seed: int = 12345) -> "Dataset":
        """This dataset with `n` training examples (a seeded draw) held out as its
        evaluation split: ``x_train``/``y_train`` keep the other N - n in their
        order, ``x_test``/``y_test`` are the held-out ones.  Hyperparameters
        chosen on them never read the test set.  A DP run on the result protects
        its N - n training examples; the held-out examples shape the choice of
        hyperparameters, which no epsilon of a single run covers.  The default
        seed gives every run the same held-out examples.  (A private search needs
        `hash_split` instead: a draw of exactly n of N moves other examples across
        the split when N changes.)"""
        n = check_count("n", n, minimum=1)
        if n >= len(self.y_train):
            raise ValueError(f"cannot hold out {n} of the {len(self.y_train)} training examples")
        order = np.random.default_rng(seed).permutation(len(self.y_train))
        held, kept = order[:n], np.sort(order[n:])
        return self._held_out(held, kept)

    def hash_split(self, fraction: float) -> "Dataset":
        """This dataset with each training example held out with probability
        `fraction` by a keyed hash of its own pixels and label (`held_out_by_hash`),
        as `validation_split` lays it out.  `fraction` is fixed in advance, never
        derived from the data: whether an example is held out depends on that
        example alone, so adding or removing one example moves no other between
        training and held out -- what a private search's add/remove-one analysis
        needs (`dpfl_tf.recipes.tune`).  The number held out is about fraction x N."""
        fraction = check_number(
            "fraction", fraction, low=0.0, high=1.0, low_open=True, high_open=True
        )
        mask = held_out_by_hash(self.x_train, self.y_train, fraction)
        held, kept = np.flatnonzero(mask), np.flatnonzero(~mask)
        if len(held) == 0 or len(kept) == 0:
            raise ValueError(
                f"holding out each of the {len(self.y_train)} training examples with "
                f"probability {fraction:g} left "
                + ("none held out" if len(held) == 0 else "no training example")
            )
        return self._held_out(held, kept)

    def _held_out(self, held: np.ndarray, kept: np.ndarray) -> "Dataset":
        n = len(held)
        return dataclasses.replace(
            self,
            x_train=self.x_train[kept],
            y_train=self.y_train[kept],
            x_test=self.x_train[held],
            y_test=self.y_train[held],
            name=f"{self.name} (validation split: {n} held out)",
        )

    def __repr__(self) -> str:
        return (
            f"Dataset(name={self.name!r}, train={self.x_train.shape} {self.x_train.dtype}, "
            f"test={self.x_test.shape}, num_classes={self.num_classes}, "
            f"source={str(self.source)!r})"
        )


def held_out_by_hash(x, y, fraction: float, key: bytes = b"dpfl_tf validation") -> np.ndarray:
    """A boolean mask: example i is held out iff u_i < `fraction`, with u_i in
    [0, 1) the first 8 bytes of the keyed BLAKE2b hash of its bytes and its label.
    u_i depends on example i alone (identical examples share it)."""
    check_number("fraction", fraction, low=0.0, high=1.0)
    x = np.ascontiguousarray(x)
    labels = np.asarray(y).astype("<i8")
    cut = int(fraction * 2.0**64)
    return np.fromiter(
        (
            int.from_bytes(
                hashlib.blake2b(
                    x[i].tobytes() + labels[i].tobytes(), digest_size=8, key=key
                ).digest(),
                "little",
            )
            < cut
            for i in range(len(labels))
        ),
        dtype=bool,
        count=len(labels),
    )


Loader = Callable[..., Dataset]

# Values are loaders or "module:function" strings imported on first use, so
# importing dpfl_tf.data stays cheap.
_REGISTRY: dict[str, Union[Loader, str]] = {
    "mnist": "dpfl_tf.data.mnist:mnist",
    "fashion_mnist": "dpfl_tf.data.mnist:fashion_mnist",
    "cifar10": "dpfl_tf.data.cifar:cifar10",
    "cifar100": "dpfl_tf.data.cifar:cifar100",
    "image_folder": "dpfl_tf.data.image_folder:image_folder",
}


def _normalise(name: str) -> str:
    return name.strip().lower().replace("-", "_")


def register_dataset(name: str, loader: Union[Loader, str], *, overwrite: bool = False) -> None:
    """Makes `load_dataset(name, data_dir, **kw)` call ``loader(data_dir=data_dir, **kw)``.

    `loader` is a callable returning a `Dataset`, or a ``"module:function"`` string.
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if not (callable(loader) or (isinstance(loader, str) and ":" in loader)):
        raise ValueError(f"loader must be a callable or a 'module:function' string, got {loader!r}")
    key = _normalise(name)
    if key in _REGISTRY and not overwrite:
        raise ValueError(f"dataset {key!r} is already registered (pass overwrite=True)")
    _REGISTRY[key] = loader


def available_datasets() -> list[str]:
    """Registered dataset names, sorted."""
    return sorted(_REGISTRY)


def load_dataset(name: str, data_dir: str | os.PathLike | None = None, **kwargs) -> Dataset:
    """Loads a registered dataset.

    Args:
      name: one of `available_datasets()` (case-insensitive, '-' same as '_').
      data_dir: a directory searched before all others (for ``"image_folder"``:
        the root folder or archive itself).
      **kwargs: passed to the loader, e.g. ``download=False``,
        ``label_mode="coarse"`` (cifar100), ``image_size=(32, 32)`` (image_folder).

    Raises:
      ValueError: unknown name (the message lists the known ones).
      DatasetNotFoundError: no copy found (the message says where it looked).
    """
    key = _normalise(name) if isinstance(name, str) else None
    if key not in _REGISTRY:
        raise ValueError(
            f"unknown dataset {name!r}; known datasets: {', '.join(available_datasets())}"
        )
    loader = _REGISTRY[key]
    if isinstance(loader, str):
        module, _, attr = loader.partition(":")
        loader = getattr(importlib.import_module(module), attr)
    return loader(data_dir=data_dir, **kwargs)


# random-access sources (records read on demand); imported last: they use the classes above
from dpfl_tf.data.image_folder import ImageFolderSource  # noqa: E402
from dpfl_tf.data.npy_rows import NpyRows  # noqa: E402
from dpfl_tf.data.sources import ArraySource, SourceDataset  # noqa: E402

"""CIFAR-10 and CIFAR-100 (Krizhevsky 2009), canonical "python version".

Layout read (https://www.cs.toronto.edu/~kriz/cifar.html):

* CIFAR-10: ``cifar-10-python.tar.gz`` or its extraction
  ``cifar-10-batches-py/`` holding the pickles ``data_batch_1`` ..
  ``data_batch_5`` (10,000 images each) and ``test_batch``; optional
  ``batches.meta`` (``b'label_names'``).
* CIFAR-100: ``cifar-100-python.tar.gz`` or ``cifar-100-python/`` holding the
  pickles ``train`` (50,000) and ``test`` (10,000) with ``b'fine_labels'``
  (100 classes) and ``b'coarse_labels'`` (20 superclasses); optional ``meta``.

Each pickle (Python 2, read with ``encoding="bytes"``) is a dict whose
``b'data'`` is a uint8 array (N, 3072): per row the 1024 red, then 1024 green,
then 1024 blue values of a 32x32 image in row-major order.  The loaders
return (N, 32, 32, 3) uint8 (NHWC) and int64 labels.  Pickles are read with
an unpickler that only admits numpy's array-reconstruction functions, so a
tampered file cannot run code.

Offline fallback (CIFAR-10 only): when no canonical copy is found (and the
download is off or fails), `cifar10` reads the image-folder copy
``cifar10_jpg.tar.xz`` (``train/<class>/NNNN.jpg``, ``test/<class>/NNNN.jpg``)
through the same search order.  Those pixels are JPEG re-encodings (quality
about 75), so the result says so: ``name == "cifar10_jpg"`` and
``source.label == "CIFAR-10 (JPEG copy)"``.  The two copies are never mixed.

`cifar10` decodes every image into memory; `cifar10_sources` gives the same
records as random-access sources instead (the JPEG copy decoded on demand,
memory O(batch)), for `DPModel.fit(source, ...)`.
"""

from __future__ import annotations

import io
import os
import pickle
import tarfile

import numpy as np

from dpfl_tf.data import Dataset, DataSource
from dpfl_tf.data.locate import (
    CIFAR10_FILES,
    CIFAR10_JPEG_FILES,
    CIFAR100_FILES,
    DatasetFormatError,
    DatasetNotFoundError,
    Located,
    locate,
)
from dpfl_tf.data.sources import ArraySource, SourceDataset

__all__ = [
    "CIFAR10_CLASSES",
    "CIFAR100_COARSE_CLASSES",
    "CIFAR100_FINE_CLASSES",
    "JPEG_COPY_LABEL",
    "cifar10",
    "cifar10_sources",
    "cifar100",
    "read_cifar_pickle",
]

CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)

CIFAR100_FINE_CLASSES = (
    "apple",
    "aquarium_fish",
    "baby",
    "bear",
    "beaver",
    "bed",
    "bee",
    "beetle",
    "bicycle",
    "bottle",
    "bowl",
    "boy",
    "bridge",
    "bus",
    "butterfly",
    "camel",
    "can",
    "castle",
    "caterpillar",
    "cattle",
    "chair",
    "chimpanzee",
    "clock",
    "cloud",
    "cockroach",
    "couch",
    "crab",
    "crocodile",
    "cup",
    "dinosaur",
    "dolphin",
    "elephant",
    "flatfish",
    "forest",
    "fox",
    "girl",
    "hamster",
    "house",
    "kangaroo",
    "keyboard",
    "lamp",
    "lawn_mower",
    "leopard",
    "lion",
    "lizard",
    "lobster",
    "man",
    "maple_tree",
    "motorcycle",
    "mountain",
    "mouse",
    "mushroom",
    "oak_tree",
    "orange",
    "orchid",
    "otter",
    "palm_tree",
    "pear",
    "pickup_truck",
    "pine_tree",
    "plain",
    "plate",
    "poppy",
    "porcupine",
    "possum",
    "rabbit",
    "raccoon",
    "ray",
    "road",
    "rocket",
    "rose",
    "sea",
    "seal",
    "shark",
    "shrew",
    "skunk",
    "skyscraper",
    "snail",
    "snake",
    "spider",
    "squirrel",
    "streetcar",
    "sunflower",
    "sweet_pepper",
    "table",
    "tank",
    "telephone",
    "television",
    "tiger",
    "tractor",
    "train",
    "trout",
    "tulip",
    "turtle",
    "wardrobe",
    "whale",
    "willow_tree",
    "wolf",
    "woman",
    "worm",
)

CIFAR100_COARSE_CLASSES = (
    "aquatic_mammals",
    "fish",
    "flowers",
    "food_containers",
    "fruit_and_vegetables",
    "household_electrical_devices",
    "household_furniture",
    "insects",
    "large_carnivores",
    "large_man-made_outdoor_things",
    "large_natural_outdoor_scenes",
    "large_omnivores_and_herbivores",
    "medium_mammals",
    "non-insect_invertebrates",
    "people",
    "reptiles",
    "small_mammals",
    "trees",
    "vehicles_1",
    "vehicles_2",
)

JPEG_COPY_LABEL = "CIFAR-10 (JPEG copy)"
_JPEG_NOTE = (
    "JPEG re-encoding (quality ~75) of CIFAR-10: pixels differ slightly from the "
    "original arrays; report results as 'CIFAR-10 (JPEG copy)'."
)

_NUMPY_GLOBALS = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"),
    # protocol-2 pickles written by Python 3 store bytes as _codecs.encode(str, "latin1")
    ("_codecs", "encode"),
}


class _NumpyOnlyUnpickler(pickle.Unpickler):
    """Admits numpy's array reconstruction (and bytes re-encoding) only: no code execution."""

    def find_class(self, module, name):
        if module.startswith("numpy.core") and hasattr(np, "_core"):
            module = "numpy._core" + module[len("numpy.core") :]  # pickles from numpy < 2
        if (module, name) in _NUMPY_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR pickle")


def read_cifar_pickle(data: bytes, where: str = "<bytes>") -> dict:
    """Unpickles one CIFAR batch (bytes) into a dict with str keys; errors name `where`."""
    try:
        obj = _NumpyOnlyUnpickler(io.BytesIO(data), encoding="bytes").load()
    except Exception as e:  # noqa: BLE001 -- truncated, not a pickle, forbidden global
        raise DatasetFormatError(
            f"{where}: not a valid CIFAR pickle ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(obj, dict):
        raise DatasetFormatError(f"{where}: a CIFAR pickle holds a dict, got {type(obj).__name__}")
    return {k.decode("utf-8") if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _read_files(
    found: Located, names: tuple[str, ...], optional: tuple[str, ...] = ()
) -> tuple[dict[str, bytes], str]:
    """Raw bytes of the wanted batch files, from the tarball or the extracted folder."""
    wanted = set(names) | set(optional)
    out: dict[str, bytes] = {}
    if found.file_set.name == "tarball":
        source = found.paths[0]
        try:
            with tarfile.open(source, "r:*") as tar:
                for member in tar:
                    base = os.path.basename(member.name)
                    if member.isfile() and base in wanted:
                        if base in out:
                            raise DatasetFormatError(f"{source}: two members named {base!r}")
                        out[base] = tar.extractfile(member).read()
        except DatasetFormatError:
            raise
        except Exception as e:  # noqa: BLE001 -- truncated/corrupt archive
            raise DatasetFormatError(
                f"{source}: cannot read the archive ({type(e).__name__}: {e})"
            ) from e
    else:
        source = os.path.dirname(found.paths[0])
        for base in wanted:
            path = os.path.join(source, base)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    out[base] = f.read()
    missing = [n for n in names if n not in out]
    if missing:
        raise DatasetFormatError(
            f"{source}: missing {missing}; the canonical layout has {list(names)}"
        )
    return out, source


def _images_and_labels(
    batch: dict, label_key: str, num_classes: int, where: str
) -> tuple[np.ndarray, np.ndarray]:
    if "data" not in batch or label_key not in batch:
        raise DatasetFormatError(
            f"{where}: needs keys b'data' and b'{label_key}', found {sorted(batch)}"
        )
    data = np.asarray(batch["data"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise DatasetFormatError(
            f"{where}: b'data' must be uint8 (N, 3072), got {data.dtype} {data.shape}"
        )
    labels = np.asarray(batch[label_key], dtype=np.int64).reshape(-1)
    if len(labels) != len(data):
        raise DatasetFormatError(f"{where}: {len(data)} images but {len(labels)} labels")
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise DatasetFormatError(
            f"{where}: b'{label_key}' must lie in [0, {num_classes}), "
            f"got [{labels.min()}, {labels.max()}]"
        )
    # rows are [R plane | G plane | B plane], each 32x32 row-major -> NHWC
    images = np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return images, labels


def _names_from_meta(
    raw: bytes | None, key: str, default: tuple[str, ...], where: str
) -> tuple[str, ...]:
    if raw is None:
        return default
    meta = read_cifar_pickle(raw, where)
    names = meta.get(key)
    if names is None or len(names) != len(default):
        raise DatasetFormatError(f"{where}: b'{key}' must list {len(default)} names")
    return tuple(n.decode("utf-8") if isinstance(n, bytes) else str(n) for n in names)


def cifar10(
    data_dir: str | os.PathLike | None = None,
    *,
    download: bool | None = None,
    allow_jpeg_copy: bool = True,
    cache_dir: str | os.PathLike | None = None,
    num_workers: int | None = None,
    extract: bool = False,
) -> Dataset:
    """CIFAR-10: x (N, 32, 32, 3) uint8, y int64 in 0..9; 50,000 train / 10,000 test.

    Canonical copy first (search, then download); only if that fails and
    ``allow_jpeg_copy`` is true, the offline JPEG image-folder copy
    ``cifar10_jpg.tar.xz``, found through the same search order, decoded once
    and cached (``cache_dir``, ``num_workers``, ``extract`` as in
    `dpfl_tf.data.image_folder.read_image_folder`).  By default the copy is
    decoded straight from the archive stream (``extract=False``): writing its
    60,000 small files first took 10-90 s on a shared 2-core machine, the
    stream about 4 s.  The JPEG copy comes back with
    ``name="cifar10_jpg"`` and ``source.label="CIFAR-10 (JPEG copy)"``, sorted
    by class (shuffle before use).
    """
    found, jpeg = _locate_cifar10(data_dir, download, allow_jpeg_copy)
    if jpeg is not None:
        return _cifar10_jpeg(jpeg, cache_dir, num_workers, extract)
    return _cifar10_canonical(found)


def _locate_cifar10(data_dir, download, allow_jpeg_copy) -> tuple[Located | None, Located | None]:
    """(canonical copy, None), or (None, JPEG copy) when only the JPEG copy is found."""
    try:
        return locate(CIFAR10_FILES, data_dir, download=download), None
    except DatasetNotFoundError as canonical:
        if not allow_jpeg_copy:
            raise
        try:
            # no URL for the JPEG copy: download=True only reports "no official download"
            return None, locate(CIFAR10_JPEG_FILES, data_dir, download=True)
        except DatasetNotFoundError as fallback:
            raise DatasetNotFoundError(
                f"{canonical}\n\nFallback: no offline JPEG copy either.\n{fallback}",
                dataset=canonical.dataset,
                places=canonical.places + fallback.places,
                download_error=canonical.download_error,
            ) from None


def _cifar10_canonical(found: Located) -> Dataset:
    batches = tuple(f"data_batch_{i}" for i in range(1, 6))
    files, source = _read_files(found, batches + ("test_batch",), optional=("batches.meta",))
    parts = [
        _images_and_labels(
            read_cifar_pickle(files[b], f"{source}:{b}"), "labels", 10, f"{source}:{b}"
        )
        for b in batches
    ]
    x_test, y_test = _images_and_labels(
        read_cifar_pickle(files["test_batch"], f"{source}:test_batch"),
        "labels",
        10,
        f"{source}:test_batch",
    )
    names = _names_from_meta(
        files.get("batches.meta"), "label_names", CIFAR10_CLASSES, f"{source}:batches.meta"
    )
    return Dataset(
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        x_test,
        y_test,
        num_classes=10,
        class_names=names,
        name="cifar10",
        source=DataSource("CIFAR-10", source, found.file_set.name, downloaded=found.downloaded),
    )


def _cifar10_jpeg(found: Located, cache_dir, num_workers, extract) -> Dataset:
    from dpfl_tf.data.image_folder import read_image_folder

    root = found.paths[0]
    folder = read_image_folder(
        root,
        splits=("train", "test"),
        class_names=CIFAR10_CLASSES,
        cache_dir=cache_dir,
        num_workers=num_workers,
        extract=extract,
    )
    for split in ("train", "test"):
        x, y = folder.splits[split]
        if x.shape[1:] != (32, 32, 3):
            raise DatasetFormatError(f"{root}: {split} images must be 32x32 RGB, got {x.shape[1:]}")
    empty = [CIFAR10_CLASSES[c] for c in range(10) if not np.any(folder.splits["train"][1] == c)]
    if empty:
        raise DatasetFormatError(f"{root}: no training images for classes {empty}")
    (x_train, y_train), (x_test, y_test) = folder.splits["train"], folder.splits["test"]
    return Dataset(
        x_train,
        y_train,
        x_test,
        y_test,
        num_classes=10,
        class_names=CIFAR10_CLASSES,
        name="cifar10_jpg",
        source=DataSource(JPEG_COPY_LABEL, root, "image_folder", note=_JPEG_NOTE),
    )


def cifar10_sources(
    data_dir: str | os.PathLike | None = None,
    *,
    download: bool | None = None,
    allow_jpeg_copy: bool = True,
    cache_dir: str | os.PathLike | None = None,
    num_workers: int | None = None,
) -> SourceDataset:
    """CIFAR-10 as random-access sources (`SourceDataset`): records read on demand.

    The same search and the same records, labels and order as `cifar10`.
    The offline JPEG copy gives one `ImageFolderSource` per split: the
    archive is extracted once into ``<cache>/extracted/`` (``cache_dir``),
    and images are decoded only when read, so memory holds the file names
    and labels plus the batches being read -- not 60,000 images.  The
    canonical copy (pickles of 10,000 images each, which must be read whole)
    is read into memory and given as `ArraySource` splits.
    """
    from dpfl_tf.data.image_folder import ImageFolderSource

    found, jpeg = _locate_cifar10(data_dir, download, allow_jpeg_copy)
    if jpeg is None:
        data = _cifar10_canonical(found)
        return SourceDataset(
            ArraySource(data.x_train, data.y_train),
            ArraySource(data.x_test, data.y_test),
            num_classes=10,
            class_names=data.class_names,
            name=data.name,
            source=data.source,
        )
    root = jpeg.paths[0]
    train, test = (
        ImageFolderSource(
            root, split, class_names=CIFAR10_CLASSES, cache_dir=cache_dir, num_workers=num_workers
        )
        for split in ("train", "test")
    )
    for split, part in (("train", train), ("test", test)):
        if part.image_shape != (32, 32, 3):  # every image is checked against it when read
            raise DatasetFormatError(
                f"{root}: {split} images must be 32x32 RGB, got {part.image_shape} ({part.path(0)})"
            )
    empty = [CIFAR10_CLASSES[c] for c in range(10) if not np.any(train.labels == c)]
    if empty:
        raise DatasetFormatError(f"{root}: no training images for classes {empty}")
    return SourceDataset(
        train,
        test,
        num_classes=10,
        class_names=CIFAR10_CLASSES,
        name="cifar10_jpg",
        source=DataSource(JPEG_COPY_LABEL, root, "image_folder", note=_JPEG_NOTE),
    )


def cifar100(
    data_dir: str | os.PathLike | None = None,
    *,
    label_mode: str = "fine",
    download: bool | None = None,
) -> Dataset:
    """CIFAR-100: x (N, 32, 32, 3) uint8; y int64, 100 fine classes or 20 coarse ones.

    Args:
      label_mode: ``"fine"`` (100 classes) or ``"coarse"`` (20 superclasses).
    """
    if label_mode not in ("fine", "coarse"):
        raise ValueError(f"label_mode must be 'fine' or 'coarse', got {label_mode!r}")
    found = locate(CIFAR100_FILES, data_dir, download=download)
    files, source = _read_files(found, ("train", "test"), optional=("meta",))
    key = f"{label_mode}_labels"
    default = CIFAR100_FINE_CLASSES if label_mode == "fine" else CIFAR100_COARSE_CLASSES
    n = len(default)
    x_train, y_train = _images_and_labels(
        read_cifar_pickle(files["train"], f"{source}:train"), key, n, f"{source}:train"
    )
    x_test, y_test = _images_and_labels(
        read_cifar_pickle(files["test"], f"{source}:test"), key, n, f"{source}:test"
    )
    names = _names_from_meta(
        files.get("meta"), f"{label_mode}_label_names", default, f"{source}:meta"
    )
    label = "CIFAR-100" if label_mode == "fine" else "CIFAR-100 (20 coarse classes)"
    return Dataset(
        x_train,
        y_train,
        x_test,
        y_test,
        num_classes=n,
        class_names=names,
        name="cifar100" if label_mode == "fine" else "cifar100_coarse",
        source=DataSource(label, source, found.file_set.name, downloaded=found.downloaded),
    )

"""Image-folder datasets: ``<root>/<split>/<class>/*.jpg|*.jpeg|*.png``.

``root`` is a directory or a ``.tar`` / ``.tar.gz`` / ``.tgz`` / ``.tar.xz`` /
``.tar.bz2`` archive of one; an archive is extracted once into the cache
directory (``<cache>/extracted/``) and reused.  With ``extract=False`` the
images are instead decoded straight from the archive stream (no files
written but the decoded cache; much faster where creating tens of thousands
of small files is slow).  An archive whose splits sit one directory down
(``archive/<top>/<split>/...``) is accepted too.

Labels are indices into the class names: the sorted union of the class
folders of all requested splits, or an explicit ``class_names`` list (a
folder not in the list is an error).  Images are ordered by class, then by
file name; nothing is shuffled.  They are decoded with Pillow in a thread
pool (Pillow releases the GIL while decoding), converted to RGB (or
grayscale) and resized only when ``image_size`` is given; all images must
otherwise have one size.

`read_image_folder` decodes every image of the requested splits into memory.
`ImageFolderSource` is one split as a random-access source instead: images
are decoded when a batch of them is read (``__getitems__``), so memory is
O(batch); archives are then always extracted (a compressed stream has no
random access).  Both decode with the same function (same pixels, labels
and order for the same ``class_names``).

The decoded arrays are cached as one ``.npz`` in ``<cache>/image_folder/``,
where ``<cache>`` is the ``cache_dir`` argument, else ``$DPFL_CACHE_DIR``,
else ``~/.cache/dpfl_tf``.  The cache key covers the source path, the size
and mtime of the archive (or of every image file of a directory tree) and
the decoding options, so editing the source invalidates it.  Cache files
are written atomically (temporary file + rename); a damaged cache file is
ignored and rebuilt.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import io
import json
import logging
import os
import shutil
import tarfile
import tempfile
import threading
import warnings
from typing import Sequence

import numpy as np

from dpfl_tf._io import atomic_write
from dpfl_tf._validation import check_count
from dpfl_tf.data import Dataset, DataSource
from dpfl_tf.data.locate import DatasetFormatError
from dpfl_tf.data.sources import IndexedSource

__all__ = [
    "IMAGE_EXTENSIONS",
    "ImageFolder",
    "ImageFolderSource",
    "default_cache_dir",
    "image_folder",
    "read_image_folder",
]

logger = logging.getLogger("dpfl_tf.data")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2")
COLOR_MODES = ("rgb", "grayscale")
_CACHE_VERSION = 1
_CHUNK = 256  # images per thread-pool task
_INLINE = 16  # ImageFolderSource: batches up to this size are decoded without the pool


@dataclasses.dataclass(frozen=True, eq=False)
class ImageFolder:
    """Decoded image folder: ``splits[name] = (x uint8 (N, H, W, C), y int64 (N,))``."""

    root: str
    class_names: tuple[str, ...]
    splits: dict
    cache_path: str | None
    from_cache: bool


def default_cache_dir() -> str:
    """``$DPFL_CACHE_DIR`` if set, else ``~/.cache/dpfl_tf``."""
    env = os.environ.get("DPFL_CACHE_DIR", "").strip()
    return os.path.abspath(os.path.expanduser(env or os.path.join("~", ".cache", "dpfl_tf")))


def _is_archive(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(ARCHIVE_SUFFIXES)


def _stem(path: str) -> str:
    base = os.path.basename(path.rstrip(os.sep)) or "root"
    for suffix in ARCHIVE_SUFFIXES:
        if base.lower().endswith(suffix):
            return base[: -len(suffix)]
    return base


# ---------------------------------------------------------------------- archives


def _extract_archive(archive: str, cache_dir: str) -> str:
    """Extracts `archive` once into the cache; returns the extracted directory."""
    st = os.stat(archive)
    key = hashlib.sha256(f"{archive}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    parent = os.path.join(cache_dir, "extracted")
    final = os.path.join(parent, f"{_stem(archive)}-{key}")
    if os.path.isdir(final):
        return final
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{_stem(archive)}-", suffix=".tmp")
    try:
        logger.info("extracting %s to %s", archive, final)
        try:
            with tarfile.open(archive, "r:*") as tar:
                if hasattr(tarfile, "data_filter"):
                    tar.extractall(tmp, filter="data")  # no absolute paths, '..', devices
                else:  # pragma: no cover -- Python < 3.11.4
                    members = [m for m in tar.getmembers() if _safe_member(m)]
                    tar.extractall(tmp, members=members)
        except (tarfile.TarError, EOFError, OSError) as e:
            raise DatasetFormatError(
                f"{archive}: cannot extract the archive ({type(e).__name__}: {e})"
            ) from e
        try:
            os.rename(tmp, final)  # atomic: `final` exists only when complete
        except OSError:
            if not os.path.isdir(final):  # not a concurrent extraction that won the race
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _safe_member(member: tarfile.TarInfo) -> bool:
    name = member.name
    return (
        (member.isfile() or member.isdir())
        and not os.path.isabs(name)
        and ".." not in name.replace("\\", "/").split("/")
    )


def _tree_root(directory: str, splits: Sequence[str]) -> str:
    """`directory`, or its single subdirectory if the splits live one level down."""
    if all(os.path.isdir(os.path.join(directory, s)) for s in splits):
        return directory
    subdirs = [e.path for e in os.scandir(directory) if e.is_dir() and not e.name.startswith(".")]
    if len(subdirs) == 1 and all(os.path.isdir(os.path.join(subdirs[0], s)) for s in splits):
        return subdirs[0]
    return directory


# ----------------------------------------------------------------------- listing


def _list_split(root: str, split: str) -> dict[str, list[os.DirEntry]]:
    """class folder name -> image entries (sorted by name) of one split."""
    split_dir = os.path.join(root, split)
    if not os.path.isdir(split_dir):
        found = sorted(e.name for e in os.scandir(root) if e.is_dir())
        raise DatasetFormatError(
            f"{root}: no split folder {split!r} (found folders {found}); "
            f"expected <root>/<split>/<class>/*.jpg|png"
        )
    classes = {}
    for entry in os.scandir(split_dir):
        if entry.is_dir() and not entry.name.startswith("."):
            files = [
                f
                for f in os.scandir(entry.path)
                if f.is_file()
                and f.name.lower().endswith(IMAGE_EXTENSIONS)
                and not f.name.startswith(".")
            ]
            classes[entry.name] = sorted(files, key=lambda f: f.name)
    return classes


# ---------------------------------------------------------------------- decoding


def _read_archive(archive: str, splits: Sequence[str]) -> dict[str, dict[str, list]]:
    """Like `_list_split` for every split, straight from the archive stream:
    split -> class -> sorted [("archive:member", bytes)]."""
    found: dict[str, dict[str, dict[str, bytes]]] = {s: {} for s in splits}
    tops: set[str] = set()
    try:
        with tarfile.open(archive, "r|*") as tar:
            for member in tar:
                parts = [p for p in member.name.split("/") if p not in ("", ".")]
                if not member.isfile() or len(parts) not in (3, 4):
                    continue
                if len(parts) == 4:
                    if parts[1] not in found:
                        continue
                    tops.add(parts[0])
                    parts = parts[1:]
                elif parts[0] in found:
                    tops.add("")
                split, cls, name = parts
                if (
                    split not in found
                    or cls.startswith(".")
                    or name.startswith(".")
                    or not name.lower().endswith(IMAGE_EXTENSIONS)
                ):
                    continue
                found[split].setdefault(cls, {})[name] = tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DatasetFormatError(
            f"{archive}: cannot read the archive ({type(e).__name__}: {e})"
        ) from e
    if len(tops) > 1:
        raise DatasetFormatError(
            f"{archive}: split folders found at several levels "
            f"{sorted(t or '.' for t in tops)}; expected "
            f"[<top>/]<split>/<class>/<image> once"
        )
    for split, classes in found.items():
        if not classes:
            raise DatasetFormatError(
                f"{archive}: no split folder {split!r} with images; "
                f"expected <split>/<class>/*.jpg|png"
            )
    return {
        s: {
            c: [(f"{archive}:{s}/{c}/{n}", files[n]) for n in sorted(files)]
            for c, files in classes.items()
        }
        for s, classes in found.items()
    }


def _decode_image(source, image_size: tuple[int, int] | None, color_mode: str) -> np.ndarray:
    """One image as uint8 (H, W, C); resized (bilinear) only if `image_size` is given.

    `source` is a file path or a ``(name, encoded bytes)`` pair (archive member)."""
    from PIL import Image, UnidentifiedImageError

    path, fileobj = (
        (source[0], io.BytesIO(source[1])) if isinstance(source, tuple) else (source, source)
    )
    try:
        with Image.open(fileobj) as im:
            mode = "RGB" if color_mode == "rgb" else "L"
            if im.mode != mode:
                im = im.convert(mode)
            if image_size is not None and im.size != (image_size[1], image_size[0]):
                im = im.resize((image_size[1], image_size[0]), Image.Resampling.BILINEAR)
            arr = np.asarray(im, dtype=np.uint8)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise DatasetFormatError(f"{path}: cannot decode image ({type(e).__name__}: {e})") from e
    return arr[..., None] if arr.ndim == 2 else arr


def _decode_all(paths: Sequence[str], image_size, color_mode: str, num_workers: int) -> np.ndarray:
    first = _decode_image(paths[0], image_size, color_mode)
    first_name = paths[0][0] if isinstance(paths[0], tuple) else paths[0]
    out = np.empty((len(paths),) + first.shape, dtype=np.uint8)
    out[0] = first

    def work(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            img = _decode_image(paths[i], image_size, color_mode)
            if img.shape != first.shape:
                name = paths[i][0] if isinstance(paths[i], tuple) else paths[i]
                raise DatasetFormatError(
                    f"{name}: image is {img.shape[0]}x{img.shape[1]}x{img.shape[2]} but "
                    f"{first_name} is {first.shape[0]}x{first.shape[1]}x{first.shape[2]}; "
                    f"pass image_size=(height, width) to resize"
                )
            out[i] = img

    bounds = [(lo, min(lo + _CHUNK, len(paths))) for lo in range(1, len(paths), _CHUNK)]
    if num_workers == 1 or len(bounds) <= 1:
        for lo, hi in bounds:
            work(lo, hi)
    else:
        with concurrent.futures.ThreadPoolExecutor(
            num_workers, thread_name_prefix="dpfl-decode"
        ) as pool:
            futures = [pool.submit(work, lo, hi) for lo, hi in bounds]
            for future in futures:
                future.result()  # re-raises the first decoding error
    return out


# ------------------------------------------------------------------------- cache


def _save_npz_atomic(path: str, arrays: dict) -> None:
    """np.savez written atomically (never a half file)."""
    atomic_write(path, lambda f: np.savez(f, **arrays), binary=True)


def _load_cache(path: str, key: str, splits: Sequence[str]):
    try:
        with np.load(path, allow_pickle=False) as f:
            if str(f["key"]) != key:
                return None
            names = tuple(str(n) for n in f["class_names"])
            out = {s: (f[f"x_{s}"], f[f"y_{s}"]) for s in splits}
        return names, out
    except Exception as e:  # noqa: BLE001 -- damaged cache: rebuild it
        warnings.warn(
            f"ignoring unreadable image cache {path} ({type(e).__name__}: {e})",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


# -------------------------------------------------------------------------- API


def _check_options(splits, class_names, image_size, color_mode, num_workers):
    if isinstance(splits, str) or not splits:
        raise ValueError(f"splits must be a non-empty sequence of folder names, got {splits!r}")
    splits = tuple(splits)
    if len(set(splits)) != len(splits) or not all(isinstance(s, str) and s for s in splits):
        raise ValueError(f"splits must be distinct non-empty names, got {splits!r}")
    if class_names is not None:
        if isinstance(class_names, str):
            raise ValueError(f"class_names must be a sequence of names, got {class_names!r}")
        class_names = tuple(class_names)
        if (
            not class_names
            or len(set(class_names)) != len(class_names)
            or not all(isinstance(c, str) and c for c in class_names)
        ):
            raise ValueError(f"class_names must be distinct non-empty names, got {class_names!r}")
    if image_size is not None:
        if isinstance(image_size, (int, np.integer)) and not isinstance(image_size, bool):
            image_size = (image_size, image_size)
        if not isinstance(image_size, (tuple, list)) or len(image_size) != 2:
            raise ValueError(
                f"image_size must be None, an int or (height, width), got {image_size!r}"
            )
        image_size = (
            check_count("image_size[0]", image_size[0], minimum=1),
            check_count("image_size[1]", image_size[1], minimum=1),
        )
    if color_mode not in COLOR_MODES:
        raise ValueError(f"color_mode must be one of {COLOR_MODES}, got {color_mode!r}")
    if num_workers is None:
        num_workers = min(8, os.cpu_count() or 1)
    num_workers = check_count("num_workers", num_workers, minimum=1)
    return splits, class_names, image_size, num_workers


def _resolve_root(root, cache_dir) -> tuple[str, bool, str]:
    """(absolute root, whether it is an archive, absolute cache directory)."""
    root = os.path.abspath(os.path.expanduser(os.fspath(root)))
    if not os.path.exists(root):
        raise FileNotFoundError(f"image folder root {root} does not exist")
    archive = _is_archive(root)
    if not archive and not os.path.isdir(root):
        raise ValueError(
            f"root must be a directory or a tar archive ({', '.join(ARCHIVE_SUFFIXES)}), got {root}"
        )
    cache_dir = (
        os.path.abspath(os.path.expanduser(os.fspath(cache_dir)))
        if cache_dir is not None
        else default_cache_dir()
    )
    return root, archive, cache_dir


def _resolve_classes(root: str, listing: dict, class_names) -> tuple[str, ...]:
    """The class order: `class_names`, or the sorted class folders of all listed splits."""
    folders = sorted({c for classes in listing.values() for c in classes})
    if class_names is None:
        return tuple(folders)
    extra = [c for c in folders if c not in class_names]
    if extra:
        raise DatasetFormatError(
            f"{root}: class folders {extra} are not in class_names={list(class_names)}"
        )
    return tuple(class_names)


def _no_images(root: str, split: str) -> DatasetFormatError:
    return DatasetFormatError(f"{root}: no {'/'.join(IMAGE_EXTENSIONS)} images in split {split!r}")


def read_image_folder(
    root: str | os.PathLike,
    *,
    splits: Sequence[str] = ("train", "test"),
    class_names: Sequence[str] | None = None,
    image_size: int | tuple[int, int] | None = None,
    color_mode: str = "rgb",
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    num_workers: int | None = None,
    extract: bool = True,
) -> ImageFolder:
    """Decodes ``root/<split>/<class>/*`` for each split (see module docstring).

    Args:
      root: a directory or a tar archive (.tar, .tar.gz, .tar.xz, ...) of one.
      splits: split folder names to read.
      class_names: explicit class order; default: sorted class folder names.
      image_size: (height, width) to resize to (bilinear); default: keep size.
      color_mode: "rgb" (C=3) or "grayscale" (C=1).
      cache_dir: cache root; default ``$DPFL_CACHE_DIR`` or ``~/.cache/dpfl_tf``.
      use_cache: read/write the decoded ``.npz`` cache (archives are still
        extracted into the cache directory unless ``extract=False``).
      num_workers: decoding threads (default: number of CPUs, at most 8).
      extract: archives only: extract once into ``<cache>/extracted/`` (default)
        or, if False, decode straight from the archive stream.
    """
    splits, class_names, image_size, num_workers = _check_options(
        splits, class_names, image_size, color_mode, num_workers
    )
    if not isinstance(extract, bool):
        raise ValueError(f"extract must be True or False, got {extract!r}")
    root, archive, cache_dir = _resolve_root(root, cache_dir)

    listing = None
    if archive:
        st = os.stat(root)
        fingerprint = [st.st_size, st.st_mtime_ns]
    else:
        tree = _tree_root(root, splits)
        listing = {s: _list_split(tree, s) for s in splits}
        fingerprint = sorted(
            [s, c, f.name, f.stat().st_size, f.stat().st_mtime_ns]
            for s, classes in listing.items()
            for c, files in classes.items()
            for f in files
        )
    key = hashlib.sha256(
        json.dumps(
            {
                "version": _CACHE_VERSION,
                "root": root,
                "fingerprint": fingerprint,
                "splits": splits,
                "class_names": class_names,
                "image_size": image_size,
                "color_mode": color_mode,
            }
        ).encode()
    ).hexdigest()[:24]
    cache_path = os.path.join(cache_dir, "image_folder", f"{_stem(root)}-{key}.npz")

    if use_cache and os.path.isfile(cache_path):
        hit = _load_cache(cache_path, key, splits)
        if hit is not None:
            logger.info("image folder %s: decoded cache %s", root, cache_path)
            return ImageFolder(root, hit[0], hit[1], cache_path, True)

    if archive and extract:
        tree = _tree_root(_extract_archive(root, cache_dir), splits)
        listing = {s: _list_split(tree, s) for s in splits}
    elif archive:
        listing = _read_archive(root, splits)

    class_names = _resolve_classes(root, listing, class_names)
    index = {c: i for i, c in enumerate(class_names)}
    paths, labels, counts = [], [], []
    for s in splits:
        n0 = len(paths)
        for c in class_names:
            for f in listing[s].get(c, []):
                paths.append(f if isinstance(f, tuple) else f.path)
                labels.append(index[c])
        counts.append(len(paths) - n0)
        if counts[-1] == 0:
            raise _no_images(root, s)
    logger.info(
        "image folder %s: decoding %d images with %d threads", root, len(paths), num_workers
    )
    x_all = _decode_all(paths, image_size, color_mode, num_workers)
    y_all = np.asarray(labels, dtype=np.int64)
    out, start = {}, 0
    for s, n in zip(splits, counts):
        out[s] = (x_all[start : start + n], y_all[start : start + n])
        start += n

    if use_cache:
        arrays = {"key": np.array(key), "class_names": np.array(class_names, dtype=str)}
        for s, (x, y) in out.items():
            arrays[f"x_{s}"], arrays[f"y_{s}"] = x, y
        try:
            _save_npz_atomic(cache_path, arrays)
        except OSError as e:
            warnings.warn(
                f"could not write the image cache {cache_path} ({e}); set "
                f"DPFL_CACHE_DIR or cache_dir= to a writable directory",
                RuntimeWarning,
                stacklevel=2,
            )
            cache_path = None
    else:
        cache_path = None
    return ImageFolder(root, tuple(class_names), out, cache_path, False)


def image_folder(
    data_dir: str | os.PathLike | None = None,
    *,
    train_split: str = "train",
    test_split: str = "test",
    class_names: Sequence[str] | None = None,
    image_size: int | tuple[int, int] | None = None,
    color_mode: str = "rgb",
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    num_workers: int | None = None,
    extract: bool = True,
    label: str | None = None,
    name: str = "image_folder",
) -> Dataset:
    """A `Dataset` from ``<data_dir>/<train_split>/<class>/*`` and ``.../<test_split>/...``.

    ``data_dir`` is the root folder or archive (required).  ``label`` is the
    name results are reported under (default: "image folder <root name>").
    Other arguments as in `read_image_folder`.
    """
    if data_dir is None:
        raise ValueError(
            "data_dir must be the image folder root (a directory or a tar archive), got None"
        )
    folder = read_image_folder(
        data_dir,
        splits=(train_split, test_split),
        class_names=class_names,
        image_size=image_size,
        color_mode=color_mode,
        cache_dir=cache_dir,
        use_cache=use_cache,
        num_workers=num_workers,
        extract=extract,
    )
    (x_train, y_train), (x_test, y_test) = (folder.splits[train_split], folder.splits[test_split])
    return Dataset(
        x_train,
        y_train,
        x_test,
        y_test,
        num_classes=len(folder.class_names),
        class_names=folder.class_names,
        name=name,
        source=DataSource(
            label or f"image folder {_stem(folder.root)}", folder.root, "image_folder"
        ),
    )


# ------------------------------------------------------------------ random access


class _Decoders:
    """A thread pool, created on first use and shared by a source and its views
    (threads, not processes: Pillow releases the GIL while it decodes)."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self._pool = None
        self._lock = threading.Lock()

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.num_workers, thread_name_prefix="dpfl-decode"
                )
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __getstate__(self):  # a pickled source starts without threads
        return {"num_workers": self.num_workers}

    def __setstate__(self, state):
        self.__init__(state["num_workers"])


class ImageFolderSource(IndexedSource):
    """One split of an image folder as a random-access source: images are
    decoded when they are read, so memory is O(batch), not O(N).

        train = ImageFolderSource("cifar10_jpg.tar.xz", "train")
        image, label = train[0]                    # uint8 (H, W, C), int
        x, y = train.__getitems__([5, 3, 8])       # uint8 (3, H, W, C), int64 (3,)
        dp_model.fit(train, lot_size=2000, preprocess=augmentation)

    ``root`` is a directory ``<root>/<split>/<class>/*.jpg|jpeg|png`` or a tar
    archive of one, extracted once into ``<cache>/extracted/`` and reused
    (a compressed archive has no random access).  Records are ordered by
    class, then file name, and labelled by index into ``class_names`` (default:
    the sorted class folders of the split) -- the order and labels of
    `read_image_folder` with the same ``class_names``.  Images are decoded
    with Pillow exactly as `read_image_folder` decodes them (same pixels),
    ``__getitems__`` in a thread pool of ``num_workers`` threads.

    Only the file names and labels are held for all N records (about 100
    bytes a record).  Every image must have the shape of record 0 (after
    ``image_size``); an image that cannot be decoded or has another shape
    raises `DatasetFormatError` naming its index and file.

    Args:
      root: a directory or a tar archive (.tar, .tar.gz, .tar.xz, ...) of one.
      split: the split folder to read.
      class_names: explicit class order (a class folder not in it is an error).
      image_size: (height, width) to resize to (bilinear); default: keep size.
      color_mode: "rgb" (C=3) or "grayscale" (C=1).
      cache_dir: where archives are extracted; default ``$DPFL_CACHE_DIR`` or
        ``~/.cache/dpfl_tf``.
      num_workers: decoding threads (default: number of CPUs, at most 8).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        split: str = "train",
        *,
        class_names: Sequence[str] | None = None,
        image_size: int | tuple[int, int] | None = None,
        color_mode: str = "rgb",
        cache_dir: str | os.PathLike | None = None,
        num_workers: int | None = None,
    ):
        if not isinstance(split, str) or not split:
            raise ValueError(f"split must be a split folder name, got {split!r}")
        _, class_names, image_size, num_workers = _check_options(
            [split], class_names, image_size, color_mode, num_workers
        )
        root, archive, cache_dir = _resolve_root(root, cache_dir)
        tree = _tree_root(_extract_archive(root, cache_dir) if archive else root, [split])
        listing = {split: _list_split(tree, split)}
        self.class_names = _resolve_classes(root, listing, class_names)
        names, labels = [], []
        for label, cls in enumerate(self.class_names):
            for entry in listing[split].get(cls, []):
                names.append(f"{cls}/{entry.name}")
                labels.append(label)
        if not names:
            raise _no_images(root, split)
        super().__init__(np.asarray(labels, dtype=np.int64))
        self.root = root
        self.split = split
        self.directory = os.path.join(tree, split)
        self.image_size = image_size
        self.color_mode = color_mode
        self._names = names
        self._decoders = _Decoders(num_workers)
        self._image_shape = None
        self._image_shape = self._decode(0, 0).shape  # record 0 sets the shape

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(height, width, channels) of every image."""
        return self._image_shape

    @property
    def element_shape(self) -> tuple[int, int, int]:
        return self._image_shape

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8)

    @property
    def num_workers(self) -> int:
        return self._decoders.num_workers

    def path(self, index: int) -> str:
        """The image file of record `index`."""
        return os.path.join(self.directory, self._names[self._row(self._position(index))])

    def close(self) -> None:
        """Stops the decoding threads (a later read starts them again)."""
        self._decoders.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return (
            f"ImageFolderSource(split={self.split!r}, records={len(self)}, "
            f"image_shape={self.image_shape}, classes={self.num_classes}, "
            f"directory={self.directory!r})"
        )

    # -- decoding ----------------------------------------------------------------
    def _decode(self, pos: int, row: int) -> np.ndarray:
        path = os.path.join(self.directory, self._names[row])
        where = f"record {pos} of split {self.split!r}"
        try:
            image = _decode_image(path, self.image_size, self.color_mode)
        except DatasetFormatError as e:
            raise DatasetFormatError(f"{where}: {e}") from e
        if self._image_shape is not None and image.shape != self._image_shape:
            got, want = "x".join(map(str, image.shape)), "x".join(map(str, self._image_shape))
            raise DatasetFormatError(
                f"{where}: {path}: image is {got} but record 0 "
                f"({os.path.join(self.directory, self._names[self._row(0)])}) is {want}; "
                "pass image_size=(height, width) to resize"
            )
        return image

    def _read_record(self, pos, row):
        return self._decode(pos, row)

    def _read_batch(self, positions, rows):
        out = np.empty((len(rows), *self._image_shape), np.uint8)

        def work(lo: int, hi: int) -> None:
            for k in range(lo, hi):
                out[k] = self._decode(int(positions[k]), int(rows[k]))

        n, workers = len(rows), self._decoders.num_workers
        if workers == 1 or n <= _INLINE:
            work(0, n)
            return out
        size = max(_INLINE, -(-n // (4 * workers)))  # ~4 tasks a thread: balanced, few tasks
        pool = self._decoders.pool()
        futures = [pool.submit(work, lo, min(n, lo + size)) for lo in range(0, n, size)]
        try:
            for future in futures:
                future.result()  # re-raises the first decoding error, by position
        finally:
            for future in futures:
                future.cancel()
        return out

"""Finding a dataset's files on disk, in one documented order.

Machines running dpfl_tf are often offline, so a loader never assumes the
download works.  For a dataset it looks, in this order, in

  1. the explicit ``data_dir`` argument,
  2. every directory in the ``DPFL_DATA_DIR`` environment variable
     (``os.pathsep``-separated),
  3. the Keras cache ``$KERAS_HOME/datasets`` (default ``~/.keras/datasets``),
  4. the system data directory ``/usr/share/datasets`` (Debian's
     ``dataset-*`` packages install there),

each directory itself and then its per-dataset subfolders (e.g.
``/usr/share/datasets/fashion-mnist/``).  The first directory holding a
complete file set wins.  Then it tries the normal download (Keras
``keras.utils.get_file`` with the official URL, into the Keras cache, so the
next search finds it), unless ``download=False`` or ``DPFL_NO_DOWNLOAD=1``.
When all of that fails it raises `DatasetNotFoundError` naming the dataset,
every place looked at (full paths) and how to provide the files.

File names that are not specific to one dataset (the IDX names
``train-images-idx3-ubyte.gz`` etc. are shared by MNIST and Fashion-MNIST)
are only accepted in the explicit ``data_dir`` and in per-dataset subfolders,
never at the top of a shared directory, so one dataset can never be silently
read as another.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import urllib.error
import urllib.request
from typing import Sequence

__all__ = [
    "DatasetFiles",
    "DatasetFormatError",
    "DatasetNotFoundError",
    "FileSet",
    "Located",
    "SearchPlace",
    "KNOWN_FILES",
    "SYSTEM_DATA_DIRS",
    "download_enabled",
    "keras_cache_dir",
    "locate",
    "search_places",
]

logger = logging.getLogger("dpfl_tf.data")

#: System-wide data directories (Debian's dataset-* packages).  A module
#: attribute, read at call time, so tests can point it elsewhere.
SYSTEM_DATA_DIRS: tuple[str, ...] = ("/usr/share/datasets",)

#: Seconds the reachability probe before a download may take; offline it
#: fails at once (no DNS), behind a black-holed network it gives up after this.
DOWNLOAD_PROBE_TIMEOUT = 10.0
#: Socket timeout (seconds of silence) while a download is running.
DOWNLOAD_SOCKET_TIMEOUT = 60.0

_TRUE = {"1", "true", "yes", "on"}


class DatasetNotFoundError(FileNotFoundError):
    """No copy of a dataset was found and none could be downloaded.

    Attributes: ``dataset`` (display name), ``places`` (the `SearchPlace`s
    looked at, in order), ``download_error`` (why the download did not
    happen or failed, or None).
    """

    def __init__(
        self,
        message: str,
        *,
        dataset: str = "",
        places: Sequence["SearchPlace"] = (),
        download_error: str | None = None,
        cli_message: str | None = None,
    ):
        super().__init__(message)
        self.dataset = dataset
        self.places = tuple(places)
        self.download_error = download_error
        #: the same, with the command line's words (--data-dir) for the Python ones
        self.cli_message = cli_message or message

    def __str__(self) -> str:  # FileNotFoundError would print "[Errno None]" otherwise
        return self.args[0] if self.args else ""


class DatasetFormatError(ValueError):
    """A dataset file exists but is not in the expected format (names the file)."""


@dataclasses.dataclass(frozen=True)
class FileSet:
    """One accepted on-disk layout of a dataset: files that must all be present.

    Attributes:
      name: short id of the layout, e.g. ``"npz"``, ``"idx"``, ``"tarball"``.
      files: one entry per required file; each entry is a tuple of accepted
        relative paths, the first preferred (e.g. ``("x.gz", "x")``).
      generic_names: the names are not specific to this dataset, so they are
        only accepted in the explicit data_dir and per-dataset subfolders.
      urls: official download URL of the first alternative of each file
        (empty when the layout is not downloadable).
      hashes: sha256 (or md5) of each downloaded file, None when unknown.
      download_subdir: folder under ``<keras cache>/datasets`` to download to.
    """

    name: str
    files: tuple[tuple[str, ...], ...]
    generic_names: bool = False
    urls: tuple[str, ...] = ()
    hashes: tuple[str | None, ...] = ()
    download_subdir: str = ""

    def __post_init__(self):
        if not self.files or any(not alts for alts in self.files):
            raise ValueError(f"FileSet {self.name!r}: every file needs at least one name")
        if self.urls and len(self.urls) != len(self.files):
            raise ValueError(
                f"FileSet {self.name!r}: {len(self.urls)} urls for {len(self.files)} files"
            )
        if self.hashes and len(self.hashes) != len(self.urls):
            raise ValueError(
                f"FileSet {self.name!r}: {len(self.hashes)} hashes for {len(self.urls)} urls"
            )

    def match(self, directory: str) -> tuple[str, ...] | None:
        """The full paths of the files if all are present in `directory`, else None."""
        found = []
        for alternatives in self.files:
            for rel in alternatives:
                path = os.path.join(directory, rel)
                if os.path.exists(path):
                    found.append(path)
                    break
            else:
                return None
        return tuple(found)

    def describe(self) -> str:
        return ", ".join(" or ".join(alts) for alts in self.files)


@dataclasses.dataclass(frozen=True)
class DatasetFiles:
    """What to look for to find one dataset.

    Attributes:
      name: registry id (``"fashion_mnist"``).
      display_name: human name used in messages and reports (``"Fashion-MNIST"``).
      file_sets: accepted layouts, in order of preference within one directory.
      subdirs: per-dataset subfolder names tried inside every searched directory.
      how_to_get: extra lines for the error message (e.g. a Debian package).
    """

    name: str
    display_name: str
    file_sets: tuple[FileSet, ...]
    subdirs: tuple[str, ...] = ()
    how_to_get: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class SearchPlace:
    """A directory that is searched, and why (``origin``)."""

    path: str
    origin: str
    specific: bool  # per-dataset folder (or explicit data_dir): generic names allowed

    def status(self) -> str:
        return "" if os.path.isdir(self.path) else " (does not exist)"


@dataclasses.dataclass(frozen=True)
class Located:
    """Where a dataset was found: the layout, the directory and the files."""

    dataset: DatasetFiles
    file_set: FileSet
    directory: str
    paths: tuple[str, ...]
    downloaded: bool = False


# --------------------------------------------------------------------------- search


def keras_cache_dir() -> str:
    """``$KERAS_HOME/datasets`` (default ``~/.keras/datasets``), like `keras.utils.get_file`."""
    home = os.environ.get("KERAS_HOME") or os.path.join("~", ".keras")
    return os.path.abspath(os.path.join(os.path.expanduser(home), "datasets"))


def download_enabled(download: bool | None = None) -> bool:
    """The explicit argument if given, else False iff ``DPFL_NO_DOWNLOAD`` is 1/true/yes/on."""
    if download is not None:
        if not isinstance(download, bool):
            raise ValueError(f"download must be True, False or None, got {download!r}")
        return download
    return os.environ.get("DPFL_NO_DOWNLOAD", "").strip().lower() not in _TRUE


def search_places(
    dataset: DatasetFiles | str, data_dir: str | os.PathLike | None = None
) -> list[SearchPlace]:
    """The directories searched for `dataset`, in order, duplicates removed."""
    spec = _spec(dataset)
    bases: list[tuple[str, str, bool]] = []
    if data_dir is not None:
        bases.append((os.fspath(data_dir), "data_dir argument", True))
    env = os.environ.get("DPFL_DATA_DIR", "")
    for entry in env.split(os.pathsep):
        if entry.strip():
            bases.append((entry.strip(), "DPFL_DATA_DIR", False))
    bases.append((keras_cache_dir(), "Keras cache", False))
    for system_dir in SYSTEM_DATA_DIRS:
        bases.append((system_dir, "system datasets", False))

    places: list[SearchPlace] = []
    seen: set[str] = set()

    def add(path: str, origin: str, specific: bool) -> None:
        path = os.path.abspath(os.path.expanduser(path))
        if path not in seen:
            seen.add(path)
            places.append(SearchPlace(path, origin, specific))

    subdirs = list(spec.subdirs)  # downloads land in a subfolder: search it too
    subdirs += [
        fs.download_subdir
        for fs in spec.file_sets
        if fs.download_subdir and fs.download_subdir not in subdirs
    ]
    for base, origin, specific in bases:
        add(base, origin, specific)
        for sub in subdirs:
            add(os.path.join(os.path.expanduser(base), sub), origin + ", per-dataset folder", True)
    return places


def locate(
    dataset: DatasetFiles | str,
    data_dir: str | os.PathLike | None = None,
    *,
    download: bool | None = None,
    file_sets: Sequence[str] | None = None,
    probe_timeout: float | None = None,
) -> Located:
    """Finds (or downloads) the files of `dataset`; see the module docstring for the order.

    Args:
      dataset: a `DatasetFiles` or the name of one in `KNOWN_FILES`.
      data_dir: an explicit directory, searched first.
      download: try the official download after the local search; None (default)
        means yes unless the environment variable ``DPFL_NO_DOWNLOAD`` is set to 1.
      file_sets: restrict the search to these layout names (default: all).
      probe_timeout: seconds allowed for the reachability check before a
        download (default `DOWNLOAD_PROBE_TIMEOUT`).

    Raises:
      DatasetNotFoundError: nothing found and no download possible; the
        message names every directory looked at and how to provide the files.
    """
    spec = _spec(dataset)
    sets = spec.file_sets
    if file_sets is not None:
        wanted = tuple(file_sets)
        unknown = [n for n in wanted if n not in {fs.name for fs in spec.file_sets}]
        if unknown:
            raise ValueError(
                f"file_sets must be names from {[fs.name for fs in spec.file_sets]}, got {unknown}"
            )
        sets = tuple(fs for fs in spec.file_sets if fs.name in wanted)
    places = search_places(spec, data_dir)
    for place in places:
        if not os.path.isdir(place.path):
            continue
        for fs in sets:
            if fs.generic_names and not place.specific:
                continue
            paths = fs.match(place.path)
            if paths is not None:
                logger.info("%s: using %s files in %s", spec.display_name, fs.name, place.path)
                return Located(spec, fs, place.path, paths)

    download_error: str | None
    if not download_enabled(download):
        download_error = "download disabled (download=False argument or DPFL_NO_DOWNLOAD=1)"
    else:
        downloadable = [fs for fs in sets if fs.urls]
        if not downloadable:
            download_error = "no official download for these files"
        else:
            fs = downloadable[0]
            timeout = DOWNLOAD_PROBE_TIMEOUT if probe_timeout is None else probe_timeout
            located, download_error = _try_download(spec, fs, timeout)
            if located is not None:
                return located
    raise DatasetNotFoundError(
        _not_found_message(spec, sets, places, download_error),
        dataset=spec.display_name,
        places=places,
        download_error=download_error,
        cli_message=_not_found_message(spec, sets, places, download_error, cli=True),
    )


# ------------------------------------------------------------------------- download


def _probe(url: str, timeout: float) -> str | None:
    """None if `url` answers within `timeout` seconds, else the reason it did not.

    Runs in a daemon thread so that even a slow DNS lookup (not covered by
    socket timeouts) cannot hold the caller longer than `timeout`.
    """
    result: list[str | None] = []

    def run():
        try:
            request = urllib.request.Request(url, method="HEAD")
            with urllib.request.urlopen(request, timeout=timeout):
                pass
            result.append(None)
        except urllib.error.HTTPError:  # the server answered (maybe 405 to HEAD): reachable
            result.append(None)
        except Exception as e:  # noqa: BLE001 -- any failure means "not reachable"
            result.append(f"{type(e).__name__}: {e}")

    thread = threading.Thread(target=run, daemon=True, name="dpfl-download-probe")
    thread.start()
    thread.join(timeout + 1.0)
    if not result:
        return f"no answer from {url} within {timeout:g} s"
    return result[0]


def _try_download(
    spec: DatasetFiles, fs: FileSet, timeout: float
) -> tuple[Located | None, str | None]:
    target_dir = os.path.join(keras_cache_dir(), fs.download_subdir)
    reason = _probe(fs.urls[0], timeout)
    if reason is not None:
        return None, f"download failed: {fs.urls[0]}: {reason}"
    try:
        from keras.utils import get_file  # imported late: Keras pulls in TensorFlow
    except Exception as e:  # noqa: BLE001
        return None, f"download impossible: cannot import keras.utils.get_file ({e})"
    try:  # get_file falls back to /tmp/.keras when the cache dir does not exist yet
        os.makedirs(target_dir, exist_ok=True)
    except OSError:
        pass
    paths = []
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_SOCKET_TIMEOUT)
    try:
        for i, url in enumerate(fs.urls):
            fname = fs.files[i][0]
            file_hash = fs.hashes[i] if fs.hashes else None
            try:
                paths.append(
                    get_file(
                        fname=os.path.basename(fname),
                        origin=url,
                        file_hash=file_hash,
                        cache_dir=os.path.dirname(keras_cache_dir()),
                        cache_subdir=os.path.join("datasets", fs.download_subdir)
                        if fs.download_subdir
                        else "datasets",
                    )
                )
            except Exception as e:  # noqa: BLE001 -- offline: URLError wrapped by Keras
                return None, f"download failed: {url}: {e}"
    finally:
        socket.setdefaulttimeout(previous)
    matched = fs.match(os.path.dirname(paths[0])) or tuple(paths)
    logger.info("%s: downloaded to %s", spec.display_name, target_dir)
    return Located(spec, fs, os.path.dirname(paths[0]), matched, downloaded=True), None


# -------------------------------------------------------------------------- message


def _not_found_message(
    spec: DatasetFiles,
    sets: Sequence[FileSet],
    places: Sequence[SearchPlace],
    download_error: str | None,
    cli: bool = False,
) -> str:
    """Where we looked and how to provide the files; `cli`: in the words of the
    `dpfl-tf` command line (``--data-dir``) instead of Python's (``data_dir=``)."""
    lines = [
        f"Could not find the {spec.display_name} dataset ({spec.name!r}).",
        "Looked for any one of these file sets:",
    ]
    data_dir = "--data-dir" if cli else "data_dir"
    for fs in sets:
        where = f" (only in {data_dir} and per-dataset folders)" if fs.generic_names else ""
        lines.append(f"  - [{fs.name}] {fs.describe()}{where}")
    lines.append("in these places, in this order:")
    for i, place in enumerate(places, 1):
        origin = place.origin.replace("data_dir argument", "--data-dir") if cli else place.origin
        lines.append(f"  {i}. {place.path}  [{origin}]{place.status()}")
    if not os.environ.get("DPFL_DATA_DIR", "").strip():
        lines.append("  (DPFL_DATA_DIR is not set)")
    if download_error:
        if cli:
            download_error = download_error.replace("download=False argument or ", "")
        lines.append(f"Download: {download_error}.")
    lines.append("To provide the files:")
    lines.append(
        "  - put them in a directory and set the environment variable "
        "DPFL_DATA_DIR=/that/dir, or pass "
        + ("--data-dir /that/dir;" if cli else "data_dir='/that/dir';")
    )
    urls = [u for fs in sets for u in fs.urls]
    if urls:
        allow = "DPFL_NO_DOWNLOAD unset" if cli else "download=True, DPFL_NO_DOWNLOAD unset"
        lines.append(
            f"  - or, online, allow the download ({allow}) from {urls[0]}"
            + (f" (+{len(urls) - 1} more files)" if len(urls) > 1 else "")
            + f" into {keras_cache_dir()};"
        )
    lines.extend(f"  - {line}" for line in spec.how_to_get)
    return "\n".join(lines)


# -------------------------------------------------------------------------- catalog

_KERAS_BASE = "https://storage.googleapis.com/tensorflow/tf-keras-datasets/"
_IDX_NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def _idx_file_set(urls: Sequence[str] = (), download_subdir: str = "") -> FileSet:
    return FileSet(
        "idx",
        tuple((n + ".gz", n) for n in _IDX_NAMES),
        generic_names=True,
        urls=tuple(urls),
        download_subdir=download_subdir,
    )


MNIST_FILES = DatasetFiles(
    name="mnist",
    display_name="MNIST",
    file_sets=(
        FileSet(
            "npz",
            (("mnist.npz",),),
            urls=(_KERAS_BASE + "mnist.npz",),
            hashes=("731c5ac602752760c8e48fbffcf8c3b850d9dc2a2aedcf2cc48468fc17b673d1",),
        ),
        _idx_file_set(),
    ),
    subdirs=("mnist",),
)

FASHION_MNIST_FILES = DatasetFiles(
    name="fashion_mnist",
    display_name="Fashion-MNIST",
    file_sets=(
        _idx_file_set(
            [_KERAS_BASE + n + ".gz" for n in _IDX_NAMES], download_subdir="fashion-mnist"
        ),
        FileSet("npz", (("fashion-mnist.npz", "fashion_mnist.npz"),)),
    ),
    subdirs=("fashion-mnist", "fashion_mnist"),
    how_to_get=(
        "on Debian/Ubuntu: apt-get update && apt-get install -y dataset-fashion-mnist "
        "(installs the four IDX files in /usr/share/datasets/fashion-mnist/).",
    ),
)

_CIFAR10_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch",)

CIFAR10_FILES = DatasetFiles(
    name="cifar10",
    display_name="CIFAR-10",
    file_sets=(
        FileSet("extracted", tuple((f"cifar-10-batches-py/{b}",) for b in _CIFAR10_BATCHES)),
        FileSet(
            "tarball",
            (("cifar-10-python.tar.gz", "cifar-10-batches-py.tar.gz"),),
            urls=("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",),
            hashes=("6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",),
        ),
    ),
    # Keras 3 extracts its download to cifar-10-batches-py-target/cifar-10-batches-py/.
    subdirs=("cifar10", "cifar-10", "cifar-10-batches-py-target"),
)

CIFAR10_JPEG_FILES = DatasetFiles(
    name="cifar10_jpg",
    display_name="CIFAR-10 (JPEG copy)",
    file_sets=(FileSet("image_folder", (("cifar10_jpg.tar.xz", "cifar10_jpg"),)),),
    subdirs=("cifar10", "cifar-10"),
    how_to_get=(
        "offline substitute: the image-folder copy cifar10_jpg.tar.xz "
        "(train/<class>/NNNN.jpg, test/<class>/NNNN.jpg) in DPFL_DATA_DIR; results "
        "on it are reported as 'CIFAR-10 (JPEG copy)'.",
    ),
)

CIFAR100_FILES = DatasetFiles(
    name="cifar100",
    display_name="CIFAR-100",
    file_sets=(
        FileSet("extracted", (("cifar-100-python/train",), ("cifar-100-python/test",))),
        FileSet(
            "tarball",
            (("cifar-100-python.tar.gz",),),
            urls=("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",),
            hashes=("85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7",),
        ),
    ),
    subdirs=("cifar100", "cifar-100", "cifar-100-python-target"),
    how_to_get=(
        "CIFAR-100 has no offline copy on these machines; download it where "
        "you have internet and copy cifar-100-python.tar.gz into DPFL_DATA_DIR.",
    ),
)

#: Known datasets by name.  Add a `DatasetFiles` here to make `locate(name)` find it.
KNOWN_FILES: dict[str, DatasetFiles] = {
    spec.name: spec
    for spec in (
        MNIST_FILES,
        FASHION_MNIST_FILES,
        CIFAR10_FILES,
        CIFAR10_JPEG_FILES,
        CIFAR100_FILES,
    )
}


def _spec(dataset: DatasetFiles | str) -> DatasetFiles:
    if isinstance(dataset, DatasetFiles):
        return dataset
    try:
        return KNOWN_FILES[dataset]
    except (KeyError, TypeError):
        raise ValueError(
            f"dataset must be a DatasetFiles or one of {sorted(KNOWN_FILES)}, got {dataset!r}"
        ) from None

"""Helpers shared by the dpfl_tf.data tests: isolated search paths and small
files written in the exact canonical layouts (IDX, mnist.npz, CIFAR pickles,
image folders), plus a real slice of the offline CIFAR-10 JPEG copy."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# README: tests point DPFL_DATA_DIR at ../shared/data (relative to the project root).
SHARED_DATA = (PROJECT_ROOT / ".." / "shared" / "data").resolve()
CIFAR10_JPEG_ARCHIVE = SHARED_DATA / "cifar10_jpg.tar.xz"
FASHION_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")


def isolate(monkeypatch, tmp_path: Path, *, system: bool = False) -> dict[str, Path]:
    """Search only temp dirs: no DPFL_DATA_DIR, Keras cache and system dir in tmp,
    downloads off, image cache in tmp.  With system=True the real
    /usr/share/datasets stays searched."""
    import dpfl_tf.data.locate as locate

    places = {name: tmp_path / name for name in ("data_dir", "env", "keras_home", "system")}
    places["keras"] = places["keras_home"] / "datasets"
    places["cache"] = tmp_path / "cache"
    monkeypatch.delenv("DPFL_DATA_DIR", raising=False)
    monkeypatch.setenv("DPFL_NO_DOWNLOAD", "1")
    monkeypatch.setenv("KERAS_HOME", str(places["keras_home"]))
    monkeypatch.setenv("DPFL_CACHE_DIR", str(places["cache"]))
    if not system:
        monkeypatch.setattr(locate, "SYSTEM_DATA_DIRS", (str(places["system"]),))
    return places


# ------------------------------------------------------------------- MNIST-like


def mnist_arrays(n_train: int = 12, n_test: int = 7, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_train, dtype=np.uint8),
        rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_test, dtype=np.uint8),
    )


def write_npz(path: Path, arrays) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    x_train, y_train, x_test, y_test = arrays
    np.savez(path, x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    return path


def idx_bytes(array: np.ndarray) -> bytes:
    """The IDX encoding of `array`, written independently of the reader."""
    codes = {
        np.dtype("u1"): 0x08,
        np.dtype("i1"): 0x09,
        np.dtype("i2"): 0x0B,
        np.dtype("i4"): 0x0C,
        np.dtype("f4"): 0x0D,
        np.dtype("f8"): 0x0E,
    }
    code = codes[array.dtype.newbyteorder("=")]
    header = bytes([0, 0, code, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx_set(directory: Path, arrays, gz: bool = True) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    names = [
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ]
    for name, array in zip(names, arrays):
        data = idx_bytes(array)
        if gz:
            (directory / (name + ".gz")).write_bytes(gzip.compress(data))
        else:
            (directory / name).write_bytes(data)
    return directory


# ------------------------------------------------------------------------- CIFAR


def cifar_rows(images_nhwc: np.ndarray) -> np.ndarray:
    """(N, 32, 32, 3) -> canonical (N, 3072) rows: R plane, G plane, B plane."""
    n = len(images_nhwc)
    rows = np.empty((n, 3072), dtype=np.uint8)
    for ch in range(3):
        rows[:, ch * 1024 : (ch + 1) * 1024] = images_nhwc[..., ch].reshape(n, 1024)
    return rows


class _Py2Pickler(pickle._Pickler):
    """Pickles like Python 2's cPickle wrote the original CIFAR files: byte strings
    as str (BINSTRING opcodes, read back as bytes with encoding="bytes") and numpy
    globals under their numpy < 2 names (numpy.core.multiarray._reconstruct)."""

    dispatch = dict(pickle._Pickler.dispatch)

    def _save_py2_str(self, obj):
        if len(obj) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(obj)]) + obj)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(obj)) + obj)
        self.memoize(obj)

    dispatch[bytes] = _save_py2_str

    def _save_py2_native_str(self, obj):  # Python 2 str literals ('u1', '|') were bytes
        self._save_py2_str(obj.encode("ascii"))

    dispatch[str] = _save_py2_native_str

    def save_global(self, obj, name=None):
        module = obj.__module__
        if module.startswith("numpy._core"):
            module = "numpy.core" + module[len("numpy._core") :]
        self.write(pickle.GLOBAL + f"{module}\n{name or obj.__qualname__}\n".encode())
        self.memoize(obj)


def cifar_pickle(obj: dict) -> bytes:
    """Python-2-style protocol-2 pickle, as in the canonical CIFAR python version."""
    buffer = io.BytesIO()
    _Py2Pickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def write_cifar10(
    directory: Path,
    n_per_batch: int = 4,
    *,
    tarball: bool = False,
    seed: int = 0,
    meta: bool = True,
    skip: tuple[str, ...] = (),
):
    """Canonical cifar-10-batches-py/ (or cifar-10-python.tar.gz) in `directory`.

    Returns (x_train, y_train, x_test, y_test) in NHWC as written."""
    rng = np.random.default_rng(seed)
    batches = {}
    xs, ys = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = rng.integers(0, 256, (n_per_batch, 32, 32, 3), dtype=np.uint8)
        y = [int(v) for v in rng.integers(0, 10, n_per_batch)]
        xs.append(x)
        ys.append(np.array(y))
        batches[name] = cifar_pickle(
            {
                b"batch_label": f"{name} of 5".encode(),
                b"labels": y,
                b"data": cifar_rows(x),
                b"filenames": [f"img_{i}.png".encode() for i in range(n_per_batch)],
            }
        )
    if meta:
        batches["batches.meta"] = cifar_pickle(
            {
                b"num_cases_per_batch": n_per_batch,
                b"num_vis": 3072,
                b"label_names": [
                    c.encode()
                    for c in (
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
                ],
            }
        )
    _write_members(
        directory,
        "cifar-10-batches-py",
        "cifar-10-python.tar.gz",
        {k: v for k, v in batches.items() if k not in skip},
        tarball,
    )
    return np.concatenate(xs[:5]), np.concatenate(ys[:5]), xs[5], ys[5]


def write_cifar100(
    directory: Path, n_train: int = 10, n_test: int = 6, *, tarball: bool = False, seed: int = 0
):
    rng = np.random.default_rng(seed)
    out, members = {}, {}
    for name, n in (("train", n_train), ("test", n_test)):
        x = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        fine = [int(v) for v in rng.integers(0, 100, n)]
        coarse = [int(v) for v in rng.integers(0, 20, n)]
        out[name] = (x, np.array(fine), np.array(coarse))
        members[name] = cifar_pickle(
            {
                b"filenames": [b"a.png"] * n,
                b"batch_label": name.encode(),
                b"fine_labels": fine,
                b"coarse_labels": coarse,
                b"data": cifar_rows(x),
            }
        )
    _write_members(directory, "cifar-100-python", "cifar-100-python.tar.gz", members, tarball)
    return out


def _write_members(directory: Path, folder: str, archive: str, members: dict, tarball: bool):
    directory.mkdir(parents=True, exist_ok=True)
    staging = directory / folder
    staging.mkdir(parents=True, exist_ok=True)
    for name, data in members.items():
        (staging / name).write_bytes(data)
    if tarball:
        with tarfile.open(directory / archive, "w:gz") as tar:
            tar.add(staging, arcname=folder)
        for f in staging.iterdir():
            f.unlink()
        staging.rmdir()


# ------------------------------------------------------------------ image folders


def real_cifar10_jpeg_slice(dest: Path, n_test: int = 20, n_train: int = 0) -> Path:
    """The first `n_test` (`n_train`) files per class of the real JPEG copy, into
    dest/<split>/<class>/.  Streams the archive and stops once it has them: only
    these files are extracted (test/ comes first in the archive)."""
    want = {"test": n_test, "train": n_train}
    counts: dict[tuple[str, str], int] = {}
    needed = 10 * n_test + 10 * n_train
    got = 0
    with tarfile.open(CIFAR10_JPEG_ARCHIVE, "r|xz") as tar:
        for member in tar:
            parts = member.name.split("/")
            if not member.isfile() or len(parts) != 3 or parts[0] not in want:
                continue
            split, cls, name = parts
            if counts.get((split, cls), 0) >= want[split]:
                continue
            counts[(split, cls)] = counts.get((split, cls), 0) + 1
            target = dest / split / cls / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(tar.extractfile(member).read())
            got += 1
            if got == needed:
                break
    return dest


def make_tar(source_dir: Path, archive: Path, *, top: str | None = None) -> Path:
    """Archives the contents of source_dir (mode from the suffix), optionally under `top`/."""
    mode = {".tar": "w", ".gz": "w:gz", ".xz": "w:xz", ".bz2": "w:bz2"}[archive.suffix]
    with tarfile.open(archive, mode) as tar:
        for child in sorted(source_dir.iterdir()):
            tar.add(child, arcname=f"{top}/{child.name}" if top else child.name)
    return archive


def touch_later(path: Path, seconds: float = 10.0) -> None:
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + int(seconds * 1e9)))

"""CIFAR-10/100 in the canonical python layout (small generated pickles and
tarballs) and the CIFAR-10 fallback to a real slice of the offline JPEG copy."""

import os
import pickle

import numpy as np
import pytest

from dpfl_tf.data import (
    ArraySource,
    DatasetFormatError,
    DatasetNotFoundError,
    ImageFolderSource,
    load_dataset,
)
from dpfl_tf.data.cifar import (
    CIFAR10_CLASSES,
    CIFAR100_COARSE_CLASSES,
    CIFAR100_FINE_CLASSES,
    JPEG_COPY_LABEL,
    cifar10,
    cifar10_sources,
    cifar100,
    read_cifar_pickle,
)
from tests.data import (
    CIFAR10_JPEG_ARCHIVE,
    cifar_pickle,
    cifar_rows,
    isolate,
    make_tar,
    real_cifar10_jpeg_slice,
    write_cifar10,
    write_cifar100,
)


def test_canonical_row_layout_is_rgb_planes_row_major():
    """Independent of the writer helper: place single bytes in the 3072-vector."""
    data = np.zeros((1, 3072), dtype=np.uint8)
    data[0, 0] = 11  # R at (row 0, col 0)
    data[0, 1024 + 31] = 22  # G at (row 0, col 31)
    data[0, 2048 + 32 * 1 + 2] = 33  # B at (row 1, col 2)
    data[0, 32 * 31 + 30] = 44  # R at (row 31, col 30)
    raw = pickle.dumps({b"data": data, b"labels": [3]}, protocol=2)
    from dpfl_tf.data.cifar import _images_and_labels

    x, y = _images_and_labels(read_cifar_pickle(raw), "labels", 10, "t")
    assert x.shape == (1, 32, 32, 3) and x.dtype == np.uint8 and x.flags.c_contiguous
    assert x[0, 0, 0, 0] == 11 and x[0, 0, 31, 1] == 22 and x[0, 1, 2, 2] == 33
    assert x[0, 31, 30, 0] == 44 and int(x.sum()) == 11 + 22 + 33 + 44
    assert y.tolist() == [3] and y.dtype == np.int64


@pytest.mark.parametrize("tarball", [False, True])
def test_cifar10_canonical(monkeypatch, tmp_path, tarball):
    places = isolate(monkeypatch, tmp_path)
    x_train, y_train, x_test, y_test = write_cifar10(places["data_dir"], tarball=tarball)
    ds = load_dataset("cifar10", data_dir=places["data_dir"])
    np.testing.assert_array_equal(ds.x_train, x_train)
    np.testing.assert_array_equal(ds.y_train, y_train)
    np.testing.assert_array_equal(ds.x_test, x_test)
    np.testing.assert_array_equal(ds.y_test, y_test)
    assert ds.x_train.shape == (20, 32, 32, 3) and ds.x_train.dtype == np.uint8
    assert ds.y_train.dtype == np.int64 and ds.class_names == CIFAR10_CLASSES
    assert ds.name == "cifar10" and ds.source.label == "CIFAR-10"
    if tarball:
        assert ds.source.format == "tarball"
        assert ds.source.path == str(places["data_dir"] / "cifar-10-python.tar.gz")
    else:
        assert ds.source.format == "extracted"
        assert ds.source.path == str(places["data_dir"] / "cifar-10-batches-py")


def test_cifar10_keras3_cache_layout_and_missing_meta(monkeypatch, tmp_path):
    places = isolate(monkeypatch, tmp_path)
    x_train, *_ = write_cifar10(places["keras"] / "cifar-10-batches-py-target", meta=False)
    ds = cifar10()
    np.testing.assert_array_equal(ds.x_train, x_train)
    assert ds.class_names == CIFAR10_CLASSES


def test_cifar10_archive_missing_a_batch(monkeypatch, tmp_path):
    places = isolate(monkeypatch, tmp_path)
    write_cifar10(places["data_dir"], tarball=True, skip=("data_batch_3",))
    with pytest.raises(
        DatasetFormatError,
        match=r"cifar-10-python.tar.gz: missing "
        r"\['data_batch_3'\]",
    ):
        cifar10(places["data_dir"])


def test_cifar_pickle_errors(monkeypatch, tmp_path):
    places = isolate(monkeypatch, tmp_path)
    write_cifar10(places["data_dir"])
    batch = places["data_dir"] / "cifar-10-batches-py" / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:100])
    with pytest.raises(DatasetFormatError, match="data_batch_2: not a valid CIFAR pickle"):
        cifar10(places["data_dir"])

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    batch.write_bytes(pickle.dumps({b"data": Evil()}, protocol=2))
    with pytest.raises(DatasetFormatError, match="refusing to load"):
        cifar10(places["data_dir"])

    batch.write_bytes(cifar_pickle({b"data": np.zeros((2, 3072), np.uint8), b"labels": [0, 10]}))
    with pytest.raises(DatasetFormatError, match=r"must lie in \[0, 10\)"):
        cifar10(places["data_dir"])
    batch.write_bytes(cifar_pickle({b"data": np.zeros((2, 3000), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(DatasetFormatError, match=r"uint8 \(N, 3072\)"):
        cifar10(places["data_dir"])


@pytest.mark.parametrize("tarball", [False, True])
def test_cifar100_fine_and_coarse(monkeypatch, tmp_path, tarball):
    places = isolate(monkeypatch, tmp_path)
    written = write_cifar100(places["data_dir"], tarball=tarball)
    fine = cifar100(places["data_dir"])
    coarse = load_dataset("cifar100", data_dir=places["data_dir"], label_mode="coarse")
    for ds, col in ((fine, 1), (coarse, 2)):
        np.testing.assert_array_equal(ds.x_train, written["train"][0])
        np.testing.assert_array_equal(ds.x_test, written["test"][0])
        np.testing.assert_array_equal(ds.y_train, written["train"][col])
        np.testing.assert_array_equal(ds.y_test, written["test"][col])
    assert fine.num_classes == 100 and fine.class_names == CIFAR100_FINE_CLASSES
    assert coarse.num_classes == 20 and coarse.class_names == CIFAR100_COARSE_CLASSES
    assert fine.source.label == "CIFAR-100" and "coarse" in coarse.source.label
    with pytest.raises(ValueError, match="label_mode must be 'fine' or 'coarse', got 'both'"):
        cifar100(places["data_dir"], label_mode="both")


def test_cifar100_meta_names(monkeypatch, tmp_path):
    places = isolate(monkeypatch, tmp_path)
    write_cifar100(places["data_dir"])
    names = [f"c{i}".encode() for i in range(20)]
    (places["data_dir"] / "cifar-100-python" / "meta").write_bytes(
        cifar_pickle({b"fine_label_names": [b"x"] * 100, b"coarse_label_names": names})
    )
    assert cifar100(places["data_dir"], label_mode="coarse").class_names[3] == "c3"


def test_cifar100_not_found_message(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    with pytest.raises(DatasetNotFoundError, match="cifar-100-python.tar.gz") as info:
        cifar100()
    assert str(tmp_path / "keras_home" / "datasets") in str(info.value)


# ------------------------------------------------------------- JPEG copy fallback

needs_jpeg_copy = pytest.mark.skipif(
    not CIFAR10_JPEG_ARCHIVE.is_file(), reason=f"no offline JPEG copy at {CIFAR10_JPEG_ARCHIVE}"
)


@pytest.fixture(scope="module")
def jpeg_copy_slice(tmp_path_factory):
    """cifar10_jpg.tar.xz holding 20 test + 4 train real images per class."""
    tree = real_cifar10_jpeg_slice(tmp_path_factory.mktemp("tree"), n_test=20, n_train=4)
    out = tmp_path_factory.mktemp("slice")
    return make_tar(tree, out / "cifar10_jpg.tar.xz")


@needs_jpeg_copy
def test_cifar10_falls_back_to_jpeg_copy_and_says_so(monkeypatch, tmp_path, jpeg_copy_slice):
    isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("DPFL_DATA_DIR", str(jpeg_copy_slice.parent))
    ds = load_dataset("cifar10")
    assert ds.source.label == JPEG_COPY_LABEL == "CIFAR-10 (JPEG copy)"
    assert ds.name == "cifar10_jpg" and "JPEG" in ds.source.note
    assert ds.source.path == str(jpeg_copy_slice) and ds.source.format == "image_folder"
    assert ds.x_train.shape == (40, 32, 32, 3) and ds.x_test.shape == (200, 32, 32, 3)
    assert ds.x_test.dtype == np.uint8 and ds.class_names == CIFAR10_CLASSES
    assert np.bincount(ds.y_test).tolist() == [20] * 10
    assert ds.y_train.tolist() == [c for c in range(10) for _ in range(4)]
    assert ds.x_test.std() > 20  # real photographs, not blank decodes
    # decoded once, then served from the cache (under DPFL_CACHE_DIR)
    assert os.listdir(tmp_path / "cache" / "image_folder")
    again = cifar10()
    np.testing.assert_array_equal(again.x_test, ds.x_test)

    with pytest.raises(DatasetNotFoundError, match="CIFAR-10"):
        cifar10(allow_jpeg_copy=False)


@needs_jpeg_copy
def test_canonical_copy_is_preferred_over_the_jpeg_copy(monkeypatch, tmp_path, jpeg_copy_slice):
    places = isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("DPFL_DATA_DIR", str(jpeg_copy_slice.parent))
    x_train, *_ = write_cifar10(places["system"], tarball=True)  # lowest-priority place
    ds = cifar10()
    assert ds.source.label == "CIFAR-10" and ds.name == "cifar10"
    np.testing.assert_array_equal(ds.x_train, x_train)


@needs_jpeg_copy
def test_cifar10_sources_read_the_records_of_cifar10(monkeypatch, tmp_path, jpeg_copy_slice):
    """The JPEG copy as sources: the archive extracted into the cache, the same
    records, labels and order as the in-memory loader."""
    isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("DPFL_DATA_DIR", str(jpeg_copy_slice.parent))
    ds = cifar10()
    sources = cifar10_sources(num_workers=2)
    assert isinstance(sources.train, ImageFolderSource)
    assert sources.source == ds.source and sources.name == "cifar10_jpg"
    assert sources.class_names == CIFAR10_CLASSES and sources.input_shape == (32, 32, 3)
    assert os.listdir(tmp_path / "cache" / "extracted")
    for split in ("train", "test"):
        part = getattr(sources, split)
        x, y = getattr(ds, f"x_{split}"), getattr(ds, f"y_{split}")
        np.testing.assert_array_equal(part.labels, y)
        got_x, got_y = part.__getitems__(np.arange(len(part)))
        np.testing.assert_array_equal(got_x, x)
        np.testing.assert_array_equal(got_y, y)


@needs_jpeg_copy
def test_cifar10_sources_of_the_canonical_copy_are_arrays(monkeypatch, tmp_path, jpeg_copy_slice):
    places = isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("DPFL_DATA_DIR", str(jpeg_copy_slice.parent))
    x_train, y_train, x_test, y_test = write_cifar10(places["system"], tarball=True)
    sources = cifar10_sources()
    assert isinstance(sources.train, ArraySource) and sources.source.label == "CIFAR-10"
    np.testing.assert_array_equal(sources.train.__getitems__([3, 1])[0], x_train[[3, 1]])
    np.testing.assert_array_equal(sources.y_test, y_test)
    np.testing.assert_array_equal(sources.y_train, y_train)


def test_neither_copy_error_names_both(monkeypatch, tmp_path):
    places = isolate(monkeypatch, tmp_path)
    with pytest.raises(DatasetNotFoundError) as info:
        cifar10(places["data_dir"])
    with pytest.raises(DatasetNotFoundError, match="cifar10_jpg.tar.xz"):
        cifar10_sources(places["data_dir"])
    msg = str(info.value)
    assert "cifar-10-python.tar.gz" in msg and "cifar10_jpg.tar.xz" in msg
    assert "CIFAR-10 (JPEG copy)" in msg and str(places["data_dir"]) in msg


def test_generated_rows_helper_matches_manual_layout():
    x = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    rows = cifar_rows(x)
    assert rows[1, 1024 + 5 * 32 + 7] == x[1, 5, 7, 1]

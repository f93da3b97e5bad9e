"""IDX parser on generated files (good and corrupt), the mnist.npz layout, and
the real MNIST (shared data dir) and Fashion-MNIST (Debian package) files."""

import gzip

import numpy as np
import pytest

from dpfl_tf.data import DatasetFormatError, load_dataset
from dpfl_tf.data.mnist import FASHION_MNIST_CLASSES, fashion_mnist, mnist, read_idx
from tests.data import (
    FASHION_SYSTEM_DIR,
    SHARED_DATA,
    idx_bytes,
    isolate,
    mnist_arrays,
    write_idx_set,
    write_npz,
)


@pytest.mark.parametrize(
    "array",
    [
        np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4),
        np.array([-128, -1, 0, 127], dtype=np.int8),
        np.array([[-30000, 2], [3, 30000]], dtype=np.int16),
        np.array([-(2**31), 0, 2**31 - 1], dtype=np.int32),
        np.array([[1.5, -2.25, 1e30]], dtype=np.float32),
        np.array([np.pi, -np.e], dtype=np.float64),
    ],
)
@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_types_shapes_and_gzip(tmp_path, array, gz):
    data = idx_bytes(array)
    path = tmp_path / ("a.idx.gz" if gz else "a.idx")
    path.write_bytes(gzip.compress(data) if gz else data)
    got = read_idx(path)
    assert got.shape == array.shape
    assert got.dtype == array.dtype and got.dtype.isnative
    np.testing.assert_array_equal(got, array)
    got[...] = 0  # writable copy


def test_read_idx_known_bytes(tmp_path):
    # labels file of 3 items: magic 0x00000801, count 3, then 7 2 1
    path = tmp_path / "labels"
    path.write_bytes(bytes.fromhex("00000801 00000003 070201"))
    np.testing.assert_array_equal(read_idx(path), [7, 2, 1])


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\x00\x00", "only 2 bytes"),
        (bytes.fromhex("01000801 00000001 00"), "magic number"),
        (bytes.fromhex("00000a01 00000001 00"), "unknown IDX type code 0x0a"),
        (bytes.fromhex("00000800"), "0 dimensions"),
        (bytes.fromhex("00000803 0000000a 0000"), "truncated IDX header"),
        (bytes.fromhex("00000802 00000002 00000003 0102"), r"truncated IDX file: shape \(2, 3\)"),
        (bytes.fromhex("00000c01 00000002 00000001"), "needs 8 data bytes, found 4"),
        (bytes.fromhex("00000801 00000001 0102"), "1 bytes beyond"),
    ],
)
def test_read_idx_rejects_corrupt_files_naming_them(tmp_path, raw, match):
    path = tmp_path / "bad-idx1-ubyte"
    path.write_bytes(raw)
    with pytest.raises(DatasetFormatError, match=match) as info:
        read_idx(path)
    assert str(path) in str(info.value)


def test_truncated_gzip_names_the_file(tmp_path):
    arrays = mnist_arrays()
    write_idx_set(tmp_path, arrays)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(DatasetFormatError, match="truncated or corrupt gzip") as info:
        read_idx(path)
    assert str(path) in str(info.value)
    with pytest.raises(DatasetFormatError, match="train-images-idx3-ubyte.gz"):
        mnist(tmp_path, download=False)


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_from_idx_files(monkeypatch, tmp_path, gz):
    places = isolate(monkeypatch, tmp_path)
    arrays = mnist_arrays(seed=11)
    write_idx_set(places["data_dir"], arrays, gz=gz)
    ds = mnist(places["data_dir"])
    for got, want in zip((ds.x_train, ds.y_train, ds.x_test, ds.y_test), arrays):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.uint8
    assert ds.source.format == "idx" and ds.source.path == str(places["data_dir"])
    assert ds.source.label == "MNIST" and ds.name == "mnist"
    assert ds.class_names == tuple("0123456789") and ds.num_classes == 10


def test_mixed_compressed_and_plain_idx_files(monkeypatch, tmp_path):
    places = isolate(monkeypatch, tmp_path)
    arrays = mnist_arrays(seed=2)
    write_idx_set(places["data_dir"], arrays, gz=True)
    (places["data_dir"] / "t10k-labels-idx1-ubyte.gz").unlink()
    (places["data_dir"] / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(arrays[3]))
    np.testing.assert_array_equal(mnist(places["data_dir"]).y_test, arrays[3])


def test_mnist_npz_layout_and_errors(monkeypatch, tmp_path):
    places = isolate(monkeypatch, tmp_path)
    arrays = mnist_arrays(seed=4)
    write_npz(places["data_dir"] / "mnist.npz", arrays)
    # both layouts present: the npz is preferred within one directory
    write_idx_set(places["data_dir"], mnist_arrays(seed=5))
    ds = load_dataset("MNIST", data_dir=places["data_dir"])
    np.testing.assert_array_equal(ds.x_train, arrays[0])
    assert ds.source.format == "npz"

    bad = places["env"] / "mnist.npz"
    bad.parent.mkdir()
    np.savez(bad, x_train=arrays[0], y_train=arrays[1], x_test=arrays[2])
    with pytest.raises(DatasetFormatError, match="missing arrays.*y_test"):
        mnist(places["env"])
    np.savez(bad, x_train=arrays[0][:, :27], y_train=arrays[1], x_test=arrays[2], y_test=arrays[3])
    with pytest.raises(DatasetFormatError, match=r"uint8 \(N, 28, 28\)"):
        mnist(places["env"])
    np.savez(bad, x_train=arrays[0], y_train=arrays[1][:-1], x_test=arrays[2], y_test=arrays[3])
    with pytest.raises(DatasetFormatError, match="12 train images but 11 labels"):
        mnist(places["env"])
    bad.write_bytes(b"not a zip file")
    with pytest.raises(DatasetFormatError, match="cannot read as .npz"):
        mnist(places["env"])


def test_fashion_mnist_npz_in_the_keras_cache(monkeypatch, tmp_path):
    places = isolate(monkeypatch, tmp_path)
    arrays = mnist_arrays(seed=9)
    write_npz(places["keras"] / "fashion-mnist.npz", arrays)
    ds = fashion_mnist()
    np.testing.assert_array_equal(ds.y_test, arrays[3])
    assert ds.class_names == FASHION_MNIST_CLASSES and ds.source.label == "Fashion-MNIST"


@pytest.mark.skipif(
    not (SHARED_DATA / "mnist.npz").is_file(),
    reason=f"real MNIST not available: no {SHARED_DATA / 'mnist.npz'}",
)
def test_real_mnist_from_shared_data_dir(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("DPFL_DATA_DIR", str(SHARED_DATA))
    ds = load_dataset("mnist")
    assert ds.source.path == str(SHARED_DATA / "mnist.npz")
    assert ds.x_train.shape == (60000, 28, 28) and ds.x_test.shape == (10000, 28, 28)
    assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.uint8
    # published class counts of the official MNIST files, official order
    assert np.bincount(ds.y_train).tolist() == [
        5923,
        6742,
        5958,
        6131,
        5842,
        5421,
        5918,
        6265,
        5851,
        5949,
    ]
    assert np.bincount(ds.y_test).tolist() == [
        980,
        1135,
        1032,
        1010,
        982,
        892,
        958,
        1028,
        974,
        1009,
    ]
    assert ds.y_train[:5].tolist() == [5, 0, 4, 1, 9] and ds.y_test[:3].tolist() == [7, 2, 1]
    assert ds.x_train.max() == 255 and ds.x_train.min() == 0


@pytest.mark.skipif(
    not (FASHION_SYSTEM_DIR / "train-images-idx3-ubyte.gz").is_file(),
    reason="Fashion-MNIST not installed: apt-get install -y dataset-fashion-mnist",
)
def test_real_fashion_mnist_from_debian_package(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path, system=True)
    ds = load_dataset("fashion-mnist")
    assert ds.source.path == str(FASHION_SYSTEM_DIR) and ds.source.format == "idx"
    assert ds.x_train.shape == (60000, 28, 28) and ds.x_test.shape == (10000, 28, 28)
    assert ds.x_train.dtype == np.uint8 and ds.y_train.dtype == np.uint8
    assert np.bincount(ds.y_train).tolist() == [6000] * 10
    assert np.bincount(ds.y_test).tolist() == [1000] * 10
    assert ds.y_train[:5].tolist() == [9, 0, 0, 3, 0]  # ankle boot, T-shirt, T-shirt, dress, ...
    assert ds.y_test[:5].tolist() == [9, 2, 1, 1, 6]
    assert ds.class_names[9] == "Ankle boot"

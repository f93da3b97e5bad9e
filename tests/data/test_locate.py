"""Search order, environment handling, the not-found message and a download
path that fails fast (all local: no test touches the internet)."""

import http.server
import os
import socket
import threading
import time

import numpy as np
import pytest

from dpfl_tf.data import (
    Dataset,
    DatasetNotFoundError,
    DataSource,
    available_datasets,
    load_dataset,
    register_dataset,
)
from dpfl_tf.data import locate as loc
from dpfl_tf.data.mnist import mnist
from tests.data import isolate, mnist_arrays, write_idx_set, write_npz


def _fill_all_places(places):
    """A different small mnist.npz in each searched directory; returns base -> first label."""
    marks = {}
    for i, name in enumerate(("data_dir", "env", "keras", "system")):
        arrays = mnist_arrays(seed=i)
        write_npz(places[name] / "mnist.npz", arrays)
        marks[name] = arrays[0]
    return marks


def test_search_order_explicit_then_env_then_keras_then_system(monkeypatch, tmp_path):
    places = isolate(monkeypatch, tmp_path)
    marks = _fill_all_places(places)
    monkeypatch.setenv("DPFL_DATA_DIR", str(places["env"]))

    def picked(data_dir=None):
        ds = mnist(data_dir)
        hits = [n for n, x in marks.items() if np.array_equal(ds.x_train, x)]
        assert len(hits) == 1
        assert ds.source.path == str(places[hits[0]] / "mnist.npz")
        return hits[0]

    assert picked(places["data_dir"]) == "data_dir"  # the explicit dir wins
    assert picked() == "env"
    monkeypatch.delenv("DPFL_DATA_DIR")
    assert picked() == "keras"
    os.remove(places["keras"] / "mnist.npz")
    assert picked() == "system"
    # an explicit directory without the files falls through to the others
    assert picked(tmp_path / "empty") == "system"


def test_env_var_may_list_several_directories_and_empty_is_unset(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    second = write_npz(tmp_path / "second" / "mnist.npz", mnist_arrays(seed=7))
    monkeypatch.setenv(
        "DPFL_DATA_DIR", os.pathsep.join([str(tmp_path / "nothing"), str(second.parent)])
    )
    assert loc.locate("mnist").paths == (str(second),)
    monkeypatch.setenv("DPFL_DATA_DIR", "  ")
    assert all(p.origin != "DPFL_DATA_DIR" for p in loc.search_places("mnist"))
    with pytest.raises(DatasetNotFoundError):
        loc.locate("mnist")


def test_keras_home_and_user_home(monkeypatch, tmp_path):
    monkeypatch.delenv("KERAS_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert loc.keras_cache_dir() == str(tmp_path / ".keras" / "datasets")
    monkeypatch.setenv("KERAS_HOME", str(tmp_path / "kh"))
    assert loc.keras_cache_dir() == str(tmp_path / "kh" / "datasets")


def test_per_dataset_subfolder_and_generic_names_only_where_specific(monkeypatch, tmp_path):
    places = isolate(monkeypatch, tmp_path)
    arrays = mnist_arrays(seed=3)
    # IDX files at the top of a shared directory could be MNIST or Fashion-MNIST:
    write_idx_set(places["env"], arrays)
    monkeypatch.setenv("DPFL_DATA_DIR", str(places["env"]))
    with pytest.raises(DatasetNotFoundError):
        loc.locate("fashion_mnist")
    # ...but are accepted in the explicit data_dir,
    assert loc.locate("fashion_mnist", places["env"]).directory == str(places["env"])
    # ...and in a per-dataset subfolder (like /usr/share/datasets/fashion-mnist/).
    write_idx_set(places["system"] / "fashion-mnist", arrays)
    found = loc.locate("fashion_mnist")
    assert found.directory == str(places["system"] / "fashion-mnist")
    assert found.file_set.name == "idx"
    assert found.paths[0].endswith("train-images-idx3-ubyte.gz")


def test_search_places_full_paths_in_order_without_duplicates(monkeypatch, tmp_path):
    places = isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("DPFL_DATA_DIR", str(places["data_dir"]))  # same as data_dir
    got = loc.search_places("fashion_mnist", places["data_dir"])
    paths = [p.path for p in got]
    assert len(paths) == len(set(paths))
    assert all(os.path.isabs(p) for p in paths)
    assert paths[:3] == [
        str(places["data_dir"]),
        str(places["data_dir"] / "fashion-mnist"),
        str(places["data_dir"] / "fashion_mnist"),
    ]
    assert paths.index(str(places["keras"])) < paths.index(str(places["system"]))
    assert str(places["system"] / "fashion-mnist") in paths


def test_error_names_dataset_every_place_and_how_to_provide(monkeypatch, tmp_path):
    places = isolate(monkeypatch, tmp_path)
    monkeypatch.setenv("DPFL_DATA_DIR", str(places["env"]))
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("fashion_mnist", data_dir=places["data_dir"])
    err = info.value
    assert isinstance(err, FileNotFoundError)
    msg = str(err)
    assert "Fashion-MNIST" in msg
    searched = loc.search_places("fashion_mnist", places["data_dir"])
    assert len(searched) == 12  # 4 bases x (itself + 2 per-dataset folders)
    for place in searched:
        assert place.path in msg
    for base in ("data_dir", "env", "keras", "system"):
        assert str(places[base]) in msg
    assert "DPFL_DATA_DIR" in msg and "data_dir=" in msg
    assert "apt-get install -y dataset-fashion-mnist" in msg
    assert "train-images-idx3-ubyte.gz" in msg
    assert "download disabled" in msg
    assert err.places == tuple(searched)


def test_download_switch(monkeypatch):
    monkeypatch.delenv("DPFL_NO_DOWNLOAD", raising=False)
    assert loc.download_enabled() is True
    for value in ("1", "true", "YES", "on"):
        monkeypatch.setenv("DPFL_NO_DOWNLOAD", value)
        assert loc.download_enabled() is False
        assert loc.download_enabled(True) is True  # the argument wins
    monkeypatch.setenv("DPFL_NO_DOWNLOAD", "0")
    assert loc.download_enabled() is True
    assert loc.download_enabled(False) is False
    with pytest.raises(ValueError, match="download must be"):
        loc.download_enabled("no")


def _spec(url):
    return loc.DatasetFiles(
        "toy", "Toy", (loc.FileSet("npz", (("toy.npz",),), urls=(url,), download_subdir="toy"),)
    )


def test_download_failure_is_caught_and_fast(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    with socket.socket() as s:  # a local port nobody listens on: refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.perf_counter()
    with pytest.raises(DatasetNotFoundError) as info:
        loc.locate(_spec(f"http://127.0.0.1:{port}/toy.npz"), download=True)
    assert time.perf_counter() - start < 5
    assert "download failed" in str(info.value) and f"127.0.0.1:{port}" in str(info.value)


def test_download_probe_does_not_hang_on_a_silent_server(monkeypatch, tmp_path):
    isolate(monkeypatch, tmp_path)
    with socket.socket() as server:  # accepts connections (backlog) but never answers
        server.bind(("127.0.0.1", 0))
        server.listen(4)
        url = f"http://127.0.0.1:{server.getsockname()[1]}/toy.npz"
        start = time.perf_counter()
        with pytest.raises(DatasetNotFoundError, match="download failed"):
            loc.locate(_spec(url), download=True, probe_timeout=0.5)
        assert time.perf_counter() - start < 4


def test_download_through_keras_get_file_lands_in_the_keras_cache(monkeypatch, tmp_path):
    """The real download path (probe + keras.utils.get_file), served from localhost."""
    pytest.importorskip("keras")
    places = isolate(monkeypatch, tmp_path)
    served = tmp_path / "served"
    write_npz(served / "toy.npz", mnist_arrays(seed=5))

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(served), **kw)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        spec = _spec(f"http://127.0.0.1:{httpd.server_address[1]}/toy.npz")
        with pytest.raises(DatasetNotFoundError):  # DPFL_NO_DOWNLOAD=1 from isolate()
            loc.locate(spec)
        found = loc.locate(spec, download=True)
    finally:
        httpd.shutdown()
        httpd.server_close()
    target = places["keras"] / "toy" / "toy.npz"
    assert found.downloaded and found.paths == (str(target),)
    assert target.read_bytes() == (served / "toy.npz").read_bytes()
    # the next search finds the cached copy without downloading
    again = loc.locate(spec, download=False)
    assert not again.downloaded and again.paths == (str(target),)


def test_unknown_names():
    with pytest.raises(ValueError, match="cifar10"):
        loc.locate("imagenet")
    with pytest.raises(
        ValueError, match="known datasets: cifar10, cifar100, fashion_mnist, image_folder, mnist"
    ):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="file_sets"):
        loc.locate("mnist", file_sets=["zip"])


def test_registry_takes_more_datasets_and_dataset_checks_itself(monkeypatch):
    import dpfl_tf.data as data

    monkeypatch.setattr(data, "_REGISTRY", dict(data._REGISTRY))
    x = np.zeros((3, 2, 2), np.uint8)

    def toy(data_dir=None, scale=1):
        return Dataset(
            x,
            np.array([0, 1, 1]),
            x[:1],
            np.array([1]),
            num_classes=2,
            class_names=("no", "yes"),
            name="toy",
            source=DataSource("Toy", str(data_dir), "generated"),
        )

    register_dataset("Toy-Set", toy)
    assert "toy_set" in available_datasets()
    ds = load_dataset("toy-set", data_dir="/somewhere", scale=2)
    assert ds.source.path == "/somewhere" and ds.input_shape == (2, 2)
    assert "Toy (generated: /somewhere)" in repr(ds)
    with pytest.raises(ValueError, match="already registered"):
        register_dataset("toy_set", toy)
    with pytest.raises(ValueError, match="loader must be"):
        register_dataset("other", "not-a-path")
    with pytest.raises(ValueError, match=r"y_train must lie in \[0, 2\)"):
        Dataset(
            x,
            np.array([0, 1, 2]),
            x,
            np.array([0, 1, 1]),
            2,
            ("a", "b"),
            "t",
            DataSource("T", "/", "g"),
        )
    with pytest.raises(ValueError, match="x_test has 3 examples but y_test has 1"):
        Dataset(
            x, np.array([0, 1, 1]), x, np.array([0]), 2, ("a", "b"), "t", DataSource("T", "/", "g")
        )
    with pytest.raises(ValueError, match="class_names must have num_classes=3"):
        Dataset(
            x,
            np.array([0, 1, 1]),
            x,
            np.array([0, 1, 1]),
            3,
            ("a", "b"),
            "t",
            DataSource("T", "/", "g"),
        )

"""dpfl_tf.data.NpyRows: a .npy file read row by row, never mapped, so training
on it keeps nothing of the file resident in the process."""

import gc
import os

import numpy as np
import pytest

from dpfl_tf.data import NpyRows


@pytest.fixture
def saved(tmp_path):
    a = np.random.default_rng(0).normal(size=(100, 3, 4)).astype(np.float32)
    np.save(tmp_path / "a.npy", a)
    return a, NpyRows(tmp_path / "a.npy")


def test_reads_what_numpy_reads(saved):
    a, rows = saved
    assert rows.shape == a.shape and len(rows) == 100 and rows.dtype == a.dtype
    assert np.shape(rows) == a.shape and rows.ndim == 3
    for key in (
        5,
        -1,
        slice(10, 20),
        slice(90, 200),
        slice(3, 40, 7),
        slice(5, 5),
        np.array([5, 3, 3, 99, 0, -2]),
        np.array([], np.int64),
        a[:, 0, 0] > 0,
    ):
        np.testing.assert_array_equal(rows[key], a[key])
    np.testing.assert_array_equal(rows[4:9, 1], a[4:9, 1])
    np.testing.assert_array_equal(np.asarray(rows), a)
    with pytest.raises(IndexError):
        rows[np.array([100])]


def test_a_file_is_filled_chunk_by_chunk(tmp_path):
    rows = NpyRows.create(tmp_path / "b.npy", (50, 2, 2))
    rows.write(10, np.ones((5, 2, 2)))
    rows.write(45, 2 * np.ones((5, 2, 2)))
    rows.close()
    b = np.load(tmp_path / "b.npy")
    assert b.shape == (50, 2, 2) and b.dtype == np.float32
    assert b[10:15].sum() == 20 and b[45:].sum() == 40 and b.sum() == 60
    with pytest.raises(ValueError, match="do not fit"):
        NpyRows(tmp_path / "b.npy").write(48, np.ones((5, 2, 2)))


def test_files_that_cannot_be_read_by_rows_are_refused(tmp_path):
    np.save(tmp_path / "f.npy", np.asfortranarray(np.ones((4, 3))))
    with pytest.raises(ValueError, match="Fortran-ordered"):
        NpyRows(tmp_path / "f.npy")
    np.save(tmp_path / "short.npy", np.ones((100, 10)))
    with open(tmp_path / "short.npy", "r+b") as f:
        f.truncate(500)
    with pytest.raises(ValueError, match="shorter"):
        NpyRows(tmp_path / "short.npy")


def _status():
    with open("/proc/self/status") as f:
        return {
            k: int(v.split()[0]) * 1024
            for k, v in (line.split(":", 1) for line in f)
            if k in ("RssAnon", "RssFile")
        }


def _fit_one_epoch(x, y):
    import keras

    from dpfl_tf.keras import DPSGD, DPModel

    model = keras.Sequential(
        [keras.Input(x.shape[1:]), keras.layers.Dense(8), keras.layers.Dense(10)]
    )
    dp = DPModel(model)
    dp.compile(
        optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    dp.fit(x, y, lot_size=500, epochs=1, verbose=0, sampling_seed=0)
    return dp


def test_training_on_it_keeps_nothing_of_the_file_resident(tmp_path):
    """A whole epoch reads every record; through NpyRows the file stays in the
    page cache (outside the process), through a memory map the pages it read
    are in the process's resident memory (the check fails for the map)."""
    n, d = 8000, 8192  # 256 MB of float32
    path = tmp_path / "x.npy"
    rows = NpyRows.create(path, (n, d))
    rng = np.random.default_rng(0)
    for i in range(0, n, 1000):
        rows.write(i, rng.normal(size=(1000, d)).astype(np.float32))
    rows.close()
    y = rng.integers(0, 10, n)
    size = os.path.getsize(path)
    _fit_one_epoch(np.zeros((600, d), np.float32), y[:600])  # warm-up: TF's own memory
    gc.collect()
    before = _status()
    dp = _fit_one_epoch(NpyRows(path), y)
    gc.collect()
    grown = {k: _status()[k] - before[k] for k in before}
    assert dp.lots_computed == n // 500
    assert grown["RssFile"] < 0.05 * size, grown
    mapped = np.load(path, mmap_mode="r")
    _fit_one_epoch(mapped, y)
    assert _status()["RssFile"] - before["RssFile"] > 0.5 * size  # what the check catches

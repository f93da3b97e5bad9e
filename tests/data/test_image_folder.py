"""The generic image-folder loader: generated PNG/JPEG trees, archives, the
decoded-array cache, and a real slice of the offline CIFAR-10 JPEG copy; and
`ImageFolderSource` (random access) against the loader, with DPModel.fit."""

import os
import pickle
import re
import warnings

import numpy as np
import pytest
from PIL import Image

import dpfl_tf.data.image_folder as imf
from dpfl_tf.data import DatasetFormatError, load_dataset
from dpfl_tf.data.cifar import CIFAR10_CLASSES
from dpfl_tf.data.image_folder import ImageFolderSource, image_folder, read_image_folder
from tests.data import CIFAR10_JPEG_ARCHIVE, make_tar, real_cifar10_jpeg_slice, touch_later


def make_tree(
    root,
    *,
    classes=("cat", "ant", "bee"),
    per_class=(3, 2),
    size=(6, 5),
    ext=".png",
    mode="RGB",
    seed=0,
):
    """root/{train,test}/<class>/<i>.<ext>; returns {split: [(array, class), ...]} in
    the loader's order (class name sorted, then file name)."""
    rng = np.random.default_rng(seed)
    written = {}
    channels = 3 if mode == "RGB" else 1
    for split, n in zip(("train", "test"), per_class):
        items = []
        for cls in classes:
            (root / split / cls).mkdir(parents=True, exist_ok=True)
            for i in range(n):
                arr = rng.integers(0, 256, (size[0], size[1], channels), dtype=np.uint8)
                img = Image.fromarray(arr if channels == 3 else arr[..., 0], mode)
                img.save(root / split / cls / f"{i:03d}{ext}")
                items.append((arr, cls))
        written[split] = sorted(items, key=lambda t: t[1])
    return written


def test_png_tree_exact_pixels_sorted_classes(tmp_path):
    written = make_tree(tmp_path / "tree")
    (tmp_path / "tree" / "train" / "ant" / "notes.txt").write_text("ignored")
    (tmp_path / "tree" / "README.md").write_text("ignored")
    ds = image_folder(tmp_path / "tree", cache_dir=tmp_path / "cache")
    assert ds.class_names == ("ant", "bee", "cat") and ds.num_classes == 3
    assert ds.x_train.shape == (9, 6, 5, 3) and ds.x_train.dtype == np.uint8
    assert ds.y_train.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert ds.y_test.tolist() == [0, 0, 1, 1, 2, 2] and ds.y_test.dtype == np.int64
    for got, (want, _) in zip(ds.x_train, written["train"]):
        np.testing.assert_array_equal(got, want)  # PNG is lossless
    assert ds.source.path == str(tmp_path / "tree") and ds.source.format == "image_folder"


def test_explicit_class_list_sets_label_order(tmp_path):
    make_tree(tmp_path / "tree")
    folder = read_image_folder(
        tmp_path / "tree", class_names=["cat", "bee", "ant", "dog"], use_cache=False
    )
    assert folder.class_names == ("cat", "bee", "ant", "dog")
    assert folder.splits["test"][1].tolist() == [0, 0, 1, 1, 2, 2]
    with pytest.raises(DatasetFormatError, match=r"class folders \['bee'\] are not in"):
        read_image_folder(tmp_path / "tree", class_names=["cat", "ant"], use_cache=False)


def test_jpeg_grayscale_resize_and_mixed_sizes(tmp_path):
    make_tree(tmp_path / "a", ext=".jpg", size=(8, 8))
    Image.new("L", (12, 10), 128).save(tmp_path / "a" / "test" / "cat" / "big.jpeg")
    with pytest.raises(DatasetFormatError, match=r"big.jpeg: image is 10x12x3.*image_size"):
        read_image_folder(tmp_path / "a", use_cache=False)
    folder = read_image_folder(
        tmp_path / "a", image_size=(4, 7), color_mode="grayscale", use_cache=False, num_workers=2
    )
    x, y = folder.splits["test"]
    assert x.shape == (7, 4, 7, 1) and y.tolist() == [0, 0, 1, 1, 2, 2, 2]
    assert abs(int(x[-1].mean()) - 128) <= 2  # the grey 'big.jpeg' (sorted last)
    assert read_image_folder(tmp_path / "a", image_size=3, use_cache=False).splits["train"][
        0
    ].shape == (9, 3, 3, 3)


def test_many_images_across_thread_chunks(tmp_path):
    """More images than one decoding chunk: order and content survive the thread pool."""
    root = tmp_path / "many"
    values = []
    for split, n in (("train", 600), ("test", 3)):
        (root / split / "only").mkdir(parents=True)
        for i in range(n):
            Image.new("L", (2, 2), i % 251).save(root / split / "only" / f"{i:04d}.png")
            values.append(i % 251)
    x = read_image_folder(root, use_cache=False, num_workers=2, color_mode="grayscale").splits[
        "train"
    ][0]
    assert x[:, 0, 0, 0].tolist() == values[:600]


def test_bad_inputs_name_the_problem(tmp_path):
    make_tree(tmp_path / "t")
    (tmp_path / "t" / "test" / "cat" / "zzz.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    with pytest.raises(DatasetFormatError, match=r"zzz.png: cannot decode image"):
        read_image_folder(tmp_path / "t", use_cache=False)
    with pytest.raises(DatasetFormatError, match=r"no split folder 'val'.*\['test', 'train'\]"):
        read_image_folder(tmp_path / "t", splits=["val"], use_cache=False)
    with pytest.raises(FileNotFoundError):
        read_image_folder(tmp_path / "missing")
    with pytest.raises(ValueError, match="color_mode must be one of"):
        read_image_folder(tmp_path / "t", color_mode="cmyk")
    with pytest.raises(ValueError, match="image_size"):
        read_image_folder(tmp_path / "t", image_size=(0, 3))
    with pytest.raises(ValueError, match="num_workers must be a whole number >= 1"):
        read_image_folder(tmp_path / "t", num_workers=0)
    (tmp_path / "empty" / "train" / "a").mkdir(parents=True)
    (tmp_path / "empty" / "test" / "a").mkdir(parents=True)
    with pytest.raises(DatasetFormatError, match="no .* images in split 'train'"):
        read_image_folder(tmp_path / "empty")
    with pytest.raises(ValueError, match="data_dir must be the image folder root"):
        load_dataset("image_folder")


@pytest.mark.parametrize("suffix, top", [(".tar", None), (".tar.gz", "inner"), (".tar.xz", None)])
def test_archives_are_extracted_once_into_the_cache(tmp_path, suffix, top):
    written = make_tree(tmp_path / "tree")
    archive = make_tar(tmp_path / "tree", tmp_path / f"pics{suffix}", top=top)
    cache = tmp_path / "cache"
    ds = load_dataset(
        "image_folder", data_dir=archive, cache_dir=cache, use_cache=False, label="pictures"
    )
    np.testing.assert_array_equal(ds.x_test[0], written["test"][0][0])
    assert ds.source.label == "pictures" and ds.source.path == str(archive)
    extracted = os.listdir(cache / "extracted")
    assert len(extracted) == 1 and extracted[0].startswith("pics-")
    mtime = os.stat(cache / "extracted" / extracted[0]).st_mtime_ns
    image_folder(archive, cache_dir=cache, use_cache=False)
    assert os.listdir(cache / "extracted") == extracted  # reused, not re-extracted
    assert os.stat(cache / "extracted" / extracted[0]).st_mtime_ns == mtime

    # extract=False decodes from the archive stream: same arrays, nothing extracted
    streamed = image_folder(archive, cache_dir=tmp_path / "c2", use_cache=False, extract=False)
    assert not (tmp_path / "c2").exists()
    for a, b in ((ds.x_train, streamed.x_train), (ds.y_test, streamed.y_test)):
        np.testing.assert_array_equal(a, b)
    assert streamed.class_names == ds.class_names


def test_streamed_archive_errors_name_the_member(tmp_path):
    make_tree(tmp_path / "tree")
    (tmp_path / "tree" / "train" / "bee" / "broken.png").write_bytes(b"nope")
    archive = make_tar(tmp_path / "tree", tmp_path / "pics.tar")
    with pytest.raises(DatasetFormatError, match=r"pics.tar:train/bee/broken.png: cannot decode"):
        read_image_folder(archive, extract=False, use_cache=False)
    with pytest.raises(DatasetFormatError, match=r"pics.tar: no split folder 'val'"):
        read_image_folder(archive, splits=["train", "val"], extract=False, use_cache=False)
    with pytest.raises(ValueError, match="extract must be True or False"):
        read_image_folder(archive, extract="no")


def test_cache_hit_skips_decoding_and_is_identical(monkeypatch, tmp_path):
    make_tree(tmp_path / "tree", ext=".jpg")
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path / "envcache"))
    calls = []
    real_decode = imf._decode_image
    monkeypatch.setattr(imf, "_decode_image", lambda *a: calls.append(a) or real_decode(*a))
    first = read_image_folder(tmp_path / "tree")
    assert not first.from_cache and len(calls) == 15
    assert first.cache_path.startswith(str(tmp_path / "envcache" / "image_folder"))
    assert not [f for f in os.listdir(os.path.dirname(first.cache_path)) if f.endswith(".tmp")]

    def fail(*args):
        raise AssertionError("decoded again despite the cache")

    monkeypatch.setattr(imf, "_decode_image", fail)
    second = read_image_folder(tmp_path / "tree")
    assert second.from_cache and second.cache_path == first.cache_path
    assert second.class_names == first.class_names
    for split in ("train", "test"):
        for a, b in zip(first.splits[split], second.splits[split]):
            np.testing.assert_array_equal(a, b)
            assert a.dtype == b.dtype

    # other options -> other cache entry; a modified file -> cache miss
    monkeypatch.setattr(imf, "_decode_image", lambda *a: calls.append(a) or real_decode(*a))
    calls.clear()
    read_image_folder(tmp_path / "tree", image_size=(3, 3))
    assert len(calls) == 15
    calls.clear()
    touch_later(tmp_path / "tree" / "test" / "bee" / "001.jpg")
    assert not read_image_folder(tmp_path / "tree").from_cache and len(calls) == 15


def test_damaged_cache_is_rebuilt_with_a_warning(tmp_path):
    make_tree(tmp_path / "tree")
    first = read_image_folder(tmp_path / "tree", cache_dir=tmp_path / "c")
    with open(first.cache_path, "r+b") as f:
        f.truncate(100)
    with pytest.warns(RuntimeWarning, match="ignoring unreadable image cache"):
        again = read_image_folder(tmp_path / "tree", cache_dir=tmp_path / "c")
    assert not again.from_cache
    np.testing.assert_array_equal(again.splits["train"][0], first.splits["train"][0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_image_folder(tmp_path / "tree", cache_dir=tmp_path / "c").from_cache


@pytest.mark.skipif(
    not CIFAR10_JPEG_ARCHIVE.is_file(), reason=f"no offline JPEG copy at {CIFAR10_JPEG_ARCHIVE}"
)
def test_real_slice_of_the_cifar10_jpeg_copy(tmp_path):
    # only the test split, 20 files per class: the archive is streamed, not extracted
    root = real_cifar10_jpeg_slice(tmp_path / "slice", n_test=20)
    folder = read_image_folder(root, splits=["test"], cache_dir=tmp_path / "c")
    assert folder.class_names == CIFAR10_CLASSES  # sorted names == the CIFAR-10 order
    x, y = folder.splits["test"]
    assert x.shape == (200, 32, 32, 3) and x.dtype == np.uint8
    assert y.tolist() == [c for c in range(10) for _ in range(20)]
    reference = np.asarray(Image.open(root / "test" / "cat" / "0007.jpg").convert("RGB"))
    np.testing.assert_array_equal(x[3 * 20 + 7], reference)
    assert x.std() > 20
    cached = read_image_folder(root, splits=["test"], cache_dir=tmp_path / "c")
    assert cached.from_cache
    np.testing.assert_array_equal(cached.splits["test"][0], x)
    # the same images read from an archive stream decode identically
    archive = make_tar(root, tmp_path / "slice.tar.xz")
    streamed = read_image_folder(archive, splits=["test"], use_cache=False, extract=False)
    np.testing.assert_array_equal(streamed.splits["test"][0], x)


# ------------------------------------------------------------- ImageFolderSource


@pytest.fixture(scope="module")
def cifar_slice(tmp_path_factory):
    """A real slice of the JPEG copy (10 train + 10 test images per class), as a
    directory and as a .tar.xz archive of it."""
    if not CIFAR10_JPEG_ARCHIVE.is_file():
        pytest.skip(f"no offline JPEG copy at {CIFAR10_JPEG_ARCHIVE}")
    base = tmp_path_factory.mktemp("cifar_slice")
    root = real_cifar10_jpeg_slice(base / "slice", n_test=10, n_train=10)
    return root, make_tar(root, base / "slice.tar.xz")


def test_source_records_equal_the_in_memory_loader(cifar_slice, tmp_path):
    root, archive = cifar_slice
    cache = tmp_path / "cache"
    folder = read_image_folder(archive, class_names=CIFAR10_CLASSES, use_cache=False)
    for split in ("train", "test"):
        source = ImageFolderSource(
            archive, split, class_names=CIFAR10_CLASSES, cache_dir=cache, num_workers=2
        )
        x, y = folder.splits[split]
        assert len(source) == len(y) == 100 and source.class_names == CIFAR10_CLASSES
        assert source.image_shape == (32, 32, 3) and source.num_classes == 10
        np.testing.assert_array_equal(source.labels, y)
        for i in range(len(source)):
            image, label = source[i]
            assert image.dtype == np.uint8 and type(label) is int
            np.testing.assert_array_equal(image, x[i])
            assert label == y[i]
        xb, yb = source.__getitems__(np.arange(len(source)))  # one call, the thread pool
        np.testing.assert_array_equal(xb, x)
        np.testing.assert_array_equal(yb, y)
        assert yb.dtype == np.int64
        source.close()
    # the archive was extracted once into the cache and is reused
    extracted = os.listdir(cache / "extracted")
    assert len(extracted) == 1 and extracted[0].startswith("slice-")
    assert (
        ImageFolderSource(archive, "test", cache_dir=cache)
        .path(0)
        .startswith(str(cache / "extracted" / extracted[0]))
    )
    assert os.listdir(cache / "extracted") == extracted
    # a directory, default class names (sorted folders == the CIFAR-10 order here)
    source = ImageFolderSource(root, "test")
    assert source.class_names == folder.class_names
    np.testing.assert_array_equal(source.__getitems__(np.arange(100))[0], folder.splits["test"][0])
    assert source.path(23) == str(
        root / "test" / "bird" / sorted(os.listdir(root / "test" / "bird"))[3]
    )


def test_getitems_equals_stacked_getitem(cifar_slice):
    source = ImageFolderSource(cifar_slice[0], "train", num_workers=3)
    order = np.random.default_rng(0).integers(0, len(source), 70)  # shuffled, repeats
    order[:2] = [-1, 0]
    xb, yb = source.__getitems__(order.tolist())
    assert xb.shape == (70, 32, 32, 3) and yb.shape == (70,)
    np.testing.assert_array_equal(xb, np.stack([source[int(i)][0] for i in order]))
    np.testing.assert_array_equal(yb, [source[int(i)][1] for i in order])
    np.testing.assert_array_equal(xb[0], source[99][0])  # -1: the last record
    empty_x, empty_y = source.__getitems__([])
    assert empty_x.shape == (0, 32, 32, 3) and empty_y.shape == (0,)
    with pytest.raises(IndexError, match="index 100 is out of range for a source of 100"):
        source[100]
    with pytest.raises(IndexError, match="index 100 is out of range"):
        source.__getitems__([3, 100])
    with pytest.raises(TypeError, match="indexed by one integer"):
        source[1:3]
    # a view: records and labels of the parent, nothing decoded until read
    view = source.subset([17, 3, 3, 88])
    assert len(view) == 4 and view.labels.tolist() == source.labels[[17, 3, 3, 88]].tolist()
    np.testing.assert_array_equal(
        view.to_arrays()[0], np.stack([source[i][0] for i in (17, 3, 3, 88)])
    )
    np.testing.assert_array_equal(view[1][0], source[3][0])
    assert view.path(0) == source.path(17)
    with pytest.raises(ValueError):
        source.labels[0] = 5  # read-only
    # picklable (the thread pool is not carried over)
    again = pickle.loads(pickle.dumps(source))
    np.testing.assert_array_equal(again.__getitems__(order)[0], xb)


def test_source_options_match_the_loader(tmp_path):
    make_tree(tmp_path / "a", ext=".jpg", size=(8, 8), per_class=(40, 2))
    folder = read_image_folder(
        tmp_path / "a",
        image_size=(4, 7),
        color_mode="grayscale",
        class_names=["bee", "cat", "ant", "wasp"],
        use_cache=False,
    )
    source = ImageFolderSource(
        tmp_path / "a",
        "train",
        image_size=(4, 7),
        color_mode="grayscale",
        class_names=["bee", "cat", "ant", "wasp"],
        num_workers=2,
    )
    x, y = folder.splits["train"]
    assert source.image_shape == (4, 7, 1) and source.num_classes == 4
    got = source.__getitems__(np.arange(len(source)))
    np.testing.assert_array_equal(got[0], x)
    np.testing.assert_array_equal(got[1], y)
    with pytest.raises(ValueError, match="split must be a split folder name, got None"):
        ImageFolderSource(tmp_path / "a", None)
    with pytest.raises(DatasetFormatError, match=r"no split folder 'val'"):
        ImageFolderSource(tmp_path / "a", "val")
    with pytest.raises(DatasetFormatError, match=r"class folders \['bee'\] are not in"):
        ImageFolderSource(tmp_path / "a", "train", class_names=["ant", "cat"])
    with pytest.raises(ValueError, match="color_mode must be one of"):
        ImageFolderSource(tmp_path / "a", color_mode="cmyk")
    with pytest.raises(ValueError, match="num_workers must be a whole number >= 1"):
        ImageFolderSource(tmp_path / "a", num_workers=0)
    (tmp_path / "empty" / "train" / "a").mkdir(parents=True)
    with pytest.raises(DatasetFormatError, match="no .* images in split 'train'"):
        ImageFolderSource(tmp_path / "empty")


def test_a_corrupt_or_odd_image_is_named_with_its_index(tmp_path):
    make_tree(tmp_path / "t", ext=".jpg", size=(8, 8), per_class=(30, 1))
    source = ImageFolderSource(tmp_path / "t", "train", num_workers=2)
    bad = tmp_path / "t" / "train" / "bee" / "007.jpg"  # record 30 + 7 (ant, bee, cat)
    bad.write_bytes(b"\xff\xd8\xff not a jpeg")
    with pytest.raises(
        DatasetFormatError,
        match=rf"record 37 of split 'train': {re.escape(str(bad))}: "
        r"cannot decode image \(UnidentifiedImageError",
    ):
        source[37]
    with pytest.raises(DatasetFormatError, match=r"record 37 .*bee/007.jpg: cannot decode"):
        source.__getitems__(np.arange(90))  # in a decoding thread
    np.testing.assert_array_equal(source.__getitems__([36, 38])[1], [1, 1])  # others read
    Image.new("RGB", (9, 8)).save(bad, "JPEG")  # decodable, another size
    with pytest.raises(
        DatasetFormatError,
        match=r"record 37 .*007.jpg: image is 8x9x3 but "
        r"record 0 .*ant/000.jpg\) is 8x8x3; pass "
        r"image_size",
    ):
        source.__getitems__([0, 37])
    bad.unlink()  # gone after the listing
    with pytest.raises(
        DatasetFormatError,
        match=r"record 37 .*007.jpg: cannot decode image "
        r"\(FileNotFoundError",
    ):
        source[37]
    view = source.subset([37])
    with pytest.raises(DatasetFormatError, match=r"record 0 of split 'train': .*bee/007.jpg"):
        view[0]


def test_dp_model_trains_on_a_source_and_counts_its_lots(cifar_slice):
    import keras
    import tensorflow as tf

    from dpfl_tf.keras import DPSGD, DPModel
    from dpfl_tf.keras.sources import SourceError

    source = ImageFolderSource(cifar_slice[0], "train", num_workers=2)
    net = keras.Sequential(
        [keras.Input((32, 32, 3)), keras.layers.Flatten(), keras.layers.Dense(10)]
    )
    model = DPModel(net)
    model.compile(
        optimizer=DPSGD(0.1, l2_norm_clip=1.0, noise_multiplier=1.0, seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = [w.copy() for w in net.get_weights()]
    model.fit(
        source,
        lot_size=20,
        epochs=2,
        verbose=0,
        sampling_seed=0,
        preprocess=lambda x: tf.cast(x, tf.float32) / 255.0,
    )
    assert model.lots_computed == model.lots_applied == 2 * (100 // 20)
    ledger = model.privacy_ledger
    assert sum(e["count"] for e in ledger.entries) == 10
    assert model.epsilon(1e-5) > 0
    assert not np.array_equal(before[0], net.get_weights()[0])
    # a corrupt image met during training: the error names the file; nothing is counted
    cats = cifar_slice[0] / "train" / "cat"
    bad = cats / sorted(os.listdir(cats))[0]  # record 30
    broken = ImageFolderSource(cifar_slice[0], "train")
    original = bad.read_bytes()
    try:
        bad.write_bytes(b"garbage")
        with pytest.raises(
            SourceError,
            match=rf"record 30 of split 'train': .*{bad.name}: "
            r"cannot decode image",
        ):
            model.fit(
                broken,
                lot_size=100,
                epochs=1,
                verbose=0,
                preprocess=lambda x: tf.cast(x, tf.float32) / 255.0,
            )
    finally:
        bad.write_bytes(original)
    assert model.lots_computed == 10

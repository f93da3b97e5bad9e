"""The generic image-folder loader: generated PNG/JPEG trees, archives, the
decoded-array cache, and a real slice of the offline CIFAR-10 JPEG copy."""

import os
import warnings

import numpy as np
import pytest
from PIL import Image

import dpfl_tf.data.image_folder as imf
from dpfl_tf.data import DatasetFormatError, load_dataset
from dpfl_tf.data.cifar import CIFAR10_CLASSES
from dpfl_tf.data.image_folder import image_folder, read_image_folder
from tests.data import (CIFAR10_JPEG_ARCHIVE, make_tar, real_cifar10_jpeg_slice,
                        touch_later)


def make_tree(root, *, classes=("cat", "ant", "bee"), per_class=(3, 2), size=(6, 5),
              ext=".png", mode="RGB", seed=0):
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
    folder = read_image_folder(tmp_path / "tree", class_names=["cat", "bee", "ant", "dog"],
                               use_cache=False)
    assert folder.class_names == ("cat", "bee", "ant", "dog")
    assert folder.splits["test"][1].tolist() == [0, 0, 1, 1, 2, 2]
    with pytest.raises(DatasetFormatError, match=r"class folders \['bee'\] are not in"):
        read_image_folder(tmp_path / "tree", class_names=["cat", "ant"], use_cache=False)


def test_jpeg_grayscale_resize_and_mixed_sizes(tmp_path):
    make_tree(tmp_path / "a", ext=".jpg", size=(8, 8))
    Image.new("L", (12, 10), 128).save(tmp_path / "a" / "test" / "cat" / "big.jpeg")
    with pytest.raises(DatasetFormatError, match=r"big.jpeg: image is 10x12x3.*image_size"):
        read_image_folder(tmp_path / "a", use_cache=False)
    folder = read_image_folder(tmp_path / "a", image_size=(4, 7), color_mode="grayscale",
                               use_cache=False, num_workers=2)
    x, y = folder.splits["test"]
    assert x.shape == (7, 4, 7, 1) and y.tolist() == [0, 0, 1, 1, 2, 2, 2]
    assert abs(int(x[-1].mean()) - 128) <= 2  # the grey 'big.jpeg' (sorted last)
    assert read_image_folder(tmp_path / "a", image_size=3, use_cache=False).splits[
        "train"][0].shape == (9, 3, 3, 3)


def test_many_images_across_thread_chunks(tmp_path):
    """More images than one decoding chunk: order and content survive the thread pool."""
    root = tmp_path / "many"
    values = []
    for split, n in (("train", 600), ("test", 3)):
        (root / split / "only").mkdir(parents=True)
        for i in range(n):
            Image.new("L", (2, 2), i % 251).save(root / split / "only" / f"{i:04d}.png")
            values.append(i % 251)
    x = read_image_folder(root, use_cache=False, num_workers=2, color_mode="grayscale"
                          ).splits["train"][0]
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


@pytest.mark.parametrize("suffix, top", [(".tar", None), (".tar.gz", "inner"),
                                         (".tar.xz", None)])
def test_archives_are_extracted_once_into_the_cache(tmp_path, suffix, top):
    written = make_tree(tmp_path / "tree")
    archive = make_tar(tmp_path / "tree", tmp_path / f"pics{suffix}", top=top)
    cache = tmp_path / "cache"
    ds = load_dataset("image_folder", data_dir=archive, cache_dir=cache, use_cache=False,
                      label="pictures")
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


@pytest.mark.skipif(not CIFAR10_JPEG_ARCHIVE.is_file(),
                    reason=f"no offline JPEG copy at {CIFAR10_JPEG_ARCHIVE}")
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

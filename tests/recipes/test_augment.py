"""The CIFAR input pipeline: crops are real windows, flips really flip, the
photometric draws have the paper's ranges, every draw is per example and per
epoch, the evaluation transform is the deterministic centre crop, and the
pipelines read a random-access source as they read arrays."""

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from dpfl_tf.data import ArraySource
from dpfl_tf.keras import LotSampler
from dpfl_tf.recipes.augment import (
    Augmentation,
    center_crop,
    eval_dataset,
    normalize,
    random_brightness_contrast,
    random_crop_and_flip,
    train_dataset,
)
from dpfl_tf.sanitizer import make_generator


def coordinate_images(n, size=32):
    """Float images whose channel 0 is the row index and channel 1 the column index."""
    rows, cols = np.meshgrid(np.arange(size), np.arange(size), indexing="ij")
    img = np.stack([rows, cols, np.zeros_like(rows)], axis=-1).astype(np.float32)
    return np.repeat(img[None], n, axis=0)


def test_crops_are_windows_flips_mirror_and_positions_are_uniform():
    n = 4000
    out = random_crop_and_flip(coordinate_images(n), 24, generator=make_generator(0)).numpy()
    assert out.shape == (n, 24, 24, 3)
    top = out[:, 0, 0, 0].astype(int)
    rows = np.broadcast_to(top[:, None, None] + np.arange(24)[None, :, None], (n, 24, 24))
    np.testing.assert_array_equal(out[..., 0], rows)
    cols = out[:, 0, :, 1].astype(int)
    forward = np.all(np.diff(cols, axis=1) == 1, axis=1)
    backward = np.all(np.diff(cols, axis=1) == -1, axis=1)
    assert np.all(forward ^ backward)  # a contiguous window, one orientation
    left = np.where(forward, cols[:, 0], cols[:, -1])
    assert top.min() == 0 and top.max() == 8 and left.min() == 0 and left.max() == 8
    # offsets uniform on 0..8 (chi-square), flips ~ Bernoulli(1/2)
    for offsets in (top, left):
        assert stats.chisquare(np.bincount(offsets, minlength=9)).pvalue > 1e-4
    assert stats.binomtest(int(backward.sum()), n, 0.5).pvalue > 1e-4
    # a flipped crop is the mirror image of the unflipped crop at the same offsets
    x = np.random.default_rng(1).integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    got = random_crop_and_flip(x, 24, generator=make_generator(0)).numpy()
    assert got.dtype == np.uint8
    for i in range(0, n, 97):
        window = x[i, top[i] : top[i] + 24, left[i] : left[i] + 24]
        np.testing.assert_array_equal(got[i], window[:, ::-1] if backward[i] else window)


def test_no_flip_and_odd_crop_sizes():
    out = random_crop_and_flip(
        coordinate_images(300, 10), (4, 7), flip=False, generator=make_generator(2)
    ).numpy()
    assert out.shape == (300, 4, 7, 3)
    assert np.all(np.diff(out[:, 0, :, 1], axis=1) == 1)
    single = random_crop_and_flip(coordinate_images(1)[0], 24, generator=make_generator(2))
    assert single.shape == (24, 24, 3)
    with pytest.raises(ValueError, match="larger than the images"):
        random_crop_and_flip(coordinate_images(2, 10), 24, generator=make_generator(0))


def test_brightness_and_contrast_ranges_per_example():
    n = 5000
    gen = make_generator(3)
    grey = np.full((n, 4, 4, 3), 0.5, np.float32)
    delta = random_brightness_contrast(grey, contrast=(1.0, 1.0), generator=gen).numpy()
    delta = delta[:, 0, 0, 0] - 0.5
    bound = 63 / 255
    assert np.all(np.abs(delta) <= bound + 1e-6)
    assert stats.kstest(delta, stats.uniform(-bound, 2 * bound).cdf).pvalue > 1e-4
    # a wrong range must be rejected by the same test
    assert stats.kstest(delta, stats.uniform(-0.5 * bound, bound).cdf).pvalue < 1e-6

    # contrast: two-level images, deviation from the channel mean scales by f ~ U[0.2, 1.8]
    img = np.full((n, 2, 2, 3), 0.4, np.float32)
    img[:, 0, 0, :] = 0.6  # mean 0.45, deviation 0.15
    out = random_brightness_contrast(img, max_brightness=0.0, generator=gen).numpy()
    factor = (out[:, 0, 0, 0] - 0.45) / 0.15
    assert factor.min() >= 0.2 - 1e-4 and factor.max() <= 1.8 + 1e-4
    assert stats.kstest(factor, stats.uniform(0.2, 1.6).cdf).pvalue > 1e-4
    # clipped to [0, 1]; uint8 input is scaled to [0, 1] first
    x = np.random.default_rng(0).integers(0, 256, (200, 8, 8, 3), dtype=np.uint8)
    out = random_brightness_contrast(x, generator=gen).numpy()
    assert out.dtype == np.float32 and out.min() >= 0.0 and out.max() <= 1.0
    assert out.min() == 0.0 and out.max() == 1.0  # the clip is active


def test_draws_are_independent_across_examples_and_calls():
    aug = Augmentation(seed=5, normalization="unit")
    same = np.repeat(
        np.random.default_rng(0).integers(0, 256, (1, 32, 32, 3), np.uint8), 64, axis=0
    )
    first = aug(same).numpy()
    assert len({first[i].tobytes() for i in range(64)}) == 64
    second = aug(same).numpy()
    assert not np.any(np.all(first == second, axis=(1, 2, 3)))  # new draws per call (epoch)
    # brightness (mean shift) and contrast (spread) of one batch are uncorrelated
    gen = make_generator(7)
    img = np.tile(np.linspace(0.3, 0.7, 16, dtype=np.float32).reshape(1, 4, 4, 1), (3000, 1, 1, 3))
    out = random_brightness_contrast(img, generator=gen).numpy()
    shift, spread = out.mean(axis=(1, 2, 3)) - 0.5, out.std(axis=(1, 2, 3))
    assert abs(stats.pearsonr(shift, spread)[0]) < 0.1


def test_normalisations_and_seeded_reproducibility():
    x = np.random.default_rng(1).integers(0, 256, (50, 32, 32, 3), dtype=np.uint8)
    std = Augmentation(seed=1)(x).numpy()
    assert std.shape == (50, 24, 24, 3) and std.dtype == np.float32
    np.testing.assert_allclose(std.mean(axis=(1, 2, 3)), 0.0, atol=1e-4)
    np.testing.assert_allclose(std.std(axis=(1, 2, 3)), 1.0, atol=1e-3)
    np.testing.assert_array_equal(std, Augmentation(seed=1)(x).numpy())
    assert not np.array_equal(std, Augmentation(seed=2)(x).numpy())
    unit = Augmentation(normalization="unit", seed=1)(x).numpy()
    assert unit.min() >= 0.0 and unit.max() <= 1.0
    # the standardisation is TensorFlow's per_image_standardization
    ref = tf.image.per_image_standardization(x.astype(np.float32) / 255.0).numpy()
    np.testing.assert_allclose(normalize(x).numpy(), ref, atol=1e-5)
    with pytest.raises(ValueError, match="normalization must be one of standardize, unit"):
        Augmentation(normalization="zca")
    with pytest.raises(ValueError, match="contrast must have low <= high"):
        Augmentation(contrast=(1.5, 0.5))
    with pytest.raises(ValueError, match="max_brightness must be in"):
        Augmentation(max_brightness=-0.1)
    with pytest.raises(ValueError, match="crop_size"):
        Augmentation(crop_size=0)


def test_eval_transform_is_the_centre_crop():
    x = np.random.default_rng(2).integers(0, 256, (30, 32, 32, 3), dtype=np.uint8)
    np.testing.assert_array_equal(center_crop(x, 24).numpy(), x[:, 4:28, 4:28])
    aug = Augmentation(seed=0)
    got = aug.eval_images(x, batch_size=7)
    np.testing.assert_allclose(got, normalize(x[:, 4:28, 4:28]).numpy(), atol=1e-6)
    np.testing.assert_array_equal(got, aug.eval_images(x))  # deterministic
    assert aug.eval_images(x[:0]).shape == (0, 24, 24, 3)


def test_per_epoch_draws_inside_the_dp_lot_pipeline_and_tf_data():
    """The generator's state persists across epochs of the DP sampler's tf.data
    pipeline and of the non-private one: the same example is distorted anew."""
    x = np.random.default_rng(3).integers(0, 256, (40, 32, 32, 3), dtype=np.uint8)
    y = np.arange(40)
    aug = Augmentation(seed=4)
    sampler = LotSampler(40, 40, "shuffle", seed=0)
    lots = [
        (xb.numpy(), yb.numpy())
        for xb, yb, _ in sampler.dataset(x, y, pad_to=40, epochs=2, preprocess=aug)
    ]
    assert len(lots) == 2 and lots[0][0].shape == (40, 24, 24, 3)
    by_label = [dict(zip(yb.tolist(), xb)) for xb, yb in lots]
    assert all(not np.array_equal(by_label[0][k], by_label[1][k]) for k in range(40))

    ds = train_dataset(x, y, aug, batch_size=16, shuffle_seed=0)
    epochs = [
        {int(k): v for xb, yb in ds for k, v in zip(yb.numpy(), xb.numpy())} for _ in range(2)
    ]
    assert len(epochs[0]) == 40
    assert all(not np.array_equal(epochs[0][k], epochs[1][k]) for k in range(40))


def test_pipelines_read_a_source_as_they_read_its_arrays():
    """train_dataset / eval_dataset on a random-access source (y=None) give the
    batches of the same records as arrays: same shuffle, same distortions."""
    x = np.random.default_rng(5).integers(0, 256, (50, 32, 32, 3), dtype=np.uint8)
    y = np.arange(50) % 10
    source = ArraySource(x, y)

    def batches(ds):
        return [(xb.numpy(), yb.numpy()) for xb, yb in ds]

    for epochs in range(2):  # per epoch: the seeded reshuffle and fresh draws agree
        from_arrays = batches(
            train_dataset(x, y, Augmentation(seed=1), batch_size=16, shuffle_seed=3).repeat(
                epochs + 1
            )
        )
        from_source = batches(
            train_dataset(source, None, Augmentation(seed=1), batch_size=16, shuffle_seed=3).repeat(
                epochs + 1
            )
        )
        assert len(from_source) == len(from_arrays) == 4 * (epochs + 1)
        for (xa, ya), (xs, ys) in zip(from_arrays, from_source):
            np.testing.assert_array_equal(ya, ys)
            np.testing.assert_array_equal(xa, xs)
    aug = Augmentation(seed=0)
    evaluated = batches(eval_dataset(source.subset(np.arange(3, 50)), None, aug, batch_size=20))
    assert [len(b[1]) for b in evaluated] == [20, 20, 7]
    np.testing.assert_array_equal(np.concatenate([b[0] for b in evaluated]), aug.eval_images(x[3:]))
    np.testing.assert_array_equal(np.concatenate([b[1] for b in evaluated]), y[3:])
    with pytest.raises(TypeError, match="x must be arrays .* or a random-access source"):
        eval_dataset(iter([x]), None, aug)

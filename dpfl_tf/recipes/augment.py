"""The CIFAR-10 input pipeline of Abadi et al. 2016, section 5.3, as TF functions.

The paper ("we refer the reader to the TensorFlow convolutional neural net
tutorial") trains on 24x24 patches of the 32x32 images:

* training: a random 24x24 crop, a random left-right flip, a random
  brightness shift delta ~ U[-63/255, 63/255] and a random contrast factor
  f ~ U[0.2, 1.8] (``x <- (x - mean_c) f + mean_c`` with ``mean_c`` the
  image's mean of channel c, as ``tf.image.adjust_contrast``), then
  normalisation;
* evaluation: the centre 24x24 crop, then the same normalisation.

Every random draw (crop offsets, flip, brightness, contrast) is made **per
example**, vectorised over the batch, from a `tf.random.Generator` whose state
persists, so each example gets new distortions in every epoch.  (The
``tf.image.random_*`` ops draw *one* value for a whole batch, which is why
they are not used here.)

Normalisation (``normalization=``):

* ``"standardize"`` (default, the tutorial's ``per_image_standardization``):
  ``(x - mean) / max(std, 1 / sqrt(H W C))`` over each image.  The
  photometric distortions act on pixels in [0, 1] and are **clipped to
  [0, 1]** before the standardisation.  Without the clip (as in the
  tutorial) the brightness shift would be removed exactly by the mean
  subtraction, i.e. a no-op;
* ``"unit"``: pixels scaled to [0, 1] (after the clipped distortions).

Seeding (``Augmentation(seed=...)``) is for tests and debugging.  In DP-SGD
(`DPModel.fit(preprocess=augmentation)`) the draws of lot t are keyed by
(key, t) -- stateless, so they do not depend on the order in which parallel
``tf.data`` calls run, and a resumed seeded run draws what an uninterrupted
one would.  Called without a lot number (the non-private `train_dataset`),
draws come from a generator whose state persists; `train_dataset` maps
sequentially when the augmentation is seeded.

Inputs are uint8 (0..255) or float images already in [0, 1], shape
(B, H, W, C) or a single (H, W, C) image; outputs are float32
(B, crop, crop, C).  Each output depends only on its own input image and its
own random draws, which is what `DPModel.fit(preprocess=...)` requires (one
example's augmentation must not depend on the others in its lot).
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import numpy as np
import tensorflow as tf

from dpfl_tf._seeds import derive_seed
from dpfl_tf._validation import ChoiceEnum, check_count, check_number
from dpfl_tf.sanitizer import make_generator

__all__ = [
    "Normalization",
    "Augmentation",
    "center_crop",
    "normalize",
    "random_crop_and_flip",
    "random_brightness_contrast",
    "train_dataset",
    "eval_dataset",
]


class Normalization(ChoiceEnum):
    """How augmented pixels are normalised (see the module docstring)."""

    __argument__ = "normalization"
    STANDARDIZE = "standardize"
    UNIT = "unit"


#: The tutorial's magnitudes, on the [0, 1] pixel scale (63 / 255 on 0..255).
DEFAULT_MAX_BRIGHTNESS = 63.0 / 255.0
DEFAULT_CONTRAST = (0.2, 1.8)


def _as_unit_float(images) -> tf.Tensor:
    """uint8 -> float32 / 255; floats are taken to be in [0, 1] already."""
    images = tf.convert_to_tensor(images)
    if images.dtype == tf.uint8:
        return tf.cast(images, tf.float32) / 255.0
    return tf.cast(images, tf.float32)


def _batched(images) -> tuple[tf.Tensor, bool]:
    images = tf.convert_to_tensor(images)
    if images.shape.rank == 3:
        return images[None], True
    if images.shape.rank != 4:
        raise ValueError(f"images must have shape (B, H, W, C) or (H, W, C), got {images.shape}")
    return images, False


def _crop_grid(offsets_y, offsets_x, crop: tuple[int, int], flip=None):
    """Row and column indices (B, ch) and (B, cw) of each example's window."""
    ch, cw = crop
    rows = offsets_y[:, None] + tf.range(ch, dtype=tf.int32)[None, :]
    cols = tf.range(cw, dtype=tf.int32)[None, :]
    if flip is not None:  # a flipped crop reads its columns right to left
        cols = tf.where(flip[:, None], cw - 1 - cols, cols)
    return rows, offsets_x[:, None] + cols


def _gather_windows(images: tf.Tensor, rows: tf.Tensor, cols: tf.Tensor) -> tf.Tensor:
    out = tf.gather(images, rows, axis=1, batch_dims=1)  # (B, ch, W, C)
    return tf.gather(out, cols, axis=2, batch_dims=1)  # (B, ch, cw, C)


def _crop_size(crop_size) -> tuple[int, int]:
    if isinstance(crop_size, (int, np.integer)) and not isinstance(crop_size, bool):
        crop_size = (crop_size, crop_size)
    if not isinstance(crop_size, (tuple, list)) or len(crop_size) != 2:
        raise ValueError(f"crop_size must be an int or (height, width), got {crop_size!r}")
    return (
        check_count("crop_size[0]", crop_size[0], minimum=1),
        check_count("crop_size[1]", crop_size[1], minimum=1),
    )


def _check_fits(images: tf.Tensor, crop: tuple[int, int]) -> tuple[int, int]:
    h, w = images.shape[1], images.shape[2]
    if h is None or w is None:
        raise ValueError("images need a static height and width")
    if crop[0] > h or crop[1] > w:
        raise ValueError(f"crop_size {crop} is larger than the images ({h}x{w})")
    return h, w


def random_crop_and_flip(
    images, crop_size=24, *, flip: bool = True, generator: tf.random.Generator
) -> tf.Tensor:
    """A uniformly placed crop_size window of each image, mirrored left-right
    with probability 1/2 -- independently per example.  Keeps the dtype."""
    images, single = _batched(images)
    crop = _crop_size(crop_size)
    h, w = _check_fits(images, crop)
    n = tf.shape(images)[0]
    oy = generator.uniform([n], 0, h - crop[0] + 1, dtype=tf.int32)
    ox = generator.uniform([n], 0, w - crop[1] + 1, dtype=tf.int32)
    flips = generator.uniform([n]) < 0.5 if flip else None
    out = _gather_windows(images, *_crop_grid(oy, ox, crop, flips))
    return out[0] if single else out


def center_crop(images, crop_size=24) -> tf.Tensor:
    """The centred crop_size window of each image (offset (H - h) // 2). Keeps the dtype."""
    images, single = _batched(images)
    crop = _crop_size(crop_size)
    h, w = _check_fits(images, crop)
    top, left = (h - crop[0]) // 2, (w - crop[1]) // 2
    out = images[:, top : top + crop[0], left : left + crop[1], :]
    return out[0] if single else out


def random_brightness_contrast(
    images,
    *,
    max_brightness: float = DEFAULT_MAX_BRIGHTNESS,
    contrast: Sequence[float] = DEFAULT_CONTRAST,
    generator: tf.random.Generator,
) -> tf.Tensor:
    """Per example: x + delta, delta ~ U[-max_brightness, max_brightness]; then
    (x - mean_c) f + mean_c with f ~ U[contrast] and mean_c the per-channel
    mean; clipped to [0, 1].  Input: uint8 or floats in [0, 1]; output float32."""
    x, single = _batched(_as_unit_float(images))
    n = tf.shape(x)[0]
    if max_brightness > 0:
        delta = generator.uniform([n, 1, 1, 1], -max_brightness, max_brightness)
        x = x + delta
    lo, hi = contrast
    if (lo, hi) != (1.0, 1.0):
        factor = generator.uniform([n, 1, 1, 1], lo, hi)
        mean = tf.reduce_mean(x, axis=[1, 2], keepdims=True)
        x = (x - mean) * factor + mean
    x = tf.clip_by_value(x, 0.0, 1.0)
    return x[0] if single else x


def normalize(images, normalization: Normalization | str = "standardize") -> tf.Tensor:
    """``"standardize"``: per-image (x - mean) / max(std, 1/sqrt(HWC)), as
    ``tf.image.per_image_standardization``; ``"unit"``: [0, 1] floats."""
    normalization = Normalization.parse(normalization)
    x = _as_unit_float(images)
    if normalization is Normalization.UNIT:
        return x
    return tf.image.per_image_standardization(x)


class Augmentation:
    """The paper's training distortions and the matching evaluation transform.

        aug = Augmentation()                         # OS-entropy randomness
        dp_model.fit(x_uint8, y, lot_size=2000, preprocess=aug, ...)
        x_test_in = aug.eval_images(x_test_uint8)    # centre crop + normalisation

    Calling the object augments a batch (the `preprocess` of `DPModel.fit`, or a
    `tf.data` map).  Random draws come from one `tf.random.Generator` (seeded
    only when ``seed`` is given: tests and reproducible debugging), so they
    differ per example and per epoch.

    Args:
      crop_size: side (or (height, width)) of the crops; 24 in the paper.
      flip: random left-right flips.
      max_brightness: brightness shifts are drawn from U[-m, m] (pixels in
        [0, 1]); 0 turns them off.
      contrast: (low, high) range of the contrast factor; (1, 1) turns it off.
      normalization: "standardize" (default) or "unit" (see the module).
      seed: seeds the distortions (default: OS entropy).
    """

    def __init__(
        self,
        crop_size=24,
        *,
        flip: bool = True,
        max_brightness: float = DEFAULT_MAX_BRIGHTNESS,
        contrast: Sequence[float] = DEFAULT_CONTRAST,
        normalization: Normalization | str = "standardize",
        seed: int | None = None,
    ):
        self.crop_size = _crop_size(crop_size)
        if not isinstance(flip, bool):
            raise ValueError(f"flip must be True or False, got {flip!r}")
        self.flip = flip
        self.max_brightness = check_number("max_brightness", max_brightness, low=0.0, high=1.0)
        if isinstance(contrast, str) or len(contrast) != 2:
            raise ValueError(f"contrast must be a (low, high) pair, got {contrast!r}")
        lo = check_number("contrast[0]", contrast[0], low=0.0)
        hi = check_number("contrast[1]", contrast[1], low=0.0)
        if lo > hi:
            raise ValueError(f"contrast must have low <= high, got {tuple(contrast)!r}")
        self.contrast = (lo, hi)
        self.normalization = Normalization.parse(normalization)
        self.seed = seed
        self._generator = None
        # the key of the per-lot draws: from the seed (a stream of its own, not the
        # DP noise's), else from OS entropy
        self._key = (
            tuple(derive_seed(seed, "augmentation", i) for i in range(2))
            if seed is not None
            else tuple(int.from_bytes(os.urandom(8), "little") >> 1 for _ in range(2))
        )

    @property
    def generator(self) -> tf.random.Generator:
        """Created on first use, outside any tf.function or tf.data trace."""
        if self._generator is None:
            with tf.init_scope():
                self._generator = make_generator(self.seed)
        return self._generator

    def __call__(self, images, lot=None) -> tf.Tensor:
        """Random crop + flip + brightness + contrast + normalisation, per example.
        `lot`: the number of the lot (DP-SGD's `preprocess`): its draws are
        keyed by (key, lot); None: draws from the persistent generator."""
        gen = self.generator if lot is None else _LotDraws(self._key, lot)
        x = random_crop_and_flip(images, self.crop_size, flip=self.flip, generator=gen)
        x = random_brightness_contrast(
            x, max_brightness=self.max_brightness, contrast=self.contrast, generator=gen
        )
        return normalize(x, self.normalization)

    def eval_transform(self, images) -> tf.Tensor:
        """Centre crop + normalisation (no randomness)."""
        return normalize(center_crop(images, self.crop_size), self.normalization)

    def eval_images(self, images, batch_size: int = 2000) -> np.ndarray:
        """`eval_transform` of an in-memory array, in chunks, as float32 numpy."""
        images = np.asarray(images)
        if len(images) == 0:
            return np.zeros((0,) + self.crop_size + images.shape[3:], np.float32)
        return np.concatenate(
            [
                self.eval_transform(images[i : i + batch_size]).numpy()
                for i in range(0, len(images), batch_size)
            ]
        )

    def get_config(self) -> dict:
        return {
            "crop_size": list(self.crop_size),
            "flip": self.flip,
            "max_brightness": self.max_brightness,
            "contrast": list(self.contrast),
            "normalization": self.normalization.value,
        }

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        return f"Augmentation({args})"


class _LotDraws:
    """What the distortions need of a `tf.random.Generator` (``uniform``), drawn
    statelessly: the k-th call for lot t is keyed by (key, t, k)."""

    def __init__(self, key, lot):
        self._seed = tf.random.experimental.stateless_fold_in(
            tf.constant(key, tf.int64), tf.cast(lot, tf.int64)
        )
        self._calls = 0

    def uniform(self, shape, minval=0, maxval=None, dtype=tf.float32):
        # int64 data keep a 64-bit seed (a Python int would fold in as int32)
        seed = tf.random.experimental.stateless_fold_in(
            self._seed, tf.constant(self._calls, tf.int64)
        )
        self._calls += 1
        if maxval is None and dtype.is_floating:
            maxval = 1
        return tf.random.stateless_uniform(shape, seed, minval, maxval, dtype=dtype, alg="philox")


def _records(x, y) -> tuple[tf.data.Dataset, Callable | None]:
    """(dataset of one element per record, None) for arrays; (dataset of record
    indices, batch reader) for a random-access source `x` (``y`` None)."""
    if y is not None:
        return tf.data.Dataset.from_tensor_slices((x, np.asarray(y))), None
    from dpfl_tf.keras.sources import IndexedReader

    if not (hasattr(x, "__len__") and hasattr(x, "__getitem__")):
        raise TypeError(
            f"x must be arrays (with y) or a random-access source (y=None), got {type(x).__name__}"
        )
    reader = IndexedReader.from_source(x)
    return tf.data.Dataset.range(len(x)), reader.read


def train_dataset(
    x, y, augmentation: Augmentation, *, batch_size: int, shuffle_seed: int | None = None
) -> tf.data.Dataset:
    """Non-private training input: reshuffled every epoch, batched, then
    augmented per example (one vectorised call per batch), prefetched.

    `x` stays uint8 in memory (a quarter of float32); conversion happens per
    batch.  Or `x` is a random-access source (``y=None``, e.g.
    `dpfl_tf.data.ImageFolderSource`): its indices are shuffled and each
    batch is read from it, so only the batches in flight are in memory (the
    same batches as the arrays of the same records, for the same seed)."""
    batch_size = check_count("batch_size", batch_size, minimum=1)
    ds, read = _records(x, y)
    ds = ds.shuffle(len(x), seed=shuffle_seed, reshuffle_each_iteration=True)
    ds = ds.batch(batch_size)
    if read is not None:
        ds = ds.map(read, num_parallel_calls=tf.data.AUTOTUNE)
    # parallel map calls would take their draws from the shared generator in a
    # varying order; a seeded augmentation maps sequentially to stay reproducible
    parallel = tf.data.AUTOTUNE if augmentation.seed is None else None
    ds = ds.map(lambda xb, yb: (augmentation(xb), yb), num_parallel_calls=parallel)
    return ds.prefetch(tf.data.AUTOTUNE)


def eval_dataset(x, y, augmentation: Augmentation, *, batch_size: int = 1000) -> tf.data.Dataset:
    """Evaluation input: centre crops in order, batched.  `x` is arrays, or a
    random-access source (``y=None``) read batch by batch, each time the
    dataset is iterated (memory O(batch))."""
    ds, read = _records(x, y)
    ds = ds.batch(check_count("batch_size", batch_size, minimum=1))
    if read is not None:
        ds = ds.map(read, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.map(
        lambda xb, yb: (augmentation.eval_transform(xb), yb), num_parallel_calls=tf.data.AUTOTUNE
    ).prefetch(tf.data.AUTOTUNE)

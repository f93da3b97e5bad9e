"""The JPEG stand-in of experiments/cifar10_scatternet_diagnosis.py: a second
generation on the first's grid nearly repeats it, one on a shifted grid acts
afresh (as a first generation on an original would)."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))

from cifar10_scatternet_diagnosis import jpeg, pixel_rmse  # noqa: E402


def _images(colour: bool) -> np.ndarray:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:32, 0:32]
    base = [128 + 60 * np.sin(x / rng.uniform(1.5, 4) + rng.uniform(0, 6))
            * np.cos(y / rng.uniform(1.5, 4)) + rng.normal(0, 12, (32, 32)) for _ in range(24)]
    out = np.clip(np.stack(base), 0, 255).astype("uint8")
    return np.repeat(out[..., None], 3, -1) // [1, 2, 3] if colour else out


def test_shifted_second_generation_acts_afresh_and_keeps_the_shape():
    for colour in (False, True):
        x = _images(colour).astype("uint8")
        first = jpeg(x)
        same, shifted = jpeg(first), jpeg(first, shift=3)
        assert first.shape == same.shape == shifted.shape == x.shape
        assert first.dtype == np.uint8
        assert pixel_rmse(first, same) < 0.5 * pixel_rmse(first, shifted)
        assert 0.5 < pixel_rmse(first, shifted) / pixel_rmse(x, first) < 2.0

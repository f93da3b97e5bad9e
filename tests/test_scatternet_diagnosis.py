"""experiments/cifar10_scatternet_diagnosis.py: the JPEG stand-in (a second
generation on the first's grid nearly repeats it, one on a shifted grid acts
afresh, as a first generation on an original would), and the machinery of the
hyperparameter sweep and the sampling comparison (settings, resumption, the
epsilon each row reports)."""

import os
import sys

import dp_accounting
import numpy as np
from scipy.optimize import brentq
from scipy.stats import norm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "experiments"))

from cifar10_scatternet_diagnosis import TB_SIGMA, Linear, jpeg, pixel_rmse  # noqa: E402


def _images(colour: bool) -> np.ndarray:
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:32, 0:32]
    base = [
        128
        + 60 * np.sin(x / rng.uniform(1.5, 4) + rng.uniform(0, 6)) * np.cos(y / rng.uniform(1.5, 4))
        + rng.normal(0, 12, (32, 32))
        for _ in range(24)
    ]
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


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """Closed-form reference: a composition of Gaussian mechanisms (no sampling)
    is one Gaussian of mu = sqrt(sum 1/sigma_i^2); its exact delta(eps) is
    Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) (Balle & Wang 2018)."""

    def excess(eps):
        return norm.cdf(-eps / mu + mu / 2) - np.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta

    return brentq(excess, 0.0, 100.0)


def test_sweep_confirm_and_sampling_rows(tmp_path):
    rng = np.random.default_rng(0)
    n = 600
    y = rng.integers(0, 10, n)
    f = (rng.normal(0, 0.01, (n, 2, 2, 243))).astype("float32")
    f[np.arange(n), 0, 0, y] += 0.05
    rows, calls = [], []

    def add(row):  # as the script's: the row list is replaced in place
        calls.append(row)
        rows[:] = [r for r in rows if r is not row] + [row]

    linear = Linear(f, f[:200], y, y[:200], str(tmp_path), rows, add)
    linear.sweep(0, lots=(64, 128), base_lrs=(0.5,), epochs=(2,))
    assert [(r["lot"], r["lr"]) for r in rows] == [(64, 0.0625), (128, 0.125)]
    assert len(linear.released(0)[3]) == 1  # one feature release, in every run's ledger
    for r in rows:  # each setting calibrated to eps 3 with the release included
        assert 2.95 < r["epsilon"] <= 3.0 and r["lots"] == 2 * (n // r["lot"])
        assert r["diagnostics_not_private"] == ["clipped_fraction", "zeroed_channels"]
        assert r["relation"] == "add_remove"
    linear.sweep(0, lots=(64, 128), base_lrs=(0.5,), epochs=(2,))
    assert len(calls) == 2  # resumed: nothing ran twice

    best = max(rows, key=lambda r: r["test_accuracy"])
    linear.confirm(0, [1])
    confirm = calls[-1]
    assert confirm["part"] == "confirm" and confirm["seed"] == 1
    assert (confirm["lot"], confirm["lr"], confirm["epochs"]) == (
        best["lot"],
        best["lr"],
        best["epochs"],
    )
    assert confirm["sweep_test_accuracy"] == best["test_accuracy"]
    assert "TEST accuracy" in confirm["selected_by"]

    linear.sampling([0], lot=128, lr=1.0, epochs=3)
    poisson, shuffle = calls[-2:]
    assert (poisson["sampling"], shuffle["sampling"]) == ("poisson", "shuffle")
    assert poisson["noise_multiplier"] == shuffle["noise_multiplier"] == TB_SIGMA
    assert poisson["lots"] == shuffle["lots"] == 3 * (n // 128)
    release = shuffle["release_noise_multiplier"]  # the release as one Gaussian
    # Poisson lots (add/remove): dp-accounting's PLD on the composition, built here
    event = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.GaussianDpEvent(release),
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(
                    128 / n, dp_accounting.GaussianDpEvent(TB_SIGMA)
                ),
                3 * (n // 128),
            ),
        ]
    )
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    np.testing.assert_allclose(poisson["epsilon"], pld.compose(event).get_epsilon(1e-5), rtol=2e-2)
    # shuffled lots: replace-one, one Gaussian(sigma / 2) per epoch, no
    # amplification; the release under replace-one is Gaussian(sigma / 2) too
    mu = np.sqrt((release / 2) ** -2 + 3 * (TB_SIGMA / 2) ** -2)
    np.testing.assert_allclose(shuffle["epsilon"], _gaussian_epsilon(mu, 1e-5), rtol=1e-2)
    assert shuffle["relation"] == "replace_one" and "no amplification" in shuffle["note"]


def test_sweep_grids_place_each_run_and_mark_missing(tmp_path):
    from cifar10_scatternet_diagnosis import draw_sweep, sweep_grids

    rows = [
        {
            "part": "sweep",
            "seed": 0,
            "epochs": 60,
            "lot": lot,
            "base_lr": b,
            "test_accuracy": 0.6 + lot / 1e5 + b / 100,
        }
        for lot in (2048, 8192)
        for b in (0.25, 0.5)
        if (lot, b) != (8192, 0.5)
    ]
    rows += [
        {
            "part": "sweep",
            "seed": 0,
            "epochs": 30,
            "lot": 4096,
            "base_lr": 1.0,
            "test_accuracy": 0.7,
        }
    ]
    rows += [
        {
            "part": "sweep",
            "seed": 1,
            "epochs": 60,
            "lot": 512,
            "base_lr": 1.0,
            "test_accuracy": 0.9,
        },
        {"part": "confirm", "seed": 0, "epochs": 30},
    ]
    grids = sweep_grids(rows, 0)
    assert list(grids) == [30, 60]
    for lots, bases, _ in grids.values():  # the same axes in both panels
        assert (lots, bases) == ([2048, 4096, 8192], [0.25, 0.5, 1.0])
    nan = np.nan
    np.testing.assert_allclose(
        grids[60][2], [[0.62298, 0.62548, nan], [nan] * 3, [0.68442, nan, nan]]
    )
    np.testing.assert_allclose(grids[30][2], [[nan] * 3, [nan, nan, 0.7], [nan] * 3])
    path = draw_sweep(rows, 0, str(tmp_path / "sweep.png"))
    assert os.path.getsize(path) > 1000
    assert draw_sweep(rows, 7, str(tmp_path / "none.png")) is None


def test_mirror_rows_cost_the_same_with_one_view_or_two(tmp_path):
    """The mirror part: one run on view 0 alone and one on both views (logits
    averaged); the release and the DP-SGD lots are the same events, so the noise
    calibrated for eps 3 and the epsilon reported are the same."""
    rng = np.random.default_rng(1)
    n = 600
    y = rng.integers(0, 10, n)
    f = (rng.normal(0, 0.01, (n, 2, 2, 2, 243))).astype("float32")
    f[np.arange(n), :, 0, 0, y] += 0.05
    rows = []

    def add(row):
        rows[:] = [r for r in rows if r is not row] + [row]

    for views in (1, 2):
        linear = Linear(
            f[:, 0] if views == 1 else f,
            f[:200, 0] if views == 1 else f[:200],
            y,
            y[:200],
            str(tmp_path),
            rows,
            add,
            views=views,
        )
        linear.mirror([0], "mirror", lot=128, lr=1.0, epochs=2)
    one, two = rows
    assert (one["views"], two["views"]) == (None, 2)
    assert one["noise_multiplier"] == two["noise_multiplier"]
    assert 2.95 < one["epsilon"] == two["epsilon"] <= 3.0
    assert one["lots"] == two["lots"] == 2 * (n // 128)

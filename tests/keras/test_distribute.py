"""MirroredStrategy over two logical CPUs and XLA give the same updates, and
the noise is drawn once per lot for the whole lot (not once per replica)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def child():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run(
        [sys.executable, "-m", "tests.keras._distribute_child"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_mirrored_strategy_equals_one_device(child):
    assert child["replicas"] == 2
    assert child["mirrored_lots"] == 3
    assert child["mirrored_max_diff"] < 1e-5


def test_models_without_keras_hub_layers_never_import_it(child):
    """Its rules are registered once it is imported (~0.5 s of every start-up)."""
    assert child["keras_hub_imported"] is False


def test_xla_equals_no_xla(child):
    assert child["xla_max_diff"] < 1e-5


@pytest.mark.parametrize("key", ["mirrored_noise", "xla_noise"])
def test_noise_once_per_lot(key, child):
    noise = np.asarray(child[key])
    assert stats.kstest(noise, "norm").pvalue > 1e-3
    # noise drawn on both replicas would have sqrt(2) times the scale: rejected
    assert stats.kstest(noise / np.sqrt(2), "norm").pvalue < 1e-6


def test_mirrored_strategy_trains_lots_of_every_size_and_drops_nan_examples(child):
    """Poisson lots of size 0, 1, 2, 3 on 2 replicas (odd sizes used to crash with
    an AddN shape mismatch); a NaN example is zeroed and counted, not published."""
    assert {0, 1, 2, 3} <= set(child["tiny_lot_sizes_seen"])
    assert child["tiny_lots"] == child["tiny_ledger"] == 7 * 5  # TINY_EPOCHS
    assert child["tiny_dropped"] >= 1
    assert child["tiny_finite"]


def test_secure_mode_is_refused_under_mirrored_strategy(child):
    assert (
        "secure_mode=True is not supported under a distribution strategy" in child["secure_refusal"]
    )
    assert child["secure_lots"] == 0


def test_correlated_noise_is_refused_under_mirrored_strategy_before_it_is_recorded(child):
    assert (
        "correlated_noise is not supported under a distribution strategy with 2 replicas"
        in (child["correlated_refusal"])
    )
    assert child["correlated_ledger"] == 0


def test_a_strategy_of_one_replica_trains_and_stops_like_no_strategy(child):
    lots, applied, ledger, stop = child["one_replica_lots"]
    assert lots == applied == ledger == child["plain_replica_lots"][0]
    assert 0 < lots < 50 and stop == "budget_spent"


def test_a_layer_mixing_the_batch_is_refused_on_two_replicas(child):
    assert "layer 'centre' (Lambda)" in child["mixing_refusal"]
    assert child["mixing_lots"] == child["mixing_ledger"] == 0

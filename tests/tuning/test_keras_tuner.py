"""DPTuner / DPRandomSearchOracle: Keras Tuner runs a private search of DPModels."""

import math

import keras
import numpy as np
import pytest

kt = pytest.importorskip("keras_tuner")

from dpfl_tf.keras import DPSGD, DPModel  # noqa: E402
from dpfl_tf.privacy import PrivacyLedger, compute_epsilon, dp_sgd_event  # noqa: E402
from dpfl_tf.tuning import TrialCount, ValidationScore, search_event  # noqa: E402
from dpfl_tf.tuning.keras_tuner import DPRandomSearchOracle, DPTuner  # noqa: E402
from tests.keras.helpers import loss, mlp, mnist_slice  # noqa: E402

N, LOT, SIGMA = 400, 50, 1.0
TRIAL_EVENT = dp_sgd_event(SIGMA, N // LOT, sampling_rate=LOT / N)


def build(hp):
    model = DPModel(mlp(seed=0))
    model.compile(
        optimizer=DPSGD(
            hp.Choice("learning_rate", [0.05, 1.0]),
            l2_norm_clip=hp.Choice("clip", [0.5, 1.0]),
            noise_multiplier=SIGMA,
        ),
        loss=loss(),
        metrics=["accuracy"],
    )
    return model


@pytest.fixture(scope="module")
def data():
    x, y = mnist_slice(N + 200, features=60)
    return (x[:N], y[:N]), (x[N:], y[N:])


def test_private_search_on_keras_tuner(data, tmp_path):
    (x, y), (xv, yv) = data
    score = ValidationScore(xv, yv, noise_multiplier=2.0, seed=0)
    tuner = DPTuner(
        build,
        trials=TrialCount.geometric(2.0),
        trial_event=TRIAL_EVENT,
        score=score,
        seed=1,
        directory=str(tmp_path),
        project_name="p",
    )
    k = tuner.oracle.num_trials
    assert k == tuner.selection.num_trials >= 1
    tuner.search(x, y, lot_size=LOT, epochs=1, verbose=0)
    assert len(tuner.oracle.trials) == k
    event = search_event(TrialCount.geometric(2.0), TRIAL_EVENT, score.event())
    report = tuner.report()
    assert report["epsilon"] == pytest.approx(compute_epsilon(event, 1e-5, "rdp"))
    assert report["epsilon_covers_search"] and report["trial_epsilon"] < report["epsilon"]
    assert set(report["best"]["hyperparameters"]) == {"learning_rate", "clip"}
    best = tuner.get_best_models(1)[0]
    assert isinstance(best, DPModel)
    # one ledger for the search, written beside the trials
    saved = PrivacyLedger.load(tmp_path / "p" / "privacy_ledger.json")
    assert saved == tuner.ledger and saved.count() == 1
    # a reloaded project runs the same number of trials and is not charged twice
    again = DPTuner(
        build,
        trials=TrialCount.geometric(2.0),
        trial_event=TRIAL_EVENT,
        score=score,
        directory=str(tmp_path),
        project_name="p",
        overwrite=False,
    )
    assert again.oracle.num_trials == k
    again.search(x, y, lot_size=LOT, epochs=1, verbose=0)
    assert again.ledger.count() == 1 and len(again.oracle.trials) == k
    with pytest.raises(ValueError, match="releases its best trial only"):
        tuner.results_summary(3)


def test_oracle_draws_independently_and_stops_at_its_count():
    hps = kt.HyperParameters()
    hps.Choice("a", [1, 2])
    oracle = DPRandomSearchOracle(
        30, objective=kt.Objective("s", "max"), hyperparameters=hps, seed=3
    )
    values = [oracle.populate_space(str(i))["values"]["a"] for i in range(30)]
    assert set(values) == {1, 2} and len(values) == 30  # repeats: no "space exhausted"
    empty = DPRandomSearchOracle(0, objective=kt.Objective("s", "max"), hyperparameters=hps)
    assert empty.populate_space("0")["status"] == "STOPPED"
    assert oracle.max_retries_per_trial == 0


def test_trial_over_its_declared_cost_stops_the_search(data, tmp_path):
    (x, y), (xv, yv) = data
    cheap = dp_sgd_event(2.0, N // LOT, sampling_rate=LOT / N)
    tuner = DPTuner(
        build,
        trials=2,
        trial_event=cheap,
        score=ValidationScore(xv, yv, noise_multiplier=2.0),
        directory=str(tmp_path),
        project_name="q",
    )
    with pytest.raises(kt.errors.FatalError, match="more than the search declared"):
        tuner.search(x, y, lot_size=LOT, epochs=1, verbose=0)


def test_non_private_search_reports_one_trials_epsilon(data, tmp_path):
    (x, y), (xv, yv) = data
    tuner = DPTuner(
        build,
        trials=1,
        trial_event=TRIAL_EVENT,
        objective="val_accuracy",
        accountant="moments",
        directory=str(tmp_path),
        project_name="r",
    )
    tuner.search(x, y, lot_size=LOT, epochs=1, verbose=0, validation_data=(xv, yv))
    report = tuner.report()
    assert report["epsilon"] is None and not report["epsilon_covers_search"]
    assert report["trial_epsilon"] == pytest.approx(compute_epsilon(TRIAL_EVENT, 1e-5))


def test_refusals(data, tmp_path):
    xv, yv = data[1]
    with pytest.raises(ValueError, match="random number of trials selects on a private score"):
        DPTuner(
            build,
            trials=TrialCount.geometric(3.0),
            trial_event=TRIAL_EVENT,
            objective="val_accuracy",
            directory=str(tmp_path),
        )
    with pytest.raises(ValueError, match="either score="):
        DPTuner(
            build,
            trials=2,
            trial_event=TRIAL_EVENT,
            objective="val_accuracy",
            score=ValidationScore(xv, yv, noise_multiplier=1.0),
            directory=str(tmp_path),
        )

    def plain(hp):
        hp.Choice("learning_rate", [0.1])
        model = mlp()
        model.compile(optimizer="sgd", loss=loss())
        return model

    tuner = DPTuner(
        plain,
        trials=1,
        trial_event=TRIAL_EVENT,
        score=ValidationScore(xv, yv, noise_multiplier=1.0),
        directory=str(tmp_path),
        project_name="s",
    )
    with pytest.raises(kt.errors.FatalError, match="must build a compiled dpfl_tf.keras.DPModel"):
        tuner.search(xv, yv, epochs=1, verbose=0)
    assert math.isfinite(tuner.report()["epsilon"])  # charged once started
    assert np.isfinite(tuner.ledger.epsilon(1e-5))
    keras.backend.clear_session()

"""private_search and ValidationScore on small slices of real MNIST."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import dp_event
from scipy import stats

from dpfl_tf.keras import DPSGD, DPModel
from dpfl_tf.privacy import PrivacyLedger, compute_epsilon, dp_sgd_event
from dpfl_tf.tuning import (
    PrivateSelection,
    SearchPrivacyError,
    TrialCount,
    ValidationScore,
    calibrate_search,
    private_search,
    search_event,
)
from tests.keras.helpers import loss, mlp, mnist_slice

N, LOT, EPOCHS, SIGMA = 600, 60, 1, 1.0
TRIAL_EVENT = dp_sgd_event(SIGMA, EPOCHS * N // LOT, sampling_rate=LOT / N)


@pytest.fixture(scope="module")
def data():
    x, y = mnist_slice(N + 300, features=60)
    return (x[:N], y[:N]), (x[N:], y[N:])


def _trainer(x, y, sigma=SIGMA, lot=LOT):
    def train(hp):
        model = DPModel(mlp(seed=0))
        model.compile(
            optimizer=DPSGD(
                hp["learning_rate"], l2_norm_clip=hp["clip"], noise_multiplier=sigma, seed=1
            ),
            loss=loss(),
        )
        model.fit(x, y, lot_size=lot, epochs=EPOCHS, verbose=0, sampling_seed=2)
        return model

    return train


def test_search_releases_the_best_trial_and_one_ledger(data):
    (x, y), (xv, yv) = data
    score = ValidationScore(xv, yv, noise_multiplier=3.0, seed=0)
    result = private_search(
        _trainer(x, y),
        {"learning_rate": [0.01, 1.0], "clip": [1.0]},
        trials=TrialCount.geometric(3.0),
        trial_event=TRIAL_EVENT,
        score=score,
        seed=1,
    )  # K = 2
    assert result.best is not None and isinstance(result.best.model, DPModel)
    assert result.best.hyperparameters["learning_rate"] in (0.01, 1.0)
    expected = search_event(
        TrialCount.geometric(3.0), TRIAL_EVENT, dp_accounting.GaussianDpEvent(3.0)
    )
    assert result.ledger.count() == 1 and result.ledger.event.events[0].event == expected
    assert result.epsilon == pytest.approx(compute_epsilon(expected, 1e-5, "rdp"))
    assert result.covers_search and result.epsilon > result.trial_epsilon
    summary = result.to_dict()
    assert summary["epsilon_covers_search"] and "number" not in str(summary["best"])
    assert summary["trials"] == "geometric(mean=3)"


def test_the_best_is_the_highest_noised_score(data):
    """With little noise on the score, a learning rate that learns wins over one
    that does not (the selection reads the scores)."""
    (x, y), (xv, yv) = data
    score = ValidationScore(xv, yv, noise_multiplier=1.0, seed=0)
    result = private_search(
        _trainer(x, y),
        {"learning_rate": [1e-4, 2.0], "clip": [1.0]},
        trials=4,
        trial_event=TRIAL_EVENT,
        score=score,
        seed=3,
    )
    assert result.best.hyperparameters["learning_rate"] == 2.0
    assert result.best.score > 0.2  # chance is 0.1


def test_number_of_trials_is_drawn_and_each_trial_draws_anew(data):
    calls = []
    selection = PrivateSelection(
        TrialCount.logarithmic(4.0),
        TRIAL_EVENT,
        ValidationScore(*data[1], noise_multiplier=1.0),
        seed=11,
    )
    again = PrivateSelection(
        TrialCount.logarithmic(4.0),
        TRIAL_EVENT,
        ValidationScore(*data[1], noise_multiplier=1.0),
        seed=11,
    )
    assert selection.num_trials == again.num_trials >= 1
    draws = [selection.draw({"a": [1, 2, 3]})["a"] for _ in range(300)]
    # independent uniform draws, repeats allowed (Keras Tuner's RandomSearch avoids them)
    assert stats.chisquare(np.bincount(draws)[1:]).pvalue > 1e-3
    assert any(a == b for a, b in zip(draws, draws[1:]))
    selection.draw(lambda rng: calls.append(rng) or {"b": 1})
    assert isinstance(calls[0], np.random.Generator)


def test_a_trial_spending_more_than_declared_stops_the_search(data):
    (x, y), (xv, yv) = data
    score = ValidationScore(xv, yv, noise_multiplier=3.0, seed=0)
    with pytest.raises(
        SearchPrivacyError,
        match=r"a trial spent 10 x Poisson\(q=0.1\) "
        r"Gaussian\(sigma=0.8\).*more than the search declared",
    ):
        private_search(
            _trainer(x, y, sigma=0.8),
            {"learning_rate": [0.1], "clip": [1.0]},
            trials=2,
            trial_event=TRIAL_EVENT,
            score=score,
        )
    # less noise is refused; more noise (a cheaper trial) is accepted
    cheaper = private_search(
        _trainer(x, y, sigma=1.5),
        {"learning_rate": [0.1], "clip": [1.0]},
        trials=1,
        trial_event=TRIAL_EVENT,
        score=score,
    )
    assert cheaper.best is not None


def test_non_private_search_reports_the_trial_epsilon_as_not_covering(data):
    (x, y), (xv, yv) = data
    score = ValidationScore(xv, yv, noise_multiplier=0.0)
    result = private_search(
        _trainer(x, y),
        {"learning_rate": [0.5], "clip": [1.0]},
        trials=2,
        trial_event=TRIAL_EVENT,
        score=score,
        accountant="moments",
    )
    assert math.isinf(result.epsilon) and not result.covers_search
    assert result.trial_epsilon == pytest.approx(compute_epsilon(TRIAL_EVENT, 1e-5, "moments"))
    summary = result.to_dict()
    assert summary["epsilon"] is None and "does not cover" not in summary["note"][:10]
    assert "covers one trial's training only, not the search" in summary["note"]


def test_public_validation_scores_cost_nothing(data):
    score = ValidationScore(*data[1], noise_multiplier=0.0, public=True)
    selection = PrivateSelection(3, TRIAL_EVENT, score, accountant="pld")
    assert selection.event == dp_event.SelfComposedDpEvent(TRIAL_EVENT, 3)
    assert selection.covers_search


def test_refusals(data):
    xv, yv = data[1]
    private = ValidationScore(xv, yv, noise_multiplier=2.0)
    with pytest.raises(
        ValueError,
        match="random number of trials selects on a private score.*got noise_multiplier=0",
    ):
        PrivateSelection(
            TrialCount.geometric(5.0), TRIAL_EVENT, ValidationScore(xv, yv, noise_multiplier=0.0)
        )
    with pytest.raises(ValueError, match="got no score"):
        PrivateSelection(TrialCount.geometric(5.0), TRIAL_EVENT, None)
    with pytest.raises(ValueError, match="accountant 'moments' cannot account best of"):
        PrivateSelection(TrialCount.geometric(5.0), TRIAL_EVENT, private, accountant="moments")
    with pytest.raises(ValueError, match="trials must be a TrialCount .* got 2.5"):
        PrivateSelection(2.5, TRIAL_EVENT, private)
    with pytest.raises(ValueError, match="public=True needs noise_multiplier=0"):
        ValidationScore(xv, yv, noise_multiplier=1.0, public=True)
    with pytest.raises(ValueError, match="noise_multiplier must be >= 0, got -1"):
        ValidationScore(xv, yv, noise_multiplier=-1)
    with pytest.raises(ValueError, match=r"space\['a'\] must list at least one value"):
        PrivateSelection(1, TRIAL_EVENT, private).draw({"a": []})
    replace_one = PrivacyLedger("rdp")
    replace_one.record(dp_sgd_event(1.0, 10, "shuffle", epochs=1))
    with pytest.raises(ValueError, match="different neighbouring relations"):
        PrivateSelection(2, TRIAL_EVENT, private, ledger=replace_one)


def test_score_noise_has_the_stated_scale(data):
    """The released score is the true mean plus N(0, sigma^2) / n: a KS test
    accepts that scale and rejects twice it."""
    xv, yv = data[1]

    class Fixed:  # the predictions of a real model, computed once
        outputs = mlp(seed=0).predict(xv, verbose=0)

        def predict(self, x, **kwargs):
            return self.outputs

    exact = ValidationScore(xv, yv, noise_multiplier=0.0)(Fixed())
    noisy = ValidationScore(xv, yv, noise_multiplier=5.0, seed=3)
    draws = np.array([noisy(Fixed()) for _ in range(400)]) - exact
    n = len(yv)
    assert stats.kstest(draws, "norm", args=(0, 5.0 / n)).pvalue > 1e-3
    assert stats.kstest(draws, "norm", args=(0, 10.0 / n)).pvalue < 1e-3
    score = ValidationScore(xv, yv, noise_multiplier=5.0)
    assert score.event() == dp_accounting.GaussianDpEvent(5.0)
    relation = dp_accounting.NeighboringRelation.REPLACE_ONE
    assert type(score.event(relation)).__name__ == "ReplaceOneGaussianDpEvent"


def test_calibrated_search_reaches_the_target():
    score = ValidationScore(np.zeros((10, 2)), np.zeros(10), noise_multiplier=20.0)
    sigma, eps = calibrate_search(
        3.0,
        1e-5,
        TrialCount.geometric(10.0),
        lambda s: dp_sgd_event(s, 1000, sampling_rate=0.01),
        score,
    )
    assert eps <= 3.0 and eps == pytest.approx(3.0, abs=0.02)
    alone = compute_epsilon(dp_sgd_event(sigma, 1000, sampling_rate=0.01), 1e-5, "rdp")
    assert alone < 3.0  # the price of the search: one trial alone costs less

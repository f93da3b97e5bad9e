"""dpfl_tf.recipes.tune: the private search of ``dpfl-tf train --tune`` on the
MNIST recipe (the command's own tests are in tests/test_cli.py)."""

import pytest

from dpfl_tf.recipes import mnist as recipe
from dpfl_tf.recipes.mnist import MnistConfig
from dpfl_tf.recipes.tune import TuneConfig, tune_mnist
from tests.keras.helpers import cut_recipe_data


@pytest.fixture
def small_mnist(monkeypatch):
    """The real MNIST cut to its first 2,000 training and 500 test examples."""
    cut_recipe_data(monkeypatch, 2000, 500)


def _held_out(result, asked=400, total=2000):
    """(training examples, lots of 100 in one epoch) of a search on the 2,000-example
    slice: each example held out with probability 0.2 by its content, so about
    `asked` (binomial sd ~18), the same in the score and the trial."""
    n, held = result["trial"]["training_examples"], result["score"]["validation_examples"]
    assert n + held == total and abs(held - asked) < 100, (n, held)
    assert result["trial"]["lots"] == n // 100 and result["trial"]["sampling_rate"] == 100 / n
    return n, n // 100


def _config(**kw):
    settings = dict(
        model="tanh_cnn",
        projection="none",
        noise_multiplier=None,
        target_epsilon=4.0,
        accountant="rdp",
        lot_size=100,
        batch_size=None,
        epochs=1,
        l2_norm_clip=0.1,
        learning_rate=4.0,
        final_learning_rate=4.0,
        seed=0,
    )
    return MnistConfig(**{**settings, **kw})


def test_tune_config_checks_and_its_default_space():
    with pytest.raises(ValueError, match="trials must be a whole number >= 1"):
        TuneConfig(trials=2.5, distribution="fixed")
    with pytest.raises(ValueError, match="mean must be > 1"):
        TuneConfig(trials=1.0)  # geometric: K >= 1 always, so E[K] = 1 is one run
    TuneConfig(trials=1.0, distribution="poisson")  # Poisson's mean may be 1
    with pytest.raises(ValueError, match="distribution must be one of geometric"):
        TuneConfig(distribution="uniform")
    with pytest.raises(ValueError, match=r"learning_rates\[\] must be > 0"):
        TuneConfig(learning_rates=(0.1, 0.0))
    space = TuneConfig().space(_config())
    assert space == {"learning_rate": [1.0, 2.0, 4.0, 8.0], "l2_norm_clip": [0.05, 0.1, 0.2]}
    assert TuneConfig(learning_rates=(3,), clips=(1, 2)).space(_config()) == {
        "learning_rate": [3.0],
        "l2_norm_clip": [1.0, 2.0],
    }


@pytest.mark.parametrize(
    "config, tune, message",
    [
        (_config(noise_multiplier=2.0), TuneConfig(), "noise_multiplier must be None"),
        (_config(users=20), TuneConfig(), "user-level runs"),
        (_config(accountant="pld"), TuneConfig(), "accountant must be 'rdp'"),
        (_config(target_epsilon=None), TuneConfig(), "needs a budget"),
        (_config(validation=100), TuneConfig(), "holds out its own validation examples"),
    ],
)
def test_searches_it_cannot_honour_are_refused_before_any_data_is_read(
    config, tune, message, monkeypatch
):
    monkeypatch.setattr(recipe, "load_dataset", pytest.fail)  # never reached
    with pytest.raises(ValueError, match=message):
        tune_mnist(config, tune)


def test_an_interrupted_search_releases_nothing_and_stays_charged_in_full(small_mnist):
    """Stopped inside its first trial: no best trial, status interrupted, and
    the epsilon of the whole search (recorded before the first trial)."""
    from dpfl_tf.privacy import compute_epsilon

    polls = iter(range(10**6))
    started = []
    result = tune_mnist(
        _config(),
        TuneConfig(trials=3.0, validation=0.2),
        should_stop=lambda: next(polls) >= 3,
        on_start=started.append,
        on_trial=lambda *a: pytest.fail("no trial ends"),
    )
    assert result["stop_reason"] == "interrupted" and result["best"] is None
    assert result["test_accuracy"] is None
    assert started[0]["epsilon"] == result["epsilon"] <= 4.0
    # the charge is the whole search's: the search event the ledger recorded
    n, lots = _held_out(result)
    from dp_accounting import dp_event

    from dpfl_tf.privacy import dp_sgd_event

    run = dp_event.ComposedDpEvent(
        [
            dp_sgd_event(result["noise_multiplier"], lots, sampling_rate=100 / n),
            dp_event.GaussianDpEvent(20.0),
        ]
    )
    search = dp_event.RepeatAndSelectDpEvent(run, 3.0, 1.0)
    assert result["epsilon"] == pytest.approx(compute_epsilon(search, 1e-5, "rdp"), rel=1e-12)


@pytest.mark.slow
def test_a_search_of_the_mlp_declares_each_trials_dp_pca(small_mnist):
    """The mlp recipe releases DP-PCA in every trial (on the trial's ~1,600
    training examples, q_p = 1): the declared trial -- checked against every
    trial's own ledger -- holds it, and one trial composed (fixed k = 1) costs
    DP-PCA + the lots + the score under the moments accountant."""
    import dp_accounting

    from dpfl_tf.privacy import compute_epsilon, dp_sgd_event

    config = _config(
        model="mlp",
        projection="dp_pca",
        hidden_units=64,
        pca_noise_multiplier=8.0,
        accountant="moments",
        l2_norm_clip=4.0,
        learning_rate=0.1,
        final_learning_rate=0.052,
        decay_epochs=10,
        target_epsilon=6.0,
    )
    tune = TuneConfig(trials=1, distribution="fixed", validation=0.2, learning_rates=(0.4,))
    result = tune_mnist(config, tune)
    assert result["stop_reason"] == "completed" and result["trials"] == "1 (fixed)"
    sigma = result["noise_multiplier"]
    n, lots = _held_out(result)
    trial = dp_accounting.ComposedDpEvent(
        [
            dp_accounting.PoissonSampledDpEvent(1.0, dp_accounting.GaussianDpEvent(8.0)),
            dp_sgd_event(sigma, lots, sampling_rate=100 / n),
            dp_accounting.GaussianDpEvent(20.0),
        ]
    )
    search = dp_accounting.SelfComposedDpEvent(trial, 1)
    assert result["epsilon"] == pytest.approx(compute_epsilon(search, 1e-5, "moments"), rel=1e-9)
    assert result["epsilon"] <= 6.0
    assert result["trial"]["event"].startswith(f"Poisson(q=1) Gaussian(sigma=8) + {lots} x")
    assert result["best"]["hyperparameters"]["learning_rate"] == 0.4
    assert result["best"]["hyperparameters"]["l2_norm_clip"] in (2.0, 4.0, 8.0)
    # the released model on the test set, through its own trial's projection: above
    # chance (0.1) after 16 noisy lots (the seeded run: 0.38)
    assert 0.25 < result["test_accuracy"] <= 1.0

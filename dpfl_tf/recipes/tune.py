"""A private hyperparameter search over a recipe: ``dpfl-tf train ... --tune``.

Papernot & Steinke 2022 (`dpfl_tf.tuning`) on the MNIST-family and ScatterNet
recipe (`dpfl_tf.recipes.mnist`): every trial is one run of the recipe with a
learning rate and a clip bound drawn at random (uniformly from `TuneConfig`'s
lists, independently of the data and of the other trials), the same training
noise sigma, lot size and number of epochs, followed by its score: top-1
accuracy on the V training examples held out from every trial's training (never
the test set), released with Gaussian noise (`ValidationScore`).  Each example
is held out with a fixed probability p (`TuneConfig.validation`, never derived
from the data) by a keyed hash of its own content (`Dataset.hash_split`, the
same examples in every trial): adding or removing one example moves no other
between training and validation, as the add/remove-one analysis below needs.
V and N - V are treated as public, as N is (the library's convention: they set
the sampling rate).  The
number of trials K is drawn from `TuneConfig.distribution` and kept secret;
only the best trial is released.

Privacy: one trial is ``ComposedDpEvent([inputs' release (DP-PCA, DP feature
statistics; none for the other models), epochs x (N - V) // L lots of
Poisson(q = L / (N - V)) Gaussian(sigma), Gaussian(score sigma)])`` (the
validation examples are private: their score is composed with the training,
as `dpfl_tf.tuning.scores` says), and the search is
``RepeatAndSelectDpEvent(trial, mean, shape)`` (random K, Renyi DP) or k
trials composed (``distribution="fixed"``).  sigma is the smallest noise whose
search costs at most the budget (`calibrate_search`); the ledger records the
search before the first trial (an interrupted search is charged in full) and
every trial's own ledger is checked against the declared trial
(`PrivateSelection.check_trial`).  The unit of privacy is one example of the
N training examples (validation included), add/remove-one.

Released: the best trial's hyperparameters, its noised score, its test
accuracy (the test set is not private) and the search's epsilon.  Not
released: the number of trials that ran, the other trials, their scores and
the search's wall time (so the results of a random number of trials carry no
time, and the command prints no line per trial unless asked).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Callable

import numpy as np

from dpfl_tf._seeds import derive_seed
from dpfl_tf._validation import ChoiceEnum, check_count, check_number
from dpfl_tf.recipes import mnist
from dpfl_tf.recipes.mnist import MnistConfig, MnistRecipe, input_features, input_release_event

__all__ = ["TrialDistribution", "TuneConfig", "tune_mnist", "LR_FACTORS", "CLIP_FACTORS"]

#: the default search space: the recipe's learning rate and clip bound times these
LR_FACTORS = (0.25, 0.5, 1.0, 2.0)
CLIP_FACTORS = (0.5, 1.0, 2.0)


class TrialDistribution(ChoiceEnum):
    """The distribution of the number of trials (`dpfl_tf.tuning.TrialCount`)."""

    __argument__ = "distribution"
    GEOMETRIC = "geometric"  # truncated negative binomial, shape 1
    LOGARITHMIC = "logarithmic"  # shape 0
    POISSON = "poisson"
    FIXED = "fixed"  # exactly `trials` trials, composed


@dataclasses.dataclass(frozen=True)
class TuneConfig:
    """A search's settings.

    Attributes:
      trials: the mean number of trials E[K] (> 1 for geometric and logarithmic,
        >= 1 for Poisson), or the number of trials k (``fixed``).
      distribution: `TrialDistribution`.
      learning_rates, clips: the values drawn from; empty: the recipe's
        learning rate times `LR_FACTORS` and clip bound times `CLIP_FACTORS`.
      validation: p, the probability with which each training example is held
        out for the score (by its own content, `Dataset.hash_split`): fixed in
        advance, never derived from the data.
      score_noise_multiplier: sigma of the score's noise (on the count of
        correct validation examples, sensitivity 1).
    """

    trials: float = 10.0
    distribution: TrialDistribution | str = TrialDistribution.GEOMETRIC
    learning_rates: tuple = ()
    clips: tuple = ()
    validation: float = 0.1
    score_noise_multiplier: float = 20.0

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 -- frozen
        set_("distribution", TrialDistribution.parse(self.distribution))
        if self.distribution is TrialDistribution.FIXED:
            set_("trials", check_count("trials", self.trials, minimum=1))
        else:
            self.trial_count()  # its own checks of the mean
        for name in ("learning_rates", "clips"):
            values = tuple(getattr(self, name))
            for v in values:
                check_number(f"{name}[]", v, low=0.0, low_open=True)
            set_(name, tuple(float(v) for v in values))
        set_(
            "validation",
            check_number(
                "validation", self.validation, low=0.0, high=1.0, low_open=True, high_open=True
            ),
        )
        set_(
            "score_noise_multiplier",
            check_number(
                "score_noise_multiplier", self.score_noise_multiplier, low=0.0, low_open=True
            ),
        )

    @property
    def random(self) -> bool:
        """True: a random, secret number of trials (Papernot & Steinke)."""
        return self.distribution is not TrialDistribution.FIXED

    def trial_count(self):
        """A `TrialCount` (random K), or the int k (fixed)."""
        from dpfl_tf.tuning import TrialCount

        d = self.distribution
        if d is TrialDistribution.FIXED:
            return int(self.trials)
        if d is TrialDistribution.POISSON:
            return TrialCount.poisson(self.trials)
        return TrialCount(self.trials, 1.0 if d is TrialDistribution.GEOMETRIC else 0.0)

    def describe_trials(self) -> str:
        return f"{self.trials} (fixed)" if not self.random else self.trial_count().describe()

    def space(self, config: MnistConfig) -> dict:
        """{hyperparameter: values} of the search on `config`'s recipe."""
        return {
            "learning_rate": list(
                self.learning_rates or (config.learning_rate * f for f in LR_FACTORS)
            ),
            "l2_norm_clip": list(self.clips or (config.l2_norm_clip * f for f in CLIP_FACTORS)),
        }


class _TrialRecipe(MnistRecipe):
    """One trial: the recipe with `validation` examples held out; it keeps the
    held-out examples' inputs for the score and measures nothing on the
    training examples (no non-private statistic)."""

    def inputs(self, ledger, releases):
        inputs = super().inputs(ledger, releases)
        self.validation_x = np.asarray(inputs.x_test)
        inputs.x_train_eval = inputs.y_train_eval = None
        return inputs


def _refusals(config: MnistConfig, tune: TuneConfig) -> None:
    if not config.private:
        raise ValueError("a private search needs private=True")
    if config.noise_multiplier is not None:
        raise ValueError(
            "the search calibrates the training noise for its budget: noise_multiplier must "
            f"be None, got {config.noise_multiplier!r}"
        )
    if config.target_epsilon is None:
        raise ValueError("the search needs a budget: target_epsilon")
    if config.user_level:
        raise ValueError(
            "a search of user-level runs (user_ids or users) is not supported: its "
            "validation score is released per example, not per user"
        )
    if config.validation or config.validation_fraction:
        raise ValueError(
            f"the search holds out its own validation examples (TuneConfig.validation), "
            f"got validation={config.validation or config.validation_fraction}"
        )
    if tune.random and config.accountant != "rdp":
        raise ValueError(
            f"a search with a random number of trials ({tune.describe_trials()}) is "
            f"bounded in Renyi DP only (Papernot & Steinke 2022): accountant must be "
            f"'rdp', got {config.accountant!r}"
        )


def tune_mnist(
    config: MnistConfig,
    tune: TuneConfig,
    *,
    should_stop: Callable[[], bool] | None = None,
    on_start: Callable[[dict], None] | None = None,
    on_trial: Callable[[dict, float], None] | None = None,
) -> dict:
    """Runs the search (module docstring) of `config`'s recipe within
    ``config.target_epsilon`` at ``config.delta``; returns the JSON-ready result.

    config: the recipe's settings every trial shares (lot size, epochs,
      model, accountant, seed, ...); its noise_multiplier must be None (the
      search calibrates it) and its learning rate and clip bound only set the
      default search space.
    should_stop(): polled between trials and after every lot; True stops the
      search (``stop_reason`` "interrupted"; nothing is released, the search
      stays charged in full).
    on_start(result): once the search is charged, before the first trial.
    on_trial(hyperparameters, seconds): after every trial (the caller's
      progress output; it shows how many trials ran, which the search keeps
      secret).
    """
    import dp_accounting

    from dpfl_tf.privacy import compute_epsilon, dp_sgd_event
    from dpfl_tf.privacy.events import describe_event
    from dpfl_tf.recipes.common import accuracy, deployment_note
    from dpfl_tf.recipes.run import run_recipe
    from dpfl_tf.tuning import PrivateSelection, Trial, ValidationScore, calibrate_search
    from dpfl_tf.tuning.trials import search_event

    _refusals(config, tune)
    data = mnist.load_dataset(config.dataset, data_dir=config.data_dir)  # the recipe's loader
    total = len(data.y_train)
    # each example held out by its own content with the fixed probability p: adding or
    # removing one example moves no other across the split (add/remove-one)
    try:
        y_val = data.hash_split(tune.validation).y_test.astype("int64")
    except ValueError as e:
        raise ValueError(f"validation ({tune.validation:g}): {e}") from None
    held = len(y_val)
    n = total - held
    if config.lot_size > n:
        raise ValueError(
            f"lot_size ({config.lot_size}) exceeds the {n} training examples a trial trains "
            f"on ({total} less {held} held out for the score)"
        )
    lots = config.epochs * max(1, n // config.lot_size)
    rate = config.lot_size / n
    release = input_release_event(config, n)

    def trial_event(sigma: float):
        training = dp_sgd_event(sigma, lots, sampling_rate=rate)
        return training if release is None else dp_accounting.ComposedDpEvent([release, training])

    seed = config.seed
    # 31 bits: a trial's seed is a recipe seed (`keras.utils.set_random_seed` takes < 2^32)
    seeded = (
        (lambda purpose, *i: derive_seed(seed, purpose, *i) >> 32) if seed is not None else None
    )
    score = ValidationScore(
        np.zeros((held, 1), np.float32),  # each trial's validation inputs replace it
        y_val,
        noise_multiplier=tune.score_noise_multiplier,
        seed=seeded and seeded("tune-score"),
    )
    trials = tune.trial_count()
    accountant, delta, budget = config.accountant, config.delta, config.target_epsilon
    # what the search costs whatever the training noise: the inputs' release and the scores
    floor = search_event(trials, release or dp_accounting.NoOpDpEvent(), score.event())
    floor_eps = compute_epsilon(floor, delta, accountant)
    if floor_eps >= budget:
        what = "validation scores"
        if release is not None:
            what = ("DP-PCA" if config.model == "mlp" else "DP feature statistics") + " and " + what
        raise ValueError(
            f"the search's {what} alone cost epsilon = {floor_eps:.3f} (score noise "
            f"{tune.score_noise_multiplier:g}, {tune.describe_trials()} trials), which leaves "
            f"nothing of the budget {budget:g} for training: raise the budget or the score "
            "noise, or lower the number of trials"
        )
    sigma, _ = calibrate_search(budget, delta, trials, trial_event, score, accountant=accountant)
    selection = PrivateSelection(
        trials,
        trial_event(sigma),
        score,
        delta=delta,
        accountant=accountant,
        seed=seeded and seeded("tune-trials"),
    )
    space = tune.space(config)
    recipe_settings = {
        k: v
        for k, v in dataclasses.asdict(config).items()
        if k
        not in (
            "learning_rate",
            "final_learning_rate",
            "l2_norm_clip",
            "noise_multiplier",
            "validation",
            "validation_fraction",
            "eval_every",
            "setting",
        )
    }
    recipe_settings["deltas"] = list(config.deltas)
    if not (config.projection == "dp_pca" and config.model == "mlp"):
        recipe_settings["pca_noise_multiplier"] = None  # no DP-PCA ran (as MnistRecipe.fields)

    def result(best: dict | None, stop_reason: str) -> dict:
        released = selection.result(
            None if best is None else Trial(best["hyperparameters"], best["score"])
        )
        search = released.to_dict()
        if best is not None:
            search["best"]["test_accuracy"] = best["test_accuracy"]
        out = {
            "dataset": config.dataset,
            "model": config.model,
            "mode": "private hyperparameter search",
            "epsilon": search["epsilon"],
            "epsilon_covers": "the whole search: every trial's training and "
            "validation score, and the selection of the best",
            "target_epsilon": budget,
            "delta": delta,
            "accountant": accountant,
            "trials": tune.describe_trials(),
            "trial_epsilon": released.trial_epsilon,
            "noise_multiplier": sigma,
            "test_accuracy": None if best is None else best["test_accuracy"],
            "best": search["best"],
            "search": search,
            "trial": {
                "epochs": config.epochs,
                "lots": lots,
                "lot_size": config.lot_size,
                "sampling_rate": rate,
                "training_examples": n,
                "event": describe_event(selection.trial_event),
            },
            "score": {
                "metric": "top-1 accuracy on held-out training examples, with noise",
                "validation_examples": held,
                "noise_multiplier": tune.score_noise_multiplier,
                "event": describe_event(score.event()),
            },
            "space": space,
            "recipe": recipe_settings,
            "privacy_unit": "example",
            "privacy_units": total,
            "stop_reason": stop_reason,
            "not_released": "the number of trials that ran, the other trials (their "
            "hyperparameters, scores and models) and the search's wall time: "
            "releasing them is not covered by epsilon",
        }
        note = deployment_note(seed)
        if note:
            if tune.random:  # the seed draws the number of trials too
                note += "; the number of trials can be recomputed from the seed"
            out["note"] = note
        return out

    selection.start()  # charged in full from here on
    if on_start is not None:
        on_start(result(None, "running"))
    best = None
    stop = should_stop or (lambda: False)
    for i in range(selection.num_trials):
        if stop():
            return result(None, "interrupted")
        hp = selection.draw(space)
        lr, clip = float(hp["learning_rate"]), float(hp["l2_norm_clip"])
        trial = dataclasses.replace(
            config,
            learning_rate=lr,
            # the recipe's schedule scaled to this learning rate
            final_learning_rate=(
                None
                if config.final_learning_rate is None
                else config.final_learning_rate * lr / config.learning_rate
            ),
            l2_norm_clip=clip,
            noise_multiplier=sigma,
            target_epsilon=None,  # the trial's length is declared; the search holds the budget
            validation_fraction=tune.validation,
            eval_every=config.epochs,
            seed=seeded and seeded("tune-trial", i),
        )
        recipe = _TrialRecipe(trial)
        start = time.perf_counter()
        with warnings.catch_warnings():  # a seeded search says it once (its "note")
            warnings.filterwarnings("ignore", r"seed=\d+: sampling and noise are reproducible")
            _, model = run_recipe(recipe, verbose=False, should_stop=should_stop)
        if model.stop_reason == "interrupted":
            return result(None, "interrupted")
        selection.check_trial(model)
        score.x = recipe.validation_x  # this trial's inputs (DP-PCA is per trial)
        value = selection.score_of(model)
        if best is None or value > best["score"]:
            x_test = input_features(trial, recipe.full.x_test, recipe.projection)
            best = {
                "hyperparameters": {"learning_rate": lr, "l2_norm_clip": clip},
                "score": value,
                "test_accuracy": accuracy(model, x_test, recipe.full.y_test),
            }
        if on_trial is not None:
            on_trial(dict(hp), time.perf_counter() - start)
    return result(best, "completed")

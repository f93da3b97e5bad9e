"""Private hyperparameter search: the best of a random number of DP trials.

Papernot & Steinke 2022 ("Hyperparameter tuning with Renyi differential
privacy"): a *run* Q draws hyperparameters at random (independently of the
data and of the other runs), trains with DP-SGD and releases a DP score; the
search runs Q K times, K ~ `TrialCount` (secret), and releases only the best
run (its hyperparameters, model and score).  The unit of privacy is the one
of the runs (one training example, add/remove-one for Poisson lots); the
search as a whole is ``RepeatAndSelectDpEvent(run, mean, shape)``, accounted
with Renyi DP (their Theorems 2 and 6, dp_accounting's RDP accountant), in
ONE `PrivacyLedger` recorded before the first trial.

Every run must cost no more than the run the search declared: after each
trial, the trial's own ledger (a fresh `DPModel` per trial) is checked against
the declared trial event order by order in Renyi DP (the bound of the theorem
is monotone in the run's RDP curve, and a run that draws its hyperparameters at
random is bounded by the largest curve among them); a trial that spent more
stops the search (`SearchPrivacyError`).

A fixed number of trials k (``trials=k``) is the usual search; its honest
epsilon composes all k runs (releasing every run bounds releasing the best),
and with a non-private score (``noise_multiplier=0``) it has none: the
result then reports the epsilon of one trial's training, which does NOT cover
the search.

    result = private_search(train, {"learning_rate": [0.1, 0.5, 1, 2]},
                            trials=TrialCount.geometric(mean=10),
                            trial_event=dp_sgd_event(sigma, steps, sampling_rate=q),
                            score=ValidationScore(x_val, y_val, noise_multiplier=10.0))
    result.best.hyperparameters, result.best.model, result.epsilon   # what to report
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import numpy as np
from dp_accounting import dp_event as _dp_event

from dpfl_tf._validation import check_number
from dpfl_tf.privacy.accountants import (
    AccountantKind,
    compute_epsilon,
    rdp_curve,
    refuse_repeat_and_select,
)
from dpfl_tf.privacy.calibration import calibrate_noise_multiplier
from dpfl_tf.privacy.events import describe_event, neighboring_relation_of
from dpfl_tf.privacy.ledger import PrivacyLedger
from dpfl_tf.tuning.scores import ValidationScore
from dpfl_tf.tuning.trials import TrialCount, search_event

__all__ = [
    "PrivateSelection",
    "SearchPrivacyError",
    "SearchResult",
    "Trial",
    "calibrate_search",
    "private_search",
]

SEARCH_LABEL = "hyperparameter search"


class SearchPrivacyError(ValueError):
    """A trial spent more privacy than the search declared for each run."""


@dataclasses.dataclass
class Trial:
    """The released run: its hyperparameters, its (noised) score, its model."""

    hyperparameters: dict
    score: float
    model: Any = None


@dataclasses.dataclass
class SearchResult:
    """What a search releases, and what it cost.

    ``epsilon`` is the search's (all trials and the selection; inf if the
    selection read private data without noise); ``trial_epsilon`` is one
    trial's training alone -- what a single run prints, which does not cover
    the search.  Both at ``delta``, with ``accountant``."""

    best: Trial | None
    ledger: PrivacyLedger
    delta: float
    accountant: str
    epsilon: float
    trial_epsilon: float
    covers_search: bool
    trials: str

    def to_dict(self) -> dict:
        """JSON-ready summary (the model left out)."""
        finite = math.isfinite(self.epsilon)
        return {
            "epsilon": self.epsilon if finite else None,
            "epsilon_covers_search": self.covers_search,
            "trial_epsilon": self.trial_epsilon,
            "delta": self.delta,
            "accountant": self.accountant,
            "trials": self.trials,
            "event": self.ledger.entries,
            "best": None
            if self.best is None
            else {"hyperparameters": self.best.hyperparameters, "score": self.best.score},
            "note": (
                "epsilon covers the whole search"
                if self.covers_search
                else "the search selected on non-private scores: it has no finite epsilon; "
                "trial_epsilon covers one trial's training only, not the search"
            ),
        }


class PrivateSelection:
    """The search mechanism both front ends share (`private_search`, `DPTuner`):
    the number of trials, the declared run, the ledger, the check of each
    trial and its score.

    Args:
      trials: a `TrialCount` (random, secret number of trials: Papernot &
        Steinke) or an int k (fixed: k runs composed).
      trial_event: the DpEvent of one trial's training (e.g. `dp_sgd_event`);
        every trial is checked against it.
      score: a `ValidationScore` (or any callable model -> float with
        ``event(relation)`` and ``private``); None: the caller selects on its
        own non-private objective (fixed k only).
      delta: the delta epsilon is reported at.
      accountant: "rdp" (the only one for a random number of trials); a fixed
        k may use any accountant of `dpfl_tf.privacy`.
      ledger: a ledger to record the search in (default: a new one).
      seed: seeds the number of trials (tests only; default OS entropy).
    """

    def __init__(
        self,
        trials: TrialCount | int,
        trial_event: _dp_event.DpEvent,
        score=None,
        *,
        delta: float = 1e-5,
        accountant: AccountantKind | str = AccountantKind.RDP,
        ledger: PrivacyLedger | None = None,
        seed: int | None = None,
    ):
        self.trials = trials
        self.trial_event = trial_event
        self.score = score
        self.delta = check_number("delta", delta, low=0.0, high=1.0, low_open=True, high_open=True)
        self.accountant = AccountantKind.parse(accountant)
        if not isinstance(trial_event, _dp_event.DpEvent):
            raise TypeError(
                f"trial_event must be a dp_accounting DpEvent, got {type(trial_event).__name__}"
            )
        relation = neighboring_relation_of(trial_event)
        score_event = _dp_event.NonPrivateDpEvent() if score is None else score.event(relation)
        if isinstance(trials, TrialCount):
            if isinstance(score_event, _dp_event.NonPrivateDpEvent):
                raise ValueError(
                    "a search with a random number of trials selects on a private score: pass "
                    "score=ValidationScore(x_val, y_val, noise_multiplier=sigma > 0) (or "
                    "public=True for public validation data), got "
                    f"{'no score' if score is None else 'noise_multiplier=0'}"
                )
            refuse_repeat_and_select(trials.event(trial_event), self.accountant)
        self.event = search_event(trials, trial_event, score_event)
        self.covers_search = not isinstance(score_event, _dp_event.NonPrivateDpEvent)
        self.ledger = ledger if ledger is not None else PrivacyLedger(self.accountant)
        self.ledger.admit(self.event)  # refuses another relation before anything runs
        rng = np.random.default_rng(seed)
        self.num_trials = trials.sample(rng) if isinstance(trials, TrialCount) else int(trials)
        self.hyperparameter_rng = np.random.default_rng(rng.integers(2**63))
        self._declared = None
        self.started = False

    def start(self) -> None:
        """Records the whole search in the ledger, once, before the first trial
        (privacy counts computations: an interrupted search is charged in full)."""
        if not self.started:
            self.ledger.record(self.event, label=SEARCH_LABEL)
            self.started = True

    def check_trial(self, model) -> None:
        """Raises `SearchPrivacyError` if the trained `model`'s ledger (a fresh
        DPModel per trial) exceeds the declared trial event at some RDP order."""
        spent = model.privacy_ledger.event
        if self._declared is None:
            self._declared = rdp_curve(self.trial_event)
        orders, declared = self._declared
        _, actual = rdp_curve(spent)
        over = np.flatnonzero(actual > declared * (1 + 1e-9) + 1e-12)
        if over.size:
            i = over[0]
            raise SearchPrivacyError(
                f"a trial spent {describe_event(spent)}, more than the search declared for each "
                f"trial, {describe_event(self.trial_event)} (Renyi DP at order {orders[i]:g}: "
                f"{actual[i]:.4g} > {declared[i]:.4g}); every trial must train with the "
                "declared noise, lot size, sampling and number of lots. The search stops: its "
                "ledger no longer bounds what was spent"
            )

    def score_of(self, model) -> float:
        """The trial's score (NaN, a diverged model: -inf, never selected)."""
        value = float(self.score(model))
        return -math.inf if math.isnan(value) else value

    def draw(self, space) -> dict:
        """Hyperparameters for one trial, independent of the data and of other
        trials: `space` a function rng -> dict, or {name: [values]} (uniform)."""
        if callable(space):
            return dict(space(self.hyperparameter_rng))
        if not isinstance(space, Mapping) or not space:
            raise ValueError(
                f"space must be a function rng -> dict or a non-empty dict "
                f"{{name: [values]}}, got {space!r}"
            )
        out = {}
        for name, values in space.items():
            values = list(values)
            if not values:
                raise ValueError(f"space[{name!r}] must list at least one value, got []")
            out[name] = values[int(self.hyperparameter_rng.integers(len(values)))]
        return out

    def result(self, best: Trial | None) -> SearchResult:
        epsilon = self.ledger.epsilon(self.delta, self.accountant)
        return SearchResult(
            best=best,
            ledger=self.ledger,
            delta=self.delta,
            accountant=self.accountant.value,
            epsilon=epsilon if self.covers_search else math.inf,
            trial_epsilon=compute_epsilon(self.trial_event, self.delta, self.accountant),
            covers_search=self.covers_search,
            trials=(
                self.trials.describe()
                if isinstance(self.trials, TrialCount)
                else f"{self.trials} (fixed)"
            ),
        )


def private_search(
    train: Callable[[dict], Any],
    space,
    *,
    trials: TrialCount | int,
    trial_event: _dp_event.DpEvent,
    score: ValidationScore,
    delta: float = 1e-5,
    accountant: AccountantKind | str = AccountantKind.RDP,
    ledger: PrivacyLedger | None = None,
    seed: int | None = None,
    keep_model: bool = True,
) -> SearchResult:
    """Random search over `space`, released privately (module docstring).

    Args:
      train: hyperparameters -> a *new* `DPModel` trained with them (its ledger
        holds that trial only, and must not exceed `trial_event`).
      space: a function rng -> hyperparameter dict, or {name: [values]}; drawn
        independently for every trial.
      trials, trial_event, score, delta, accountant, ledger, seed: see
        `PrivateSelection`.
      keep_model: keep the best trial's model in the result.

    Returns a `SearchResult`: only the best trial is released; ``best`` is None
    if no trial ran (Poisson K = 0).  The number of trials is not returned.
    """
    selection = PrivateSelection(
        trials, trial_event, score, delta=delta, accountant=accountant, ledger=ledger, seed=seed
    )
    selection.start()
    best = None
    for _ in range(selection.num_trials):
        hyperparameters = selection.draw(space)
        model = train(dict(hyperparameters))
        selection.check_trial(model)
        value = selection.score_of(model)
        if best is None or value > best.score:
            best = Trial(hyperparameters, value, model if keep_model else None)
    return selection.result(best)


def calibrate_search(
    target_epsilon: float,
    delta: float,
    trials: TrialCount | int,
    make_trial_event: Callable[[float], _dp_event.DpEvent],
    score=None,
    *,
    accountant: AccountantKind | str = AccountantKind.RDP,
) -> tuple[float, float]:
    """(sigma, eps): the smallest training noise multiplier sigma whose search
    (``make_trial_event(sigma)`` per trial, `score`'s event, `trials`) costs at
    most `target_epsilon` at `delta`."""

    def make_event(sigma):
        trial = make_trial_event(sigma)
        score_event = None if score is None else score.event(neighboring_relation_of(trial))
        return search_event(trials, trial, score_event)

    return calibrate_noise_multiplier(target_epsilon, delta, make_event, accountant)

"""Private hyperparameter search on Keras Tuner (``pip install dpfl-tf[tune]``).

`DPTuner` is a Keras Tuner ``Tuner`` whose oracle, `DPRandomSearchOracle`,
runs a number of trials drawn from Papernot & Steinke's distribution
(`TrialCount`, kept secret) with hyperparameters drawn independently for every
trial (Keras Tuner's RandomSearch avoids repeats, which makes a trial's
values depend on the earlier ones; here they never do).  Each trial builds a
`DPModel` from the hypermodel, trains it with the arguments given to
``search`` and is scored by a `ValidationScore` (a noised metric on held-out
data); the search is recorded in one `PrivacyLedger` (``tuner.ledger``, also
written to the project directory) as ``RepeatAndSelectDpEvent`` around the
trial's event, before the first trial, and accounted with RDP.

    tuner = DPTuner(build, trials=TrialCount.geometric(10), trial_event=event,
                    score=ValidationScore(x_val, y_val, noise_multiplier=10.0),
                    directory=tmp, project_name="mnist")
    tuner.search(x, y, lot_size=256, epochs=5)
    model = tuner.get_best_models(1)[0]; tuner.report()   # the release and its epsilon

Only the best trial is released: ``tuner.report()``, ``get_best_models(1)``,
``get_best_hyperparameters(1)`` and ``results_summary()`` (which shows the
best trial only).  The project directory and the console log of the search
hold every trial -- their scores and their number -- and are as private as
the training data.

With ``trials=k`` (an int) and ``score=None`` this is the usual search on a
Keras objective (e.g. "val_accuracy" on private validation data): every
trial's ledger is checked all the same, and ``report()`` gives the epsilon of
one trial's training, which does NOT cover the search (the search itself has
no finite epsilon).
"""

from __future__ import annotations

import os

try:
    import keras_tuner as kt
except ImportError as err:  # pragma: no cover - the optional extra
    raise ImportError(
        "dpfl_tf.tuning.keras_tuner needs Keras Tuner: pip install 'dpfl-tf[tune]' (or keras-tuner)"
    ) from err
from keras_tuner.src.engine import hyperparameters as hp_module
from keras_tuner.src.engine import trial as trial_module

from dpfl_tf.privacy.ledger import PrivacyLedger
from dpfl_tf.tuning.search import SEARCH_LABEL, PrivateSelection, SearchPrivacyError, Trial

__all__ = ["DPRandomSearchOracle", "DPTuner"]

SCORE_NAME = "dp_score"
LEDGER_FILE = "privacy_ledger.json"


class DPRandomSearchOracle(kt.Oracle):
    """Random search over `num_trials` trials, values drawn independently.

    Args:
      num_trials: the number of trials to run (drawn by `PrivateSelection`
        from a `TrialCount`; kept in the oracle's state, so a reloaded search
        runs the same number).
      objective, hyperparameters, allow_new_entries, tune_new_entries, seed:
        as for Keras Tuner's oracles (`seed` seeds the hyperparameter draws).

    A trial that fails is not retried (a retry is one more run than the
    analysis counts) and failures never stop the search early (stopping would
    depend on the data): a failed trial is a run whose output is never
    selected.
    """

    def __init__(
        self,
        num_trials: int,
        objective=None,
        *,
        hyperparameters=None,
        allow_new_entries: bool = True,
        tune_new_entries: bool = True,
        seed=None,
    ):
        self.num_trials = int(num_trials)
        super().__init__(
            objective=objective,
            max_trials=max(self.num_trials, 1),
            hyperparameters=hyperparameters,
            allow_new_entries=allow_new_entries,
            tune_new_entries=tune_new_entries,
            seed=seed,
            max_retries_per_trial=0,
            max_consecutive_failed_trials=self.num_trials + 1,
        )

    def populate_space(self, trial_id):
        # the trial being created is not in self.trials yet
        if len(self.trials) >= self.num_trials:
            return {"status": trial_module.TrialStatus.STOPPED, "values": None}
        hps = hp_module.HyperParameters()
        for hp in self.hyperparameters.space:
            hps.merge([hp])
            if hps.is_active(hp):  # no check against earlier trials: independent draws
                hps.values[hp.name] = hp.random_sample(self._seed_state)
                self._seed_state += 1
        return {"status": trial_module.TrialStatus.RUNNING, "values": hps.values}

    def score_trial(self, trial):
        super().score_trial(trial)
        if trial.score is None or trial.score != trial.score:  # NaN: never the best
            trial.score = float("-inf") if self.objective.direction == "max" else float("inf")

    def get_state(self):
        return {**super().get_state(), "dp_num_trials": self.num_trials}

    def set_state(self, state):
        super().set_state(state)
        self.num_trials = int(state["dp_num_trials"])
        self.max_trials = max(self.num_trials, 1)
        self.max_consecutive_failed_trials = self.num_trials + 1


class DPTuner(kt.Tuner):
    """Keras Tuner search of `DPModel`s, released privately (module docstring).

    Args:
      hypermodel: a function hp -> compiled `DPModel` (or a `kt.HyperModel`
        whose ``build`` returns one; its ``fit`` trains it).
      trials: a `TrialCount` (private search) or an int (fixed count).
      trial_event: the DpEvent of one trial's training; every trial's ledger
        is checked against it (`PrivateSelection.check_trial`).
      score: a `ValidationScore`; None with an int `trials`: select on
        `objective`, a Keras metric (non-private).
      objective: the Keras objective when `score` is None.
      delta, accountant, ledger, seed: see `PrivateSelection`.
      hyperparameters, allow_new_entries, tune_new_entries: as for Keras Tuner.
      **kwargs: `kt.Tuner` arguments (directory, project_name, overwrite, ...).
    """

    def __init__(
        self,
        hypermodel,
        *,
        trials,
        trial_event,
        score=None,
        objective=None,
        delta: float = 1e-5,
        accountant="rdp",
        ledger: PrivacyLedger | None = None,
        seed: int | None = None,
        hyperparameters=None,
        allow_new_entries=True,
        tune_new_entries=True,
        **kwargs,
    ):
        if score is not None and objective is not None:
            raise ValueError(
                f"pass either score= (a private score, objective {SCORE_NAME!r}) "
                f"or objective= (a Keras metric, non-private), got both"
            )
        if score is None and objective is None:
            raise ValueError(
                "pass score=ValidationScore(...) (private) or, with a fixed "
                "number of trials, objective= a Keras metric (non-private)"
            )
        self.selection = PrivateSelection(
            trials, trial_event, score, delta=delta, accountant=accountant, ledger=ledger, seed=seed
        )
        oracle = DPRandomSearchOracle(
            self.selection.num_trials,
            objective=kt.Objective(SCORE_NAME, "max") if score is not None else objective,
            hyperparameters=hyperparameters,
            allow_new_entries=allow_new_entries,
            tune_new_entries=tune_new_entries,
            seed=seed,
        )
        super().__init__(oracle, hypermodel, **kwargs)
        self._load_ledger()

    @property
    def ledger(self) -> PrivacyLedger:
        """The one ledger of the whole search."""
        return self.selection.ledger

    def _ledger_path(self) -> str:
        return os.path.join(self.project_dir, LEDGER_FILE)

    def _load_ledger(self) -> None:
        """A reloaded project continues its ledger: the search is charged once."""
        path = self._ledger_path()
        if os.path.exists(path) and not self.selection.started:
            saved = PrivacyLedger.load(path)
            if saved.count(SEARCH_LABEL):
                self.selection.ledger = saved
                self.selection.started = True

    def search(self, *fit_args, **fit_kwargs):
        """Runs the trials; `fit_args` / `fit_kwargs` go to each trial's
        ``DPModel.fit`` (x, y, lot_size=, epochs=, ...)."""
        self.selection.start()
        self.ledger.save(self._ledger_path())
        return super().search(*fit_args, **fit_kwargs)

    def run_trial(self, trial, *args, **kwargs):
        from dpfl_tf.keras.model import DPModel

        hp = trial.hyperparameters
        model = self.hypermodel.build(hp)
        if not isinstance(model, DPModel):
            raise kt.errors.FatalError(
                f"the hypermodel must build a compiled dpfl_tf.keras.DPModel, got "
                f"{type(model).__name__}: a trial trained without DP-SGD is not covered"
            )
        history = self.hypermodel.fit(hp, model, *args, **kwargs)
        try:
            self.selection.check_trial(model)
        except SearchPrivacyError as err:
            raise kt.errors.FatalError(str(err)) from err
        self.save_model(trial.trial_id, model)
        if self.selection.score is None:
            return history
        return {SCORE_NAME: self.selection.score_of(model)}

    def save_model(self, trial_id, model, step=0):
        if not model.built:  # a DPModel trained by fit is built through its inner model
            model.build(None)
        model.save_weights(self._get_checkpoint_fname(trial_id))

    def load_model(self, trial):
        """The trial's DPModel with its trained weights (its own ledger is empty:
        the search's is `ledger`)."""
        model = self.hypermodel.build(trial.hyperparameters)
        if not model.built:
            model.build(None)
        model.load_weights(self._get_checkpoint_fname(trial.trial_id))
        return model

    def report(self) -> dict:
        """The release: the best trial's hyperparameters and score, and the
        epsilon (`SearchResult.to_dict`)."""
        best = None
        done = [
            t for t in self.oracle.trials.values() if t.status == trial_module.TrialStatus.COMPLETED
        ]
        if done:
            trial = self.oracle.get_best_trials(1)[0]
            best = Trial(dict(trial.hyperparameters.values), float(trial.score))
        return self.selection.result(best).to_dict()

    def results_summary(self, num_trials=1):
        """Shows the best trial only: the others are not released."""
        if num_trials != 1:
            raise ValueError(
                f"a private search releases its best trial only: num_trials "
                f"must be 1, got {num_trials}"
            )
        report = self.report()
        print(
            f"Best trial: {report['best']}; epsilon {report['epsilon']} at delta "
            f"{report['delta']:g} ({report['accountant']}; {report['note']})"
        )

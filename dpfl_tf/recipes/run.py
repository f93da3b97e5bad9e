"""The life cycle every `train` recipe shares, written once.

    start or resume -> inputs -> build or restore -> calibrate -> plan -> fit -> result

A recipe (`Recipe`) says only what differs: how its inputs are made
(`Recipe.inputs`, the SAME function for a first run and a resume: a resume
passes the DP releases saved beside the checkpoint instead of releasing them
again), its network, its optimizer and its result fields.  `run_recipe` does
the rest: the checkpoint and its run state, the noise calibrated for the
budget (after whatever the inputs released), the number of lots, the history,
interrupts, and the result.

Resume is exact for seeded runs: the lots are keyed by their absolute number
(`LotSampler`), the noise by the lot counter (`GaussianSanitizer.add_noise`),
per-lot randomness of the inputs (augmentation) by the lot number, and a run
interrupted inside an epoch first finishes that epoch (the lots beyond its end
are skipped in the graph), so that every later epoch spans the lots of an
uninterrupted run.  A seeded run interrupted and resumed ends with the
weights of the same run uninterrupted.

Inputs that name the user of every example (`Inputs.user_ids`) make the run
user-level DP-SGD (`dpfl_tf.keras.users`): lots sample users (q = L / U, an
epoch U // L lots), the noise is calibrated and the budget kept for that rate,
the result states the unit (``privacy_unit`` "user", ``users``), and a resume
checks that the users are the same (a digest of the grouping in the run state).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable

import dp_accounting
import keras
import numpy as np

from dpfl_tf.privacy import (
    PrivacyLedger,
    calibrate_noise_multiplier,
    dp_sgd_event,
    gaussian_step_event,
    max_steps,
)
from dpfl_tf.recipes.common import (
    EpochHistory,
    LotStopper,
    RunCheckpoint,
    accuracy,
    comparable_config,
    mark_run_finished,
    paper_learning_rate,
    privacy_summary,
    resumable_run_state,
)

__all__ = ["Inputs", "Recipe", "run_recipe"]


@dataclasses.dataclass
class Inputs:
    """What a run trains and evaluates on.

    x_train, y_train: arrays, or a random-access source and None.
    x_test, y_test: the held-out evaluation set (arrays or a tf.data pipeline).
    x_train_eval, y_train_eval: where training accuracy (a non-private
      statistic) is measured; None: not measured.
    preprocess: applied to each lot inside tf.data (`DPModel.fit`).
    examples: N, the private training examples (q = L / N).
    releases: DP releases made while preparing the inputs ({name: array}),
      kept beside the checkpoint so that a resume reuses them (their cost is
      in the ledger once).
    user_ids: user-level DP-SGD (`dpfl_tf.keras.users`): the user of every
      training example (N ids, or a `ClientPartition`); the unit of privacy is
      then a user, the lot size counts users and q = L / U.  None: example-level.
    max_examples_per_user: with `user_ids`, at most this many examples of a
      user in a lot (None: all of them).
    """

    x_train: Any
    y_train: Any
    x_test: Any
    y_test: Any
    examples: int
    x_train_eval: Any = None
    y_train_eval: Any = None
    preprocess: Callable | None = None
    releases: dict = dataclasses.field(default_factory=dict)
    user_ids: Any = None
    max_examples_per_user: int | None = None

    @property
    def user_level(self) -> bool:
        return self.user_ids is not None


def _users(inputs: Inputs) -> tuple[int, str]:
    """(U, a digest of the grouping) of a user-level run's inputs: the number
    of users, and what a resume checks to train the same users."""
    import hashlib

    from dpfl_tf.keras.users import group_users

    indices, offsets = group_users(inputs.user_ids, inputs.examples)
    digest = hashlib.sha256(np.ascontiguousarray(indices, np.int64).tobytes())
    digest.update(np.ascontiguousarray(offsets, np.int64).tobytes())
    return len(offsets) - 1, digest.hexdigest()


class Recipe:
    """What one training recipe adds to `run_recipe`.  Its config must have the
    fields private, seed, noise_multiplier, l2_norm_clip, lot_size, batch_size,
    learning_rate, final_learning_rate, decay_epochs, momentum, target_epsilon,
    delta, accountant, epochs, eval_every and deltas."""

    #: config fields a resumed run may change (they do not change what is trained)
    #: settings a resume may change: where the data are, how often to evaluate,
    #: the physical batch (memory only: the lots and the privacy do not change)
    resumable_changes: tuple = ("data_dir", "eval_every", "batch_size")
    #: the config of the defaults (a checkpoint written before a field existed
    #: resumes with its default); None: every field must be recorded
    default_config = None

    def __init__(self, config):
        self.config = config

    def comparable(self, config=None) -> dict:
        return comparable_config(dataclasses.asdict(config or self.config), self.resumable_changes)

    # -- hooks ----------------------------------------------------------------------
    def check(self) -> None:
        """Refusals of a new run before any data is read."""

    def inputs(self, ledger: PrivacyLedger | None, releases: dict | None) -> Inputs:
        """The inputs.  `releases` is None for a new run (make the DP releases,
        recording them in `ledger`), else the releases of the run resumed."""
        raise NotImplementedError

    def network(self, inputs: Inputs, ledger: PrivacyLedger | None) -> keras.Model:
        """The network of a new run (a release it makes goes into `ledger`)."""
        raise NotImplementedError

    def restored(self, state: dict, model) -> None:
        """A resumed run's recipe state (`state()` of the run that wrote it)."""

    def state(self) -> dict:
        """What the recipe needs to resume, beside the run state (JSON)."""
        return {}

    def start_row(self, net: keras.Model, inputs: Inputs) -> dict | None:
        """A history row before training (epoch 0), or None."""
        return None

    def l2_norm_clip(self):
        return self.config.l2_norm_clip

    def fit_nonprivate(self, net, inputs: Inputs, learning_rate, epochs: int, callbacks) -> None:
        net.compile(
            optimizer=keras.optimizers.SGD(learning_rate, momentum=self.config.momentum),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        net.fit(
            inputs.x_train,
            inputs.y_train,
            batch_size=self.config.lot_size,
            epochs=epochs,
            callbacks=list(callbacks),
            verbose=0,
        )

    def fields(self, run: "_Run", model) -> dict:
        """The result: the recipe's fields (the run adds the common ones after)."""
        return dataclasses.asdict(self.config)

    def too_few_examples(self, n: int) -> str:
        return f"lot_size ({self.config.lot_size}) exceeds the {n} training examples"

    def too_few_users(self, users: int) -> str:
        return (
            f"lot_size ({self.config.lot_size}) counts users in a user-level run: it "
            f"exceeds the {users} users"
        )


@dataclasses.dataclass
class _Run:
    """One run's plan and progress (what the result and the run state read)."""

    recipe: Recipe
    inputs: Inputs
    start: float
    lots_per_epoch: int
    steps_per_epoch: int
    noise_multiplier: float | None
    total_epochs: int
    initial_epoch: int = 0
    start_row: dict | None = None
    seconds_before: float = 0.0
    releases: dict = dataclasses.field(default_factory=dict)  # name -> file
    history: EpochHistory | None = None
    #: user-level runs: (U, digest of the grouping); None: example-level
    users: tuple | None = None

    @property
    def rows(self) -> list:
        return self.history.rows

    def result(self, model, final: bool = False) -> dict:
        config, inputs = self.recipe.config, self.inputs
        rows = self.rows
        last = rows[-1] if rows else (self.start_row or {"epoch": self.initial_epoch})
        evaluated = [r for r in [self.start_row or {}, *rows] if "test_accuracy" in r]
        if "test_accuracy" in last:
            test_acc = last["test_accuracy"]
        elif final:
            test_acc = accuracy(model, inputs.x_test, inputs.y_test)
        else:
            test_acc = evaluated[-1]["test_accuracy"] if evaluated else None
        if "train_accuracy" in last:
            train_acc = last["train_accuracy"]
        elif final and inputs.x_train_eval is not None:
            train_acc = accuracy(model, inputs.x_train_eval, inputs.y_train_eval)
        else:
            train_acc = next(
                (r["train_accuracy"] for r in reversed(evaluated) if "train_accuracy" in r), None
            )
        ledger = model.privacy_ledger if config.private else None
        return {
            **self.recipe.fields(self, model),
            "noise_multiplier": self.noise_multiplier if config.private else None,
            "epochs": last["epoch"],
            "lots": (
                model.lots_applied if config.private else last["epoch"] * self.steps_per_epoch
            ),
            "epsilon": ledger.epsilon(config.delta) if config.private else None,
            "test_accuracy": test_acc,
            "train_accuracy": train_acc,
            "seconds": self.seconds_before + time.perf_counter() - self.start,
            "stop_reason": getattr(model, "stop_reason", None) or "running",
            "history": ([self.start_row] if self.start_row else []) + list(rows),
            **self.unit(),
            **privacy_summary(ledger, config.delta, config.seed),
        }

    def unit(self) -> dict:
        """The unit of privacy epsilon is stated for, and its count."""
        if not self.recipe.config.private:
            return {}
        if self.users is None:
            return {"privacy_unit": "example", "privacy_units": self.inputs.examples}
        return {
            "privacy_unit": "user",
            "privacy_units": self.users[0],
            "users": self.users[0],
            "examples": self.inputs.examples,
            "max_examples_per_user": self.inputs.max_examples_per_user,
        }

    def state(self, model) -> dict:
        return {
            "config": self.recipe.comparable(),
            "noise_multiplier": self.noise_multiplier,
            "total_epochs": self.total_epochs,
            "lots_per_epoch": self.lots_per_epoch,
            "lots": model.lots_applied,
            "releases": self.releases,
            "row0": self.start_row,
            "history": self.rows,
            "seconds": self.seconds_before + time.perf_counter() - self.start,
            "finished": None,
            "user_ids_digest": None if self.users is None else self.users[1],
            **self.recipe.state(),
        }


def _saved_releases(directory: str, state: dict) -> dict:
    names = dict(state.get("releases") or {})
    if state.get("projection"):  # a checkpoint of dpfl_tf 0.1
        names.setdefault("projection", state["projection"])
    return {name: np.load(os.path.join(directory, file)) for name, file in names.items()}


def _write_releases(directory: str, releases: dict) -> dict:
    from dpfl_tf._io import atomic_write

    names = {}
    for name, value in releases.items():
        names[name] = f"{name}.npy"
        atomic_write(
            os.path.join(directory, names[name]), lambda f, v=value: np.save(f, v), binary=True
        )
    return names


def _calibrated(config, prior: dp_accounting.DpEvent, lots: int, rate: float) -> float:
    """The smallest sigma whose `lots` lots at rate `rate`, after `prior`, stay
    within (target_epsilon, delta)."""
    if config.target_epsilon is None:
        raise ValueError("noise_multiplier=None needs a target_epsilon to calibrate for")

    def event_for(sigma):
        return dp_accounting.ComposedDpEvent([prior, dp_sgd_event(sigma, lots, sampling_rate=rate)])

    sigma, _ = calibrate_noise_multiplier(
        config.target_epsilon, config.delta, event_for, config.accountant, tolerance=1e-3
    )
    return sigma


def _no_lot_message(config, sigma: float, rate: float, spent) -> str:
    """Why the budget allows no lot: what the first lot brings epsilon to under
    each accountant that can analyse it, and what to change (one line)."""
    from dpfl_tf.privacy.accountants import epsilon_by_accountant
    from dpfl_tf.privacy.events import describe_event

    step = gaussian_step_event(sigma, sampling_rate=rate)
    event = dp_accounting.ComposedDpEvent(([spent] if spent is not None else []) + [step])
    costs = [
        f"{eps:.4g} ({kind.value})"
        for kind, eps in epsilon_by_accountant(event, config.delta).items()
    ]
    return (
        f"target_epsilon={config.target_epsilon:g} allows no lot of {describe_event(step)}: "
        f"{'with what is already spent, ' if spent is not None else ''}one brings epsilon to "
        f"{', '.join(costs)} at delta={config.delta:g}; raise the budget (--epsilon) or "
        f"the noise multiplier (--noise-multiplier, now {sigma:g})"
    )


def _planned_epochs(config, sigma: float, rate: float, spent, lots_per_epoch: int) -> int:
    """Epochs to run: `config.epochs`, or fewer when the budget ends sooner."""
    if config.target_epsilon is None:
        return config.epochs
    lots = max_steps(
        config.target_epsilon,
        config.delta,
        gaussian_step_event(sigma, sampling_rate=rate),
        config.accountant,
        already_spent=spent,
        limit=config.epochs * lots_per_epoch,  # more are never run
    )
    if lots == 0:
        raise ValueError(_no_lot_message(config, sigma, rate, spent))
    return min(config.epochs, EpochHistory.estimated_epochs(lots, lots_per_epoch))


def run_recipe(
    recipe: Recipe,
    *,
    verbose: bool = True,
    checkpoint_dir: str | None = None,
    checkpoint_every_epoch: bool = True,
    on_epoch=None,
    should_stop=None,
    on_resume=None,
    callbacks=(),
) -> tuple[dict, keras.Model]:
    """Runs `recipe`; returns (JSON-ready result, the trained model).

    checkpoint_dir: if it holds a checkpoint of the same configuration, the
      run resumes from it exactly (weights, ledger, lot counter, optimizer
      state and so the learning-rate schedule, the DP releases of the inputs,
      the history) and ends after the same lots as an uninterrupted run;
      checkpoints are written there after every epoch
      (`checkpoint_every_epoch`) or only when `should_stop` ends the run.
    on_epoch(result): called after every epoch with everything measured so far.
    should_stop(): polled after every call of the training function; True ends
      training there (``stop_reason`` "interrupted"; a checkpoint is written).
    on_resume(info): called once when resuming ({"directory", "lots", "epoch",
      "epsilon"}).
    """
    from dpfl_tf.keras import DPSGD, DPModel
    from dpfl_tf.keras.checkpoint import DPCheckpoint

    config = recipe.config
    start = time.perf_counter()
    defaults = recipe.comparable(recipe.default_config) if recipe.default_config else None
    state = resumable_run_state(checkpoint_dir, recipe.comparable(), defaults=defaults)
    if state is None:
        recipe.check()
    if config.seed is not None:
        keras.utils.set_random_seed(config.seed)
    ledger = PrivacyLedger(config.accountant) if config.private and state is None else None
    releases = _saved_releases(checkpoint_dir, state) if state is not None else None
    inputs = recipe.inputs(ledger, releases)
    n = inputs.examples
    if config.lot_size > n:
        raise ValueError(recipe.too_few_examples(n))
    users = None
    if inputs.user_level:  # lots sample users: q = L / U, an epoch is U / L lots
        if not config.private:
            raise ValueError("user_ids: user-level DP-SGD is for private runs (private=True)")
        users = _users(inputs)
        if config.lot_size > users[0]:
            raise ValueError(recipe.too_few_users(users[0]))
    units = n if users is None else users[0]
    lots_per_epoch = max(1, units // config.lot_size)
    steps_per_epoch = lots_per_epoch if config.private else -(-n // config.lot_size)
    rate = config.lot_size / units
    if state is not None:
        if state["lots_per_epoch"] != lots_per_epoch:
            raise ValueError(
                f"{checkpoint_dir} holds a run of {state['lots_per_epoch']} lots "
                f"per epoch, this data gives {lots_per_epoch} ({units} training "
                f"{'examples' if users is None else 'users'}): not the same data; use "
                "another checkpoint directory"
            )
        if state.get("user_ids_digest") != (None if users is None else users[1]):
            raise ValueError(
                f"{checkpoint_dir} holds a run of other users (its user ids differ from "
                "these): not the same run; use another checkpoint directory"
            )
        model, _ = DPCheckpoint.restore(checkpoint_dir)
        recipe.restored(state, model)
        run = _Run(
            recipe,
            inputs,
            start,
            lots_per_epoch,
            steps_per_epoch,
            state["noise_multiplier"],
            state["total_epochs"],
            initial_epoch=model.lots_applied // lots_per_epoch,
            start_row=state.get("row0"),
            seconds_before=state["seconds"],
            releases=dict(state.get("releases") or {}),
            users=users,
        )
        if state.get("projection") and "projection" not in run.releases:
            run.releases["projection"] = state["projection"]
        if on_resume is not None:
            on_resume(
                {
                    "directory": checkpoint_dir,
                    "lots": model.lots_applied,
                    "epoch": model.lots_applied / lots_per_epoch,
                    "epsilon": model.epsilon(config.delta),
                }
            )
    else:
        net = recipe.network(inputs, ledger)
        sigma = config.noise_multiplier
        total_epochs = config.epochs
        if config.private:
            if sigma is None:
                sigma = _calibrated(config, ledger.event, config.epochs * lots_per_epoch, rate)
            total_epochs = _planned_epochs(
                config, sigma, rate, ledger.event if len(ledger) else None, lots_per_epoch
            )
        run = _Run(
            recipe,
            inputs,
            start,
            lots_per_epoch,
            steps_per_epoch,
            sigma,
            total_epochs,
            start_row=recipe.start_row(net, inputs),
            users=users,
        )
    run.history = EpochHistory(
        inputs.x_test,
        inputs.y_test,
        inputs.x_train_eval,
        inputs.y_train_eval,
        every=config.eval_every,
        deltas=config.deltas,
        total_epochs=run.total_epochs,
        private=config.private,
        verbose=verbose,
    )
    if state is not None:
        run.history.rows = [r for r in state["history"] if r["epoch"] <= run.initial_epoch]
    lr = paper_learning_rate(
        config.learning_rate,
        config.learning_rate if config.final_learning_rate is None else config.final_learning_rate,
        config.decay_epochs,
        steps_per_epoch,
    )
    if not config.private:
        if state is not None:
            raise ValueError("checkpoint_dir: resuming is for private runs (private=True)")
        recipe.fit_nonprivate(net, inputs, lr, run.total_epochs, [run.history, *callbacks])
        net.stop_reason = "completed"
        return run.result(net, final=True), net

    if state is None:
        model = DPModel(net, ledger=ledger)
        model.compile(
            optimizer=DPSGD(
                lr,
                momentum=config.momentum,
                l2_norm_clip=recipe.l2_norm_clip(),
                noise_multiplier=sigma,
                seed=config.seed,
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    def run_state() -> dict:
        if inputs.releases and not run.releases:  # once, before the first checkpoint
            run.releases = _write_releases(checkpoint_dir, inputs.releases)
        return run.state(model)

    _fit(
        model,
        run,
        checkpoint_dir,
        checkpoint_every_epoch,
        run_state,
        on_epoch,
        should_stop,
        callbacks,
    )
    mark_run_finished(checkpoint_dir, run_state, model.stop_reason)
    return run.result(model, final=model.stop_reason != "interrupted"), model


def _fit(
    model, run: _Run, checkpoint_dir, every_epoch: bool, run_state, on_epoch, should_stop, callbacks
) -> None:
    """DP-SGD from the model's lot counter to the planned end.  A run resumed
    inside an epoch first finishes that epoch: its own fit, whose lots beyond
    the epoch's end are skipped in the graph (`LotStopper`), so that the next
    epochs span the same lots as in an uninterrupted run."""
    config, inputs = run.recipe.config, run.inputs
    total = run.total_epochs * run.lots_per_epoch
    boundary = (model.lots_applied // run.lots_per_epoch + 1) * run.lots_per_epoch
    segments = []
    if model.lots_applied % run.lots_per_epoch and boundary < total:
        segments.append((boundary, run.initial_epoch + 1))
    segments.append((total, run.total_epochs))
    model.stop_reason = None
    for end, epochs in segments:
        if model.lots_applied >= min(end, total):
            model.stop_reason = model.stop_reason or "completed"
            continue
        stopper = LotStopper(end, should_stop)
        saver = RunCheckpoint(
            checkpoint_dir, every_epoch, stopper, run_state, lambda m: run.result(m), on_epoch
        )
        user_level = (
            dict(user_ids=inputs.user_ids, max_examples_per_user=inputs.max_examples_per_user)
            if inputs.user_level
            else {}
        )
        model.fit(
            inputs.x_train,
            inputs.y_train,
            lot_size=config.lot_size,
            batch_size=config.batch_size,
            epochs=epochs,
            initial_epoch=model.lots_applied // run.lots_per_epoch,
            target_epsilon=config.target_epsilon,
            target_delta=config.delta,
            preprocess=inputs.preprocess,
            callbacks=[run.history, stopper, saver, *callbacks],
            verbose=0,
            sampling_seed=config.seed,
            **user_level,
        )
        if model.stop_reason != "completed" or model.lots_applied < end:
            break  # interrupted, or the budget is spent

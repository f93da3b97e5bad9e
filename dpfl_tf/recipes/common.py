"""Pieces shared by the training recipes: per-epoch history, progress, schedules,
and the checkpoint / resume / interrupt mechanism of a recipe run."""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from typing import Callable, Sequence

import keras
import numpy as np

from dpfl_tf.sanitizer import deployment_note  # noqa: F401  (re-exported for the recipes)

__all__ = [
    "EpochHistory",
    "paper_learning_rate",
    "accuracy",
    "deployment_note",
    "privacy_summary",
    "RUN_STATE",
    "LotStopper",
    "RunCheckpoint",
    "comparable_config",
    "read_run_state",
    "resumable_run_state",
    "mark_run_finished",
]


def paper_learning_rate(initial: float, final: float, decay_epochs: int, lots_per_epoch: int):
    """Abadi et al. 2016: linear decay from `initial` to `final` over
    `decay_epochs` epochs, then constant -- a standard Keras PolynomialDecay."""
    if decay_epochs <= 0 or initial == final:
        return initial
    return keras.optimizers.schedules.PolynomialDecay(
        initial, decay_epochs * lots_per_epoch, final, power=1.0
    )


def accuracy(model: keras.Model, x, y, batch_size: int = 2000, chunk_bytes: int = 2**26) -> float:
    """Top-1 accuracy, predicted chunk by chunk (at most `chunk_bytes` of inputs
    at a time): `predict` on a whole array makes a tensor of all of it (a second
    6 GB copy of CIFAR-10's scattering features), and `x` may be a file read by
    rows (`dpfl_tf.data.NpyRows`) or a memmap."""
    y = np.asarray(y).reshape(-1)
    if not hasattr(x, "__getitem__"):  # a tf.data pipeline: it streams already
        logits = model.predict(x, batch_size=batch_size, verbose=0)
        return float(np.mean(np.argmax(logits, axis=-1) == y))
    example_bytes = int(np.prod(np.shape(x)[1:], dtype=np.int64)) * 4
    chunk = max(1, min(8 * batch_size, chunk_bytes // max(1, example_bytes)))
    correct = 0
    for i in range(0, len(y), chunk):
        logits = model.predict(np.asarray(x[i : i + chunk]), batch_size=batch_size, verbose=0)
        correct += int(np.sum(np.argmax(logits, axis=-1) == y[i : i + chunk]))
    return correct / len(y) if len(y) else float("nan")


#: result fields measured on the private training data without noise
NON_PRIVATE_STATISTICS = ("train_accuracy", "history[].train_accuracy", "dropped_examples")
NON_PRIVATE_STATISTICS_NOTE = (
    "train_accuracy (final, and per epoch in history) is computed on private training "
    "examples without noise, like the loss / accuracy Keras logs while DPModel.fit runs: "
    "a non-private statistic, not covered by epsilon (so is dropped_examples, the count of "
    "examples whose gradient was NaN or inf). Releasing it leaks information about "
    "the training data; release test_accuracy (held-out data) and the model instead."
)


def privacy_summary(ledger, delta: float, seed) -> dict:
    """The privacy fields every recipe's result carries: the ledger entries, the
    composed events, epsilon by each accountant, the deployment note, and which
    fields are non-private statistics of the training data (`NON_PRIVATE_STATISTICS`)."""
    from dpfl_tf.privacy.events import describe_event

    out = {
        "ledger": ledger.entries if ledger is not None else [],
        "events": describe_event(ledger.event) if ledger is not None else "non-private",
        "non_private_statistics": list(NON_PRIVATE_STATISTICS),
        "non_private_statistics_note": NON_PRIVATE_STATISTICS_NOTE,
    }
    if ledger is not None:
        out["epsilon_by_accountant"] = {
            k: ledger.epsilon(delta, k) for k in ("moments", "rdp", "pld")
        }
    note = deployment_note(seed)
    if note:
        out["note"] = note
    return out


class EpochHistory(keras.callbacks.Callback):
    """After every `every` epochs: test / train accuracy and epsilon at several
    deltas, appended to `rows`; a one-line progress bar over `total_epochs`."""

    def __init__(
        self,
        x_test,
        y_test,
        x_train=None,
        y_train=None,
        *,
        every: int = 1,
        deltas: Sequence[float] = (1e-5,),
        total_epochs: int | None = None,
        private: bool = True,
        verbose: bool = True,
    ):
        super().__init__()
        self.x_test, self.y_test = x_test, y_test
        self.x_train, self.y_train = x_train, y_train
        self.every = max(1, int(every))
        self.deltas = list(deltas)
        self.private = private
        self.rows: list[dict] = []
        self.total_epochs = total_epochs
        self.verbose = verbose
        self._bar = None
        self._start = None

    def on_train_begin(self, logs=None):
        self._start = time.perf_counter()
        if self.verbose:
            self._bar = keras.utils.Progbar(
                self.total_epochs, unit_name="epoch", stateful_metrics=["test_acc", "epsilon"]
            )

    def on_epoch_end(self, epoch, logs=None):
        done = epoch + 1
        row = {"epoch": done, "seconds": time.perf_counter() - self._start}
        if self.private:
            row["lots"] = int(self.model.lots_computed)
            for d in self.deltas:
                row[f"epsilon@{d:g}"] = self.model.epsilon(d)
            row["epsilon"] = row[f"epsilon@{self.deltas[-1]:g}"]
        if done % self.every == 0 or getattr(self.model, "stop_training", False):
            row["test_accuracy"] = accuracy(self.model, self.x_test, self.y_test)
            if self.x_train is not None:
                row["train_accuracy"] = accuracy(self.model, self.x_train, self.y_train)
        self.rows.append(row)
        if self._bar is not None:
            values = [("epsilon", row["epsilon"])] if self.private else []
            if "test_accuracy" in row:
                values.append(("test_acc", row["test_accuracy"]))
            target = self.total_epochs
            self._bar.update(min(done, target) if target else done, values=values)

    def on_train_end(self, logs=None):
        if self._bar is not None:
            print(flush=True)

    @staticmethod
    def estimated_epochs(lots: int, lots_per_epoch: int) -> int:
        return max(1, math.ceil(lots / lots_per_epoch))


# ------------------------------------------------------------ checkpoint and resume
#
# A recipe run checkpoints into one directory: `DPCheckpoint`'s files (the whole
# DPModel: weights, lot counter, optimizer state and so the learning-rate
# schedule, privacy ledger) and, beside them, RUN_STATE: what the recipe needs
# to go on (its settings, the noise it calibrated, the planned length, the
# history so far).  `resumable_run_state` reads and checks both before any data
# is loaded; `RunCheckpoint` writes both after every epoch (or when interrupted);
# `LotStopper` ends a resumed run after the same number of lots as an
# uninterrupted one and stops after the current lot when asked to.

RUN_STATE = "run.json"


class LotStopper(keras.callbacks.Callback):
    """Stops after exactly `total_lots` lots in all (so a resumed run ends where
    an uninterrupted one would: an in-graph lot limit, exact also inside a call
    of several lots), or after the current call of the training function
    (`steps_per_execution` lots) when `should_stop()`."""

    def __init__(self, total_lots: int, should_stop: Callable[[], bool] | None = None):
        super().__init__()
        self.total_lots = total_lots
        self.should_stop = should_stop
        self.interrupted = False

    def on_train_begin(self, logs=None):
        left = max(0, self.total_lots - self.model.lots_applied)
        self.model.set_lot_limit(self.model.lots_computed + left, reason="planned end")

    def on_train_end(self, logs=None):
        self.model.set_lot_limit(None, reason="planned end")

    def on_train_batch_end(self, batch, logs=None):
        if self.model.lots_applied >= self.total_lots:
            self.model.stop_training = True
        if self.should_stop is not None and self.should_stop():
            self.interrupted = True
            self.model.stop_reason = "interrupted"
            self.model.stop_training = True


class RunCheckpoint(keras.callbacks.Callback):
    """After every epoch (or only when interrupted): the `DPCheckpoint` of the
    model, then the recipe's state ``state()`` as RUN_STATE, then
    ``on_epoch(snapshot(model))`` (the results so far)."""

    def __init__(
        self,
        directory,
        every_epoch: bool,
        stopper: LotStopper,
        state: Callable[[], dict],
        snapshot: Callable,
        on_epoch=None,
    ):
        super().__init__()
        self.directory, self.every_epoch, self.stopper = directory, every_epoch, stopper
        self.state, self.snapshot, self.on_epoch = state, snapshot, on_epoch
        self.saved = None

    def on_epoch_end(self, epoch, logs=None):
        if self.directory is not None and (self.every_epoch or self.stopper.interrupted):
            from dpfl_tf._io import atomic_write_json
            from dpfl_tf.keras.checkpoint import DPCheckpoint

            ckpt = DPCheckpoint(self.directory)
            ckpt.set_model(self.model)
            with warnings.catch_warnings():  # the wrapper is saved whole; its model is built
                warnings.filterwarnings("ignore", "You are saving a model that has not")
                ckpt.save(epoch + 1)
            state = self.state()
            atomic_write_json(os.path.join(self.directory, RUN_STATE), state)
            self.saved = state
        if self.on_epoch is not None:
            self.on_epoch(self.snapshot(self.model))


def comparable_config(config: dict, changeable: Sequence[str]) -> dict:
    """`config` as JSON data without the fields a resumed run may change
    (`changeable`; a dotted name reaches into a nested dict: "pretrain.data_dir")."""
    d = json.loads(json.dumps(config, default=_json_value))
    for name in changeable:
        *outer, last = name.split(".")
        inner = d
        for key in outer:
            inner = inner.get(key) if isinstance(inner, dict) else None
        if isinstance(inner, dict):
            inner.pop(last, None)
    return d


def _json_value(obj):
    if hasattr(obj, "value"):  # enums
        return obj.value
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    raise TypeError(f"cannot serialise {type(obj).__name__} to JSON")


def read_run_state(directory: str) -> dict | None:
    """The recipe state of a checkpoint directory (None if it holds none); a
    damaged file is named in the error."""
    from dpfl_tf._io import read_checkpoint_json

    return read_checkpoint_json(os.path.join(directory, RUN_STATE))


def resumable_run_state(
    checkpoint_dir: str | None, config: dict, defaults: dict | None = None
) -> dict | None:
    """The state to resume from `checkpoint_dir`, or None when it holds no
    checkpoint (a new run).  Refuses, naming the directory, a checkpoint without
    a recipe state, one of other settings (`config`, from `comparable_config`)
    and one of a finished run.  A setting the checkpoint does not record (it
    was written before the setting existed) counts as its value in `defaults`."""
    from dpfl_tf.keras.checkpoint import DPCheckpoint

    if checkpoint_dir is None or DPCheckpoint.latest(checkpoint_dir) is None:
        return None
    state = read_run_state(checkpoint_dir)
    if state is None:
        raise ValueError(
            f"{checkpoint_dir} holds a DPCheckpoint but no {RUN_STATE}: it "
            "was not written by this recipe; use another checkpoint directory"
        )
    missing = object()
    saved = {**(defaults or {}), **state["config"]}
    diff = sorted(k for k, v in config.items() if saved.get(k, missing) != v)
    if diff:
        raise ValueError(
            f"{checkpoint_dir} holds a checkpoint of a different run "
            f"(differs in: {', '.join(diff)}); use another checkpoint "
            "directory"
        )
    if state.get("finished"):
        raise ValueError(
            f"{checkpoint_dir} holds a finished run ({state['finished']}); "
            "nothing to resume: use another checkpoint directory"
        )
    return state


def mark_run_finished(
    checkpoint_dir: str | None, state: Callable[[], dict], stop_reason: str
) -> None:
    """Records in RUN_STATE (``state()``) that the run ended (`stop_reason`), so that the same
    command does not resume it again.  Nothing if no checkpoint was written
    there, or the run was interrupted (it is to be resumed)."""
    from dpfl_tf._io import atomic_write_json

    if (
        checkpoint_dir is None
        or stop_reason == "interrupted"
        or not os.path.exists(os.path.join(checkpoint_dir, RUN_STATE))
    ):
        return
    atomic_write_json(os.path.join(checkpoint_dir, RUN_STATE), {**state(), "finished": stop_reason})

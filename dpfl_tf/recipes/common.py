"""Pieces shared by the training recipes: per-epoch history, progress, schedules."""

from __future__ import annotations

import math
import time
from typing import Sequence

import keras
import numpy as np

from dpfl_tf.sanitizer import deployment_note  # noqa: F401  (re-exported for the recipes)

__all__ = ["EpochHistory", "paper_learning_rate", "accuracy", "deployment_note",
           "privacy_summary"]


def paper_learning_rate(initial: float, final: float, decay_epochs: int,
                        lots_per_epoch: int):
    """Abadi et al. 2016: linear decay from `initial` to `final` over
    `decay_epochs` epochs, then constant -- a standard Keras PolynomialDecay."""
    if decay_epochs <= 0 or initial == final:
        return initial
    return keras.optimizers.schedules.PolynomialDecay(
        initial, decay_epochs * lots_per_epoch, final, power=1.0)


def accuracy(model: keras.Model, x, y, batch_size: int = 2000) -> float:
    logits = model.predict(x, batch_size=batch_size, verbose=0)
    return float(np.mean(np.argmax(logits, axis=-1) == np.asarray(y).reshape(-1)))


#: result fields measured on the private training data without noise
NON_PRIVATE_STATISTICS = ("train_accuracy", "history[].train_accuracy", "dropped_examples")
NON_PRIVATE_STATISTICS_NOTE = (
    "train_accuracy (final, and per epoch in history) is computed on private training "
    "examples without noise, like the loss / accuracy Keras logs while DPModel.fit runs: "
    "a non-private statistic, not covered by epsilon (so is dropped_examples, the count of "
    "examples whose gradient was NaN or inf). Releasing it leaks information about "
    "the training data; release test_accuracy (held-out data) and the model instead.")


def privacy_summary(ledger, delta: float, seed) -> dict:
    """The privacy fields every recipe's result carries: the ledger entries, the
    composed events, epsilon by each accountant, the deployment note, and which
    fields are non-private statistics of the training data (`NON_PRIVATE_STATISTICS`)."""
    from dpfl_tf.privacy.events import describe_event

    out = {"ledger": ledger.entries if ledger is not None else [],
           "events": describe_event(ledger.event) if ledger is not None else "non-private",
           "non_private_statistics": list(NON_PRIVATE_STATISTICS),
           "non_private_statistics_note": NON_PRIVATE_STATISTICS_NOTE}
    if ledger is not None:
        out["epsilon_by_accountant"] = {k: ledger.epsilon(delta, k)
                                        for k in ("moments", "rdp", "pld")}
    note = deployment_note(seed)
    if note:
        out["note"] = note
    return out


class EpochHistory(keras.callbacks.Callback):
    """After every `every` epochs: test / train accuracy and epsilon at several
    deltas, appended to `rows`; a one-line progress bar over `total_epochs`."""

    def __init__(self, x_test, y_test, x_train=None, y_train=None, *, every: int = 1,
                 deltas: Sequence[float] = (1e-5,), total_epochs: int | None = None,
                 private: bool = True, verbose: bool = True):
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
            self._bar = keras.utils.Progbar(self.total_epochs, unit_name="epoch",
                                            stateful_metrics=["test_acc", "epsilon"])

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

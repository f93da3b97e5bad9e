"""Keras callbacks for DP training: epsilon in the logs, and the budget stop."""

from __future__ import annotations

import operator

import keras
import numpy as np

from dpfl_tf.privacy.accountants import AccountantKind
from dpfl_tf.privacy.ledger import BudgetExceededError, PrivacyBudget

__all__ = ["PrivacyCallback"]

_FAST = (AccountantKind.MOMENTS, AccountantKind.RDP)


class PrivacyCallback(keras.callbacks.Callback):
    """Logs epsilon spent into the Keras logs (so History and TensorBoard get
    it) and, with a target, stops training *before* the lot that would exceed
    (target_epsilon, delta).

    The stop is exact: at the start of training the callback computes how many
    more lots the budget allows with the current settings and sets the model's
    in-graph lot limit on the monotonic count of lots computed; a lot beyond the
    limit is skipped inside the computation (so also under XLA and with
    ``steps_per_execution > 1``), training stops after the last allowed lot,
    the model's ``stop_reason`` becomes "budget_spent", and (verbose) one line
    says so.

    Args:
      target_epsilon: optional budget; None only logs.
      delta: the delta for the logged epsilon and the budget.
      accountant: defaults to the model's ledger accountant.
      log_every_batch: also log epsilon per batch (moments / rdp only); the
        default None does so when a progress bar shows it (verbose=1), as an
        accountant call per lot costs about a millisecond.
    """

    def __init__(
        self,
        target_epsilon: float | None = None,
        delta: float = 1e-5,
        accountant: str | None = None,
        log_every_batch: bool | None = None,
    ):
        super().__init__()
        self.accountant = AccountantKind.parse(accountant) if accountant else None
        self.budget = None
        self.target_epsilon = target_epsilon
        self.delta = delta
        self.log_every_batch = log_every_batch
        self.allowed_lots = None

    def _kind(self):
        return self.accountant or self.model.ledger.accountant

    def on_train_begin(self, logs=None):
        event = getattr(self.model, "lot_event", None)
        if event is not None:
            # before any lot: a ledger of another neighbouring relation refuses this
            # fit's event (e.g. add/remove DP-PCA, then shuffled lots, replace-one)
            self.model.ledger.admit(event)
        kind = self._kind()
        if self.target_epsilon is None:
            PrivacyBudget(1.0, self.delta)  # validates delta
            self.model.set_lot_limit(None)
            return
        self.budget = PrivacyBudget(self.target_epsilon, self.delta, kind)
        remaining = self.model.steps_within_budget(self.budget, self._lots_wanted())
        if remaining <= 0:  # what one lot costs per accountant, and what to change
            raise BudgetExceededError(self.model._no_lot_message(self.budget))
        self.allowed_lots = self.model.lots_computed + remaining
        self.model.set_lot_limit(self.allowed_lots)

    def on_epoch_begin(self, epoch, logs=None):
        # weights restored by another callback's on_train_begin (BackupAndRestore
        # in a new process) may carry lots this model never computed: record them
        # and recompute the limit before the next lot
        if self.model.lots_applied > self.model.lots_computed:
            self.model._adopt_restored_lots()
            if self.budget is not None:
                remaining = self.model.steps_within_budget(self.budget, self._lots_wanted())
                self.allowed_lots = self.model.lots_computed + max(remaining, 0)
                self.model.set_lot_limit(self.allowed_lots)
                if remaining <= 0:
                    self.model.stop_training = True

    def _lots_wanted(self) -> int | None:
        """More lots than this fit can run (epochs x lots per epoch, + 1 so that a
        budget allowing more never reads as spent at the fit's last lot): the budget
        is asked for no more (None: not known, the whole budget is searched)."""
        params = self.params or {}
        try:
            return operator.index(params["epochs"]) * operator.index(params["steps"]) + 1
        except (KeyError, TypeError):
            return None

    def _epsilon(self) -> float:
        return self.model.epsilon(self.delta, self._kind())

    def _budget_spent(self) -> bool:
        return self.allowed_lots is not None and self.model.lots_computed >= self.allowed_lots

    def on_train_batch_end(self, batch, logs=None):
        if self._budget_spent():
            self.model.stop_training = True
            self.model.stop_reason = "budget_spent"
        every = self.log_every_batch
        if every is None:
            every = (self.params or {}).get("verbose") == 1
        if logs is not None and every and self._kind() in _FAST:
            logs["epsilon"] = self._epsilon()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["epsilon"] = self._epsilon()
            logs["delta"] = self.delta
            logs["lots"] = self.model.lots_computed
            if getattr(self.model, "_log_metrics", True):
                # an un-noised count over private lots: a non-private statistic,
                # logged only with the other training statistics
                logs["dropped_examples"] = self.model.dropped_examples

    def on_train_end(self, logs=None):
        self.model.set_lot_limit(None)
        if self._budget_spent():
            self.model.stop_reason = "budget_spent"
            if (self.params or {}).get("verbose", 1):
                print(
                    f"privacy budget spent: epsilon = {self._epsilon():.4g} of "
                    f"{self.budget.epsilon:g} at delta = {self.delta:g} "
                    f"({self._kind().value}) after {self.model.lots_computed} lots; "
                    "training stopped"
                )


class _Count(float):
    """A count in Keras's progress bar, which formats every value as a float
    (``lots: 700.0000``): shown as the integer it is."""

    def __truediv__(self, other):  # the bar shows value / 1
        return _Count(float(self) / other)

    def __format__(self, spec):
        return str(int(self))


def _counts_shown_as_integers(logs):
    if not logs:
        return logs
    return {
        k: _Count(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else v
        for k, v in logs.items()
    }


class CountsProgbarLogger(keras.callbacks.ProgbarLogger):
    """Keras's progress bar, with integer logs (``lots``, ``dropped_examples``)
    shown as integers; the logs themselves (and `History`) keep their values."""

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, _counts_shown_as_integers(logs))

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, _counts_shown_as_integers(logs))

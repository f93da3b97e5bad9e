"""The privacy ledger: what has been spent, as events, and the budget filter.

Every mechanism that touches private data records its `DpEvent` here as it
runs (a DP-SGD lot, a DP-PCA release, a federated round).  The ledger answers
"epsilon spent so far" with any accountant, serialises to JSON and restores
exactly, and -- given a `PrivacyBudget` -- refuses a step that would exceed it
(a privacy filter: the check happens before the mechanism runs).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import dp_accounting

from dpfl_tf._io import atomic_write_text
from dpfl_tf._validation import check_count, check_number
from dpfl_tf.privacy.accountants import AccountantKind, compute_delta, compute_epsilon
from dpfl_tf.privacy.calibration import max_steps
from dpfl_tf.privacy.events import (describe_event, event_from_dict, event_to_dict,
                                    event_to_json)

__all__ = ["PrivacyBudget", "PrivacyLedger", "BudgetExceededError"]

LEDGER_FORMAT_VERSION = 1


class BudgetExceededError(RuntimeError):
    """Raised when a step would take the ledger past its budget."""


@dataclasses.dataclass(frozen=True)
class PrivacyBudget:
    """A target (epsilon, delta) and the accountant that judges it."""

    epsilon: float
    delta: float
    accountant: AccountantKind = AccountantKind.MOMENTS

    def __post_init__(self):
        object.__setattr__(self, "epsilon", check_number("epsilon", self.epsilon, low=0.0,
                                                         low_open=True))
        object.__setattr__(self, "delta", check_number("delta", self.delta, low=0.0, high=1.0,
                                                       low_open=True, high_open=True))
        object.__setattr__(self, "accountant", AccountantKind.parse(self.accountant))

    def to_dict(self) -> dict:
        return {"epsilon": self.epsilon, "delta": self.delta, "accountant": self.accountant.value}


@dataclasses.dataclass
class _Entry:
    event: dp_accounting.DpEvent
    count: int
    label: str


class PrivacyLedger:
    """Records privacy events and reports what they cost.

    Args:
      accountant: default accountant for `epsilon` / `delta` queries.
      budget: optional `PrivacyBudget`; `spend` refuses events that exceed it.
    """

    def __init__(self, accountant: AccountantKind | str = AccountantKind.MOMENTS,
                 budget: PrivacyBudget | None = None):
        self.accountant = AccountantKind.parse(accountant)
        if budget is not None and not isinstance(budget, PrivacyBudget):
            raise TypeError(f"budget must be a PrivacyBudget, got {type(budget).__name__}")
        self.budget = budget
        self._entries: list[_Entry] = []
        self._cache: dict[tuple, float] = {}
        self._steps_cache: dict[tuple, int] = {}

    # -- recording --------------------------------------------------------
    def record(self, event: dp_accounting.DpEvent, count: int = 1, label: str = "") -> None:
        """Adds `count` applications of `event` (no budget check)."""
        if not isinstance(event, dp_accounting.DpEvent):
            raise TypeError(f"event must be a dp_accounting.DpEvent, got {type(event).__name__}")
        count = check_count("count", count)
        if count == 0:
            return
        last = self._entries[-1] if self._entries else None
        if last is not None and last.event == event and last.label == label:
            last.count += count
        else:
            self._entries.append(_Entry(event, count, label))
        self._cache.clear()
        self._steps_cache.clear()

    def would_exceed(self, event: dp_accounting.DpEvent, count: int = 1) -> bool:
        """True if recording `count` x `event` would take the ledger past its budget."""
        if self.budget is None:
            return False
        return self.steps_within_budget(event) < count

    def spend(self, event: dp_accounting.DpEvent, count: int = 1, label: str = "") -> None:
        """Records the event, or raises BudgetExceededError (recording nothing)."""
        if self.would_exceed(event, count):
            b = self.budget
            raise BudgetExceededError(
                f"{count} x {describe_event(event)} would exceed the budget "
                f"(epsilon={b.epsilon:g}, delta={b.delta:g}, {b.accountant.value}); "
                f"spent so far: epsilon={self.epsilon(b.delta, b.accountant):.4g}")
        self.record(event, count, label)

    def steps_within_budget(self, event: dp_accounting.DpEvent) -> int:
        """How many more applications of `event` the budget allows (cached)."""
        if self.budget is None:
            raise ValueError("this ledger has no budget; pass budget=PrivacyBudget(...)")
        b = self.budget
        key = (event_to_json(event), b)   # events holding lists are not hashable
        if key not in self._steps_cache:
            self._steps_cache[key] = max_steps(b.epsilon, b.delta, event, b.accountant,
                                               already_spent=self.event if self._entries else None)
        return self._steps_cache[key]

    # -- queries ----------------------------------------------------------
    @property
    def event(self) -> dp_accounting.DpEvent:
        """Everything recorded, as one composed event."""
        return dp_accounting.ComposedDpEvent(
            [dp_accounting.SelfComposedDpEvent(e.event, e.count) for e in self._entries])

    @property
    def entries(self) -> list[dict]:
        return [{"event": describe_event(e.event), "count": e.count, "label": e.label}
                for e in self._entries]

    def count(self, label: str | None = None) -> int:
        """Number of recorded applications (of events with `label`, if given)."""
        return sum(e.count for e in self._entries if label is None or e.label == label)

    def epsilon(self, delta: float, accountant: AccountantKind | str | None = None) -> float:
        kind = AccountantKind.parse(accountant or self.accountant)
        key = ("eps", kind, float(delta))
        if key not in self._cache:
            self._cache[key] = (compute_epsilon(self.event, delta, kind)
                                if self._entries else 0.0)
        return self._cache[key]

    def delta(self, epsilon: float, accountant: AccountantKind | str | None = None) -> float:
        kind = AccountantKind.parse(accountant or self.accountant)
        key = ("delta", kind, float(epsilon))
        if key not in self._cache:
            self._cache[key] = (compute_delta(self.event, epsilon, kind)
                                if self._entries else 0.0)
        return self._cache[key]

    def spent(self) -> dict:
        """Summary at the budget's delta (or 1e-5): epsilon, delta, accountant, steps."""
        delta = self.budget.delta if self.budget else 1e-5
        return {"epsilon": self.epsilon(delta), "delta": delta,
                "accountant": self.accountant.value, "applications": self.count()}

    def __len__(self) -> int:
        return self.count()

    def __repr__(self) -> str:
        return (f"PrivacyLedger(accountant={self.accountant.value!r}, "
                f"entries={len(self._entries)}, applications={self.count()})")

    # -- serialisation ----------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": LEDGER_FORMAT_VERSION,
            "accountant": self.accountant.value,
            "budget": self.budget.to_dict() if self.budget else None,
            "entries": [{"event": event_to_dict(e.event), "count": e.count, "label": e.label}
                        for e in self._entries],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PrivacyLedger":
        if not isinstance(data, dict) or data.get("format") != LEDGER_FORMAT_VERSION:
            raise ValueError(f"not a dpfl_tf privacy ledger (format {LEDGER_FORMAT_VERSION})")
        budget = PrivacyBudget(**data["budget"]) if data.get("budget") else None
        ledger = cls(accountant=data["accountant"], budget=budget)
        for item in data["entries"]:
            ledger._entries.append(_Entry(event_from_dict(item["event"]),
                                          check_count("count", item["count"]),
                                          str(item.get("label", ""))))
        return ledger

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "PrivacyLedger":
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike) -> None:
        """Writes the ledger atomically (a crash never leaves half a file)."""
        atomic_write_text(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "PrivacyLedger":
        with open(path) as f:
            return cls.from_json(f.read())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PrivacyLedger) and self.to_dict() == other.to_dict()

    def copy(self) -> "PrivacyLedger":
        return PrivacyLedger.from_dict(self.to_dict())


"""The privacy ledger: what has been spent, as events, and the budget filter.

Every mechanism that touches private data records its `DpEvent` here as it
runs (a DP-SGD lot, a DP-PCA release, a federated round).  The ledger answers
"epsilon spent so far" with any accountant, serialises to JSON and restores
exactly, and -- given a `PrivacyBudget` -- refuses a step that would exceed it
(a privacy filter: the check happens before the mechanism runs).

One ledger, one neighbouring relation.  Its epsilon is a guarantee for one
relation, so the ledger refuses an event whose relation differs from the
events it holds (add/remove-one Poisson lots or DP-PCA vs. replace-one
shuffle epochs or fixed-size lots; see `dpfl_tf.privacy.events`), naming both.
``PrivacyLedger(relation="replace_one")`` accounts everything under
replace-one: add/remove Gaussian events are converted as they are recorded
(``GaussianDpEvent(sigma)`` -> ``ReplaceOneGaussianDpEvent(sigma/2)``,
sensitivity 2C), and events with no replace-one form are refused.
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
from dpfl_tf.privacy.events import (
    NeighboringRelation,
    describe_event,
    event_from_dict,
    event_to_dict,
    event_to_json,
    mixed_relations_message,
    parse_relation,
    relation_name,
    relations_of,
    to_replace_one,
)

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
        object.__setattr__(
            self, "epsilon", check_number("epsilon", self.epsilon, low=0.0, low_open=True)
        )
        object.__setattr__(
            self,
            "delta",
            check_number("delta", self.delta, low=0.0, high=1.0, low_open=True, high_open=True),
        )
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
      relation: the neighbouring relation everything is accounted under.  None
        (default): the relation of the first event recorded; events of the other
        relation are refused.  "replace_one": add/remove Gaussian events are
        converted to replace-one as recorded (`events.to_replace_one`: sigma ->
        sigma / 2, sensitivity 2C); others without a replace-one form are refused.
        "add_or_remove_one": replace-one events are refused.
    """

    def __init__(
        self,
        accountant: AccountantKind | str = AccountantKind.MOMENTS,
        budget: PrivacyBudget | None = None,
        *,
        relation: NeighboringRelation | str | None = None,
    ):
        self.accountant = AccountantKind.parse(accountant)
        if budget is not None and not isinstance(budget, PrivacyBudget):
            raise TypeError(f"budget must be a PrivacyBudget, got {type(budget).__name__}")
        self.budget = budget
        self._relation = None if relation is None else parse_relation(relation)
        self._entries: list[_Entry] = []
        self._cache: dict[tuple, float] = {}
        self._steps_cache: dict[tuple, int] = {}

    # -- relation -----------------------------------------------------------
    @property
    def relation(self) -> NeighboringRelation | None:
        """The neighbouring relation of this ledger: the one it was given, else
        that of the events recorded (None while none has one)."""
        if self._relation is not None:
            return self._relation
        found = frozenset().union(*(relations_of(e.event) for e in self._entries))
        return next(iter(found)) if len(found) == 1 else None

    def admit(self, event: dp_accounting.DpEvent) -> dp_accounting.DpEvent:
        """`event` as `record` would store it (converted to replace-one if this
        ledger accounts under replace-one); ValueError if the ledger refuses it
        because its neighbouring relation differs from the ledger's."""
        if not isinstance(event, dp_accounting.DpEvent):
            raise TypeError(f"event must be a dp_accounting.DpEvent, got {type(event).__name__}")
        own = relations_of(event)
        if len(own) > 1:
            raise ValueError(mixed_relations_message(describe_event(event)))
        if self._relation is NeighboringRelation.REPLACE_ONE:
            return to_replace_one(event)
        held = frozenset().union(*(relations_of(e.event) for e in self._entries))
        if self._relation is not None:
            held = held | {self._relation}
        if not own or own == held or not held:
            return event
        if len(held) > 1:  # an old file that already mixes relations
            raise ValueError(mixed_relations_message("this ledger"))
        (mine,), (theirs,) = held, own
        labels = sorted({e.label or "unlabelled" for e in self._entries if relations_of(e.event)})
        raise ValueError(
            f"cannot record {describe_event(event)} in a ledger of {relation_name(mine)} "
            f"events ({', '.join(labels) or 'declared'}): {relation_name(theirs)} and "
            f"{relation_name(mine)} are different neighbouring relations, and an epsilon "
            "composed from both bounds neither.  Account everything under replace-one: "
            "PrivacyLedger(..., relation='replace_one') (or ledger.as_replace_one()) converts "
            "add/remove Gaussian(sigma) events, e.g. DP-PCA on every example, to "
            "replace-one Gaussian(sigma/2) (sensitivity 2C); Poisson-sampled events with "
            "q < 1 have no such form: keep them in a separate ledger, or use one sampling "
            "scheme throughout"
        )

    def as_replace_one(self) -> "PrivacyLedger":
        """A copy accounting everything under replace-one (entries converted with
        `events.to_replace_one`; ValueError if one has no replace-one form)."""
        out = PrivacyLedger(self.accountant, self.budget, relation=NeighboringRelation.REPLACE_ONE)
        for e in self._entries:
            out.record(e.event, e.count, e.label)
        return out

    # -- recording --------------------------------------------------------
    def record(self, event: dp_accounting.DpEvent, count: int = 1, label: str = "") -> None:
        """Adds `count` applications of `event` (no budget check).

        Raises ValueError, recording nothing, if the event's neighbouring
        relation is not the ledger's (see `admit`)."""
        event = self.admit(event)
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
        event = self.admit(event)
        if self.budget is None:
            return False
        return self.steps_within_budget(event) < count

    def spend(self, event: dp_accounting.DpEvent, count: int = 1, label: str = "") -> None:
        """Records the event, or raises BudgetExceededError (recording nothing)."""
        event = self.admit(event)
        if self.would_exceed(event, count):
            b = self.budget
            raise BudgetExceededError(
                f"{count} x {describe_event(event)} would exceed the budget "
                f"(epsilon={b.epsilon:g}, delta={b.delta:g}, {b.accountant.value}); "
                f"spent so far: epsilon={self.epsilon(b.delta, b.accountant):.4g}"
            )
        self.record(event, count, label)

    def steps_within_budget(self, event: dp_accounting.DpEvent, limit: int | None = None) -> int:
        """How many more applications of `event` the budget allows (cached); with
        `limit`, at most that many (`max_steps`: a limit that fits costs one
        evaluation instead of a search to the end of a large budget)."""
        if self.budget is None:
            raise ValueError("this ledger has no budget; pass budget=PrivacyBudget(...)")
        event = self.admit(event)
        b = self.budget
        key = (event_to_json(event), b, limit)  # events holding lists are not hashable
        if key not in self._steps_cache:
            self._steps_cache[key] = max_steps(
                b.epsilon,
                b.delta,
                event,
                b.accountant,
                already_spent=self.event if self._entries else None,
                limit=limit,
            )
        return self._steps_cache[key]

    # -- queries ----------------------------------------------------------
    @property
    def event(self) -> dp_accounting.DpEvent:
        """Everything recorded, as one composed event."""
        return dp_accounting.ComposedDpEvent(
            [dp_accounting.SelfComposedDpEvent(e.event, e.count) for e in self._entries]
        )

    @property
    def entries(self) -> list[dict]:
        return [
            {"event": describe_event(e.event), "count": e.count, "label": e.label}
            for e in self._entries
        ]

    def count(self, label: str | None = None) -> int:
        """Number of recorded applications (of events with `label`, if given)."""
        return sum(e.count for e in self._entries if label is None or e.label == label)

    def epsilon(self, delta: float, accountant: AccountantKind | str | None = None) -> float:
        kind = AccountantKind.parse(accountant or self.accountant)
        key = ("eps", kind, float(delta))
        if key not in self._cache:
            self._cache[key] = compute_epsilon(self.event, delta, kind) if self._entries else 0.0
        return self._cache[key]

    def delta(self, epsilon: float, accountant: AccountantKind | str | None = None) -> float:
        kind = AccountantKind.parse(accountant or self.accountant)
        key = ("delta", kind, float(epsilon))
        if key not in self._cache:
            self._cache[key] = compute_delta(self.event, epsilon, kind) if self._entries else 0.0
        return self._cache[key]

    def spent(self) -> dict:
        """Summary at the budget's delta (or 1e-5): epsilon, delta, accountant, steps."""
        delta = self.budget.delta if self.budget else 1e-5
        return {
            "epsilon": self.epsilon(delta),
            "delta": delta,
            "accountant": self.accountant.value,
            "applications": self.count(),
        }

    def __len__(self) -> int:
        return self.count()

    def __repr__(self) -> str:
        relation = self.relation
        return (
            f"PrivacyLedger(accountant={self.accountant.value!r}, "
            f"relation={relation_name(relation) if relation else None!r}, "
            f"entries={len(self._entries)}, applications={self.count()})"
        )

    # -- serialisation ----------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": LEDGER_FORMAT_VERSION,
            "accountant": self.accountant.value,
            "budget": self.budget.to_dict() if self.budget else None,
            # the relation given to the constructor (None: taken from the events)
            "relation": self._relation.name.lower() if self._relation else None,
            "entries": [
                {"event": event_to_dict(e.event), "count": e.count, "label": e.label}
                for e in self._entries
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PrivacyLedger":
        if not isinstance(data, dict) or data.get("format") != LEDGER_FORMAT_VERSION:
            raise ValueError(f"not a dpfl_tf privacy ledger (format {LEDGER_FORMAT_VERSION})")
        budget = PrivacyBudget(**data["budget"]) if data.get("budget") else None
        # ledgers written before the field existed: relation inferred from the events
        ledger = cls(accountant=data["accountant"], budget=budget, relation=data.get("relation"))
        # entries are restored as written (no refusal): a file that mixes relations
        # loads, and its epsilon queries raise
        for item in data["entries"]:
            ledger._entries.append(
                _Entry(
                    event_from_dict(item["event"]),
                    check_count("count", item["count"]),
                    str(item.get("label", "")),
                )
            )
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

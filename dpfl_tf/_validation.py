"""Argument checks shared by the whole package.

Errors name the argument, the value received and what is allowed; they are
real exceptions, never `assert` (asserts vanish under ``python -O``).
"""

from __future__ import annotations

import argparse
import enum
import math
from typing import Any


def check_number(
    name: str,
    value: Any,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    allow_inf: bool = False,
) -> float:
    """float(value) if it lies in the interval, else ValueError naming `name`."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    lo_ok = x > low if low_open else x >= low
    hi_ok = x < high if high_open else x <= high
    if math.isnan(x) or (math.isinf(x) and not allow_inf) or not (lo_ok and hi_ok):
        raise ValueError(
            f"{name} must be {_describe(low, high, low_open, high_open)}, got {value!r}"
        )
    return x


def check_count(name: str, value: Any, *, minimum: int = 0) -> int:
    """int(value) if it is a whole number >= minimum, else ValueError naming `name`."""
    ok = not isinstance(value, bool)
    if ok:
        try:
            x = float(value)
            ok = math.isfinite(x) and x.is_integer() and x >= minimum
        except (TypeError, ValueError):
            ok = False
    if not ok:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(float(value))


def _describe(low: float, high: float, low_open: bool, high_open: bool) -> str:
    """'>= 0', '> 0' or 'in (0, 1]' -- the allowed range in words."""
    if math.isinf(high):
        return f"{'>' if low_open else '>='} {low:g}"
    if math.isinf(low):
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


class ChoiceEnum(str, enum.Enum):
    """A string enum whose `parse` accepts a member or its value (case and
    '-' / '_' insensitive, plus any `__aliases__`), and otherwise raises a
    ValueError naming `__argument__` and listing the allowed values."""

    @classmethod
    def parse(cls, value):
        if isinstance(value, cls):
            return value
        key = str(value).lower().replace("-", "_")
        key = getattr(cls, "__aliases__", {}).get(key, key)
        try:
            return cls(key)
        except ValueError:
            allowed = ", ".join(m.value for m in cls)
            raise ValueError(
                f"{cls._argument_name()} must be one of {allowed}, got {value!r}"
            ) from None

    @classmethod
    def _argument_name(cls) -> str:
        return getattr(cls, "__argument__", cls.__name__)


def float_arg(text: str) -> float:
    """argparse type: a float, or an argparse error naming the text."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None

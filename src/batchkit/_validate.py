"""The one place argument checks live: whole numbers >= 1 and finite non-negative numbers.

Each check raises ``ValueError`` naming the argument, what it must be, and the value it got;
``note`` adds the hint that belongs to one argument (``"(or pass rate)"``). ``bool`` is refused
where a number is asked for, though Python counts it as an ``int``."""

from __future__ import annotations

import math

__all__ = ["non_negative_float", "positive_float", "positive_int", "positive_int_or_none"]


def _suffix(note: str) -> str:
    return f" {note}" if note else ""


def positive_int(name: str, value: object, *, note: str = "") -> int:
    """Return ``value`` if it is an ``int >= 1``; raise
    ``ValueError("<name> must be an int >= 1[ note], got <value!r>")`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1{_suffix(note)}, got {value!r}")
    return value


def positive_int_or_none(name: str, value: object, *, note: str = "") -> int | None:
    """``positive_int`` that also takes ``None``; its message says ``"an int >= 1 or None"``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1 or None{_suffix(note)}, got {value!r}")
    return value


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def non_negative_float(name: str, value: object, *, note: str = "") -> float:
    """Return ``value`` as a float if it is a finite number >= 0; raise
    ``ValueError("<name> must be a finite number >= 0[ note], got <value!r>")`` otherwise."""
    number = _finite(value)
    if number is None or number < 0:
        raise ValueError(f"{name} must be a finite number >= 0{_suffix(note)}, got {value!r}")
    return number


def positive_float(name: str, value: object, *, note: str = "") -> float:
    """Return ``value`` as a float if it is a finite number > 0; raise
    ``ValueError("<name> must be a finite number > 0[ note], got <value!r>")`` otherwise."""
    number = _finite(value)
    if number is None or number <= 0:
        raise ValueError(f"{name} must be a finite number > 0{_suffix(note)}, got {value!r}")
    return number

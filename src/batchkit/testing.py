"""Test doubles for users' own tests (and batchkit's): a clock that only moves when told."""

from __future__ import annotations

import math
import numbers
import threading

__all__ = ["MockClock", "echo_batch"]


class MockClock:
    """A :class:`~batchkit.Clock` that stands still until :meth:`advance` moves it.

    >>> clock = MockClock()
    >>> clock.advance(0.25)
    >>> clock.now()
    0.25

    Thread-safe. Runtimes that sleep until a deadline (the batcher's dispatcher) are woken by
    ``advance`` through listeners they register (it is a :class:`~batchkit._clock.ListenableClock`),
    so a test drives time exactly.
    """

    def __init__(self, start: float = 0.0) -> None:
        start = float(start)
        if not math.isfinite(start):
            raise ValueError(f"start must be a finite number of seconds, got {start!r}")
        self._now = start
        self._lock = threading.Lock()
        self._listeners: list[threading.Condition] = []

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds`` (a finite number >= 0) and wake whoever waits on it."""
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
            raise ValueError(f"seconds must be a number, got {seconds!r}")
        if not seconds >= 0:  # also NaN
            raise ValueError(f"seconds must be >= 0, got {seconds!r}: time does not run backwards")
        if not math.isfinite(seconds):
            raise ValueError(f"seconds must be finite, got {seconds!r}: advance to the next deadline instead")
        with self._lock:
            self._now += seconds
            listeners = list(self._listeners)
        for cond in listeners:
            with cond:
                cond.notify_all()

    def add_listener(self, cond: threading.Condition) -> None:
        """Notify ``cond`` (``notify_all`` under it) whenever time advances."""
        with self._lock:
            self._listeners.append(cond)

    def remove_listener(self, cond: threading.Condition) -> None:
        """Stop notifying ``cond``."""
        with self._lock:
            if cond in self._listeners:
                self._listeners.remove(cond)

    def __repr__(self) -> str:
        return f"<MockClock now={self._now:.6f}>"


def echo_batch(items: list[object]) -> list[object]:
    """A batch function that returns its inputs: the smallest thing to serve or bench
    (``batchkit bench batchkit.testing:echo_batch``)."""
    return list(items)

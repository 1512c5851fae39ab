"""Time, injected: every deadline and window in batchkit reads a :class:`Clock`."""

from __future__ import annotations

import threading
import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "ListenableClock", "MonotonicClock", "checked_clock"]


@runtime_checkable
class Clock(Protocol):
    """Anything with ``now() -> float`` seconds on a monotonic scale."""

    def now(self) -> float: ...


@runtime_checkable
class ListenableClock(Protocol):
    """A clock that moves only when told (a test or simulation clock) and then notifies the
    conditions registered with it, so that a runtime sleeping until a deadline on that clock is
    woken when the deadline comes. :class:`batchkit.testing.MockClock` is one."""

    def now(self) -> float: ...

    def add_listener(self, cond: threading.Condition) -> None: ...

    def remove_listener(self, cond: threading.Condition) -> None: ...


class MonotonicClock:
    """The real clock: :func:`time.monotonic`."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()

    def __repr__(self) -> str:
        return "<MonotonicClock>"


def checked_clock(clock: object) -> Clock:
    """``clock``, or the :class:`MonotonicClock` for None.

    Raises:
        TypeError: ``clock`` has no ``now()`` method (caught where it is given, not at its first read).
    """
    if clock is None:
        return MonotonicClock()
    if not callable(getattr(clock, "now", None)):
        raise TypeError(f"clock must have a now() method returning seconds (a batchkit.Clock), got {clock!r}")
    return clock  # type: ignore[return-value]

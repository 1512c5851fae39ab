"""Time, injected: every deadline and window in batchkit reads a :class:`Clock`."""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "MonotonicClock"]


@runtime_checkable
class Clock(Protocol):
    """Anything with ``now() -> float`` seconds on a monotonic scale."""

    def now(self) -> float: ...


class MonotonicClock:
    """The real clock: :func:`time.monotonic`."""

    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()

    def __repr__(self) -> str:
        return "<MonotonicClock>"

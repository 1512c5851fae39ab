"""Small, allocation-light measurement helpers shared by every primitive's ``statistics()``."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["LatencySummary", "SampleWindow", "percentiles"]


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Percentiles of a latency sample, in milliseconds (``nan`` when there is no sample)."""

    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


_NAN = float("nan")
EMPTY_SUMMARY = LatencySummary(0, _NAN, _NAN, _NAN, _NAN, _NAN)


def percentiles(values: Sequence[float] | np.ndarray, qs: Iterable[float]) -> list[float]:
    """Linear-interpolated percentiles (``qs`` in 0..100) of ``values``; ``nan`` when empty."""
    arr = np.asarray(values, dtype=np.float64)
    qs = list(qs)
    if arr.size == 0:
        return [_NAN for _ in qs]
    return [float(x) for x in np.percentile(arr, qs)]


class SampleWindow:
    """The most recent ``size`` samples (seconds), summarised on demand.

    Appending is O(1) and allocation-free beyond the float; summarising costs a sort of the window,
    so it belongs in ``statistics()``, never on a per-request path.
    """

    __slots__ = ("_samples", "total")

    def __init__(self, size: int = 10_000) -> None:
        if size <= 0:
            raise ValueError(f"size must be positive, got {size!r}")
        self._samples: deque[float] = deque(maxlen=size)
        self.total = 0  # samples ever added

    def add(self, seconds: float) -> None:
        self._samples.append(seconds)
        self.total += 1

    def extend(self, seconds: Sequence[float]) -> None:
        self._samples.extend(seconds)
        self.total += len(seconds)

    def since(self, seen: int) -> tuple[list[float], int]:
        """The samples added after the first ``seen`` (those still in the window), and the new total."""
        new = min(self.total - seen, len(self._samples))
        if new <= 0:
            return [], self.total
        return list(self._samples)[-new:], self.total

    def __len__(self) -> int:
        return len(self._samples)

    def clear(self) -> None:
        self._samples.clear()

    def percentile_ms(self, q: float) -> float:
        return percentiles(tuple(self._samples), [q])[0] * 1e3

    def summary(self) -> LatencySummary:
        # One C-level copy first: atomic against appends from the thread that records samples
        # (statistics() is read from other threads, e.g. a /metrics scrape).
        samples = tuple(self._samples)
        if not samples:
            return EMPTY_SUMMARY
        arr = np.asarray(samples, dtype=np.float64) * 1e3
        p50, p90, p99 = np.percentile(arr, [50, 90, 99])
        return LatencySummary(
            count=int(arr.size),
            mean_ms=float(arr.mean()),
            p50_ms=float(p50),
            p90_ms=float(p90),
            p99_ms=float(p99),
            max_ms=float(arr.max()),
        )

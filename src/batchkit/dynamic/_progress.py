"""The progress bar of ``@batched.map(progress=True)``, ``batchkit bench`` and bulk jobs: tqdm's
when it is installed, else a plain line on stderr with rate and ETA."""

from __future__ import annotations

import math
import sys
import time
from typing import Any

__all__ = ["progress_bar"]


class _SimpleBar:
    """A dependency-free progress line on stderr (rate and ETA), used when tqdm is not installed."""

    def __init__(self, total: int | None, desc: str, unit: str) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.n = 0
        self._t0 = self._last = time.monotonic()

    def update(self, n: int) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= 0.2:
            self._last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.n / max(now - self._t0, 1e-9)
        text = f"\r{self.desc}: {self.n:,}"
        if self.total:
            eta = (self.total - self.n) / rate if rate > 0 else math.inf
            text += f"/{self.total:,} [{rate:,.0f} {self.unit}s/s, ETA {eta:,.0f} s]"
        else:
            text += f" [{rate:,.0f} {self.unit}s/s]"
        sys.stderr.write(text)
        sys.stderr.flush()

    def close(self) -> None:
        self._draw(time.monotonic())
        sys.stderr.write("\n")


def progress_bar(total: int | None, desc: str, unit: str = "it") -> Any:
    """A tqdm progress bar when tqdm is installed, else a plain line on stderr with rate and ETA
    (``update(n)``, ``close()``); ``@batched.map(progress=True)``, ``batchkit bench`` and bulk jobs
    show it."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _SimpleBar(total, desc, unit)
    return tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True)

"""Self-tuning batch size: the adaptive controller (the circuit breaker is in ``breaker.py``, the
tuner that applies a policy's decisions to a live batcher or decode loop in ``tuner.py``).

The controller is the clipped sign rule over the queue depth ``Q_t`` and its target ``Q*``::

    B_{t+1} = clip(B_t + eta * sign(Q_t - Q*), B_min, B_max)

with guards that step down instead: memory headroom (a user callback) running low; the batch
time itself nearing half the SLO (a request may wait one batch and then ride the next, so
``2 * t_batch(B)`` must stay inside it); and the latency percentile over a sliding window nearing
the SLO while there is no backlog. (With a backlog, high latency is queueing, and the cure is a
larger batch, not a smaller one: stepping down then would shrink capacity into a spiral.) A deadband around ``Q*`` and a
cooldown between changes keep it from oscillating; an out-of-memory error halves the ceiling.
The controller is sans-I/O: it is told the time (or reads an injected clock) and never sleeps
or starts threads.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .._clock import Clock, checked_clock

__all__ = ["AdaptiveBatchController", "Decision", "is_out_of_memory"]


@dataclass(frozen=True, slots=True)
class Decision:
    """One controller update: the batch size it chose, why, and what it saw."""

    time: float
    batch_size: int
    reason: str  # "queue_up", "queue_down", "deadband", "cooldown", "latency", "memory", "oom", "hold"
    queue_depth: float
    latency_ms: float


class AdaptiveBatchController:
    """The clipped sign rule with latency and memory guards, a deadband and a cooldown.

    Args:
        target_queue: ``Q*``, the queue depth to hold (requests waiting).
        eta: step size in batch-size units (>= 1).
        min_batch, max_batch: the clip range.
        initial: starting batch size (default ``min_batch``).
        latency_slo_ms: the latency SLO; with it, the controller steps down while the recent
            batch time exceeds ``slo_margin * SLO / 2``, or while the ``slo_quantile`` latency of the
            last ``window_s`` seconds exceeds ``slo_margin * SLO`` and the queue is at its target.
        memory_headroom: ``() -> float`` in [0, 1] (free KV blocks, free device memory...); below
            ``min_headroom`` the controller steps down.
        deadband: no change while ``|Q - Q*| <= deadband``.
        cooldown_s: at least this long between two changes.
        clock: time source.

    Raises:
        ValueError: a batch size that is not an int, ``min_batch``/``max_batch``/``initial`` out of
            order, a limit that is not a finite number or is out of its range (the message names it).
        TypeError: ``memory_headroom`` is not callable.
    """

    def __init__(
        self,
        *,
        target_queue: float,
        eta: int = 1,
        min_batch: int = 1,
        max_batch: int = 64,
        initial: int | None = None,
        latency_slo_ms: float | None = None,
        slo_quantile: float = 99.0,
        slo_margin: float = 0.8,
        window_s: float = 5.0,
        memory_headroom: Callable[[], float] | None = None,
        min_headroom: float = 0.1,
        deadband: float = 0.0,
        cooldown_s: float = 0.0,
        clock: Clock | None = None,
    ) -> None:
        for name, value in (("min_batch", min_batch), ("max_batch", max_batch), ("eta", eta), ("initial", initial)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an int (batch sizes are whole numbers), got {value!r}")
        if not 1 <= min_batch <= max_batch:
            raise ValueError(f"need 1 <= min_batch <= max_batch, got {min_batch} and {max_batch}")
        if eta < 1:
            raise ValueError(f"eta must be >= 1, got {eta}")
        for name, number in (
            ("target_queue", target_queue),
            ("deadband", deadband),
            ("cooldown_s", cooldown_s),
            ("window_s", window_s),
            ("min_headroom", min_headroom),
            ("slo_margin", slo_margin),
            ("slo_quantile", slo_quantile),
        ):
            if not is_finite(number):
                raise ValueError(f"{name} must be a finite number, got {number!r}")
        for name, number in (("target_queue", target_queue), ("deadband", deadband), ("cooldown_s", cooldown_s)):
            if number < 0:
                raise ValueError(f"{name} must be >= 0, got {number!r}")
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        if not 0 <= min_headroom <= 1:
            raise ValueError(f"min_headroom is a share of memory, in [0, 1], got {min_headroom!r}")
        if memory_headroom is not None and not callable(memory_headroom):
            raise TypeError(f"memory_headroom must be a function () -> float in [0, 1], got {memory_headroom!r}")
        if latency_slo_ms is not None and not (is_finite(latency_slo_ms) and latency_slo_ms > 0):
            raise ValueError(f"latency_slo_ms must be a finite number > 0, got {latency_slo_ms!r}")
        if not 0 < slo_margin <= 1:
            raise ValueError(f"slo_margin must be in (0, 1], got {slo_margin!r}")
        if not 0 <= slo_quantile <= 100:
            raise ValueError(f"slo_quantile must be a percentile in [0, 100], got {slo_quantile!r}")
        start = min_batch if initial is None else initial
        if not min_batch <= start <= max_batch:
            raise ValueError(f"initial must be within [{min_batch}, {max_batch}], got {initial}")
        self.target_queue = target_queue
        self.eta = eta
        self.min_batch = min_batch
        self.max_batch = max_batch
        self.ceiling = max_batch
        self.latency_slo_ms = latency_slo_ms
        self.slo_quantile = slo_quantile
        self.slo_margin = slo_margin
        self.window_s = window_s
        self.memory_headroom = memory_headroom
        self.min_headroom = min_headroom
        self.deadband = deadband
        self.cooldown_s = cooldown_s
        self.clock: Clock = checked_clock(clock)
        self.batch_size = start
        self._last_change = float("-inf")
        self._latencies: deque[tuple[float, float]] = deque()
        self._batch_times: deque[tuple[float, int, float]] = deque(maxlen=16)
        self.decisions: deque[Decision] = deque(maxlen=1000)

    def observe_latency(self, seconds: float, now: float | None = None) -> None:
        """Record one request's latency (end to end) for the SLO guard."""
        self._latencies.append((self.clock.now() if now is None else now, seconds))

    def observe_latencies(self, seconds: list[float] | np.ndarray, now: float | None = None) -> None:
        t = self.clock.now() if now is None else now
        self._latencies.extend((t, s) for s in seconds)

    def observe_batch(self, size: int, seconds: float, now: float | None = None) -> None:
        """Record how long a batch of ``size`` took (for the batch-time guard)."""
        self._batch_times.append((self.clock.now() if now is None else now, size, seconds))

    def _batch_time_ms(self) -> float:
        """The longest recent batch time at or above the current batch size, in ms."""
        times = [s for _, b, s in self._batch_times if b >= self.batch_size]
        return max(times) * 1e3 if times else 0.0

    def latency_ms(self, now: float | None = None) -> float:
        """The ``slo_quantile`` latency over the sliding window, in ms (``nan`` if no samples)."""
        now = self.clock.now() if now is None else now
        lat = self._latencies
        while lat and lat[0][0] < now - self.window_s:
            lat.popleft()
        if not lat:
            return float("nan")
        return (
            float(np.percentile(np.fromiter((s for _, s in lat), dtype=np.float64, count=len(lat)), self.slo_quantile))
            * 1e3
        )

    def _set(self, size: int, now: float) -> None:
        size = max(self.min_batch, min(size, self.ceiling))
        if size != self.batch_size:
            self.batch_size = size
            self._last_change = now

    def update(self, queue_depth: float, now: float | None = None) -> Decision:
        """Decide the batch size for the next period from the queue depth seen now."""
        now = self.clock.now() if now is None else now
        slo = self.latency_slo_ms
        lat = self.latency_ms(now) if slo is not None else float("nan")
        backlog = queue_depth > self.target_queue + self.deadband
        # A batch that alone takes half the SLO argues for smaller batches, but only while the
        # queue is under control: with a backlog, shrinking cuts throughput and the queueing delay
        # it adds outgrows the batch time it saves (measured: P99 4.3 s against 0.1 s at fixed B).
        slow_batches = slo is not None and not backlog and self._batch_time_ms() >= self.slo_margin * slo / 2
        near_slo = slo is not None and lat == lat and lat >= self.slo_margin * slo and not backlog
        if now - self._last_change < self.cooldown_s:
            reason = "cooldown"
        elif self.memory_headroom is not None and self.memory_headroom() < self.min_headroom:
            reason = "memory"
            self._set(self.batch_size - self.eta, now)
        elif slow_batches or near_slo:
            reason = "latency"
            self._set(self.batch_size - self.eta, now)
        elif abs(queue_depth - self.target_queue) <= self.deadband:
            reason = "deadband"
        elif queue_depth > self.target_queue:
            reason = "queue_up"
            self._set(self.batch_size + self.eta, now)
        else:
            reason = "queue_down"
            self._set(self.batch_size - self.eta, now)
        d = Decision(now, self.batch_size, reason, float(queue_depth), lat)
        self.decisions.append(d)
        return d

    def on_oom(self, failed_batch: int, now: float | None = None) -> None:
        """A batch of ``failed_batch`` items ran out of memory: halve the ceiling below it."""
        now = self.clock.now() if now is None else now
        self.ceiling = max(self.min_batch, min(self.ceiling, failed_batch // 2))
        self._set(min(self.batch_size, self.ceiling), now)
        self.decisions.append(Decision(now, self.batch_size, "oom", float("nan"), float("nan")))

    def __repr__(self) -> str:
        return f"<AdaptiveBatchController batch_size={self.batch_size} range=[{self.min_batch}, {self.ceiling}]>"


def is_finite(value: object) -> bool:
    """A finite real number (numpy's too), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def is_out_of_memory(exc: BaseException) -> bool:
    """``MemoryError``, ``torch.cuda.OutOfMemoryError`` and the like (recognised by name, so
    that torch need not be imported)."""
    return isinstance(exc, MemoryError) or type(exc).__name__ in ("OutOfMemoryError", "OutOfMemory")

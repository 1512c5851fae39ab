"""A discrete-event simulator of dynamic batching on virtual time.

It drives the very cores that :class:`~batchkit.DynamicBatcher` drives (the queue's
:class:`~batchkit.dynamic._queue_core.QueueCore` admission and the :class:`~batchkit.dynamic.former.BatchFormer`
flush decisions, with an optional :class:`~batchkit.AdaptiveBatchController`) with a model of the
batch cost ``t_batch(B)`` and an arrival process, so that what it predicts is what the batcher's
policy does by construction, thousands of simulated seconds per real second, deterministically
under a seed.

::

    from batchkit import sim

    cost = sim.linear_cost(fixed_ms=15, per_item_ms=5)   # t(1) = 20 ms, t(8) = 55 ms
    r = sim.simulate(cost, sim.poisson(rate=500, duration_s=60, seed=1), max_batch_size=8, max_wait_ms=10)
    r.throughput, r.latency.p99_ms, r.mean_batch_size
"""

from __future__ import annotations

import bisect
import heapq
import math
import numbers
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._errors import CircuitOpen, QueueFull
from ._validate import positive_int
from .control import AdaptiveBatchController, CircuitBreaker
from .dynamic._queue_core import QueueCore, QueueEntry
from .dynamic.former import BatchFormer, FormedBatch
from .dynamic.ledger import NO_FALLBACK, Phase, RequestLedger
from .metrics import LatencySummary, summarize

__all__ = [
    "ClosedLoop",
    "PhaseResult",
    "SimResult",
    "bursty",
    "linear_cost",
    "poisson",
    "simulate",
    "steps",
    "table_cost",
    "trace",
]

CostFn = Callable[[int], float]


def linear_cost(fixed_ms: float, per_item_ms: float) -> CostFn:
    """``t(B) = fixed + per_item * B`` (ms in, seconds out): weights read once, compute per item."""
    return lambda b: (fixed_ms + per_item_ms * b) / 1e3


def table_cost(table: dict[int, float]) -> CostFn:
    """``t(B)`` interpolated linearly from measured ``{B: seconds}`` (e.g. from ``batchkit bench``).

    Raises:
        ValueError: an empty table, a batch size below 1, or a time that is not a finite number
            of seconds >= 0.
    """
    if not table:
        raise ValueError("the cost table is empty")
    for b, seconds in table.items():
        if not (isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) and b >= 1):
            raise ValueError(f"the cost table's batch sizes must be >= 1, got {b!r}")
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"the cost table's times must be finite seconds >= 0, got {seconds!r} for B={b}")
    xs = sorted(table)
    ys = [table[x] for x in xs]

    def cost(b: int) -> float:
        if b <= xs[0]:
            return ys[0] * b / xs[0] if xs[0] > 1 else ys[0]
        if b >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else ys[-1] / xs[-1]
            return ys[-1] + slope * (b - xs[-1])
        i = bisect.bisect_left(xs, b)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (b - x0) / (x1 - x0)

    return cost


def poisson(rate: float, duration_s: float, seed: int = 0, start: float = 0.0) -> Iterator[float]:
    """Arrival times of a Poisson process of ``rate`` per second (none at rate 0).

    Raises:
        ValueError: a negative ``rate`` or ``duration_s`` (on the first iteration: this is a generator).
    """
    if not rate >= 0 or not duration_s >= 0:
        raise ValueError(f"rate and duration_s must be >= 0, got rate={rate!r}, duration_s={duration_s!r}")
    if rate == 0:
        return
    rng = random.Random(seed)
    t = start
    while True:
        t += rng.expovariate(rate)
        if t >= start + duration_s:
            return
        yield t


def steps(phases: Sequence[tuple[float, float]], seed: int = 0) -> Iterator[float]:
    """Poisson arrivals whose rate steps through ``[(duration_s, rate), ...]``."""
    t = 0.0
    for i, (duration, rate) in enumerate(phases):
        yield from poisson(rate, duration, seed + i, start=t)
        t += duration


def bursty(
    base_rate: float, burst_rate: float, period_s: float, burst_s: float, duration_s: float, seed: int = 0
) -> Iterator[float]:
    """``base_rate`` arrivals with bursts of ``burst_rate`` for ``burst_s`` every ``period_s``.

    Raises:
        ValueError: ``period_s`` not > 0, or ``burst_s`` outside ``0..period_s`` (a burst longer
            than its period would stretch the arrivals past ``duration_s``).
    """
    if not period_s > 0 or not 0 <= burst_s <= period_s:
        raise ValueError(
            f"need period_s > 0 and 0 <= burst_s <= period_s, got period_s={period_s!r}, burst_s={burst_s!r}"
        )
    phases = []
    t = 0.0
    while t < duration_s:
        phases += [
            (min(burst_s, duration_s - t), burst_rate),
            (max(0.0, min(period_s - burst_s, duration_s - t - burst_s)), base_rate),
        ]
        t += period_s
    return steps([p for p in phases if p[0] > 0], seed)


def trace(source: str | Path | Iterable[float]) -> Iterator[float]:
    """Arrival times from a file (one time in seconds per line) or any iterable of times."""
    if isinstance(source, (str, Path)):
        values = [float(line) for line in Path(source).read_text().split() if line.strip()]
    else:
        values = [float(x) for x in source]
    yield from sorted(values)


@dataclass(frozen=True)
class ClosedLoop:
    """``concurrency`` callers that each send their next request as soon as the last one returns,
    for ``duration_s`` seconds."""

    concurrency: int
    duration_s: float

    def __post_init__(self) -> None:
        positive_int("concurrency", self.concurrency)
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s!r}")


@dataclass(frozen=True)
class PhaseResult:
    """What happened to the requests that arrived within one time window."""

    start: float
    end: float
    arrivals: int
    completed: int  # requests that arrived in the window and were served (whenever)
    throughput: float  # requests completed within the window, per second
    latency: LatencySummary
    mean_batch_size: float


@dataclass(frozen=True)
class SimResult:
    """The outcome of a simulation (times in seconds unless named ``_ms``)."""

    duration: float
    arrivals: int
    completed: int
    rejected: int
    expired: int
    throughput: float
    latency: LatencySummary
    mean_batch_size: float
    batches: int
    utilisation: float  # share of the time the model was busy (running one batch or more)
    mean_in_system: float  # L, time-averaged
    phases: list[PhaseResult] = field(default_factory=list)
    batch_sizes: list[tuple[float, int]] = field(default_factory=list)  # (time, size) of each batch
    failed: int = 0  # requests whose batch failed (see ``fails``)

    @property
    def littles_law_ratio(self) -> float:
        """``L / (lambda * W)``: 1.0 when the measurements are consistent."""
        w = self.latency.mean_ms / 1e3
        lam = self.completed / self.duration if self.duration else 0.0
        return self.mean_in_system / (lam * w) if lam * w > 0 else float("nan")


class _Request(QueueEntry[None]):
    """A simulated request: a queue entry with the ledger's phase (no item, no caller)."""

    __slots__ = ("error", "fallback", "phase", "value")

    def __init__(self, arrival: float) -> None:
        super().__init__(None, 0, 0, arrival, None, None, 1)
        self.phase = Phase.WAITING
        self.fallback: Any = NO_FALLBACK
        self.value: Any = None
        self.error: BaseException | None = None


_BATCH_FAILED = RuntimeError("the simulated batch failed (see fails=)")


def _seconds(value: Any, size: int) -> float:
    """A cost function's answer as seconds: a finite number >= 0 (a negative or NaN batch time
    would move the simulation back in time)."""
    try:
        dt = float(value)
    except (TypeError, ValueError):
        dt = math.nan
    if not (math.isfinite(dt) and dt >= 0):
        raise ValueError(f"cost({size}) returned {value!r}: t_batch(B) must be a finite number of seconds >= 0")
    return dt


def _is_number(x: object) -> bool:
    """A real number (numpy's included), not a bool, not NaN."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def _in_order(arrivals: Iterable[float]) -> Iterator[float]:
    """The arrival times, checked as they come: finite and never earlier than the one before.

    Raises:
        ValueError: a time that is not a finite number, or one earlier than its predecessor
            (sort them, or read them with :func:`trace`, which does).
    """
    last = -math.inf
    for i, t in enumerate(arrivals):
        if not _is_number(t) or not math.isfinite(t):
            raise ValueError(f"arrival {i} is {t!r}: arrival times must be finite numbers of seconds")
        if t < last:
            raise ValueError(
                f"arrival {i} at {t!r} s comes before the one before it ({last!r} s): arrival times must be "
                "in order (sort them, or read them with trace())"
            )
        last = t
        yield float(t)


_DONE, _ARRIVAL, _TIMER = 0, 1, 2  # event kinds, in the order events at one instant are handled


class _Simulation:
    """One run on virtual time: the event heap, the former and ledger it drives, and what it
    records (each served request's arrival, latency and batch size; each batch's start and size;
    the busy time and the area under the number of requests in the system)."""

    def __init__(
        self,
        former: BatchFormer[_Request],
        cost: CostFn,
        *,
        deadline_ms: float | None,
        circuit_breaker: CircuitBreaker | None,
        fails: Callable[[float], bool] | None,
    ) -> None:
        self.former = former
        self.ledger = RequestLedger()  # the same counting rules as a batcher's statistics()
        self.cost = cost
        self.deadline_ms = deadline_ms
        self.circuit_breaker = circuit_breaker
        self.fails = fails
        self.events: list[tuple[float, int, int, Any]] = []  # (time, kind, tiebreak, payload)
        self.counter = 0
        self.closed: ClosedLoop | None = None
        self.arrival_iter: Iterator[float] | None = None
        self.end_time = math.inf
        self.records: list[tuple[float, float, int]] = []  # (arrival, latency, batch size)
        self.arrival_times: list[float] = []
        self.batch_sizes: list[tuple[float, int]] = []
        self.busy = 0.0  # time at least one batch ran: concurrent batches overlap
        self.busy_until = 0.0
        self.in_system_area = 0.0
        self.in_system = 0
        self.last_t = 0.0
        self.timers: set[float] = set()

    def push(self, t: float, kind: int, payload: Any = None) -> None:
        self.counter += 1
        heapq.heappush(self.events, (t, kind, self.counter, payload))

    def start(self, arrivals: Iterable[float] | ClosedLoop) -> None:
        """The first arrivals: each closed-loop caller's at 0, or the first of the times."""
        if isinstance(arrivals, ClosedLoop):
            self.closed = arrivals
            for _ in range(arrivals.concurrency):
                self.push(0.0, _ARRIVAL)
            self.end_time = arrivals.duration_s
            return
        self.arrival_iter = _in_order(arrivals)
        first = next(self.arrival_iter, None)
        if first is not None:
            self.push(first, _ARRIVAL)

    def run(self) -> None:
        """Handle every event in time order; after each, expire and start what is due."""
        while self.events:
            t, kind, _, payload = heapq.heappop(self.events)
            self.in_system_area += self.in_system * (t - self.last_t)
            self.last_t = t
            if kind == _DONE:
                self._finished(t, payload)
            elif kind == _ARRIVAL:
                if self.closed is not None and t >= self.end_time:
                    continue
                self._arrive(t)
            else:
                self.timers.discard(t)
            drops = self.former.expire(t)
            self.ledger.drop(drops)
            self.in_system -= len(drops)
            self._start_due(t)

    def _finished(self, t: float, payload: tuple[FormedBatch[_Request], int, float, bool]) -> None:
        batch, size, took, ok = payload
        self.former.complete(batch)
        if ok:
            served, lat = self.ledger.answer(batch.entries, [None] * size, t)
            for r, x in zip(served, lat, strict=True):
                self.records.append((r.arrival, x, size))
            self.former.observe_latencies(lat, t)
        else:
            self.ledger.fail(batch.entries, _BATCH_FAILED, t)
        self.former.record(batch, size, took, ok, t)
        self.in_system -= size
        if self.closed is not None and t < self.end_time:
            for _ in range(size):
                self.push(t, _ARRIVAL)

    def _arrive(self, t: float) -> None:
        self.arrival_times.append(t)
        try:
            if self.circuit_breaker is not None:
                self.circuit_breaker.check(t)
            self.former.add(_Request(t), t, 0, self.deadline_ms)
            self.ledger.admitted(t)
            self.in_system += 1
        except (QueueFull, CircuitOpen):
            self.ledger.refused()
        if self.arrival_iter is not None:
            nxt = next(self.arrival_iter, None)
            if nxt is not None:
                self.push(nxt, _ARRIVAL)

    def _start_due(self, t: float) -> None:
        """Start every batch the former has due at ``t``, and set a timer for its next wake."""
        while True:
            formed, wake_at = self.former.next_batch(t)
            if formed is None:
                break
            size = len(self.ledger.start(formed.entries))
            dt = _seconds(self.cost(size), size)
            self.busy += max(0.0, t + dt - max(t, self.busy_until))
            self.busy_until = max(self.busy_until, t + dt)
            self.batch_sizes.append((t, size))
            self.push(t + dt, _DONE, (formed, size, dt, self.fails is None or not self.fails(t)))
        if wake_at is not None and wake_at > t and wake_at not in self.timers:
            self.timers.add(wake_at)
            self.push(wake_at, _TIMER)

    def phase(self, start: float, end: float) -> PhaseResult:
        """What happened to the requests that arrived in ``[start, end)``."""
        sel = [(lat, size) for arr, lat, size in self.records if start <= arr < end]
        finished_in = sum(1 for arr, lat, _ in self.records if start <= arr + lat < end)
        return PhaseResult(
            start=start,
            end=end,
            arrivals=sum(1 for a in self.arrival_times if start <= a < end),
            completed=len(sel),
            throughput=finished_in / (end - start) if end > start else 0.0,
            latency=summarize([lat for lat, _ in sel]),
            mean_batch_size=sum(s for _, s in sel) / len(sel) if sel else 0.0,
        )

    def result(self, phases: Sequence[tuple[float, float]]) -> SimResult:
        duration = self.last_t
        done = self.records
        n_batches = len(self.batch_sizes)
        return SimResult(
            duration=duration,
            arrivals=len(self.arrival_times),
            completed=len(done),
            rejected=self.ledger.rejected,
            expired=self.ledger.expired,
            failed=self.ledger.failed,
            throughput=len(done) / duration if duration else 0.0,
            latency=summarize([lat for _, lat, _ in done]),  # exact: the run keeps every latency anyway
            mean_batch_size=sum(s for _, s in self.batch_sizes) / n_batches if n_batches else 0.0,
            batches=n_batches,
            utilisation=self.busy / duration if duration else 0.0,
            mean_in_system=self.in_system_area / duration if duration else 0.0,
            phases=[self.phase(start, end) for start, end in phases],
            batch_sizes=self.batch_sizes,
        )


def simulate(
    cost: CostFn,
    arrivals: Iterable[float] | ClosedLoop,
    *,
    max_batch_size: int = 32,
    max_wait_ms: float = 5.0,
    max_concurrent_batches: int = 1,
    max_queue: int = 1_000_000,
    deadline_ms: float | None = None,
    controller: AdaptiveBatchController | None = None,
    circuit_breaker: CircuitBreaker | None = None,
    fails: Callable[[float], bool] | None = None,
    phases: Sequence[tuple[float, float]] | None = None,
) -> SimResult:
    """Run the batcher's cores (queue core and former) on virtual time.

    Args:
        cost: ``t_batch(B)`` in seconds (a finite number >= 0; anything else raises ValueError).
        arrivals: arrival times (e.g. :func:`poisson`, :func:`steps`, :func:`trace`) or a
            :class:`ClosedLoop`.
        max_batch_size, max_wait_ms, max_concurrent_batches, max_queue: the batcher's settings.
        deadline_ms: each request's deadline (expired ones are counted, not served).
        controller: an :class:`AdaptiveBatchController` to drive the batch size, told the
            simulation's time (its own ``clock`` is left as it is).
        circuit_breaker: a :class:`CircuitBreaker`, told the simulation's time (arrivals while
            it is open count as ``rejected``, as a batcher's ``statistics()`` counts them).
        fails: an outage model: ``fails(t)`` says whether a batch that starts at ``t`` fails
            (its items count as ``failed``, and the breaker sees the failure); default: none fail.
        phases: ``[(start, end), ...]`` windows to report separately (by arrival time).

    Raises:
        ValueError: arrival times out of order or not finite, a ``deadline_ms`` that is not a
            finite number > 0, a phase whose start is not before its end, or a ``cost`` that
            returns anything but a finite number of seconds >= 0.
    """
    if deadline_ms is not None and (not _is_number(deadline_ms) or not 0 < deadline_ms < math.inf):
        raise ValueError(f"deadline_ms must be a finite number of ms > 0 (or None: no deadline), got {deadline_ms!r}")
    for window in phases or []:
        start, end = window
        if not (_is_number(start) and _is_number(end) and start < end):
            raise ValueError(f"each phase must be a (start, end) window of times with start < end, got {window!r}")
    former: BatchFormer[_Request] = BatchFormer(
        QueueCore(max_queue, "reject"),
        max_batch_size=max_batch_size,
        max_wait_ms=max_wait_ms,
        max_concurrent_batches=max_concurrent_batches,
        controller=controller,
        circuit_breaker=circuit_breaker,
    )
    run = _Simulation(former, cost, deadline_ms=deadline_ms, circuit_breaker=circuit_breaker, fails=fails)
    run.start(arrivals)
    run.run()
    return run.result(phases or [])

"""DynamicBatcher: many small calls in, few large calls to the model, every caller answered once.

Architecture (see docs/architecture.md):

- The policy is a sans-I/O :class:`~batchkit.dynamic.former.BatchFormer` over the queue's
  :class:`~batchkit.dynamic._queue_core.QueueCore`: it admits requests, decides when a batch is due
  (``max_batch_size`` reached, ``max_wait_ms`` since the *oldest* waiting item, ``flush()``,
  ``close()``) and seals it only when a worker slot is free, so that while the model is busy the
  next batch keeps growing. This module is its threaded shell, and ``batchkit.sim`` drives the
  same former on virtual time.
- Callers (threads or async tasks, on asyncio or trio, mixed) admit requests through the former
  under the queue's lock (``queue.mutex``) and park on a waiter.
- One dispatcher thread sleeps until the former's ``wake_at`` (or an arrival that changes the
  plan), expires deadlines, enforces ``batch_timeout_s`` and hands due batches to the workers.
- ``max_concurrent_batches`` worker threads call the batch function (an async one runs on the
  batcher's own event loop thread) and deliver results: per-item values or exceptions, one
  cross-thread wake per caller event loop per batch.

Nothing starts until the first submit; ``close()`` drains and joins everything.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import logging
import threading
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from time import monotonic as _monotonic
from typing import Any, Generic, TypedDict, TypeVar

import anyio
from typing_extensions import Self

from .._clock import Clock
from .._errors import BatcherClosed, BatchSizeMismatch, BatchTimeout, CircuitOpen, QueueFull
from .._waiters import ThreadWaiter, new_async_waiter, wake_all
from ..control import AdaptiveBatchController, CircuitBreaker, is_out_of_memory
from ..metrics import LatencySummary, SampleWindow
from ._loop_thread import LoopThread
from ._queue_core import (
    Drop,
    QueueEntry,
    check_number,
    check_put_args,
    check_queue_options,
    check_timeout,
    is_cost,
)
from ._threads import BatchThreads
from .former import FLUSH_REASONS, BatchFormer, BatchInfo, FormedBatch
from .ledger import NO_FALLBACK, Phase, RequestLedger, Split
from .queue import BoundedQueue, OnFull

__all__ = [
    "FLUSH_REASONS",
    "BatchInfo",
    "BatcherOptions",
    "BatcherShell",
    "BatcherStatistics",
    "DynamicBatcher",
    "LedgerEntry",
    "check_batcher_options",
    "is_async_callable",
    "item_key_and_cost",
    "malformed_results",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_NO_FALLBACK: Any = NO_FALLBACK
# Enum members read from the class cost more than globals.
_QUEUED, _WAITING, _RUNNING = Phase.QUEUED, Phase.WAITING, Phase.RUNNING

Settled = tuple[list[Any], bool] | Split
"""What :meth:`BatcherShell._settle` makes of a call: the entries to wake and whether it
succeeded, or the halves to call next."""


class LedgerEntry(QueueEntry[Any]):
    """One caller's item, its place in the queue (it *is* the queue entry) and its answer: a
    shell's request as the :class:`~batchkit.dynamic.ledger.RequestLedger` tracks it.

    The queue fields (priority, seq, arrival, ...) are filled in when it is admitted; its
    ``phase`` (its one state) moves along the ledger's table, and ``value`` and ``error`` are
    the ledger's once it is answered.
    """

    __slots__ = ("error", "fallback", "value")

    def __init__(self, item: Any, fallback: Any) -> None:
        self.item = item
        self.fallback = fallback
        self.phase = _QUEUED
        self.value: Any = None
        self.error: BaseException | None = None

    def outcome(self) -> Any:
        """The value the ledger answered with, or raise its error."""
        if self.error is not None:
            raise self.error
        return self.value


class _Request(LedgerEntry):
    """A :class:`DynamicBatcher` caller's entry, and how to wake it."""

    __slots__ = ("notified", "sink")

    def __init__(self, item: Any, sink: Any, fallback: Any) -> None:
        # LedgerEntry's fields, set here rather than through super(): one call less per request.
        self.item = item
        self.fallback = fallback
        self.phase = _QUEUED
        self.value = None
        self.error = None
        self.sink = sink  # concurrent.futures.Future, ThreadWaiter, or an async waiter
        # A Future sink: set_running_or_notify_cancel() was called (it may be called only once).
        self.notified = False


_Batch = FormedBatch[_Request]


@dataclass(frozen=True, slots=True)
class BatcherStatistics:
    """A snapshot of a :class:`DynamicBatcher` (latencies in milliseconds).

    ``pending``: items waiting in the queue; ``in_flight``: items in the batches running now
    (``running_batches`` of them); ``submitted``: items admitted; ``succeeded`` / ``failed``:
    callers a batch answered with a result / an exception; ``cancelled``: callers that gave up,
    and items ``close()`` failed before they ran (``drain=False``, or an open circuit breaker);
    ``expired``: items whose
    deadline passed (answered with ``DeadlineExceeded`` or their fallback); ``rejected``: submits
    refused (``QueueFull``, ``CircuitOpen``) plus items evicted from a full queue.

    ``queue_wait``, ``latency`` and ``batch_time`` cover the whole run (mergeable with
    ``LatencySummary.merge``); the ``*_recent`` ones the last 10,000 samples of each.
    """

    pending: int
    in_flight: int
    submitted: int
    succeeded: int
    failed: int
    cancelled: int
    expired: int
    rejected: int
    batches: int
    mean_batch_size: float
    batch_size_histogram: dict[int, int] = field(default_factory=dict)
    flush_reasons: dict[str, int] = field(default_factory=dict)
    queue_wait: LatencySummary | None = None
    latency: LatencySummary | None = None
    batch_time: LatencySummary | None = None
    throughput_rps: float = 0.0
    running_batches: int = 0
    queue_wait_recent: LatencySummary | None = None
    latency_recent: LatencySummary | None = None
    batch_time_recent: LatencySummary | None = None


BatchFn = Callable[[list[T]], Sequence[R]] | Callable[[list[T]], Awaitable[Sequence[R]]]


class BatcherOptions(TypedDict, total=False):
    """The keyword options of :class:`DynamicBatcher` besides ``max_batch_size`` and
    ``max_wait_ms`` (the ones ``@batched`` passes through); see its docstring for each."""

    queue: BoundedQueue[Any] | None
    max_queue: int
    on_full: OnFull
    max_concurrent_batches: int
    size_fn: Callable[[Any], float] | None
    max_batch_cost: float | None
    group_by: Callable[[Any], Hashable] | None
    isolate_errors: bool
    batch_timeout_s: float | None
    controller: AdaptiveBatchController | None
    circuit_breaker: CircuitBreaker | None
    clock: Clock | None
    name: str | None


_OPTION_NAMES = frozenset(BatcherOptions.__annotations__)


def check_batcher_options(
    fn: object, max_batch_size: int, max_wait_ms: float, options: BatcherOptions, *, size_name: str = "max_batch_size"
) -> None:
    """Raise what ``DynamicBatcher(fn, max_batch_size=..., max_wait_ms=..., **options)`` would
    raise for these arguments, without building a batcher: nothing is started, and a ``queue``
    is checked but not claimed (``@batched`` validates at decoration this way). Missing options
    take their defaults. ``size_name``: what the caller calls the batch size (``@batched``'s
    ``max_batch``), in the message for an unknown option.

    Raises:
        TypeError: ``fn``, ``size_fn`` or ``group_by`` is not callable, ``queue``,
            ``controller`` or ``circuit_breaker`` is not of its type, ``clock`` has no ``now()``,
            or an option name is unknown.
        ValueError: a value the batcher refuses (the message names the argument and the fix):
            a size that is not an int >= 1, a ``max_wait_ms`` that is not a number >= 0, a
            ``max_batch_cost`` or ``batch_timeout_s`` that is not a number > 0.
    """
    unknown = options.keys() - _OPTION_NAMES
    if unknown:
        raise TypeError(
            f"unknown batcher option(s) {', '.join(sorted(unknown))}; the options are {size_name}, "
            f"max_wait_ms, {', '.join(sorted(_OPTION_NAMES))}"
        )
    if not callable(fn):
        raise TypeError(f"fn must be callable (a batch function over a list), got {fn!r}")
    _check_positive_int("max_batch_size", max_batch_size)
    _check_positive_int("max_concurrent_batches", options.get("max_concurrent_batches", 1))
    check_number("max_wait_ms", max_wait_ms, unit="milliseconds")
    size_fn = options.get("size_fn")
    max_batch_cost = options.get("max_batch_cost")
    for what, f in (("size_fn", size_fn), ("group_by", options.get("group_by"))):
        if f is not None and not callable(f):
            raise TypeError(f"{what} must be a function of one item, got {f!r}")
    for what, cls in (("controller", AdaptiveBatchController), ("circuit_breaker", CircuitBreaker)):
        value = options.get(what)
        if value is not None and not isinstance(value, cls):
            raise TypeError(f"{what} must be a batchkit.{cls.__name__} (or None), got {value!r}")
    clock = options.get("clock")
    if clock is not None and not callable(getattr(clock, "now", None)):
        raise TypeError(f"clock must have a now() method returning seconds (a batchkit.Clock), got {clock!r}")
    if max_batch_cost is not None and size_fn is None:
        raise ValueError("max_batch_cost needs size_fn: pass size_fn=lambda item: cost_of(item)")
    if max_batch_cost is not None:
        check_number("max_batch_cost", max_batch_cost, unit="size_fn cost units", positive=True, optional=True)
    batch_timeout_s = options.get("batch_timeout_s")
    if batch_timeout_s is not None:
        check_number("batch_timeout_s", batch_timeout_s, unit="seconds", positive=True, optional=True)
    queue = options.get("queue")
    if queue is not None and not isinstance(queue, BoundedQueue):
        raise TypeError(f"queue must be a batchkit.BoundedQueue (or None for the default one), got {queue!r}")
    if queue is None:
        max_queue = options.get("max_queue", 4096)
        _check_positive_int("max_queue", max_queue)
        check_queue_options(max_queue, options.get("on_full", "reject"))
    elif queue.on_drop is not None:
        if isinstance(getattr(queue.on_drop, "__self__", None), BatcherShell):
            raise ValueError("queue already belongs to a batcher (its on_drop is set); give each its own")
        raise ValueError(
            f"queue has an on_drop callback ({queue.on_drop!r}); a batcher answers the callers of the items "
            "that leave its queue unserved through on_drop itself: pass a queue without one (the batcher's "
            "statistics() count the expired, evicted and cancelled items)"
        )
    elif options.get("max_queue", 4096) != 4096 or options.get("on_full", "reject") != "reject":
        raise ValueError(
            "queue= brings its own capacity and on_full policy; pass either queue or max_queue/on_full, not both"
        )
    elif clock is not None and queue.clock is not clock:
        # Deadlines and waits would be set on one clock and read on the other: the queue's own
        # expire() (in statistics(), put, get) would fail a caller long before its deadline.
        raise ValueError(
            "queue= keeps its own clock: pass clock= to the BoundedQueue (the batcher then uses it), not another "
            "one to the batcher"
        )


class BatcherShell(Generic[T, R]):
    """What :class:`DynamicBatcher` (threads) and :class:`~batchkit.AsyncBatcher` (one event
    loop) share around their :class:`~batchkit.dynamic.former.BatchFormer`: the settings, the counters,
    ``statistics()``, the ``TunableTarget`` methods, admission (waiting for room included) and
    what a call of the batch function answers."""

    def __init__(
        self, fn: Any, max_batch_size: int, max_wait_ms: float, options: BatcherOptions, *, locked: bool
    ) -> None:
        """Check ``options`` (those of :class:`DynamicBatcher`, see :func:`check_batcher_options`)
        and build the queue, former and ledger; ``locked``: the shell drives its former under the
        queue's mutex (threads), else under no lock (one event loop is the only driver)."""
        check_batcher_options(fn, max_batch_size, max_wait_ms, options)
        queue = options.get("queue")
        if queue is None:
            on_full = options.get("on_full", "reject")
            queue = BoundedQueue(options.get("max_queue", 4096), on_full, clock=options.get("clock"))
        self.queue: BoundedQueue[Any] = queue
        """The queue items wait in (its capacity and ``on_full`` apply)."""
        queue.on_drop = self._on_drop
        queue.stop_waiting = self._is_closing
        self.fn = fn
        self.name: str = options.get("name") or str(getattr(fn, "__qualname__", type(fn).__name__))
        size_fn = self.size_fn = options.get("size_fn")
        group_by = self.group_by = options.get("group_by")
        self.isolate_errors = isolate_errors = options.get("isolate_errors", False)
        self.clock: Clock = queue.clock
        self._now = self.clock.now
        core = self._core = queue.core
        self._guard: contextlib.AbstractContextManager[Any] = queue.mutex if locked else contextlib.nullcontext()
        self._block = block = queue.on_full == "block"  # a full queue makes the caller wait for room
        max_batch_cost = options.get("max_batch_cost")
        max_concurrent_batches = options.get("max_concurrent_batches", 1)
        batch_timeout_s = options.get("batch_timeout_s")
        controller = options.get("controller")
        circuit_breaker = options.get("circuit_breaker")
        self.former: BatchFormer[Any] = BatchFormer(
            core,
            max_batch_size=max_batch_size,
            max_wait_ms=max_wait_ms,
            max_batch_cost=max_batch_cost,
            grouped=group_by is not None,
            max_concurrent_batches=max_concurrent_batches,
            batch_timeout_s=batch_timeout_s,
            controller=controller,
            circuit_breaker=circuit_breaker,
        )
        """The flush policy this batcher drives."""
        # The settings the former was built with (they do not change; max_batch_size does).
        self.max_wait_ms = self.former.max_wait_ms
        self.max_batch_cost = max_batch_cost
        self.max_concurrent_batches = max_concurrent_batches
        self.batch_timeout_s = batch_timeout_s
        self.controller = controller
        self.circuit_breaker = circuit_breaker
        self._closing = False
        self.ledger = RequestLedger(isolate_errors=isolate_errors)
        """Every request's phase and the counters of :meth:`statistics`."""
        self._batch_time = SampleWindow()
        # No per-item work beyond admission: no key, cost, breaker or waiting for room.
        self._plain = group_by is None and size_fn is None and circuit_breaker is None and not block

    @property
    def max_batch_size(self) -> int:
        """Most items per batch (an adaptive controller or tuner may change it)."""
        return self.former.max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, value: int) -> None:
        self.set_batch_limit(value)

    @property
    def closed(self) -> bool:
        """Whether closing has begun (new submits are refused)."""
        return self._closing

    def _is_closing(self) -> bool:
        # A writer waiting for room reads this under the queue's lock (BoundedQueue.stop_waiting):
        # close() sets it under that lock, then wakes the writers.
        return self._closing

    def queue_depth(self) -> int:
        """Items waiting in the queue now (``TunableTarget``)."""
        return self._core.depth

    def latency_samples(self, since: int = 0) -> tuple[list[float], int]:
        """End-to-end latencies (seconds) of the callers answered after the first ``since``
        (those still in the window), and the new count to pass next time (``TunableTarget``)."""
        with self._guard:
            return self.ledger.latency.since(since)

    def set_batch_limit(self, size: int) -> None:
        """Set ``max_batch_size`` (``TunableTarget``).

        Raises:
            ValueError: ``size`` is not an int >= 1 (a limit of 0 would never dispatch).
        """
        _check_positive_int("max_batch_size", size)
        with self._guard:
            if self.former.max_batch_size == size:
                return  # a tuner's step that keeps the size wakes nobody
            self.former.max_batch_size = size
        self._limit_changed()

    def _limit_changed(self) -> None:
        """``max_batch_size`` changed: have the driver ask the former again (a group that holds
        the new, smaller limit is due now, not when the oldest item's wait is up)."""

    def _key_and_cost(self, item: Any, priority: int, deadline_ms: float | None) -> tuple[Hashable, float]:
        """Check a submit's arguments; the item's group key and cost (no guard needed)."""
        if deadline_ms is not None or type(priority) is not int:
            check_put_args(priority, deadline_ms)
        if self.group_by is not None or self.size_fn is not None:
            return item_key_and_cost(item, self.group_by, self.size_fn)
        return None, 1

    def _admit(
        self, entry: QueueEntry[Any], priority: int, deadline_ms: float | None, key: Hashable, cost: float
    ) -> tuple[Sequence[Drop], bool] | None:
        """Admit ``entry`` through the former (guard held): the entries evicted for it and
        whether the plan changed, or None when a ``"block"`` queue has no room (nothing done).

        Raises:
            BatcherClosed, CircuitOpen, QueueFull: refused (counted).
        """
        if self._closing:
            raise BatcherClosed(f"{self.name}: the batcher is closed; create a new one to submit")
        now = self._now()
        if self.circuit_breaker is not None:
            try:
                self.circuit_breaker.check(now)
            except CircuitOpen:
                self.ledger.refused()
                raise
        core = self._core
        if self._block and core.depth >= core.maxsize:
            return None
        try:
            added = self.former.add(entry, now, priority, deadline_ms, key, cost)
        except QueueFull:
            self.ledger.refused()
            raise
        self.ledger.admitted(now)
        return added

    def _admit_plain(self, entry: QueueEntry[Any]) -> tuple[Sequence[Drop], bool]:
        """:meth:`_admit` for the common case (guard held, the shell ``_plain``, not closing,
        priority 0, no deadline, not the first submit): nothing to check but room."""
        now = self._now()
        try:
            added = self.former.add(entry, now)
        except QueueFull:
            self.ledger.refused()
            raise
        self.ledger.admitted(now)
        return added

    def _enqueue(
        self, entry: Any, priority: int, deadline_ms: float | None, key_cost: tuple[Hashable, float] | None = None
    ) -> bool:
        """Admit ``entry`` (the shell's own way); False, nothing done, when a ``"block"`` queue
        has no room. ``key_cost``: its group key and cost, when the caller computed them."""
        raise NotImplementedError

    async def _enqueue_when_room(
        self, entry: Any, priority: int, deadline_ms: float | None, timeout: float | None
    ) -> None:
        """Admit ``entry`` into a ``"block"`` queue from async code, awaiting room (woken by the
        queue as slots free, see :meth:`BoundedQueue.await_room`) for up to ``timeout`` seconds.

        Raises:
            QueueFull: no room within ``timeout`` (counted).
            BatcherClosed, CircuitOpen, TypeError, ValueError: refused.
        """
        key_cost = self._key_and_cost(entry.item, priority, deadline_ms)  # once, however long it waits
        waited = False
        try:
            with anyio.move_on_after(timeout):
                while not self._enqueue(entry, priority, deadline_ms, key_cost):
                    waited = True
                    await self.queue.await_room()
                return
        except (BatcherClosed, CircuitOpen):
            if waited:  # this writer may have taken a wake-up meant for room: pass it on
                self.queue.wake_room_waiters()
            raise
        raise self._no_room(timeout)

    def _no_room(self, timeout: float | None) -> QueueFull:
        """A writer waited ``timeout`` seconds for room in vain: count it, and the error to raise."""
        with self._guard:
            self.ledger.refused()
            self._core.count_rejection()
        return QueueFull(f"{self.name}: no room in the queue within timeout={timeout!r} s")

    def _settle(self, batch: FormedBatch[Any], reqs: list[Any], results: Any, exc: BaseException | None) -> Settled:
        """The batch function returned ``results`` for ``reqs`` (or raised ``exc``): answer them
        through the ledger and return the entries to wake and whether the call succeeded, or the
        ledger's :class:`~batchkit.dynamic.ledger.Split`, whose halves the shell calls next. A
        malformed return fails the call (:class:`BatchSizeMismatch`); per-item exceptions in
        the results fail only their callers. A batch abandoned meanwhile (timed out, closed) had
        its callers answered by whoever abandoned it: nothing is done."""
        if batch.abandoned:
            return [], False
        if exc is not None:
            oom = is_out_of_memory(exc)
            if oom and self.controller is not None:
                with self._guard:
                    self.former.on_oom(len(reqs), self._now())
            verdict = self.ledger.after_error(reqs, exc, oom=oom)
            if isinstance(verdict, Split):
                return verdict
            error: BaseException | None = exc
        else:
            error = malformed_results(self.name, results, len(reqs))
            if error is None and not isinstance(results, list | tuple):
                results, error = _rows(self.name, results, len(reqs))
        return self._answer(reqs, results, error), error is None

    def _answer(self, reqs: Sequence[Any], results: Any, error: BaseException | None) -> list[Any]:
        """Answer ``reqs`` with ``results`` or ``error`` (those not answered yet): the entries to
        wake. Their latencies go to the controller."""
        with self._guard:
            now = self._now()
            if error is None:
                answered, latencies = self.ledger.answer(reqs, results, now)
            else:
                answered, latencies = self.ledger.fail(reqs, error, now)
            if latencies:
                self.former.observe_latencies(latencies, now)
        return answered

    def _fail(self, reqs: Sequence[Any], error: BaseException) -> None:
        """Fail the callers of ``reqs`` not answered yet with ``error``, and wake them."""
        self._wake(self._answer(reqs, None, error))

    def _timed_out(self) -> BatchTimeout:
        return BatchTimeout(f"{self.name}: batch function ran past batch_timeout_s={self.batch_timeout_s}")

    def _cut_off(self, timeout: float | None) -> tuple[list[Any], list[Drop]]:
        """(guard held) close's ``timeout`` passed with batches still running: fail their callers
        with :class:`BatcherClosed` (those of a batch no driver started yet count as cancelled:
        none of it ran), free their slots, and take the items still waiting. The entries to
        wake, and the drops to resolve as closed."""
        closed = BatcherClosed(self._cut_off_message(timeout))
        now = self._now()
        woken: list[Any] = []
        for b in list(self.former.running):
            b.abandoned = True
            self.former.complete(b)
            if b.runner is None:
                woken += self.ledger.abandon(b.entries, closed)
            else:
                failed, latencies = self.ledger.fail(b.entries, closed, now)
                if latencies:
                    self.former.observe_latencies(latencies, now)
                woken += failed
        return woken, [(e, closed) for e in self.former.drain(now)]

    def _cut_off_message(self, timeout: float | None) -> str:
        return (
            f"{self.name}: closed with timeout={timeout!r}; this batch was still running or waiting at the "
            "deadline and was cancelled"
        )

    def _wake(self, entries: list[Any]) -> None:
        """Hand each answered entry its ``value`` or ``error`` (the shell's own way)."""
        raise NotImplementedError

    def _on_drop(self, entry: QueueEntry[Any], exc: BaseException) -> None:
        self._resolve_drops([(entry, exc)])

    def _resolve_drops(self, drops: Sequence[Drop], *, closing: bool = False) -> None:
        """Answer requests that left the queue without running (expired, evicted, closed)."""
        if not drops:
            return
        with self._guard:
            claimed = self.ledger.drop(drops, closing=closing)
        self._wake(claimed)

    async def aclose(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting work and finish it (each shell's own way)."""
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def statistics(self) -> BatcherStatistics:
        """A snapshot of counters, batch sizes, flush reasons and latency percentiles."""
        former = self.former
        with self._guard:
            queue = self._core.statistics()
            ledger = self.ledger
            return BatcherStatistics(
                pending=self._core.depth,
                in_flight=sum(b.info.size for b in former.running),
                submitted=ledger.submitted,
                succeeded=ledger.succeeded,
                failed=ledger.failed,
                cancelled=ledger.cancelled,
                expired=ledger.expired,
                rejected=ledger.rejected,
                batches=former.batches,
                mean_batch_size=former.batched_items / former.batches if former.batches else 0.0,
                batch_size_histogram=dict(sorted(former.sizes.items())),
                flush_reasons=dict(former.reasons),
                queue_wait=queue.wait,
                latency=ledger.latency.summary(),
                batch_time=self._batch_time.summary(),
                throughput_rps=ledger.throughput_rps(),
                running_batches=len(former.running),
                queue_wait_recent=queue.wait_recent,
                latency_recent=ledger.latency.recent(),
                batch_time_recent=self._batch_time.recent(),
            )

    def recent_batches(self) -> list[BatchInfo]:
        """The last 64 batches dispatched (size, cost, group key, flush reason), oldest first."""
        with self._guard:
            return list(self.former.recent)

    def __repr__(self) -> str:
        state = "closed" if self._closing else "open"
        return (
            f"<{type(self).__name__} {self.name} {state} pending={self._core.depth} "
            f"in_flight={len(self.former.running)} max_batch_size={self.max_batch_size} "
            f"max_wait_ms={self.max_wait_ms:g}>"
        )


class DynamicBatcher(BatcherShell[T, R]):
    """Collects items from many callers into batches for one batch function.

    Args:
        fn: ``fn(items: list[T]) -> Sequence[R]`` (sync, run in a worker thread) or an
            ``async def`` equivalent (run on the batcher's event loop thread). Return one result
            per item, in order; an :class:`Exception` in a slot fails only that item's caller.
        max_batch_size: most items per batch (>= 1).
        max_wait_ms: longest the oldest waiting item waits for company before its batch is
            dispatched (>= 0; 0 dispatches whatever is waiting as soon as a slot is free).
        queue: a :class:`BoundedQueue` to admit through (its capacity and ``on_full`` apply);
            default ``BoundedQueue(max_queue, on_full)``.
        max_queue: capacity of the default queue.
        on_full: policy of the default queue (see :class:`BoundedQueue`).
        max_concurrent_batches: batches that may run at once (>= 1).
        size_fn: cost of one item (tokens, rows, bytes); with ``max_batch_cost``, a batch never
            exceeds that total (an item costlier than the limit runs alone).
        max_batch_cost: cost limit per batch (needs ``size_fn``).
        group_by: ``key(item) -> Hashable``; items with different keys never share a batch.
        isolate_errors: when the batch function raises, split the batch and retry the halves so
            that only the failing items' callers see the error.
        batch_timeout_s: fail a batch's callers with :class:`BatchTimeout` if the function runs
            longer than this (the stuck call is abandoned, its slot replaced).
        controller: an :class:`~batchkit.AdaptiveBatchController` that sets ``max_batch_size``
            before each batch from the queue depth and the callers' latencies, and lowers its
            ceiling when the batch function runs out of memory.
        circuit_breaker: a :class:`~batchkit.CircuitBreaker`: after repeated failing batches,
            submits fail fast with :class:`~batchkit.CircuitOpen` until one probe batch succeeds.

        A batch function that runs out of memory (``MemoryError``, ``torch.cuda.OutOfMemoryError``)
        has its batch split in halves and retried, down to single items.
        clock: time source (tests pass :class:`batchkit.testing.MockClock`).
        name: shown in ``repr`` and thread names.

    Raises:
        ValueError: a size that is not an int >= 1, a ``max_wait_ms`` that is not a number >= 0,
            a ``max_batch_cost`` or ``batch_timeout_s`` that is not a number > 0,
            ``max_batch_cost`` without ``size_fn``, a ``queue`` that already serves another
            batcher or has an ``on_drop`` of its own, or a ``queue`` together with a
            ``max_queue`` or ``on_full`` other than the default, or with a ``clock`` other than its
            own (see :func:`check_batcher_options`).
        TypeError: ``fn``, ``size_fn`` or ``group_by`` is not callable, ``queue`` is not a
            :class:`BoundedQueue`, ``controller`` not an :class:`~batchkit.AdaptiveBatchController`,
            ``circuit_breaker`` not a :class:`~batchkit.CircuitBreaker`, or ``clock`` has no
            ``now()``.
    """

    def __init__(
        self,
        fn: BatchFn[T, R],
        *,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        queue: BoundedQueue[Any] | None = None,
        max_queue: int = 4096,
        on_full: OnFull = "reject",
        max_concurrent_batches: int = 1,
        size_fn: Callable[[T], float] | None = None,
        max_batch_cost: float | None = None,
        group_by: Callable[[T], Hashable] | None = None,
        isolate_errors: bool = False,
        batch_timeout_s: float | None = None,
        controller: AdaptiveBatchController | None = None,
        circuit_breaker: CircuitBreaker | None = None,
        clock: Clock | None = None,
        name: str | None = None,
    ) -> None:
        options: BatcherOptions = {
            "queue": queue,
            "max_queue": max_queue,
            "on_full": on_full,
            "max_concurrent_batches": max_concurrent_batches,
            "size_fn": size_fn,
            "max_batch_cost": max_batch_cost,
            "group_by": group_by,
            "isolate_errors": isolate_errors,
            "batch_timeout_s": batch_timeout_s,
            "controller": controller,
            "circuit_breaker": circuit_breaker,
            "clock": clock,
            "name": name,
        }
        super().__init__(fn, max_batch_size, max_wait_ms, options, locked=True)
        self._is_async = is_async_callable(fn)
        self._mutex = self.queue.mutex
        self._threads = BatchThreads(
            self.name,
            self.former,
            self._mutex,
            self.clock,
            max_concurrent_batches,
            run=self._run_batch,
            resolve_drops=self._resolve_drops,
            timed_out=self._on_timeout,
        )
        self._loop_thread = LoopThread()  # where an async def batch function runs
        self._closed = False

    # ------------------------------------------------------------------ submitting

    def submit(
        self,
        item: T,
        *,
        priority: int = 0,
        deadline_ms: float | None = None,
        fallback: Any = _NO_FALLBACK,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[R]:
        """Queue ``item`` from any thread; return a future for its result.

        Args:
            priority: lower is served first.
            deadline_ms: if the item is still waiting this long after submit, it leaves the queue
                and the future fails with :class:`DeadlineExceeded` (or resolves to ``fallback``).
            fallback: value to resolve with instead of failing on deadline expiry.
            timeout: with ``on_full="block"``, seconds to wait for room in the queue.

        Cancelling the future before its batch is dispatched removes the item.

        Raises:
            BatcherClosed: after :meth:`close`.
            QueueFull: the queue refused the item.
        """
        fut: concurrent.futures.Future[R] = concurrent.futures.Future()
        req = _Request(item, fut, fallback)
        self._enqueue_sync(req, priority, deadline_ms, timeout)
        fut.add_done_callback(lambda f: self._future_cancelled(req) if f.cancelled() else None)
        return fut

    def __call__(
        self,
        item: T,
        *,
        priority: int = 0,
        deadline_ms: float | None = None,
        fallback: Any = _NO_FALLBACK,
        timeout: float | None = None,
    ) -> R:
        """Submit ``item`` and block this thread until its result is ready; the arguments and
        errors of :meth:`submit`, raised here."""
        waiter = ThreadWaiter()
        req = _Request(item, waiter, fallback)
        self._enqueue_sync(req, priority, deadline_ms, timeout)
        try:
            waiter.wait()
        except BaseException:  # KeyboardInterrupt while parked: give the item up
            self._cancel(req)
            raise
        return req.outcome()  # type: ignore[no-any-return]

    async def asubmit(
        self,
        item: T,
        *,
        priority: int = 0,
        deadline_ms: float | None = None,
        fallback: Any = _NO_FALLBACK,
        timeout: float | None = None,
    ) -> R:
        """Queue ``item`` from async code (asyncio or trio) and await its result.

        Cancelling the awaiting task removes the item if its batch has not been dispatched yet,
        and discards its result otherwise. Same arguments and errors as :meth:`submit`.
        """
        check_timeout(timeout)
        waiter = new_async_waiter()
        req = _Request(item, waiter, fallback)
        if self._block:
            await self._enqueue_when_room(req, priority, deadline_ms, timeout)
        else:
            self._enqueue(req, priority, deadline_ms)
        try:
            await waiter
        except BaseException:
            self._cancel(req)
            raise
        return req.outcome()  # type: ignore[no-any-return]

    def _enqueue(
        self,
        req: _Request,
        priority: int,
        deadline_ms: float | None,
        key_cost: tuple[Hashable, float] | None = None,
    ) -> bool:
        """Admit ``req`` through the former; False (nothing done) when a ``"block"`` queue has
        no room, so that the caller waits for some.

        Raises:
            BatcherClosed, CircuitOpen, QueueFull, TypeError, ValueError: refused.
        """
        plain = priority == 0 and deadline_ms is None
        key: Hashable = None
        cost: float = 1
        if not plain or not self._plain:
            # group_by and size_fn run once for a writer that waits for room (it passes key_cost)
            key, cost = key_cost if key_cost is not None else self._key_and_cost(req.item, priority, deadline_ms)
        with self._mutex:
            if plain and self._plain and not self._closing and self._threads.dispatcher is not None:
                drops, replan = self._admit_plain(req)
            else:
                added = self._admit(req, priority, deadline_ms, key, cost)
                if added is None:
                    return False
                drops, replan = added
                if self._threads.dispatcher is None:
                    self._threads.start()
                    replan = False  # the new dispatcher asks the former first thing
            if replan:  # the arrival changes the plan (see BatchFormer.add)
                drops = [*drops, *self._threads.dispatch_due()]
        if drops:
            self._resolve_drops(drops)
        return True

    def _enqueue_sync(self, req: _Request, priority: int, deadline_ms: float | None, timeout: float | None) -> None:
        check_timeout(timeout)
        if not self._block:
            self._enqueue(req, priority, deadline_ms)
            return
        key_cost = self._key_and_cost(req.item, priority, deadline_ms)  # once, however long it waits
        deadline = None if timeout is None else _monotonic() + timeout
        waited = False
        try:
            while not self._enqueue(req, priority, deadline_ms, key_cost):
                waited = True
                left = None if deadline is None else deadline - _monotonic()
                if left is not None and left <= 0:
                    raise self._no_room(timeout)
                self.queue.wait_for_room(left)
        except (BatcherClosed, CircuitOpen):
            if waited:  # this writer may have taken a wake-up meant for room: pass it on
                self.queue.wake_room_waiters()
            raise

    def _cancel(self, req: _Request) -> None:
        """The caller gave up: drop its item if still queued, else let its result be discarded."""
        with self._mutex:
            self._cancel_locked(req)

    def _cancel_locked(self, req: _Request) -> None:
        phase = req.phase
        if phase is _QUEUED:
            self._core.cancel(req)  # out of the queue (LEFT); the ledger counts it cancelled
        elif phase is not _WAITING and phase is not _RUNNING:
            return  # answered, or left unserved: the drop that took it out answers it
        # Taken or running, its result will find no one waiting.
        self.ledger.cancel(req)

    def _future_cancelled(self, req: _Request) -> None:
        """A submit's Future was cancelled: give the item up, and move the Future on to "cancelled
        and notified", as an executor does, so that ``concurrent.futures.wait()`` and
        ``as_completed()`` count it as done (they wait for that notification, which only
        ``set_running_or_notify_cancel()`` sends). Unless a worker already called it, as it
        does for each Future of a batch it starts."""
        with self._mutex:
            self._cancel_locked(req)
            if req.notified:
                return
            req.notified = True
        req.sink.set_running_or_notify_cancel()

    # ------------------------------------------------------------------ controls

    def _limit_changed(self) -> None:
        with self._mutex:
            self._threads.wake()

    def flush(self) -> None:
        """Dispatch everything waiting now without waiting for ``max_wait_ms``."""
        with self._mutex:
            self.former.flush()
            self._threads.wake()

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting work, then finish it: with ``drain`` (the default) every waiting item is
        dispatched (behind an open circuit breaker: fails with :class:`CircuitOpen`, see
        :meth:`BatchFormer.expire`); without, waiting items fail with :class:`BatcherClosed`. Joins all threads,
        waiting at most ``timeout`` seconds in all (one deadline, however many threads).

        If the deadline passes with batches still running, close returns anyway. A sync batch
        function cannot be interrupted: its callers are answered when (if) it returns, and the
        items still waiting run after it. Calls of an async batch function are cancelled at the
        deadline, and their callers and those of the items still waiting fail with
        :class:`BatcherClosed`. Idempotent; a ``close(drain=False)`` while an earlier ``close()``
        drains fails the items still waiting at once.

        Called from the batch function itself (a worker thread, or the event loop of an ``async
        def``), it closes without waiting for the threads (one of them is the caller); a later
        ``close()`` from elsewhere joins them.
        """
        with self._mutex:
            if self._closed:
                return
            drops: list[Drop] = []
            if not drain:  # also while an earlier close() drains: what waits fails now
                drops = [
                    (e, BatcherClosed(f"{self.name}: closed before this item ran"))
                    for e in self.former.drain(self.clock.now())
                ]
            if not self._closing:
                self._closing = True
                self.former.close()
                self._threads.wake()
        self._resolve_drops(drops, closing=True)
        self.queue.wake_room_waiters()  # writers blocked on a full "block" queue get BatcherClosed now
        current = threading.current_thread()
        # From the batch function itself (a worker, or the event loop of an async def): the
        # threads cannot be waited for (one of them is the caller).
        inside = self._threads.owns(current) or current is self._loop_thread.thread
        if not inside:
            stuck = self._threads.join(timeout)
            if stuck and self._is_async:
                self._abandon_at_close(timeout)
            self._stop_portal(cancel_running=stuck, timeout=timeout)
            self._closed = True

    def _abandon_at_close(self, timeout: float | None) -> None:
        """close(timeout=...) passed its deadline with calls of the ``async def`` batch function
        still running: answer every caller now, before close returns (see :meth:`_cut_off`).
        The workers, when the stopped portal ends their calls, find every caller answered."""
        with self._mutex:
            woken, waiting = self._cut_off(timeout)
            self._threads.wake()  # the dispatcher sees the end
        self._wake(woken)
        self._resolve_drops(waiting, closing=True)

    def _stop_portal(self, *, cancel_running: bool, timeout: float | None) -> None:
        """End the event loop thread of an async batch function. With ``cancel_running``, the
        calls still running past close's deadline are cancelled (their callers get
        :class:`BatcherClosed`) rather than waited for."""
        self._loop_thread.stop(
            self._cut_off_message(timeout) if cancel_running else f"{self.name}: the batcher is closed",
            cancel_running=cancel_running,
        )

    async def aclose(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """:meth:`close` from async code (runs in a worker thread, the event loop stays free)."""
        if threading.current_thread() is self._loop_thread.thread:
            # From the async batch function: the close cannot wait for its own loop (see close).
            self.close(drain=drain, timeout=timeout)
            return
        await anyio.to_thread.run_sync(lambda: self.close(drain=drain, timeout=timeout))

    def __enter__(self) -> DynamicBatcher[T, R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ running batches

    def _on_timeout(self, batch: _Batch) -> None:
        """``batch`` ran past ``batch_timeout_s``: its callers fail; an ``async def``'s call is
        cancelled (a plain one cannot be)."""
        self._fail(batch.entries, self._timed_out())
        if batch.call is not None:
            batch.call.cancel()

    def _run_batch(self, batch: _Batch) -> None:
        reqs = batch.entries
        # Under the lock: against _future_cancelled (a Future is marked running or notified once),
        # and so that _abandon_at_close knows whether this batch started.
        with self._mutex:
            batch.runner = threading.current_thread()
            for r in reqs:
                sink = r.sink
                if r.phase is _WAITING and isinstance(sink, concurrent.futures.Future):
                    r.notified = True
                    if not sink.set_running_or_notify_cancel():
                        self.ledger.cancel(r)  # cancelled just now; _future_cancelled finds it final
            live = self.ledger.start(reqs)
        if not live:
            with self._mutex:
                self.former.record(batch, 0, 0.0, True, self._now())
            return
        t0 = self.clock.now()
        held: list[_Request] = []
        ok = self._call_and_deliver(batch, live, held)
        with self._mutex:
            now = self.clock.now()
            self._batch_time.add(now - t0)
            self.former.record(batch, len(live), now - t0, ok, now)
        if not ok and self._block and self.circuit_breaker is not None:
            # The failure may have opened the breaker: writers waiting for room fail fast now.
            self.queue.wake_room_waiters()
        # Wake the last callers only now, so that one who saw this batch fail and submits again
        # meets the breaker in the state that failure put it in.
        self._wake(held)

    def _call(self, batch: _Batch, items: list[Any]) -> Any:
        if not self._is_async:
            return self.fn(items)

        def started(call: concurrent.futures.Future[Any]) -> None:
            batch.call = call
            if batch.abandoned:  # timed out before its call was known: the dispatcher could not cancel it
                call.cancel()

        return self._loop_thread.run(self.fn, items, started)

    def _call_and_deliver(self, batch: _Batch, reqs: list[_Request], held: list[_Request] | None) -> bool:
        """Run the batch function (split and retried as the ledger says) and answer the callers;
        False if a call failed. The answered requests of the last call go to ``held`` (not woken)
        when it is given."""
        stopped = self._loop_thread.stopped
        if stopped is not None and self._is_async:
            # close(timeout=...) stopped the event loop of the async batch function before this
            # batch could start: its callers are answered as closed before they ran.
            with self._mutex:
                settled: Settled = self.ledger.abandon(reqs, BatcherClosed(stopped)), False
        else:
            try:
                results, exc = self._call(batch, [r.item for r in reqs]), None
            except BaseException as raised:  # noqa: BLE001 - every failure goes to the callers
                results, exc = None, raised
            settled = self._settle(batch, reqs, results, exc)
        if isinstance(settled, Split):
            first = self._call_and_deliver(batch, settled.first, None)
            return self._call_and_deliver(batch, settled.second, held) and first
        answered, ok = settled
        if held is not None:
            held.extend(answered)
        else:
            self._wake(answered)
        return ok

    def _wake(self, reqs: list[_Request]) -> None:
        waiters = []
        for r in reqs:
            sink = r.sink
            if isinstance(sink, concurrent.futures.Future):
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    if r.error is not None:
                        sink.set_exception(r.error)
                    else:
                        sink.set_result(r.value)
            else:
                waiters.append(sink)
        if waiters:
            wake_all(waiters)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def is_async_callable(fn: object) -> bool:
    """Whether calling ``fn`` returns an awaitable (``async def``, a partial of one, or an object
    whose ``__call__`` is ``async def``)."""
    while hasattr(fn, "func"):  # functools.partial
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def item_key_and_cost(
    item: Any, group_by: Callable[[Any], Hashable] | None, size_fn: Callable[[Any], float] | None
) -> tuple[Hashable, float]:
    """An item's group key (``group_by``; None without) and cost (``size_fn``; 1 without).

    Raises:
        TypeError: ``group_by`` returned an unhashable key.
        ValueError: ``size_fn`` returned a cost that is not a finite number >= 0.
    """
    key: Hashable = None
    cost: float = 1
    if group_by is not None:
        key = group_by(item)
        try:
            hash(key)
        except TypeError:
            raise TypeError(
                f"group_by returned an unhashable key {key!r}; return a hashable value "
                "(a tuple, str or int) that names the item's group"
            ) from None
    if size_fn is not None:
        cost = size_fn(item)
        if not is_cost(cost):
            raise ValueError(f"size_fn must return a cost >= 0 (a finite number), got {cost!r}")
    return key, cost


def malformed_results(name: str, results: object, n: int) -> BatchSizeMismatch | None:
    """The error for a batch function's return value that is not ``n`` results in a sequence
    (or an array), or None when it is well formed."""
    if isinstance(results, (str, bytes)) or (not isinstance(results, Sequence) and not _is_array(results)):
        what = type(results).__name__
        if getattr(results, "shape", None) == ():
            what = f"a 0-d {what} (one value for the whole batch)"
        elif hasattr(results, "columns"):
            what += " (a table iterates over its columns: return its rows, e.g. df.to_dict('records'))"
        return BatchSizeMismatch(
            f"{name} returned {what}, not a sequence; a batch function must return one result per input, in order"
        )
    if len(results) != n:  # type: ignore[arg-type]
        return BatchSizeMismatch(
            f"{name} returned {len(results)} results for a batch of {n}; "  # type: ignore[arg-type]
            "return exactly one result per input, in order"
        )
    return None


def _rows(name: str, results: Any, n: int) -> tuple[list[Any] | None, BatchSizeMismatch | None]:
    """An array's (or other sequence's) results as a list, read before any caller is answered:
    one whose iteration fails or yields another count than its length fails the batch's callers
    instead of the thread answering them."""
    try:
        rows = list(results)
    except Exception as exc:  # noqa: BLE001 - a broken result type is the batch function's error
        return None, BatchSizeMismatch(f"{name} returned a {type(results).__name__} that could not be read: {exc!r}")
    if len(rows) != n:
        return None, BatchSizeMismatch(
            f"{name} returned a {type(results).__name__} of length {n} that iterates over {len(rows)} results; "
            "return a list of one result per input"
        )
    return rows, None


def _is_array(x: object) -> bool:
    """Whether ``x`` is an array of results, one per row (numpy, torch, a pandas Series...): not a
    0-d array (a single value: it has no length), nor a table whose iteration yields its column
    labels instead of its rows (a pandas DataFrame)."""
    shape = getattr(x, "shape", None)
    if shape is None or not (hasattr(x, "__len__") and hasattr(x, "__getitem__")) or hasattr(x, "columns"):
        return False
    try:
        return len(shape) >= 1
    except TypeError:
        return False

"""BatcherShell: what both batcher shells share around their BatchFormer.

:class:`~batchkit.DynamicBatcher` (threads) and :class:`~batchkit.AsyncBatcher` (one event loop)
differ in how they call the batch function and how they wake callers; everything else is here:
the options (checked once, :func:`check_batcher_options`), the queue, the former and the ledger
they drive, admission (closed, breaker, room, the former) and waiting for room, what a call
answers (``_settle``: the ledger's split-and-retry verdict, malformed results, per-item errors),
the close-deadline cut-off, the counters, ``statistics()`` and the ``TunableTarget`` methods.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypedDict, TypeVar

import anyio
from typing_extensions import Self

from .._clock import Clock
from .._errors import BatcherClosed, BatchTimeout, CircuitOpen, QueueFull
from .._validate import positive_int
from ..control import AdaptiveBatchController, CircuitBreaker, is_out_of_memory
from ..metrics import LatencySummary, SampleWindow
from ._queue_core import Drop, QueueEntry, check_number, check_put_args, check_queue_options, is_cost
from .batch_function import read_results
from .former import BatchFormer, BatchInfo, FormedBatch
from .ledger import Phase, RequestLedger, Split
from .queue import BoundedQueue, OnFull

__all__ = [
    "BatcherOptions",
    "BatcherShell",
    "BatcherStatistics",
    "LedgerEntry",
    "Settled",
    "check_batcher_options",
    "item_key_and_cost",
]

T = TypeVar("T")
R = TypeVar("R")

_QUEUED = Phase.QUEUED

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
    positive_int("max_batch_size", max_batch_size)
    positive_int("max_concurrent_batches", options.get("max_concurrent_batches", 1))
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
        positive_int("max_queue", max_queue)
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
        positive_int("max_batch_size", size)
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
            results, error = read_results(self.name, results, len(reqs))
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

"""DynamicBatcher: many small calls in, few large calls to the model, every caller answered once.

Architecture (see docs/concepts.md):

- Callers (threads or async tasks, on asyncio or trio, mixed) put requests in a
  :class:`~batchkit.BoundedQueue` under one lock and park on a waiter.
- One dispatcher thread decides, from the queue's state and the clock, when a batch is due
  (``max_batch_size`` reached, ``max_wait_ms`` since the *oldest* waiting item, ``flush()``,
  ``close()``), and seals it only when a worker slot is free, so that while the model is busy the
  next batch keeps growing. It also expires deadlines and enforces ``batch_timeout_s``.
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
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from queue import SimpleQueue
from time import monotonic as _monotonic
from typing import Any, Generic, TypedDict, TypeVar

import anyio

from ._clock import Clock
from ._errors import BatcherClosed, BatchSizeMismatch, BatchTimeout, CircuitOpen, QueueFull
from ._waiters import ThreadWaiter, new_async_waiter, wake_all
from .adaptive import AdaptiveBatchController, CircuitBreaker, is_out_of_memory
from .metrics import LatencySummary, SampleWindow
from .queue import _ANY, WAITING, BoundedQueue, OnFull, QueueEntry, _check_put_args, check_queue_options

__all__ = [
    "FLUSH_REASONS",
    "BatchInfo",
    "BatcherOptions",
    "BatcherStatistics",
    "DynamicBatcher",
    "check_batcher_options",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

FLUSH_REASONS = ("size", "cost", "timeout", "flush", "close")
_NO_FALLBACK: Any = object()
_PENDING, _DISPATCHED, _DONE = range(3)


class _Request(QueueEntry[Any]):
    """One caller's item, its place in the queue (it *is* the queue entry) and how to answer it.

    The queue fields (priority, seq, arrival, ...) are filled in when it is admitted.
    """

    __slots__ = ("error", "fallback", "phase", "sink", "value")

    def __init__(self, item: Any, sink: Any, fallback: Any) -> None:
        self.item = item
        self.sink = sink  # concurrent.futures.Future, ThreadWaiter, or an async waiter
        self.fallback = fallback
        self.phase = _PENDING
        self.value: Any = None
        self.error: BaseException | None = None

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


@dataclass(frozen=True, slots=True)
class BatchInfo:
    """How one batch was formed: its size, total cost, group key and why it was flushed."""

    size: int
    cost: float
    key: Hashable
    reason: str


class _Batch:
    __slots__ = ("abandoned", "info", "requests", "started", "thread")

    def __init__(self, requests: list[_Request], info: BatchInfo, started: float) -> None:
        self.requests = requests
        self.info = info
        self.started = started
        self.abandoned = False
        self.thread: threading.Thread | None = None


@dataclass(frozen=True, slots=True)
class BatcherStatistics:
    """A snapshot of a :class:`DynamicBatcher` (latencies in milliseconds)."""

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


def check_batcher_options(fn: object, max_batch_size: int, max_wait_ms: float, options: BatcherOptions) -> None:
    """Raise what ``DynamicBatcher(fn, max_batch_size=..., max_wait_ms=..., **options)`` would
    raise for these arguments, without building a batcher: nothing is started, and a ``queue``
    is checked but not claimed (``@batched`` validates at decoration this way). Missing options
    take their defaults.

    Raises:
        TypeError: ``fn`` is not callable, or an option name is unknown.
        ValueError: a value the batcher refuses (the message names the argument and the fix).
    """
    unknown = options.keys() - _OPTION_NAMES
    if unknown:
        raise TypeError(
            f"unknown batcher option(s) {', '.join(sorted(unknown))}; the options are max_batch_size, "
            f"max_wait_ms, {', '.join(sorted(_OPTION_NAMES))}"
        )
    if not callable(fn):
        raise TypeError(f"fn must be callable (a batch function over a list), got {fn!r}")
    _check_positive_int("max_batch_size", max_batch_size)
    _check_positive_int("max_concurrent_batches", options.get("max_concurrent_batches", 1))
    if not max_wait_ms >= 0:
        raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms!r}")
    size_fn = options.get("size_fn")
    max_batch_cost = options.get("max_batch_cost")
    if max_batch_cost is not None and size_fn is None:
        raise ValueError("max_batch_cost needs size_fn: pass size_fn=lambda item: cost_of(item)")
    if max_batch_cost is not None and not max_batch_cost > 0:
        raise ValueError(f"max_batch_cost must be > 0, got {max_batch_cost!r}")
    batch_timeout_s = options.get("batch_timeout_s")
    if batch_timeout_s is not None and not batch_timeout_s > 0:
        raise ValueError(f"batch_timeout_s must be > 0 or None, got {batch_timeout_s!r}")
    queue = options.get("queue")
    if queue is None:
        max_queue = options.get("max_queue", 4096)
        _check_positive_int("max_queue", max_queue)
        check_queue_options(max_queue, options.get("on_full", "reject"))
    elif queue.on_drop is not None:
        raise ValueError("queue already belongs to a batcher (its on_drop is set); give each its own")


class DynamicBatcher(Generic[T, R]):
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
        ValueError: a non-positive size, negative wait, ``max_batch_cost`` without ``size_fn``, or
            a ``queue`` that already serves another batcher (see :func:`check_batcher_options`).
        TypeError: ``fn`` is not callable.
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
        check_batcher_options(
            fn,
            max_batch_size,
            max_wait_ms,
            {
                "queue": queue,
                "max_queue": max_queue,
                "on_full": on_full,
                "max_concurrent_batches": max_concurrent_batches,
                "size_fn": size_fn,
                "max_batch_cost": max_batch_cost,
                "batch_timeout_s": batch_timeout_s,
            },
        )
        if queue is None:
            queue = BoundedQueue(max_queue, on_full, clock=clock)
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", type(fn).__name__)
        self.max_batch_size = max_batch_size
        self.max_wait_ms = float(max_wait_ms)
        self.max_concurrent_batches = max_concurrent_batches
        self.size_fn = size_fn
        self.max_batch_cost = max_batch_cost
        self.group_by = group_by
        self.isolate_errors = isolate_errors
        self.controller = controller
        self.circuit_breaker = circuit_breaker
        if controller is not None:
            self.max_batch_size = controller.batch_size
        self._manual = False  # set by batchkit.sim: the cores are driven without threads
        self.batch_timeout_s = batch_timeout_s
        self.clock: Clock = clock if clock is not None else queue.clock
        self._now = self.clock.now
        self.queue: BoundedQueue[_Request] = queue
        queue.on_drop = self._on_drop
        self._is_async = _is_async_callable(fn)
        self._mutex = queue._mutex
        self._cond = threading.Condition(self._mutex)
        self._work: SimpleQueue[_Batch | None] = SimpleQueue()
        self._dispatcher: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        self._portal_cm: Any = None
        self._portal: Any = None
        self._portal_lock = threading.Lock()
        self._portal_stopped: str | None = None  # why: no async batch may start after close stopped it
        self._recent: deque[BatchInfo] = deque(maxlen=64)
        self._running: list[_Batch] = []
        self._closing = False
        self._closed = False
        self._flush_seq = 0
        self._wake_at: float | None = None
        self._dispatcher_idle = False
        # statistics
        self._submitted = 0
        self._succeeded = 0
        self._failed = 0
        self._cancelled = 0
        self._expired = 0
        self._rejected = 0
        self._batches = 0
        self._batch_items = 0
        self._sizes: Counter[int] = Counter()
        self._reasons: Counter[str] = Counter()
        self._latency = SampleWindow()
        self._batch_time = SampleWindow()
        self._t_first: float | None = None
        self._t_last = 0.0

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
        fut.add_done_callback(lambda f: self._cancel(req) if f.cancelled() else None)
        return fut

    def __call__(self, item: T, *, priority: int = 0, deadline_ms: float | None = None) -> R:
        """Submit ``item`` and block this thread until its result is ready."""
        waiter = ThreadWaiter()
        req = _Request(item, waiter, _NO_FALLBACK)
        self._enqueue_sync(req, priority, deadline_ms, None)
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
        waiter = new_async_waiter()
        req = _Request(item, waiter, fallback)
        if self.queue.on_full == "block":
            await self._enqueue_async_blocking(req, priority, deadline_ms, timeout)
        else:
            self._enqueue(req, priority, deadline_ms)
        try:
            await waiter
        except BaseException:
            self._cancel(req)
            raise
        return req.outcome()  # type: ignore[no-any-return]

    def _prepare(self, req: _Request) -> tuple[Hashable, float]:
        key: Hashable = None
        cost: float = 1
        if self.group_by is not None:
            key = self.group_by(req.item)
            try:
                hash(key)
            except TypeError:
                raise TypeError(
                    f"group_by returned an unhashable key {key!r}; return a hashable value "
                    "(a tuple, str or int) that names the item's group"
                ) from None
        if self.size_fn is not None:
            cost = self.size_fn(req.item)
            if not cost >= 0:
                raise ValueError(f"size_fn must return a cost >= 0, got {cost!r}")
        return key, cost

    def _enqueue(self, req: _Request, priority: int, deadline_ms: float | None) -> None:
        if self.group_by is not None or self.size_fn is not None:
            key, cost = self._prepare(req)
        else:
            key, cost = None, 1
        if deadline_ms is not None or type(priority) is not int:
            _check_put_args(priority, deadline_ms)
        q = self.queue
        with self._mutex:
            if self._closing:
                raise BatcherClosed(f"{self.name}: the batcher is closed; create a new one to submit")
            if self.circuit_breaker is not None:
                try:
                    self.circuit_breaker.check()
                except CircuitOpen:
                    self._rejected += 1
                    raise
            drops: list[tuple[QueueEntry[Any], BaseException]] = []
            if q._depth >= q.maxsize:
                try:
                    drops = q._admit(priority)
                except QueueFull:
                    self._rejected += 1
                    raise
            now = self._now()
            req.priority = priority
            req.arrival = now
            req.deadline = None if deadline_ms is None else now + deadline_ms / 1e3
            req.key = key
            req.cost = cost
            req.state = WAITING
            q._seq += 1
            req.seq = q._seq
            was_empty = q._depth == 0
            q._push(req)
            self._submitted += 1
            if self._t_first is None:
                self._t_first = now
            if self._manual:
                pass
            elif self._dispatcher is None:
                self._start()
            elif self._dispatcher_idle:
                # Wake the dispatcher only when this arrival changes its plan: a first item starts
                # the wait clock, a full group is due now, an earlier deadline moves the wake-up.
                load = q._key_counts[key]
                if (
                    was_empty
                    or drops
                    or load[0] >= self.max_batch_size
                    or (self.max_batch_cost is not None and load[1] >= self.max_batch_cost)
                    or (req.deadline is not None and (self._wake_at is None or req.deadline < self._wake_at))
                ):
                    self._dispatcher_idle = False
                    self._cond.notify()
        if drops:
            self._resolve_drops(drops)

    def _enqueue_sync(self, req: _Request, priority: int, deadline_ms: float | None, timeout: float | None) -> None:
        if self.queue.on_full != "block":
            self._enqueue(req, priority, deadline_ms)
            return
        deadline = None if timeout is None else _monotonic() + timeout
        while True:
            try:
                self._enqueue(req, priority, deadline_ms)
                return
            except QueueFull:
                with self._mutex:
                    self._rejected -= 1  # not a rejection yet: we wait for room
                    if self.queue._depth < self.queue.maxsize:
                        continue
                    waiter = ThreadWaiter()
                    self.queue._space_waiters.append(waiter)
                remaining = None if deadline is None else deadline - _monotonic()
                if (remaining is not None and remaining <= 0) or not waiter.wait(remaining):
                    self.queue._abandon(self.queue._space_waiters, waiter)
                    with self._mutex:
                        self._rejected += 1
                    raise QueueFull(f"{self.name}: no room in the queue within timeout={timeout!r} s") from None

    async def _enqueue_async_blocking(
        self, req: _Request, priority: int, deadline_ms: float | None, timeout: float | None
    ) -> None:
        with anyio.move_on_after(timeout) as scope:
            while True:
                try:
                    self._enqueue(req, priority, deadline_ms)
                    return
                except QueueFull:
                    with self._mutex:
                        self._rejected -= 1
                        if self.queue._depth < self.queue.maxsize:
                            continue
                        waiter = new_async_waiter()
                        self.queue._space_waiters.append(waiter)
                try:
                    await waiter
                except BaseException:
                    self.queue._abandon(self.queue._space_waiters, waiter)
                    raise
        if scope.cancelled_caught:
            with self._mutex:
                self._rejected += 1
            raise QueueFull(f"{self.name}: no room in the queue within timeout={timeout!r} s")

    def _cancel(self, req: _Request) -> None:
        """The caller gave up: drop its item if still queued, else let its result be discarded."""
        with self._mutex:
            if req.phase == _DONE:
                return
            if self.queue._cancel(req):
                req.phase = _DONE
                self._cancelled += 1
            elif req.phase == _DISPATCHED:
                # Its batch runs; the result will find no one waiting and is dropped.
                req.phase = _DONE
                self._cancelled += 1

    # ------------------------------------------------------------------ controls

    def flush(self) -> None:
        """Dispatch everything waiting now without waiting for ``max_wait_ms``."""
        with self._mutex:
            self._flush_seq = self.queue._seq
            self._dispatcher_idle = False
            self._cond.notify()

    def close(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting work, then finish it: with ``drain`` (the default) every waiting item is
        dispatched; without, waiting items fail with :class:`BatcherClosed`. Joins all threads,
        waiting at most ``timeout`` seconds in all (one deadline, however many threads).

        If the deadline passes with batches still running, close returns anyway. A sync batch
        function cannot be interrupted: its callers are answered when (if) it returns, and the
        items still waiting run after it. Calls of an async batch function are cancelled at the
        deadline, and their callers and those of the items still waiting fail with
        :class:`BatcherClosed`. Idempotent: a second call returns at once.
        """
        with self._mutex:
            if self._closed:
                return
            self._closing = True
            drops: list[tuple[QueueEntry[_Request], BaseException]] = []
            if not drain:
                while True:
                    taken = self.queue._take(self.queue.maxsize, self.clock.now())
                    if not taken:
                        break
                    drops += [(e, BatcherClosed(f"{self.name}: closed before this item ran")) for e in taken]
            self._dispatcher_idle = False
            self._cond.notify_all()
            dispatcher = self._dispatcher
        self._resolve_drops(drops, count_as="cancelled")
        current = threading.current_thread()
        inside = current is dispatcher or current in self._workers  # close() from the batch function
        stuck = False
        if dispatcher is not None and not inside:
            # One deadline for every join: close(timeout=t) returns after about t, not t per thread.
            deadline = None if timeout is None else _monotonic() + timeout
            for t in [dispatcher, *self._workers]:
                t.join(None if deadline is None else max(0.0, deadline - _monotonic()))
                stuck = stuck or t.is_alive()
        if not inside:
            self._stop_portal(cancel_running=stuck, timeout=timeout)
        self._closed = True

    def _stop_portal(self, *, cancel_running: bool, timeout: float | None) -> None:
        """End the event loop thread of an async batch function. With ``cancel_running``, the
        calls still running past close's deadline are cancelled (their callers get
        :class:`BatcherClosed`) rather than waited for; a call that blocks its event loop
        cannot be cancelled and keeps that thread alive."""
        with self._portal_lock:
            self._portal_stopped = (
                f"{self.name}: closed with timeout={timeout!r}; this batch was still running or waiting at "
                "the deadline and was cancelled"
                if cancel_running
                else f"{self.name}: the batcher is closed"
            )
            portal, portal_cm = self._portal, self._portal_cm
            self._portal = self._portal_cm = None
        if portal_cm is None:
            return
        if cancel_running:
            with contextlib.suppress(RuntimeError):  # already stopped
                portal.call(portal.stop, True)
        portal_cm.__exit__(None, None, None)

    async def aclose(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """:meth:`close` from async code (runs in a worker thread, the event loop stays free)."""
        await anyio.to_thread.run_sync(lambda: self.close(drain=drain, timeout=timeout))

    def __enter__(self) -> DynamicBatcher[T, R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> DynamicBatcher[T, R]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._closing

    # ------------------------------------------------------------------ the dispatcher

    def _start(self) -> None:
        """Start the dispatcher and workers (first submit; lock held)."""
        self._dispatcher = threading.Thread(
            target=self._dispatch_loop, name=f"batchkit-dispatch-{self.name}", daemon=True
        )
        for _ in range(self.max_concurrent_batches):
            self._spawn_worker()
        listen = getattr(self.clock, "_add_listener", None)
        if listen is not None:
            listen(self._cond)
        self._dispatcher.start()

    def _spawn_worker(self) -> None:
        w = threading.Thread(target=self._work_loop, name=f"batchkit-worker-{self.name}", daemon=True)
        self._workers.append(w)
        w.start()

    def _dispatch_loop(self) -> None:
        mock = hasattr(self.clock, "_add_listener")
        try:
            while True:
                drops: list[tuple[QueueEntry[_Request], BaseException]]
                timed_out: list[_Batch] = []
                with self._mutex:
                    while True:
                        now = self.clock.now()
                        drops = self.queue._expire(now)
                        timed_out = self._check_timeouts(now)
                        batch, wake_at = self._next_batch(now)
                        if batch is not None or drops or timed_out:
                            break
                        if self._closing and self.queue._depth == 0 and not self._running:
                            for _ in self._workers:
                                self._work.put(None)
                            return
                        self._wake_at = wake_at
                        self._dispatcher_idle = True
                        if wake_at is None or mock:
                            self._cond.wait(None if not mock else 1.0)
                        else:
                            self._cond.wait(max(wake_at - now, 0.0))
                        self._dispatcher_idle = False
                if drops:
                    self._resolve_drops(drops)
                for b in timed_out:
                    self._deliver(
                        b,
                        None,
                        BatchTimeout(f"{self.name}: batch function ran past batch_timeout_s={self.batch_timeout_s}"),
                    )
                if batch is not None:
                    self._work.put(batch)
        except BaseException:  # pragma: no cover - a bug here must not hang callers silently
            logger.exception("batchkit dispatcher crashed")
            raise
        finally:
            remove = getattr(self.clock, "_remove_listener", None)
            if remove is not None:
                remove(self._cond)

    def _check_timeouts(self, now: float) -> list[_Batch]:
        if self.batch_timeout_s is None or not self._running:
            return []
        out = [b for b in self._running if now - b.started >= self.batch_timeout_s]
        for b in out:
            b.abandoned = True
            if self.circuit_breaker is not None:
                self.circuit_breaker.record(False)
            self._running.remove(b)
            if b.thread in self._workers:
                self._workers.remove(b.thread)
            self._spawn_worker()  # the stuck worker leaves when (if) its call returns
        return out

    def _next_batch(self, now: float) -> tuple[_Batch | None, float | None]:
        """Decide (lock held) whether a batch is due now; if not, when to look again."""
        q = self.queue
        wake_at = q._next_deadline()
        if self._running and self.batch_timeout_s is not None:
            first_timeout = min(b.started for b in self._running) + self.batch_timeout_s
            wake_at = first_timeout if wake_at is None else min(wake_at, first_timeout)
        if q._depth == 0 or len(self._running) >= self.max_concurrent_batches:
            return None, wake_at
        breaker = self.circuit_breaker
        if breaker is not None and breaker.state != "closed" and not breaker.allow_dispatch():
            if breaker.state == "open":  # look again when it turns half-open
                reopen = breaker.half_open_at
                wake_at = reopen if wake_at is None else min(wake_at, reopen)
            return None, wake_at
        reason = None
        key: Hashable = _ANY
        for k, (count, cost) in q._key_counts.items():
            if count >= self.max_batch_size:
                reason, key = "size", k
                break
            if self.max_batch_cost is not None and cost >= self.max_batch_cost:
                reason, key = "cost", k
                break
        if reason is None:
            oldest = q._oldest()
            assert oldest is not None
            key = oldest.key
            if self._closing:
                reason = "close"
            elif oldest.seq <= self._flush_seq:
                reason = "flush"
            else:
                due = oldest.arrival + self.max_wait_ms / 1e3
                if now < due:
                    return None, due if wake_at is None else min(due, wake_at)
                reason = "timeout"
        if self.group_by is None:
            key = _ANY
        if self.controller is not None:
            # The controller sees the backlog a batch of the current size would leave behind:
            # none means batches have room to spare (step down), some means they fall behind.
            backlog = max(0, q._depth - self.max_batch_size)
            self.max_batch_size = self.controller.update(backlog, now).batch_size
        reqs: list[_Request] = q._take(self.max_batch_size, now, self.max_batch_cost, key)  # type: ignore[assignment]
        for r in reqs:
            r.phase = _DISPATCHED
        info = BatchInfo(
            size=len(reqs),
            cost=float(sum(r.cost for r in reqs)) if self.size_fn else float(len(reqs)),
            key=None if key is _ANY else key,
            reason=reason,
        )
        batch = _Batch(reqs, info, now)
        self._running.append(batch)
        self._batches += 1
        self._batch_items += len(reqs)
        self._sizes[len(reqs)] += 1
        self._reasons[reason] += 1
        self._recent.append(info)
        return batch, wake_at

    # ------------------------------------------------------------------ running batches

    def _work_loop(self) -> None:
        batch = self._work.get()
        while batch is not None:
            self._run_batch(batch)
            if batch.abandoned:
                return  # a replacement worker took this one's place
            with self._mutex:
                if batch in self._running:
                    self._running.remove(batch)
                # Keep the model busy: if the next batch is already due, run it from here rather
                # than handing it through the dispatcher thread (two thread switches saved).
                now = self._now()
                drops = self.queue._expire(now)
                nxt, _ = self._next_batch(now)
                if nxt is None:
                    self._dispatcher_idle = False
                    self._cond.notify()
            if drops:
                self._resolve_drops(drops)
            batch = nxt if nxt is not None else self._work.get()

    def _run_batch(self, batch: _Batch) -> None:
        batch.thread = threading.current_thread()
        reqs = batch.requests
        live: list[_Request] = []
        for r in reqs:
            sink = r.sink
            if isinstance(sink, concurrent.futures.Future):
                if sink.set_running_or_notify_cancel():
                    live.append(r)
                else:
                    with self._mutex:
                        if r.phase != _DONE:
                            r.phase = _DONE
                            self._cancelled += 1
            elif r.phase != _DONE:
                live.append(r)
        if not live:
            if self.circuit_breaker is not None:
                with self._mutex:  # if this was the half-open probe, the next batch probes instead
                    self.circuit_breaker.release_probe()
            return
        t0 = self.clock.now()
        held: list[_Request] = []
        ok = self._call_and_deliver(batch, live, held)
        with self._mutex:
            now = self.clock.now()
            self._batch_time.add(now - t0)
            if self.controller is not None:
                self.controller.observe_batch(len(live), now - t0, now)
            # An abandoned batch was already counted as failed when it timed out.
            if self.circuit_breaker is not None and not batch.abandoned:
                self.circuit_breaker.record(ok)
        # Wake the last callers only now, so that one who saw this batch fail and submits again
        # meets the breaker in the state that failure put it in.
        self._wake(held)

    def _call(self, items: list[Any]) -> Any:
        if not self._is_async:
            return self.fn(items)
        portal = self._portal
        if portal is None:
            with self._portal_lock:
                if self._portal_stopped is not None:
                    raise BatcherClosed(self._portal_stopped)
                if self._portal is None:
                    self._portal_cm = anyio.from_thread.start_blocking_portal()
                    self._portal = self._portal_cm.__enter__()
                portal = self._portal
        try:
            return portal.call(self.fn, items)
        except (concurrent.futures.CancelledError, RuntimeError):
            stopped = self._portal_stopped
            if stopped is not None:  # close() stopped the portal under this call
                raise BatcherClosed(stopped) from None
            raise

    def _call_and_deliver(self, batch: _Batch, reqs: list[_Request], held: list[_Request] | None) -> bool:
        """Run the batch function and answer the callers; False if the batch failed: the
        function raised, or returned a malformed result (:class:`BatchSizeMismatch`). Per-item
        exceptions in the results fail only their callers, not the batch.

        The answered requests of the last call are put in ``held`` (not woken) when it is given.
        """
        items = [r.item for r in reqs]
        try:
            results = self._call(items)
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the callers
            oom = is_out_of_memory(exc)
            if oom and self.controller is not None:
                with self._mutex:
                    self.controller.on_oom(len(reqs), self._now())
                    self.max_batch_size = min(self.max_batch_size, self.controller.batch_size)
            splittable = isinstance(exc, Exception) and not isinstance(exc, BatcherClosed)
            if (oom or self.isolate_errors) and len(reqs) > 1 and splittable:
                mid = len(reqs) // 2
                first = self._call_and_deliver(batch, reqs[:mid], None)
                return self._call_and_deliver(batch, reqs[mid:], held) and first
            self._deliver(batch, None, exc, reqs, held)
            return False
        if isinstance(results, (str, bytes)) or (not isinstance(results, Sequence) and not _is_array(results)):
            self._deliver(
                batch,
                None,
                BatchSizeMismatch(
                    f"{self.name} returned {type(results).__name__}, not a sequence; a batch "
                    "function must return one result per input, in order"
                ),
                reqs,
                held,
            )
            return False
        if len(results) != len(reqs):
            self._deliver(
                batch,
                None,
                BatchSizeMismatch(
                    f"{self.name} returned {len(results)} results for a batch of {len(reqs)}; "
                    "return exactly one result per input, in order"
                ),
                reqs,
                held,
            )
            return False
        self._deliver(batch, results, None, reqs, held)
        return True

    def _deliver(
        self,
        batch: _Batch,
        results: Any,
        error: BaseException | None,
        reqs: list[_Request] | None = None,
        held: list[_Request] | None = None,
    ) -> None:
        """Resolve each request once (lock for the bookkeeping, wakes outside it, or appends
        them to ``held`` for the caller to wake)."""
        if reqs is None:
            reqs = batch.requests
        if batch.abandoned and error is None:
            return  # its callers were already failed with BatchTimeout
        claimed: list[_Request] = []
        with self._mutex:
            now = self._now()
            failed = 0
            for i, r in enumerate(reqs):
                if r.phase == _DONE:
                    continue
                r.phase = _DONE
                if error is not None:
                    r.error = error
                    failed += 1
                else:
                    v = results[i]
                    if isinstance(v, Exception):
                        r.error = v
                        failed += 1
                    else:
                        r.value = v
                claimed.append(r)
            self._failed += failed
            self._succeeded += len(claimed) - failed
            lat = [now - r.arrival for r in claimed]
            self._latency.extend(lat)
            if self.controller is not None:
                self.controller.observe_latencies(lat, now)
            self._t_last = now
        if held is not None:
            held.extend(claimed)
        else:
            self._wake(claimed)

    @staticmethod
    def _wake(reqs: list[_Request]) -> None:
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

    def _on_drop(self, entry: QueueEntry[Any], exc: BaseException) -> None:
        self._resolve_drops([(entry, exc)])

    def _resolve_drops(self, drops: list[tuple[QueueEntry[Any], BaseException]], count_as: str = "") -> None:
        """Answer requests that left the queue without running (expired, evicted, closed)."""
        if not drops:
            return
        claimed: list[_Request] = []
        with self._mutex:
            for entry, exc in drops:
                r: _Request = entry  # type: ignore[assignment]
                if r.phase == _DONE:
                    continue
                r.phase = _DONE
                if r.fallback is not _NO_FALLBACK and not isinstance(exc, QueueFull):
                    r.value = r.fallback
                else:
                    r.error = exc
                if count_as == "cancelled":
                    self._cancelled += 1
                elif isinstance(exc, QueueFull):
                    self._rejected += 1
                else:
                    self._expired += 1
                claimed.append(r)
        self._wake(claimed)

    # ------------------------------------------------------------------ observing

    def statistics(self) -> BatcherStatistics:
        """A snapshot of counters, batch sizes, flush reasons and latency percentiles."""
        qs = self.queue.statistics()
        with self._mutex:
            span = (self._t_last - self._t_first) if self._t_first is not None else 0.0
            done = self._succeeded + self._failed
            return BatcherStatistics(
                pending=self.queue._depth,
                in_flight=len(self._running),
                submitted=self._submitted,
                succeeded=self._succeeded,
                failed=self._failed,
                cancelled=self._cancelled,
                expired=self._expired,
                rejected=self._rejected,
                batches=self._batches,
                mean_batch_size=self._batch_items / self._batches if self._batches else 0.0,
                batch_size_histogram=dict(sorted(self._sizes.items())),
                flush_reasons=dict(self._reasons),
                queue_wait=qs.wait,
                latency=self._latency.summary(),
                batch_time=self._batch_time.summary(),
                throughput_rps=done / span if span > 0 else 0.0,
            )

    def recent_batches(self) -> list[BatchInfo]:
        """The last 64 batches dispatched (size, cost, group key, flush reason), oldest first."""
        with self._mutex:
            return list(self._recent)

    def __repr__(self) -> str:
        state = "closed" if self._closing else "open"
        return (
            f"<DynamicBatcher {self.name} {state} pending={self.queue._depth} in_flight={len(self._running)} "
            f"max_batch_size={self.max_batch_size} max_wait_ms={self.max_wait_ms:g}>"
        )


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _is_async_callable(fn: object) -> bool:
    while hasattr(fn, "func"):  # functools.partial
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _is_array(x: object) -> bool:
    return hasattr(x, "__len__") and hasattr(x, "__getitem__") and hasattr(x, "shape")

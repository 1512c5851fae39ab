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
import logging
import threading
from collections.abc import Callable, Hashable
from time import monotonic as _monotonic
from typing import Any, TypeVar

import anyio

from .._clock import Clock
from .._errors import BatcherClosed, CircuitOpen
from .._waiters import ThreadWaiter, new_async_waiter, wake_all
from ..control import AdaptiveBatchController, CircuitBreaker
from ._loop_thread import LoopThread
from ._queue_core import Drop, check_timeout
from ._threads import BatchThreads
from .batch_function import BatchFn, is_async_callable
from .former import FormedBatch
from .ledger import NO_FALLBACK, Phase, Split
from .queue import BoundedQueue, OnFull
from .shell import BatcherOptions, BatcherShell, LedgerEntry, Settled

# BatcherShell and is_async_callable are imported from here by integrations/ray.py and bench.py.
__all__ = ["BatcherShell", "DynamicBatcher", "is_async_callable"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

_NO_FALLBACK: Any = NO_FALLBACK
# Enum members read from the class cost more than globals.
_QUEUED, _WAITING, _RUNNING = Phase.QUEUED, Phase.WAITING, Phase.RUNNING


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
            own (see :func:`~batchkit.dynamic.shell.check_batcher_options`).
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
        still running: answer every caller now, before close returns (see :meth:`BatcherShell._cut_off`).
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

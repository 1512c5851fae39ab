"""AsyncBatcher: dynamic batching on one asyncio event loop, with no thread and no lock.

When the callers and the batch function live on the same asyncio loop (an ASGI app, an
``async def`` handler per request), :class:`~batchkit.DynamicBatcher`'s threads only add hops:
each batch crosses to a worker thread and each result back. ``AsyncBatcher`` drives the very same
:class:`~batchkit.dynamic.former.BatchFormer` (so the same flush policy, deadlines, priorities, groups,
costs, adaptive controller and circuit breaker) from loop callbacks:

- ``await submit(item)`` admits the item and parks the task on a future of the loop;
- a due batch is started as a task at once (an arrival that fills a batch dispatches it in the
  same loop iteration); a timer on the loop fires at the former's ``wake_at`` otherwise;
- the batch function is awaited on the loop (``async def``), called on the loop (a plain
  function: the loop waits for it, as with any blocking call; this is how a model on the event
  loop runs, in the process's main thread), or with ``offload=True`` called in the batcher's own
  worker thread (the loop stays free; the same thread every time, so a torch model keeps one
  thread pool);
- results go straight into the callers' futures.

It belongs to the loop of its first ``submit``; callers on other loops or threads use
``DynamicBatcher``.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, TypeVar

import anyio

from .._clock import Clock, MonotonicClock
from .._errors import BatcherClosed, QueueFull
from ..control import AdaptiveBatchController, CircuitBreaker
from ._loop_pump import LoopPump
from ._offload import OffloadThreads
from ._queue_core import check_timeout
from .batch_function import is_async_callable
from .former import FormedBatch
from .ledger import NO_FALLBACK, Phase, Split
from .queue import OnFull
from .shell import BatcherOptions, BatcherShell, LedgerEntry

__all__ = ["AsyncBatcher"]

T = TypeVar("T")
R = TypeVar("R")

_NO_FALLBACK: Any = NO_FALLBACK
# Enum members read from the class cost more than globals.
_QUEUED, _WAITING, _RUNNING = Phase.QUEUED, Phase.WAITING, Phase.RUNNING
_get_running_loop = asyncio.get_running_loop
_running_loop_or_none = asyncio._get_running_loop  # the C function: None outside a loop, no raise

# The AsyncBatcher whose ``async def`` batch function the current task runs, or a task it started
# (tasks copy the context they are created in): its aclose() must not wait for its own batch.
_running_batch_of: contextvars.ContextVar[object] = contextvars.ContextVar("batchkit_running_batch_of", default=None)


class _Entry(LedgerEntry):
    """One caller's entry and the future of the loop that answers it."""

    __slots__ = ("future",)

    def __init__(self, item: Any, future: asyncio.Future[Any], fallback: Any) -> None:
        # LedgerEntry's fields, set here rather than through super(): one call less per request.
        self.item = item
        self.fallback = fallback
        self.phase = _QUEUED
        self.value = None
        self.error = None
        self.future = future


_Batch = FormedBatch[_Entry]


class AsyncBatcher(BatcherShell[T, R]):
    """Collects items from the tasks of one asyncio event loop into batches; no threads.

    Args:
        fn: ``fn(items: list[T]) -> Sequence[R]``, or an ``async def`` equivalent; one result
            per item, in order; an :class:`Exception` in a slot fails only that item's caller.
            An ``async def`` runs on the loop; a plain function runs on the loop too (the loop
            waits for it) unless ``offload`` is set.
        max_batch_size, max_wait_ms, max_queue, on_full, max_concurrent_batches, size_fn,
        max_batch_cost, group_by, isolate_errors, batch_timeout_s, controller,
        circuit_breaker, clock, name: as for :class:`~batchkit.DynamicBatcher`. With
            ``on_full="block"``, :meth:`submit` waits (on the loop) for room.
        offload: call a plain ``fn`` in the batcher's worker threads
            (``max_concurrent_batches`` of them, started on first use) instead of on the loop.

    Raises:
        ValueError: as ``DynamicBatcher``; ``batch_timeout_s`` with a plain ``fn`` on the
            loop (a call that holds the loop cannot be timed out: pass ``offload=True``);
            ``offload=True`` with an ``async def`` ``fn``.
        TypeError: ``fn``, ``size_fn`` or ``group_by`` is not callable, ``controller`` or
            ``circuit_breaker`` is not of its type, or ``clock`` has no ``now()`` (see
            :func:`~batchkit.dynamic.shell.check_batcher_options`).
    """

    def __init__(
        self,
        fn: Callable[[list[T]], Sequence[R]] | Callable[[list[T]], Awaitable[Sequence[R]]],
        *,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
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
        offload: bool = False,
        clock: Clock | None = None,
        name: str | None = None,
    ) -> None:
        options: BatcherOptions = {
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
        super().__init__(fn, max_batch_size, max_wait_ms, options, locked=False)
        is_async = is_async_callable(fn)
        if offload and is_async:
            raise ValueError(
                "offload=True runs a plain function in a worker thread; an async def batch function "
                "is awaited on the loop (make it a plain function to offload it)"
            )
        if batch_timeout_s is not None and not is_async and not offload:
            raise ValueError(
                "batch_timeout_s needs a batch function that can be interrupted: an async def, or "
                "offload=True for a plain function (on the loop, a stuck call holds the loop)"
            )
        self._is_async = is_async
        self.offload = offload
        # submit's common path applies: nothing per item to check but room, and not closing.
        self._fast = self._plain
        # The real clock's now() is time.monotonic: call it without the method frame.
        self._now = time.monotonic if type(self.clock) is MonotonicClock else self.clock.now
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump = LoopPump(
            self.former,
            self.clock,
            self._now,
            start=self._start,
            resolve_drops=self._resolve_drops,
            timed_out=self._abandon,
        )
        self._tasks: dict[_Batch, asyncio.Task[None]] = {}
        self._offload = OffloadThreads(self.name, self.max_concurrent_batches) if offload else None

    # ------------------------------------------------------------------ submitting

    async def submit(
        self,
        item: T,
        *,
        priority: int = 0,
        deadline_ms: float | None = None,
        fallback: Any = _NO_FALLBACK,
        timeout: float | None = None,
    ) -> R:
        """Queue ``item`` and await its result (from a task of this batcher's loop).

        Args:
            priority: lower is served first.
            deadline_ms: if the item still waits this long after submit, it leaves the queue and
                the call raises :class:`DeadlineExceeded` (or returns ``fallback``).
            fallback: value to return instead of raising on deadline expiry.
            timeout: with ``on_full="block"``, seconds to wait for room in the queue.

        Cancelling the awaiting task removes the item if its batch has not started, and
        discards its result otherwise.

        Raises:
            BatcherClosed: after :meth:`aclose` began.
            QueueFull: the queue refused the item.
            CircuitOpen: the circuit breaker is open.
            RuntimeError: called from another event loop than the first submit's.
        """
        if timeout is not None:
            check_timeout(timeout)
        entry = enter(self, item, self._loop, fallback) if priority == 0 and deadline_ms is None else None
        if entry is None:
            entry = await self._admit_elsewise(item, priority, deadline_ms, fallback, timeout)
        fut = entry.future
        try:
            return await fut  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            withdraw(self, entry)
            raise

    __call__ = submit

    async def _admit_elsewise(
        self, item: T, priority: int, deadline_ms: float | None, fallback: Any, timeout: float | None
    ) -> _Entry:
        """Admit ``item`` off :func:`enter`'s path (the first call on a loop, a priority or a
        deadline, group keys or costs, a circuit breaker, waiting for room, or closing): its entry."""
        try:
            loop = _get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                f"{self.name}: AsyncBatcher.submit runs in a task of an asyncio event loop; from "
                "threads or trio, use a DynamicBatcher (submit, asubmit)"
            ) from None
        if loop is not self._loop:
            self._bind(loop)
        entry = enter(self, item, loop, fallback) if priority == 0 and deadline_ms is None else None
        if entry is None:
            entry = _Entry(item, loop.create_future(), fallback)
            if self._block:
                await self._enqueue_when_room(entry, priority, deadline_ms, timeout)
            else:
                self._enqueue(entry, priority, deadline_ms)
        return entry

    def _bind(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not None and not self._loop.is_closed():
            raise RuntimeError(
                f"{self.name}: this AsyncBatcher serves the event loop of its first submit; callers "
                "on other loops or threads need a DynamicBatcher (or one AsyncBatcher per loop)"
            )
        self._loop = loop
        self._pump.bind(loop)

    def _enqueue(
        self, entry: _Entry, priority: int, deadline_ms: float | None, key_cost: tuple[Hashable, float] | None = None
    ) -> bool:
        """Admit ``entry``; False when a ``"block"`` queue has no room (nothing done)."""
        if key_cost is None:
            key_cost = self._key_and_cost(entry.item, priority, deadline_ms)
        added = self._admit(entry, priority, deadline_ms, *key_cost)
        if added is None:
            return False
        drops, replan = added
        if drops:
            self._resolve_drops(drops)
        if replan:
            self._pump.soon()
        return True

    def _cancel(self, entry: _Entry) -> None:
        """The caller gave up: its item leaves the queue if it still waits."""
        phase = entry.phase
        if phase is _QUEUED:
            self._core.cancel(entry)  # out of the queue (LEFT); the ledger counts it cancelled
            self.ledger.cancel(entry)
            self._pump.soon()
        elif phase is _WAITING or phase is _RUNNING:
            self.ledger.cancel(entry)  # its result will find no one waiting
        # Otherwise answered, or left unserved: the drop that took it out answers it.

    # ------------------------------------------------------------------ running batches

    def _start(self, batch: _Batch) -> None:
        self._tasks[batch] = self._loop.create_task(self._run(batch))  # type: ignore[union-attr]

    async def _run(self, batch: _Batch) -> None:
        batch.runner = self._tasks.get(batch)
        entries = self.ledger.start(batch.entries)
        try:
            if not entries:
                self.former.record(batch, 0, 0.0, True, self._now())
                return
            t0 = self._now()
            ok = await self._call_and_deliver(batch, entries)
            now = self._now()
            self._batch_time.add(now - t0)
            self.former.record(batch, len(entries), now - t0, ok, now)
        finally:
            self._tasks.pop(batch, None)
            self.former.complete(batch)
            self._pump.soon()

    async def _call(self, items: list[Any]) -> Any:
        if self._is_async:
            _running_batch_of.set(self)  # this task's own context (see _running_batch_of)
            return await self.fn(items)
        if self._offload is not None:
            return await self._offload.run(self.fn, items)
        return self.fn(items)

    async def _call_and_deliver(self, batch: _Batch, entries: list[_Entry]) -> bool:
        """Run the batch function (split and retried as the ledger says) and answer the callers;
        False if a call failed."""
        try:
            results, exc = await self._call([e.item for e in entries]), None
        except asyncio.CancelledError as cancelled:
            cancelling = getattr(asyncio.current_task(), "cancelling", None)  # Python >= 3.11
            if cancelling is not None and not cancelling():
                # Raised by the batch function itself, nobody cancelled this batch: a failure of
                # it, also while aclose() drains (its callers are still waiting).
                self._fail(entries, cancelled)
                return False
            if batch.abandoned or self._closing:
                return False  # its callers were answered by whoever cancelled it
            raise
        except BaseException as raised:  # noqa: BLE001 - every failure goes to the callers
            results, exc = None, raised
        settled = self._settle(batch, entries, results, exc)
        if isinstance(settled, Split):
            first = await self._call_and_deliver(batch, settled.first)
            return await self._call_and_deliver(batch, settled.second) and first
        answered, ok = settled
        _wake(answered)
        return ok

    def _abandon(self, batch: _Batch) -> None:
        """A batch ran past ``batch_timeout_s``: its callers fail, its task is cancelled."""
        self._fail(batch.entries, self._timed_out())
        task = self._tasks.pop(batch, None)
        if task is not None:
            task.cancel()
        if self._offload is not None:
            self._offload.abandon()

    def _wake(self, entries: list[_Entry]) -> None:
        _wake(entries)

    # ------------------------------------------------------------------ controls

    def _limit_changed(self) -> None:
        self._pump.soon_threadsafe()  # an AdaptiveTuner sets the limit from its own thread

    def flush(self) -> None:
        """Dispatch everything waiting now without waiting for ``max_wait_ms``."""
        self.former.flush()
        self._pump.soon()

    async def aclose(self, *, drain: bool = True, timeout: float | None = None) -> None:
        """Stop accepting work, then finish it: with ``drain`` (the default) every waiting item
        runs (behind an open circuit breaker: fails with :class:`CircuitOpen`, see
        :meth:`BatchFormer.expire`); without, waiting items fail with :class:`BatcherClosed`. Waits at most
        ``timeout`` seconds; batches still running then are cancelled (an ``async def`` or
        offloaded call) and their callers fail with :class:`BatcherClosed`. Idempotent. Awaited in
        the batch function itself (or in a task it started), it closes and returns without
        waiting (a later ``aclose()`` from elsewhere waits)."""
        if not drain:  # also while an earlier aclose() drains: what waits fails now
            self._resolve_drops(
                [
                    (e, BatcherClosed(f"{self.name}: closed before this item ran"))
                    for e in self.former.drain(self._now())
                ],
                closing=True,
            )
        if not self._closing:
            self._closing = True
            self._fast = False
            self.former.close()
            self.queue.wake_room_waiters()  # writers waiting for room get BatcherClosed now
        if self._loop is None:  # never used
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        self._pump.pump()
        if _running_batch_of.get() is self:
            # From the batch function itself (or a task it started): waiting for the batches to
            # finish would wait for this one. The rest drains on its own; a later aclose() from
            # elsewhere waits for it.
            return
        finished = self._pump.finished
        assert finished is not None
        timed_out = False
        try:
            with anyio.fail_after(timeout):
                await finished.wait()
        except TimeoutError:
            timed_out = True
            woken, waiting = self._cut_off(timeout)
            for task in self._tasks.values():
                task.cancel()  # it ends at a later loop iteration, or never starts if it had not yet
            self._wake(woken)
            self._resolve_drops(waiting, closing=True)
        finally:
            self._pump.stop()
        if self._offload is not None:
            await self._offload.aclose(deadline, join=not timed_out)


def enter(
    batcher: AsyncBatcher[Any, Any], item: Any, owner: asyncio.AbstractEventLoop | None, fallback: Any = _NO_FALLBACK
) -> _Entry | None:
    """``batcher.submit(item)``'s common path up to its await, for a wrapper that awaits in its
    own coroutine (``@batched`` on an ``async def``: one coroutine per call, not two): queue
    ``item`` and return its entry, whose ``future`` the caller awaits (handing the entry to
    :func:`withdraw` if it is cancelled meanwhile). None, with nothing done, where that path does
    not apply: ``batcher`` does not serve the loop ``owner`` (or none yet), the caller is not a
    task of that loop, ``batcher`` is closing, or it has ``group_by``, ``size_fn``, a circuit
    breaker or an ``on_full="block"`` queue; await ``batcher.submit`` then.

    Raises:
        QueueFull: the queue refused the item (counted).
    """
    if not batcher._fast or owner is None or batcher._loop is not owner or _running_loop_or_none() is not owner:
        return None
    entry = _Entry(item, owner.create_future(), fallback)
    now = batcher._now()
    try:
        drops, replan = batcher.former.add(entry, now)
    except QueueFull:
        batcher.ledger.refused()
        raise
    batcher.ledger.admitted(now)
    if drops:  # evicted by it: answer them (the ledger's drop rule, no guard on one loop)
        _wake(batcher.ledger.drop(drops))
    if replan:
        batcher._pump.soon()
    return entry


def withdraw(batcher: AsyncBatcher[Any, Any], entry: _Entry) -> None:
    """The caller awaiting ``entry``'s future (from :func:`enter`) was cancelled: its item leaves
    ``batcher``'s queue if its batch has not started, and its result is discarded otherwise
    (nothing happens if it was answered before the cancel arrived)."""
    fut = entry.future
    if fut.cancelled() or not fut.done():
        batcher._cancel(entry)


def _wake(entries: list[_Entry]) -> None:
    """Answer each entry's future with the ``value`` or ``error`` the ledger gave it."""
    for e in entries:
        fut = e.future
        if fut.done():  # its caller's task was cancelled
            continue
        if e.error is not None:
            fut.set_exception(e.error)
        else:
            fut.set_result(e.value)

"""BoundedQueue: a capacity-bounded priority queue with deadlines, shedding and cancellation.

The queue is the admission point of every batchkit runtime. Its order, deadlines and full policy
live in a sans-I/O :class:`~batchkit.dynamic._queue_core.QueueCore` (``queue.core``); this shell adds the
lock (``queue.mutex``) and the threads and tasks that wait. It is safe to use from many threads
and from async tasks (asyncio or trio) at the same time. Its state changes under one lock with no
I/O and no user code inside; callbacks (``on_drop``) run after the lock is released.

Ordering: a *lower* ``priority`` value is served first (``priority=-1`` jumps ahead of the default
``0``), FIFO within a priority. With ``aging_s`` set, an item's effective priority improves by one
level for every ``aging_s`` seconds it has waited, so that low-priority work cannot starve.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Hashable
from time import monotonic as _monotonic
from typing import Any, Generic, TypeVar

import anyio

from .._clock import Clock, checked_clock
from .._errors import QueueEmpty, QueueFull
from .._waiters import ThreadWaiter, new_async_waiter, wake_all
from ._queue_core import (
    ON_FULL_POLICIES,
    Drop,
    OnFull,
    QueueCore,
    QueueEntry,
    QueueStatistics,
    check_put_args,
    check_queue_options,
    check_timeout,
)

__all__ = ["ON_FULL_POLICIES", "BoundedQueue", "OnFull", "QueueEntry", "QueueStatistics", "check_queue_options"]

logger = logging.getLogger("batchkit.queue")  # the name api.md documents

T = TypeVar("T")

DropCallback = Callable[[QueueEntry[Any], BaseException], None]


class BoundedQueue(Generic[T]):
    """A bounded, thread- and task-safe priority queue.

    Args:
        maxsize: capacity, at least 1. Every queue in batchkit is bounded.
        on_full: what ``put`` does when the queue is full: ``"reject"`` raises
            :class:`~batchkit.QueueFull` at once; ``"block"`` waits for room (up to the call's
            ``timeout``, then ``QueueFull``); ``"drop_oldest"`` evicts the oldest waiting item;
            ``"shed_lowest_priority"`` evicts the newest item of the least important priority if
            the newcomer is more important, else rejects the newcomer.
        aging_s: seconds of waiting that improve an item's effective priority by one level
            (``None``: no aging).
        clock: time source for arrivals, deadlines and wait times.
        on_drop: called as ``on_drop(entry, exc)`` for each item that leaves without being
            taken (expired, evicted; not one its caller cancelled); ``exc`` is the :class:`DeadlineExceeded` or
            :class:`QueueFull` its owner should see.

    Raises:
        ValueError: ``maxsize`` below 1, an unknown ``on_full``, or ``aging_s`` <= 0.
        TypeError: a ``clock`` without a ``now()`` method, or an ``on_drop`` that is not callable.
    """

    def __init__(
        self,
        maxsize: int,
        on_full: OnFull = "reject",
        *,
        aging_s: float | None = None,
        clock: Clock | None = None,
        on_drop: DropCallback | None = None,
    ) -> None:
        self.core: QueueCore[T] = QueueCore(maxsize, on_full, aging_s=aging_s)
        if on_drop is not None and not callable(on_drop):
            raise TypeError(f"on_drop must be called as on_drop(entry, error), got {on_drop!r}")
        self.maxsize = maxsize
        self.on_full: OnFull = on_full
        self.aging_s = aging_s
        """The sans-I/O state; drive it only while holding :attr:`mutex`."""
        self.core.on_release = self._wake_writers
        self.mutex = threading.Lock()
        """Guards :attr:`core`. A runtime that admits through the core directly (the batcher)
        holds it, so that its decisions and this queue's callers see one state."""
        self.clock: Clock = checked_clock(clock)
        self.on_drop = on_drop
        self.stop_waiting: Callable[[], bool] | None = None
        """A condition read under :attr:`mutex` beside the room: while it holds, writers waiting
        for room return at once (a batcher that owns the queue sets its ``closed`` here). Whoever
        makes it hold does so under the mutex, then calls :meth:`wake_room_waiters`: no writer
        misses it, and none needs to look again on a timer."""
        self._space_waiters: deque[Any] = deque()
        self._item_waiters: deque[Any] = deque()

    def _wake_writers(self, freed: int) -> None:
        """The core freed ``freed`` slots (lock held): wake as many writers waiting for room."""
        waiters = self._space_waiters
        if waiters:
            wake_all([waiters.popleft() for _ in range(min(freed, len(waiters)))])

    def _wake_reader(self) -> None:
        if self._item_waiters:
            wake_all((self._item_waiters.popleft(),))

    def _notify_drops(self, drops: list[Drop]) -> None:
        """Tell ``on_drop`` of each entry that left unserved. Its exceptions are logged, not
        raised: the put, get or expire that evicted the entry has already succeeded."""
        if drops and self.on_drop is not None:
            for entry, exc in drops:
                try:
                    self.on_drop(entry, exc)
                except Exception:
                    logger.exception("on_drop raised for %r; the queue carries on", entry)

    # ------------------------------------------------------------------ waiting for room

    def wait_for_room(self, timeout: float | None = None) -> bool:
        """Block this thread until the queue may have room: True at once if it has some now,
        False if ``timeout`` seconds pass first. Call it without holding :attr:`mutex`. A True
        is a hint, not a reservation: another writer may take the slot, so try to admit again.
        True at once, too, while :attr:`stop_waiting` holds.
        """
        with self.mutex:
            if self._room_or_stopped():
                return True
            waiter = ThreadWaiter()
            self._space_waiters.append(waiter)
        if (timeout is not None and timeout <= 0) or not waiter.wait(timeout):
            self._abandon(self._space_waiters, waiter)
            return False
        return True

    def _room_or_stopped(self) -> bool:
        """(mutex held) Whether a writer should stop waiting: room, or :attr:`stop_waiting`."""
        return self.core.depth < self.core.maxsize or (self.stop_waiting is not None and self.stop_waiting())

    def wake_room_waiters(self) -> None:
        """Wake every thread and task waiting for room (in :meth:`wait_for_room`,
        :meth:`await_room`, or ``put``/``aput`` on a ``"block"`` queue); each tries again. A
        runtime that stops admitting (a closing batcher) calls it so that its blocked writers
        learn why at once instead of waiting for room."""
        with self.mutex:
            waiters = list(self._space_waiters)
            self._space_waiters.clear()
        wake_all(waiters)

    async def await_room(self) -> None:
        """Await until the queue may have room (see :meth:`wait_for_room`); cancel the task or
        wrap in ``anyio.move_on_after`` to stop waiting."""
        with self.mutex:
            if self._room_or_stopped():
                return
            waiter = new_async_waiter()
            self._space_waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            self._abandon(self._space_waiters, waiter)
            raise

    # ------------------------------------------------------------------ public, thread-safe API

    def put_nowait(
        self,
        item: T,
        *,
        priority: int = 0,
        deadline_ms: float | None = None,
        key: Hashable = None,
        cost: float = 1,
    ) -> QueueEntry[T]:
        """Add ``item`` without waiting; return its entry (for :meth:`cancel`).

        Raises:
            QueueFull: the queue is full and its policy refuses the item (``"block"`` queues
                refuse here too: use :meth:`put` or :meth:`aput` to wait).
            ValueError: ``deadline_ms`` is negative.
        """
        check_put_args(priority, deadline_ms, key, cost)
        error: QueueFull | None = None
        core = self.core
        with self.mutex:
            now = self.clock.now()
            drops = core.expire(now)
            try:
                entry, more = core.insert(item, priority, deadline_ms, key, cost, now)
                drops += more
                self._wake_reader()
            except QueueFull as exc:
                error = exc
        self._notify_drops(drops)
        if error is not None:
            raise error
        return entry

    def _put_if_room(
        self, item: T, priority: int, deadline_ms: float | None, key: Hashable, cost: float
    ) -> QueueEntry[T] | None:
        """Add ``item`` if the queue has room now (a ``"block"`` put's attempt), else None."""
        core = self.core
        entry = None
        with self.mutex:
            now = self.clock.now()
            drops = core.expire(now)
            if core.depth < core.maxsize:
                entry, _ = core.insert(item, priority, deadline_ms, key, cost, now)
                self._wake_reader()
        self._notify_drops(drops)
        return entry

    def put(
        self,
        item: T,
        *,
        priority: int = 0,
        deadline_ms: float | None = None,
        timeout: float | None = None,
        key: Hashable = None,
        cost: float = 1,
    ) -> QueueEntry[T]:
        """Add ``item``; on a ``"block"`` queue wait up to ``timeout`` seconds for room.

        Raises:
            QueueFull: refused, or no room came within ``timeout``.
        """
        check_timeout(timeout)
        if self.on_full != "block":
            return self.put_nowait(item, priority=priority, deadline_ms=deadline_ms, key=key, cost=cost)
        check_put_args(priority, deadline_ms, key, cost)
        deadline = None if timeout is None else _monotonic() + timeout
        while True:
            entry = self._put_if_room(item, priority, deadline_ms, key, cost)
            if entry is not None:
                return entry
            if not self.wait_for_room(None if deadline is None else deadline - _monotonic()) or self._stopped():
                self._count_rejection()
                raise QueueFull(f"no room in the queue within timeout={timeout!r} s")

    async def aput(
        self,
        item: T,
        *,
        priority: int = 0,
        deadline_ms: float | None = None,
        timeout: float | None = None,
        key: Hashable = None,
        cost: float = 1,
    ) -> QueueEntry[T]:
        """Async :meth:`put`: on a ``"block"`` queue, await room (up to ``timeout`` seconds)."""
        check_timeout(timeout)
        if self.on_full != "block":
            return self.put_nowait(item, priority=priority, deadline_ms=deadline_ms, key=key, cost=cost)
        check_put_args(priority, deadline_ms, key, cost)
        with anyio.move_on_after(timeout):
            while True:
                entry = self._put_if_room(item, priority, deadline_ms, key, cost)
                if entry is not None:
                    return entry
                await self.await_room()
                if self._stopped():
                    break
        self._count_rejection()
        raise QueueFull(f"no room in the queue within timeout={timeout!r} s")

    def _stopped(self) -> bool:
        """Whether :attr:`stop_waiting` holds: no room will come for a ``put`` (it would spin)."""
        with self.mutex:
            return self.stop_waiting is not None and self.stop_waiting()

    def _count_rejection(self) -> None:
        with self.mutex:
            self.core.count_rejection()

    def _take_one(self, new_waiter: Callable[[], Any] | None = None) -> tuple[list[QueueEntry[T]], Any]:
        """Expire what is due and take the best entry: ``([entry], None)``; or, with none waiting,
        ``([], waiter)``, a ``new_waiter()`` enlisted for the next item under the same lock (so no
        put is missed) where one is given, else ``([], None)``. ``on_drop`` is told of the expired."""
        waiter = None
        with self.mutex:
            now = self.clock.now()
            drops = self.core.expire(now)
            taken = self.core.take(1, now)
            if not taken and new_waiter is not None:
                waiter = new_waiter()
                self._item_waiters.append(waiter)
        self._notify_drops(drops)
        return taken, waiter

    def get_nowait(self) -> T:
        """Remove and return the best waiting item.

        Raises:
            QueueEmpty: nothing is waiting.
        """
        taken, _ = self._take_one()
        if not taken:
            raise QueueEmpty("no item is waiting")
        return taken[0].item

    def get(self, timeout: float | None = None) -> T:
        """Remove and return the best item, waiting up to ``timeout`` seconds for one.

        Raises:
            QueueEmpty: nothing arrived within ``timeout``.
        """
        deadline = None if timeout is None else _monotonic() + timeout
        while True:
            taken, waiter = self._take_one(ThreadWaiter)
            if taken:
                return taken[0].item
            remaining = None if deadline is None else deadline - _monotonic()
            if (remaining is not None and remaining <= 0) or not waiter.wait(remaining):
                self._abandon(self._item_waiters, waiter)
                raise QueueEmpty(f"no item arrived within timeout={timeout!r} s")

    async def aget(self) -> T:
        """Remove and return the best item, awaiting one if none is waiting.

        Cancel the calling task (or wrap in ``anyio.fail_after``) to stop waiting.
        """
        while True:
            taken, waiter = self._take_one(new_async_waiter)
            if taken:
                return taken[0].item
            try:
                await waiter
            except BaseException:
                self._abandon(self._item_waiters, waiter)
                raise

    def cancel(self, entry: QueueEntry[T]) -> bool:
        """Remove a waiting entry. Returns False if it already left (taken, expired, dropped)."""
        with self.mutex:
            return self.core.cancel(entry)

    def expire(self) -> int:
        """Remove the items whose deadline has passed now; return how many."""
        with self.mutex:
            drops = self.core.expire(self.clock.now())
        self._notify_drops(drops)
        return len(drops)

    def next_deadline(self) -> float | None:
        """The earliest deadline (clock time) among waiting items, or None."""
        with self.mutex:
            return self.core.next_deadline()

    def _abandon(self, waiters: deque[Any], waiter: Any) -> None:
        """Forget a waiter that gave up; if it had been woken, pass the wake on."""
        with self.mutex:
            try:
                waiters.remove(waiter)
            except ValueError:  # it was woken (popped) already: hand the wake-up to the next
                if waiters:
                    wake_all((waiters.popleft(),))

    def __len__(self) -> int:
        return self.core.depth

    def empty(self) -> bool:
        return self.core.depth == 0

    def full(self) -> bool:
        return self.core.depth >= self.core.maxsize

    def statistics(self) -> QueueStatistics:
        """A consistent snapshot of counters and the wait-time distribution of served items."""
        with self.mutex:
            drops = self.core.expire(self.clock.now())
            stats = self.core.statistics()
        self._notify_drops(drops)
        return stats

    def __repr__(self) -> str:
        return f"<BoundedQueue depth={self.core.depth} maxsize={self.maxsize} on_full={self.on_full!r}>"

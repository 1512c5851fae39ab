"""BoundedQueue: a capacity-bounded priority queue with deadlines, shedding and cancellation.

The queue is the admission point of every batchkit runtime. It is safe to use from many threads
and from async tasks (asyncio or trio) at the same time. Its state changes under one lock with no
I/O and no user code inside; callbacks (``on_drop``) run after the lock is released.

Ordering: a *lower* ``priority`` value is served first (``priority=-1`` jumps ahead of the default
``0``), FIFO within a priority. With ``aging_s`` set, an item's effective priority improves by one
level for every ``aging_s`` seconds it has waited, so that low-priority work cannot starve.
"""

from __future__ import annotations

import heapq
import threading
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from time import monotonic as _monotonic
from typing import Any, Generic, Literal, TypeVar

import anyio

from ._clock import Clock, MonotonicClock
from ._errors import DeadlineExceeded, QueueEmpty, QueueFull
from ._waiters import ThreadWaiter, new_async_waiter, wake_all
from .metrics import LatencySummary, SampleWindow

__all__ = ["ON_FULL_POLICIES", "BoundedQueue", "OnFull", "QueueEntry", "QueueStatistics", "check_queue_options"]

T = TypeVar("T")

OnFull = Literal["reject", "block", "drop_oldest", "shed_lowest_priority"]
ON_FULL_POLICIES: tuple[str, ...] = ("reject", "block", "drop_oldest", "shed_lowest_priority")

# Entry states. An entry leaves WAITING exactly once; lazily deleted entries stay in their deque
# until they reach its head (or a compaction), which keeps cancel and expire O(1).
WAITING, TAKEN, CANCELLED, EXPIRED, DROPPED = range(5)

_ANY: Any = object()


class QueueEntry(Generic[T]):
    """One item in a :class:`BoundedQueue`, as returned by ``put``; pass it to ``cancel``."""

    __slots__ = ("arrival", "cost", "deadline", "item", "key", "priority", "seq", "state")

    def __init__(
        self,
        item: T,
        priority: int,
        seq: int,
        arrival: float,
        deadline: float | None,
        key: Hashable,
        cost: float,
    ) -> None:
        self.item = item
        self.priority = priority
        self.seq = seq
        self.arrival = arrival
        self.deadline = deadline
        self.key = key
        self.cost = cost
        self.state = WAITING

    @property
    def waiting(self) -> bool:
        """Whether the entry is still in the queue."""
        return self.state == WAITING

    def __repr__(self) -> str:
        states = ("waiting", "taken", "cancelled", "expired", "dropped")
        return f"<QueueEntry seq={self.seq} priority={self.priority} {states[self.state]}>"


@dataclass(frozen=True, slots=True)
class QueueStatistics:
    """A snapshot of a :class:`BoundedQueue`."""

    maxsize: int
    depth: int
    peak_depth: int
    arrivals: int
    served: int
    rejections: int
    drops: int
    expiries: int
    cancellations: int
    wait: LatencySummary


DropCallback = Callable[[QueueEntry[Any], BaseException], None]


def check_queue_options(maxsize: object, on_full: object = "reject", aging_s: object = None) -> None:
    """Raise what ``BoundedQueue(maxsize, on_full, aging_s=aging_s)`` would raise for these
    arguments, without building a queue (the batcher and ``@batched`` validate their options so).

    Raises:
        ValueError: ``maxsize`` not an int >= 1, an unknown ``on_full``, or ``aging_s`` <= 0.
    """
    if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
        raise ValueError(f"maxsize must be an int >= 1, got {maxsize!r}: every queue is bounded")
    if on_full not in ON_FULL_POLICIES:
        raise ValueError(f"on_full must be one of {ON_FULL_POLICIES}, got {on_full!r}")
    if aging_s is not None and not (isinstance(aging_s, (int, float)) and aging_s > 0):
        raise ValueError(f"aging_s must be > 0 seconds or None, got {aging_s!r}")


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
            taken (expired, evicted); ``exc`` is the :class:`DeadlineExceeded` or
            :class:`QueueFull` its owner should see.

    Raises:
        ValueError: ``maxsize`` below 1, an unknown ``on_full``, or ``aging_s`` <= 0.
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
        check_queue_options(maxsize, on_full, aging_s)
        self.maxsize = maxsize
        self.on_full: OnFull = on_full
        self.aging_s = aging_s
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self.on_drop = on_drop
        self._mutex = threading.Lock()
        self._levels: dict[int, deque[QueueEntry[T]]] = {}
        self._deadlines: list[tuple[float, int, QueueEntry[T]]] = []
        self._key_counts: dict[Hashable, list[float]] = {}
        self._space_waiters: deque[Any] = deque()
        self._item_waiters: deque[Any] = deque()
        self._seq = 0
        self._depth = 0
        self._peak = 0
        self._arrivals = 0
        self._served = 0
        self._rejections = 0
        self._drops = 0
        self._expiries = 0
        self._cancellations = 0
        self._wait = SampleWindow()

    # ------------------------------------------------------------------ lock-free core
    # Methods starting with ``_`` expect the caller to hold ``self._mutex``; they never block and
    # never call user code. They return the (entry, exception) pairs to hand to ``on_drop``.

    def _admit(self, priority: int) -> list[tuple[QueueEntry[T], BaseException]]:
        """Make room for one item of ``priority`` per the full policy. Raises QueueFull if refused."""
        if self._depth < self.maxsize:
            return []
        victim = self._choose_victim(priority)
        if victim is None:
            self._rejections += 1
            raise QueueFull(
                f"queue is full ({self.maxsize} items, on_full={self.on_full!r}); raise "
                "maxsize, use on_full='block' to wait, or add serving capacity"
            )
        self._remove(victim, DROPPED)
        self._drops += 1
        return [(victim, QueueFull(f"dropped from a full queue ({self.on_full}) to admit a newer item"))]

    def _push(self, entry: QueueEntry[T]) -> None:
        """Add an admitted entry (room was made by ``_admit``)."""
        level = self._levels.get(entry.priority)
        if level is None:
            level = self._levels[entry.priority] = deque()
        level.append(entry)
        if entry.deadline is not None:
            heapq.heappush(self._deadlines, (entry.deadline, entry.seq, entry))
        counts = self._key_counts.get(entry.key)
        if counts is None:
            self._key_counts[entry.key] = [1, entry.cost]
        else:
            counts[0] += 1
            counts[1] += entry.cost
        self._depth += 1
        self._arrivals += 1
        if self._depth > self._peak:
            self._peak = self._depth
        if self._item_waiters:
            wake_all((self._item_waiters.popleft(),))

    def _insert(
        self,
        item: T,
        priority: int,
        deadline_ms: float | None,
        key: Hashable,
        cost: float,
        now: float,
    ) -> tuple[QueueEntry[T], list[tuple[QueueEntry[T], BaseException]]]:
        """Admit one item, applying the full policy. Raises QueueFull when it is refused."""
        dropped = self._admit(priority)
        deadline = None if deadline_ms is None else now + deadline_ms / 1e3
        self._seq += 1
        entry = QueueEntry(item, priority, self._seq, now, deadline, key, cost)
        self._push(entry)
        return entry, dropped

    def _choose_victim(self, priority: int) -> QueueEntry[T] | None:
        if self.on_full == "drop_oldest":
            return self._oldest()
        if self.on_full == "shed_lowest_priority":
            worst = max(p for p, dq in self._levels.items() if self._head(dq) is not None)
            if worst <= priority:
                return None
            dq = self._levels[worst]
            for entry in reversed(dq):
                if entry.state == WAITING:
                    return entry
        return None

    @staticmethod
    def _head(dq: deque[QueueEntry[T]]) -> QueueEntry[T] | None:
        while dq:
            head = dq[0]
            if head.state == WAITING:
                return head
            dq.popleft()
        return None

    def _remove(self, entry: QueueEntry[T], state: int) -> None:
        """Mark a waiting entry as gone (lazy deletion) and free its slot."""
        entry.state = state
        self._release([entry])
        dq = self._levels.get(entry.priority)
        if dq is not None and len(dq) > 2 * self.maxsize:
            # Many lazily deleted entries: compact so memory stays bounded by capacity.
            self._levels[entry.priority] = deque(e for e in dq if e.state == WAITING)

    def _oldest(self) -> QueueEntry[T] | None:
        best: QueueEntry[T] | None = None
        for dq in self._levels.values():
            head = self._head(dq)
            if head is not None and (best is None or head.seq < best.seq):
                best = head
        return best

    def _ordered_levels(self, now: float) -> list[int]:
        """Priority levels with a waiting head, best effective priority first."""
        if len(self._levels) == 1:
            (p,) = self._levels
            return [p]
        scored: list[tuple[float, int, int]] = []
        for p, dq in list(self._levels.items()):
            head = self._head(dq)
            if head is None:
                del self._levels[p]
                continue
            eff = float(p)
            if self.aging_s is not None:
                eff -= (now - head.arrival) / self.aging_s
            scored.append((eff, head.seq, p))
        scored.sort()
        return [p for _, _, p in scored]

    def _take(
        self,
        max_items: int,
        now: float,
        max_cost: float | None = None,
        key: Hashable = _ANY,
    ) -> list[QueueEntry[T]]:
        """Remove and return up to ``max_items`` entries (and ``max_cost`` total cost), best first.

        With ``key``, only entries of that key are taken; the others keep their places. An entry
        whose cost alone exceeds ``max_cost`` is still taken when it would be first in the batch,
        so that nothing waits forever.
        """
        out: list[QueueEntry[T]] = []
        total = 0.0
        full = False
        for p in self._ordered_levels(now):
            dq = self._levels[p]
            if key is _ANY:
                while dq and len(out) < max_items:
                    e = dq[0]
                    if e.state != WAITING:
                        dq.popleft()
                        continue
                    if max_cost is not None and out and total + e.cost > max_cost:
                        full = True
                        break
                    dq.popleft()
                    e.state = TAKEN
                    out.append(e)
                    total += e.cost
            else:
                keep: deque[QueueEntry[T]] = deque()
                while dq:
                    e = dq.popleft()
                    if e.state != WAITING:
                        continue
                    if full or e.key != key or len(out) >= max_items:
                        keep.append(e)
                    elif max_cost is not None and out and total + e.cost > max_cost:
                        full = True
                        keep.append(e)
                    else:
                        e.state = TAKEN
                        out.append(e)
                        total += e.cost
                self._levels[p] = keep
            if not self._levels[p]:
                del self._levels[p]
            if full or len(out) >= max_items:
                break
        if out:
            self._release(out)
            self._wait.extend([now - e.arrival for e in out])
            self._served += len(out)
        return out

    def _release(self, gone: list[QueueEntry[T]]) -> None:
        """Account for entries that just left (their state is already set): slots, loads, waiters."""
        n = len(gone)
        self._depth -= n
        counts = self._key_counts
        if len(counts) == 1 and (only := next(iter(counts))) == gone[0].key and counts[only][0] == n:
            del counts[only]  # the common case: one group, all of it taken
        else:
            for e in gone:
                c = counts[e.key]
                c[0] -= 1
                c[1] -= e.cost
                if c[0] == 0:
                    del counts[e.key]
        waiters = self._space_waiters
        if waiters:
            wake_all([waiters.popleft() for _ in range(min(n, len(waiters)))])

    def _expire(self, now: float) -> list[tuple[QueueEntry[T], BaseException]]:
        """Remove every waiting entry whose deadline has passed."""
        out: list[tuple[QueueEntry[T], BaseException]] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, entry = heapq.heappop(heap)
            if entry.state != WAITING:
                continue
            self._remove(entry, EXPIRED)
            self._expiries += 1
            waited_ms = (now - entry.arrival) * 1e3
            out.append((entry, DeadlineExceeded(f"deadline passed after {waited_ms:.1f} ms in the queue")))
        return out

    def _cancel(self, entry: QueueEntry[T]) -> bool:
        if entry.state != WAITING:
            return False
        self._remove(entry, CANCELLED)
        self._cancellations += 1
        return True

    def _next_deadline(self) -> float | None:
        heap = self._deadlines
        while heap and heap[0][2].state != WAITING:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def _notify_drops(self, drops: list[tuple[QueueEntry[T], BaseException]]) -> None:
        if drops and self.on_drop is not None:
            for entry, exc in drops:
                self.on_drop(entry, exc)

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
        _check_put_args(priority, deadline_ms)
        error: QueueFull | None = None
        with self._mutex:
            now = self.clock.now()
            drops = self._expire(now)
            try:
                entry, more = self._insert(item, priority, deadline_ms, key, cost, now)
                drops += more
            except QueueFull as exc:
                error = exc
        self._notify_drops(drops)
        if error is not None:
            raise error
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
        if self.on_full != "block":
            return self.put_nowait(item, priority=priority, deadline_ms=deadline_ms, key=key, cost=cost)
        _check_put_args(priority, deadline_ms)
        deadline = None if timeout is None else _monotonic() + timeout
        while True:
            with self._mutex:
                now = self.clock.now()
                drops = self._expire(now)
                if self._depth < self.maxsize:
                    entry, _ = self._insert(item, priority, deadline_ms, key, cost, now)
                    break
                waiter = ThreadWaiter()
                self._space_waiters.append(waiter)
            self._notify_drops(drops)
            remaining = None if deadline is None else deadline - _monotonic()
            if (remaining is not None and remaining <= 0) or not waiter.wait(remaining):
                self._abandon(self._space_waiters, waiter)
                with self._mutex:
                    self._rejections += 1
                raise QueueFull(f"no room in the queue within timeout={timeout!r} s")
        self._notify_drops(drops)
        return entry

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
        if self.on_full != "block":
            return self.put_nowait(item, priority=priority, deadline_ms=deadline_ms, key=key, cost=cost)
        _check_put_args(priority, deadline_ms)
        with anyio.move_on_after(timeout) as scope:
            while True:
                with self._mutex:
                    now = self.clock.now()
                    drops = self._expire(now)
                    if self._depth < self.maxsize:
                        entry, _ = self._insert(item, priority, deadline_ms, key, cost, now)
                        break
                    waiter = new_async_waiter()
                    self._space_waiters.append(waiter)
                self._notify_drops(drops)
                try:
                    await waiter
                except BaseException:
                    self._abandon(self._space_waiters, waiter)
                    raise
        if scope.cancelled_caught:
            with self._mutex:
                self._rejections += 1
            raise QueueFull(f"no room in the queue within timeout={timeout!r} s")
        self._notify_drops(drops)
        return entry

    def get_nowait(self) -> T:
        """Remove and return the best waiting item.

        Raises:
            QueueEmpty: nothing is waiting.
        """
        with self._mutex:
            now = self.clock.now()
            drops = self._expire(now)
            taken = self._take(1, now)
        self._notify_drops(drops)
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
            with self._mutex:
                now = self.clock.now()
                drops = self._expire(now)
                taken = self._take(1, now)
                if not taken:
                    waiter = ThreadWaiter()
                    self._item_waiters.append(waiter)
            self._notify_drops(drops)
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
            with self._mutex:
                now = self.clock.now()
                drops = self._expire(now)
                taken = self._take(1, now)
                if not taken:
                    waiter = new_async_waiter()
                    self._item_waiters.append(waiter)
            self._notify_drops(drops)
            if taken:
                return taken[0].item
            try:
                await waiter
            except BaseException:
                self._abandon(self._item_waiters, waiter)
                raise

    def cancel(self, entry: QueueEntry[T]) -> bool:
        """Remove a waiting entry. Returns False if it already left (taken, expired, dropped)."""
        with self._mutex:
            return self._cancel(entry)

    def expire(self) -> int:
        """Remove the items whose deadline has passed now; return how many."""
        with self._mutex:
            drops = self._expire(self.clock.now())
        self._notify_drops(drops)
        return len(drops)

    def next_deadline(self) -> float | None:
        """The earliest deadline (clock time) among waiting items, or None."""
        with self._mutex:
            return self._next_deadline()

    def _abandon(self, waiters: deque[Any], waiter: Any) -> None:
        """Forget a waiter that gave up; if it had been woken, pass the wake on."""
        with self._mutex:
            try:
                waiters.remove(waiter)
            except ValueError:  # it was woken (popped) already: hand the wake-up to the next
                if waiters:
                    wake_all((waiters.popleft(),))

    def __len__(self) -> int:
        return self._depth

    def empty(self) -> bool:
        return self._depth == 0

    def full(self) -> bool:
        return self._depth >= self.maxsize

    def statistics(self) -> QueueStatistics:
        """A consistent snapshot of counters and the wait-time distribution of served items."""
        with self._mutex:
            drops = self._expire(self.clock.now())
            stats = QueueStatistics(
                maxsize=self.maxsize,
                depth=self._depth,
                peak_depth=self._peak,
                arrivals=self._arrivals,
                served=self._served,
                rejections=self._rejections,
                drops=self._drops,
                expiries=self._expiries,
                cancellations=self._cancellations,
                wait=self._wait.summary(),
            )
        self._notify_drops(drops)
        return stats

    def __repr__(self) -> str:
        return f"<BoundedQueue depth={self._depth} maxsize={self.maxsize} on_full={self.on_full!r}>"


def _check_put_args(priority: int, deadline_ms: float | None) -> None:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an int (lower is served first), got {priority!r}")
    if deadline_ms is not None and not deadline_ms >= 0:
        raise ValueError(f"deadline_ms must be >= 0 or None, got {deadline_ms!r}")

"""QueueCore: the sans-I/O heart of :class:`~batchkit.BoundedQueue` and of the batcher's admission.

It owns queue order (priority levels, FIFO within one, optional aging), per-entry deadlines, the
per-group loads that ``group_by`` batching reads, the full policies, and the counters of
:class:`QueueStatistics`. It has no lock, no waiters and no clock: every method is told ``now``,
never blocks and never calls user code. A shell (``BoundedQueue``, ``BatchFormer``) holds the lock
that guards it and wakes whoever waits; the core only announces freed slots through
``on_release(n)``.

Methods that remove entries without serving them (``admit``, ``expire``) return ``(entry, exc)``
pairs: the exception the entry's owner should see.
"""

from __future__ import annotations

import heapq
import math
import numbers
from collections import deque
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from .._errors import DeadlineExceeded, QueueFull
from .._validate import positive_int
from ..metrics import LatencySummary, SampleWindow
from .ledger import TRANSITIONS, Event, Phase

__all__ = [
    "ANY_KEY",
    "ON_FULL_POLICIES",
    "Drop",
    "OnFull",
    "QueueCore",
    "QueueEntry",
    "QueueStatistics",
    "check_number",
    "check_put_args",
    "check_queue_options",
]

T = TypeVar("T")

OnFull = Literal["reject", "block", "drop_oldest", "shed_lowest_priority"]
ON_FULL_POLICIES: tuple[str, ...] = ("reject", "block", "drop_oldest", "shed_lowest_priority")

# An entry's one state is the ledger's phase. The core makes the table's two moves out of QUEUED,
# each exactly once: TAKE (into a batch) and LEAVE (unserved: the Drop or the cancel that took it
# out says why). Lazily deleted entries stay in their deque until they reach its head (or a
# compaction), which keeps cancel and expire O(1).
_QUEUED = Phase.QUEUED
_TAKEN = TRANSITIONS[_QUEUED][Event.TAKE]
_LEFT = TRANSITIONS[_QUEUED][Event.LEAVE]

ANY_KEY: Any = object()
"""``QueueCore.take(key=ANY_KEY)``: take from every group."""


class QueueEntry(Generic[T]):
    """One item in a :class:`BoundedQueue`, as returned by ``put``; pass it to ``cancel``."""

    __slots__ = ("arrival", "cost", "deadline", "item", "key", "phase", "priority", "seq")

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
        self.phase = _QUEUED
        """Where it stands (:class:`~batchkit.dynamic.ledger.Phase`): ``QUEUED`` while in the
        queue, ``WAITING`` once taken, ``LEFT`` once out unserved; a batcher's ledger moves it on."""

    @property
    def waiting(self) -> bool:
        """Whether the entry is still in the queue."""
        return self.phase is _QUEUED

    def __repr__(self) -> str:
        where = {_QUEUED: "waiting", _TAKEN: "taken", _LEFT: "removed"}.get(self.phase, self.phase.value)
        return f"<QueueEntry seq={self.seq} priority={self.priority} {where}>"


Drop = tuple[QueueEntry[Any], BaseException]
"""An entry that left without being served, and the exception its owner should see."""


@dataclass(frozen=True, slots=True)
class QueueStatistics:
    """A snapshot of a :class:`BoundedQueue`. ``wait``: every served entry's time in the queue
    (whole run, mergeable); ``wait_recent``: the same over the last 10,000 served."""

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
    wait_recent: LatencySummary


def check_queue_options(maxsize: object, on_full: object = "reject", aging_s: object = None) -> None:
    """Raise what ``BoundedQueue(maxsize, on_full, aging_s=aging_s)`` would raise for these
    arguments, without building a queue (the batcher and ``@batched`` validate their options so).

    Raises:
        ValueError: ``maxsize`` not an int >= 1, an unknown ``on_full``, or ``aging_s`` <= 0.
    """
    positive_int("maxsize", maxsize, note="(every queue is bounded)")
    if on_full not in ON_FULL_POLICIES:
        raise ValueError(f"on_full must be one of {ON_FULL_POLICIES}, got {on_full!r}")
    if aging_s is not None and not (isinstance(aging_s, (int, float)) and aging_s > 0):
        raise ValueError(f"aging_s must be > 0 seconds or None, got {aging_s!r}")


def check_number(name: str, value: object, *, unit: str, positive: bool = False, optional: bool = False) -> None:
    """Refuse a setting that is not a real number (a bool, a str, None...) or is below its
    bound (NaN included), with a message that names it: ``>= 0``, or ``> 0`` when ``positive``.

    Raises:
        ValueError: ``value`` is not an int or float (numpy's too) within the bound.
    """
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not (number and (value > 0 if positive else value >= 0)):  # type: ignore[operator]
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be {bound}{' or None' if optional else ''} (a number of {unit}), got {value!r}")


def check_timeout(timeout: object) -> None:
    """Refuse a ``timeout`` (seconds to wait for room) that is neither None nor a number >= 0, on
    every queue policy: a NaN or negative one would otherwise pass unnoticed where no wait happens.

    Raises:
        ValueError: naming ``timeout``.
    """
    if timeout is not None:
        check_number("timeout", timeout, unit="seconds", optional=True)


def is_cost(cost: object) -> bool:
    """Whether ``cost`` is a finite number >= 0. An infinite cost is refused: the per-group
    totals that decide a ``max_batch_cost`` flush would turn NaN once it left (inf - inf)."""
    try:
        return math.isfinite(cost) and cost >= 0  # type: ignore[arg-type, operator]
    except TypeError:
        return False


def check_put_args(priority: object, deadline_ms: float | None, key: object = None, cost: float = 1) -> None:
    """Validate one ``put``'s ``priority``, ``deadline_ms``, group ``key`` and ``cost``.

    Raises:
        TypeError: ``priority`` is not an int, or ``key`` is unhashable.
        ValueError: ``deadline_ms`` or ``cost`` is negative (or NaN).
    """
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"priority must be an int (lower is served first), got {priority!r}")
    if deadline_ms is not None:
        check_number("deadline_ms", deadline_ms, unit="milliseconds", optional=True)
    if cost != 1 and not is_cost(cost):
        raise ValueError(f"cost must be a number >= 0 (and finite), got {cost!r}")
    if key is not None:
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"key must be hashable (it names the item's group), got {key!r}") from None


class QueueCore(Generic[T]):
    """Priority order, deadlines, group loads and the full policy of a bounded queue; no lock.

    Args:
        maxsize: capacity, at least 1.
        on_full: the full policy (see :class:`~batchkit.BoundedQueue`). For ``"block"`` the core
            refuses like ``"reject"``; waiting for room is the shell's business.
        aging_s: seconds of waiting that improve an entry's effective priority by one level.

    Attributes (read them, never assign them):
        depth: entries waiting now.
        seq: sequence number of the last admitted entry (entries are numbered from 1).
        on_release: ``on_release(n)`` is called when ``n`` slots have just been freed (entries
            taken, expired, cancelled or dropped); a shell sets it to wake writers waiting for
            room. It is called with the shell's lock held and must not block.
    """

    __slots__ = (
        "_cancellations",
        "_deadlines",
        "_drops",
        "_expiries",
        "_levels",
        "_loads",
        "_peak",
        "_rejections",
        "_served",
        "_wait",
        "aging_s",
        "depth",
        "maxsize",
        "on_full",
        "on_release",
        "seq",
    )

    def __init__(self, maxsize: int, on_full: OnFull = "reject", *, aging_s: float | None = None) -> None:
        check_queue_options(maxsize, on_full, aging_s)
        self.maxsize = maxsize
        self.on_full: OnFull = on_full
        self.aging_s = aging_s
        self.on_release: Callable[[int], None] | None = None
        self._levels: dict[int, deque[QueueEntry[T]]] = {}
        self._deadlines: list[tuple[float, int, QueueEntry[T]]] = []
        self._loads: dict[Hashable, list[float]] = {}
        self.seq = 0
        self.depth = 0
        self._peak = 0
        self._served = 0
        self._rejections = 0
        self._drops = 0
        self._expiries = 0
        self._cancellations = 0
        self._wait = SampleWindow()

    # ------------------------------------------------------------------ admission

    def admit(self, priority: int, now: float | None = None) -> list[Drop]:
        """Make room for one entry of ``priority`` per the full policy; return the entries it
        evicted (with the :class:`QueueFull` their owners should see). ``now`` (clock time) lets
        ``"shed_lowest_priority"`` judge waiting entries by their aged priority (``aging_s``).

        Raises:
            QueueFull: the queue is full and its policy refuses the newcomer (counted as a
                rejection).
        """
        if self.depth < self.maxsize:
            return []
        victim = self._choose_victim(priority, now)
        if victim is None:
            self._rejections += 1
            advice = (
                "this call does not wait: use put() or aput() to wait for room"
                if self.on_full == "block"
                else "raise maxsize, use on_full='block' to wait, or add serving capacity"
            )
            raise QueueFull(f"queue is full ({self.maxsize} items, on_full={self.on_full!r}); {advice}")
        self._remove(victim)
        self._drops += 1
        return [(victim, QueueFull(f"dropped from a full queue ({self.on_full}) to admit a newer item"))]

    def add(
        self,
        entry: QueueEntry[T],
        priority: int,
        deadline: float | None,
        key: Hashable,
        cost: float,
        now: float,
    ) -> None:
        """Place ``entry`` (room was made by :meth:`admit`): fill in its queue fields (arrival
        ``now``, ``deadline`` as a clock time or None, the next sequence number) and queue it."""
        entry.priority = priority
        entry.arrival = now
        entry.deadline = deadline
        entry.key = key
        entry.cost = cost
        entry.phase = _QUEUED
        entry.seq = self.seq = self.seq + 1
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = deque()
        level.append(entry)
        if deadline is not None:
            heapq.heappush(self._deadlines, (deadline, entry.seq, entry))
        load = self._loads.get(key)
        if load is None:
            self._loads[key] = [1, cost]
        else:
            load[0] += 1
            load[1] += cost
        depth = self.depth = self.depth + 1
        if depth > self._peak:
            self._peak = depth

    def insert(
        self,
        item: T,
        priority: int,
        deadline_ms: float | None,
        key: Hashable,
        cost: float,
        now: float,
    ) -> tuple[QueueEntry[T], list[Drop]]:
        """Admit and add a new entry for ``item``; return it and the entries evicted for it.

        Raises:
            QueueFull: refused by the full policy.
        """
        dropped = self.admit(priority, now)
        entry: QueueEntry[T] = QueueEntry(item, priority, 0, now, None, key, cost)
        self.add(entry, priority, None if deadline_ms is None else now + deadline_ms / 1e3, key, cost, now)
        return entry, dropped

    def count_rejection(self) -> None:
        """Count a newcomer refused by the shell (a ``"block"`` wait that timed out)."""
        self._rejections += 1

    # ------------------------------------------------------------------ leaving

    def take(
        self,
        max_items: int,
        now: float,
        max_cost: float | None = None,
        key: Hashable = ANY_KEY,
    ) -> list[QueueEntry[T]]:
        """Remove and return up to ``max_items`` entries (and ``max_cost`` total cost), best first.

        With ``key``, only entries of that group are taken; the others keep their places. An
        entry whose cost alone exceeds ``max_cost`` is still taken when it would be first in the
        batch, so that nothing waits forever.
        """
        out: list[QueueEntry[T]] = []
        total = 0.0
        full = False
        for p in self._ordered_levels(now):
            dq = self._levels[p]
            if key is ANY_KEY:
                while dq and len(out) < max_items:
                    e = dq[0]
                    if e.phase is not _QUEUED:
                        dq.popleft()
                        continue
                    if max_cost is not None and out and total + e.cost > max_cost:
                        full = True
                        break
                    dq.popleft()
                    e.phase = _TAKEN
                    out.append(e)
                    total += e.cost
            else:
                keep: deque[QueueEntry[T]] = deque()
                while dq:
                    e = dq.popleft()
                    if e.phase is not _QUEUED:
                        continue
                    if full or e.key != key or len(out) >= max_items:
                        keep.append(e)
                    elif max_cost is not None and out and total + e.cost > max_cost:
                        full = True
                        keep.append(e)
                    else:
                        e.phase = _TAKEN
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

    def discard_all(self, now: float) -> list[QueueEntry[T]]:
        """Remove and return every waiting entry, counted as cancellations, not as served (a
        close without drain: none of them runs)."""
        out = [e for dq in self._levels.values() for e in dq if e.phase is _QUEUED]
        for e in out:
            e.phase = _LEFT
        self._levels.clear()
        if out:
            self._release(out)
            self._cancellations += len(out)
        return out

    def expire(self, now: float) -> list[Drop]:
        """Remove every waiting entry whose deadline has passed by ``now``."""
        heap = self._deadlines
        if not heap or heap[0][0] > now:
            return []
        out: list[Drop] = []
        while heap and heap[0][0] <= now:
            _, _, entry = heapq.heappop(heap)
            if entry.phase is not _QUEUED:
                continue
            self._remove(entry)
            self._expiries += 1
            waited_ms = (now - entry.arrival) * 1e3
            out.append((entry, DeadlineExceeded(f"deadline passed after {waited_ms:.1f} ms in the queue")))
        return out

    def cancel(self, entry: QueueEntry[T]) -> bool:
        """Remove a waiting entry; False if it already left (taken, expired, dropped)."""
        if entry.phase is not _QUEUED:
            return False
        self._remove(entry)
        self._cancellations += 1
        return True

    # ------------------------------------------------------------------ reading

    def next_deadline(self) -> float | None:
        """The earliest deadline (clock time) among waiting entries, or None."""
        heap = self._deadlines
        while heap and heap[0][2].phase is not _QUEUED:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def oldest(self) -> QueueEntry[T] | None:
        """The waiting entry that arrived first, whatever its priority (None when empty)."""
        best: QueueEntry[T] | None = None
        for dq in self._levels.values():
            head = self._head(dq)
            if head is not None and (best is None or head.seq < best.seq):
                best = head
        return best

    def best(self, now: float) -> QueueEntry[T] | None:
        """The waiting entry :meth:`take` would serve first at ``now`` (best effective priority,
        FIFO within it), or None when empty."""
        for p in self._ordered_levels(now):
            head = self._head(self._levels[p])
            if head is not None:
                return head
        return None

    def best_key(self, keys: Collection[Hashable], now: float) -> Hashable:
        """Of the groups ``keys`` (each with waiting entries), the one whose best entry
        :meth:`take` would serve first at ``now`` (best effective priority, FIFO within it)."""
        for p in self._ordered_levels(now):
            for e in self._levels[p]:
                if e.phase is _QUEUED and e.key in keys:
                    return e.key
        raise ValueError(f"no waiting entry in the groups {keys!r}")

    def loads(self) -> dict[Hashable, list[float]]:
        """``{key: [count, cost]}`` of the waiting entries per group. The core's own live dict
        (the same object for the core's lifetime), for speed: read it, never change it."""
        return self._loads

    def statistics(self) -> QueueStatistics:
        """Counters and the wait-time distribution of served entries."""
        return QueueStatistics(
            maxsize=self.maxsize,
            depth=self.depth,
            peak_depth=self._peak,
            arrivals=self.seq,
            served=self._served,
            rejections=self._rejections,
            drops=self._drops,
            expiries=self._expiries,
            cancellations=self._cancellations,
            wait=self._wait.summary(),
            wait_recent=self._wait.recent(),
        )

    def __len__(self) -> int:
        return self.depth

    def __repr__(self) -> str:
        return f"<QueueCore depth={self.depth} maxsize={self.maxsize} on_full={self.on_full!r}>"

    # ------------------------------------------------------------------ internals

    def _choose_victim(self, priority: int, now: float | None) -> QueueEntry[T] | None:
        if self.on_full == "drop_oldest":
            return self.oldest()
        if self.on_full == "shed_lowest_priority":
            # The newest entry of each level is that level's worst (aging favours the older ones);
            # the victim is the worst of those by effective priority, if the newcomer beats it.
            aging = self.aging_s if now is not None else None
            t = now if now is not None else 0.0
            victim: QueueEntry[T] | None = None
            worst = -math.inf
            for p, dq in self._levels.items():
                tail = next((e for e in reversed(dq) if e.phase is _QUEUED), None)
                if tail is None:
                    continue
                eff = float(p) if aging is None else p - (t - tail.arrival) / aging
                if victim is None or eff > worst or (eff == worst and tail.seq > victim.seq):
                    victim, worst = tail, eff
            if victim is None or worst <= priority:
                return None
            return victim
        return None

    @staticmethod
    def _head(dq: deque[QueueEntry[T]]) -> QueueEntry[T] | None:
        while dq:
            head = dq[0]
            if head.phase is _QUEUED:
                return head
            dq.popleft()
        return None

    def _remove(self, entry: QueueEntry[T]) -> None:
        """Mark a waiting entry as gone unserved (lazy deletion) and free its slot."""
        entry.phase = _LEFT
        self._release([entry])
        dq = self._levels.get(entry.priority)
        if dq is not None and len(dq) > 2 * self.maxsize:
            # Many lazily deleted entries: compact so memory stays bounded by capacity.
            self._levels[entry.priority] = deque(e for e in dq if e.phase is _QUEUED)

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

    def _release(self, gone: list[QueueEntry[T]]) -> None:
        """Account for entries that just left (their phase is already set): depth, loads."""
        n = len(gone)
        self.depth -= n
        loads = self._loads
        if len(loads) == 1 and (only := next(iter(loads))) == gone[0].key and loads[only][0] == n:
            del loads[only]  # the common case: one group, all of it taken
        else:
            for e in gone:
                c = loads[e.key]
                c[0] -= 1
                c[1] -= e.cost
                if c[0] == 0:
                    del loads[e.key]
        if self.on_release is not None:
            self.on_release(n)

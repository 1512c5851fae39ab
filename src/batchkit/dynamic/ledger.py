"""RequestLedger: what happens to each admitted request, written once, as data.

A request the queue admitted is in one :class:`Phase` at a time; an :class:`Event` moves it along
:data:`TRANSITIONS` (one table, as h11's ``_state.py``) and a request in a final phase is never
answered twice. The phase is a request's only state: the queue core
(:class:`~batchkit.dynamic._queue_core.QueueCore`) makes the two moves out of ``QUEUED`` (``TAKE``
into a batch, ``LEAVE`` unserved) and the ledger makes the rest. The ledger owns the counters
``statistics()`` reports, the fallback rule (a deadline with a fallback answers with it) and the
split-and-retry rule (an out-of-memory, or any error under ``isolate_errors``, retries the two
halves). It returns what the shell must do (the requests to wake, with ``value`` or ``error`` set;
the halves to retry) and does nothing itself.

It does not know the queue's order, batches, locks, threads, event loops or clocks: the shells
(:class:`~batchkit.DynamicBatcher`, :class:`~batchkit.AsyncBatcher`, ``batchkit.sim``) call it
under their own guard and tell it ``now``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from .._errors import BatcherClosed, CircuitOpen, DeadlineExceeded, QueueFull
from ..metrics import SampleWindow

__all__ = [
    "FINAL",
    "NO_FALLBACK",
    "TRANSITIONS",
    "Event",
    "Fail",
    "IllegalTransition",
    "Phase",
    "RequestLedger",
    "Split",
    "Tracked",
    "Verdict",
]


class _NoFallback:
    __slots__ = ()

    def __repr__(self) -> str:  # as signatures (help(), inspect) show the default
        return "<no fallback>"


NO_FALLBACK: Any = _NoFallback()
"""The ``fallback`` of a request that has none."""


class Phase(enum.Enum):
    """Where an admitted request stands."""

    QUEUED = "queued"  # in the queue
    LEFT = "left"  # out of the queue unserved; the drop (or the cancel) that took it out says why
    WAITING = "waiting"  # taken from the queue, not yet handed to the batch function
    RUNNING = "running"  # in a batch the shell started
    SUCCEEDED = "succeeded"  # answered with a result (or its fallback)
    FAILED = "failed"  # its batch answered it with an exception
    CANCELLED = "cancelled"  # its caller gave up
    EXPIRED = "expired"  # its deadline passed while it waited
    EVICTED = "evicted"  # a full queue dropped it for a newer item
    ABANDONED = "abandoned"  # closing failed it before it ran

    # Members are singletons compared by identity: hash them so too, in C, not by name in Python
    # (Enum's own __hash__), since every request's moves look its phase up in the table.
    __hash__ = object.__hash__


class Event(enum.Enum):
    """What can happen to a request."""

    TAKE = "be taken"  # the queue core: into a batch
    LEAVE = "leave the queue"  # the queue core: expired, evicted, cancelled or discarded
    START = "start"
    SUCCEED = "succeed"
    FAIL = "fail"
    CANCEL = "cancel"
    EXPIRE = "expire"
    EVICT = "evict"
    ABANDON = "abandon"

    __hash__ = object.__hash__  # as Phase's


W, R = Phase.WAITING, Phase.RUNNING
TRANSITIONS: Mapping[Phase, Mapping[Event, Phase]] = {
    Phase.QUEUED: {Event.TAKE: W, Event.LEAVE: Phase.LEFT},
    # The queue core took it out unserved, without knowing why; the shell answers it (drop, or
    # the cancel that took it out) and never cancels one that a drop answers.
    Phase.LEFT: {
        Event.CANCEL: Phase.CANCELLED,
        Event.EXPIRE: Phase.EXPIRED,
        Event.EVICT: Phase.EVICTED,
        Event.ABANDON: Phase.ABANDONED,
    },
    W: {
        Event.START: R,
        Event.CANCEL: Phase.CANCELLED,
        Event.EXPIRE: Phase.EXPIRED,
        Event.EVICT: Phase.EVICTED,
        Event.ABANDON: Phase.ABANDONED,
        # A dispatched batch can time out (or be cut off by close) before a worker starts it.
        Event.FAIL: Phase.FAILED,
    },
    R: {
        Event.SUCCEED: Phase.SUCCEEDED,
        Event.FAIL: Phase.FAILED,
        Event.CANCEL: Phase.CANCELLED,  # the result will find no one waiting
        Event.ABANDON: Phase.ABANDONED,  # closing stopped the event loop before the call began
    },
}
"""The one table of legal moves; the phases it has no row for are final."""
del W, R

FINAL = frozenset(p for p in Phase if p not in TRANSITIONS)

# TRANSITIONS by event: the phase each event moves a request to, from each phase it may.
_NEXT: dict[Event, dict[Phase, Phase]] = {e: {p: row[e] for p, row in TRANSITIONS.items() if e in row} for e in Event}
# Each event leads to one phase, whichever phase it moves a request from (unpacking checks it), so
# that a batch's moves are counted once per batch.
_TARGET: dict[Event, Phase] = {e: target for e, row in _NEXT.items() for (target,) in [set(row.values())]}
_SUCCEEDED, _FAILED = _TARGET[Event.SUCCEED], _TARGET[Event.FAIL]


class IllegalTransition(RuntimeError):
    """A shell asked for a move the table does not have (a bug in the shell)."""


class Tracked(Protocol):
    """What the ledger reads and writes on a request (the shells' queue entries)."""

    phase: Phase
    fallback: Any
    value: Any
    error: BaseException | None
    arrival: float


K = TypeVar("K", bound=Tracked)


@dataclass(frozen=True, slots=True)
class Split:
    """Retry ``first`` and then ``second`` as batches of their own."""

    first: list[Any]
    second: list[Any]
    oom: bool


@dataclass(frozen=True, slots=True)
class Fail:
    """Answer every request of the batch with ``error``."""

    error: BaseException
    oom: bool


Verdict = Split | Fail


class RequestLedger:
    """The lifecycle of every request of one batcher, and its counters."""

    __slots__ = ("entered", "isolate_errors", "latency", "refusals", "submitted", "t_first", "t_last")

    def __init__(self, *, isolate_errors: bool = False) -> None:
        self.isolate_errors = isolate_errors
        self.submitted = 0
        self.refusals = 0
        self.entered: dict[Phase, int] = dict.fromkeys(Phase, 0)
        """Requests that ever entered each phase (the final ones stay: these are the counts)."""
        self.latency = SampleWindow()
        """End-to-end latencies (seconds) of the callers a batch answered."""
        self.t_first: float | None = None  # first admission
        self.t_last = 0.0  # last answer from a batch

    # ------------------------------------------------------------------ the counts

    @property
    def succeeded(self) -> int:
        return self.entered[Phase.SUCCEEDED]

    @property
    def failed(self) -> int:
        return self.entered[Phase.FAILED]

    @property
    def cancelled(self) -> int:
        """Given up by their callers, or failed by a close before they ran."""
        return self.entered[Phase.CANCELLED] + self.entered[Phase.ABANDONED]

    @property
    def expired(self) -> int:
        return self.entered[Phase.EXPIRED]

    @property
    def rejected(self) -> int:
        """Submits refused, and requests evicted from a full queue."""
        return self.refusals + self.entered[Phase.EVICTED]

    # ------------------------------------------------------------------ the table

    def move(self, req: Tracked, event: Event) -> bool:
        """Apply ``event`` to ``req`` and count where it ends; False (nothing done) when ``req``
        is already final.

        Raises:
            IllegalTransition: the table has no such move from ``req``'s phase.
        """
        nxt = _NEXT[event].get(req.phase)
        if nxt is None:
            return _refuse(req, event)
        req.phase = nxt
        self.entered[nxt] += 1
        return True

    def _move_all(self, reqs: Sequence[K], event: Event) -> list[K]:
        """:meth:`move` each of ``reqs`` (a batch's, on the per-request path: one loop, no call
        per request); the ones it moved."""
        row = _NEXT[event]
        target = _TARGET[event]
        moved: list[K] = []
        try:
            for r in reqs:
                if r.phase in row:
                    r.phase = target
                    moved.append(r)
                else:
                    _refuse(r, event)
        finally:  # counted also when a shell's bug raises IllegalTransition part way
            self.entered[target] += len(moved)
        return moved

    # ------------------------------------------------------------------ admission

    def admitted(self, now: float) -> None:
        """One request entered the queue."""
        self.submitted += 1
        if self.t_first is None:
            self.t_first = now

    def refused(self) -> None:
        """One submit was refused (``QueueFull``, ``CircuitOpen``, no room in time)."""
        self.refusals += 1

    def cancel(self, req: Tracked) -> bool:
        """Its caller gave up (queued or taken alike); False if it was answered already."""
        return self.move(req, Event.CANCEL)

    # ------------------------------------------------------------------ leaving unrun

    def drop(self, drops: Sequence[tuple[Any, BaseException]], *, closing: bool = False) -> list[Any]:
        """Requests that left the queue without running, each with the exception its caller
        should see: the ones to wake, ``value`` or ``error`` set. A deadline answers with the
        request's fallback if it has one (an eviction or a close never does). ``closing``: the
        close failed them (they count as cancelled)."""
        woken = []
        for req, exc in drops:
            if closing or isinstance(exc, (CircuitOpen, BatcherClosed)):
                event = Event.ABANDON  # failed at close, unrun (an open breaker behind a drain)
            elif isinstance(exc, QueueFull):
                event = Event.EVICT
            else:
                event = Event.EXPIRE
            if not self.move(req, event):
                continue
            if event is Event.EXPIRE and req.fallback is not NO_FALLBACK and isinstance(exc, DeadlineExceeded):
                req.value = req.fallback
            else:
                req.error = exc
            woken.append(req)
        return woken

    def abandon(self, reqs: Sequence[K], exc: BaseException) -> list[K]:
        """Closing failed ``reqs`` before they ran (counted as cancelled): the ones to wake."""
        woken = self._move_all(reqs, Event.ABANDON)
        for r in woken:
            r.error = exc
        return woken

    # ------------------------------------------------------------------ running

    def start(self, reqs: Sequence[K]) -> list[K]:
        """A batch of ``reqs`` is about to run: the ones still wanted (not cancelled)."""
        return self._move_all(reqs, Event.START)

    def answer(self, reqs: Sequence[K], results: Sequence[Any], now: float) -> tuple[list[K], list[float]]:
        """The batch function returned ``results`` for ``reqs`` (in order; an Exception in a slot
        fails that caller only): the requests to wake and their latencies."""
        succeed, fail = _NEXT[Event.SUCCEED], _NEXT[Event.FAIL]
        woken: list[K] = []
        failed = 0
        try:
            for r, v in zip(reqs, results, strict=True):
                if isinstance(v, Exception):
                    if r.phase not in fail:
                        _refuse(r, Event.FAIL)
                        continue
                    r.phase = _FAILED
                    r.error = v
                    failed += 1
                elif r.phase in succeed:
                    r.phase = _SUCCEEDED
                    r.value = v
                else:
                    _refuse(r, Event.SUCCEED)
                    continue
                woken.append(r)
        finally:  # counted once per batch, also when a shell's bug raises part way
            entered = self.entered
            entered[_SUCCEEDED] += len(woken) - failed
            entered[_FAILED] += failed
        return woken, self._observe(woken, now)

    def fail(self, reqs: Sequence[K], exc: BaseException, now: float) -> tuple[list[K], list[float]]:
        """The batch of ``reqs`` failed with ``exc``: the requests to wake and their latencies."""
        woken = self._move_all(reqs, Event.FAIL)
        for r in woken:
            r.error = exc
        return woken, self._observe(woken, now)

    def after_error(self, reqs: Sequence[K], exc: BaseException, *, oom: bool) -> Verdict:
        """The batch function raised ``exc`` on ``reqs`` (``oom``: it ran out of memory): retry
        the two halves (out of memory or ``isolate_errors``, more than one request, an ordinary
        error that is not a close), or fail them all."""
        splittable = isinstance(exc, Exception) and not isinstance(exc, BatcherClosed)
        if (oom or self.isolate_errors) and len(reqs) > 1 and splittable:
            mid = len(reqs) // 2
            return Split(list(reqs[:mid]), list(reqs[mid:]), oom)
        return Fail(exc, oom)

    def _observe(self, woken: Sequence[Tracked], now: float) -> list[float]:
        latencies = [now - r.arrival for r in woken]
        if latencies:
            self.latency.extend(latencies)
            self.t_last = now
        return latencies

    def throughput_rps(self) -> float:
        """Callers a batch answered per second, first admission to last answer."""
        span = (self.t_last - self.t_first) if self.t_first is not None else 0.0
        return (self.succeeded + self.failed) / span if span > 0 else 0.0


def _refuse(req: Tracked, event: Event) -> bool:
    """The table has no move for ``event`` from ``req``'s phase: False when that phase is final
    (answered once, nothing done).

    Raises:
        IllegalTransition: ``req`` is not final (a bug in the shell).
    """
    if req.phase in FINAL:
        return False
    raise IllegalTransition(f"a request {req.phase.value} cannot {event.value}")

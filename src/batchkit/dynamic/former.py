"""BatchFormer: the sans-I/O flush policy of dynamic batching.

It decides, from a :class:`~batchkit.dynamic._queue_core.QueueCore`'s state and the time it is told,
whether a batch is due and what it holds. It never sleeps, starts no thread and calls no user
code: :class:`~batchkit.DynamicBatcher` drives it from its dispatcher and worker threads under
the queue's lock, and :func:`batchkit.sim.simulate` drives the very same object on virtual time,
so that the simulator runs the production policy by construction.

A batch is due (the :class:`FlushReason`) when one group holds ``max_batch_size`` items
(``SIZE``) or ``max_batch_cost`` of cost (``COST``), when the oldest waiting item has waited
``max_wait_ms`` (``TIMEOUT``), for what was waiting at the last :meth:`BatchFormer.flush`
(``FLUSH``), and after :meth:`BatchFormer.close` (``CLOSE``, the drain). A batch is sealed only
when :meth:`BatchFormer.next_batch` is called with a free slot (``max_concurrent_batches``), so
that while the model is busy the next batch keeps growing.
"""

from __future__ import annotations

import enum
import logging
import math
from collections import Counter, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .._errors import CircuitOpen
from .._validate import positive_int
from ..control import AdaptiveBatchController, BreakerState, CircuitBreaker
from ._queue_core import ANY_KEY, Drop, QueueCore, QueueEntry, check_number

__all__ = ["FLUSH_REASONS", "BatchFormer", "BatchInfo", "FlushReason", "FormedBatch"]

logger = logging.getLogger("batchkit.former")  # the name api.md documents

E = TypeVar("E", bound=QueueEntry[Any])

_NO_DROPS: Sequence[Drop] = ()
#: Seconds between looks at a half-open circuit breaker whose probe another batch holds.
_PROBE_POLL_S = 0.05


class FlushReason(str, enum.Enum):
    """Why a batch was dispatched; compares equal to its value (``FlushReason.SIZE == "size"``)."""

    SIZE = "size"
    COST = "cost"
    TIMEOUT = "timeout"
    FLUSH = "flush"
    CLOSE = "close"

    def __str__(self) -> str:
        return self.value


FLUSH_REASONS: tuple[str, ...] = tuple(r.value for r in FlushReason)
# The values, as next_batch records them (an enum member's .value is a property: slow per batch).
_SIZE, _COST, _TIMEOUT = FlushReason.SIZE.value, FlushReason.COST.value, FlushReason.TIMEOUT.value
_FLUSH, _CLOSE = FlushReason.FLUSH.value, FlushReason.CLOSE.value


@dataclass(frozen=True, slots=True)
class BatchInfo:
    """How one batch was formed: its size, total cost, group key and why it was flushed."""

    size: int
    cost: float
    key: Hashable
    reason: str


class FormedBatch(Generic[E]):
    """A sealed batch: its entries, how it was formed, when it started, and whether it was
    abandoned (ran past ``batch_timeout_s``). ``runner`` and ``call`` are the driver's own slots
    (the batcher keeps there the worker thread that runs the batch, and the handle that cancels
    the call of an ``async def`` batch function running now)."""

    __slots__ = ("abandoned", "call", "entries", "info", "runner", "started")

    def __init__(self, entries: list[E], info: BatchInfo, started: float) -> None:
        self.entries = entries
        self.info = info
        self.started = started
        self.abandoned = False
        self.runner: Any = None
        self.call: Any = None

    def __repr__(self) -> str:
        return f"<FormedBatch size={self.info.size} reason={self.info.reason!r} started={self.started:.6f}>"


class BatchFormer(Generic[E]):
    """When a batch is due and what it holds, over a :class:`QueueCore`; no lock, no threads.

    Args:
        queue: the core whose entries are batched. The former admits through it (:meth:`add`)
            and takes from it (:meth:`next_batch`); a driver holds the lock that guards both.
        max_batch_size: most entries per batch (the adaptive ``controller`` changes it).
        max_wait_ms: longest the oldest waiting entry waits for company.
        max_batch_cost: cost limit per batch (entries' ``cost``), or None.
        grouped: entries of different ``key`` never share a batch (``group_by`` was given).
        max_concurrent_batches: batches that may run at once.
        batch_timeout_s: a running batch older than this is reported by :meth:`timed_out`.
        controller: sets ``max_batch_size`` before each batch from the backlog.
        circuit_breaker: consulted before sealing a batch (open: none; half-open: one probe).

    Raises:
        ValueError: a size or count below 1, a negative wait, or a non-positive cost limit or
            timeout (the message names the argument).

    Attributes (read them; the former changes them): ``running`` (batches dispatched and not
    completed), ``wake_at`` (when the last :meth:`next_batch` that found nothing due wants to be
    asked again), ``closing``, and the counters ``batches``, ``batched_items``, ``sizes``
    (histogram), ``reasons`` (per flush reason) and ``recent`` (the last 64 :class:`BatchInfo`).
    """

    def __init__(
        self,
        queue: QueueCore[Any],
        *,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        max_batch_cost: float | None = None,
        grouped: bool = False,
        max_concurrent_batches: int = 1,
        batch_timeout_s: float | None = None,
        controller: AdaptiveBatchController | None = None,
        circuit_breaker: CircuitBreaker | None = None,
    ) -> None:
        for name, value in (("max_batch_size", max_batch_size), ("max_concurrent_batches", max_concurrent_batches)):
            positive_int(name, value)
        check_number("max_wait_ms", max_wait_ms, unit="milliseconds")
        if max_batch_cost is not None:
            check_number("max_batch_cost", max_batch_cost, unit="cost units", positive=True, optional=True)
        if batch_timeout_s is not None:
            check_number("batch_timeout_s", batch_timeout_s, unit="seconds", positive=True, optional=True)
        self.queue = queue
        self._loads = queue.loads()  # the core's live dict (it is never replaced)
        self.max_batch_size = controller.batch_size if controller is not None else max_batch_size
        self.max_wait_ms = float(max_wait_ms)
        self.max_batch_cost = max_batch_cost
        self.grouped = grouped
        self.max_concurrent_batches = max_concurrent_batches
        self.batch_timeout_s = batch_timeout_s
        self.controller = controller
        self.circuit_breaker = circuit_breaker
        self.running: list[FormedBatch[E]] = []
        self.closing = False
        self.wake_at: float | None = None
        self._flush_seq = 0
        self.batches = 0
        self.batched_items = 0
        self.sizes: Counter[int] = Counter()
        self.reasons: Counter[str] = Counter()
        self.recent: deque[BatchInfo] = deque(maxlen=64)

    # ------------------------------------------------------------------ entries in

    def add(
        self,
        entry: E,
        now: float,
        priority: int = 0,
        deadline_ms: float | None = None,
        key: Hashable = None,
        cost: float = 1,
    ) -> tuple[Sequence[Drop], bool]:
        """Admit ``entry`` into the queue now. Returns the entries the full policy evicted for
        it, and whether the arrival changes the plan: a first entry starts the wait clock, a
        group is full while a batch slot is free, or its deadline comes before :attr:`wake_at`
        (a driver that sleeps until ``wake_at`` must then ask :meth:`next_batch` again). While
        every slot is busy a full group waits for one: the driver asks again as a batch
        completes, so the arrivals of a saturated batcher ask nothing.

        Raises:
            QueueFull: the queue's full policy refused it (counted by the queue).
            ValueError: ``key`` is not equal to itself (a NaN), or comparing it raised: the
                former finds an entry's group by equality, so such an entry could never be
                batched (nothing is admitted).
        """
        q = self.queue
        depth = q.depth
        if key is None and deadline_ms is None and 0 < depth < q.maxsize:
            # The common case (no group, no deadline, room, not the first entry), in fewer steps:
            # the plan changes only if the batch is full and a slot is free to run it.
            q.add(entry, priority, None, None, cost, now)
            if len(self.running) >= self.max_concurrent_batches:
                return _NO_DROPS, False
            load = self._loads[None]
            replan = load[0] >= self.max_batch_size or (
                self.max_batch_cost is not None and load[1] >= self.max_batch_cost
            )
            return _NO_DROPS, replan
        if key is not None:
            _check_key(key)
        drops = q.admit(priority, now) if depth >= q.maxsize else _NO_DROPS
        deadline = None if deadline_ms is None else now + deadline_ms / 1e3
        q.add(entry, priority, deadline, key, cost, now)
        if depth == 0 or drops:  # a first entry starts the wait clock; evictions change the plan
            return drops, True
        load = self._loads[key]
        full = load[0] >= self.max_batch_size or (self.max_batch_cost is not None and load[1] >= self.max_batch_cost)
        replan = (full and len(self.running) < self.max_concurrent_batches) or (
            deadline is not None and (self.wake_at is None or deadline < self.wake_at)
        )
        return drops, replan

    def expire(self, now: float) -> list[Drop]:
        """Remove the waiting entries whose deadline has passed (their owners get the error).

        While closing with the circuit breaker open and no batch of this former running, every
        waiting entry goes too, with :class:`CircuitOpen`: a drain does not wait out
        ``reset_timeout_s`` for a probe (and another after each failing one), which would hold a
        shutdown for as many cool-downs as there are batches waiting. A running batch may still
        close the circuit by succeeding, so the entries wait for it (the driver calls this again
        after each batch completes); a half-open circuit's probe still runs, and if it fails,
        what still waits goes then.
        """
        drops = self.queue.expire(now)
        breaker = self.circuit_breaker
        if (
            self.closing
            and breaker is not None
            and self.queue.depth
            and not self.running
            and breaker.state_at(now) is BreakerState.OPEN
        ):
            error = CircuitOpen(
                f"closed while the circuit breaker was open ({breaker.failure_threshold} or more consecutive batch "
                "failures); the items still waiting failed fast instead of waiting for its probe"
            )
            drops += [(e, error) for e in self.queue.discard_all(now)]
        return drops

    # ------------------------------------------------------------------ the decision

    def next_batch(self, now: float) -> tuple[FormedBatch[E] | None, float | None]:
        """Seal and return the batch due now (it joins :attr:`running`), or None; and the
        earliest time something may change without an arrival (a deadline, a batch timeout,
        the oldest entry's ``max_wait_ms``, a circuit turning half-open), or None.

        Call it again after a batch is returned: more may be due.
        """
        q = self.queue
        wake_at = q.next_deadline()
        running = self.running
        if running and self.batch_timeout_s is not None:
            first_timeout = min(b.started for b in running) + self.batch_timeout_s
            wake_at = _min_time(wake_at, first_timeout)
        if q.depth == 0 or len(running) >= self.max_concurrent_batches:
            return self._wait(wake_at)
        breaker = self.circuit_breaker
        if breaker is not None and breaker.state_at(now) is BreakerState.OPEN:
            return self._wait(_min_time(wake_at, breaker.half_open_at))  # a probe may go then
        reason: str | None = None  # a FlushReason's value
        key: Hashable = ANY_KEY
        full: dict[Hashable, str] = {}
        for k, (count, cost) in self._loads.items():
            if count >= self.max_batch_size:
                full[k] = _SIZE
            elif self.max_batch_cost is not None and cost >= self.max_batch_cost:
                full[k] = _COST
        if full:
            # Several groups full at once (every batch slot was busy): the one whose best item
            # is served first goes, as when a batch is due by time.
            key = next(iter(full)) if len(full) == 1 else q.best_key(full, now)
            reason = full[key]
        if reason is None:
            oldest = q.oldest()
            assert oldest is not None  # depth > 0
            key = oldest.key
            if self.closing:
                reason = _CLOSE
            elif oldest.seq <= self._flush_seq:
                reason = _FLUSH
            else:
                due = oldest.arrival + self.max_wait_ms / 1e3
                if now < due:
                    return self._wait(_min_time(wake_at, due))
                reason = _TIMEOUT
            if self.grouped:
                # The oldest item says when; the group that goes is the one whose head is served
                # first (best effective priority, FIFO within one), as a batch without groups is
                # filled best level first: a better priority never waits behind another group.
                best = q.best(now)
                assert best is not None
                key = best.key
        if not self.grouped:
            key = ANY_KEY
        if breaker is not None and not breaker.allow_dispatch(now):
            # Half-open with the probe out, maybe from another batcher sharing the breaker (every
            # instance's batcher of a @batched method shares its options): nothing here learns
            # how that probe ends, so look again soon. The probe is asked for only here, for a
            # batch that is due and sealed next, so that no look hands it out for nothing.
            return self._wait(_min_time(wake_at, now + _PROBE_POLL_S))
        if self.controller is not None:
            # The controller sees the backlog a batch of the current size would leave behind:
            # none means batches have room to spare (step down), some means they fall behind.
            backlog = max(0, q.depth - self.max_batch_size)
            self.max_batch_size = self._controlled_size(backlog, now)
        entries: list[E] = q.take(self.max_batch_size, now, self.max_batch_cost, key)  # type: ignore[assignment]
        info = BatchInfo(
            size=len(entries),
            cost=float(sum([e.cost for e in entries])),
            key=None if key is ANY_KEY else key,
            reason=reason,
        )
        batch: FormedBatch[E] = FormedBatch(entries, info, now)
        running.append(batch)
        self.batches += 1
        self.batched_items += len(entries)
        self.sizes[len(entries)] += 1
        self.reasons[reason] += 1
        self.recent.append(info)
        return batch, wake_at

    def _wait(self, wake_at: float | None) -> tuple[None, float | None]:
        """Nothing is due now: ask to be woken at ``wake_at``."""
        self.wake_at = wake_at
        return None, wake_at

    # ------------------------------------------------------------------ the controller

    # The controller is user code (a subclass, or its ``memory_headroom`` callable), called from a
    # batcher's dispatcher, worker or caller threads (or an AsyncBatcher's loop callbacks). An
    # exception from it must not escape there (it would leave entries admitted and never batched,
    # kill the dispatcher, or fail a caller's submit after its item was queued): it is logged, and
    # the batch size stays as it was.

    def _controlled_size(self, backlog: int, now: float) -> int:
        controller = self.controller
        assert controller is not None
        try:
            size = controller.update(backlog, now).batch_size
        except Exception:
            logger.exception("controller %r: update() raised; the batch size stays %d", controller, self.max_batch_size)
            return self.max_batch_size
        return _valid_size(size, self.max_batch_size)

    def _tell_controller(self, method: str, *args: Any) -> bool:
        try:
            getattr(self.controller, method)(*args)
        except Exception:
            logger.exception("controller %r: %s() raised; ignored", self.controller, method)
            return False
        return True

    # ------------------------------------------------------------------ batches out

    def complete(self, batch: FormedBatch[E]) -> None:
        """The batch's call returned (or it was abandoned): its slot is free again."""
        if batch in self.running:
            self.running.remove(batch)

    def record(self, batch: FormedBatch[E], ran: int, seconds: float, ok: bool, now: float) -> None:
        """Tell the controller and the breaker how a batch went: ``ran`` entries (0 when every
        caller had given up before it started), taking ``seconds``; ``ok`` False when the batch
        function raised or returned a malformed result."""
        breaker = self.circuit_breaker
        if ran == 0:
            if breaker is not None:  # if this was the half-open probe, the next batch probes instead
                breaker.release_probe()
            return
        if self.controller is not None:
            self._tell_controller("observe_batch", ran, seconds, now)
        # An abandoned batch was already counted as failed when it timed out.
        if breaker is not None and not batch.abandoned:
            breaker.record(ok, now)

    def observe_latencies(self, seconds: list[float], now: float) -> None:
        """End-to-end latencies of answered entries, for the controller's SLO guard."""
        if self.controller is not None:
            self._tell_controller("observe_latencies", seconds, now)

    def on_oom(self, size: int, now: float) -> None:
        """A batch of ``size`` ran out of memory: the controller lowers its ceiling."""
        if self.controller is not None and self._tell_controller("on_oom", size, now):
            self.max_batch_size = min(self.max_batch_size, _valid_size(self.controller.batch_size, self.max_batch_size))

    def timed_out(self, now: float) -> list[FormedBatch[E]]:
        """The running batches older than ``batch_timeout_s``: marked abandoned, counted as
        failures by the breaker, and removed from :attr:`running` (their slots are free)."""
        if self.batch_timeout_s is None or not self.running:
            return []
        out = [b for b in self.running if now - b.started >= self.batch_timeout_s]
        for b in out:
            b.abandoned = True
            if self.circuit_breaker is not None:
                self.circuit_breaker.record(False, now)
            self.running.remove(b)
        return out

    # ------------------------------------------------------------------ controls

    def flush(self) -> None:
        """Make everything waiting now due (``FlushReason.FLUSH``), without waiting."""
        self._flush_seq = self.queue.seq

    def close(self) -> None:
        """From now on every waiting entry is due (``FlushReason.CLOSE``): drain."""
        self.closing = True

    def drain(self, now: float) -> list[E]:
        """Take every waiting entry out without forming batches (a close without drain): the
        queue counts them cancelled, not served."""
        return self.queue.discard_all(now)  # type: ignore[return-value]

    @property
    def finished(self) -> bool:
        """Closing, nothing waiting and nothing running: the driver may stop."""
        return self.closing and self.queue.depth == 0 and not self.running

    def __repr__(self) -> str:
        return (
            f"<BatchFormer waiting={self.queue.depth} running={len(self.running)} "
            f"max_batch_size={self.max_batch_size} max_wait_ms={self.max_wait_ms:g}>"
        )


def _min_time(a: float | None, b: float) -> float:
    """The earlier of two wake-up times, ``a`` possibly None (no wake-up of its own)."""
    return b if a is None else min(a, b)


def _valid_size(size: object, current: int) -> int:
    """A controller's batch size if it is an int >= 1 (a float is truncated), else ``current``
    (logged): a bad size must not stall or crash the batcher."""
    if isinstance(size, float) and math.isfinite(size):
        size = int(size)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        logger.error("controller gave batch size %r (not an int >= 1); the batch size stays %d", size, current)
        return current
    return size


def _check_key(key: Hashable) -> None:
    """Refuse a group key that is not equal to itself (``float("nan")``) or whose comparison
    raises: its entries would never be found again to form a batch."""
    try:
        same = bool(key == key)
    except Exception as exc:
        raise ValueError(
            f"group key {key!r} cannot be compared with itself ({exc!r}); group_by must return a value equal to itself"
        ) from exc
    if not same:
        raise ValueError(
            f"group key {key!r} is not equal to itself (a NaN?); group_by must return a value equal to itself"
        )

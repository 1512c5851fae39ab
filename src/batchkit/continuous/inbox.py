"""Inbox: where callers hand requests and aborts to the decode loop's engine, under one lock.

Callers on any thread put requests in (``max_waiting`` lets a prompt's samples in together or
refuses them together) and ask for aborts; the engine takes both at each step boundary. The
inbox also holds the engine's lifecycle: which thread runs it (started here on the first
request, or claimed by a thread of the caller's), closing, and stopped. It never touches the
scheduler's lists: it reads how many requests wait there and how many seats are free.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Container, Hashable, Sequence
from typing import Any, NamedTuple

from .._clock import Clock
from .._errors import BatcherClosed, QueueFull
from .options import RequestOptions
from .request import Request
from .sampling import SamplingParams
from .scheduler import Scheduler
from .stream import RequestStream

__all__ = ["Arrival", "Inbox", "Taken"]

Arrival = tuple[Request, RequestStream]


class Taken(NamedTuple):
    """What the engine takes from the inbox at a step boundary: the requests submitted since the
    last, the aborts asked for; with ``closing``, the requests left unadmitted by a close."""

    arrivals: list[Arrival]
    aborts: list[Hashable]
    closing: bool


def _no_room(waiting: int, seats: int, num_samples: int, max_waiting: int) -> str:
    """QueueFull's message: ``num_samples`` more would leave more than ``max_waiting`` requests
    waiting beyond the ``seats`` free now (the next step admits that many waiting requests)."""
    are = "request is" if waiting == 1 else "requests are"
    free = "seat" if seats == 1 else "seats"
    these = "this request" if num_samples == 1 else f"these {num_samples} samples"
    return (
        f"{waiting} {are} already waiting, {max(0, waiting - seats)} of them beyond the {seats} free decode {free} "
        f"(max_waiting={max_waiting} bounds those beyond the seats): no room for {these}; retry later, raise "
        "max_waiting, or add capacity"
    )


class Inbox:
    """The requests and aborts on their way to the engine, the lock that guards them, and the
    engine's lifecycle.

    Args:
        scheduler: the scheduler the engine adds the requests to (read only: its waiting
            requests and free seats count against ``max_waiting``).
        clock: when a request is submitted (its deadline counts from then).
        max_waiting: most requests waiting beyond the free seats (None: unbounded).
        serve: the engine's body, run in a thread started on the first request; None: a thread
            of the caller's claims the engine (:meth:`claim`).
    """

    def __init__(
        self, scheduler: Scheduler, clock: Clock, max_waiting: int | None, serve: Callable[[], None] | None
    ) -> None:
        self.scheduler = scheduler
        self.clock = clock
        self.max_waiting = max_waiting
        self._serve = serve
        self._cond = threading.Condition(threading.Lock())
        self._arrivals: list[Arrival] = []
        self._admitting: list[Arrival] = []  # taken by the engine, not yet in the scheduler
        self._aborts: list[Hashable] = []
        self._next_id = 0
        self.closing = False
        self.thread: threading.Thread | None = None  # the engine's, once one runs it
        self.stopped = threading.Event()  # set when the engine has ended

    def __len__(self) -> int:
        """Requests submitted that the engine has not taken yet."""
        return len(self._arrivals)

    def _num_waiting(self) -> int:
        """Requests not yet running (call under the lock). Those the engine took count until they
        are in the scheduler, which it adds them to under the lock: each is counted once."""
        return len(self._arrivals) + len(self._admitting) + len(self.scheduler.waiting)

    def num_waiting(self) -> int:
        """Requests waiting for admission now: submitted or preempted, not running."""
        with self._cond:
            return self._num_waiting()

    def free_seats(self) -> int:
        """``max_num_seqs`` less the running requests."""
        return max(0, self.scheduler.max_num_seqs - len(self.scheduler.running))

    def put(
        self,
        prompt: list[int],
        options: RequestOptions,
        samples: Sequence[SamplingParams],
        streams: Sequence[RequestStream],
    ) -> list[Arrival]:
        """Queue a prompt's requests (one per entry of ``samples``, each with its stream) for the
        engine in one hold of the lock; start the engine thread if none runs. The first waits
        for none, the others for the first (``Request.after``).

        Raises:
            BatcherClosed: the loop is closed. QueueFull: past ``max_waiting``.
        """
        queued: list[Arrival] = []
        with self._cond:
            if self.closing:
                raise BatcherClosed("the decode loop is closed")
            if self.max_waiting is not None:
                waiting, seats = self._num_waiting(), self.free_seats()
                # The free seats take waiting requests first (this one's samples included).
                if waiting + len(samples) - seats > self.max_waiting:
                    raise QueueFull(_no_room(waiting, seats, len(samples), self.max_waiting))
            deadline = None if options.deadline_s is None else self.clock.now() + options.deadline_s
            after: Request | None = None
            for params, stream in zip(samples, streams, strict=True):
                self._next_id += 1
                req = Request(
                    self._next_id, prompt, params, priority=options.priority, tenant=options.tenant, deadline=deadline
                )
                req.after = after
                after = after or req
                queued.append((req, stream))
            self._arrivals += queued
            if self.thread is None and self._serve is not None:
                self.thread = threading.Thread(target=self._serve, name="batchkit-decode-loop", daemon=True)
                self.thread.start()
            self._cond.notify()
        return queued

    def abort(self, request_id: Hashable) -> None:
        """Ask the engine to abort ``request_id`` at its next step boundary."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def take_aborts(self) -> list[Hashable]:
        """The aborts asked for since they were last taken."""
        with self._cond:
            aborts, self._aborts = self._aborts, []
        return aborts

    def take(self, has_work: Callable[[], bool]) -> Taken:
        """Wait until there is news (an arrival, an abort, a close, or ``has_work()``), then take
        it; the new arrivals count as waiting until :meth:`hand_over` adds them."""
        with self._cond:
            while not (self._arrivals or self._aborts or self.closing or has_work()):
                self._cond.wait()
            arrivals, self._arrivals = self._arrivals, []
            if self.closing:
                return Taken(arrivals, [], True)
            aborts, self._aborts = self._aborts, []
            self._admitting = arrivals
        return Taken(arrivals, aborts, False)

    def hand_over(self, add: Callable[[], list[Any]]) -> list[Any]:
        """Run ``add`` (the engine adding the arrivals it took to the scheduler) under the lock,
        so that :meth:`num_waiting` counts each of them once; what it returns."""
        with self._cond:
            out = add()
            self._admitting = []
        return out

    def wait_for_news(self, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds, woken early by a request, an abort or a close."""
        with self._cond:
            self._cond.wait(timeout)

    def close(self) -> tuple[threading.Thread | None, list[Arrival]]:
        """Refuse new requests and wake the engine to end; the engine's thread (None if none ran)
        and, when none ran, the requests it leaves in the inbox (no one else will end them)."""
        with self._cond:
            self.closing = True
            self._cond.notify_all()
            orphans: list[Arrival] = []
            if self.thread is None:
                orphans, self._arrivals = self._arrivals, []
            return self.thread, orphans

    def fail(self, admitted: Container[Hashable]) -> list[Arrival]:
        """Close after a fault of the engine: the arrivals the scheduler has not seen (those in
        the inbox, and those being taken from it that are not in ``admitted``)."""
        with self._cond:
            self.closing = True
            left = self._arrivals + [(r, s) for r, s in self._admitting if r.request_id not in admitted]
            self._arrivals, self._admitting = [], []
        return left

    def claim(self, caller: str) -> None:
        """Make the calling thread the engine's, or raise why it cannot be.

        Raises:
            RuntimeError: the loop starts its own engine thread, or the engine already runs.
            BatcherClosed: the engine ran and stopped.
        """
        if self._serve is not None:
            raise RuntimeError(f"{caller}() needs a loop made with engine='caller'; this one runs its own thread")
        with self._cond:
            if self.thread is not None:
                if self.stopped.is_set():
                    raise BatcherClosed(
                        f"the decode loop is closed: its engine ran in thread {self.thread.name!r} and stopped; "
                        "make a new loop"
                    )
                raise RuntimeError(f"the engine already runs in thread {self.thread.name!r}")
            self.thread = threading.current_thread()

    def check_stepper(self) -> None:
        """Refuse a thread that would step the scheduler beside the engine's.

        Raises:
            BatcherClosed: closed before any engine ran (close aborted what was left).
            RuntimeError: another thread runs the engine.
        """
        engine = self.thread
        if engine is None and self.closing:
            raise BatcherClosed("the decode loop was closed: step_once() has nothing left to run")
        if engine is not None and engine is not threading.current_thread() and engine.is_alive():
            raise RuntimeError(
                f"the engine runs in thread {engine.name!r}; step_once() drives a loop whose generate()/"
                "submit() API is unused (add requests with scheduler.add), or use engine='caller'"
            )

"""BatchThreads: the dispatcher thread and the worker threads that carry out a former's plan.

:class:`~batchkit.DynamicBatcher` admits requests and answers callers; these threads decide
nothing themselves, they ask its :class:`~batchkit.dynamic.former.BatchFormer` (under the batcher's lock):

- the dispatcher sleeps until the former's ``wake_at`` (or until :meth:`BatchThreads.wake` or
  :meth:`BatchThreads.nudge` says the plan changed), expires deadlines, times out batches past
  ``batch_timeout_s`` (replacing their stuck workers) and hands due batches to the workers;
  with nothing queued it sleeps until woken, or, if requests came since it last slept, for one
  ``max_wait_ms`` (under steady traffic the next batch's first arrival then need not wake it:
  a thread switch saved per batch);
- ``max_concurrent_batches`` workers each run a batch (the batcher's ``run``), free its slot and,
  if the next batch is already due, run it straight away (no hop through the dispatcher);
- a clock that moves only when told (:class:`~batchkit.testing.MockClock`) wakes the dispatcher
  through its listener instead of a timed sleep.

They start on the first submit and end when the former is finished (closed and drained).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from queue import SimpleQueue
from time import monotonic as _monotonic
from typing import Any

from .._clock import Clock, ListenableClock
from .._waiters import wait_limit
from ._queue_core import Drop
from .former import BatchFormer, FormedBatch

__all__ = ["BatchThreads"]

logger = logging.getLogger(__name__)

# The shortest wait the dispatcher wakes after, unasked, while requests flow: at most 200 timed
# wakes a second. A shorter max_wait_ms would have it wake more often than batches form (1 ms
# cost 1,000 wakes a second against about 360 batches of 512 in benchmarks/overhead.py); there,
# it sleeps until an arrival wakes it.
_MIN_TICK_S = 0.005


class BatchThreads:
    """The threads of one batcher (see the module docstring).

    Args:
        name: the batcher's name, in the threads' names.
        former: the plan; read and changed only under ``mutex``.
        mutex: the batcher's lock (its queue's mutex).
        clock: the batcher's clock.
        workers: how many batches may run at once.
        run: ``run(batch)`` runs a batch and answers its callers (called without the lock).
        resolve_drops: answers entries that left the queue unserved (called without the lock).
        timed_out: ``timed_out(batch)`` answers the callers of a batch past ``batch_timeout_s``
            and cancels its call if it can (called without the lock).
    """

    def __init__(
        self,
        name: str,
        former: BatchFormer[Any],
        mutex: threading.Lock,
        clock: Clock,
        workers: int,
        *,
        run: Callable[[FormedBatch[Any]], None],
        resolve_drops: Callable[[Sequence[Drop]], None],
        timed_out: Callable[[FormedBatch[Any]], None],
    ) -> None:
        self._name = name
        self._former = former
        self._mutex = mutex
        self._clock = clock
        self._size = workers
        self._run = run
        self._resolve_drops = resolve_drops
        self._timed_out = timed_out
        self._cond = threading.Condition(mutex)
        self._work: SimpleQueue[FormedBatch[Any] | None] = SimpleQueue()
        self.dispatcher: threading.Thread | None = None
        """The dispatcher thread, once started."""
        self.workers: list[threading.Thread] = []
        """The worker threads now in service (a stuck one replaced after a timeout leaves it)."""
        self._idle = False  # the dispatcher sleeps on the condition
        self._until: float | None = None  # when an idle dispatcher wakes (None: when told)

    @property
    def idle(self) -> bool:
        """Whether the dispatcher sleeps now (until the former's ``wake_at``, or until woken)."""
        return self._idle

    def start(self) -> None:
        """Start the dispatcher and the workers (lock held; once)."""
        self.dispatcher = threading.Thread(
            target=self._dispatch_loop, name=f"batchkit-dispatch-{self._name}", daemon=True
        )
        for _ in range(self._size):
            self._spawn_worker()
        if isinstance(self._clock, ListenableClock):
            self._clock.add_listener(self._cond)
        self.dispatcher.start()

    def dispatch_due(self) -> list[Drop]:
        """(lock held) Hand every batch due now straight to the workers, from the thread that
        made it due, and wake the dispatcher only if it must now wake sooner than it planned: a
        full batch costs one thread switch (to a worker), not two. Returns the expired entries."""
        former = self._former
        now = self._clock.now()
        drops = former.expire(now)
        batch, wake_at = former.next_batch(now)
        while batch is not None:
            self._work.put(batch)
            batch, wake_at = former.next_batch(now)
        self.nudge(wake_at)
        return drops

    def nudge(self, wake_at: float | None) -> None:
        """(lock held) Wake an idle dispatcher if ``wake_at`` comes before the time it sleeps
        until, or if the former is closing (the dispatcher must see the end)."""
        if not self._idle:
            return  # it is awake and will ask the former itself
        until = self._until
        if self._former.closing or (wake_at is not None and (until is None or wake_at < until)):
            self.wake()

    def wake(self) -> None:
        """(lock held) Have the dispatcher ask the former again now (flush, a new limit, close)."""
        self._idle = False
        self._cond.notify_all()

    def owns(self, thread: threading.Thread) -> bool:
        """Whether ``thread`` is the dispatcher or a worker."""
        return thread is self.dispatcher or thread in self.workers

    def join(self, timeout: float | None) -> bool:
        """Wait for every thread to end, at most ``timeout`` seconds in all (one deadline however
        many threads); whether some are still running (stuck in a batch function)."""
        if self.dispatcher is None:
            return False
        deadline = None if timeout is None else _monotonic() + timeout
        stuck = False
        for t in [self.dispatcher, *self.workers]:
            t.join(None if deadline is None else wait_limit(deadline - _monotonic()))
            stuck = stuck or t.is_alive()
        return stuck

    def _spawn_worker(self) -> None:
        w = threading.Thread(target=self._work_loop, name=f"batchkit-worker-{self._name}", daemon=True)
        self.workers.append(w)
        w.start()

    def _dispatch_loop(self) -> None:
        # A clock that moves only when told wakes this thread through its listener; the real
        # clock is slept on until the former's wake_at.
        mock = isinstance(self._clock, ListenableClock)
        former = self._former
        seen = -1  # the queue's arrival count when this thread last slept for its wait
        try:
            while True:
                drops: list[Drop]
                timed_out: list[FormedBatch[Any]] = []
                with self._mutex:
                    while True:
                        now = self._clock.now()
                        drops = former.expire(now)
                        timed_out = self._check_timeouts(now)
                        batch, wake_at = former.next_batch(now)
                        if batch is not None or drops or timed_out:
                            break
                        if former.finished:
                            for _ in self.workers:
                                self._work.put(None)
                            return
                        wait_s = former.max_wait_ms / 1000
                        if wake_at is None and not mock and wait_s >= _MIN_TICK_S and former.queue.seq != seen:
                            # Requests came since the last sleep: more will. Wake after one wait
                            # rather than be woken by the next first arrival (which would
                            # cost its caller a thread switch for each batch).
                            seen = former.queue.seq
                            wake_at = now + wait_s
                        self._idle = True
                        self._until = None if mock else wake_at
                        if wake_at is None or mock:
                            self._cond.wait(None if not mock else 1.0)
                        else:  # an infinite (or huge) wake_at sleeps until told
                            self._cond.wait(wait_limit(wake_at - now))
                        self._idle = False
                if drops:
                    self._resolve_drops(drops)
                for b in timed_out:
                    self._timed_out(b)
                if batch is not None:
                    self._work.put(batch)
        except BaseException:  # pragma: no cover - a bug here must not hang callers silently
            logger.exception("batchkit dispatcher crashed")
            raise
        finally:
            if isinstance(self._clock, ListenableClock):
                self._clock.remove_listener(self._cond)

    def _check_timeouts(self, now: float) -> list[FormedBatch[Any]]:
        """Batches past ``batch_timeout_s`` (lock held): the former frees their slots; each
        stuck worker is replaced (it leaves when, if, its call returns)."""
        out = self._former.timed_out(now)
        for b in out:
            if b.runner in self.workers:
                self.workers.remove(b.runner)
            self._spawn_worker()
        return out

    def _work_loop(self) -> None:
        batch = self._work.get()
        while batch is not None:
            self._run(batch)
            with self._mutex:
                # Under the lock that times batches out: a batch that timed out after its call
                # returned has had this worker replaced (and dropped from the workers close joins
                # and stops); a worker that carried on would be one too many for the stop.
                if batch.abandoned:
                    return  # a replacement worker took this one's place
                self._former.complete(batch)
                # Keep the model busy: if the next batch is already due, run it from here rather
                # than handing it through the dispatcher thread (two thread switches saved).
                now = self._clock.now()
                drops = self._former.expire(now)
                nxt, wake_at = self._former.next_batch(now)
                if nxt is None:  # the freed slot may make a waiting batch due sooner
                    self.nudge(wake_at)
            if drops:
                self._resolve_drops(drops)
            batch = nxt if nxt is not None else self._work.get()

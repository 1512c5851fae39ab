"""LoopPump: a former's plan carried out from callbacks of one asyncio event loop.

The on-loop counterpart of :class:`~batchkit.dynamic._threads.BatchThreads`, for
:class:`~batchkit.AsyncBatcher`: no thread, no lock. When an arrival, a freed slot, a flush or a
new limit may change the plan, :meth:`LoopPump.soon` schedules one :meth:`LoopPump.pump` with
``call_soon`` (however many ask in one loop iteration); the pump expires deadlines, times out
batches past ``batch_timeout_s``, starts every due batch, and arms one loop timer at the former's
``wake_at``. A clock that moves only when told (:class:`~batchkit.testing.MockClock`) calls the
pump through its listener instead of a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .._clock import Clock, ListenableClock
from ._queue_core import Drop
from .former import BatchFormer, FormedBatch

__all__ = ["LoopPump"]


class _LoopWake(threading.Condition):
    """What a :class:`ListenableClock` notifies when it advances: a call of the pump on the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pump: Callable[[], None]) -> None:
        super().__init__()
        self._loop = loop
        self._pump = pump

    def notify_all(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._pump)


class LoopPump:
    """Drives ``former`` on one event loop (see the module docstring).

    Args:
        former: the plan.
        clock: the batcher's clock; ``now`` its (possibly faster) reading.
        start: ``start(batch)`` starts a due batch (as a task of the loop).
        resolve_drops: answers entries that left the queue unserved.
        timed_out: ``timed_out(batch)`` answers the callers of a batch past ``batch_timeout_s``
            and cancels it.
    """

    def __init__(
        self,
        former: BatchFormer[Any],
        clock: Clock,
        now: Callable[[], float],
        *,
        start: Callable[[FormedBatch[Any]], None],
        resolve_drops: Callable[[Sequence[Drop]], None],
        timed_out: Callable[[FormedBatch[Any]], None],
    ) -> None:
        self._former = former
        self._clock = clock
        self._now = now
        self._start = start
        self._resolve_drops = resolve_drops
        self._timed_out = timed_out
        self.loop: asyncio.AbstractEventLoop | None = None
        """The loop it pumps on (None until :meth:`bind`)."""
        self.finished: asyncio.Event | None = None
        """Set when the former is finished (closed, drained, nothing running)."""
        self._soon = False  # a pump is scheduled
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._listener: _LoopWake | None = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Pump on ``loop`` from now on: whatever was scheduled on an earlier (closed) loop will
        never run, so start afresh."""
        self.stop()
        self.loop = loop
        self._soon = False
        self._timer_at = None
        self.finished = asyncio.Event()
        if isinstance(self._clock, ListenableClock):
            self._listener = _LoopWake(loop, self.pump)
            self._clock.add_listener(self._listener)

    def soon(self) -> None:
        """Pump once in this loop iteration's callbacks (on the loop's thread)."""
        if not self._soon and self.loop is not None:
            self._soon = True
            self.loop.call_soon(self.pump)

    def soon_threadsafe(self) -> None:
        """:meth:`soon`, from any thread (a tuner's); nothing if the loop is gone."""
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self.soon()
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self.soon)

    def pump(self) -> None:
        """Expire, time out, start every due batch, and set the timer for the next decision."""
        self._soon = False
        former = self._former
        now = self._now()
        drops = former.expire(now)
        if drops:
            self._resolve_drops(drops)
        for b in former.timed_out(now):
            self._timed_out(b)
        while True:
            batch, wake_at = former.next_batch(now)
            if batch is None:
                break
            self._start(batch)
        if former.finished:
            if self.finished is not None:
                self.finished.set()
            return
        self._arm(wake_at, now)

    def stop(self) -> None:
        """No more timed or clock-driven pumps (closing, or moving to another loop)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._listener is not None and isinstance(self._clock, ListenableClock):
            self._clock.remove_listener(self._listener)
            self._listener = None

    def _arm(self, wake_at: float | None, now: float) -> None:
        """Have the pump run again at ``wake_at`` (clock time); a mock clock wakes it instead."""
        if wake_at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = wake_at
        if wake_at is None or self._listener is not None:
            return
        loop = self.loop
        assert loop is not None
        self._timer = loop.call_at(loop.time() + max(wake_at - now, 0.0), self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = None
        self.pump()

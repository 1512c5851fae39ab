"""LoopThread: the event loop, in a thread of its own, on which a DynamicBatcher awaits an ``async
def`` batch function.

The batcher's worker threads block in :meth:`LoopThread.run` while the call runs on the loop
(anyio's blocking portal), so that many calls can be in flight on one loop. The loop starts with
the first call and ends once, at :meth:`LoopThread.stop`; a call after the stop, or one that the
stop cut short, raises :class:`BatcherClosed` with the stop's reason.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from .._errors import BatcherClosed

__all__ = ["LoopThread"]


class LoopThread:
    """An event loop in a thread of its own, started on first use (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cm: Any = None
        self._portal: Any = None
        self.thread: threading.Thread | None = None  # the loop's thread, once started
        self.stopped: str | None = None  # why it stopped: no call may start after that

    def run(
        self,
        fn: Callable[[list[Any]], Awaitable[Any]],
        items: list[Any],
        started: Callable[[concurrent.futures.Future[Any]], None],
    ) -> Any:
        """Await ``fn(items)`` on the loop and return its result (or raise its exception);
        ``started`` is handed the call's future as soon as it exists, to cancel it.

        Raises:
            BatcherClosed: the loop was stopped before or during the call.
        """
        try:
            call = self._started_portal().start_task_soon(_guarded, fn, items)
            started(call)
            result = call.result()
        except (concurrent.futures.CancelledError, RuntimeError):
            if self.stopped is not None:  # stop() under this call
                raise BatcherClosed(self.stopped) from None
            raise
        if type(result) is _Raised:
            raise result.exc
        return result

    def _started_portal(self) -> Any:
        portal = self._portal
        if portal is not None:
            return portal
        with self._lock:
            if self.stopped is not None:
                raise BatcherClosed(self.stopped)
            if self._portal is None:
                self._cm = anyio.from_thread.start_blocking_portal()
                self._portal = self._cm.__enter__()
                self.thread = self._portal.call(threading.current_thread)
            return self._portal

    def stop(self, reason: str, *, cancel_running: bool) -> None:
        """End the loop (if it started), and refuse later calls with ``reason``. With
        ``cancel_running``, the calls still running are cancelled rather than waited for; a call
        that blocks its event loop cannot be cancelled and keeps the thread alive."""
        with self._lock:
            self.stopped = reason
            portal, cm = self._portal, self._cm
            self._portal = self._cm = None
        if cm is None:
            return
        if cancel_running:
            with contextlib.suppress(RuntimeError):  # already stopped
                portal.call(portal.stop, True)
        cm.__exit__(None, None, None)


@dataclass(frozen=True, slots=True)
class _Raised:
    """A BaseException that is not an Exception, carried out of the portal as a value."""

    exc: BaseException


async def _guarded(fn: Callable[[list[Any]], Awaitable[Any]], items: list[Any]) -> Any:
    """Await the batch function in the portal. KeyboardInterrupt, SystemExit or GeneratorExit
    raised there would stop the portal's event loop (anyio re-raises what is not an Exception) and
    every later batch with it: return it boxed, for the worker thread to raise to this batch's
    callers only. Cancellation (close(timeout=)) still propagates."""
    try:
        return await fn(items)
    except (KeyboardInterrupt, SystemExit, GeneratorExit) as exc:
        return _Raised(exc)

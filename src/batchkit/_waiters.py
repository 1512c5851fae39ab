"""One-shot waiters that any thread can wake: the bridge between batchkit's worker threads and
the caller's world (a blocked thread, an asyncio task or a trio task).

anyio has no non-blocking way to wake a task from a foreign thread (``from_thread.run_sync``
waits for the event loop to answer, which would stall a batch's delivery on the slowest caller
loop), so this is the one module that speaks to the backends directly: an asyncio task parks on
a bare future of its loop, a trio task on a trio event, each woken with its loop's thread-safe
"call soon". Everything else in batchkit goes through anyio or :mod:`threading`.

Wakes are grouped per event loop (:func:`wake_all`), so delivering a batch of 512 results to one
loop costs one cross-thread call, not 512.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Generator, Iterable
from typing import Any

import anyio

__all__ = ["AsyncWaiter", "ThreadWaiter", "Waiter", "new_async_waiter", "wait_limit", "wake_all"]

_allocate_lock = threading.Lock


class ThreadWaiter:
    """Parks a thread until woken: a lock taken at creation and released by ``wake``.

    A bare lock is the cheapest parking primitive CPython has (no condition, no waiter list).
    """

    __slots__ = ("_lock", "woken")

    def __init__(self) -> None:
        self._lock = _allocate_lock()
        self._lock.acquire()
        self.woken = False

    def wake(self) -> None:
        if not self.woken:
            self.woken = True
            self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until woken (True) or ``timeout`` seconds pass (False). A ``timeout`` beyond
        what the platform can wait for (``math.inf``) waits without a limit."""
        limit = wait_limit(timeout)
        if self._lock.acquire(timeout=-1 if limit is None else limit):
            self._lock.release()
            return True
        return False


class _TrioWaiter:
    """Parks one trio task; woken from any thread."""

    __slots__ = ("_event", "loop_key")

    def __init__(self) -> None:
        import trio

        self.loop_key: Any = trio.lowlevel.current_trio_token()
        self._event = trio.Event()

    def _set_in_loop(self) -> None:
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def __await__(self) -> Generator[Any, None, None]:
        return self._event.wait().__await__()


def wait_limit(timeout: float | None) -> float | None:
    """``timeout`` seconds as ``threading`` waits (``Condition.wait``, ``Thread.join``) take
    them: None (no limit) for None and for spans beyond ``threading.TIMEOUT_MAX``, which they
    refuse with an OverflowError (``math.inf`` means "no limit"); at least 0 otherwise."""
    if timeout is None or timeout >= threading.TIMEOUT_MAX:
        return None
    return max(timeout, 0.0)


# An asyncio waiter is a bare future of the caller's loop: awaiting it is as cheap as it gets.
AsyncWaiter = asyncio.Future
Waiter = ThreadWaiter | asyncio.Future | _TrioWaiter  # type: ignore[type-arg]


def new_async_waiter() -> asyncio.Future[None] | _TrioWaiter:
    """An awaitable waiter for the task running now, on whichever backend runs it."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        return loop.create_future()
    if "trio" in sys.modules:
        return _TrioWaiter()
    anyio.lowlevel.current_token()  # raises anyio's NoEventLoopError, which names the backends
    raise RuntimeError("batchkit's async API runs on asyncio or trio")  # pragma: no cover


def _set_futures(futures: list[Any]) -> None:
    for f in futures:
        if not f.done():
            f.set_result(None)


def _set_trio(waiters: list[_TrioWaiter]) -> None:
    for w in waiters:
        w._set_in_loop()


def wake_all(waiters: Iterable[Any]) -> None:
    """Wake every waiter, with one thread-safe call per event loop involved.

    A loop that has already shut down is skipped: its callers are gone.
    """
    by_loop: dict[Any, list[Any]] = {}
    for w in waiters:
        if type(w) is ThreadWaiter:
            w.wake()
            continue
        key = w.get_loop() if isinstance(w, asyncio.Future) else w.loop_key
        group = by_loop.get(key)
        if group is None:
            by_loop[key] = [w]
        else:
            group.append(w)
    for key, group in by_loop.items():
        if isinstance(key, asyncio.AbstractEventLoop):
            if asyncio._get_running_loop() is key:
                _set_futures(group)
            else:
                with contextlib.suppress(RuntimeError):  # the loop has closed: its callers are gone
                    key.call_soon_threadsafe(_set_futures, group)
        else:
            with contextlib.suppress(RuntimeError):  # the trio run has finished
                key.run_sync_soon(_set_trio, group)

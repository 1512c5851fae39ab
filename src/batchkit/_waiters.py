"""One-shot waiters that any thread can wake: the bridge between batchkit's worker threads and
the caller's world (a blocked thread, an asyncio task or a trio task).

anyio has no non-blocking way to wake a task from a foreign thread (``from_thread.run_sync``
waits for the event loop to answer, which would stall a batch's delivery on the slowest caller
loop), so this is the one module that speaks to the backends directly: asyncio futures and
trio events, each woken with its loop's thread-safe "call soon". Everything else in batchkit
goes through anyio or :mod:`threading`.

Wakes are grouped per event loop (:func:`wake_all`), so delivering a batch of 512 results to one
loop costs one cross-thread call, not 512.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Iterable
from typing import Any

import anyio

__all__ = ["AsyncWaiter", "ThreadWaiter", "Waiter", "new_async_waiter", "wake_all"]


class ThreadWaiter:
    """Blocks a thread until woken."""

    __slots__ = ("_event",)
    loop_key: object = None

    def __init__(self) -> None:
        self._event = threading.Event()

    def wake(self) -> None:
        self._event.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    @property
    def woken(self) -> bool:
        return self._event.is_set()


class AsyncWaiter:
    """Parks one asyncio task; woken from any thread."""

    __slots__ = ("_future", "loop_key")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop_key: Any = loop
        self._future: asyncio.Future[None] = loop.create_future()

    def wake(self) -> None:
        wake_all((self,))

    def _set_in_loop(self) -> None:
        if not self._future.done():
            self._future.set_result(None)

    async def wait(self) -> None:
        await self._future

    @property
    def woken(self) -> bool:
        return self._future.done()


class _TrioWaiter:
    """Parks one trio task; woken from any thread."""

    __slots__ = ("_event", "loop_key")

    def __init__(self) -> None:
        import trio

        self.loop_key: Any = trio.lowlevel.current_trio_token()
        self._event = trio.Event()

    def wake(self) -> None:
        wake_all((self,))

    def _set_in_loop(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()

    @property
    def woken(self) -> bool:
        return self._event.is_set()


Waiter = ThreadWaiter | AsyncWaiter | _TrioWaiter


def new_async_waiter() -> AsyncWaiter | _TrioWaiter:
    """A waiter for the task running now, on whichever backend runs it."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        return AsyncWaiter(loop)
    if "trio" in sys.modules:
        return _TrioWaiter()
    # Fall back on anyio's detection so that the error names the supported backends.
    anyio.lowlevel.current_token()
    raise RuntimeError("batchkit's async API runs on asyncio or trio")  # pragma: no cover


def _set_all(waiters: list[Any]) -> None:
    for w in waiters:
        w._set_in_loop()


def wake_all(waiters: Iterable[Waiter]) -> None:
    """Wake every waiter, with one thread-safe call per event loop involved.

    A loop that has already shut down is skipped: its callers are gone.
    """
    by_loop: dict[Any, list[Any]] = {}
    for w in waiters:
        if w.loop_key is None:
            w.wake()
        else:
            by_loop.setdefault(w.loop_key, []).append(w)
    for key, group in by_loop.items():
        if isinstance(key, asyncio.AbstractEventLoop):
            if asyncio._get_running_loop() is key:
                _set_all(group)
                continue
            with contextlib.suppress(RuntimeError):  # the loop has closed: its callers are gone
                key.call_soon_threadsafe(_set_all, group)
        else:
            with contextlib.suppress(RuntimeError):  # the trio run has finished
                key.run_sync_soon(_set_all, group)

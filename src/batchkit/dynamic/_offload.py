"""OffloadThreads: the worker threads an on-loop batcher calls a plain batch function in.

With ``AsyncBatcher(offload=True)`` the loop stays free while a plain (not ``async def``) batch
function runs: each call runs in one of ``max_concurrent_batches`` threads of the batcher's own,
started on first use and the same every time (a torch model keeps one thread pool). A call that
runs past ``batch_timeout_s`` keeps its thread; later calls get fresh ones.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["OffloadThreads"]


class OffloadThreads:
    """``size`` worker threads named after ``name``, started on the first :meth:`run`."""

    def __init__(self, name: str, size: int) -> None:
        self._name = name
        self._size = size
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        # The threads of the current executor (each adds itself as it starts), joined by aclose().
        self._threads: list[threading.Thread] = []

    async def run(self, fn: Callable[[list[Any]], Any], items: list[Any]) -> Any:
        """``fn(items)`` in one of the threads, awaited on the running loop."""
        if self._executor is None:
            threads: list[threading.Thread] = []
            self._threads = threads
            self._executor = concurrent.futures.ThreadPoolExecutor(
                self._size,
                thread_name_prefix=f"batchkit-{self._name}",
                initializer=lambda: threads.append(threading.current_thread()),
            )
        result = await asyncio.get_running_loop().run_in_executor(self._executor, _call_boxed, fn, items)
        if type(result) is _GeneratorExitBox:
            raise result.exc  # raised here, not thrown into the awaiting coroutines (see _call_boxed)
        return result

    def abandon(self) -> None:
        """A call is stuck (timed out): it keeps its thread; later calls get fresh ones."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
            self._threads = []

    async def aclose(self, deadline: float | None, *, join: bool) -> None:
        """Shut the threads down; with ``join``, wait (without blocking the loop) until the idle
        ones have exited, or ``deadline`` (``time.monotonic()``) passes."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
        threads, self._threads = self._threads, []
        if join:
            await _join_idle_threads(threads, deadline)


async def _join_idle_threads(threads: Sequence[threading.Thread], deadline: float | None) -> None:
    """Wait, without blocking the loop, until the worker threads of a shut-down executor have
    exited (they were idle: each leaves as soon as it sees the shutdown), or ``deadline`` passes."""
    delay = 0.0
    while any(t.is_alive() for t in threads):
        if deadline is not None and time.monotonic() >= deadline:
            return
        await asyncio.sleep(delay)
        delay = min(0.01, delay * 2 or 0.0005)


class _GeneratorExitBox:
    __slots__ = ("exc",)

    def __init__(self, exc: GeneratorExit) -> None:
        self.exc = exc


def _call_boxed(fn: Callable[[list[Any]], Any], items: list[Any]) -> Any:
    """``fn(items)`` in an offload thread, a GeneratorExit returned boxed: thrown back into the
    awaiting task, Python would close the coroutines it awaits through instead of raising it in
    them, and the batch task would end with it unhandled."""
    try:
        return fn(items)
    except GeneratorExit as exc:
        return _GeneratorExitBox(exc)

"""RequestStream: the tokens of one request, written by the engine and read by its caller.

The engine thread pushes each :class:`TokenEvent` of a request to its stream and wakes the
caller parked on it; the caller reads it as an async iterator (:func:`read_async`), a blocking
one (:func:`read_sync`) or a future (``RequestStream.future``). It knows nothing of the
scheduler: leaving a stream early calls the ``abort`` it is given.
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Hashable, Iterator
from typing import Any

from .._waiters import ThreadWaiter, new_async_waiter
from .logprobs import TokenLogprobs
from .request import TokenEvent

__all__ = ["RequestStream", "read_async", "read_sync"]


class RequestStream:
    """The tokens of one request, produced by the engine thread and consumed by its caller."""

    __slots__ = ("detailed", "done", "error", "future", "lock", "output", "tokens", "waiter")

    def __init__(self, detailed: bool = False) -> None:
        self.lock = threading.Lock()
        # detailed: the items are TokenLogprobs (the prompt's first, then each token's), not ids.
        self.detailed = detailed
        self.tokens: deque[Any] = deque()
        self.output: list[Any] = []
        self.done = False
        self.error: BaseException | None = None
        self.waiter: Any = None
        self.future: concurrent.futures.Future[list[Any]] | None = None

    def push(self, event: TokenEvent) -> Any:
        """Record an event (engine thread); return the waiter to wake, if any."""
        with self.lock:
            if self.detailed:
                items: list[Any] = list(event.prompt_logprobs)
                if event.token is not None:
                    items.append(event.logprobs or TokenLogprobs(event.token, math.nan))
                self.tokens.extend(items)
                self.output.extend(items)
            elif event.token is not None:
                self.tokens.append(event.token)
                self.output.append(event.token)
            if event.finished:
                self.done = True
                self.error = event.error
            w, self.waiter = self.waiter, None
        if event.finished and self.future is not None and not self.future.done():
            try:
                if event.error is not None:
                    self.future.set_exception(event.error)
                else:
                    self.future.set_result(list(self.output))
            except concurrent.futures.InvalidStateError:
                pass  # the caller cancelled it after done() was checked: nobody wants the result
        return w

    def next_or_park(self, make_waiter: Callable[[], Any]) -> tuple[bool, Any, Any]:
        """``(True, item, None)`` for the next item (``item`` None at the end), or ``(False,
        None, waiter)`` with a new waiter that the next push wakes.

        Raises:
            BaseException: the error the request ended with, once its items are read.
        """
        with self.lock:
            if self.tokens:
                return True, self.tokens.popleft(), None
            if self.done:
                if self.error is not None:
                    raise self.error
                return True, None, None
            self.waiter = make_waiter()
            return False, None, self.waiter


async def read_async(
    rid: Hashable, stream: RequestStream, abort: Callable[[Hashable], None]
) -> AsyncGenerator[Any, None]:
    """A submitted request's items as they come (asyncio or trio); leaving early aborts it."""
    try:
        while True:
            ready, item, waiter = stream.next_or_park(new_async_waiter)
            if not ready:
                await waiter
                continue
            if item is None:
                return
            yield item
    finally:
        if not stream.done:
            abort(rid)


def read_sync(rid: Hashable, stream: RequestStream, abort: Callable[[Hashable], None]) -> Iterator[Any]:
    """The blocking twin of :func:`read_async`, for threads."""
    try:
        while True:
            ready, item, waiter = stream.next_or_park(ThreadWaiter)
            if not ready:
                waiter.wait()
                continue
            if item is None:
                return
            yield item
    finally:
        if not stream.done:
            abort(rid)

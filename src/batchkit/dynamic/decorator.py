"""``@batched``: the decorator form of :class:`~batchkit.DynamicBatcher`.

::

    @batchkit.batched(max_batch=8, max_wait_ms=20)
    def embed(texts: list[str]) -> list[Vector]: ...

    embed("hi")                 # blocks this thread, returns one Vector
    await embed.acall("hi")     # from async code
    embed.submit("hi")          # concurrent.futures.Future

    @batchkit.batched(max_batch=32, max_wait_ms=5)
    async def score(xs: list[Tensor]) -> list[float]: ...

    await score(x)

On a method, each instance gets its own batcher (created on first use), like Ray Serve's
``@serve.batch``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import re
import threading
import typing
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar, overload

import anyio.to_thread
from typing_extensions import Self, Unpack

from .._errors import BatcherClosed, QueueFull
from .._validate import positive_int
from ._progress import progress_bar
from .async_batcher import AsyncBatcher, enter, withdraw
from .batch_function import is_async_callable
from .batcher import DynamicBatcher
from .ledger import NO_FALLBACK
from .shell import BatcherOptions, BatcherStatistics, check_batcher_options

__all__ = ["AsyncBatchedFunction", "BatchedFunction", "batched", "progress_bar"]

T = TypeVar("T")
R = TypeVar("R")


class _Settings:
    """What @batched was given: the batch size and wait, and the batcher's other options."""

    __slots__ = ("max_batch_size", "max_wait_ms", "options")

    def __init__(self, max_batch_size: int, max_wait_ms: float, options: BatcherOptions) -> None:
        self.max_batch_size = max_batch_size
        self.max_wait_ms = max_wait_ms
        self.options = options


class _BatchedBase(Generic[T, R]):
    __name__: str  # set by functools.update_wrapper, like the other attributes of fn

    def __init__(self, fn: Callable[..., Any], settings: _Settings) -> None:
        self._fn = fn
        self._settings = settings
        self._batcher: DynamicBatcher[T, R] | None = None
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]
        # What callers pass (one item), not the batch function's list: help() and inspect show it.
        self.__signature__ = _call_signature(fn)
        # Where an instance keeps its bound copy: keyed by the qualified name, so that a subclass's
        # override and the base method it overrides (``super().f``) each get their own batcher.
        self._attr = f"__batchkit_{getattr(fn, '__qualname__', None) or getattr(fn, '__name__', 'fn')}"
        self._method_of: str | None = None  # the class that defines this method (see __set_name__)
        # A method's batcher for one instance: the class's function it was made by, and the instance.
        self._unbound: _BatchedBase[T, R] | None = None
        self._instance: object = None

    def __set_name__(self, owner: type, name: str) -> None:
        # Defined in this class's body (not a module-level function assigned to a class attribute,
        # which stays usable as a function): a method, whose calls belong to instances.
        qualname = getattr(self, "__qualname__", "")
        if qualname.startswith(owner.__qualname__ + ".") and "." not in qualname[len(owner.__qualname__) + 1 :]:
            self._method_of = owner.__qualname__

    def __reduce__(self) -> str | tuple[Any, ...]:
        # A function pickles (and copies) by reference, as a plain function does; a method's
        # batcher as its instance's method, so that an instance that used it pickles and copies
        # (the copy gets a batcher of its own on first use).
        if self._unbound is not None:
            return _method_of_instance, (self._unbound, self._instance)
        return str(getattr(self, "__qualname__", self.__name__))

    @property
    def batcher(self) -> DynamicBatcher[T, R]:
        """The :class:`DynamicBatcher` behind this function (created on first use)."""
        b = self._batcher
        if b is None:
            if self._method_of is not None:
                raise TypeError(
                    f"{self._method_of}.{self.__name__} is a @batched method: call it on an instance "
                    f"(each instance has its own batcher), not on the class"
                )
            with self._lock:
                b = self._batcher
                if b is None:
                    st = self._settings
                    b = self._batcher = DynamicBatcher(
                        self._fn, max_batch_size=st.max_batch_size, max_wait_ms=st.max_wait_ms, **st.options
                    )
        return b

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> Self: ...
    @overload
    def __get__(self, instance: object, owner: type | None = None) -> Self: ...
    def __get__(self, instance: object, owner: type | None = None) -> Self:
        if instance is None:
            return self
        if isinstance(instance, type):  # under @classmethod (Python < 3.13 chains __get__)
            raise TypeError(
                f"@batched under @classmethod is not supported ({self.__name__}): decorate a "
                "module-level function, a staticmethod or a method (one batcher per instance)"
            )
        try:
            store = instance.__dict__
        except AttributeError:
            raise TypeError(
                f"@batched on a method needs instances with a __dict__ to hold their batcher; "
                f"{type(instance).__name__} uses __slots__: add '__dict__' to its slots"
            ) from None
        # Another instance's batcher where a shallow copy (copy.copy) took the original's __dict__.
        bound = store.get(self._attr)
        if bound is None or bound._instance is not instance:
            with self._lock:
                bound = store.get(self._attr)
                if bound is None or bound._instance is not instance:
                    method = functools.partial(self._fn, instance)
                    # The method's name (a partial has none), for the batcher's errors, threads and repr.
                    functools.update_wrapper(method, self._fn)
                    bound = type(self)(method, self._settings)
                    bound._unbound, bound._instance = self, instance
                    store[self._attr] = bound
        return bound

    def submit(self, item: T, **kwargs: Any) -> concurrent.futures.Future[R]:
        """Queue ``item``; return a :class:`concurrent.futures.Future` (see ``DynamicBatcher.submit``)."""
        return self.batcher.submit(item, **kwargs)

    async def acall(self, item: T, **kwargs: Any) -> R:
        """Await the result for ``item`` from async code (asyncio or trio)."""
        return await self.batcher.asubmit(item, **kwargs)

    def flush(self) -> None:
        """Dispatch everything waiting now."""
        if self._batcher is not None:
            self._batcher.flush()

    def close(self, **kwargs: Any) -> None:
        """Drain and stop the batcher (see ``DynamicBatcher.close``); later calls raise
        :class:`~batchkit.BatcherClosed`, also when the function was never called before."""
        # A batcher that was never used is made only to be closed: it starts no thread, and it
        # makes a later call refuse like a used one does instead of starting a new batcher.
        self.batcher.close(**kwargs)

    async def aclose(self, **kwargs: Any) -> None:
        """:meth:`close` from async code."""
        await self.batcher.aclose(**kwargs)

    def statistics(self) -> BatcherStatistics:
        """The batcher's statistics snapshot."""
        return self.batcher.statistics()

    def map(
        self,
        items: Iterable[T],
        *,
        progress: bool = False,
        window: int | None = None,
        total: int | None = None,
    ) -> Iterator[R]:
        """Stream ``items`` through the batcher; yield results in input order.

        At most ``window`` items are in flight (default: four batches, capped by the queue's
        capacity), so memory stays bounded for any number of items. When the queue is full (other
        callers share it), the job waits for room, whatever the queue's ``on_full`` policy: an
        offline job slows down instead of failing with :class:`~batchkit.QueueFull`. With
        ``progress``, a progress bar is drawn on stderr (tqdm's when installed). The first failing
        item's exception is raised when its turn to be yielded comes; the items after it are
        cancelled.

        Raises:
            ValueError: at the call, for a ``window`` that is not an int >= 1 or a ``total`` that
                is not an int >= 0.
        """
        b = self.batcher
        if window is None:
            window = min(4 * b.max_batch_size, b.queue.maxsize)
        positive_int("window", window)
        if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
            raise ValueError(f"total must be an int >= 0 or None, got {total!r}")
        if total is None and hasattr(items, "__len__"):
            total = len(items)  # type: ignore[arg-type]
        return self._map(b, iter(items), progress, window, total)

    def _map(
        self, b: DynamicBatcher[T, R], it: Iterator[T], progress: bool, window: int, total: int | None
    ) -> Iterator[R]:
        bar = progress_bar(total, getattr(self, "__name__", "batched")) if progress else None
        pending: deque[concurrent.futures.Future[R]] = deque()
        try:
            for item in it:
                pending.append(_submit_waiting(b, item))
                if len(pending) >= window:
                    yield pending.popleft().result()
                    if bar is not None:
                        bar.update(1)
            while pending:
                yield pending.popleft().result()
                if bar is not None:
                    bar.update(1)
        finally:
            for f in pending:
                f.cancel()
            if bar is not None:
                bar.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {getattr(self, '__qualname__', '?')} batcher={self._batcher!r}>"


def _element(annotation: Any) -> Any:
    """``X`` of an annotation ``list[X]`` / ``Sequence[X]`` (a type or its string); else empty."""
    if isinstance(annotation, str):
        match = re.fullmatch(
            r"\s*(?:list|List|Sequence|typing\.Sequence|collections\.abc\.Sequence)\[(.+)\]\s*", annotation
        )
        return match.group(1) if match else inspect.Parameter.empty
    args = typing.get_args(annotation)
    return args[0] if len(args) == 1 else inspect.Parameter.empty


def _call_signature(fn: Callable[..., Any]) -> inspect.Signature:
    """``(item, /, *, priority=0, deadline_ms=None, fallback=..., timeout=None)`` with the item and result types
    read from ``fn``'s batch signature (``list[X]`` of items -> ``item: X``), where it has them."""
    try:
        params = list(inspect.signature(fn).parameters.values())
        returns = inspect.signature(fn).return_annotation
    except (TypeError, ValueError):  # a callable inspect cannot read
        params, returns = [], inspect.Signature.empty
    batch = params[-1].annotation if params else inspect.Parameter.empty
    result = inspect.Signature.empty
    if returns is not inspect.Signature.empty:
        inner = returns
        if isinstance(inner, str) and (m := re.fullmatch(r"\s*(?:Coroutine|Awaitable)\[.*,\s*(.+)\]\s*", inner)):
            inner = m.group(1)
        result = _element(inner)
    P = inspect.Parameter
    return inspect.Signature(
        [
            P("item", P.POSITIONAL_ONLY, annotation=_element(batch)),
            P("priority", P.KEYWORD_ONLY, default=0, annotation=int),
            P("deadline_ms", P.KEYWORD_ONLY, default=None, annotation=float | None),
            P("fallback", P.KEYWORD_ONLY, default=NO_FALLBACK, annotation=Any),
            P("timeout", P.KEYWORD_ONLY, default=None, annotation=float | None),
        ],
        return_annotation=result,
    )


def _method_of_instance(method: _BatchedBase[T, R], instance: object) -> _BatchedBase[T, R]:
    """``instance``'s batcher of ``method`` (how a method's batcher unpickles)."""
    return method.__get__(instance, type(instance))


def _submit_waiting(b: DynamicBatcher[T, R], item: T) -> concurrent.futures.Future[R]:
    """``b.submit(item)``, waiting for room while the queue is full (any ``on_full``); a closed
    batcher still raises :class:`~batchkit.BatcherClosed`."""
    q = b.queue
    while True:
        # Wait before submitting, not only after a QueueFull: under "drop_oldest" or
        # "shed_lowest_priority" a submit to a full queue evicts another caller's item instead.
        # Every freed slot and the close wake the waiters (see BoundedQueue.stop_waiting).
        while len(q) >= q.maxsize and not b.closed:
            q.wait_for_room()
        try:
            return b.submit(item)
        except QueueFull:
            pass  # another caller took the room first: wait again


class BatchedFunction(_BatchedBase[T, R]):
    """A ``def`` batch function wrapped by :func:`batched`: calling it blocks for one result."""

    def __call__(self, item: T, **kwargs: Any) -> R:
        return self.batcher(item, **kwargs)


class AsyncBatchedFunction(_BatchedBase[T, R]):
    """An ``async def`` batch function wrapped by :func:`batched`: calling it gives an awaitable.

    Awaited from tasks of an asyncio loop, the function runs on that loop, in an
    :class:`~batchkit.AsyncBatcher` (:attr:`loop_batcher`): no thread hop per batch or result.
    Awaited from trio, from a second asyncio loop while the first still runs, or through
    :meth:`submit` and :meth:`map` from threads, it runs on the :attr:`batcher`'s own event loop
    thread (a ``DynamicBatcher``'s portal). A shared ``queue=`` belongs to that ``DynamicBatcher``,
    so with one every call goes through it.
    """

    def __init__(self, fn: Callable[..., Any], settings: _Settings) -> None:
        super().__init__(fn, settings)
        self._on_loop: AsyncBatcher[T, R] | None = None
        self._owner: asyncio.AbstractEventLoop | None = None  # the loop _on_loop serves
        self._closed = False

    @property
    def loop_batcher(self) -> AsyncBatcher[T, R] | None:
        """The :class:`~batchkit.AsyncBatcher` that serves asyncio callers on their loop (None
        until the first such call)."""
        return self._on_loop

    def _batcher_here(self) -> AsyncBatcher[T, R] | None:
        """The on-loop batcher if the caller is a task of the asyncio loop it serves (or may
        serve: the first loop, or a new one after that one closed), else None (the portal)."""
        if "queue" in self._settings.options:
            return None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # trio, or no loop
            return None
        if self._owner is loop and not self._closed:
            return self._on_loop
        with self._lock:
            if self._closed:
                return None  # the portal, closed, refuses with BatcherClosed
            owner = self._owner
            if owner is not None and owner is not loop and not owner.is_closed():
                return None  # that loop still runs: this one shares the portal
            if self._on_loop is None:
                st = self._settings
                options: dict[str, Any] = dict(st.options)  # no "queue": see above
                self._on_loop = AsyncBatcher(
                    self._fn, max_batch_size=st.max_batch_size, max_wait_ms=st.max_wait_ms, **options
                )
            self._owner = loop
            return self._on_loop

    async def __call__(self, item: T, **kwargs: Any) -> R:
        # Decided where the call is awaited, not where the coroutine was made (asyncio.run(f(x))
        # makes it before its loop runs; a coroutine may be handed to another loop), and an
        # async def, so that frameworks that ask inspect.iscoroutinefunction see one.
        if self._closed:  # at once, also while close() still drains the on-loop batcher
            raise BatcherClosed(f"{self.batcher.name}: the batcher is closed; create a new one to submit")
        b = self._on_loop
        if b is not None and not kwargs:
            # The common case, awaited here rather than in b.submit() (one coroutine per call);
            # None unless called from a task of the owner loop, which b serves.
            entry = enter(b, item, self._owner)
            if entry is not None:
                fut = entry.future
                try:
                    return await fut  # type: ignore[no-any-return]
                except asyncio.CancelledError:
                    withdraw(b, entry)
                    raise
        b = self._batcher_here()
        if b is not None:
            return await b.submit(item, **kwargs)
        return await self.batcher.asubmit(item, **kwargs)

    async def acall(self, item: T, **kwargs: Any) -> R:
        """Await the result for ``item``: ``await f(item)``."""
        return await self(item, **kwargs)

    def flush(self) -> None:
        b, owner = self._on_loop, self._owner
        if b is not None and owner is not None and not owner.is_closed():
            if _running_loop() is owner:
                b.flush()
            else:
                owner.call_soon_threadsafe(b.flush)
        super().flush()

    def close(self, **kwargs: Any) -> None:
        """Drain and stop both batchers (see ``DynamicBatcher.close``); later calls raise
        :class:`~batchkit.BatcherClosed`. Called from a task of the loop the on-loop batcher
        serves, that batcher's close is started and not waited for (use :meth:`aclose` there)."""
        b, owner = self._close_on_loop()
        try:
            if b is not None and owner is not None:
                here = _running_loop()
                if here is owner:
                    owner.create_task(b.aclose(**kwargs))
                elif owner.is_running():
                    _wait_while_running(asyncio.run_coroutine_threadsafe(b.aclose(**kwargs), owner), owner)
                elif here is None:
                    owner.run_until_complete(b.aclose(**kwargs))
                # Else the owner is idle and another loop runs here: what waits on the owner is
                # drained when it runs again (new calls are refused already).
        finally:
            super().close(**kwargs)

    async def aclose(self, **kwargs: Any) -> None:
        b, owner = self._close_on_loop()
        if b is not None and owner is not None:
            if _running_loop() is owner:
                await b.aclose(**kwargs)
            elif owner.is_running():
                fut = asyncio.run_coroutine_threadsafe(b.aclose(**kwargs), owner)
                await anyio.to_thread.run_sync(_wait_while_running, fut, owner)
        await super().aclose(**kwargs)

    def _close_on_loop(self) -> tuple[AsyncBatcher[T, R] | None, asyncio.AbstractEventLoop | None]:
        """Refuse new on-loop calls; the on-loop batcher and its loop, if that loop can still
        run its close (a closed loop ran its last batch already)."""
        with self._lock:
            self._closed = True
            owner = self._owner
        if owner is None or owner.is_closed():
            return None, None
        return self._on_loop, owner

    def statistics(self) -> BatcherStatistics:
        """The on-loop batcher's statistics while no call went through the portal, else the
        portal's (:attr:`loop_batcher` and :attr:`batcher` give each)."""
        b = self._on_loop
        if b is not None and (self._batcher is None or self._batcher.statistics().submitted == 0):
            return b.statistics()
        return super().statistics()


def _wait_while_running(fut: concurrent.futures.Future[None], loop: asyncio.AbstractEventLoop) -> None:
    """Wait for ``fut``, a coroutine run on ``loop`` from another thread, while that loop runs: a
    loop that stops first drops it (it would never finish), and a loop that shuts down cancels it."""
    while True:
        try:
            fut.result(timeout=0.05)
            return
        except concurrent.futures.TimeoutError:
            if loop.is_closed() or not loop.is_running():
                fut.cancel()
                return
        except concurrent.futures.CancelledError:
            return


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class _Decorator:
    def __init__(self, settings: _Settings) -> None:
        self._settings = settings

    @overload
    def __call__(self, fn: Callable[[list[T]], Coroutine[Any, Any, Sequence[R]]], /) -> AsyncBatchedFunction[T, R]: ...
    @overload
    def __call__(
        self, fn: Callable[[Any, list[T]], Coroutine[Any, Any, Sequence[R]]], /
    ) -> AsyncBatchedFunction[T, R]: ...
    @overload
    def __call__(self, fn: Callable[[list[T]], Sequence[R]], /) -> BatchedFunction[T, R]: ...
    @overload
    def __call__(self, fn: Callable[[Any, list[T]], Sequence[R]], /) -> BatchedFunction[T, R]: ...
    def __call__(self, fn: Callable[..., Any], /) -> Any:
        return _wrap(fn, self._settings)


def _wrap(fn: Callable[..., Any], settings: _Settings) -> Any:
    if isinstance(fn, staticmethod | classmethod):  # it would be handed the instance or the class
        kind = type(fn).__name__
        raise TypeError(
            f"@batched over @{kind} is not supported: put @{kind} above @batched"
            if kind == "staticmethod"
            else "@batched over @classmethod is not supported: decorate a module-level function, "
            "a staticmethod or a method (one batcher per instance)"
        )
    if not callable(fn):
        raise TypeError(f"@batched decorates a function over a list of items, got {fn!r}")
    # Validate now, so that a typo fails at decoration, not at the first call; without building
    # a batcher, which would claim a `queue=` that the real one needs.
    check_batcher_options(fn, settings.max_batch_size, settings.max_wait_ms, settings.options, size_name="max_batch")
    cls = AsyncBatchedFunction if is_async_callable(fn) else BatchedFunction
    return cls(fn, settings)


@overload
def batched(fn: Callable[[list[T]], Coroutine[Any, Any, Sequence[R]]], /) -> AsyncBatchedFunction[T, R]: ...
@overload
def batched(fn: Callable[[Any, list[T]], Coroutine[Any, Any, Sequence[R]]], /) -> AsyncBatchedFunction[T, R]: ...
@overload
def batched(fn: Callable[[list[T]], Sequence[R]], /) -> BatchedFunction[T, R]: ...
@overload
def batched(fn: Callable[[Any, list[T]], Sequence[R]], /) -> BatchedFunction[T, R]: ...
@overload
def batched(
    fn: None = None,
    /,
    *,
    max_batch: int = 8,
    max_wait_ms: float = 20.0,
    **options: Unpack[BatcherOptions],
) -> _Decorator: ...
def batched(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    max_batch: int = 8,
    max_wait_ms: float = 20.0,
    **options: Unpack[BatcherOptions],
) -> Any:
    """Turn a function over a list of items into one that callers call with a single item.

    Usable bare (``@batched``) or called (``@batched(max_batch=8, max_wait_ms=20)``). Other
    keyword options are those of :class:`~batchkit.DynamicBatcher` (``max_queue``, ``on_full``,
    ``group_by``, ``size_fn``, ``max_batch_cost``, ``isolate_errors``, ...).

    A ``queue=`` is claimed by the batcher when it is created on first use; on a method, where
    each instance gets its own batcher, only one instance can use it (pass ``max_queue`` and
    ``on_full`` instead to give each its own queue).

    Raises:
        ValueError, TypeError: at decoration time, for options the batcher would refuse (see
            :func:`~batchkit.dynamic.shell.check_batcher_options`).
    """
    if "max_batch_size" in options:
        raise TypeError("@batched takes max_batch=..., not max_batch_size=...")
    positive_int("max_batch", max_batch)
    settings = _Settings(max_batch, max_wait_ms, options)
    if fn is None:
        return _Decorator(settings)
    return _wrap(fn, settings)

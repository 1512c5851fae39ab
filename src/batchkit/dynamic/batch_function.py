"""What a batcher knows of its batch function: how it is called, and what its return means.

``fn(items) -> results`` is either a plain function or an ``async def`` (:func:`is_async_callable`
tells which shell calls it how); it must return one result per item, in order, as a sequence or
an array (:func:`read_results`, :func:`malformed_results`). Nothing here calls it.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from .._errors import BatchSizeMismatch

__all__ = ["BatchFn", "is_async_callable", "malformed_results", "read_results"]

T = TypeVar("T")
R = TypeVar("R")

BatchFn = Callable[[list[T]], Sequence[R]] | Callable[[list[T]], Awaitable[Sequence[R]]]
"""A batch function: a list of items in, one result per item out (or awaited)."""


def is_async_callable(fn: object) -> bool:
    """Whether calling ``fn`` returns an awaitable (``async def``, a partial of one, or an object
    whose ``__call__`` is ``async def``)."""
    while hasattr(fn, "func"):  # functools.partial
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def malformed_results(name: str, results: object, n: int) -> BatchSizeMismatch | None:
    """The error for a batch function's return value that is not ``n`` results in a sequence
    (or an array), or None when it is well formed."""
    if isinstance(results, (str, bytes)) or (not isinstance(results, Sequence) and not _is_array(results)):
        what = type(results).__name__
        if getattr(results, "shape", None) == ():
            what = f"a 0-d {what} (one value for the whole batch)"
        elif hasattr(results, "columns"):
            what += " (a table iterates over its columns: return its rows, e.g. df.to_dict('records'))"
        return BatchSizeMismatch(
            f"{name} returned {what}, not a sequence; a batch function must return one result per input, in order"
        )
    if len(results) != n:  # type: ignore[arg-type]
        return BatchSizeMismatch(
            f"{name} returned {len(results)} results for a batch of {n}; "  # type: ignore[arg-type]
            "return exactly one result per input, in order"
        )
    return None


def read_results(name: str, results: object, n: int) -> tuple[Sequence[Any] | None, BatchSizeMismatch | None]:
    """A batch function's return for a batch of ``n`` as one result per input, in order, or the
    :class:`BatchSizeMismatch` that fails the batch's callers instead (see
    :func:`malformed_results`)."""
    error = malformed_results(name, results, n)
    if error is not None:
        return None, error
    if isinstance(results, list | tuple):
        return results, None
    return _rows(name, results, n)


def _rows(name: str, results: Any, n: int) -> tuple[list[Any] | None, BatchSizeMismatch | None]:
    """An array's (or other sequence's) results as a list, read before any caller is answered:
    one whose iteration fails or yields another count than its length fails the batch's callers
    instead of the thread answering them."""
    try:
        rows = list(results)
    except Exception as exc:  # noqa: BLE001 - a broken result type is the batch function's error
        return None, BatchSizeMismatch(f"{name} returned a {type(results).__name__} that could not be read: {exc!r}")
    if len(rows) != n:
        return None, BatchSizeMismatch(
            f"{name} returned a {type(results).__name__} of length {n} that iterates over {len(rows)} results; "
            "return a list of one result per input"
        )
    return rows, None


def _is_array(x: object) -> bool:
    """Whether ``x`` is an array of results, one per row (numpy, torch, a pandas Series...): not a
    0-d array (a single value: it has no length), nor a table whose iteration yields its column
    labels instead of its rows (a pandas DataFrame)."""
    shape = getattr(x, "shape", None)
    if shape is None or not (hasattr(x, "__len__") and hasattr(x, "__getitem__")) or hasattr(x, "columns"):
        return False
    try:
        return len(shape) >= 1
    except TypeError:
        return False

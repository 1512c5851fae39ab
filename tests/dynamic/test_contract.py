"""The request-lifecycle contract both batchers keep: one test body per rule, run over
DynamicBatcher (threads) and AsyncBatcher (one event loop), which drive the same RequestLedger."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest

import batchkit
from batchkit import AsyncBatcher, BatcherClosed, BatchSizeMismatch, DynamicBatcher
from batchkit.testing import MockClock, echo_batch

WAIT = 10.0  # seconds: the bound on every wait in this file; nothing should come near it

T = TypeVar("T")


def run(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(asyncio.wait_for(main(), WAIT))


class Shell:
    """One batcher behind the calls the contract needs, from async code."""

    def __init__(self, batcher: Any) -> None:
        self.batcher = batcher
        is_async = isinstance(batcher, AsyncBatcher)
        self.submit: Callable[..., Awaitable[Any]] = batcher.submit if is_async else batcher.asubmit

    async def close(self, *, drain: bool = True) -> None:
        await self.batcher.aclose(drain=drain)

    def statistics(self) -> Any:
        return self.batcher.statistics()


Make = Callable[..., Shell]


@pytest.fixture(params=["DynamicBatcher", "AsyncBatcher"])
def make(request: pytest.FixtureRequest) -> Make:
    """Build the batcher under test from a batch function and options."""
    cls = DynamicBatcher if request.param == "DynamicBatcher" else AsyncBatcher

    def build(fn: Callable[[list[Any]], Any], **options: Any) -> Shell:
        return Shell(cls(fn, **options))

    return build


async def until(predicate: Callable[[], bool]) -> None:
    """Yield (to the loop and the batcher's threads) until ``predicate()`` holds."""
    while not predicate():
        await asyncio.sleep(0.001)


def double(items: list[int]) -> list[int]:
    return [2 * x for x in items]


def test_a_deadline_answers_with_the_fallback(make: Make) -> None:
    """An item still waiting at its deadline resolves to its fallback, counted expired."""
    clock = MockClock()

    async def main() -> None:
        shell = make(double, max_batch_size=8, max_wait_ms=60_000, clock=clock)
        task = asyncio.ensure_future(shell.submit(1, deadline_ms=10, fallback="fb"))
        await until(lambda: shell.statistics().pending == 1)
        clock.advance(0.02)
        assert await task == "fb"
        stats = shell.statistics()
        assert (stats.expired, stats.succeeded, stats.pending) == (1, 0, 0)
        await shell.close()

    run(main)


def test_isolate_errors_splits_and_retries_so_only_the_bad_item_fails(make: Make) -> None:
    """A failing batch is split and retried: the good items get results, the bad one its error."""

    def picky(items: list[int]) -> list[int]:
        if 13 in items:
            raise ValueError("13 is bad")
        return double(items)

    async def main() -> None:
        shell = make(picky, max_batch_size=4, max_wait_ms=60_000, isolate_errors=True)
        results = await asyncio.gather(*(shell.submit(x) for x in (1, 13, 2, 3)), return_exceptions=True)
        assert results[0::2] == [2, 4]
        assert results[3] == 6
        assert isinstance(results[1], ValueError)
        stats = shell.statistics()
        assert (stats.succeeded, stats.failed) == (3, 1)
        await shell.close()

    run(main)


def test_cancel_while_waiting_leaves_statistics_holding_nothing(make: Make) -> None:
    """A caller that gives up while its item waits: nothing pending, nothing in flight."""

    async def main() -> None:
        shell = make(double, max_batch_size=8, max_wait_ms=60_000, clock=MockClock())
        task = asyncio.ensure_future(shell.submit(1))
        await until(lambda: shell.statistics().pending == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = shell.statistics()
        assert (stats.pending, stats.in_flight, stats.cancelled, stats.succeeded) == (0, 0, 1, 0)
        await shell.close()

    run(main)


def test_close_drains_what_waits_then_refuses(make: Make) -> None:
    """close() runs the waiting items; a submit after it raises BatcherClosed."""

    async def main() -> None:
        shell = make(double, max_batch_size=8, max_wait_ms=60_000, clock=MockClock())
        task = asyncio.ensure_future(shell.submit(21))
        await until(lambda: shell.statistics().pending == 1)
        await shell.close()
        assert await task == 42
        with pytest.raises(BatcherClosed):
            await shell.submit(1)
        assert shell.statistics().succeeded == 1

    run(main)


def test_close_without_drain_fails_what_waits_as_cancelled(make: Make) -> None:
    """close(drain=False): waiting items fail with BatcherClosed and count as cancelled."""

    async def main() -> None:
        shell = make(double, max_batch_size=8, max_wait_ms=60_000, clock=MockClock())
        task = asyncio.ensure_future(shell.submit(21))
        await until(lambda: shell.statistics().pending == 1)
        await shell.close(drain=False)
        with pytest.raises(BatcherClosed):
            await task
        stats = shell.statistics()
        assert (stats.pending, stats.cancelled, stats.succeeded, stats.failed) == (0, 1, 0, 0)

    run(main)


@pytest.mark.parametrize("on_full", ["reject", "block"])
@pytest.mark.parametrize("timeout", [float("nan"), -1.0, "1", True])
def test_a_timeout_that_is_not_a_wait_is_refused_whatever_the_policy(make: Make, on_full: str, timeout: object) -> None:
    """A NaN, negative or non-number ``timeout`` is a ValueError naming it, also where the queue
    would not have waited (it used to pass unnoticed there); nothing is queued."""
    shell = make(double, on_full=on_full)

    async def main() -> None:
        with pytest.raises(ValueError, match="timeout must be >= 0"):
            await shell.submit(1, timeout=timeout)
        assert shell.statistics().submitted == 0
        assert await shell.submit(2, timeout=0) == 4
        await shell.close()

    run(main)


def test_a_single_value_for_the_whole_batch_fails_its_callers_and_the_batcher_goes_on(make: Make) -> None:
    """A 0-d array (e.g. ``torch.tensor(xs).sum()``) is a BatchSizeMismatch for each caller of
    the batch; it killed the worker, and no caller, then or later, was ever answered."""
    np = pytest.importorskip("numpy")
    calls: list[int] = []

    def fn(items: list[int]) -> Any:
        calls.append(len(items))
        return np.asarray(sum(items)) if len(calls) == 1 else double(items)

    shell = make(fn, max_batch_size=2, max_wait_ms=1e6)

    async def main() -> None:
        results = await asyncio.gather(shell.submit(1), shell.submit(2), return_exceptions=True)
        assert all(isinstance(r, BatchSizeMismatch) for r in results), results
        assert "0-d ndarray" in str(results[0])
        assert list(await asyncio.gather(shell.submit(3), shell.submit(4))) == [6, 8]
        await shell.close()

    run(main)


def _dynamic(**options: Any) -> object:
    return batchkit.DynamicBatcher(echo_batch, **options)


def _async(**options: Any) -> object:
    async def fn(xs: list[int]) -> list[int]:
        return xs

    return batchkit.AsyncBatcher(fn, **options)


def _decorated(**options: Any) -> object:
    return batchkit.batched(max_batch=4, **options)(echo_batch)


MAKERS = [_dynamic, _async, _decorated]


@pytest.mark.parametrize("make", MAKERS, ids=["DynamicBatcher", "AsyncBatcher", "batched"])
@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"max_wait_ms": "5"}, "max_wait_ms"),
        ({"max_wait_ms": None}, "max_wait_ms"),
        ({"max_wait_ms": True}, "max_wait_ms"),
        ({"batch_timeout_s": "1"}, "batch_timeout_s"),
        ({"size_fn": len, "max_batch_cost": "10"}, "max_batch_cost"),
    ],
)
def test_a_limit_that_is_not_a_number_is_a_value_error_naming_it(
    make: Callable[..., object], options: dict[str, Any], name: str
) -> None:
    """A wait, cost or timeout that is not a number is refused at construction with a
    ValueError that names the argument (not a TypeError from a comparison inside)."""
    with pytest.raises(ValueError, match=name):
        make(**options)


@pytest.mark.parametrize("make", MAKERS, ids=["DynamicBatcher", "AsyncBatcher", "batched"])
@pytest.mark.parametrize("name", ["size_fn", "group_by"])
def test_size_fn_and_group_by_that_cannot_be_called_are_refused_at_construction(
    make: Callable[..., object], name: str
) -> None:
    """A ``size_fn`` or ``group_by`` that is not a function fails where the batcher is made,
    naming the option, instead of failing every submit later."""
    with pytest.raises(TypeError, match=name):
        make(**{name: 3})


@pytest.mark.parametrize("make", MAKERS, ids=["DynamicBatcher", "AsyncBatcher", "batched"])
@pytest.mark.parametrize("name", ["controller", "circuit_breaker", "clock"])
def test_a_controller_breaker_or_clock_of_the_wrong_kind_is_a_type_error_naming_it(
    make: Callable[..., object], name: str
) -> None:
    """api.md: ``controller`` is an AdaptiveBatchController, ``circuit_breaker`` a CircuitBreaker,
    ``clock`` any object with ``now()``; anything else fails at construction, naming the option
    (not with an AttributeError, or at the first failing batch)."""
    with pytest.raises(TypeError, match=name):
        make(**{name: object()})

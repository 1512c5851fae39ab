"""A controller is user code (a subclass, or its ``memory_headroom`` callable): whatever it
raises or returns, every caller is answered, the batcher keeps serving, and nothing escapes into
a thread's excepthook or leaks a thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import batchkit
from batchkit.adaptive import Decision


class _UpdateRaises(batchkit.AdaptiveBatchController):
    def update(self, queue_depth: float, now: float | None = None) -> Decision:
        raise ValueError("update")


class _ObserveRaises(batchkit.AdaptiveBatchController):
    def observe_batch(self, size: int, seconds: float, now: float | None = None) -> None:
        raise ValueError("observe_batch")

    def observe_latencies(self, seconds: Any, now: float | None = None) -> None:
        raise ValueError("observe_latencies")

    def on_oom(self, failed_batch: int, now: float | None = None) -> None:
        raise ValueError("on_oom")


class _BadSize(batchkit.AdaptiveBatchController):
    def update(self, queue_depth: float, now: float | None = None) -> Decision:
        return Decision(time=0.0, batch_size=0, reason="bad", queue_depth=queue_depth, latency_ms=0.0)


def _headroom_raises() -> float:
    raise ValueError("memory_headroom")


CONTROLLERS: dict[str, Callable[[], batchkit.AdaptiveBatchController]] = {
    "update": lambda: _UpdateRaises(target_queue=1, initial=4),
    "observe": lambda: _ObserveRaises(target_queue=1, initial=4),
    "bad_size": lambda: _BadSize(target_queue=1, initial=4),
    "memory_headroom": lambda: batchkit.AdaptiveBatchController(
        target_queue=1, initial=4, memory_headroom=_headroom_raises
    ),
}


@pytest.fixture
def escaped() -> Iterator[list[BaseException | None]]:
    seen: list[BaseException | None] = []
    old = threading.excepthook
    threading.excepthook = lambda args: seen.append(args.exc_value)
    try:
        yield seen
    finally:
        threading.excepthook = old


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


@pytest.mark.parametrize("kind", sorted(CONTROLLERS))
def test_dynamic_batcher_survives_a_failing_controller(kind: str, escaped: list[BaseException | None]) -> None:
    before = _threads()
    calls = 0

    def fn(xs: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1 and kind == "observe" and len(xs) > 1:
            raise MemoryError("first batch runs out of memory")  # split and retried; reaches on_oom
        return [x + 1 for x in xs]

    b = batchkit.DynamicBatcher(fn, max_batch_size=4, max_wait_ms=1, controller=CONTROLLERS[kind]())
    futures = [b.submit(i) for i in range(10)]
    assert [f.result(timeout=10) for f in futures] == [i + 1 for i in range(10)]
    assert b.submit(100).result(timeout=10) == 101
    b.close(timeout=10)
    s = b.statistics()
    assert s.submitted == s.succeeded == 11
    assert s.pending == s.in_flight == 0
    assert escaped == []
    assert _threads() <= before


@pytest.mark.parametrize("kind", sorted(CONTROLLERS))
def test_async_batcher_survives_a_failing_controller(kind: str) -> None:
    loop_errors: list[dict[str, Any]] = []

    async def fn(xs: list[int]) -> list[int]:
        return [x + 1 for x in xs]

    async def main() -> batchkit.BatcherStatistics:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
        b = batchkit.AsyncBatcher(fn, max_batch_size=4, max_wait_ms=1, controller=CONTROLLERS[kind]())
        results = await asyncio.wait_for(asyncio.gather(*(b.submit(i) for i in range(10))), 10)
        assert results == [i + 1 for i in range(10)]
        await asyncio.wait_for(b.aclose(), 10)
        return b.statistics()

    s = asyncio.run(main())
    assert s.submitted == s.succeeded == 10
    assert loop_errors == []

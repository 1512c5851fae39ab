"""A batch function that raises what an ordinary ``except Exception`` does not catch
(``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``, a spontaneous
``asyncio.CancelledError``): its callers get the exception, every caller is answered, and the
batcher keeps serving the next ones."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any

import pytest

import batchkit

BASE_EXCEPTIONS = [KeyboardInterrupt, SystemExit, GeneratorExit]


@pytest.mark.parametrize("exc_type", BASE_EXCEPTIONS, ids=lambda t: t.__name__)
def test_sync_batch_function_raising_a_base_exception_fails_only_its_batch(exc_type: type[BaseException]) -> None:
    calls = 0

    def fn(xs: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise exc_type("boom")
        return [x + 1 for x in xs]

    with batchkit.DynamicBatcher(fn, max_batch_size=2, max_wait_ms=60_000) as b:
        first = [b.submit(1), b.submit(2)]  # one batch, by size
        for f in first:
            with pytest.raises(exc_type):
                f.result(timeout=10)
        third = b.submit(3)
        b.flush()
        assert third.result(timeout=10) == 4
    s = b.statistics()
    assert (s.submitted, s.failed, s.succeeded) == (3, 2, 1)


@pytest.mark.parametrize("exc_type", BASE_EXCEPTIONS, ids=lambda t: t.__name__)
def test_async_def_batch_function_raising_a_base_exception_keeps_the_batcher_serving(
    exc_type: type[BaseException],
) -> None:
    calls = 0

    async def fn(xs: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise exc_type("boom")
        return [x + 1 for x in xs]

    b = batchkit.DynamicBatcher(fn, max_batch_size=2, max_wait_ms=60_000)
    try:
        first = [b.submit(1), b.submit(2)]  # one batch, by size
        for f in first:
            with pytest.raises(exc_type):
                f.result(timeout=10)
        third = b.submit(3)
        b.flush()
        assert third.result(timeout=10) == 4
    finally:
        b.close(timeout=10)


async def _raise_cancelled(xs: list[int]) -> list[int]:
    raise asyncio.CancelledError("raised by the batch function, nobody cancelled it")


def _raise_cancelled_sync(xs: list[int]) -> list[int]:
    raise asyncio.CancelledError("raised by the batch function, nobody cancelled it")


@pytest.mark.parametrize("offload", [False, True], ids=["async_def", "offload"])
def test_async_batcher_batch_function_raising_cancelled_error_answers_its_callers(offload: bool) -> None:
    fn: Any = _raise_cancelled_sync if offload else _raise_cancelled

    async def main() -> tuple[int, batchkit.BatcherStatistics]:
        b = batchkit.AsyncBatcher(fn, max_batch_size=2, max_wait_ms=1, offload=offload)
        tasks = [asyncio.ensure_future(b.submit(i)) for i in range(2)]
        _done, pending = await asyncio.wait(tasks, timeout=10)
        for t in pending:
            t.cancel()
        await asyncio.wait_for(b.aclose(timeout=5), 10)
        return len(pending), b.statistics()

    unanswered, s = asyncio.run(main())
    assert unanswered == 0
    assert (s.submitted, s.failed) == (2, 2)


def test_dynamic_batcher_async_def_raising_cancelled_error_answers_its_callers() -> None:
    with batchkit.DynamicBatcher(_raise_cancelled, max_batch_size=2, max_wait_ms=1) as b:
        futures = [b.submit(1), b.submit(2)]
        for f in futures:
            with pytest.raises((asyncio.CancelledError, concurrent.futures.CancelledError)):
                f.result(timeout=10)
    s = b.statistics()
    assert s.submitted == 2
    assert s.failed + s.cancelled == 2


def test_async_batcher_offload_generator_exit_does_not_reach_the_loop_handler() -> None:
    def fn(xs: list[int]) -> list[int]:
        raise GeneratorExit("boom")

    errors: list[dict[str, Any]] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        b = batchkit.AsyncBatcher(fn, max_batch_size=2, max_wait_ms=1, offload=True)
        results = await asyncio.wait_for(asyncio.gather(b.submit(1), b.submit(2), return_exceptions=True), 10)
        assert all(isinstance(r, GeneratorExit) for r in results)
        await asyncio.wait_for(b.aclose(), 10)

    asyncio.run(main())
    assert errors == []

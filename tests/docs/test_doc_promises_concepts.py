"""Promises of docs/concepts.md, checked as a user reads them: why a batch goes, per-item
outcomes, queue policies, cancellation, closing, threads and event loops, time, priorities."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any

import pytest

from batchkit import BatcherClosed, BatchSizeMismatch, BoundedQueue, DynamicBatcher, QueueFull
from batchkit.testing import MockClock

WAIT = 10.0


class Gate:
    """A batch function that records its batches and holds each one until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.batches: list[list[Any]] = []

    def __call__(self, xs: list[Any]) -> list[Any]:
        self.batches.append(list(xs))
        self.started.set()
        assert self.release.wait(WAIT)
        return list(xs)


def test_every_reason_a_batch_goes_is_recorded() -> None:
    """size, cost, timeout (the oldest item waited max_wait_ms), flush and close: each batch's
    reason is in statistics().flush_reasons and recent_batches()."""
    clock = MockClock()
    b = DynamicBatcher(
        lambda xs: list(xs), max_batch_size=2, max_wait_ms=50, size_fn=float, max_batch_cost=10, clock=clock
    )
    try:
        assert [f.result(WAIT) for f in [b.submit(1), b.submit(1)]] == [1, 1]  # size
        assert b.submit(10).result(WAIT) == 10  # cost
        f = b.submit(1)
        clock.advance(0.05)  # timeout
        assert f.result(WAIT) == 1
        f = b.submit(2)
        b.flush()
        assert f.result(WAIT) == 2
        f = b.submit(3)
    finally:
        b.close()  # close
    assert f.result(WAIT) == 3
    assert b.statistics().flush_reasons == {"size": 1, "cost": 1, "timeout": 1, "flush": 1, "close": 1}
    assert [info.reason for info in b.recent_batches()] == ["size", "cost", "timeout", "flush", "close"]


@pytest.mark.parametrize("bad", [None, 5, "ab", {0: 1, 1: 2}], ids=["none", "int", "str", "dict"])
def test_a_result_of_the_wrong_type_is_batch_size_mismatch_for_each_caller(bad: object) -> None:
    """A result that is not one result per input fails every caller of that batch with
    BatchSizeMismatch, and the batcher serves on."""
    fn: Any = lambda xs: bad if xs[0] != "ok" else xs  # noqa: E731 - malformed on purpose
    with DynamicBatcher(fn, max_batch_size=2, max_wait_ms=1e6, clock=MockClock()) as b:
        futures = [b.submit(1), b.submit(2)]
        for f in futures:
            with pytest.raises(BatchSizeMismatch):
                f.result(WAIT)
        assert [f.result(WAIT) for f in [b.submit("ok"), b.submit("ok")]] == ["ok", "ok"]


def test_drop_oldest_gives_the_evicted_caller_queue_full() -> None:
    """A full drop_oldest queue evicts the item that waited longest; its caller gets QueueFull,
    the newcomer is served, and statistics count the eviction as rejected."""
    gate = Gate()
    b = DynamicBatcher(gate, max_batch_size=1, max_wait_ms=0, max_queue=1, on_full="drop_oldest")
    try:
        running = b.submit(0)
        assert gate.started.wait(WAIT)
        evicted = b.submit(1)
        kept = b.submit(2)
        with pytest.raises(QueueFull):
            evicted.result(WAIT)
        gate.release.set()
        assert (running.result(WAIT), kept.result(WAIT)) == (0, 2)
    finally:
        gate.release.set()
        b.close()
    s = b.statistics()
    assert (s.submitted, s.succeeded, s.rejected) == (3, 2, 1)
    assert gate.batches == [[0], [2]]


def test_cancelling_before_dispatch_frees_the_items_slot_in_the_queue() -> None:
    """A cancelled future's item leaves the queue at once: a queue of one has room again, the
    batch function never sees it, and statistics().cancelled counts it."""
    gate = Gate()
    b = DynamicBatcher(gate, max_batch_size=1, max_wait_ms=0, max_queue=1)
    try:
        running = b.submit(0)
        assert gate.started.wait(WAIT)
        waiting = b.submit(1)
        with pytest.raises(QueueFull):
            b.submit(99)  # the queue of one is full
        assert waiting.cancel()
        after = b.submit(2)  # room again
        gate.release.set()
        assert (running.result(WAIT), after.result(WAIT)) == (0, 2)
    finally:
        gate.release.set()
        b.close()
    assert gate.batches == [[0], [2]]
    assert b.statistics().cancelled == 1


def test_close_without_drain_fails_what_waits_with_batcher_closed() -> None:
    """close(drain=False) fails the waiting items (BatcherClosed) and lets the running batch finish;
    later submits are refused with BatcherClosed."""
    gate = Gate()
    b = DynamicBatcher(gate, max_batch_size=1, max_wait_ms=0)
    running = b.submit(0)
    assert gate.started.wait(WAIT)
    waiting = b.submit(1)
    closer = threading.Thread(target=b.close, kwargs={"drain": False})
    closer.start()
    try:
        with pytest.raises(BatcherClosed):
            waiting.result(WAIT)
    finally:
        gate.release.set()
        closer.join(WAIT)
    assert running.result(WAIT) == 0
    with pytest.raises(BatcherClosed):
        b.submit(2)
    assert gate.batches == [[0]]


def test_an_async_batch_function_runs_on_asyncio_even_for_trio_callers() -> None:
    """An async def batch function runs on the batcher's own asyncio loop thread, whatever the
    callers run (here trio), never on the callers' thread."""
    trio = pytest.importorskip("trio")
    sniffio = pytest.importorskip("sniffio")
    seen: list[tuple[str, bool]] = []
    caller = threading.get_ident()

    async def double(xs: list[int]) -> list[int]:
        await asyncio.sleep(0)  # an asyncio call works here
        seen.append((sniffio.current_async_library(), threading.get_ident() == caller))
        return [2 * x for x in xs]

    with DynamicBatcher(double, max_batch_size=4, max_wait_ms=1) as b:

        async def main() -> list[int]:
            results: list[int] = []

            async def one(i: int) -> None:
                results.append(await b.asubmit(i))

            with trio.fail_after(WAIT):
                async with trio.open_nursery() as nursery:
                    for i in range(4):
                        nursery.start_soon(one, i)
            return sorted(results)

        assert trio.run(main) == [0, 2, 4, 6]
    assert seen
    assert all(s == ("asyncio", False) for s in seen)


def test_a_sync_batch_function_never_runs_on_an_event_loop() -> None:
    """With asyncio callers, a plain batch function runs in a worker thread with no running loop."""
    on_loop: list[bool] = []

    def fn(xs: list[int]) -> list[int]:
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return xs

    with DynamicBatcher(fn, max_batch_size=4, max_wait_ms=1) as b:

        async def main() -> list[int]:
            return await asyncio.wait_for(asyncio.gather(*(b.asubmit(i) for i in range(8))), WAIT)

        assert asyncio.run(main()) == list(range(8))
    assert on_loop
    assert not any(on_loop)


def test_results_reach_an_event_loop_with_one_thread_safe_call_per_batch() -> None:
    """16 asyncio callers answered by one batch cost their loop one call_soon_threadsafe."""
    with DynamicBatcher(lambda xs: list(xs), max_batch_size=16, max_wait_ms=1e6, clock=MockClock()) as b:

        async def main() -> tuple[list[int], int]:
            loop = asyncio.get_running_loop()
            calls = [0]
            original = loop.call_soon_threadsafe

            def counting(*args: Any, **kwargs: Any) -> Any:
                calls[0] += 1
                return original(*args, **kwargs)

            loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
            results = await asyncio.wait_for(asyncio.gather(*(b.asubmit(i) for i in range(16))), WAIT)
            return results, calls[0]

        results, calls = asyncio.run(main())
    assert results == list(range(16))
    assert calls == 1


def test_aging_lifts_a_long_waiting_item_and_batches_fill_level_by_level() -> None:
    """Lower priority values go first, FIFO within a level; with aging_s an item improves one level
    per aging_s of waiting: priority 1 after 2.5 s of aging_s=1 is level -1, ahead of a newer -1."""
    gate = Gate()
    clock = MockClock()
    queue: BoundedQueue[str] = BoundedQueue(100, aging_s=1.0, clock=clock)
    b = DynamicBatcher(gate, max_batch_size=2, max_wait_ms=1e6, queue=queue, clock=clock)
    try:
        busy = b.submit("busy")
        b.flush()
        assert gate.started.wait(WAIT)
        futures = [b.submit("old", priority=1)]
        clock.advance(2.5)
        futures += [b.submit("new0"), b.submit("new1"), b.submit("minus", priority=-1)]
        gate.release.set()
        assert busy.result(WAIT) == "busy"
        assert [f.result(WAIT) for f in futures] == ["old", "new0", "new1", "minus"]
    finally:
        gate.release.set()
        b.close()
    assert gate.batches == [["busy"], ["old", "minus"], ["new0", "new1"]]


def test_priority_levels_fill_a_batch_best_first_and_fifo_within_a_level() -> None:
    gate = Gate()
    b = DynamicBatcher(gate, max_batch_size=3, max_wait_ms=1e6, clock=MockClock())
    try:
        busy = b.submit("busy")
        b.flush()
        assert gate.started.wait(WAIT)
        items = [("a", 1), ("b", 0), ("c", 1), ("d", -1), ("e", 0), ("f", 1)]
        futures = [b.submit(x, priority=p) for x, p in items]
        gate.release.set()
        assert busy.result(WAIT) == "busy"
        assert [f.result(WAIT) for f in futures] == [x for x, _ in items]
    finally:
        gate.release.set()
        b.close()
    assert gate.batches == [["busy"], ["d", "b", "e"], ["a", "c", "f"]]


def test_a_put_timeout_is_a_wall_clock_bound_even_with_a_mock_clock() -> None:
    """Timeouts of blocking calls are wall-clock bounds: a writer on a full block queue gives up
    with QueueFull though the mock clock never moves."""
    gate = Gate()
    b = DynamicBatcher(gate, max_batch_size=1, max_wait_ms=0, max_queue=1, on_full="block", clock=MockClock())
    try:
        futures: list[Future[int]] = [b.submit(0)]
        assert gate.started.wait(WAIT)
        futures.append(b.submit(1))
        with pytest.raises(QueueFull, match="timeout"):
            b.submit(2, timeout=0.05)
        gate.release.set()
        assert [f.result(WAIT) for f in futures] == [0, 1]
    finally:
        gate.release.set()
        b.close()


def test_mock_clock_wakes_the_dispatcher_only_when_advanced() -> None:
    """With MockClock a partial batch waits (however long in real time) until advance() passes
    max_wait_ms, then goes with reason "timeout"."""
    clock = MockClock()
    with DynamicBatcher(lambda xs: list(xs), max_batch_size=8, max_wait_ms=100, clock=clock) as b:
        f = b.submit(1)
        done = threading.Event()
        f.add_done_callback(lambda _: done.set())
        assert not done.wait(0.05)  # a real-time wait: the virtual clock has not moved
        clock.advance(0.099)
        assert not done.wait(0.05)
        clock.advance(0.001)
        assert f.result(WAIT) == 1
        assert b.recent_batches()[-1].reason == "timeout"


def test_aclose_waits_for_the_running_batch_without_blocking_the_event_loop() -> None:
    """aclose() drains like close(), and the loop keeps running other tasks meanwhile."""
    gate = Gate()
    b = DynamicBatcher(gate, max_batch_size=1, max_wait_ms=0)

    async def main() -> tuple[int, bool]:
        caller = asyncio.ensure_future(b.asubmit(1))
        while not gate.started.is_set():
            await asyncio.sleep(0.001)
        closing = asyncio.ensure_future(b.aclose())
        for _ in range(5):
            await asyncio.sleep(0)  # other tasks run while aclose waits for the batch
        still_closing = not closing.done()
        gate.release.set()
        await asyncio.wait_for(closing, WAIT)
        return await asyncio.wait_for(caller, WAIT), still_closing

    try:
        assert asyncio.run(main()) == (1, True)
    finally:
        gate.release.set()
    assert b.closed
    with pytest.raises(BatcherClosed):
        b.submit(2)

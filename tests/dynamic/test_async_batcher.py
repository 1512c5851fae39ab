"""AsyncBatcher: the same flush policy as DynamicBatcher, driven on the callers' asyncio loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import anyio
import pytest

import batchkit
from _support import DUE_BY_REASON, DUE_BY_REASON_OPTIONS
from batchkit import (
    AsyncBatcher,
    BatcherClosed,
    BatchSizeMismatch,
    BatchTimeout,
    CircuitBreaker,
    CircuitOpen,
    DeadlineExceeded,
    QueueFull,
)
from batchkit.testing import MockClock

WAIT = 10.0  # seconds: the bound on every wait in this file; nothing should come near it

T = TypeVar("T")


def run(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    return asyncio.run(asyncio.wait_for(main(), WAIT))


async def settle() -> None:
    """Let the loop run every callback and task that is ready (the pump, batch tasks, callers)."""
    for _ in range(20):
        await asyncio.sleep(0)


class Recorder:
    """An async batch function that records its batches; ``gate`` holds calls while unset."""

    def __init__(self, fn: Callable[[int], object] = lambda x: x * 10) -> None:
        self.fn = fn
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, xs: list[int]) -> list[object]:
        self.batches.append(list(xs))
        await self.gate.wait()
        return [self.fn(x) for x in xs]


def test_a_full_batch_runs_at_once_and_each_caller_gets_its_own_result() -> None:
    """max_batch_size arrivals form one batch (reason size) without waiting for max_wait_ms."""

    async def main() -> None:
        rec = Recorder()
        b = AsyncBatcher(rec, max_batch_size=4, max_wait_ms=60_000)
        out = await asyncio.gather(*(b.submit(i) for i in range(4)))
        assert out == [0, 10, 20, 30]
        assert rec.batches == [[0, 1, 2, 3]]
        assert b.statistics().flush_reasons == {"size": 1}
        await b.aclose()

    run(main)


def test_a_partial_batch_waits_for_max_wait_ms_on_the_clock() -> None:
    """Fewer items than max_batch_size run when the oldest has waited max_wait_ms, not before."""

    async def main() -> None:
        clock = MockClock()
        rec = Recorder()
        b = AsyncBatcher(rec, max_batch_size=8, max_wait_ms=10, clock=clock)
        calls = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
        await settle()
        clock.advance(0.005)
        await settle()
        assert rec.batches == []
        clock.advance(0.005)
        assert await asyncio.gather(*calls) == [0, 10, 20]
        assert b.recent_batches()[0].reason == "timeout"
        await b.aclose()

    run(main)


def test_flush_dispatches_what_waits_without_waiting() -> None:
    """flush() makes the waiting items due now (reason flush)."""

    async def main() -> None:
        b = AsyncBatcher(Recorder(), max_batch_size=8, max_wait_ms=60_000, clock=MockClock())
        calls = [asyncio.ensure_future(b.submit(i)) for i in range(2)]
        await settle()
        b.flush()
        assert await asyncio.gather(*calls) == [0, 10]
        assert b.statistics().flush_reasons == {"flush": 1}
        await b.aclose()

    run(main)


def test_queue_shows_what_waits() -> None:
    """``queue`` is the BoundedQueue the items wait in: its length and statistics follow them."""

    async def main() -> None:
        b = AsyncBatcher(Recorder(), max_batch_size=8, max_wait_ms=60_000, max_queue=5, clock=MockClock())
        assert b.queue.maxsize == 5
        calls = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
        await settle()
        assert len(b.queue) == 3
        assert b.queue.statistics().depth == 3
        b.flush()
        assert await asyncio.gather(*calls) == [0, 10, 20]
        assert len(b.queue) == 0
        await b.aclose()

    run(main)


def test_a_plain_function_runs_on_the_loop_thread_and_offload_moves_it_off() -> None:
    """Without offload a sync batch function runs in the loop's thread; with it, in a worker
    thread, the same one for every batch."""

    async def main() -> None:
        seen: list[threading.Thread] = []

        def fn(xs: list[int]) -> list[int]:
            seen.append(threading.current_thread())
            return xs

        on_loop = AsyncBatcher(fn, max_batch_size=2, max_wait_ms=60_000)
        assert list(await asyncio.gather(on_loop.submit(1), on_loop.submit(2))) == [1, 2]
        await on_loop.aclose()
        off = AsyncBatcher(fn, max_batch_size=2, max_wait_ms=60_000, offload=True)
        for _ in range(2):
            assert list(await asyncio.gather(off.submit(1), off.submit(2))) == [1, 2]
        await off.aclose()
        assert seen[0] is threading.current_thread()
        assert seen[1] is not threading.current_thread()
        assert seen[1] is seen[2]

    run(main)


def test_an_exception_in_a_slot_fails_only_that_caller() -> None:
    """A result that is an Exception is raised to its own caller; the others get values."""

    async def main() -> None:
        b = AsyncBatcher(Recorder(lambda x: ValueError("bad") if x == 1 else x), max_batch_size=3, max_wait_ms=60_000)
        out = await asyncio.gather(*(b.submit(i) for i in range(3)), return_exceptions=True)
        assert out[0] == 0
        assert out[2] == 2
        assert isinstance(out[1], ValueError)
        st = b.statistics()
        assert (st.succeeded, st.failed) == (2, 1)
        await b.aclose()

    run(main)


def test_a_raising_batch_fails_its_callers_and_isolate_errors_narrows_it_to_the_culprit() -> None:
    """Without isolate_errors every caller of the batch sees the error; with it, only the
    failing item's caller does."""

    def fn(xs: list[int]) -> list[int]:
        if 3 in xs:
            raise RuntimeError("three")
        return xs

    async def main(isolate: bool) -> list[object]:
        b = AsyncBatcher(fn, max_batch_size=4, max_wait_ms=60_000, isolate_errors=isolate)
        out: list[object] = list(await asyncio.gather(*(b.submit(i) for i in range(4)), return_exceptions=True))
        await b.aclose()
        return out

    plain = run(lambda: main(False))
    assert all(isinstance(o, RuntimeError) for o in plain)
    isolated = run(lambda: main(True))
    assert isolated[:3] == [0, 1, 2]
    assert isinstance(isolated[3], RuntimeError)


def test_a_wrong_number_of_results_is_a_batch_size_mismatch() -> None:
    """A batch function that drops a result fails the batch with BatchSizeMismatch."""

    async def main() -> None:
        b = AsyncBatcher(lambda xs: xs[:-1], max_batch_size=2, max_wait_ms=60_000)
        out = await asyncio.gather(b.submit(1), b.submit(2), return_exceptions=True)
        assert all(isinstance(o, BatchSizeMismatch) for o in out)
        await b.aclose()

    run(main)


def test_a_cancelled_caller_leaves_the_queue_before_its_batch() -> None:
    """Cancelling a waiting caller removes its item: the batch holds only the others."""

    async def main() -> None:
        clock = MockClock()
        rec = Recorder()
        b = AsyncBatcher(rec, max_batch_size=8, max_wait_ms=10, clock=clock)
        calls = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
        await settle()
        calls[1].cancel()
        await settle()
        assert b.queue_depth() == 2
        clock.advance(0.010)
        assert await calls[0] == 0
        assert await calls[2] == 20
        assert rec.batches == [[0, 2]]
        assert b.statistics().cancelled == 1
        await b.aclose()

    run(main)


def test_a_deadline_expires_a_waiting_item_with_an_error_or_its_fallback() -> None:
    """An item still waiting at deadline_ms fails with DeadlineExceeded, or returns fallback."""

    async def main() -> None:
        clock = MockClock()
        rec = Recorder()
        b = AsyncBatcher(rec, max_batch_size=8, max_wait_ms=50, clock=clock)
        strict = asyncio.ensure_future(b.submit(1, deadline_ms=5))
        lenient = asyncio.ensure_future(b.submit(2, deadline_ms=5, fallback=-1))
        await settle()
        clock.advance(0.005)
        with pytest.raises(DeadlineExceeded):
            await strict
        assert await lenient == -1
        assert rec.batches == []
        assert b.statistics().expired == 2
        await b.aclose()

    run(main)


def test_lower_priority_values_are_served_first() -> None:
    """With more waiting than a batch holds, the batch takes the lowest priority values."""

    async def main() -> None:
        rec = Recorder()
        b = AsyncBatcher(rec, max_batch_size=2, max_wait_ms=0)
        rec.gate.clear()
        first = [asyncio.ensure_future(b.submit(i)) for i in (0, 1)]  # fills a batch, held running
        await settle()
        later = [asyncio.ensure_future(b.submit(i, priority=p)) for i, p in ((5, 2), (6, 0), (7, 1))]
        await settle()
        rec.gate.set()
        await asyncio.gather(*first, *later)
        assert rec.batches[1:] == [[6, 7], [5]]
        await b.aclose()

    run(main)


def test_items_of_different_groups_never_share_a_batch() -> None:
    """group_by keeps keys apart; a full group runs while the other waits."""

    async def main() -> None:
        rec = Recorder()
        b = AsyncBatcher(rec, max_batch_size=2, max_wait_ms=60_000, group_by=lambda x: x % 2)
        out = await asyncio.gather(*(b.submit(i) for i in range(4)))
        assert out == [0, 10, 20, 30]
        assert sorted(rec.batches) == [[0, 2], [1, 3]]
        await b.aclose()

    run(main)


def test_a_full_queue_rejects_or_makes_the_caller_wait_for_room() -> None:
    """on_full="reject" raises QueueFull; "block" admits the caller once a batch takes items,
    or raises QueueFull after its timeout."""

    async def main() -> None:
        clock = MockClock()
        rec = Recorder()
        b = AsyncBatcher(rec, max_batch_size=1, max_wait_ms=60_000, max_queue=1, clock=clock)
        rec.gate.clear()
        running = asyncio.ensure_future(b.submit(0))  # taken at once: runs, held
        await settle()
        waiting = asyncio.ensure_future(b.submit(1))  # fills the queue
        await settle()
        with pytest.raises(QueueFull):
            await b.submit(2)
        assert (b.statistics().rejected, b.statistics().submitted) == (1, 2)
        rec.gate.set()
        assert list(await asyncio.gather(running, waiting)) == [0, 10]
        await b.aclose()

        blocking = AsyncBatcher(rec, max_batch_size=1, max_wait_ms=60_000, max_queue=1, on_full="block")
        rec.gate.clear()
        held = [asyncio.ensure_future(blocking.submit(i)) for i in (0, 1)]
        await settle()
        with pytest.raises(QueueFull):
            await blocking.submit(9, timeout=0.01)
        assert blocking.statistics().rejected == 1
        third = asyncio.ensure_future(blocking.submit(2))
        await settle()
        assert not third.done()
        rec.gate.set()
        assert await asyncio.gather(*held, third) == [0, 10, 20]
        await blocking.aclose()

    run(main)


def test_close_drains_by_default_and_fails_waiting_items_without_drain() -> None:
    """aclose() runs what waits; aclose(drain=False) fails it with BatcherClosed; submits after
    close raise BatcherClosed."""

    async def main() -> None:
        clock = MockClock()
        b = AsyncBatcher(Recorder(), max_batch_size=8, max_wait_ms=60_000, clock=clock)
        calls = [asyncio.ensure_future(b.submit(i)) for i in range(2)]
        await settle()
        await b.aclose()
        assert await asyncio.gather(*calls) == [0, 10]
        with pytest.raises(BatcherClosed):
            await b.submit(5)

        c = AsyncBatcher(Recorder(), max_batch_size=8, max_wait_ms=60_000, clock=clock)
        dropped = asyncio.ensure_future(c.submit(1))
        await settle()
        await c.aclose(drain=False)
        with pytest.raises(BatcherClosed):
            await dropped
        assert c.statistics().cancelled == 1

    run(main)


def test_close_with_timeout_cancels_a_stuck_batch_and_fails_its_callers() -> None:
    """A batch still running at aclose's timeout is cancelled; its callers get BatcherClosed."""

    async def main() -> None:
        rec = Recorder()
        rec.gate.clear()
        b = AsyncBatcher(rec, max_batch_size=1, max_wait_ms=0)
        stuck = asyncio.ensure_future(b.submit(1))
        await settle()
        await b.aclose(timeout=0.01)
        with pytest.raises(BatcherClosed):
            await stuck

    run(main)


def test_batch_timeout_fails_the_callers_of_a_batch_that_runs_too_long() -> None:
    """batch_timeout_s: the callers get BatchTimeout when the clock passes it; the next batch runs."""

    async def main() -> None:
        clock = MockClock()
        rec = Recorder()
        rec.gate.clear()
        b = AsyncBatcher(rec, max_batch_size=1, max_wait_ms=0, batch_timeout_s=1.0, clock=clock)
        stuck = asyncio.ensure_future(b.submit(1))
        await settle()
        clock.advance(1.0)
        with pytest.raises(BatchTimeout):
            await stuck
        rec.gate.set()
        assert await b.submit(2) == 20
        await b.aclose()

    run(main)


def test_batch_timeout_on_the_loop_is_refused() -> None:
    """A plain function on the loop cannot be interrupted, so batch_timeout_s asks for offload."""
    with pytest.raises(ValueError, match="offload=True"):
        AsyncBatcher(lambda xs: xs, batch_timeout_s=1.0)
    AsyncBatcher(lambda xs: xs, batch_timeout_s=1.0, offload=True)


def test_offload_of_an_async_def_is_refused() -> None:
    """offload=True moves a plain function off the loop; an async def is awaited on the loop,
    so asking to offload one is a mistake, not something to ignore."""

    async def double(xs: list[int]) -> list[int]:
        return [2 * x for x in xs]

    with pytest.raises(ValueError, match="async def"):
        AsyncBatcher(double, offload=True)


def test_an_open_circuit_fails_submits_fast() -> None:
    """After failure_threshold failing batches the breaker opens and submit raises CircuitOpen."""

    def broken(xs: list[int]) -> list[int]:
        raise RuntimeError("down")

    async def main() -> None:
        breaker = CircuitBreaker(failure_threshold=2, reset_timeout_s=60, clock=MockClock())
        b = AsyncBatcher(broken, max_batch_size=1, max_wait_ms=0, circuit_breaker=breaker)
        for i in range(2):
            with pytest.raises(RuntimeError):
                await b.submit(i)
        with pytest.raises(CircuitOpen):
            await b.submit(3)
        assert b.statistics().rejected == 1
        await b.aclose()

    run(main)


def test_aclose_fails_what_waits_behind_an_open_circuit_at_once() -> None:
    """aclose() (drain) does not wait out reset_timeout_s for a probe: the items still waiting
    behind an open circuit fail with CircuitOpen, counted as cancelled (they never ran)."""

    def broken(xs: list[int]) -> list[int]:
        raise RuntimeError("down")

    async def main() -> None:
        breaker = CircuitBreaker(failure_threshold=1, reset_timeout_s=60, clock=MockClock())
        b = AsyncBatcher(broken, max_batch_size=1, max_wait_ms=0, circuit_breaker=breaker)
        calls = [asyncio.ensure_future(b.submit(i)) for i in range(5)]
        await settle()
        assert calls[0].done()
        assert breaker.state == "open"
        assert not any(c.done() for c in calls[1:])
        await b.aclose()
        errors = [type(e).__name__ for e in await asyncio.gather(*calls, return_exceptions=True)]
        assert errors == ["RuntimeError", "CircuitOpen", "CircuitOpen", "CircuitOpen", "CircuitOpen"]
        st = b.statistics()
        assert (st.submitted, st.failed, st.cancelled, st.pending) == (5, 1, 4, 0)

    run(main)


def test_concurrent_batches_overlap_up_to_max_concurrent_batches() -> None:
    """With max_concurrent_batches=2 two async batches run at once; a third waits for a slot."""

    async def main() -> None:
        rec = Recorder()
        rec.gate.clear()
        b = AsyncBatcher(rec, max_batch_size=1, max_wait_ms=0, max_concurrent_batches=2)
        calls = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
        await settle()
        assert rec.batches == [[0], [1]]
        assert b.statistics().in_flight == 2
        rec.gate.set()
        assert await asyncio.gather(*calls) == [0, 10, 20]
        await b.aclose()

    run(main)


def test_a_second_live_event_loop_is_refused_and_a_closed_one_is_replaced() -> None:
    """One AsyncBatcher serves one loop: a submit from another loop while the first is alive
    raises RuntimeError naming DynamicBatcher; once the first loop is closed, a new one may bind."""
    b = AsyncBatcher(lambda xs: xs, max_batch_size=1, max_wait_ms=0)
    first = asyncio.new_event_loop()
    errors: list[BaseException] = []

    def from_another_loop() -> None:
        try:
            asyncio.run(b.submit(2))
        except BaseException as exc:
            errors.append(exc)

    try:
        assert first.run_until_complete(b.submit(1)) == 1
        t = threading.Thread(target=from_another_loop)
        t.start()
        t.join(WAIT)
    finally:
        first.close()
    assert len(errors) == 1
    assert isinstance(errors[0], RuntimeError)
    assert "DynamicBatcher" in str(errors[0])
    assert asyncio.run(b.submit(3)) == 3


def test_statistics_count_every_caller_once() -> None:
    """submitted = succeeded + failed + expired + cancelled + rejected after a mixed run."""

    async def main() -> None:
        b = AsyncBatcher(Recorder(lambda x: ValueError() if x % 5 == 0 else x), max_batch_size=4, max_wait_ms=1)
        out = await asyncio.gather(*(b.submit(i) for i in range(50)), return_exceptions=True)
        await b.aclose()
        st = b.statistics()
        assert st.submitted == 50
        assert st.succeeded + st.failed == 50
        assert st.failed == sum(isinstance(o, ValueError) for o in out) == 10
        assert st.latency is not None
        assert st.latency.count == 50

    run(main)


async def _drive(b: AsyncBatcher[int, int], n: int) -> list[int]:
    return await asyncio.gather(*(b.submit(i) for i in range(n)))


def test_many_concurrent_callers_on_a_real_clock_all_get_their_results() -> None:
    """A burst of 500 callers with a 1 ms wait: every result comes back to its own caller."""

    async def main() -> None:
        async def double(xs: list[int]) -> list[int]:
            await asyncio.sleep(0)
            return [2 * x for x in xs]

        fn: Callable[[list[int]], Awaitable[list[int]]] = double
        b: AsyncBatcher[int, int] = AsyncBatcher(fn, max_batch_size=16, max_wait_ms=1)
        assert await _drive(b, 500) == [2 * i for i in range(500)]
        st = b.statistics()
        assert st.batches >= 500 // 16
        await b.aclose()

    run(main)


def test_submit_outside_an_asyncio_loop_says_what_to_use_instead() -> None:
    """From trio (or any non-asyncio context) submit raises RuntimeError naming DynamicBatcher."""
    trio = pytest.importorskip("trio")
    b = AsyncBatcher(lambda xs: xs)
    with pytest.raises(RuntimeError, match="DynamicBatcher"):
        trio.run(b.submit, 1)


@pytest.mark.parametrize("reason", sorted(DUE_BY_REASON))
def test_a_half_open_circuit_recovers_when_its_probe_batch_is_due_for_any_reason(reason: str) -> None:
    """``max_wait_ms > 0``: once the cool-down passed, the first batch due (by size, cost,
    max_wait_ms, flush() or aclose()) is the probe, and its success closes the circuit; the
    pump's look at an item still within ``max_wait_ms`` takes no probe."""
    down = True

    def flaky(xs: list[int]) -> list[int]:
        if down:
            raise RuntimeError("backend down")
        return [x * 10 for x in xs]

    async def main() -> None:
        nonlocal down
        clock = MockClock()
        breaker = CircuitBreaker(failure_threshold=5, reset_timeout_s=1.0, clock=clock)
        b: AsyncBatcher[int, int] = AsyncBatcher(flaky, circuit_breaker=breaker, clock=clock, **DUE_BY_REASON_OPTIONS)
        for _ in range(5):
            call = asyncio.ensure_future(b.submit(1))
            await settle()
            clock.advance(0.005)
            with pytest.raises(RuntimeError, match="backend down"):
                await call
        assert breaker.state == "open"
        down = False
        clock.advance(1.5)
        items, then = DUE_BY_REASON[reason]
        calls = [asyncio.ensure_future(b.submit(x)) for x in items]
        await settle()  # the pump has looked once, before the batch is due
        if then == "advance":
            clock.advance(0.005)
        elif then == "flush":
            b.flush()
        elif then == "close":
            await b.aclose()
        assert await asyncio.gather(*calls) == [x * 10 for x in items]
        assert breaker.state == "closed"
        await b.aclose()
        assert b.recent_batches()[-1].reason == reason

    run(main)


class TestAcloseJoinsItsOffloadThreads:
    """AsyncBatcher(offload=True) joins its worker threads on aclose(), as every batcher joins its own."""

    def test_aclose_joins_the_offload_worker_threads(self) -> None:
        """After aclose() returns, no thread that ran the batch function is still alive."""
        ran_in: set[threading.Thread] = set()

        def double(xs: list[int]) -> list[int]:
            ran_in.add(threading.current_thread())
            return [2 * x for x in xs]

        async def main() -> tuple[list[int], list[str]]:
            async with batchkit.AsyncBatcher(
                double, max_batch_size=4, max_wait_ms=0, max_concurrent_batches=2, offload=True
            ) as b:
                results = await asyncio.gather(*(b.submit(i) for i in range(16)))
            return results, [t.name for t in ran_in if t.is_alive()]  # checked at once, on the loop

        results, alive = asyncio.run(main())
        assert results == [2 * i for i in range(16)]
        assert ran_in
        assert threading.main_thread() not in ran_in
        assert alive == []

    def test_aclose_twice_after_offload_is_harmless(self) -> None:
        """A second aclose() returns at once; the batcher refuses new work."""

        async def main() -> None:
            b = batchkit.AsyncBatcher(lambda xs: xs, max_batch_size=2, max_wait_ms=0, offload=True)
            assert await b.submit(1) == 1
            await b.aclose()
            await b.aclose()
            try:
                await b.submit(2)
            except batchkit.BatcherClosed:
                return
            raise AssertionError("submit after aclose was accepted")

        asyncio.run(main())


class TestAcloseFromATaskTheBatchFunctionStarted:
    """AsyncBatcher.aclose() awaited from a task the batch function started (asyncio.gather,
    asyncio.wait_for before 3.12, a TaskGroup) returns, as when awaited in the function itself,
    instead of waiting for the batch that waits for it."""

    def test_aclose_in_a_task_started_by_the_batch_function_does_not_deadlock(self) -> None:
        async def main() -> tuple[list[int], list[str]]:
            holder: dict[str, batchkit.AsyncBatcher[int, int]] = {}
            inner: list[str] = []

            async def fn(xs: list[int]) -> list[int]:
                if 0 in xs:
                    await asyncio.wait_for(asyncio.gather(holder["b"].aclose()), WAIT)
                    inner.append("closed")
                return [x + 1 for x in xs]

            b = batchkit.AsyncBatcher(fn, max_batch_size=1, max_wait_ms=0)
            holder["b"] = b
            futs = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
            done, _ = await asyncio.wait(futs, timeout=2 * WAIT)
            assert len(done) == 3
            await b.aclose()
            return [f.result() for f in futs], inner

        assert asyncio.run(main()) == ([1, 2, 3], ["closed"])

    def test_aclose_of_another_batcher_from_a_batch_function_still_waits(self) -> None:
        """Only a batcher's own batch function is 'inside': closing another batcher from it waits
        for that one's running batch."""

        async def main() -> list[str]:
            log: list[str] = []
            started = asyncio.Event()
            go = asyncio.Event()

            async def slow(xs: list[int]) -> list[int]:
                started.set()
                await go.wait()
                log.append("other ran")
                return xs

            other = batchkit.AsyncBatcher(slow, max_batch_size=1, max_wait_ms=0)

            async def fn(xs: list[int]) -> list[int]:
                pending = asyncio.ensure_future(other.submit(1))
                await asyncio.wait_for(started.wait(), WAIT)
                asyncio.get_running_loop().call_soon(go.set)
                await asyncio.wait_for(other.aclose(), WAIT)
                log.append("other closed")
                assert pending.done()
                return xs

            b = batchkit.AsyncBatcher(fn, max_batch_size=1, max_wait_ms=0)
            assert await asyncio.wait_for(b.submit(0), 2 * WAIT) == 0
            await b.aclose()
            return log

        assert asyncio.run(main()) == ["other ran", "other closed"]


class TestStatistics:
    """statistics() fields as docs/api.md defines them."""

    def test_asyncbatcher_in_flight_counts_items_too(self) -> None:
        async def main() -> tuple[int, int]:
            gate = asyncio.Event()

            async def fn(xs: list[int]) -> list[int]:
                await gate.wait()
                return xs

            b = batchkit.AsyncBatcher(fn, max_batch_size=4, max_wait_ms=0)
            calls = [asyncio.ensure_future(b.submit(i)) for i in range(4)]
            for _ in range(5):
                await asyncio.sleep(0)
            s = b.statistics()
            gate.set()
            assert await asyncio.gather(*calls) == [0, 1, 2, 3]
            await b.aclose()
            return s.in_flight, s.running_batches

        assert asyncio.run(main()) == (4, 1)


def test_an_async_batcher_caller_cancelled_after_its_wake_for_room_passes_the_room_on() -> None:
    """On a full ``"block"`` queue, a waiting caller that is cancelled just after a slot was
    freed for it hands the slot to the next waiting caller, which is then admitted."""
    asyncio.run(_cancelled_after_its_wake_for_room())


async def _cancelled_after_its_wake_for_room() -> None:
    started, gate = asyncio.Event(), asyncio.Event()

    async def fn(xs: list[int]) -> list[int]:
        if xs == [1]:
            started.set()
            await gate.wait()
        return xs

    b = batchkit.AsyncBatcher(fn, max_batch_size=1, max_wait_ms=0, max_queue=1, on_full="block")
    first = asyncio.create_task(b.submit(1))
    await asyncio.wait_for(started.wait(), WAIT)
    queued = asyncio.create_task(b.submit(2))
    await asyncio.sleep(0)  # one loop turn: it is admitted and fills the queue
    assert b.queue_depth() == 1
    wakeful = asyncio.create_task(b.submit(3))
    patient = asyncio.create_task(b.submit(4))
    await asyncio.sleep(0)  # one loop turn: both wait for room
    assert not wakeful.done()
    assert not patient.done()
    # The queued caller gives up: its slot goes to `wakeful`, which is cancelled before it can
    # run (call_soon runs after the wake-up is scheduled, before the task resumes).
    queued.cancel()
    asyncio.get_running_loop().call_soon(wakeful.cancel)
    gate.set()
    assert await asyncio.wait_for(patient, WAIT) == 4
    assert await asyncio.wait_for(first, WAIT) == 1
    assert wakeful.cancelled()
    assert queued.cancelled()
    await b.aclose(timeout=WAIT)
    stats = b.statistics()
    assert (stats.submitted, stats.succeeded, stats.cancelled) == (3, 2, 1)


def test_aclose_without_drain_during_a_draining_aclose_fails_what_waits_at_once() -> None:
    """The same on an AsyncBatcher: ``aclose(drain=False)`` during a draining ``aclose()``."""

    async def main() -> None:
        started, release = asyncio.Event(), asyncio.Event()

        async def fn(xs: list[int]) -> list[int]:
            started.set()
            await release.wait()
            return xs

        b = batchkit.AsyncBatcher(fn, max_batch_size=1, max_wait_ms=0)
        running = asyncio.create_task(b.submit(0))
        await asyncio.wait_for(started.wait(), WAIT)
        waiting = [asyncio.create_task(b.submit(i)) for i in (1, 2)]
        await asyncio.sleep(0)  # both are queued
        draining = asyncio.create_task(b.aclose(timeout=WAIT))
        await asyncio.sleep(0)  # the draining aclose() has begun
        hurry = asyncio.create_task(b.aclose(drain=False))  # waits for the running batch too
        for t in waiting:
            with pytest.raises(batchkit.BatcherClosed):
                await asyncio.wait_for(t, WAIT)
        assert not running.done()
        release.set()
        assert await asyncio.wait_for(running, WAIT) == 0
        await asyncio.wait_for(asyncio.gather(draining, hurry), WAIT)

    asyncio.run(main())


def _new_threads(before: set[threading.Thread]) -> set[threading.Thread]:
    """The live threads not in ``before``: threads are told apart by identity, so a thread some
    other test left behind is not counted (README.md's thread promises compare before and after)."""
    return {t for t in threading.enumerate() if t not in before and t.is_alive()}


def test_an_offloading_async_batcher_joins_its_worker_threads_on_aclose() -> None:
    """`AsyncBatcher(offload=True)` runs batches "in the batcher's own worker threads, one per
    concurrent batch, joined by `aclose()`"."""
    before = set(threading.enumerate())

    def work(xs: list[int]) -> list[int]:
        return [x * x for x in xs]

    async def main() -> list[int]:
        async with batchkit.AsyncBatcher(work, max_batch_size=4, max_concurrent_batches=2, offload=True) as b:
            out: list[int] = [0] * 12

            async def one(i: int) -> None:
                out[i] = await b.submit(i)

            async with anyio.create_task_group() as tg:
                for i in range(12):
                    tg.start_soon(one, i)
            assert 1 <= len(_new_threads(before)) <= 2
        return out

    assert anyio.run(main) == [i * i for i in range(12)]
    assert not _new_threads(before)

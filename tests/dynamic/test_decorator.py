"""@batched: bare and called forms, functions and methods, sync and async, map and controls."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import gc
import inspect
import pickle
import threading
import weakref
from typing import Any

import anyio
import pytest
import trio
from typing_extensions import assert_type

import batchkit
from batchkit import AsyncBatchedFunction, BatchedFunction, BatchSizeMismatch, batched
from batchkit.dynamic.batcher import DynamicBatcher
from batchkit.dynamic.queue import OnFull
from batchkit.testing import MockClock

WAIT = 10


def test_bare_and_called_forms_give_a_blocking_callable() -> None:
    """@batched and @batched(...) on a def give a function called with one item."""

    @batched
    def double(xs: list[int]) -> list[int]:
        return [2 * x for x in xs]

    @batched(max_batch=4, max_wait_ms=1)
    def triple(xs: list[int]) -> list[int]:
        return [3 * x for x in xs]

    assert isinstance(double, BatchedFunction)
    assert double(2) == 4
    assert triple(2) == 6
    assert double.__name__ == "double"
    double.close()
    triple.close()


def test_threads_calling_share_batches() -> None:
    """Concurrent blocking callers are served in shared batches, in order, each its own result."""
    sizes: list[int] = []
    gate = threading.Barrier(8, timeout=WAIT)

    # A clock that never moves: the batch goes when all 8 callers are in, however late the last
    # one is scheduled, never on max_wait_ms with part of them.
    @batched(max_batch=8, max_wait_ms=1000, clock=batchkit.testing.MockClock())
    def square(xs: list[int]) -> list[int]:
        sizes.append(len(xs))
        return [x * x for x in xs]

    def call(i: int) -> int:
        gate.wait()
        return square(i)

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        assert list(ex.map(call, range(8))) == [i * i for i in range(8)]
    assert sizes == [8]
    square.close()


def test_submit_flush_statistics_and_close() -> None:
    """The controls: submit returns a Future, flush dispatches, statistics counts, close refuses."""

    @batched(max_batch=100, max_wait_ms=1e6, clock=batchkit.testing.MockClock())
    def echo(xs: list[str]) -> list[str]:
        return xs

    futs = [echo.submit(s) for s in "abc"]
    echo.flush()
    assert [f.result(WAIT) for f in futs] == ["a", "b", "c"]
    assert echo.statistics().flush_reasons == {"flush": 1}
    echo.close()
    with pytest.raises(batchkit.BatcherClosed):
        echo("d")


def test_map_streams_in_input_order_with_bounded_window() -> None:
    """map() yields results in input order and never has more than `window` items in flight."""
    peak = {"pending": 0}

    @batched(max_batch=16, max_wait_ms=1)
    def inc(xs: list[int]) -> list[int]:
        peak["pending"] = max(peak["pending"], inc.batcher.statistics().pending + len(xs))
        return [x + 1 for x in xs]

    out = list(inc.map(range(500), window=32))
    assert out == list(range(1, 501))
    assert peak["pending"] <= 32
    inc.close()


def test_map_with_progress_bar_writes_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """progress=True draws a progress bar on stderr and still returns every result."""

    @batched(max_batch=8, max_wait_ms=1)
    def ident(xs: list[int]) -> list[int]:
        return xs

    assert list(ident.map(list(range(50)), progress=True)) == list(range(50))
    assert "50" in capsys.readouterr().err
    ident.close()


def test_map_raises_the_first_error_in_order() -> None:
    """A failing item's exception surfaces when its result is due."""

    @batched(max_batch=4, max_wait_ms=1)
    def picky(xs: list[int]) -> list[object]:
        return [ValueError(x) if x == 3 else x for x in xs]

    it = picky.map(range(10))
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="3"):
        next(it)
    picky.close()


def test_methods_get_one_batcher_per_instance() -> None:
    """On a method, each instance has its own batcher bound to itself."""

    class Model:
        def __init__(self, scale: int) -> None:
            self.scale = scale

        @batched(max_batch=4, max_wait_ms=1)
        def predict(self, xs: list[int]) -> list[int]:
            return [self.scale * x for x in xs]

    a, b = Model(2), Model(10)
    assert a.predict(3) == 6
    assert b.predict(3) == 30
    assert a.predict is a.predict
    assert a.predict.batcher is not b.predict.batcher
    a.predict.close()
    b.predict.close()


def test_a_methods_batcher_is_named_after_the_method() -> None:
    """Errors, threads and repr name ``Model.predict``, not ``partial`` (the bound method)."""

    class Model:
        @batched(max_batch=4, max_wait_ms=1)
        def predict(self, xs: list[int]) -> list[int]:
            return xs[:-1]

    m = Model()
    with pytest.raises(BatchSizeMismatch, match=r"Model.predict returned 0 results"):
        m.predict(1)
    assert m.predict.batcher.name.endswith("Model.predict")
    assert "partial" not in repr(m.predict)
    m.predict.close()


def test_bad_options_fail_at_decoration() -> None:
    """A misconfigured decorator fails where it is written, not at the first call."""
    with pytest.raises(ValueError, match="max_batch must be"):

        @batched(max_batch=0)
        def f(xs: list[int]) -> list[int]:
            return xs

    with pytest.raises(TypeError, match="max_batch="):
        batched(max_batch_size=4)  # type: ignore[call-overload]  # the wrong name, on purpose


@pytest.mark.anyio
async def test_async_def_gives_an_awaitable() -> None:
    """@batched on async def: `await f(x)` from tasks; batches are shared."""
    sizes: list[int] = []

    @batched(max_batch=10, max_wait_ms=1e6, clock=batchkit.testing.MockClock())
    async def score(xs: list[int]) -> list[float]:
        sizes.append(len(xs))
        return [x / 2 for x in xs]

    assert isinstance(score, AsyncBatchedFunction)
    out: dict[int, float] = {}

    async def one(i: int) -> None:
        out[i] = await score(i)

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(one, i)
    assert out == {i: i / 2 for i in range(10)}
    assert sizes == [10]
    await score.aclose()


@pytest.mark.anyio
async def test_sync_function_awaited_with_acall() -> None:
    """A def batch function can be awaited from async code through .acall()."""

    @batched(max_batch=2, max_wait_ms=1)
    def neg(xs: list[int]) -> list[int]:
        return [-x for x in xs]

    with anyio.fail_after(WAIT):
        assert await neg.acall(5) == -5
    await neg.aclose()


def test_a_queue_passed_to_the_decorator_admits_its_callers() -> None:
    """@batched(queue=BoundedQueue(...)) works from the first call, and that queue's limits apply.

    Validating the options at decoration must not claim the queue for a throw-away batcher.
    """
    q: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(maxsize=2, on_full="reject")

    @batched(max_batch=4, max_wait_ms=1e6, queue=q)
    def echo(xs: list[int]) -> list[int]:
        return xs

    futs = [echo.submit(i) for i in range(2)]
    with pytest.raises(batchkit.QueueFull):
        echo.submit(2)
    echo.flush()
    assert [f.result(WAIT) for f in futs] == [0, 1]
    assert echo.batcher.queue is q
    echo.close()


def test_a_queue_owned_by_a_batcher_is_refused_at_decoration() -> None:
    """A queue that already serves a DynamicBatcher cannot serve a decorated function too."""
    q: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(maxsize=4)
    owner = batchkit.DynamicBatcher(lambda xs: xs, queue=q)
    with pytest.raises(ValueError, match="queue already belongs to a batcher"):

        @batched(queue=q)
        def f(xs: list[int]) -> list[int]:
            return xs

    owner.close()


def test_an_unknown_option_fails_at_decoration() -> None:
    """A misspelt option is a TypeError that names it, raised where the decorator is written,
    and lists the decorator's own names for the options (max_batch, not max_batch_size)."""
    with pytest.raises(TypeError, match="max_wiat_ms") as raised:

        @batched(max_wiat_ms=5)  # type: ignore[call-overload, untyped-decorator]
        def f(xs: list[int]) -> list[int]:
            return xs

    assert "the options are max_batch, max_wait_ms," in str(raised.value)
    assert "max_batch_size" not in str(raised.value)


class TestAsyncDefWhereItRuns:
    """Where the function of an ``@batched async def`` runs: on its callers' asyncio loop when
    they are tasks of one loop, else on the portal's loop thread."""

    def test_tasks_of_one_asyncio_loop_run_it_on_that_loop(self) -> None:
        """No thread hop: the function runs on the callers' loop and thread, in the
        ``loop_batcher``, and the batch is shared; ``statistics()`` counts its calls."""
        seen: list[tuple[asyncio.AbstractEventLoop, threading.Thread, int]] = []

        @batched(max_batch=8, max_wait_ms=1e6)
        async def score(xs: list[int]) -> list[int]:
            seen.append((asyncio.get_running_loop(), threading.current_thread(), len(xs)))
            return [x * 2 for x in xs]

        async def main() -> tuple[list[int], asyncio.AbstractEventLoop]:
            out = await asyncio.gather(*(score(i) for i in range(8)))
            await score.aclose()
            return out, asyncio.get_running_loop()

        out, loop = asyncio.run(asyncio.wait_for(main(), WAIT))
        assert out == [2 * i for i in range(8)]
        assert seen == [(loop, threading.main_thread(), 8)]
        assert isinstance(score.loop_batcher, batchkit.AsyncBatcher)
        assert score.statistics().succeeded == 8
        assert score.batcher.statistics().submitted == 0  # the portal was never used

    def test_a_call_made_before_its_loop_runs_is_served_on_the_loop_that_awaits_it(self) -> None:
        """``asyncio.run(f(x))`` makes the awaitable before the loop starts: the call still runs
        on that loop, not through the portal."""
        threads: list[threading.Thread] = []

        @batched(max_batch=1, max_wait_ms=0)
        async def echo(xs: list[int]) -> list[int]:
            threads.append(threading.current_thread())
            return xs

        assert asyncio.run(echo(3)) == 3
        assert threads == [threading.main_thread()]
        assert echo.loop_batcher is not None
        echo.close()

    def test_a_call_handed_to_another_loop_leaves_its_own_loop_served(self) -> None:
        """A coroutine made on loop A and awaited on loop B (another thread) runs where it is
        awaited; A's own calls still run on A. The function stays an async def for frameworks
        that ask ``inspect.iscoroutinefunction``."""

        @batched(max_batch=4, max_wait_ms=1)
        async def echo(xs: list[int]) -> list[int]:
            return xs

        assert inspect.iscoroutinefunction(type(echo).__call__)
        other = asyncio.new_event_loop()
        runner = threading.Thread(target=other.run_forever, daemon=True)
        runner.start()

        async def main() -> tuple[int, int]:
            handed = asyncio.run_coroutine_threadsafe(echo(1), other)
            return await asyncio.wait_for(asyncio.wrap_future(handed), WAIT), await asyncio.wait_for(echo(2), WAIT)

        try:
            assert asyncio.run(main()) == (1, 2)
        finally:
            other.call_soon_threadsafe(other.stop)
            runner.join(WAIT)
            other.close()
        echo.close()

    def test_close_from_a_task_of_the_owning_loop_refuses_the_next_call_at_once(self) -> None:
        """close() called in a coroutine of the loop it serves starts the drain there, and a call
        right after it raises BatcherClosed."""

        @batched(max_batch=4, max_wait_ms=1)
        async def echo(xs: list[int]) -> list[int]:
            return xs

        async def main() -> None:
            assert await echo(1) == 1
            echo.close()
            with pytest.raises(batchkit.BatcherClosed):
                await echo(2)

        asyncio.run(asyncio.wait_for(main(), WAIT))

    def test_a_new_loop_after_the_first_closed_is_served_on_the_new_loop(self) -> None:
        """Two ``asyncio.run`` one after the other: each run's calls run on its own loop."""
        loops: list[asyncio.AbstractEventLoop] = []

        @batched(max_batch=2, max_wait_ms=1e6)
        async def echo(xs: list[int]) -> list[int]:
            loops.append(asyncio.get_running_loop())
            return xs

        async def main() -> list[int]:
            return list(await asyncio.gather(echo(1), echo(2)))

        assert asyncio.run(asyncio.wait_for(main(), WAIT)) == [1, 2]
        assert asyncio.run(asyncio.wait_for(main(), WAIT)) == [1, 2]
        assert len(loops) == 2
        assert loops[0] is not loops[1]
        echo.close()

    def test_a_second_loop_running_at_the_same_time_shares_the_portal(self) -> None:
        """While one loop owns the on-loop batcher, callers on another running loop (another
        thread) go through the portal, and both get their results."""
        owner_has_called, release = threading.Event(), threading.Event()
        ran_on: list[threading.Thread] = []

        @batched(max_batch=1, max_wait_ms=0)
        async def echo(xs: list[int]) -> list[int]:
            ran_on.append(threading.current_thread())
            return xs

        async def owner() -> int:
            y = await echo(1)
            owner_has_called.set()
            await anyio.to_thread.run_sync(release.wait, WAIT)
            return y

        def other() -> int:
            assert owner_has_called.wait(WAIT)
            try:
                return asyncio.run(asyncio.wait_for(echo(2), WAIT))
            finally:
                release.set()

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(other)
            assert asyncio.run(asyncio.wait_for(owner(), WAIT)) == 1
            assert fut.result(WAIT) == 2
        assert ran_on[0] is threading.main_thread()
        assert ran_on[1] is not threading.main_thread()  # the portal's loop thread
        assert echo.batcher.statistics().succeeded == 1
        echo.close()

    def test_close_from_another_thread_drains_the_loop_batcher_and_refuses_later_calls(self) -> None:
        """close() called from a thread while the owning loop runs drains what waits on that
        loop; every later call, on any loop, raises BatcherClosed."""
        started = threading.Event()

        @batched(max_batch=8, max_wait_ms=1e6)
        async def echo(xs: list[int]) -> list[int]:
            return xs

        async def main() -> list[int]:
            calls = [asyncio.ensure_future(echo(i)) for i in range(3)]
            await asyncio.sleep(0)
            started.set()
            out = list(await asyncio.gather(*calls))
            with pytest.raises(batchkit.BatcherClosed):
                await echo(9)
            return out

        def close_when_started() -> None:
            assert started.wait(WAIT)
            echo.close(timeout=WAIT)

        closer = threading.Thread(target=close_when_started)
        closer.start()
        assert asyncio.run(asyncio.wait_for(main(), WAIT)) == [0, 1, 2]  # max_wait_ms: only close sends them
        closer.join(WAIT)
        assert not closer.is_alive()
        with pytest.raises(batchkit.BatcherClosed):
            asyncio.run(asyncio.wait_for(echo(10), WAIT))

    def test_a_shared_queue_keeps_every_call_on_the_portal(self) -> None:
        """With ``queue=``, the queue belongs to the DynamicBatcher: calls from a loop use it."""
        q: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(maxsize=4)

        @batched(max_batch=2, max_wait_ms=1e6, queue=q)
        async def echo(xs: list[int]) -> list[int]:
            return xs

        async def main() -> list[int]:
            return list(await asyncio.gather(echo(1), echo(2)))

        assert asyncio.run(asyncio.wait_for(main(), WAIT)) == [1, 2]
        assert echo.loop_batcher is None
        assert echo.statistics().succeeded == 2
        echo.close()


class TestCancellingAnOnLoopCall:
    """A cancelled task that awaited an ``@batched async def`` on its loop: its item leaves the
    queue if its batch has not started, and its result is discarded if it has."""

    def test_cancelled_while_waiting_leaves_the_queue(self) -> None:
        """The batch function never sees the item, and ``statistics()`` counts it cancelled."""
        seen: list[list[int]] = []

        @batched(max_batch=8, max_wait_ms=1e6)
        async def echo(xs: list[int]) -> list[int]:
            seen.append(list(xs))
            return xs

        async def main() -> batchkit.BatcherStatistics:
            first = asyncio.ensure_future(echo(0))
            await asyncio.sleep(0)  # queued: the on-loop batcher serves this loop from now on
            echo.flush()
            assert await first == 0
            gone, kept = asyncio.ensure_future(echo(1)), asyncio.ensure_future(echo(2))
            await asyncio.sleep(0)  # both queued
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            stats = echo.statistics()
            echo.flush()
            assert await kept == 2
            await echo.aclose()
            return stats

        stats = asyncio.run(asyncio.wait_for(main(), WAIT))
        assert (stats.pending, stats.cancelled) == (1, 1)
        assert seen == [[0], [2]]

    def test_cancelled_while_its_batch_runs_discards_the_result(self) -> None:
        """The batch runs with the item; its caller sees CancelledError, the other its result."""
        started, release = asyncio.Event(), asyncio.Event()

        @batched(max_batch=2, max_wait_ms=1e6)
        async def echo(xs: list[int]) -> list[int]:
            if xs != [0]:
                started.set()
                await release.wait()
            return xs

        async def main() -> None:
            first = asyncio.ensure_future(echo(0))
            await asyncio.sleep(0)
            echo.flush()
            assert await first == 0
            gone, kept = asyncio.ensure_future(echo(1)), asyncio.ensure_future(echo(2))
            await started.wait()  # a full batch of both is running
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            release.set()
            assert await kept == 2
            await echo.aclose()

        asyncio.run(asyncio.wait_for(main(), WAIT))
        stats = echo.statistics()
        assert (stats.succeeded, stats.cancelled, stats.pending) == (2, 1, 0)


class TestAnAsyncDefRunsOnTheBatchersOwnLoop:
    """An ``async def`` batch function runs on the batcher's own asyncio loop, whatever its callers run."""

    def test_trio_callers_share_an_async_batch_function_that_awaits_anyio(self) -> None:
        loops: list[str] = []

        @batchkit.batched(max_batch=4, max_wait_ms=1)
        async def score(xs: list[str]) -> list[int]:
            loops.append(type(asyncio.get_running_loop()).__module__)
            await anyio.sleep(0)
            return [len(x) for x in xs]

        async def main() -> list[int]:
            out: list[int] = []

            async def one(s: str) -> None:
                out.append(await score(s))

            async with trio.open_nursery() as nursery:
                for s in ["a", "bb", "ccc"]:
                    nursery.start_soon(one, s)
            return sorted(out)

        assert trio.run(main) == [1, 2, 3]
        assert loops
        assert all(m.startswith("asyncio") for m in loops)
        score.close()


class _RoomWatch(batchkit.BoundedQueue[int]):
    """A queue that tells a test when someone waits for room in it."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize, on_full="reject")
        self.waiting = threading.Event()

    def wait_for_room(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait_for_room(timeout)


class TestMapThroughASharedBatcher:
    """``f.map``: an offline job through a batcher that other callers share."""

    def test_map_waits_for_room_in_a_full_reject_queue(self) -> None:
        """A queue filled by other callers slows map() down; it does not fail it with QueueFull."""
        gate = threading.Event()
        started = threading.Event()
        q = _RoomWatch(2)

        @batched(max_batch=1, max_wait_ms=0, queue=q)
        def inc(xs: list[int]) -> list[int]:
            started.set()
            assert gate.wait(WAIT)
            return [x + 1 for x in xs]

        first = inc.submit(0)
        assert started.wait(WAIT)
        others = [inc.submit(1), inc.submit(2)]  # the queue is full now
        outcome: dict[str, object] = {}
        finished = threading.Event()

        def job() -> None:
            try:
                outcome["results"] = list(inc.map([10, 11, 12]))
            except BaseException as exc:  # handed to the test thread
                outcome["error"] = exc
            finally:
                finished.set()
                q.waiting.set()

        t = threading.Thread(target=job)
        t.start()
        assert q.waiting.wait(WAIT)  # map met the full queue (or failed on it)
        gate.set()
        assert finished.wait(WAIT)
        t.join(WAIT)
        assert "error" not in outcome, outcome
        assert outcome["results"] == [11, 12, 13]
        assert [f.result(WAIT) for f in [first, *others]] == [1, 2, 3]
        inc.close()

    def test_map_refuses_a_bad_window_or_total_at_the_call(self) -> None:
        """Bad arguments fail when map() is called, before any item is read."""

        @batched(max_batch=2, max_wait_ms=1)
        def ident(xs: list[int]) -> list[int]:
            return xs

        for window in (0, -1, 2.5, True):
            with pytest.raises(ValueError, match="window"):
                ident.map([1], window=window)  # type: ignore[arg-type]
        for total in (-1, "3", 1.5):
            with pytest.raises(ValueError, match="total"):
                ident.map([1], total=total)  # type: ignore[arg-type]
        assert list(ident.map([1, 2, 3], total=3)) == [1, 2, 3]
        ident.close()

    def test_map_after_close_raises_batcher_closed(self) -> None:
        """A closed function's map() refuses its first item with BatcherClosed."""

        @batched(max_batch=2, max_wait_ms=1)
        def ident(xs: list[int]) -> list[int]:
            return xs

        ident.close()
        with pytest.raises(batchkit.BatcherClosed):
            list(ident.map([1]))


class TestMapWaitsForRoom:
    """@batched map() waits for room in a full queue under every on_full policy: it never evicts
    another caller's waiting item (docs/api.md: "map waits for room (whatever on_full says)")."""

    @pytest.mark.parametrize("on_full", ["drop_oldest", "shed_lowest_priority"])
    def test_map_waits_for_room_instead_of_evicting(self, on_full: OnFull) -> None:
        started = threading.Event()
        release = threading.Event()

        @batched(max_batch=1, max_wait_ms=0, max_queue=2, on_full=on_full, max_concurrent_batches=1)
        def double(xs: list[int]) -> list[int]:
            started.set()
            assert release.wait(WAIT)
            return [2 * x for x in xs]

        try:
            first = double.submit(1)  # runs, and holds the only worker
            assert started.wait(WAIT)
            others = [double.submit(2, priority=5), double.submit(3, priority=5)]  # fill the queue
            b: DynamicBatcher[int, int] = double.batcher
            waiting = threading.Event()
            original = b.queue.wait_for_room

            def wait_for_room(timeout: float | None = None) -> bool:
                waiting.set()
                return original(timeout)

            b.queue.wait_for_room = wait_for_room  # type: ignore[method-assign]
            results: list[int] = []
            job = threading.Thread(target=lambda: results.extend(double.map([4], window=1)))
            job.start()
            assert waiting.wait(WAIT)  # map found the queue full and waits for room
            assert not any(f.done() for f in others)  # nobody was evicted for it
            release.set()
            job.join(WAIT)
            assert not job.is_alive()
            assert results == [8]
            assert first.result(WAIT) == 2
            assert [f.result(WAIT) for f in others] == [4, 6]
        finally:
            release.set()
            double.close()


class Model:
    def __init__(self, factor: int = 2) -> None:
        self.factor = factor

    @batchkit.batched(max_batch=4, max_wait_ms=1)
    def run(self, xs: list[int]) -> list[int]:
        return [self.factor * x for x in xs]


@batchkit.batched(max_batch=4, max_wait_ms=1)
def module_double(xs: list[int]) -> list[int]:
    return [2 * x for x in xs]


class TestOnAMethod:
    """@batched on a method: docs/api.md's promise that closing an instance's batcher frees it."""

    def test_closing_an_instances_batcher_joins_its_threads_and_frees_the_instance(self) -> None:
        before = set(threading.enumerate())
        refs = []
        for i in range(3):
            m = Model()
            assert m.run(i) == 2 * i
            m.run.close()
            refs.append(weakref.ref(m))
            del m
        gc.collect()
        assert [r() for r in refs] == [None, None, None]
        assert not [t.name for t in set(threading.enumerate()) - before if t.name.startswith("batchkit")]

    def test_a_copy_of_an_instance_gets_its_own_batcher(self) -> None:
        a = Model()
        assert a.run(1) == 2
        b = copy.copy(a)  # its __dict__ holds a's batcher, bound to a
        b.factor = 100
        try:
            assert b.run(1) == 100
            assert b.run is not a.run
            b.run.close()
            assert a.run(1) == 2  # closing the copy's batcher left the original's open
        finally:
            a.run.close()

    def test_an_instance_that_used_its_batcher_deep_copies_and_pickles(self) -> None:
        a = Model(3)
        assert a.run(1) == 3
        try:
            for other in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
                assert other.factor == 3
                assert other.run(2) == 6
                assert other.run is not a.run
                assert other.run.batcher is not a.run.batcher
                other.run.close()
            assert a.run(2) == 6
        finally:
            a.run.close()

    def test_a_function_pickles_and_copies_by_reference(self) -> None:
        assert pickle.loads(pickle.dumps(module_double)) is module_double
        assert copy.deepcopy(module_double) is module_double
        assert copy.copy(module_double) is module_double

    def test_a_method_called_on_the_class_is_refused_naming_the_instance(self) -> None:
        with pytest.raises(TypeError, match=r"Model\.run is a @batched method: call it on an instance"):
            Model.run.submit(1)
        with pytest.raises(TypeError, match="on an instance"):
            Model.run(1)

    def test_a_module_function_assigned_in_a_class_body_stays_a_function(self) -> None:
        class Holder:
            double = module_double

        assert module_double(4) == 8
        assert Holder.double(5) == 10

    def test_staticmethod_under_batched_is_refused_at_decoration(self) -> None:
        with pytest.raises(TypeError, match="put @staticmethod above @batched"):

            class Host:
                @batchkit.batched(max_batch=2, max_wait_ms=1)
                @staticmethod
                def double(xs: list[int]) -> list[int]:
                    return [2 * x for x in xs]

    def test_a_method_is_typed_as_a_batched_function_of_its_items(self) -> None:
        m = Model()
        try:
            # Checked by mypy (the suite's type check): an instance's method takes an item.
            assert_type(m.run, BatchedFunction[int, int])
            assert_type(m.run(1), int)
            assert_type(Model.run, BatchedFunction[int, int])
        finally:
            m.run.close()

    def test_each_instance_has_its_own_batcher_and_closing_one_leaves_the_other(self) -> None:
        a, b = Model(), Model()
        assert a.run.batcher is not b.run.batcher
        a.run.close()
        assert b.run(5) == 10
        b.run.close()

    def test_static_methods_work_and_class_methods_are_refused_clearly(self) -> None:
        class Host:
            @staticmethod
            @batchkit.batched(max_batch=2, max_wait_ms=1)
            def double(xs: list[int]) -> list[int]:
                return [2 * x for x in xs]

        assert Host.double(2) == 4
        assert Host().double(3) == 6
        Host.double.close()

        class Bad:
            @classmethod
            @batchkit.batched(max_batch=2, max_wait_ms=1)
            def names(cls, xs: list[int]) -> list[str]:
                return [cls.__name__ for _ in xs]

        with pytest.raises(TypeError, match="classmethod"):
            Bad.names(1)


class TestCallSignature:
    """help() and inspect show what callers pass: one item (its type read from the batch
    function's list), the submit options, and one result."""

    def test_a_function_method_and_async_function_show_the_item_and_result_types(self) -> None:
        @batched(max_batch=2, max_wait_ms=1)
        def embed(texts: list[str]) -> list[list[float]]:
            return [[1.0] for _ in texts]

        @batched(max_batch=2, max_wait_ms=1)
        async def score(xs: list[int]) -> list[float]:
            return [1.0 for _ in xs]

        m = Model()
        try:
            # This module's annotations are strings (from __future__ import annotations): read too.
            for fn, item, result in ((embed, "str", "list[float]"), (score, "int", "float"), (m.run, "int", "int")):
                sig = inspect.signature(fn)
                assert list(sig.parameters) == ["item", "priority", "deadline_ms", "fallback", "timeout"]
                assert sig.parameters["item"].kind is inspect.Parameter.POSITIONAL_ONLY
                assert (sig.parameters["item"].annotation, sig.return_annotation) == (item, result)
            assert str(inspect.signature(embed)).startswith("(item: 'str', /, *, priority: int = 0")
        finally:
            embed.close()
            score.close()
            m.run.close()

    def test_a_batch_function_without_list_annotations_shows_a_bare_item(self) -> None:
        f: BatchedFunction[int, int] = batched(max_batch=2, max_wait_ms=1)(lambda xs: xs)
        try:
            sig = inspect.signature(f)
            assert sig.parameters["item"].annotation is inspect.Parameter.empty
            assert sig.return_annotation is inspect.Signature.empty
        finally:
            f.close()


def test_close_before_first_call_refuses_later_calls() -> None:
    """close() is DynamicBatcher.close: new work is refused with BatcherClosed, used or not."""

    @batchkit.batched(max_batch=4, max_wait_ms=1)
    def echo(xs: list[int]) -> list[int]:
        return xs

    before = set(threading.enumerate())  # the threads, not their count: an earlier test's may still be exiting
    echo.close()
    assert set(threading.enumerate()) <= before  # closing an unused function starts nothing
    with pytest.raises(batchkit.BatcherClosed):
        echo(1)
    with pytest.raises(batchkit.BatcherClosed):
        echo.submit(1)
    echo.close()  # idempotent


def test_aclose_before_first_call_refuses_later_calls() -> None:
    @batchkit.batched(max_batch=4, max_wait_ms=1)
    async def echo(xs: list[int]) -> list[int]:
        return xs

    async def main() -> None:
        await echo.aclose()
        with pytest.raises(batchkit.BatcherClosed):
            await echo(1)

    anyio.run(main)


def test_close_on_an_unused_method_refuses_that_instance_only() -> None:
    class Model:
        @batchkit.batched(max_batch=4, max_wait_ms=1)
        def run(self, xs: list[int]) -> list[int]:
            return xs

    a, b = Model(), Model()
    a.run.close()
    with pytest.raises(batchkit.BatcherClosed):
        a.run(1)
    assert b.run(2) == 2
    b.run.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_a_bad_max_batch_is_named_max_batch(bad: Any) -> None:
    """@batched's parameter is max_batch: the error names it, not the batcher's max_batch_size."""
    with pytest.raises(ValueError, match="max_batch must be"):
        batchkit.batched(max_batch=bad)(lambda xs: xs)


@pytest.mark.parametrize("bad", [0, 1.5, True])
def test_map_refuses_a_window_that_is_not_a_positive_int(bad: Any) -> None:
    @batchkit.batched(max_batch=4, max_wait_ms=1)
    def echo(xs: list[int]) -> list[int]:
        return xs

    with pytest.raises(ValueError, match="window"):
        list(echo.map([1, 2], window=bad))
    echo.close()


def test_an_override_and_the_method_it_overrides_keep_their_own_batchers() -> None:
    """On a method each instance gets its own batcher: one per decorated method, so that a
    subclass's override and ``super().method`` do not share (and swap) one."""

    class Base:
        @batchkit.batched(max_batch=4, max_wait_ms=1)
        def tag(self, xs: list[int]) -> list[str]:
            return ["base"] * len(xs)

    class Child(Base):
        @batchkit.batched(max_batch=4, max_wait_ms=1)
        def tag(self, xs: list[int]) -> list[str]:
            return ["child"] * len(xs)

        def base_tag(self, x: int) -> str:
            return str(super().tag(x))

    first, second = Child(), Child()
    assert first.tag(0) == "child"
    assert first.base_tag(0) == "base"
    assert second.base_tag(0) == "base"  # the base method used first on this instance
    assert second.tag(0) == "child"
    for c in (first, second):
        c.tag.close()
        Base.tag.__get__(c).close()


def test_map_cancels_the_items_after_the_first_failure() -> None:
    """api.md: the first item that fails raises when its turn comes, and the items after it are
    cancelled: an item still waiting for its batch never reaches the batch function."""
    seen: list[int] = []

    @batchkit.batched(max_batch=2, max_wait_ms=60_000, clock=MockClock())
    def picky(xs: list[int]) -> list[object]:
        seen.extend(xs)
        return [ValueError(f"bad {x}") if x == 0 else x for x in xs]

    results = picky.map(range(3), window=3)  # 0 and 1 fill a batch; 2 waits for a partner
    with pytest.raises(ValueError, match="bad 0"):
        next(results)
    stats = picky.statistics()
    assert (stats.pending, stats.cancelled, stats.failed, stats.succeeded) == (0, 1, 1, 1)
    picky.close(timeout=WAIT)
    assert seen == [0, 1]


def _new_threads(before: set[threading.Thread]) -> set[threading.Thread]:
    """The live threads not in ``before``: threads are told apart by identity, so a thread some
    other test left behind is not counted (README.md's thread promises compare before and after)."""
    return {t for t in threading.enumerate() if t not in before and t.is_alive()}


def test_a_batcher_starts_its_threads_on_first_use_and_close_joins_them() -> None:
    """ "a batcher starts its threads on first use and joins them on `close()`", and `close()`
    drains: what was submitted before it gets its result."""
    before = set(threading.enumerate())

    @batchkit.batched(max_batch=8, max_wait_ms=20)
    def embed(texts: list[str]) -> list[list[float]]:
        return [[float(len(t)), 1.0] for t in texts]

    assert not _new_threads(before)  # decorating starts nothing
    assert embed("hello") == [5.0, 1.0]
    future = embed.submit("hey")
    assert isinstance(future, concurrent.futures.Future)
    assert _new_threads(before)
    embed.close()
    assert future.result(timeout=0) == [3.0, 1.0]
    assert not _new_threads(before)


def test_map_streams_results_in_order_with_a_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    """`list(embed.map(corpus, progress=True))`: an offline job, streamed, results in order."""
    pytest.importorskip("tqdm")

    @batchkit.batched(max_batch=8, max_wait_ms=1)
    def embed(texts: list[str]) -> list[int]:
        return [int(t.split()[1]) for t in texts]

    try:
        corpus = [f"document {i}" for i in range(200)]
        assert list(embed.map(corpus, progress=True)) == list(range(200))
    finally:
        embed.close()
    assert "200/200" in capsys.readouterr().err


def test_a_method_gets_one_batcher_per_instance_and_its_close_frees_the_threads() -> None:
    """`@batched` on a method: "one batcher per instance; `obj.method.close()` frees it and its
    threads"; the other instance's batcher runs on."""

    class Model:
        def __init__(self, scale: int) -> None:
            self.scale = scale

        @batchkit.batched(max_batch=4, max_wait_ms=1)
        def predict(self, xs: list[int]) -> list[int]:
            return [x * self.scale for x in xs]

    before = set(threading.enumerate())
    a, b = Model(2), Model(3)
    assert (a.predict(5), b.predict(5)) == (10, 15)
    a_and_b = _new_threads(before)
    a.predict.close()
    only_b = _new_threads(before)
    assert only_b
    assert only_b < a_and_b
    assert b.predict(1) == 3
    b.predict.close()
    assert not _new_threads(before)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_async_batch_function_gives_an_awaitable_on_asyncio_and_trio(backend: str) -> None:
    """ "An `async def` batch function gives an awaitable (`await score(x)`)", and `acall` works
    "from async code (asyncio or trio)"."""
    if backend == "trio":
        pytest.importorskip("trio")
    sizes: list[int] = []

    @batchkit.batched(max_batch=16, max_wait_ms=5)
    async def score(xs: list[int]) -> list[int]:
        sizes.append(len(xs))
        return [x + 1 for x in xs]

    @batchkit.batched(max_batch=16, max_wait_ms=5)
    def double(xs: list[int]) -> list[int]:
        return [2 * x for x in xs]

    async def main() -> tuple[list[int], int]:
        results: list[int] = [0] * 10

        async def one(i: int) -> None:
            results[i] = await score(i)

        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(one, i)
        return results, await double.acall(21)

    try:
        results, doubled = anyio.run(main, backend=backend)
    finally:
        double.close()
    assert results == [i + 1 for i in range(10)]
    assert doubled == 42
    assert sum(sizes) == 10

"""DynamicBatcher: flush triggers, sealing, per-item outcomes, faults, cancellation and closing."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import random
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import anyio
import pytest
import trio

import batchkit
from _support import Gate
from batchkit import (
    AdaptiveBatchController,
    AsyncBatcher,
    BatcherClosed,
    BatchSizeMismatch,
    BatchTimeout,
    DeadlineExceeded,
    DynamicBatcher,
    QueueFull,
)
from batchkit.integrations.ray import QUEUE_DEPTH_METRIC, RUNNING_BATCHES_METRIC, autoscaling_stats
from batchkit.testing import MockClock, echo_batch

WAIT = 10  # seconds: the bound on every wait in this file; nothing should come near it


class Recorder:
    """A batch function that records its batches and can be held while running."""

    def __init__(self, fn: Callable[[int], object] = lambda x: x * 10, hold: bool = False) -> None:
        self.fn = fn
        self.batches: list[list[int]] = []
        self.started = threading.Semaphore(0)
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.lock = threading.Lock()

    def __call__(self, xs: list[int]) -> list[object]:
        with self.lock:
            self.batches.append(list(xs))
        self.started.release()
        assert self.release.wait(WAIT)
        return [self.fn(x) for x in xs]

    def wait_started(self, n: int = 1) -> None:
        for _ in range(n):
            assert self.started.acquire(timeout=WAIT)


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"max_batch_size": 0}, ValueError, "max_batch_size must be an int >= 1"),
        ({"max_wait_ms": -1}, ValueError, "max_wait_ms must be >= 0"),
        ({"max_concurrent_batches": 0}, ValueError, "max_concurrent_batches"),
        ({"max_batch_cost": 10}, ValueError, "max_batch_cost needs size_fn"),
        ({"batch_timeout_s": 0}, ValueError, "batch_timeout_s must be > 0"),
        ({"max_queue": 0}, ValueError, "max_queue must be an int >= 1"),
        ({"on_full": "wait"}, ValueError, "on_full must be one of"),
    ],
)
def test_bad_configuration_is_refused(kwargs: dict[str, Any], exc: type[BaseException], message: str) -> None:
    """Misconfiguration fails at construction with a message that names the argument."""
    with pytest.raises(exc, match=message):
        DynamicBatcher(lambda xs: xs, **kwargs)


def test_a_batch_limit_below_one_is_refused() -> None:
    """max_batch_size = 0 (or set_batch_limit(0), what a tuner calls) would never dispatch."""
    with DynamicBatcher(Recorder(), max_batch_size=4, max_wait_ms=1) as b:
        for bad in (0, -1, 2.5, True):
            with pytest.raises(ValueError, match="max_batch_size must be an int >= 1"):
                b.set_batch_limit(bad)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="max_batch_size must be an int >= 1"):
                b.max_batch_size = bad  # type: ignore[assignment]
        assert b.max_batch_size == 4
        b.max_batch_size = 2
        assert b.submit(1).result(WAIT) == 10
    ab = AsyncBatcher(Recorder(), max_batch_size=4)
    with pytest.raises(ValueError, match="max_batch_size must be an int >= 1"):
        ab.set_batch_limit(0)


def test_fn_must_be_callable() -> None:
    """A non-callable batch function is a TypeError."""
    with pytest.raises(TypeError, match="fn must be callable"):
        DynamicBatcher(42)  # type: ignore[arg-type]


def test_constructing_starts_no_thread() -> None:
    """Nothing runs until the first submit."""
    # The threads alive before, not their count: a thread of an earlier test may still be
    # exiting, which would lower the count without this batcher having anything to do with it.
    before = set(threading.enumerate())
    b = DynamicBatcher(lambda xs: xs)
    assert set(threading.enumerate()) <= before
    b.close()


def test_full_batch_is_dispatched_without_waiting() -> None:
    """max_batch_size items are dispatched at once, even though the clock never moves."""
    rec = Recorder()
    with DynamicBatcher(rec, max_batch_size=4, max_wait_ms=1000, clock=MockClock()) as b:
        futs = [b.submit(i) for i in range(4)]
        assert [f.result(WAIT) for f in futs] == [0, 10, 20, 30]
        assert rec.batches == [[0, 1, 2, 3]]
        assert b.statistics().flush_reasons == {"size": 4 // 4}


def test_wait_is_measured_from_the_oldest_item() -> None:
    """A partial batch goes when the oldest waiting item has waited max_wait_ms, not the newest."""
    clock = MockClock()
    rec = Recorder()
    with DynamicBatcher(rec, max_batch_size=8, max_wait_ms=5, clock=clock) as b:
        f1 = b.submit(1)
        clock.advance(0.003)
        f2 = b.submit(2)
        clock.advance(0.0019)
        assert not f1.done()
        clock.advance(0.0002)  # oldest has now waited 5.1 ms; the newest only 2.1 ms
        assert f1.result(WAIT) == 10
        assert f2.result(WAIT) == 20
        assert rec.batches == [[1, 2]]
        assert b.recent_batches()[-1].reason == "timeout"


def test_flush_dispatches_what_is_waiting_now() -> None:
    """flush() sends waiting items without waiting for the batch to fill or the timer."""
    rec = Recorder()
    with DynamicBatcher(rec, max_batch_size=8, max_wait_ms=1e6, clock=MockClock()) as b:
        futs = [b.submit(i) for i in range(3)]
        b.flush()
        assert [f.result(WAIT) for f in futs] == [0, 10, 20]
        assert b.statistics().flush_reasons == {"flush": 1}


def test_batch_keeps_growing_while_the_model_is_busy() -> None:
    """Items arriving while a batch runs join the next batch, which is sealed only at dispatch."""
    rec = Recorder(hold=True)
    with DynamicBatcher(rec, max_batch_size=8, max_wait_ms=0) as b:
        first = b.submit(0)
        rec.wait_started()
        rest = [b.submit(i) for i in range(1, 6)]
        rec.release.set()
        assert [f.result(WAIT) for f in [first, *rest]] == [0, 10, 20, 30, 40, 50]
        assert rec.batches == [[0], [1, 2, 3, 4, 5]]


def test_concurrent_batches_run_side_by_side() -> None:
    """max_concurrent_batches=2 lets two batches run at the same time."""
    barrier = threading.Barrier(2, timeout=WAIT)

    def fn(xs: list[int]) -> list[int]:
        barrier.wait()  # only passes if both batches run at once
        return xs

    with DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, max_concurrent_batches=2) as b:
        futs = [b.submit(i) for i in range(2)]
        assert [f.result(WAIT) for f in futs] == [0, 1]


def test_returned_exception_fails_only_its_caller() -> None:
    """An Exception in a result slot fails that caller; its neighbours get their values."""

    def fn(xs: list[int]) -> list[object]:
        return [ValueError(f"bad {x}") if x == 2 else x for x in xs]

    with DynamicBatcher(fn, max_batch_size=4, max_wait_ms=1e6, clock=MockClock()) as b:
        futs = [b.submit(i) for i in range(4)]
        assert [futs[i].result(WAIT) for i in (0, 1, 3)] == [0, 1, 3]
        with pytest.raises(ValueError, match="bad 2"):
            futs[2].result(WAIT)
        s = b.statistics()
        assert (s.succeeded, s.failed) == (3, 1)


def test_raised_exception_fails_the_batch_and_the_batcher_keeps_serving() -> None:
    """A raising batch function fails that batch's callers only."""
    calls = []

    def fn(xs: list[int]) -> list[int]:
        calls.append(xs)
        if len(calls) == 1:
            raise RuntimeError("model crashed")
        return xs

    with DynamicBatcher(fn, max_batch_size=2, max_wait_ms=1e6, clock=MockClock()) as b:
        bad = [b.submit(i) for i in range(2)]
        for f in bad:
            with pytest.raises(RuntimeError, match="model crashed"):
                f.result(WAIT)
        good = [b.submit(i) for i in range(2)]
        assert [f.result(WAIT) for f in good] == [0, 1]


def test_isolate_errors_fails_only_the_culprit() -> None:
    """isolate_errors splits a failing batch until only the poisoned item's caller fails."""

    def fn(xs: list[int]) -> list[int]:
        if 5 in xs:
            raise ValueError("poison")
        return [x + 1 for x in xs]

    with DynamicBatcher(fn, max_batch_size=8, max_wait_ms=1e6, isolate_errors=True, clock=MockClock()) as b:
        futs = [b.submit(i) for i in range(8)]
        for i, f in enumerate(futs):
            if i == 5:
                with pytest.raises(ValueError, match="poison"):
                    f.result(WAIT)
            else:
                assert f.result(WAIT) == i + 1


def _numpy() -> Any:
    return pytest.importorskip("numpy")


class _Table:
    """A pandas-DataFrame-like result: rows by len() and shape, but iteration over column labels."""

    columns = ("score", "label", "extra")

    def __init__(self, rows: int) -> None:
        self.shape = (rows, len(self.columns))

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: str) -> list[int]:
        return [0] * self.shape[0]

    def __iter__(self) -> Any:
        return iter(self.columns)


class _Ragged:
    """An array-like result whose length says one row per input but whose iteration yields one."""

    def __init__(self, rows: int) -> None:
        self.shape = (rows,)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int) -> int:
        if i >= 1:
            raise IndexError(i)
        return 0


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (lambda xs: xs[:-1], "returned 2 results for a batch of 3"),
        (lambda xs: 42, "not a sequence"),
        (lambda xs: "abc", "not a sequence"),
        (lambda xs: _numpy().asarray(sum(xs)), "a 0-d ndarray"),  # killed the worker: no one answered
        (lambda xs: _Table(len(xs)), "iterates over its columns"),  # callers got column names
        (lambda xs: _Ragged(len(xs)), "iterates over 1 results"),  # killed the worker part-way
    ],
)
def test_wrong_result_shape_is_batch_size_mismatch_for_everyone(
    result: Callable[[list[int]], object], message: str
) -> None:
    """A result of the wrong length or type fails every caller of that batch clearly; no hang."""
    n = {"calls": 0}

    def fn(xs: list[int]) -> object:
        n["calls"] += 1
        return result(xs) if n["calls"] == 1 else xs

    malformed: Any = fn  # not a batch function's type, on purpose
    b: DynamicBatcher[int, int]
    with DynamicBatcher(malformed, max_batch_size=3, max_wait_ms=1e6, clock=MockClock()) as b:
        futs = [b.submit(i) for i in range(3)]
        for f in futs:
            with pytest.raises(BatchSizeMismatch, match=message):
                f.result(WAIT)
        again = [b.submit(i) for i in range(3)]
        assert [f.result(WAIT) for f in again] == [0, 1, 2]


def test_numpy_array_results_are_accepted() -> None:
    """A batch function may return an array with one row per input."""
    np = pytest.importorskip("numpy")
    with DynamicBatcher(lambda xs: np.asarray(xs) * 2, max_batch_size=2, max_wait_ms=1e6, clock=MockClock()) as b:
        futs = [b.submit(i) for i in range(2)]
        assert [int(f.result(WAIT)) for f in futs] == [0, 2]


def test_cost_limit_caps_batches_and_runs_an_oversized_item_alone() -> None:
    """size_fn + max_batch_cost: no batch exceeds the cost; a too-big item runs by itself."""
    size: Any = len  # the Recorder is typed for ints; this one records str items
    rec: Any = Recorder(fn=size)
    b: DynamicBatcher[str, int]
    with DynamicBatcher(
        rec, max_batch_size=100, max_wait_ms=1e6, size_fn=len, max_batch_cost=10, clock=MockClock()
    ) as b:
        items = ["aaaa", "bbbb", "cccc", "x" * 25, "dd"]
        futs = [b.submit(s) for s in items]
        b.flush()
        assert [f.result(WAIT) for f in futs] == [4, 4, 4, 25, 2]
        batches: list[list[str]] = rec.batches
        for batch in batches:
            assert sum(map(len, batch)) <= 10 or len(batch) == 1
        assert ["x" * 25] in batches


def test_group_by_never_mixes_groups() -> None:
    """Items with different group keys never share a batch."""
    rec = Recorder(fn=lambda x: x)
    with DynamicBatcher(rec, max_batch_size=4, max_wait_ms=1e6, group_by=lambda x: x % 2, clock=MockClock()) as b:
        futs = [b.submit(i) for i in range(10)]
        b.flush()
        assert [f.result(WAIT) for f in futs] == list(range(10))
    for batch in rec.batches:
        assert len({x % 2 for x in batch}) == 1
    assert sorted(x for batch in rec.batches for x in batch) == list(range(10))


def test_unhashable_group_key_is_a_clear_type_error() -> None:
    """group_by returning an unhashable key fails the submit, not the batcher."""
    unhashable: Any = lambda x: [x]  # noqa: E731 - a key mypy would refuse, on purpose
    with DynamicBatcher(lambda xs: xs, group_by=unhashable) as b:
        with pytest.raises(TypeError, match="unhashable key"):
            b.submit(1)
        assert b.statistics().pending == 0


def test_deadline_expires_promptly_while_the_model_is_busy() -> None:
    """A waiting item whose deadline passes fails at once, even though no batch can form."""
    clock = MockClock()
    rec = Recorder(hold=True)
    with DynamicBatcher(rec, max_batch_size=8, max_wait_ms=0, clock=clock) as b:
        running = b.submit(0)
        rec.wait_started()
        late = b.submit(1, deadline_ms=50)
        fallback = b.submit(2, deadline_ms=50, fallback="cached")
        clock.advance(0.051)
        with pytest.raises(DeadlineExceeded):
            late.result(WAIT)
        assert fallback.result(WAIT) == "cached"
        rec.release.set()
        assert running.result(WAIT) == 0
        s = b.statistics()
        assert (s.expired, s.pending) == (2, 0)


def test_an_earlier_deadline_wakes_a_dispatcher_that_sleeps_until_later() -> None:
    """On the real clock: the dispatcher sleeps until the oldest item's max_wait_ms (an hour
    here); an item whose deadline comes sooner still expires on time, and a full batch still
    goes at once (handed to the worker by the caller that filled it)."""
    rec = Recorder()
    with DynamicBatcher(rec, max_batch_size=3, max_wait_ms=3_600_000) as b:
        first = b.submit(0)
        asleep = time.monotonic() + WAIT
        while not b._threads.idle:  # let it go to sleep first: this test is about waking it
            assert time.monotonic() < asleep, "the dispatcher never went idle"
            time.sleep(0.001)
        late = b.submit(1, deadline_ms=20)
        with pytest.raises(DeadlineExceeded):
            late.result(WAIT)
        assert not first.done()
        rest = [b.submit(2), b.submit(3)]
        assert [f.result(WAIT) for f in [first, *rest]] == [0, 20, 30]
        assert rec.batches == [[0, 2, 3]]
        assert b.statistics().expired == 1


def test_a_busy_batcher_does_not_wake_its_dispatcher_for_each_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the real clock: after requests came, the dispatcher wakes once per ``max_wait_ms``
    rather than sleeping until the next first arrival wakes it (a thread switch for each batch
    under steady traffic); a lone item still goes after ``max_wait_ms``, and once requests stop
    the dispatcher sleeps until woken."""
    rec = Recorder()
    wakes = 0
    with DynamicBatcher(rec, max_batch_size=2, max_wait_ms=300) as b:
        threads = b._threads
        wake = threads.wake

        def counted() -> None:
            nonlocal wakes
            wakes += 1
            wake()

        def until_asleep(forever: bool) -> None:
            limit = time.monotonic() + WAIT
            while not threads.idle or (threads._until is None) is not forever:
                assert time.monotonic() < limit, (
                    f"the dispatcher never slept {'until woken' if forever else 'on a timer'}"
                )
                time.sleep(0.001)

        assert [f.result(WAIT) for f in [b.submit(0), b.submit(1)]] == [0, 10]
        until_asleep(forever=True)  # no requests for a while: nothing to wake for
        monkeypatch.setattr(threads, "wake", counted)
        assert [f.result(WAIT) for f in [b.submit(2), b.submit(3)]] == [20, 30]
        assert wakes == 1  # the first arrival after the pause woke it
        until_asleep(forever=False)  # requests came: it wakes after one wait, unasked
        assert [f.result(WAIT) for f in [b.submit(4), b.submit(5)]] == [40, 50]
        assert wakes == 1  # the next batch did not wake it
        assert b.submit(6).result(WAIT) == 60  # alone: flushed by the dispatcher's timer
        until_asleep(forever=True)  # requests stopped: so does its timer
    assert rec.batches == [[0, 1], [2, 3], [4, 5], [6]]


def test_cancelled_future_is_dropped_before_the_model_runs() -> None:
    """Cancelling a waiting future removes its item and frees its slot."""
    rec = Recorder()
    with DynamicBatcher(rec, max_batch_size=8, max_wait_ms=1e6, max_queue=2, clock=MockClock()) as b:
        f1 = b.submit(1)
        f2 = b.submit(2)
        assert f1.cancel()
        f3 = b.submit(3)  # room again
        b.flush()
        assert [f2.result(WAIT), f3.result(WAIT)] == [20, 30]
        assert rec.batches == [[2, 3]]
        s = b.statistics()
        assert (s.cancelled, s.pending, s.in_flight) == (1, 0, 0)


def test_full_queue_rejects_with_queue_full() -> None:
    """A full reject-queue refuses the next submit with QueueFull, counted in statistics."""
    with DynamicBatcher(lambda xs: xs, max_batch_size=8, max_wait_ms=1e6, max_queue=2, clock=MockClock()) as b:
        b.submit(1)
        b.submit(2)
        with pytest.raises(QueueFull):
            b.submit(3)
        assert b.statistics().rejected == 1


def test_block_policy_waits_for_room() -> None:
    """on_full='block' makes submit wait for room instead of failing."""
    rec = Recorder(hold=True)
    with DynamicBatcher(rec, max_batch_size=1, max_wait_ms=0, max_queue=1, on_full="block") as b:
        first = b.submit(0)
        rec.wait_started()
        second = b.submit(1)  # fills the queue
        with pytest.raises(QueueFull, match="within timeout"):
            b.submit(2, timeout=0.01)
        done = threading.Event()
        third: list[concurrent.futures.Future[object]] = []

        def submit_third() -> None:
            third.append(b.submit(3, timeout=WAIT))
            done.set()

        t = threading.Thread(target=submit_third)
        t.start()
        rec.release.set()
        assert done.wait(WAIT)
        t.join(WAIT)
        assert [first.result(WAIT), second.result(WAIT), third[0].result(WAIT)] == [0, 10, 30]


def test_batch_timeout_fails_callers_and_service_continues() -> None:
    """A batch function that hangs past batch_timeout_s fails its callers with BatchTimeout."""
    clock = MockClock()  # time passes only when told: the second batch cannot time out too
    hang = threading.Event()
    started = threading.Event()
    calls = []

    def fn(xs: list[int]) -> list[int]:
        calls.append(xs)
        if len(calls) == 1:
            started.set()
            hang.wait(WAIT)
        return xs

    b = DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, batch_timeout_s=0.05, clock=clock)
    try:
        hung = b.submit(1)
        assert started.wait(WAIT)
        clock.advance(0.05)
        with pytest.raises(BatchTimeout, match="batch_timeout_s"):
            hung.result(WAIT)
        assert b.submit(2).result(WAIT) == 2
    finally:
        hang.set()
        b.close()


def test_close_drains_waiting_items_then_refuses() -> None:
    """close() dispatches everything still waiting, joins its threads, then raises BatcherClosed."""
    rec = Recorder()
    b = DynamicBatcher(rec, max_batch_size=8, max_wait_ms=1e6, clock=MockClock())
    futs = [b.submit(i) for i in range(3)]
    b.close()
    assert [f.result(0) for f in futs] == [0, 10, 20]
    assert b.statistics().flush_reasons == {"close": 1}
    with pytest.raises(BatcherClosed, match="closed"):
        b.submit(9)
    assert b._threads.dispatcher is not None
    assert not b._threads.dispatcher.is_alive()
    assert not any(w.is_alive() for w in b._threads.workers)
    b.close()  # idempotent


def test_close_without_drain_fails_waiting_items() -> None:
    """close(drain=False) fails the waiting items with BatcherClosed instead of running them."""
    rec = Recorder()
    b = DynamicBatcher(rec, max_batch_size=8, max_wait_ms=1e6, clock=MockClock())
    futs = [b.submit(i) for i in range(3)]
    b.close(drain=False)
    for f in futs:
        with pytest.raises(BatcherClosed):
            f.result(0)
    assert rec.batches == []


def test_statistics_and_repr_describe_the_state() -> None:
    """statistics() counts batches, sizes and latencies; repr shows the live state."""
    with DynamicBatcher(lambda xs: xs, max_batch_size=2, max_wait_ms=1e6, clock=MockClock(), name="echo") as b:
        futs = [b.submit(i) for i in range(4)]
        [f.result(WAIT) for f in futs]
        s = b.statistics()
        assert (s.batches, s.mean_batch_size, s.batch_size_histogram) == (2, 2.0, {2: 2})
        assert s.latency is not None
        assert s.latency.count == 4
        assert "echo" in repr(b)
        assert "pending=0" in repr(b)


# --------------------------------------------------------------------------- async callers


@pytest.mark.anyio
async def test_async_callers_are_batched_together() -> None:
    """Concurrent tasks awaiting asubmit share batches and each gets its own result."""
    rec = Recorder()
    b = DynamicBatcher(rec, max_batch_size=16, max_wait_ms=1e6, clock=MockClock())
    results: dict[int, object] = {}

    async def one(i: int) -> None:
        results[i] = await b.asubmit(i)

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            for i in range(32):
                tg.start_soon(one, i)
    assert results == {i: i * 10 for i in range(32)}
    assert [len(x) for x in rec.batches] == [16, 16]
    await b.aclose()


@pytest.mark.anyio
async def test_async_batch_function_runs_off_the_callers_loop() -> None:
    """An async def batch function is awaited on the batcher's own loop."""

    async def fn(xs: list[int]) -> list[int]:
        await anyio.sleep(0)
        return [x + 1 for x in xs]

    async with DynamicBatcher(fn, max_batch_size=4, max_wait_ms=1) as b:
        with anyio.fail_after(WAIT):
            assert await b.asubmit(1) == 2
        assert b.submit(5).result(WAIT) == 6  # and from a thread


@pytest.mark.anyio
async def test_cancelled_task_removes_its_item() -> None:
    """A task cancelled while its item waits leaves nothing behind in the batcher."""
    rec = Recorder()
    b = DynamicBatcher(rec, max_batch_size=8, max_wait_ms=1e6, clock=MockClock())
    with anyio.move_on_after(0.01):
        await b.asubmit(1)
    s = b.statistics()
    assert (s.pending, s.cancelled, s.in_flight) == (0, 1, 0)
    await b.aclose()
    assert rec.batches == []


@pytest.mark.anyio
async def test_async_errors_reach_the_awaiting_task() -> None:
    """Per-item exceptions and deadlines surface in the awaiting task."""
    clock = MockClock()

    def fn(xs: list[int]) -> list[object]:
        return [KeyError(x) for x in xs]

    async with DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, clock=clock) as b:
        with anyio.fail_after(WAIT), pytest.raises(KeyError):
            await b.asubmit(3)
    async with DynamicBatcher(fn, max_batch_size=8, max_wait_ms=1e6, clock=clock) as b2:
        async with anyio.create_task_group() as tg:
            outcome: list[BaseException] = []

            async def late() -> None:
                try:
                    await b2.asubmit(1, deadline_ms=10)
                except DeadlineExceeded as exc:
                    outcome.append(exc)

            tg.start_soon(late)
            await anyio.wait_all_tasks_blocked()
            clock.advance(0.02)
        assert len(outcome) == 1


# --------------------------------------------------------------------------- stress


def test_stress_threads_and_tasks_with_random_cancellations() -> None:
    """Many threads and tasks, some cancelling: every request resolves exactly once, nothing is held."""
    rng = random.Random(1234)
    lock = threading.Lock()
    outcomes: dict[tuple[str, int], str] = {}

    def fn(xs: list[tuple[str, int]]) -> list[object]:
        return [ValueError("odd") if i % 7 == 0 else (src, i) for src, i in xs]

    b = DynamicBatcher(fn, max_batch_size=16, max_wait_ms=1, max_queue=10_000, max_concurrent_batches=2)

    def record(key: tuple[str, int], what: str) -> None:
        with lock:
            assert key not in outcomes, f"{key} resolved twice"
            outcomes[key] = what

    def thread_caller(t: int) -> None:
        futs = []
        for i in range(200):
            key = (f"t{t}", i)
            futs.append((key, b.submit(key)))
        for key, f in futs:
            if rng.random() < 0.2 and f.cancel():
                record(key, "cancelled")
                continue
            try:
                assert f.result(WAIT) == key
                record(key, "ok")
            except ValueError:
                record(key, "error")

    async def task_main() -> None:
        async def one(i: int) -> None:
            key = ("a", i)
            try:
                if i % 5 == 0:
                    with anyio.move_on_after(0):  # cancelled straight away
                        await b.asubmit(key)
                        record(key, "ok")
                        return
                    record(key, "cancelled")
                    return
                assert await b.asubmit(key) == key
                record(key, "ok")
            except ValueError:
                record(key, "error")

        with anyio.fail_after(WAIT * 3):
            async with anyio.create_task_group() as tg:
                for i in range(400):
                    tg.start_soon(one, i)

    threads = [threading.Thread(target=thread_caller, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    anyio.run(task_main)
    for t in threads:
        t.join(WAIT * 3)
    b.close()
    assert len(outcomes) == 6 * 200 + 400
    s = b.statistics()
    assert (s.pending, s.in_flight) == (0, 0)
    assert s.succeeded + s.failed + s.cancelled == s.submitted
    # A caller may give up after its result was computed (the result is then discarded), so the
    # batcher's cancellations are at most the callers' ones.
    assert s.cancelled <= sum(1 for v in outcomes.values() if v == "cancelled")


class _FakeMonotonic:
    """Stands in for ``batchkit.dynamic.batcher._monotonic``: real seconds that move only when told."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _spy_on_joins(name: str, clock: _FakeMonotonic, monkeypatch: pytest.MonkeyPatch) -> list[float | None]:
    """Make each join of the batcher's threads a simulated wait: record the timeout it was given,
    advance the fake clock by it (the thread is hung, so a real join would wait that long) and
    return at once."""
    waits: list[float | None] = []
    threads = [t for t in threading.enumerate() if t.name.startswith("batchkit-") and t.name.endswith(f"-{name}")]
    assert len(threads) == 3, threads  # the dispatcher and two workers

    def spy(timeout: float | None = None) -> None:
        waits.append(timeout)
        assert timeout is not None, "a bounded close() must not join without a timeout"
        clock.t += timeout

    for t in threads:
        monkeypatch.setattr(t, "join", spy)
    return waits


@pytest.mark.parametrize("closer", ["close", "aclose"])
def test_close_timeout_is_one_deadline_for_all_threads(closer: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """close(timeout=t) / aclose(timeout=t) wait t seconds in all, not t per thread: with two hung
    batches (max_concurrent_batches=2) the dispatcher and both workers share one deadline."""
    import batchkit.dynamic._threads

    clock = _FakeMonotonic()
    monkeypatch.setattr(batchkit.dynamic._threads, "_monotonic", clock)
    rec = Recorder(hold=True)
    # A name of its own: the threads of the other parametrization, released at its end, may still
    # be exiting when this one starts.
    name = f"hung-{closer}"
    b = DynamicBatcher(rec, max_batch_size=1, max_wait_ms=0, max_concurrent_batches=2, name=name)
    try:
        futs = [b.submit(i) for i in range(2)]
        rec.wait_started(2)
        waits = _spy_on_joins(name, clock, monkeypatch)
        if closer == "close":
            b.close(timeout=0.5)
        else:
            anyio.run(lambda: b.aclose(timeout=0.5))
        assert clock.t == pytest.approx(0.5)
        assert sum(w or 0.0 for w in waits) == pytest.approx(0.5)
        assert not any(f.done() for f in futs)
    finally:
        rec.release.set()
    assert [f.result(WAIT) for f in futs] == [0, 10]


def test_close_timeout_cancels_a_hung_async_batch_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """With an async batch function, close(timeout=t) does not wait past t for calls that hang:
    at the deadline they are cancelled, and their callers and those still queued fail with
    BatcherClosed."""
    import batchkit.dynamic._threads

    clock = _FakeMonotonic()
    monkeypatch.setattr(batchkit.dynamic._threads, "_monotonic", clock)
    release = threading.Event()
    started = threading.Semaphore(0)

    async def fn(xs: list[int]) -> list[int]:
        started.release()
        while not release.is_set():  # hangs, but stays cancellable
            await anyio.sleep(0.01)
        return xs

    b = DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, max_concurrent_batches=2, name="hung-async")
    try:
        futs = [b.submit(i) for i in range(2)]
        for _ in futs:
            assert started.acquire(timeout=WAIT)
        futs.append(b.submit(2))  # both workers are busy: this one waits in the queue
        _spy_on_joins("hung-async", clock, monkeypatch)
        closer = threading.Thread(target=b.close, kwargs={"timeout": 0.5})
        closer.start()
        closer.join(WAIT)
        assert not closer.is_alive(), "close() waited past its timeout for a hung async batch"
        assert clock.t == pytest.approx(0.5)
        for f in futs:
            with pytest.raises(BatcherClosed, match="timeout"):
                f.result(WAIT)
    finally:
        release.set()


class _Watched(batchkit.BoundedQueue[object]):
    """A "block" queue that counts the writers that started waiting for room."""

    def __init__(self, maxsize: int, writers: int) -> None:
        super().__init__(maxsize, on_full="block")
        self._writers = writers
        self._count = 0
        self._count_lock = threading.Lock()
        self.all_waiting = threading.Event()

    def _one_more(self) -> None:
        with self._count_lock:
            self._count += 1
            if self._count >= self._writers:
                self.all_waiting.set()

    def wait_for_room(self, timeout: float | None = None) -> bool:
        self._one_more()
        return super().wait_for_room(timeout)

    async def await_room(self) -> None:
        self._one_more()
        await super().await_room()


class TestCloseAnswersCallersBlockedOnAFullQueue:
    """close() answers the callers blocked on a full "block" queue at once, threads and tasks alike."""

    def test_close_answers_writers_blocked_for_room_with_batcher_closed(self) -> None:
        gate = threading.Event()
        started = threading.Event()

        def fn(xs: list[object]) -> list[object]:
            started.set()
            assert gate.wait(WAIT)
            return xs

        q = _Watched(1, writers=3)
        b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, queue=q)
        first = b.submit(0)
        assert started.wait(WAIT)
        second = b.submit(1)  # the queue is full now
        outcomes: dict[str, str] = {}
        answered = threading.Semaphore(0)

        def record(name: str, call: object) -> None:
            try:
                outcomes[name] = repr(call() if callable(call) else call)
            except batchkit.BatcherClosed:
                outcomes[name] = "BatcherClosed"
            except BaseException as exc:  # handed to the test thread
                outcomes[name] = repr(exc)
            finally:
                answered.release()

        def from_thread() -> None:
            record("thread", lambda: b.submit(2))

        def from_asyncio() -> None:
            async def main() -> object:
                return await b.asubmit(3)

            record("asyncio", lambda: asyncio.run(main()))

        def from_trio() -> None:
            async def main() -> object:
                return await b.asubmit(4)

            record("trio", lambda: trio.run(main))

        writers = [threading.Thread(target=f, daemon=True) for f in (from_thread, from_asyncio, from_trio)]
        for t in writers:
            t.start()
        assert q.all_waiting.wait(WAIT)
        closer = threading.Thread(target=b.close, daemon=True)
        closer.start()
        for _ in writers:
            assert answered.acquire(timeout=WAIT)  # answered while the batch still runs
        assert outcomes == {"thread": "BatcherClosed", "asyncio": "BatcherClosed", "trio": "BatcherClosed"}
        gate.set()
        closer.join(WAIT)
        assert [first.result(WAIT), second.result(WAIT)] == [0, 1]


class TestABlockedWriterLearnsOfACloseThatRacedItsWait:
    """A writer blocked on a full "block" queue learns of close() even when close() wakes the waiting
    writers between its finding the queue full and its starting to wait (it missed that wake-up)."""

    @pytest.mark.parametrize("caller", ["submit", "asubmit"])
    def test_a_writer_that_starts_waiting_just_after_close_gets_batcher_closed(
        self, caller: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        release = threading.Event()
        started = threading.Event()

        def fn(xs: list[int]) -> list[int]:
            started.set()
            assert release.wait(WAIT)
            return xs

        b = DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, max_concurrent_batches=1, max_queue=1, on_full="block")
        queue = b.queue
        woken = threading.Event()
        real_wake = queue.wake_room_waiters

        def wake() -> None:
            real_wake()
            woken.set()

        monkeypatch.setattr(queue, "wake_room_waiters", wake)
        closer = threading.Thread(target=b.close)

        def close_first() -> None:
            """The writer found the queue full; close() runs (and wakes the waiting writers, of which
            there are none yet) before the writer starts waiting."""
            if not closer.is_alive() and not woken.is_set():
                closer.start()
                assert woken.wait(WAIT)

        real_wait, real_await = queue.wait_for_room, queue.await_room

        def wait_for_room(timeout: float | None = None) -> bool:
            close_first()
            return real_wait(timeout)

        async def await_room() -> None:
            close_first()
            await real_await()

        monkeypatch.setattr(queue, "wait_for_room", wait_for_room)
        monkeypatch.setattr(queue, "await_room", await_room)

        running = b.submit(0)
        assert started.wait(WAIT)
        queued = b.submit(1)  # the queue (max_queue=1) is now full
        outcome: list[Any] = []

        def writer() -> None:
            try:
                if caller == "submit":
                    b.submit(2).result(WAIT)
                else:
                    anyio.run(b.asubmit, 2)
            except BaseException as exc:  # the outcome is what the test checks
                outcome.append(exc)

        t = threading.Thread(target=writer)
        t.start()
        try:
            t.join(WAIT)  # the held batch still runs: the queue has no room until it is released
            assert not t.is_alive(), "the writer waited for room after close()"
            assert len(outcome) == 1, outcome
            assert isinstance(outcome[0], BatcherClosed), outcome
        finally:
            release.set()
            closer.join(WAIT)
            t.join(WAIT)
        assert (running.result(WAIT), queued.result(WAIT)) == (0, 1)  # close() drains what it had


class TestCloseFromInsideTheBatchFunction:
    """close()/aclose() called from inside the batch function: it neither deadlocks nor leaves threads."""

    def test_close_from_the_batch_function_then_from_outside_joins_every_thread(self) -> None:
        """A close() inside the batch function returns; the next close() (outside) joins the threads."""
        ran_in: list[threading.Thread] = []
        inner: dict[str, object] = {}
        holder: dict[str, batchkit.DynamicBatcher[int, int]] = {}
        both_submitted = threading.Event()

        def fn(xs: list[int]) -> list[int]:
            ran_in.append(threading.current_thread())
            if 0 in xs:
                assert both_submitted.wait(WAIT)  # close only once the second item is queued
                holder["b"].close(timeout=WAIT)
                inner["closed"] = holder["b"].closed
            return xs

        b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0)
        holder["b"] = b
        try:
            first, second = b.submit(0), b.submit(1)
        finally:
            both_submitted.set()
        assert first.result(WAIT) == 0
        assert second.result(WAIT) == 1  # waiting work still drains
        assert inner == {"closed": True}
        b.close()
        assert not [t.name for t in ran_in if t.is_alive()]

    def test_aclose_from_an_async_batch_function_does_not_deadlock(self) -> None:
        """``await batcher.aclose()`` inside the ``async def`` batch function returns, and the batch's
        caller gets its result."""
        holder: dict[str, batchkit.DynamicBatcher[int, int]] = {}
        inner: list[str] = []

        async def fn(xs: list[int]) -> list[int]:
            if 0 in xs:
                await holder["b"].aclose()
                inner.append("closed")
            return [x + 1 for x in xs]

        b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0)
        holder["b"] = b
        fut = b.submit(0)
        assert fut.result(WAIT) == 1
        assert inner == ["closed"]
        b.close()
        assert b.closed

    def test_close_from_an_async_batch_function_does_not_deadlock(self) -> None:
        """The blocking ``close()`` inside an ``async def`` batch function returns as well."""
        holder: dict[str, batchkit.DynamicBatcher[int, int]] = {}

        async def fn(xs: list[int]) -> list[int]:
            if 0 in xs:
                holder["b"].close()
            return xs

        b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0)
        holder["b"] = b
        assert b.submit(0).result(WAIT) == 0
        b.close()

    def test_asyncbatcher_aclose_from_its_batch_function_does_not_deadlock(self) -> None:
        """``await b.aclose()`` in an AsyncBatcher's own batch function returns; the batch's caller
        gets its result, the items still waiting drain, and later submits are refused."""

        async def main() -> tuple[list[int], list[str]]:
            holder: dict[str, batchkit.AsyncBatcher[int, int]] = {}
            inner: list[str] = []

            async def fn(xs: list[int]) -> list[int]:
                if 0 in xs:
                    await holder["b"].aclose()
                    inner.append("closed")
                return [x + 1 for x in xs]

            b = batchkit.AsyncBatcher(fn, max_batch_size=1, max_wait_ms=0)
            holder["b"] = b
            futs = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
            done, _ = await asyncio.wait(futs, timeout=WAIT)
            assert len(done) == 3
            try:
                await b.submit(9)
            except batchkit.BatcherClosed:
                inner.append("refused")
            await b.aclose()
            return [f.result() for f in futs], inner

        assert asyncio.run(main()) == ([1, 2, 3], ["closed", "refused"])


CLOSE_TIMEOUT_S = 0.2  # how long close() waits for the hung batch; nothing is timed against it


class TestCloseTimeoutFailsTheRunningBatchAndCancelsTheWaiting:
    """close(timeout=t) with an async batch function that hangs: the batch running at the deadline
    fails (its call was cancelled), the items still waiting never run and count as cancelled, the
    same in DynamicBatcher and AsyncBatcher (api.md, BatcherStatistics)."""

    def test_dynamic_batcher_counts_items_that_never_ran_as_cancelled(self) -> None:
        started = threading.Event()

        async def hang(xs: list[int]) -> list[int]:
            started.set()
            await anyio.sleep(WAIT * 6)  # cancelled by close at its deadline
            return xs

        b = DynamicBatcher(hang, max_batch_size=1, max_wait_ms=0, max_concurrent_batches=1)
        futs = [b.submit(0)]
        assert started.wait(WAIT)
        futs += [b.submit(i) for i in (1, 2)]  # wait behind the hung batch
        b.close(timeout=CLOSE_TIMEOUT_S)
        for f in futs:
            with pytest.raises(BatcherClosed):
                f.result(WAIT)
        s = b.statistics()
        assert (s.submitted, s.succeeded, s.failed, s.cancelled) == (3, 0, 1, 2)

    def test_async_batcher_counts_them_the_same(self) -> None:
        async def main() -> tuple[int, int, int, int]:
            started = anyio.Event()

            async def hang(xs: list[int]) -> list[int]:
                started.set()
                await anyio.sleep(WAIT * 6)
                return xs

            b = AsyncBatcher(hang, max_batch_size=1, max_wait_ms=0, max_concurrent_batches=1)
            outcomes: list[BaseException] = []

            async def one(i: int) -> None:
                try:
                    await b.submit(i)
                except BatcherClosed as exc:
                    outcomes.append(exc)

            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(one, 0)
                    await started.wait()
                    tg.start_soon(one, 1)
                    tg.start_soon(one, 2)
                    await anyio.wait_all_tasks_blocked()
                    await b.aclose(timeout=CLOSE_TIMEOUT_S)
            assert len(outcomes) == 3
            s = b.statistics()
            return s.submitted, s.succeeded, s.failed, s.cancelled

        assert anyio.run(main) == (3, 0, 1, 2)


class TestCostBoundedBatches:
    """Cost-bounded batches (docs/api.md, DynamicBatcher): the bound, and an item over it on its own."""

    def test_batches_stay_within_max_batch_cost_and_an_oversized_item_runs_alone(self) -> None:
        clock = MockClock()
        seen: list[list[str]] = []

        def fn(xs: list[str]) -> list[str]:
            seen.append(list(xs))
            return xs

        b = batchkit.DynamicBatcher(
            fn, max_batch_size=100, max_wait_ms=100, size_fn=len, max_batch_cost=10, clock=clock
        )
        futs = [b.submit(s) for s in ["aaaa", "bbbb", "ccc", "x" * 11, "d"]]
        clock.advance(0.2)
        assert [f.result(WAIT) for f in futs] == ["aaaa", "bbbb", "ccc", "x" * 11, "d"]
        assert all(sum(map(len, batch)) <= 10 for batch in seen if len(batch) > 1)
        assert ["x" * 11] in seen
        assert sorted(x for batch in seen for x in batch) == sorted(["aaaa", "bbbb", "ccc", "x" * 11, "d"])
        b.close()

    def test_size_fn_runs_at_submit_and_its_errors_fail_that_submit(self) -> None:
        def cost(x: str) -> float:
            if x == "boom":
                raise ZeroDivisionError("no cost")
            return -1.0 if x == "neg" else 1.0

        b = batchkit.DynamicBatcher(lambda xs: xs, max_wait_ms=0, size_fn=cost, max_batch_cost=10)
        with pytest.raises(ZeroDivisionError):
            b.submit("boom")
        with pytest.raises(ValueError, match="cost"):
            b.submit("neg")
        assert b.submit("ok").result(WAIT) == "ok"
        b.close()


BASE_EXCEPTIONS = [KeyboardInterrupt, SystemExit, GeneratorExit]


async def _raise_cancelled(xs: list[int]) -> list[int]:
    raise asyncio.CancelledError("raised by the batch function, nobody cancelled it")


def _raise_cancelled_sync(xs: list[int]) -> list[int]:
    raise asyncio.CancelledError("raised by the batch function, nobody cancelled it")


class TestABatchFunctionRaisingABaseException:
    """A batch function that raises what an ordinary ``except Exception`` does not catch
    (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``, a spontaneous
    ``asyncio.CancelledError``): its callers get the exception, every caller is answered, and the
    batcher keeps serving the next ones."""

    @pytest.mark.parametrize("exc_type", BASE_EXCEPTIONS, ids=lambda t: t.__name__)
    def test_sync_batch_function_raising_a_base_exception_fails_only_its_batch(
        self, exc_type: type[BaseException]
    ) -> None:
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
        self,
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

    @pytest.mark.parametrize("offload", [False, True], ids=["async_def", "offload"])
    def test_async_batcher_batch_function_raising_cancelled_error_answers_its_callers(self, offload: bool) -> None:
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

    def test_dynamic_batcher_async_def_raising_cancelled_error_answers_its_callers(self) -> None:
        with batchkit.DynamicBatcher(_raise_cancelled, max_batch_size=2, max_wait_ms=1) as b:
            futures = [b.submit(1), b.submit(2)]
            for f in futures:
                with pytest.raises((asyncio.CancelledError, concurrent.futures.CancelledError)):
                    f.result(timeout=10)
        s = b.statistics()
        assert s.submitted == 2
        assert s.failed + s.cancelled == 2

    def test_async_batcher_offload_generator_exit_does_not_reach_the_loop_handler(self) -> None:
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


class _EqRaises:
    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparing")


def _key(item: int) -> Hashable:
    if item < 0:
        return float("nan") if item == -1 else _EqRaises()
    return item % 2


class TestAGroupKeyThatCannotBeFoundAgain:
    """A ``group_by`` key that is not equal to itself (a NaN) or cannot be compared could never be
    found again to form a batch: its submit is a ValueError, nothing is queued, and the batcher
    keeps serving (it left the callers waiting forever, and a raising ``__eq__`` killed the
    dispatcher)."""

    def test_dynamic_batcher_refuses_a_key_unequal_to_itself(self) -> None:
        with batchkit.DynamicBatcher(lambda xs: xs, max_batch_size=2, max_wait_ms=1, group_by=_key) as b:
            for bad in (-1, -2):
                with pytest.raises(ValueError, match="group key"):
                    b.submit(bad)
            futures = [b.submit(i) for i in range(4)]
            assert [f.result(timeout=10) for f in futures] == [0, 1, 2, 3]
        s = b.statistics()
        assert (s.submitted, s.succeeded, s.pending) == (4, 4, 0)

    def test_async_batcher_refuses_a_key_unequal_to_itself(self) -> None:
        async def fn(xs: list[int]) -> list[int]:
            return xs

        async def main() -> list[Any]:
            async with batchkit.AsyncBatcher(fn, max_batch_size=2, max_wait_ms=1, group_by=_key) as b:
                for bad in (-1, -2):
                    with pytest.raises(ValueError, match="group key"):
                        await b.submit(bad)
                return list(await asyncio.wait_for(asyncio.gather(*(b.submit(i) for i in range(4))), 10))

        assert asyncio.run(main()) == [0, 1, 2, 3]


def _double(xs: list[int]) -> list[int]:
    return [2 * x for x in xs]


class TestAQueueOfItsOwnIsTakenWithItsCapacity:
    """A queue passed to the batcher brings its capacity and policy: max_queue or on_full beside it
    is refused, not silently half-applied."""

    @pytest.mark.parametrize("extra", [{"max_queue": 8}, {"on_full": "block"}])
    def test_a_queue_with_its_own_capacity_refuses_max_queue_and_on_full(self, extra: dict[str, object]) -> None:
        q: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(4)
        with pytest.raises(ValueError, match="not both"):
            batchkit.DynamicBatcher(_double, queue=q, **extra)  # type: ignore[arg-type]

    def test_a_queue_alone_is_taken_with_its_capacity(self) -> None:
        q: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(4)
        with batchkit.DynamicBatcher(_double, queue=q, max_wait_ms=0) as b:
            assert b.queue.maxsize == 4
            assert b(3) == 6


LONG_RUN = 12_000  # past the 10,000 samples the recent window keeps


def _long_run_statistics() -> batchkit.BatcherStatistics:
    """A batcher's statistics after it answered LONG_RUN callers (in batches of 1,000)."""
    b = batchkit.DynamicBatcher(echo_batch, max_batch_size=1000, max_wait_ms=1e6, max_queue=LONG_RUN)
    futs = [b.submit(i) for i in range(LONG_RUN)]
    b.flush()
    assert [f.result(WAIT) for f in futs] == list(range(LONG_RUN))
    b.close()
    return b.statistics()


class TestStatistics:
    """statistics() fields as docs/api.md defines them: in flight, one counter per outcome, whole-run
    latencies and their recent views."""

    def test_in_flight_counts_items_of_running_batches(self) -> None:
        """A running batch of 3 is 3 items in flight and 1 running batch; the waiting ones are pending."""
        gate = threading.Event()
        started = threading.Event()

        def fn(xs: list[int]) -> list[int]:
            started.set()
            assert gate.wait(WAIT)
            return xs

        b = batchkit.DynamicBatcher(fn, max_batch_size=3, max_wait_ms=1e6)
        futs = [b.submit(i) for i in range(5)]
        assert started.wait(WAIT)
        s = b.statistics()
        assert (s.pending, s.in_flight, s.running_batches) == (2, 3, 1)
        assert autoscaling_stats(b) == {QUEUE_DEPTH_METRIC: 2.0, RUNNING_BATCHES_METRIC: 1.0}
        gate.set()
        b.flush()
        assert [f.result(WAIT) for f in futs] == [0, 1, 2, 3, 4]
        b.close()
        s = b.statistics()
        assert (s.pending, s.in_flight, s.running_batches, s.submitted, s.succeeded) == (0, 0, 0, 5, 5)

    def test_counters_of_each_outcome(self) -> None:
        """One caller of each outcome lands in its own counter."""
        clock = MockClock()
        gate = threading.Event()
        started = threading.Event()

        def fn(xs: list[str]) -> list[object]:
            started.set()
            assert gate.wait(WAIT)
            return [ValueError(x) if x == "bad" else x for x in xs]

        b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, max_queue=3, clock=clock)
        first = b.submit("ok")
        assert started.wait(WAIT)
        late = b.submit("late", deadline_ms=10, fallback="fb")
        gone = b.submit("gone")
        bad = b.submit("bad")
        with pytest.raises(batchkit.QueueFull):
            b.submit("refused")
        assert gone.cancel()
        clock.advance(1.0)
        assert late.result(WAIT) == "fb"
        gate.set()
        assert first.result(WAIT) == "ok"
        assert isinstance(bad.exception(WAIT), ValueError)
        b.close()
        s = b.statistics()
        assert (s.submitted, s.succeeded, s.failed, s.cancelled, s.expired, s.rejected) == (4, 1, 1, 1, 1, 1)

    def test_batcher_latencies_cover_every_answered_caller(self) -> None:
        """After more answers than the recent window holds, ``latency`` and ``queue_wait`` still count
        every caller (whole-run), so a p99 read after a long run is the run's, not its tail's."""
        s = _long_run_statistics()
        assert s.succeeded == LONG_RUN
        assert s.latency is not None
        assert s.queue_wait is not None
        assert s.batch_time is not None
        assert (s.latency.count, s.queue_wait.count, s.batch_time.count) == (LONG_RUN, LONG_RUN, s.batches)

    def test_batcher_recent_views_are_the_last_ten_thousand_samples(self) -> None:
        """``latency_recent``, ``queue_wait_recent`` and ``batch_time_recent`` of ``BatcherStatistics``
        are the named recent view: the last 10,000 samples, beside the whole-run fields."""
        s = _long_run_statistics()
        assert s.latency_recent is not None
        assert s.queue_wait_recent is not None
        assert s.batch_time_recent is not None
        recent = (s.latency_recent.count, s.queue_wait_recent.count, s.batch_time_recent.count)
        assert recent == (10_000, 10_000, s.batches)
        assert s.latency_recent.histogram is None

    def test_whole_run_latencies_of_several_batchers_merge_into_one(self) -> None:
        """``LatencySummary.merge`` over the ``latency`` of several batchers' statistics is the
        latency of all their callers: counts add up, the max is the slowest batcher's."""
        clock = MockClock()
        fast = batchkit.DynamicBatcher(echo_batch, max_batch_size=10, max_wait_ms=1e6, clock=clock)
        slow = batchkit.DynamicBatcher(echo_batch, max_batch_size=10, max_wait_ms=1e6, clock=clock)
        waiting = [slow.submit(i) for i in range(5)]
        assert [f.result(WAIT) for f in [fast.submit(i) for i in range(30)]] == list(range(30))  # full batches, no wait
        clock.advance(2.0)
        slow.flush()
        assert [f.result(WAIT) for f in waiting] == list(range(5))
        fast.close()
        slow.close()
        merged = batchkit.LatencySummary.merge(fast.statistics().latency, slow.statistics().latency)
        assert (merged.count, merged.max_ms, merged.p50_ms) == (35, 2000.0, 0.0)


class TestBlockedWritersAndTheBreaker:
    """A writer waiting for room in a full "block" queue meets an open breaker as new work does."""

    def test_a_writer_waiting_for_room_fails_fast_when_a_failure_opens_the_breaker(self) -> None:
        """The queue stays full (an open breaker dispatches nothing until its probe), so only the
        failure that opened it can tell the blocked writer: it gets CircuitOpen, not a wait of
        reset_timeout_s or of its own timeout."""
        release, entered = threading.Event(), threading.Event()

        def fn(xs: list[int]) -> list[int]:
            entered.set()
            release.wait(WAIT)
            raise RuntimeError("down")

        breaker = batchkit.CircuitBreaker(failure_threshold=1, reset_timeout_s=3600.0)
        b = batchkit.DynamicBatcher(
            fn, max_batch_size=1, max_wait_ms=0, max_queue=1, on_full="block", circuit_breaker=breaker
        )
        try:
            running = b.submit(1)  # taken: the batch blocks in fn
            assert entered.wait(WAIT)
            waiting = b.submit(2)  # the queue's one place
            outcome: list[BaseException] = []
            blocked = threading.Event()

            def writer() -> None:
                blocked.set()
                try:
                    b.submit(3, timeout=3 * WAIT)  # waits for room: the queue is full
                except BaseException as exc:
                    outcome.append(exc)

            t = threading.Thread(target=writer)
            t.start()
            assert blocked.wait(WAIT)
            release.set()
            with pytest.raises(RuntimeError, match="down"):
                running.result(WAIT)
            t.join(WAIT)
            assert not t.is_alive(), "the writer still waits for room behind an open breaker"
            assert len(outcome) == 1
            assert isinstance(outcome[0], batchkit.CircuitOpen)
        finally:
            release.set()
            b.close(drain=False, timeout=WAIT)
        with pytest.raises(BatcherClosed):  # close(drain=False) fails what still waits
            waiting.result(WAIT)


def test_a_cuda_out_of_memory_error_splits_the_batch_and_lowers_the_ceiling() -> None:
    """torch.cuda.OutOfMemoryError, like MemoryError, always splits and retries (no isolate_errors
    needed) and lowers the controller's ceiling."""
    torch = pytest.importorskip("torch")

    def fn(xs: list[int]) -> list[int]:
        if len(xs) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return [2 * x for x in xs]

    clock = MockClock()
    ctl = AdaptiveBatchController(target_queue=0, max_batch=8, initial=8, clock=clock)
    with DynamicBatcher(fn, max_batch_size=8, max_wait_ms=1e6, controller=ctl, clock=clock) as b:
        futures = [b.submit(i) for i in range(8)]
        assert [f.result(WAIT) for f in futures] == [2 * i for i in range(8)]
    assert ctl.ceiling <= 4


def test_a_queue_that_is_not_a_bounded_queue_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"queue must be a batchkit\.BoundedQueue"):
        batchkit.DynamicBatcher(echo_batch, queue=[])  # type: ignore[arg-type]


def test_a_deadline_that_is_not_a_number_is_a_value_error_naming_it() -> None:
    """``deadline_ms`` is checked at submit (the batcher's and the queue's), with its name."""
    with batchkit.DynamicBatcher(echo_batch) as b:
        with pytest.raises(ValueError, match="deadline_ms"):
            b.submit(1, deadline_ms="100")  # type: ignore[arg-type]
        assert b.statistics().submitted == 0
        assert b.submit(2).result(timeout=WAIT) == 2
    q: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(4)
    with pytest.raises(ValueError, match="deadline_ms"):
        q.put_nowait(1, deadline_ms="100")  # type: ignore[arg-type]
    assert len(q) == 0


def test_a_zero_deadline_has_passed_on_arrival_and_the_item_never_runs() -> None:
    """api.md: ``deadline_ms=0`` has passed on arrival: DeadlineExceeded (or the fallback), and
    the batch function never sees the item, even with a greedy batcher (``max_wait_ms=0``)."""
    seen: list[object] = []

    def fn(xs: list[object]) -> list[object]:
        seen.extend(xs)
        return xs

    with batchkit.DynamicBatcher(fn, max_wait_ms=0) as b:
        for _ in range(3):
            with pytest.raises(batchkit.DeadlineExceeded):
                b.submit(1, deadline_ms=0).result(timeout=WAIT)
        assert b.submit(2, deadline_ms=0, fallback="late").result(timeout=WAIT) == "late"
        assert b.submit(3).result(timeout=WAIT) == 3
    assert seen == [3]
    assert b.statistics().expired == 4


@pytest.mark.parametrize("cost", [None, "3", math.inf, math.nan, -1])
def test_a_size_fn_cost_that_is_not_a_finite_number_at_least_zero_fails_that_submit(cost: object) -> None:
    """api.md: a cost that is not a number >= 0 fails that submit. An infinite cost is refused
    too: it would leave its group's running total NaN, and ``max_batch_cost`` would stop
    dispatching full batches of that group."""

    def size_fn(x: object) -> Any:
        return cost if x == "bad" else 1

    b: batchkit.DynamicBatcher[object, object] = batchkit.DynamicBatcher(echo_batch, size_fn=size_fn, max_batch_cost=10)
    with b:
        with pytest.raises(ValueError, match="size_fn"):
            b.submit("bad")
        assert b.statistics().submitted == 0
        assert b.submit("good").result(timeout=WAIT) == "good"
    q: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(4)
    with pytest.raises(ValueError, match="cost"):
        q.put_nowait(1, cost=math.inf)


class _WatchClock:
    """The real clock, recording the queue depth each time the batcher's dispatcher thread
    reads it (the dispatcher reads the clock, under the batcher's lock, before it decides and
    sleeps; a call that needs that lock afterwards runs once it sleeps)."""

    def __init__(self) -> None:
        self.batcher: batchkit.DynamicBatcher[Any, Any] | None = None
        self.depths: list[int] = []
        self._cond = threading.Condition()

    def now(self) -> float:
        t = time.monotonic()
        b = self.batcher
        if b is not None and threading.current_thread().name.startswith("batchkit-dispatch"):
            with self._cond:
                self.depths.append(b.queue_depth())
                self._cond.notify_all()
        return t

    def wait_for(self, predicate: Callable[[list[int]], bool]) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: predicate(self.depths), timeout=WAIT)


def test_an_infinite_max_wait_ms_leaves_batches_to_size_and_flush() -> None:
    """``max_wait_ms=math.inf`` (a number >= 0): a lone item waits for company or a flush; the
    dispatcher sleeps until told instead of dying on a wait the platform cannot time."""
    clock = _WatchClock()
    b = batchkit.DynamicBatcher(echo_batch, max_batch_size=4, max_wait_ms=math.inf, clock=clock)
    clock.batcher = b
    fut = b.submit(1)
    clock.wait_for(lambda depths: 1 in depths)  # the dispatcher has seen the item and sleeps
    b.flush()
    assert fut.result(timeout=WAIT) == 1
    b.close(timeout=WAIT)
    assert b.statistics().flush_reasons == {"flush": 1}


@pytest.mark.parametrize("infinite", ["deadline_ms", "batch_timeout_s"])
def test_an_infinite_deadline_or_batch_timeout_keeps_the_dispatcher_alive(infinite: str) -> None:
    """An item with ``deadline_ms=math.inf`` waiting behind a busy batch, or a running batch
    under ``batch_timeout_s=math.inf``, has no time to wake for: later deadlines still expire."""
    clock = _WatchClock()
    started, gate = threading.Event(), threading.Event()

    def fn(xs: list[str]) -> list[str]:
        if "slow" in xs:
            started.set()
            gate.wait(WAIT)
        return xs

    b = batchkit.DynamicBatcher(
        fn,
        max_batch_size=1,
        max_wait_ms=0,
        batch_timeout_s=math.inf if infinite == "batch_timeout_s" else None,
        clock=clock,
    )
    clock.batcher = b
    try:
        slow = b.submit("slow")
        assert started.wait(WAIT)
        if infinite == "deadline_ms":
            clock.depths.clear()
            patient = b.submit("patient", deadline_ms=math.inf)
            clock.wait_for(lambda depths: 1 in depths)  # the dispatcher has seen it and sleeps
        else:
            clock.wait_for(lambda depths: 0 in depths[depths.index(1) :] if 1 in depths else False)
        hurried = b.submit("hurried", deadline_ms=1, fallback="too late")
        assert hurried.result(timeout=WAIT) == "too late"  # expired while "slow" still runs
        assert not slow.done()
    finally:
        gate.set()
    assert slow.result(timeout=WAIT) == "slow"
    if infinite == "deadline_ms":
        assert patient.result(timeout=WAIT) == "patient"
    b.close(timeout=WAIT)
    assert b.statistics().expired == 1


def test_an_infinite_timeout_means_no_limit() -> None:
    """``timeout=math.inf`` waits without a limit (``close``, the queue's ``get``, ``put`` and
    ``wait_for_room``) instead of raising OverflowError."""
    b = batchkit.DynamicBatcher(echo_batch)
    assert b.submit(1).result(timeout=WAIT) == 1
    b.close(timeout=math.inf)
    assert b.closed
    with pytest.raises(batchkit.BatcherClosed):
        b.submit(2)

    q: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(1, "block")
    writer = threading.Thread(target=lambda: q.put(7, timeout=math.inf))
    writer.start()
    assert q.get(timeout=math.inf) == 7  # waits for the writer (or finds its item)
    writer.join(WAIT)
    assert q.wait_for_room(math.inf)
    q.put_nowait(8)
    filler = threading.Thread(target=lambda: q.put(9, timeout=math.inf))  # waits for room
    filler.start()
    assert q.get(timeout=WAIT) == 8
    filler.join(WAIT)
    assert not filler.is_alive()
    assert q.get_nowait() == 9


def test_the_blocking_call_takes_the_arguments_of_submit() -> None:
    """``batcher(item)`` and ``f(x)`` block for one result, with ``submit``'s ``fallback`` and
    ``timeout`` as ``acall`` has them."""
    with batchkit.DynamicBatcher(echo_batch) as b:
        assert b(1, deadline_ms=0, fallback="fallback") == "fallback"  # expired at once
        assert b(2, priority=-1) == 2

    @batchkit.batched(max_batch=4, max_wait_ms=1)
    def f(xs: list[int]) -> list[int]:
        return xs

    assert f(1, deadline_ms=0, fallback=None) is None
    f.close()

    started, gate = threading.Event(), threading.Event()

    def slow(xs: list[int]) -> list[int]:
        started.set()
        gate.wait(WAIT)
        return xs

    b2 = batchkit.DynamicBatcher(slow, max_batch_size=1, max_wait_ms=0, max_queue=1, on_full="block")
    try:
        running = b2.submit(1)
        assert started.wait(WAIT)
        waiting = b2.submit(2)  # fills the queue
        with pytest.raises(batchkit.QueueFull, match="timeout"):
            b2(3, timeout=0.01)
        assert b2.statistics().rejected == 1
    finally:
        gate.set()
    assert (running.result(timeout=WAIT), waiting.result(timeout=WAIT)) == (1, 2)
    b2.close(timeout=WAIT)


def test_a_queue_with_its_own_on_drop_is_refused_with_the_reason() -> None:
    """A ``queue=`` that comes with an ``on_drop`` of its user is refused for what it is (the
    batcher needs that hook to answer dropped callers), not as a queue of another batcher."""
    q: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(4, on_drop=lambda entry, error: None)
    with pytest.raises(ValueError, match="queue has an on_drop callback") as refused:
        batchkit.DynamicBatcher(echo_batch, queue=q)
    assert "another batcher" not in str(refused.value)
    owned: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(4)
    b = batchkit.DynamicBatcher(echo_batch, queue=owned)
    with pytest.raises(ValueError, match="queue already belongs to a batcher"):
        batchkit.DynamicBatcher(echo_batch, queue=owned)
    b.close()


def test_close_without_drain_fails_an_item_with_a_fallback_with_batcher_closed() -> None:
    """``fallback`` answers a deadline that passed; ``close(drain=False)`` fails what waits with
    BatcherClosed, fallback or not (and counts it as cancelled)."""
    b = batchkit.DynamicBatcher(echo_batch, max_batch_size=4, max_wait_ms=1000, clock=MockClock())
    waiting = b.submit(1, deadline_ms=5000, fallback="fallback")
    b.close(drain=False)
    with pytest.raises(batchkit.BatcherClosed):
        waiting.result(timeout=WAIT)
    assert (b.statistics().cancelled, b.statistics().expired) == (1, 0)
    asyncio.run(_async_close_without_drain_with_a_fallback())


async def _async_close_without_drain_with_a_fallback() -> None:
    b = batchkit.AsyncBatcher(echo_batch, max_batch_size=4, max_wait_ms=1000, clock=MockClock())
    waiting = asyncio.create_task(b.submit(1, deadline_ms=5000, fallback="fallback"))
    await asyncio.sleep(0)  # one loop turn: it is admitted
    assert b.queue_depth() == 1
    await b.aclose(drain=False)
    with pytest.raises(batchkit.BatcherClosed):
        await asyncio.wait_for(waiting, WAIT)
    assert (b.statistics().cancelled, b.statistics().expired) == (1, 0)


def test_a_queue_and_a_batcher_clock_that_differ_are_refused() -> None:
    """The batcher runs on its queue's clock: a ``clock=`` other than the queue's would set
    deadlines on one clock and read them on the other (the queue's own statistics() expired a
    caller at once). The same clock, on the queue alone or on both, is taken."""
    clock = MockClock()
    with pytest.raises(ValueError, match="clock"):
        batchkit.DynamicBatcher(echo_batch, queue=batchkit.BoundedQueue(8), clock=clock)
    q: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(8, clock=clock)
    b = batchkit.DynamicBatcher(echo_batch, queue=q, clock=clock, max_wait_ms=1000)
    waiting = b.submit(1, deadline_ms=60_000)
    assert q.statistics().expiries == 0
    assert not waiting.done()
    clock.advance(1.0)
    assert waiting.result(timeout=WAIT) == 1
    b.close(timeout=WAIT)


def test_a_better_priority_does_not_wait_behind_another_group() -> None:
    """Lower ``priority`` goes first, with ``group_by`` too: when the oldest item's wait is up,
    the group of the best waiting item goes first (on both batchers)."""
    clock = MockClock()
    calls: list[list[tuple[str, int]]] = []

    def fn(xs: list[tuple[str, int]]) -> list[tuple[str, int]]:
        calls.append(list(xs))
        return xs

    def group(x: tuple[str, int]) -> str:
        return x[0]

    b = batchkit.DynamicBatcher(fn, max_batch_size=4, max_wait_ms=10, group_by=group, clock=clock)
    late = b.submit(("low", 1), priority=5)
    urgent = b.submit(("high", 1), priority=-1)
    clock.advance(0.01)
    assert (late.result(timeout=WAIT), urgent.result(timeout=WAIT)) == (("low", 1), ("high", 1))
    b.close(timeout=WAIT)
    assert calls == [[("high", 1)], [("low", 1)]]

    calls.clear()
    asyncio.run(_async_priority_across_groups(fn, group))
    assert calls == [[("high", 1)], [("low", 1)]]


async def _async_priority_across_groups(fn: Callable[..., Any], group: Callable[..., Any]) -> None:
    b = batchkit.AsyncBatcher(fn, max_batch_size=4, max_wait_ms=60_000, group_by=group)
    late = asyncio.create_task(b.submit(("low", 1), priority=5))
    urgent = asyncio.create_task(b.submit(("high", 1), priority=-1))
    await asyncio.sleep(0)  # one loop turn: both are admitted
    assert b.queue_depth() == 2
    b.flush()
    assert list(await asyncio.wait_for(asyncio.gather(late, urgent), WAIT)) == [("low", 1), ("high", 1)]
    await b.aclose(timeout=WAIT)


def test_of_two_full_groups_the_one_with_the_better_priority_goes_first() -> None:
    """Two groups fill up while the only batch slot is busy: when it frees, the group whose best
    item has the lower priority goes first, whichever filled first."""
    started, release = threading.Event(), threading.Event()
    calls: list[list[tuple[str, int]]] = []

    def fn(xs: list[tuple[str, int]]) -> list[tuple[str, int]]:
        calls.append(list(xs))
        if xs[0][0] == "busy":
            started.set()
            assert release.wait(WAIT)
        return xs

    b = batchkit.DynamicBatcher(fn, max_batch_size=2, max_wait_ms=60_000, group_by=lambda x: x[0])
    try:
        busy = [b.submit(("busy", i)) for i in range(2)]
        assert started.wait(WAIT)
        low = [b.submit(("low", i), priority=5) for i in range(2)]  # full first
        high = [b.submit(("high", i), priority=-1) for i in range(2)]
        release.set()
        for f in busy + low + high:
            f.result(timeout=WAIT)
    finally:
        release.set()
        b.close(timeout=WAIT)
    assert [c[0][0] for c in calls] == ["busy", "high", "low"]


def test_items_a_close_without_drain_ends_are_cancellations_of_the_queue_not_served() -> None:
    """QueueStatistics: ``served`` and ``wait`` are the entries taken out to run; those that
    ``close(drain=False)`` ends never ran, and count as ``cancellations``."""
    started, release = threading.Event(), threading.Event()

    def fn(xs: list[int]) -> list[int]:
        started.set()
        assert release.wait(WAIT)
        return xs

    b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0)
    try:
        running = b.submit(0)
        assert started.wait(WAIT)
        waiting = [b.submit(i) for i in (1, 2, 3)]
        b.close(drain=False, timeout=0)
    finally:
        release.set()
    b.close(timeout=WAIT)
    assert running.result(timeout=WAIT) == 0
    for f in waiting:
        with pytest.raises(batchkit.BatcherClosed):
            f.result(timeout=WAIT)
    q = b.queue.statistics()
    assert (q.served, q.wait.count, q.cancellations, q.depth) == (1, 1, 3, 0)


def test_close_without_drain_during_a_draining_close_fails_what_waits_at_once() -> None:
    """A ``close()`` that drains waits for every item; a ``close(drain=False)`` called meanwhile
    (say, a second Ctrl-C) fails the items still waiting with BatcherClosed at once, while the
    running batch finishes."""
    started, release = threading.Event(), threading.Event()

    def fn(xs: list[int]) -> list[int]:
        started.set()
        assert release.wait(WAIT)
        return xs

    b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0)
    draining = threading.Thread(target=b.close, kwargs={"timeout": WAIT})
    try:
        running = b.submit(0)
        assert started.wait(WAIT)
        waiting = [b.submit(i) for i in (1, 2)]
        draining.start()
        deadline = time.monotonic() + WAIT
        while not b.closed:  # the draining close() has begun
            assert time.monotonic() < deadline
            time.sleep(0.001)
        b.close(drain=False, timeout=0)
        for f in waiting:  # failed while the running batch still holds its slot
            with pytest.raises(batchkit.BatcherClosed):
                f.result(timeout=WAIT)
    finally:
        release.set()
        draining.join(WAIT)
    assert running.result(timeout=WAIT) == 0
    assert not draining.is_alive()


def test_lowering_max_batch_size_dispatches_a_group_that_now_holds_it() -> None:
    """api.md: ``max_batch_size`` is settable, and a batch goes when a group holds that many
    items: lowering it to what waits dispatches that batch now, not when the oldest item's
    ``max_wait_ms`` is up (an AdaptiveTuner lowers it so)."""
    clock = _WatchClock()
    b = batchkit.DynamicBatcher(echo_batch, max_batch_size=8, max_wait_ms=60_000, clock=clock)
    clock.batcher = b
    waiting = [b.submit(i) for i in range(4)]
    # The dispatcher has read the clock (and planned to sleep until the oldest item's wait is
    # up; arrivals that fill no batch do not wake it); setting the limit waits for it to sleep.
    clock.wait_for(lambda depths: len(depths) > 0)
    b.max_batch_size = 4
    assert [f.result(timeout=WAIT) for f in waiting] == [0, 1, 2, 3]
    assert b.statistics().flush_reasons == {"size": 1}
    b.close(timeout=WAIT)
    asyncio.run(_async_lowered_limit())


async def _async_lowered_limit() -> None:
    b = batchkit.AsyncBatcher(echo_batch, max_batch_size=8, max_wait_ms=60_000)
    waiting = [asyncio.create_task(b.submit(i)) for i in range(4)]
    for _ in range(3):  # loop turns: the four are admitted and the batcher has set its timer
        await asyncio.sleep(0)
    assert b.queue_depth() == 4
    await asyncio.to_thread(b.set_batch_limit, 4)  # from another thread, as AdaptiveTuner does
    assert await asyncio.wait_for(asyncio.gather(*waiting), WAIT) == [0, 1, 2, 3]
    assert b.statistics().flush_reasons == {"size": 1}
    await b.aclose(timeout=WAIT)


def test_size_fn_and_group_by_run_once_per_submit_while_it_waits_for_room() -> None:
    """api.md: ``size_fn`` runs at ``submit``: once, also for a caller that waits for room in
    a full ``"block"`` queue (a tokenizer is not rerun at every retry)."""
    calls: list[int] = []
    started, gate = threading.Event(), threading.Event()
    writer_sized = threading.Event()

    def fn(xs: list[int]) -> list[int]:
        if 1 in xs:
            started.set()
            gate.wait(WAIT)
        return xs

    def size_fn(x: int) -> int:
        calls.append(x)
        if x == 3:
            writer_sized.set()
        return 1

    def group(x: int) -> int:
        calls.append(-x)
        return 0

    b = batchkit.DynamicBatcher(
        fn, max_batch_size=1, max_wait_ms=0, max_queue=1, on_full="block", size_fn=size_fn, group_by=group
    )
    first = b.submit(1)
    assert started.wait(WAIT)
    queued = b.submit(2)  # fills the queue
    results: list[int] = []
    writer = threading.Thread(target=lambda: results.append(b(3, timeout=WAIT)))
    writer.start()
    assert writer_sized.wait(WAIT)
    gate.set()  # 1 finishes, 2 runs, the writer's 3 gets the freed slot
    writer.join(WAIT)
    assert (first.result(timeout=WAIT), queued.result(timeout=WAIT), results) == (1, 2, [3])
    b.close(timeout=WAIT)
    assert (calls.count(3), calls.count(-3)) == (1, 1)

    calls.clear()
    asyncio.run(_async_size_fn_once(size_fn, group, calls))


async def _async_size_fn_once(size_fn: Callable[[int], int], group: Callable[[int], int], calls: list[int]) -> None:
    started, gate = asyncio.Event(), asyncio.Event()

    async def fn(xs: list[int]) -> list[int]:
        if 1 in xs:
            started.set()
            await gate.wait()
        return xs

    b = batchkit.AsyncBatcher(
        fn, max_batch_size=1, max_wait_ms=0, max_queue=1, on_full="block", size_fn=size_fn, group_by=group
    )
    first = asyncio.create_task(b.submit(1))
    await asyncio.wait_for(started.wait(), WAIT)
    queued = asyncio.create_task(b.submit(2))
    await asyncio.sleep(0)  # one loop turn: it fills the queue
    writer = asyncio.create_task(b.submit(3))
    await asyncio.sleep(0)  # one loop turn: it waits for room
    assert calls.count(3) == 1
    gate.set()
    assert list(await asyncio.wait_for(asyncio.gather(first, queued, writer), WAIT)) == [1, 2, 3]
    await b.aclose(timeout=WAIT)
    assert (calls.count(3), calls.count(-3)) == (1, 1)


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

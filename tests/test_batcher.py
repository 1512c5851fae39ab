"""DynamicBatcher: flush triggers, sealing, per-item outcomes, faults, cancellation and closing."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest

from batchkit import (
    AsyncBatcher,
    BatcherClosed,
    BatchSizeMismatch,
    BatchTimeout,
    DeadlineExceeded,
    DynamicBatcher,
    QueueFull,
)
from batchkit.testing import MockClock

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


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (lambda xs: xs[:-1], "returned 2 results for a batch of 3"),
        (lambda xs: 42, "not a sequence"),
        (lambda xs: "abc", "not a sequence"),
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
        while not b._dispatcher_idle:  # let it go to sleep first: this test is about waking it
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
    assert b._dispatcher is not None
    assert not b._dispatcher.is_alive()
    assert not any(w.is_alive() for w in b._workers)
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
    """Stands in for ``batchkit.batcher._monotonic``: real seconds that move only when told."""

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
    import batchkit.batcher

    clock = _FakeMonotonic()
    monkeypatch.setattr(batchkit.batcher, "_monotonic", clock)
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
    import batchkit.batcher

    clock = _FakeMonotonic()
    monkeypatch.setattr(batchkit.batcher, "_monotonic", clock)
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

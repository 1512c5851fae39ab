"""statistics() fields as docs/api.md defines them."""

from __future__ import annotations

import asyncio
import threading

import pytest

import batchkit
from batchkit._queue_core import QueueCore
from batchkit.continuous import Request, SamplingParams, Scheduler
from batchkit.integrations.ray import QUEUE_DEPTH_METRIC, RUNNING_BATCHES_METRIC, autoscaling_stats
from batchkit.kv import PagedKVAllocator
from batchkit.testing import MockClock, echo_batch

WAIT = 10.0


def test_in_flight_counts_items_of_running_batches() -> None:
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


def test_asyncbatcher_in_flight_counts_items_too() -> None:
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


def test_counters_of_each_outcome() -> None:
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


# ----------------------------------------------------------------------------- whole-run latencies

LONG_RUN = 12_000  # past the 10,000 samples the recent window keeps


def _long_run_statistics() -> batchkit.BatcherStatistics:
    """A batcher's statistics after it answered LONG_RUN callers (in batches of 1,000)."""
    b = batchkit.DynamicBatcher(echo_batch, max_batch_size=1000, max_wait_ms=1e6, max_queue=LONG_RUN)
    futs = [b.submit(i) for i in range(LONG_RUN)]
    b.flush()
    assert [f.result(WAIT) for f in futs] == list(range(LONG_RUN))
    b.close()
    return b.statistics()


def test_batcher_latencies_cover_every_answered_caller() -> None:
    """After more answers than the recent window holds, ``latency`` and ``queue_wait`` still count
    every caller (whole-run), so a p99 read after a long run is the run's, not its tail's."""
    s = _long_run_statistics()
    assert s.succeeded == LONG_RUN
    assert s.latency is not None
    assert s.queue_wait is not None
    assert s.batch_time is not None
    assert (s.latency.count, s.queue_wait.count, s.batch_time.count) == (LONG_RUN, LONG_RUN, s.batches)


def test_queue_wait_covers_every_served_entry() -> None:
    """``QueueStatistics.wait`` counts every entry served, also past the recent window, and its
    percentiles are those of the whole run: the early, long waits are not forgotten."""
    core: QueueCore[int] = QueueCore(LONG_RUN)
    for i in range(LONG_RUN):
        core.insert(i, 0, None, None, 1, now=0.0)
    core.take(LONG_RUN // 2, now=10.0)  # the first half waited 10 s, the second half no time
    core.take(LONG_RUN, now=0.0)
    s = core.statistics()
    assert (s.served, s.wait.count) == (LONG_RUN, LONG_RUN)
    assert s.wait.max_ms == 10_000.0
    assert s.wait.mean_ms == pytest.approx(5_000.0)
    assert s.wait.p90_ms == pytest.approx(10_000.0, rel=0.01)


def test_scheduler_latencies_cover_every_request() -> None:
    """``ttft``, ``tpot`` and ``queue_wait`` of ``SchedulerStatistics`` count every request of a
    run longer than the recent window."""
    sched = Scheduler(PagedKVAllocator(num_blocks=1024, block_size=4), max_num_seqs=512)
    for i in range(LONG_RUN):
        sched.add(Request(i, [1], SamplingParams(max_new_tokens=2)))
    while sched.has_work():
        step = sched.schedule()
        sched.update(step, [0] * sum(step.samples))
    s = sched.statistics()
    assert s.finished == LONG_RUN
    assert (s.ttft.count, s.tpot.count, s.queue_wait.count) == (LONG_RUN, LONG_RUN, LONG_RUN)


def test_batcher_recent_views_are_the_last_ten_thousand_samples() -> None:
    """``latency_recent``, ``queue_wait_recent`` and ``batch_time_recent`` of ``BatcherStatistics``
    are the named recent view: the last 10,000 samples, beside the whole-run fields."""
    s = _long_run_statistics()
    assert s.latency_recent is not None
    assert s.queue_wait_recent is not None
    assert s.batch_time_recent is not None
    recent = (s.latency_recent.count, s.queue_wait_recent.count, s.batch_time_recent.count)
    assert recent == (10_000, 10_000, s.batches)
    assert s.latency_recent.histogram is None


def test_queue_wait_recent_is_the_last_ten_thousand_served() -> None:
    """``QueueStatistics.wait_recent`` is the named recent view: the last 10,000 entries served,
    with exact percentiles, so a run's early long waits have left it."""
    core: QueueCore[int] = QueueCore(LONG_RUN)
    for i in range(LONG_RUN):
        core.insert(i, 0, None, None, 1, now=0.0)
    core.take(2_000, now=10.0)  # served first, waited 10 s: outside the last 10,000
    core.take(LONG_RUN, now=0.0)
    s = core.statistics()
    assert (s.wait_recent.count, s.wait_recent.max_ms, s.wait.max_ms) == (10_000, 0.0, 10_000.0)


def test_scheduler_and_loop_name_their_recent_views() -> None:
    """``SchedulerStatistics`` has ``ttft_recent``, ``tpot_recent`` and ``queue_wait_recent`` (the
    last 10,000 samples), ``LoopStatistics`` has ``step_time_recent``; both views agree on a short
    run."""
    torch = pytest.importorskip("torch")
    kv = batchkit.PagedKVCache(1, 16, 4, 1, 2, dtype=torch.float32)
    loop = batchkit.ContinuousDecodeLoop(lambda batch, kv: torch.zeros(len(batch.sample_indices), 8), kv)
    try:
        assert loop.submit([1, 2], max_new_tokens=3).result(timeout=WAIT) == [0, 0, 0]
    finally:
        loop.close()
    s = loop.statistics()
    sched = s.scheduler
    assert (sched.ttft_recent.count, sched.tpot_recent.count, sched.queue_wait_recent.count) == (1, 2, 1)
    assert (sched.ttft.count, sched.tpot.count, sched.queue_wait.count) == (1, 2, 1)
    assert s.step_time_recent.count == s.step_time.count == s.steps
    assert s.step_time_recent.max_ms == s.step_time.max_ms


def test_whole_run_latencies_of_several_batchers_merge_into_one() -> None:
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

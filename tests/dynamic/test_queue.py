"""BoundedQueue: capacity policies, priorities, aging, deadlines, cancellation, thread and task safety."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import anyio
import pytest

import batchkit
from _support import Gate
from batchkit import BoundedQueue, DeadlineExceeded, DynamicBatcher, QueueEmpty, QueueEntry, QueueFull
from batchkit.dynamic._queue_core import QueueCore
from batchkit.testing import MockClock

WAIT = 10.0  # seconds: the bound on every wait on a batcher in this file; nothing should come near it


def drain(q: BoundedQueue[str]) -> list[str]:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except QueueEmpty:
            return out


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"maxsize": 0}, "maxsize must be an int >= 1"),
        ({"maxsize": 2, "on_full": "explode"}, "on_full must be one of"),
        ({"maxsize": 2, "aging_s": 0}, "aging_s must be > 0"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(kwargs: dict[str, Any], message: str) -> None:
    """Constructor arguments are validated with a message naming the argument."""
    with pytest.raises(ValueError, match=message):
        BoundedQueue(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"clock": 1}, "clock must have a now"), ({"on_drop": 5}, "on_drop must be called as")],
)
def test_a_clock_or_on_drop_of_the_wrong_kind_is_refused_at_construction(kwargs: dict[str, Any], message: str) -> None:
    """Refused where it is written: not at the first put (an AttributeError) or at every drop
    (a logged TypeError)."""
    with pytest.raises(TypeError, match=message):
        BoundedQueue(3, **kwargs)


def test_a_negative_cost_or_an_unhashable_key_is_refused_at_put() -> None:
    """What a batcher's size_fn and group_by may not return, a put may not pass either."""
    q: BoundedQueue[int] = BoundedQueue(4)
    with pytest.raises(ValueError, match="cost must be a number >= 0"):
        q.put_nowait(1, cost=-1)
    with pytest.raises(ValueError, match="cost must be a number >= 0"):
        q.put_nowait(1, cost=float("nan"))
    with pytest.raises(TypeError, match="key must be hashable"):
        q.put_nowait(1, key=["a"])  # type: ignore[arg-type]
    assert len(q) == 0
    q.put_nowait(1, cost=0, key=("a", 1))
    assert len(q) == 1


@pytest.mark.parametrize("on_full", ["reject", "block", "drop_oldest"])
def test_a_timeout_that_is_not_a_wait_is_refused_at_put_whatever_the_policy(on_full: Any) -> None:
    q: BoundedQueue[int] = BoundedQueue(4, on_full=on_full)
    for bad in (float("nan"), -1, "1", True):
        with pytest.raises(ValueError, match="timeout must be >= 0"):
            q.put(1, timeout=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="timeout must be >= 0"):
            anyio.run(lambda: q.aput(1, timeout=bad))  # type: ignore[arg-type]  # noqa: B023
    assert len(q) == 0
    q.put(1, timeout=0)
    q.put(2, timeout=float("inf"))
    assert len(q) == 2


def test_fifo_within_a_priority_and_lower_priority_value_first() -> None:
    """Lower priority values are served first; equal priorities in arrival order."""
    q: BoundedQueue[str] = BoundedQueue(10)
    q.put_nowait("a", priority=1)
    q.put_nowait("b", priority=0)
    q.put_nowait("c", priority=1)
    q.put_nowait("d", priority=-1)
    q.put_nowait("e", priority=0)
    assert drain(q) == ["d", "b", "e", "a", "c"]


def test_reject_raises_queue_full_and_counts_it() -> None:
    """on_full='reject' refuses the newcomer at once."""
    q: BoundedQueue[int] = BoundedQueue(2)
    q.put_nowait(1)
    q.put_nowait(2)
    with pytest.raises(QueueFull, match="queue is full"):
        q.put_nowait(3)
    s = q.statistics()
    assert (s.depth, s.rejections, s.arrivals) == (2, 1, 2)


def test_drop_oldest_evicts_the_oldest_and_tells_its_owner() -> None:
    """on_full='drop_oldest' makes room by evicting the oldest item; on_drop reports QueueFull."""
    dropped = []
    q: BoundedQueue[str] = BoundedQueue(2, "drop_oldest", on_drop=lambda e, exc: dropped.append((e.item, type(exc))))
    q.put_nowait("a")
    q.put_nowait("b", priority=-5)
    q.put_nowait("c")
    assert dropped == [("a", QueueFull)]
    assert drain(q) == ["b", "c"]
    assert q.statistics().drops == 1


def test_shed_lowest_priority_evicts_least_important_or_rejects_newcomer() -> None:
    """shed_lowest_priority evicts the newest item of the worst priority if the newcomer is better."""
    dropped: list[str] = []
    q: BoundedQueue[str] = BoundedQueue(3, "shed_lowest_priority", on_drop=lambda e, exc: dropped.append(e.item))
    q.put_nowait("low1", priority=5)
    q.put_nowait("low2", priority=5)
    q.put_nowait("mid", priority=1)
    q.put_nowait("high", priority=0)
    assert dropped == ["low2"]
    with pytest.raises(QueueFull):
        q.put_nowait("lower", priority=9)
    assert drain(q) == ["high", "mid", "low1"]


def test_aging_lets_low_priority_overtake_after_waiting() -> None:
    """With aging, an old low-priority item eventually beats a fresh high-priority one."""
    clock = MockClock()
    q: BoundedQueue[str] = BoundedQueue(10, aging_s=1.0, clock=clock)
    q.put_nowait("old-low", priority=3)
    clock.advance(2.0)
    q.put_nowait("new-high", priority=0)
    assert q.get_nowait() == "new-high"  # 3 - 2 = 1 > 0
    q.put_nowait("new-high2", priority=0)
    clock.advance(2.0)  # old-low is now 3 - 4 = -1, new-high2 is 0 - 2 = -2
    assert q.get_nowait() == "new-high2"
    q.put_nowait("fresh", priority=0)
    assert q.get_nowait() == "old-low"  # -1 beats 0


def test_deadline_expiry_removes_item_and_reports_deadline_exceeded() -> None:
    """Items whose deadline passes leave with DeadlineExceeded and are never handed out."""
    clock = MockClock()
    dropped = []
    q: BoundedQueue[str] = BoundedQueue(5, clock=clock, on_drop=lambda e, exc: dropped.append((e.item, exc)))
    q.put_nowait("short", deadline_ms=10)
    q.put_nowait("long", deadline_ms=1000)
    q.put_nowait("none")
    assert q.next_deadline() == pytest.approx(0.010)
    clock.advance(0.011)
    assert q.expire() == 1
    assert dropped[0][0] == "short"
    assert isinstance(dropped[0][1], DeadlineExceeded)
    assert drain(q) == ["long", "none"]
    assert q.statistics().expiries == 1


def test_cancel_frees_the_slot_and_is_idempotent() -> None:
    """A cancelled entry frees its slot at once; cancelling twice is harmless."""
    q: BoundedQueue[str] = BoundedQueue(1)
    e = q.put_nowait("x")
    assert q.cancel(e) is True
    assert q.cancel(e) is False
    q.put_nowait("y")
    assert drain(q) == ["y"]
    assert q.statistics().cancellations == 1


def test_many_cancellations_keep_memory_bounded() -> None:
    """Lazily deleted entries are compacted: internal storage stays near capacity."""
    q: BoundedQueue[int] = BoundedQueue(4)
    keep = q.put_nowait(-1)
    for i in range(1000):
        q.cancel(q.put_nowait(i))
    assert sum(len(d) for d in q.core._levels.values()) <= 2 * q.maxsize + 1
    assert keep.waiting
    assert len(q) == 1


def test_block_policy_put_waits_for_room_then_times_out() -> None:
    """on_full='block': put waits for a get to free room, and raises QueueFull on timeout."""
    q: BoundedQueue[int] = BoundedQueue(1, "block")
    q.put_nowait(1)
    with pytest.raises(QueueFull, match="within timeout"):
        q.put(2, timeout=0.01)
    with pytest.raises(QueueFull, match=r"does not wait: use put\(\) or aput\(\)"):
        q.put_nowait(2)  # the advice fits the policy: this queue already blocks, put_nowait does not
    done = threading.Event()

    def producer() -> None:
        q.put(3, timeout=10)
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    assert q.get(timeout=10) == 1
    assert done.wait(10)
    t.join(10)
    assert q.get_nowait() == 3


def test_get_waits_for_an_item_and_times_out() -> None:
    """get blocks until an item arrives, or raises QueueEmpty after its timeout."""
    q: BoundedQueue[int] = BoundedQueue(2)
    with pytest.raises(QueueEmpty):
        q.get(timeout=0.01)
    t = threading.Timer(0.01, lambda: q.put_nowait(7))
    t.start()
    assert q.get(timeout=10) == 7
    t.join()


@pytest.mark.anyio
async def test_async_get_and_blocking_put_from_tasks() -> None:
    """aget awaits items and aput awaits room, from tasks on either backend."""
    q: BoundedQueue[int] = BoundedQueue(2, "block")
    got: list[int] = []

    async def consumer() -> None:
        for _ in range(10):
            got.append(await q.aget())

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(consumer)
            for i in range(10):
                await q.aput(i)
    assert got == list(range(10))
    assert q.statistics().peak_depth <= 2


@pytest.mark.anyio
async def test_cancelled_async_waiter_leaves_no_trace() -> None:
    """A task cancelled while waiting in aget is forgotten by the queue."""
    q: BoundedQueue[int] = BoundedQueue(2)
    with anyio.move_on_after(0.01):
        await q.aget()
    assert len(q._item_waiters) == 0
    q.put_nowait(1)
    assert await q.aget() == 1


def test_threads_put_and_get_concurrently_without_loss() -> None:
    """Many producer and consumer threads: every item is received exactly once."""
    q: BoundedQueue[int] = BoundedQueue(8, "block")
    n_producers, per = 4, 500
    received: list[int] = []
    lock = threading.Lock()

    def producer(base: int) -> None:
        for i in range(per):
            q.put(base + i, timeout=10)

    def consumer() -> None:
        while True:
            try:
                x = q.get(timeout=0.5)
            except QueueEmpty:
                return
            with lock:
                received.append(x)

    threads = [threading.Thread(target=producer, args=(k * per,)) for k in range(n_producers)]
    threads += [threading.Thread(target=consumer) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(received) == list(range(n_producers * per))
    s = q.statistics()
    assert s.depth == 0
    assert s.served == n_producers * per


# ---------------------------------------------------------------------- the core, without a lock


def test_core_take_by_group_leaves_other_groups_in_place_and_loads_exact() -> None:
    """QueueCore.take(key=...) takes only that group, in order; the per-group loads (count, cost)
    follow every take, cancel and expiry exactly."""
    core: QueueCore[str] = QueueCore(10)
    a1, _ = core.insert("a1", 0, None, "a", 2, now=0.0)
    core.insert("b1", 0, 5.0, "b", 3, now=0.0)
    core.insert("a2", 0, None, "a", 4, now=0.001)
    assert core.loads() == {"a": [2, 6], "b": [1, 3]}
    assert [e.item for e in core.take(8, 0.002, key="a")] == ["a1", "a2"]
    assert core.loads() == {"b": [1, 3]}
    assert not core.cancel(a1)  # already taken
    drops = core.expire(0.005)
    assert [(e.item, type(exc)) for e, exc in drops] == [("b1", DeadlineExceeded)]
    assert core.loads() == {}
    assert (core.depth, core.seq) == (0, 3)


def test_core_announces_freed_slots_and_never_wakes_anyone_itself() -> None:
    """QueueCore calls on_release(n) with the number of slots each removal frees, so that a shell
    can wake exactly that many writers."""
    core: QueueCore[int] = QueueCore(4)
    freed: list[int] = []
    core.on_release = freed.append
    entries = [core.insert(i, 0, None, None, 1, now=0.0)[0] for i in range(4)]
    core.cancel(entries[0])
    core.take(2, now=0.0)
    assert freed == [1, 2]
    assert core.depth == 1


def test_core_oldest_and_next_deadline_skip_entries_that_left() -> None:
    """oldest() and next_deadline() ignore cancelled entries (lazy deletion stays invisible)."""
    core: QueueCore[str] = QueueCore(4)
    first, _ = core.insert("first", 1, 1.0, None, 1, now=0.0)
    core.insert("second", 0, 3.0, None, 1, now=0.5)
    assert core.oldest() is first
    assert core.next_deadline() == pytest.approx(0.001)
    core.cancel(first)
    oldest = core.oldest()
    assert oldest is not None
    assert oldest.item == "second"
    assert core.next_deadline() == pytest.approx(0.503)


def test_wait_for_room_returns_at_once_when_there_is_room_and_false_on_timeout() -> None:
    """BoundedQueue.wait_for_room is True immediately with room, False after the timeout when
    full, and leaves no waiter behind."""
    q: BoundedQueue[int] = BoundedQueue(1, "block")
    assert q.wait_for_room(0)
    q.put_nowait(1)
    assert not q.wait_for_room(0.01)
    assert len(q._space_waiters) == 0


def _dropped_into(out: list[str]) -> Callable[[QueueEntry[str], BaseException], None]:
    def on_drop(entry: QueueEntry[str], error: BaseException) -> None:
        assert isinstance(error, batchkit.QueueFull)
        out.append(entry.item)

    return on_drop


class TestFullPolicies:
    """BoundedQueue's full policies as docs/api.md states them, with aging and priorities."""

    def test_drop_oldest_evicts_the_longest_waiting_item_whatever_its_priority(self) -> None:
        dropped: list[str] = []
        q: batchkit.BoundedQueue[str] = batchkit.BoundedQueue(2, "drop_oldest", on_drop=_dropped_into(dropped))
        q.put_nowait("urgent", priority=-1)
        q.put_nowait("low", priority=5)
        q.put_nowait("new", priority=0)
        assert dropped == ["urgent"]
        assert [q.get_nowait(), q.get_nowait()] == ["new", "low"]

    def test_shed_lowest_priority_evicts_the_newest_of_the_worst_level(self) -> None:
        dropped: list[str] = []
        q: batchkit.BoundedQueue[str] = batchkit.BoundedQueue(3, "shed_lowest_priority", on_drop=_dropped_into(dropped))
        q.put_nowait("a5", priority=5)
        q.put_nowait("b5", priority=5)
        q.put_nowait("c1", priority=1)
        q.put_nowait("n0", priority=0)
        assert dropped == ["b5"]
        with pytest.raises(batchkit.QueueFull):
            q.put_nowait("n5", priority=5)  # no better than the worst waiting item: refused
        with pytest.raises(batchkit.QueueFull):
            q.put_nowait("m5", priority=6)

    def test_shed_lowest_priority_judges_waiting_items_by_their_aged_priority(self) -> None:
        """An item that aged past the newcomer's level is not the one shed: aging protects it."""
        clock = MockClock()
        dropped: list[str] = []
        q: batchkit.BoundedQueue[str] = batchkit.BoundedQueue(
            2,
            "shed_lowest_priority",
            aging_s=1.0,
            clock=clock,
            on_drop=_dropped_into(dropped),
        )
        q.put_nowait("old3", priority=3)
        clock.advance(10.0)  # old3's effective priority is now 3 - 10 = -7
        q.put_nowait("x2", priority=2)
        q.put_nowait("new1", priority=1)
        assert dropped == ["x2"]
        assert [q.get_nowait(), q.get_nowait()] == ["old3", "new1"]

    def test_shed_in_a_batcher_with_aging_spares_the_aged_item(self) -> None:
        """The same rule through DynamicBatcher's own admission (the former)."""
        clock = MockClock()
        q: batchkit.BoundedQueue[str] = batchkit.BoundedQueue(2, "shed_lowest_priority", aging_s=1.0, clock=clock)
        b = batchkit.DynamicBatcher(lambda xs: xs, max_batch_size=8, max_wait_ms=1e6, queue=q, clock=clock)
        old = b.submit("old3", priority=3)
        clock.advance(10.0)
        mid = b.submit("x2", priority=2)
        new = b.submit("new1", priority=1)
        with pytest.raises(batchkit.QueueFull):
            mid.result(10)
        b.flush()
        assert old.result(10) == "old3"
        assert new.result(10) == "new1"
        b.close()

    def test_an_on_drop_that_raises_does_not_fail_the_put_that_evicted(self, caplog: pytest.LogCaptureFixture) -> None:
        """The put succeeded (its item is queued), so it returns; the callback's error is logged."""

        def on_drop(entry: QueueEntry[str], error: BaseException) -> None:
            raise RuntimeError("callback bug")

        q: batchkit.BoundedQueue[str] = batchkit.BoundedQueue(1, "drop_oldest", on_drop=on_drop)
        q.put_nowait("a")
        with caplog.at_level("ERROR", logger="batchkit.queue"):
            entry = q.put_nowait("b")
        assert entry.item == "b"
        assert len(q) == 1
        assert q.get_nowait() == "b"
        assert "callback bug" in caplog.text


LONG_RUN = 12_000  # past the 10,000 samples the recent window keeps


class TestStatistics:
    """statistics() fields as docs/api.md defines them: the queue wait over the whole run and its recent view."""

    def test_queue_wait_covers_every_served_entry(self) -> None:
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

    def test_queue_wait_recent_is_the_last_ten_thousand_served(self) -> None:
        """``QueueStatistics.wait_recent`` is the named recent view: the last 10,000 entries served,
        with exact percentiles, so a run's early long waits have left it."""
        core: QueueCore[int] = QueueCore(LONG_RUN)
        for i in range(LONG_RUN):
            core.insert(i, 0, None, None, 1, now=0.0)
        core.take(2_000, now=10.0)  # served first, waited 10 s: outside the last 10,000
        core.take(LONG_RUN, now=0.0)
        s = core.statistics()
        assert (s.wait_recent.count, s.wait_recent.max_ms, s.wait.max_ms) == (10_000, 0.0, 10_000.0)


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

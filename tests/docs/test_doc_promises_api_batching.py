"""docs/api.md, "Dynamic batching", "Collating", "Adaptive sizing and faults", "Time and testing"
and "Errors": the promises a user meets at the edges (bad arguments, infinite limits, cancelled
callers, the blocking call's arguments), checked through the public API."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import batchkit
from batchkit.testing import MockClock, echo_batch

WAIT_S = 10.0  # the bound of every wait below; never reached when the promise holds


# ---------------------------------------------------------------------------- bad arguments


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


def test_a_queue_that_is_not_a_bounded_queue_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"queue must be a batchkit\.BoundedQueue"):
        batchkit.DynamicBatcher(echo_batch, queue=[])  # type: ignore[arg-type]


def test_a_deadline_that_is_not_a_number_is_a_value_error_naming_it() -> None:
    """``deadline_ms`` is checked at submit (the batcher's and the queue's), with its name."""
    with batchkit.DynamicBatcher(echo_batch) as b:
        with pytest.raises(ValueError, match="deadline_ms"):
            b.submit(1, deadline_ms="100")  # type: ignore[arg-type]
        assert b.statistics().submitted == 0
        assert b.submit(2).result(timeout=WAIT_S) == 2
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
                b.submit(1, deadline_ms=0).result(timeout=WAIT_S)
        assert b.submit(2, deadline_ms=0, fallback="late").result(timeout=WAIT_S) == "late"
        assert b.submit(3).result(timeout=WAIT_S) == 3
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
        assert b.submit("good").result(timeout=WAIT_S) == "good"
    q: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(4)
    with pytest.raises(ValueError, match="cost"):
        q.put_nowait(1, cost=math.inf)


# ---------------------------------------------------------------------------- infinite limits


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
            assert self._cond.wait_for(lambda: predicate(self.depths), timeout=WAIT_S)


def test_an_infinite_max_wait_ms_leaves_batches_to_size_and_flush() -> None:
    """``max_wait_ms=math.inf`` (a number >= 0): a lone item waits for company or a flush; the
    dispatcher sleeps until told instead of dying on a wait the platform cannot time."""
    clock = _WatchClock()
    b = batchkit.DynamicBatcher(echo_batch, max_batch_size=4, max_wait_ms=math.inf, clock=clock)
    clock.batcher = b
    fut = b.submit(1)
    clock.wait_for(lambda depths: 1 in depths)  # the dispatcher has seen the item and sleeps
    b.flush()
    assert fut.result(timeout=WAIT_S) == 1
    b.close(timeout=WAIT_S)
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
            gate.wait(WAIT_S)
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
        assert started.wait(WAIT_S)
        if infinite == "deadline_ms":
            clock.depths.clear()
            patient = b.submit("patient", deadline_ms=math.inf)
            clock.wait_for(lambda depths: 1 in depths)  # the dispatcher has seen it and sleeps
        else:
            clock.wait_for(lambda depths: 0 in depths[depths.index(1) :] if 1 in depths else False)
        hurried = b.submit("hurried", deadline_ms=1, fallback="too late")
        assert hurried.result(timeout=WAIT_S) == "too late"  # expired while "slow" still runs
        assert not slow.done()
    finally:
        gate.set()
    assert slow.result(timeout=WAIT_S) == "slow"
    if infinite == "deadline_ms":
        assert patient.result(timeout=WAIT_S) == "patient"
    b.close(timeout=WAIT_S)
    assert b.statistics().expired == 1


def test_an_infinite_timeout_means_no_limit() -> None:
    """``timeout=math.inf`` waits without a limit (``close``, the queue's ``get``, ``put`` and
    ``wait_for_room``) instead of raising OverflowError."""
    b = batchkit.DynamicBatcher(echo_batch)
    assert b.submit(1).result(timeout=WAIT_S) == 1
    b.close(timeout=math.inf)
    assert b.closed
    with pytest.raises(batchkit.BatcherClosed):
        b.submit(2)

    q: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(1, "block")
    writer = threading.Thread(target=lambda: q.put(7, timeout=math.inf))
    writer.start()
    assert q.get(timeout=math.inf) == 7  # waits for the writer (or finds its item)
    writer.join(WAIT_S)
    assert q.wait_for_room(math.inf)
    q.put_nowait(8)
    filler = threading.Thread(target=lambda: q.put(9, timeout=math.inf))  # waits for room
    filler.start()
    assert q.get(timeout=WAIT_S) == 8
    filler.join(WAIT_S)
    assert not filler.is_alive()
    assert q.get_nowait() == 9


# ---------------------------------------------------------------------------- cancellation


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
    await asyncio.wait_for(started.wait(), WAIT_S)
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
    assert await asyncio.wait_for(patient, WAIT_S) == 4
    assert await asyncio.wait_for(first, WAIT_S) == 1
    assert wakeful.cancelled()
    assert queued.cancelled()
    await b.aclose(timeout=WAIT_S)
    stats = b.statistics()
    assert (stats.submitted, stats.succeeded, stats.cancelled) == (3, 2, 1)


# ---------------------------------------------------------------------------- the blocking call


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
        gate.wait(WAIT_S)
        return xs

    b2 = batchkit.DynamicBatcher(slow, max_batch_size=1, max_wait_ms=0, max_queue=1, on_full="block")
    try:
        running = b2.submit(1)
        assert started.wait(WAIT_S)
        waiting = b2.submit(2)  # fills the queue
        with pytest.raises(batchkit.QueueFull, match="timeout"):
            b2(3, timeout=0.01)
        assert b2.statistics().rejected == 1
    finally:
        gate.set()
    assert (running.result(timeout=WAIT_S), waiting.result(timeout=WAIT_S)) == (1, 2)
    b2.close(timeout=WAIT_S)


# ---------------------------------------------------------------------------- map


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
    picky.close(timeout=WAIT_S)
    assert seen == [0, 1]


# ---------------------------------------------------------------------------- circuit breaker


def test_a_circuit_breaker_reads_half_open_once_its_cool_down_has_passed() -> None:
    """api.md: after ``reset_timeout_s`` one probe batch runs; ``state`` says so when read,
    without a ``check()`` or ``allow_dispatch()`` first."""
    clock = MockClock()
    breaker = batchkit.CircuitBreaker(failure_threshold=2, reset_timeout_s=5.0, clock=clock)
    breaker.record(False)
    assert breaker.state == "closed"
    breaker.record(False)
    assert breaker.state == "open"
    assert breaker.half_open_at == 5.0
    with pytest.raises(batchkit.CircuitOpen):
        breaker.check()
    clock.advance(5.0)
    assert breaker.state == "half_open"
    breaker.check()  # new work is admitted again, to make the probe
    assert breaker.allow_dispatch()
    assert not breaker.allow_dispatch()  # one probe only
    breaker.release_probe()  # it did not run: the next batch probes
    assert breaker.allow_dispatch()
    breaker.record(True)
    assert breaker.state == "closed"


# ---------------------------------------------------------------------------- collating


@pytest.mark.parametrize("pad_value", [None, "0"])
def test_pad_refuses_a_pad_value_that_is_not_a_number(pad_value: Any) -> None:
    """A ``pad_value`` that is not a number is a ValueError naming it, for float items too
    (None would otherwise fill their padding with NaN, silently)."""
    np = pytest.importorskip("numpy")
    for items in ([np.arange(3), np.arange(5)], [np.ones(2), np.ones(3)]):
        with pytest.raises(ValueError, match="pad_value"):
            batchkit.collate.pad(items, pad_value=pad_value)
    padded = batchkit.collate.pad([np.ones(2), np.ones(3)], pad_value=np.float32(-1))
    assert padded.batch.tolist() == [[1.0, 1.0, -1.0], [1.0, 1.0, 1.0]]
    assert batchkit.collate.pad([np.array([True]), np.array([False, True])], pad_value=False).batch.dtype == bool


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


# ---------------------------------------------------------------------------- adaptive controller


@pytest.mark.parametrize(
    ("options", "name", "error"),
    [
        ({"target_queue": -1}, "target_queue", ValueError),
        ({"deadband": -0.5}, "deadband", ValueError),
        ({"cooldown_s": -1}, "cooldown_s", ValueError),
        ({"window_s": 0}, "window_s", ValueError),
        ({"slo_margin": "0.8"}, "slo_margin", ValueError),
        ({"slo_quantile": "99"}, "slo_quantile", ValueError),
        ({"memory_headroom": 0.5}, "memory_headroom", TypeError),
    ],
)
def test_the_controller_names_the_argument_it_refuses(
    options: dict[str, Any], name: str, error: type[Exception]
) -> None:
    """Each refused setting is named in the error (not a shared sentence about four of them, nor
    a TypeError from a comparison, nor a memory_headroom that only fails while serving)."""
    settings: dict[str, Any] = {"target_queue": 1, **options}
    with pytest.raises(error, match=name) as refused:
        batchkit.AdaptiveBatchController(**settings)
    others = {"target_queue", "deadband", "cooldown_s", "window_s"} - {name}
    assert not any(other in str(refused.value) for other in others)


# ---------------------------------------------------------------------------- fallback and close


def test_close_without_drain_fails_an_item_with_a_fallback_with_batcher_closed() -> None:
    """``fallback`` answers a deadline that passed; ``close(drain=False)`` fails what waits with
    BatcherClosed, fallback or not (and counts it as cancelled)."""
    b = batchkit.DynamicBatcher(echo_batch, max_batch_size=4, max_wait_ms=1000, clock=MockClock())
    waiting = b.submit(1, deadline_ms=5000, fallback="fallback")
    b.close(drain=False)
    with pytest.raises(batchkit.BatcherClosed):
        waiting.result(timeout=WAIT_S)
    assert (b.statistics().cancelled, b.statistics().expired) == (1, 0)
    asyncio.run(_async_close_without_drain_with_a_fallback())


async def _async_close_without_drain_with_a_fallback() -> None:
    b = batchkit.AsyncBatcher(echo_batch, max_batch_size=4, max_wait_ms=1000, clock=MockClock())
    waiting = asyncio.create_task(b.submit(1, deadline_ms=5000, fallback="fallback"))
    await asyncio.sleep(0)  # one loop turn: it is admitted
    assert b.queue_depth() == 1
    await b.aclose(drain=False)
    with pytest.raises(batchkit.BatcherClosed):
        await asyncio.wait_for(waiting, WAIT_S)
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
    assert waiting.result(timeout=WAIT_S) == 1
    b.close(timeout=WAIT_S)


# ---------------------------------------------------------------------------- time and testing


def test_mock_clock_notifies_its_listeners_when_it_advances_and_stops_after_removal() -> None:
    """api.md: ``add_listener(cond)`` has ``notify_all()`` called on the condition whenever time
    advances; ``remove_listener(cond)`` stops it (and removing twice is harmless)."""
    clock = MockClock(start=5.0)
    cond = threading.Condition()
    clock.add_listener(cond)
    outcomes: list[tuple[bool, float]] = []
    ready = threading.Event()

    def wait_once(limit: float) -> None:
        with cond:
            ready.set()
            outcomes.append((cond.wait(limit), clock.now()))

    waiter = threading.Thread(target=wait_once, args=(WAIT_S,))
    waiter.start()
    assert ready.wait(WAIT_S)
    with cond:  # taken only once the waiter waits (wait releases it)
        pass
    clock.advance(0.5)
    waiter.join(WAIT_S)
    assert outcomes == [(True, 5.5)]

    clock.remove_listener(cond)
    clock.remove_listener(cond)
    ready.clear()
    waiter = threading.Thread(target=wait_once, args=(0.05,))
    waiter.start()
    assert ready.wait(WAIT_S)
    with cond:
        pass
    clock.advance(1.0)  # nobody is told: the waiter's own limit ends its wait
    waiter.join(WAIT_S)
    assert outcomes[1] == (False, 6.5)
    assert batchkit.testing.echo_batch([1, "a"]) == [1, "a"]


# ---------------------------------------------------------------------------- priorities and groups


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
    assert (late.result(timeout=WAIT_S), urgent.result(timeout=WAIT_S)) == (("low", 1), ("high", 1))
    b.close(timeout=WAIT_S)
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
    assert list(await asyncio.wait_for(asyncio.gather(late, urgent), WAIT_S)) == [("low", 1), ("high", 1)]
    await b.aclose(timeout=WAIT_S)


def test_of_two_full_groups_the_one_with_the_better_priority_goes_first() -> None:
    """Two groups fill up while the only batch slot is busy: when it frees, the group whose best
    item has the lower priority goes first, whichever filled first."""
    started, release = threading.Event(), threading.Event()
    calls: list[list[tuple[str, int]]] = []

    def fn(xs: list[tuple[str, int]]) -> list[tuple[str, int]]:
        calls.append(list(xs))
        if xs[0][0] == "busy":
            started.set()
            assert release.wait(WAIT_S)
        return xs

    b = batchkit.DynamicBatcher(fn, max_batch_size=2, max_wait_ms=60_000, group_by=lambda x: x[0])
    try:
        busy = [b.submit(("busy", i)) for i in range(2)]
        assert started.wait(WAIT_S)
        low = [b.submit(("low", i), priority=5) for i in range(2)]  # full first
        high = [b.submit(("high", i), priority=-1) for i in range(2)]
        release.set()
        for f in busy + low + high:
            f.result(timeout=WAIT_S)
    finally:
        release.set()
        b.close(timeout=WAIT_S)
    assert [c[0][0] for c in calls] == ["busy", "high", "low"]


def test_items_a_close_without_drain_ends_are_cancellations_of_the_queue_not_served() -> None:
    """QueueStatistics: ``served`` and ``wait`` are the entries taken out to run; those that
    ``close(drain=False)`` ends never ran, and count as ``cancellations``."""
    started, release = threading.Event(), threading.Event()

    def fn(xs: list[int]) -> list[int]:
        started.set()
        assert release.wait(WAIT_S)
        return xs

    b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0)
    try:
        running = b.submit(0)
        assert started.wait(WAIT_S)
        waiting = [b.submit(i) for i in (1, 2, 3)]
        b.close(drain=False, timeout=0)
    finally:
        release.set()
    b.close(timeout=WAIT_S)
    assert running.result(timeout=WAIT_S) == 0
    for f in waiting:
        with pytest.raises(batchkit.BatcherClosed):
            f.result(timeout=WAIT_S)
    q = b.queue.statistics()
    assert (q.served, q.wait.count, q.cancellations, q.depth) == (1, 1, 3, 0)


def test_close_without_drain_during_a_draining_close_fails_what_waits_at_once() -> None:
    """A ``close()`` that drains waits for every item; a ``close(drain=False)`` called meanwhile
    (say, a second Ctrl-C) fails the items still waiting with BatcherClosed at once, while the
    running batch finishes."""
    started, release = threading.Event(), threading.Event()

    def fn(xs: list[int]) -> list[int]:
        started.set()
        assert release.wait(WAIT_S)
        return xs

    b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0)
    draining = threading.Thread(target=b.close, kwargs={"timeout": WAIT_S})
    try:
        running = b.submit(0)
        assert started.wait(WAIT_S)
        waiting = [b.submit(i) for i in (1, 2)]
        draining.start()
        deadline = time.monotonic() + WAIT_S
        while not b.closed:  # the draining close() has begun
            assert time.monotonic() < deadline
            time.sleep(0.001)
        b.close(drain=False, timeout=0)
        for f in waiting:  # failed while the running batch still holds its slot
            with pytest.raises(batchkit.BatcherClosed):
                f.result(timeout=WAIT_S)
    finally:
        release.set()
        draining.join(WAIT_S)
    assert running.result(timeout=WAIT_S) == 0
    assert not draining.is_alive()


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
        await asyncio.wait_for(started.wait(), WAIT_S)
        waiting = [asyncio.create_task(b.submit(i)) for i in (1, 2)]
        await asyncio.sleep(0)  # both are queued
        draining = asyncio.create_task(b.aclose(timeout=WAIT_S))
        await asyncio.sleep(0)  # the draining aclose() has begun
        hurry = asyncio.create_task(b.aclose(drain=False))  # waits for the running batch too
        for t in waiting:
            with pytest.raises(batchkit.BatcherClosed):
                await asyncio.wait_for(t, WAIT_S)
        assert not running.done()
        release.set()
        assert await asyncio.wait_for(running, WAIT_S) == 0
        await asyncio.wait_for(asyncio.gather(draining, hurry), WAIT_S)

    asyncio.run(main())


# ---------------------------------------------------------------------------- a settable limit


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
    assert [f.result(timeout=WAIT_S) for f in waiting] == [0, 1, 2, 3]
    assert b.statistics().flush_reasons == {"size": 1}
    b.close(timeout=WAIT_S)
    asyncio.run(_async_lowered_limit())


async def _async_lowered_limit() -> None:
    b = batchkit.AsyncBatcher(echo_batch, max_batch_size=8, max_wait_ms=60_000)
    waiting = [asyncio.create_task(b.submit(i)) for i in range(4)]
    for _ in range(3):  # loop turns: the four are admitted and the batcher has set its timer
        await asyncio.sleep(0)
    assert b.queue_depth() == 4
    await asyncio.to_thread(b.set_batch_limit, 4)  # from another thread, as AdaptiveTuner does
    assert await asyncio.wait_for(asyncio.gather(*waiting), WAIT_S) == [0, 1, 2, 3]
    assert b.statistics().flush_reasons == {"size": 1}
    await b.aclose(timeout=WAIT_S)


# ---------------------------------------------------------------------------- size_fn runs once


def test_size_fn_and_group_by_run_once_per_submit_while_it_waits_for_room() -> None:
    """api.md: ``size_fn`` runs at ``submit``: once, also for a caller that waits for room in
    a full ``"block"`` queue (a tokenizer is not rerun at every retry)."""
    calls: list[int] = []
    started, gate = threading.Event(), threading.Event()
    writer_sized = threading.Event()

    def fn(xs: list[int]) -> list[int]:
        if 1 in xs:
            started.set()
            gate.wait(WAIT_S)
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
    assert started.wait(WAIT_S)
    queued = b.submit(2)  # fills the queue
    results: list[int] = []
    writer = threading.Thread(target=lambda: results.append(b(3, timeout=WAIT_S)))
    writer.start()
    assert writer_sized.wait(WAIT_S)
    gate.set()  # 1 finishes, 2 runs, the writer's 3 gets the freed slot
    writer.join(WAIT_S)
    assert (first.result(timeout=WAIT_S), queued.result(timeout=WAIT_S), results) == (1, 2, [3])
    b.close(timeout=WAIT_S)
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
    await asyncio.wait_for(started.wait(), WAIT_S)
    queued = asyncio.create_task(b.submit(2))
    await asyncio.sleep(0)  # one loop turn: it fills the queue
    writer = asyncio.create_task(b.submit(3))
    await asyncio.sleep(0)  # one loop turn: it waits for room
    assert calls.count(3) == 1
    gate.set()
    assert list(await asyncio.wait_for(asyncio.gather(first, queued, writer), WAIT_S)) == [1, 2, 3]
    await b.aclose(timeout=WAIT_S)
    assert (calls.count(3), calls.count(-3)) == (1, 1)

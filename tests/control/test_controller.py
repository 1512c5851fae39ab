"""AdaptiveBatchController: the clipped sign rule, its guards, the out-of-memory ceiling, and the
controller driving a batcher."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import batchkit
from batchkit import (
    AdaptiveBatchController,
    DynamicBatcher,
)
from batchkit.control import Decision
from batchkit.testing import MockClock

WAIT = 10


def ctl(**kw: object) -> AdaptiveBatchController:
    args: dict[str, object] = {"target_queue": 4, "min_batch": 1, "max_batch": 8, "initial": 4, "clock": MockClock()}
    args.update(kw)
    return AdaptiveBatchController(**args)  # type: ignore[arg-type]


def test_clipped_sign_rule() -> None:
    """B moves by eta towards the queue target, clipped to [min, max]; each decision has a reason."""
    c = ctl(eta=2)
    assert c.update(10).batch_size == 6
    assert c.update(10).batch_size == 8
    assert c.update(10).batch_size == 8  # clipped
    d = c.update(0)
    assert (d.batch_size, d.reason) == (6, "queue_down")
    for _ in range(5):
        c.update(0)
    assert c.batch_size == 1
    assert [d.reason for d in list(c.decisions)[:2]] == ["queue_up", "queue_up"]


def test_deadband_and_cooldown_prevent_oscillation() -> None:
    """Inside the deadband nothing changes; after a change, the cooldown holds the size."""
    clock = MockClock()
    c = ctl(deadband=1, cooldown_s=1.0, clock=clock)
    assert c.update(5).reason == "deadband"
    assert c.update(9).batch_size == 5
    assert c.update(9).reason == "cooldown"
    clock.advance(1.0)
    assert c.update(9).batch_size == 6


def test_latency_guard_steps_down_near_the_slo() -> None:
    """High recent latency without a backlog, or slow batches without a backlog, step the size down."""
    clock = MockClock()
    c = ctl(latency_slo_ms=100, clock=clock)
    c.observe_latencies([0.09] * 50)
    assert c.update(4).reason == "latency"
    assert c.batch_size == 3
    clock.advance(10)  # the window forgets old samples
    assert c.update(10).reason == "queue_up"
    c.observe_batch(4, 0.045)  # 2 * 45 ms >= 0.9 * 100 ms
    assert c.update(4).reason == "latency"


def test_memory_guard_and_oom_ceiling() -> None:
    """Low memory headroom steps down; an OOM halves the ceiling below the failed batch."""
    headroom = {"free": 0.5}
    c = ctl(memory_headroom=lambda: headroom["free"], min_headroom=0.2)
    assert c.update(10).reason == "queue_up"
    headroom["free"] = 0.1
    assert c.update(10).reason == "memory"
    c.on_oom(4)
    assert c.ceiling == 2
    assert c.batch_size <= 2
    assert c.update(100).batch_size <= 2 or c.decisions[-1].reason == "memory"


def test_controller_validates_its_limits() -> None:
    """Inconsistent limits are ValueErrors."""
    with pytest.raises(ValueError, match="min_batch <= max_batch"):
        AdaptiveBatchController(target_queue=1, min_batch=4, max_batch=2)
    with pytest.raises(ValueError, match="initial"):
        AdaptiveBatchController(target_queue=1, max_batch=2, initial=3)


def test_out_of_memory_splits_the_batch_and_lowers_the_ceiling() -> None:
    """A batch function that runs out of memory above 2 items still answers everyone."""

    def fn(xs: list[int]) -> list[int]:
        if len(xs) > 2:
            raise MemoryError("too big")
        return [x * 2 for x in xs]

    c = AdaptiveBatchController(target_queue=0, max_batch=8, initial=8, clock=MockClock())
    with DynamicBatcher(fn, max_batch_size=8, max_wait_ms=1e6, controller=c, clock=MockClock()) as b:
        futs = [b.submit(i) for i in range(8)]
        assert [f.result(WAIT) for f in futs] == [2 * i for i in range(8)]
        assert c.ceiling <= 4
        assert b.max_batch_size <= 4


def test_controller_grows_the_batch_under_backlog_in_a_batcher() -> None:
    """Plugged into a batcher, the controller raises max_batch_size while a backlog remains."""
    c = AdaptiveBatchController(target_queue=0, max_batch=16, initial=1, clock=MockClock())
    with DynamicBatcher(lambda xs: xs, max_wait_ms=1e6, controller=c, clock=MockClock()) as b:
        futs = [b.submit(i) for i in range(40)]
        b.flush()
        concurrent.futures.wait(futs, timeout=WAIT)
        assert max(x.size for x in b.recent_batches()) > 1
        assert [f.result() for f in futs] == list(range(40))


def test_slow_batches_do_not_shrink_the_batch_under_a_backlog() -> None:
    """The batch-time guard shrinks the batch when one batch takes half the SLO, but not while a
    backlog grows: there, shrinking would cut throughput and let queueing delay explode. The
    previous controller shrank in both cases."""
    clock = MockClock()
    ctl = AdaptiveBatchController(
        target_queue=4, eta=2, min_batch=1, max_batch=64, initial=8, latency_slo_ms=80, cooldown_s=0, clock=clock
    )
    ctl.observe_batch(8, 0.050)  # 50 ms >= 0.9 * 80 / 2
    clock.advance(1)
    assert ctl.update(queue_depth=4).reason == "latency"  # no backlog: shrink
    assert ctl.batch_size == 6
    clock.advance(1)
    ctl.observe_batch(6, 0.050)
    d = ctl.update(queue_depth=100)  # a backlog: grow for throughput instead
    assert d.reason == "queue_up"
    assert ctl.batch_size == 8


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


class TestAControllerThatFailsNeverStrandsCallers:
    """A controller is user code (a subclass, or its ``memory_headroom`` callable): whatever it
    raises or returns, every caller is answered, the batcher keeps serving, and nothing escapes into
    a thread's excepthook or leaks a thread."""

    @pytest.mark.parametrize("kind", sorted(CONTROLLERS))
    def test_dynamic_batcher_survives_a_failing_controller(
        self, kind: str, escaped: list[BaseException | None]
    ) -> None:
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
    def test_async_batcher_survives_a_failing_controller(self, kind: str) -> None:
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


@pytest.mark.parametrize("quantile", [-1.0, 100.5, 150.0])
def test_controller_refuses_a_quantile_that_is_not_a_percentile(quantile: float) -> None:
    """slo_quantile is a percentile: out of [0, 100] it fails at construction, not at the first update."""
    with pytest.raises(ValueError, match="slo_quantile"):
        batchkit.AdaptiveBatchController(target_queue=1, latency_slo_ms=10, slo_quantile=quantile)


@pytest.mark.parametrize(
    "bad",
    [
        {"eta": 1.5},
        {"max_batch": 8.0},
        {"initial": 2.5},
        {"eta": True},
        {"target_queue": float("nan")},
        {"cooldown_s": float("nan")},
        {"deadband": float("inf")},
        {"latency_slo_ms": float("nan")},
        {"min_headroom": 2.0},
        {"min_headroom": -0.1},
    ],
)
def test_controller_refuses_fractional_batch_sizes_and_numbers_that_are_not_finite(bad: dict[str, object]) -> None:
    """Batch sizes are whole numbers and limits are finite: a bad one fails at construction with
    ValueError naming it, not later as a fractional batch size or a guard that never fires."""
    kwargs: dict[str, object] = {"target_queue": 1.0, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        batchkit.AdaptiveBatchController(**kwargs)  # type: ignore[arg-type]


def test_latencies_older_than_the_window_no_longer_shrink_the_batch() -> None:
    """The latency guard reads the P99 over the last window_s: a slow minute long past does not
    keep stepping the batch down."""
    clock = MockClock()
    ctl = AdaptiveBatchController(
        target_queue=1, eta=1, min_batch=1, max_batch=64, initial=8, latency_slo_ms=80, window_s=5.0, clock=clock
    )
    ctl.observe_latencies([0.079] * 20)
    assert ctl.update(queue_depth=1).reason == "latency"
    clock.advance(6.0)
    assert math.isnan(ctl.latency_ms())
    assert ctl.update(queue_depth=1).reason != "latency"


def test_an_out_of_memory_error_lowers_the_ceiling_to_half_the_failed_batch() -> None:
    """A batch of 8 that ran out of memory puts the ceiling at 4, whatever it was (64 here), and
    the batch size under it; later steps up stop there."""
    clock = MockClock()
    ctl = AdaptiveBatchController(target_queue=1, eta=4, min_batch=1, max_batch=64, initial=8, clock=clock)
    ctl.on_oom(8)
    assert (ctl.ceiling, ctl.batch_size) == (4, 4)
    clock.advance(1)
    assert ctl.update(queue_depth=100).batch_size == 4


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

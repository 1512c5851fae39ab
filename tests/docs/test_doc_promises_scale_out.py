"""Promises of docs/scale-out.md checked in this process (no Ray cluster): the derived Serve
options, what a replica's batcher gets, its health and autoscaling reports, and the Ray Data
mapper's rows."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

import batchkit
from batchkit.testing import MockClock

pytest.importorskip("ray", reason='needs Ray: pip install "batchkit[ray]"')

from batchkit.integrations.ray import (
    QUEUE_DEPTH_METRIC,
    RUNNING_BATCHES_METRIC,
    RUNNING_REQUESTS_METRIC,
    BatchkitMapper,
    BatchkitReplica,
    QueueDepthPolicy,
    autoscaling_stats,
    batched_deployment,
    deployment_options,
    replica_health,
)

pytestmark = [
    # Ray's own modules warn about their deprecations on import and on use; not ours to fix.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]

WAIT = 10.0


async def until(condition: Any, what: str) -> None:
    """Poll condition() on the event loop until it holds; fail after WAIT seconds."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


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


def test_a_missing_replica_bound_defaults_as_the_table_says() -> None:
    """A missing min_replicas is 1; a missing max_replicas is min_replicas (at least 1)."""
    cfg = deployment_options(max_batch=8, max_replicas=4)["autoscaling_config"]
    assert (cfg["min_replicas"], cfg["max_replicas"]) == (1, 4)
    cfg = deployment_options(max_batch=8, min_replicas=3)["autoscaling_config"]
    assert (cfg["min_replicas"], cfg["max_replicas"]) == (3, 3)
    cfg = deployment_options(max_batch=8, min_replicas=0)["autoscaling_config"]
    assert (cfg["min_replicas"], cfg["max_replicas"]) == (0, 1)


def test_the_queue_depth_policy_is_sized_from_b_opt_and_the_batch_slots() -> None:
    """autoscale_on_queue_depth: ceil((waiting + running batches * B_opt) / (B_opt * slots))."""
    opts = deployment_options(
        max_batch=8, b_opt=4, max_concurrent_batches=2, max_replicas=5, autoscale_on_queue_depth=True
    )
    cfg = opts["autoscaling_config"]
    assert cfg["target_ongoing_requests"] == 8
    policy = QueueDepthPolicy(**cfg["policy"]["policy_kwargs"])
    metrics = {QUEUE_DEPTH_METRIC: {"a": 10.0, "b": 3.0}, RUNNING_BATCHES_METRIC: {"a": 2.0, "b": 1.0}}
    assert policy.desired_replicas(metrics, current=2) == 4  # ceil((13 + 3 * 4) / 8)


def test_running_decode_requests_count_as_load() -> None:
    """A decode replica's running requests count one item each."""
    policy = QueueDepthPolicy(target_items_per_replica=4)
    metrics = {QUEUE_DEPTH_METRIC: {"a": 1.0, "b": 0.0}, RUNNING_REQUESTS_METRIC: {"a": 4.0, "b": 4.0}}
    assert policy.desired_replicas(metrics, current=1) == 3  # ceil(9 / 4)


def test_remaining_keyword_arguments_reach_each_replicas_batcher() -> None:
    """max_queue, max_concurrent_batches, isolate_errors... go to the replica's DynamicBatcher."""

    def half(xs: list[int]) -> list[int]:
        if 3 in xs:
            raise ValueError("three")
        return [x // 2 for x in xs]

    dep = batched_deployment(half, max_batch=4, max_wait_ms=1e6, isolate_errors=True, max_queue=12)
    replica = dep.func_or_class()
    try:
        assert replica.batcher.max_batch_size == 4
        assert replica.batcher.statistics().pending == 0
        futures = [replica.batcher.submit(x) for x in (2, 3, 4, 6)]
        assert futures[0].result(WAIT) == 1
        with pytest.raises(ValueError, match="three"):
            futures[1].result(WAIT)  # isolated: only the culprit fails
        assert [futures[2].result(WAIT), futures[3].result(WAIT)] == [2, 3]
        assert dep.max_ongoing_requests == 12
    finally:
        replica.batcher.close()


def test_each_replica_gets_its_own_default_circuit_breaker() -> None:
    """circuit_breaker defaults to a CircuitBreaker() per replica: five failing batches open it and
    fail that replica's health check; another replica of the same deployment stays healthy."""

    def broken(xs: list[int]) -> list[int]:
        raise RuntimeError("device lost")

    dep = batched_deployment(broken, max_batch=1, max_wait_ms=0)
    first, second = dep.func_or_class(), dep.func_or_class()
    try:
        for i in range(5):
            with pytest.raises(RuntimeError, match="device lost"):
                first.batcher.submit(i).result(WAIT)
        with pytest.raises(batchkit.CircuitOpen):
            first.check_health()
        with pytest.raises(batchkit.CircuitOpen):
            first.batcher.submit(9)
        second.check_health()
    finally:
        first.batcher.close()
        second.batcher.close()


def test_without_a_circuit_breaker_a_failing_replica_stays_healthy() -> None:
    """circuit_breaker=None: no breaker, so repeated failures never fail the health check."""

    def broken(xs: list[int]) -> list[int]:
        raise RuntimeError("device lost")

    replica = batched_deployment(broken, max_batch=1, max_wait_ms=0, circuit_breaker=None).func_or_class()
    try:
        for i in range(6):
            with pytest.raises(RuntimeError):
                replica.batcher.submit(i).result(WAIT)
        replica.check_health()
    finally:
        replica.batcher.close()


def test_a_replica_submit_reaches_priorities_and_deadlines() -> None:
    """submit(x, priority=..., deadline_ms=...): a better priority is served first; an item past its
    deadline leaves with DeadlineExceeded, even while the batch function is busy."""
    gate = Gate()
    clock = MockClock()
    replica = BatchkitReplica(gate, {"max_batch_size": 2, "max_wait_ms": 1e6, "clock": clock})

    async def main() -> None:
        busy = asyncio.ensure_future(replica.submit("busy"))
        await until(lambda: replica.statistics().pending >= 1, "the first item queued")
        replica.batcher.flush()
        await until(gate.started.is_set, "the first batch to start")
        late = asyncio.ensure_future(replica.submit("late", priority=1))
        doomed = asyncio.ensure_future(replica.submit("doomed", deadline_ms=10))
        early = asyncio.ensure_future(replica.submit("early", priority=-1))
        mid = asyncio.ensure_future(replica.submit("mid"))
        await until(lambda: replica.statistics().pending >= 4, "four items queued")
        clock.advance(0.02)
        with pytest.raises(batchkit.DeadlineExceeded):
            await asyncio.wait_for(doomed, WAIT)
        gate.release.set()
        assert list(await asyncio.wait_for(asyncio.gather(busy, early, mid), WAIT)) == ["busy", "early", "mid"]
        replica.batcher.flush()
        assert await asyncio.wait_for(late, WAIT) == "late"

    try:
        asyncio.run(main())
    finally:
        gate.release.set()
        replica.batcher.close()
    assert gate.batches == [["busy"], ["early", "mid"], ["late"]]


def test_replica_health_takes_a_batched_function_and_a_half_open_breaker_is_healthy() -> None:
    """replica_health(@batched function): CircuitOpen while its breaker is open, healthy once it
    may probe (half-open), BatcherClosed after close()."""
    clock = MockClock()
    breaker = batchkit.CircuitBreaker(failure_threshold=1, reset_timeout_s=5, clock=clock)

    @batchkit.batched(max_batch=1, max_wait_ms=0, circuit_breaker=breaker, clock=clock)
    def broken(xs: list[int]) -> list[int]:
        raise RuntimeError("down")

    replica_health(broken)
    with pytest.raises(RuntimeError, match="down"):
        broken(1)
    with pytest.raises(batchkit.CircuitOpen):
        replica_health(broken)
    clock.advance(5)
    replica_health(broken)  # half-open: its probe decides
    broken.close()
    with pytest.raises(batchkit.BatcherClosed):
        replica_health(broken)


def test_autoscaling_stats_sum_over_several_batchers() -> None:
    """autoscaling_stats(*batchers): the queue depths and running batches, summed."""
    gate = Gate()
    busy = batchkit.DynamicBatcher(gate, max_batch_size=1, max_wait_ms=0)
    idle = batchkit.DynamicBatcher(lambda xs: list(xs), max_batch_size=100, max_wait_ms=1e6, clock=MockClock())
    try:
        futures = [busy.submit(0)]
        assert gate.started.wait(WAIT)
        futures += [busy.submit(1), idle.submit(2), idle.submit(3)]
        assert autoscaling_stats(busy, idle) == {QUEUE_DEPTH_METRIC: 3.0, RUNNING_BATCHES_METRIC: 1.0}
    finally:
        gate.release.set()
        busy.close()
        idle.close()
    assert [f.result(WAIT) for f in futures] == [0, 1, 2, 3]


def test_mapper_rows_hold_id_output_and_a_type_message_error_after_retries() -> None:
    """Each row: the record's id, its output, and error None or "Type: message" after `retries`
    further tries; the record that makes its batch raise fails alone, its block-mates succeed."""
    tries: dict[int, int] = {}
    lock = threading.Lock()

    def fn(records: list[dict[str, Any]]) -> list[Any]:
        out: list[Any] = []
        for r in records:
            with lock:
                tries[r["id"]] = tries.get(r["id"], 0) + 1
            if r["id"] == 3:
                raise KeyError("poison")
            out.append(ValueError("bad record") if r["id"] == 2 else r["text"].upper())
        return out

    mapper = BatchkitMapper(fn, max_batch=4, max_wait_ms=1, retries=2, backoff_s=0.0)
    try:
        rows = mapper({"id": [0, 1, 2, 3, 4], "text": ["a", "b", "c", "d", "e"]})
    finally:
        mapper.batcher.close()
    assert list(rows["id"]) == [0, 1, 2, 3, 4]
    assert list(rows["output"]) == ["A", "B", None, None, "E"]
    assert list(rows["error"]) == [None, None, "ValueError: bad record", "KeyError: 'poison'", None]
    assert tries[4] == 1
    assert tries[2] > 1  # tried again before its error was recorded


def test_a_batch_request_may_carry_more_items_than_the_replicas_queue_holds() -> None:
    """handle.batch.remote(items): many items in one request, one result each. On an idle replica
    every item is served, even when the request carries more items than the queue holds: they wait
    for room instead of failing with QueueFull."""

    def double(xs: list[int]) -> list[int]:
        return [2 * x for x in xs]

    replica = BatchkitReplica(double, {"max_batch_size": 4, "max_wait_ms": 1, "max_queue": 8})

    async def main() -> list[Any]:
        return await asyncio.wait_for(replica.batch(list(range(50))), WAIT)

    try:
        assert asyncio.run(main()) == [2 * i for i in range(50)]
    finally:
        replica.batcher.close()
    assert replica.statistics().rejected == 0


def test_a_batch_request_to_a_closed_replica_gets_batcher_closed_in_every_slot() -> None:
    replica = BatchkitReplica(lambda xs: list(xs), {"max_batch_size": 4, "max_wait_ms": 1, "max_queue": 2})
    replica.batcher.close()

    async def main() -> list[Any]:
        return await asyncio.wait_for(replica.batch([1, 2, 3, 4, 5]), WAIT)

    out = asyncio.run(main())
    assert len(out) == 5
    assert all(isinstance(r, batchkit.BatcherClosed) for r in out)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"upscale_delay_s": 0.0},
        {"num_replicas": 2, "downscale_delay_s": 5.0},
    ],
    ids=["no-range", "fixed-count"],
)
def test_autoscaling_delays_without_autoscaling_are_refused(kwargs: dict[str, Any]) -> None:
    """The delays go to the autoscaling config: without a replica range (a fixed count) there is
    none, and they are a ValueError instead of being dropped."""
    with pytest.raises(ValueError, match="autoscaling"):
        deployment_options(max_batch=8, **kwargs)


@pytest.mark.parametrize("delay", [-1.0, float("nan"), float("inf"), "1", True])
def test_an_autoscaling_delay_is_a_finite_number_of_seconds(delay: object) -> None:
    with pytest.raises(ValueError, match="upscale_delay_s"):
        deployment_options(max_batch=8, max_replicas=2, upscale_delay_s=delay)  # type: ignore[arg-type]


def test_autoscaling_delays_reach_the_autoscaling_config() -> None:
    cfg = deployment_options(max_batch=8, max_replicas=3, upscale_delay_s=0, downscale_delay_s=5.5)[
        "autoscaling_config"
    ]
    assert (cfg["upscale_delay_s"], cfg["downscale_delay_s"]) == (0, 5.5)

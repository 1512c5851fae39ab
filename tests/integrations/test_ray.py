"""batchkit.integrations.ray: Serve replicas and Ray Data pipelines.

The first half runs in this process (options, health, autoscaling stats, cancellation, the
mapper); the second starts one local Ray instance for the module (two CPUs, no dashboard, no
HTTP proxy) and checks the promises that need real replicas. Without Ray installed the whole file
is skipped; if Ray cannot start here, the cluster tests are skipped with the reason.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import numpy as np
import pytest

import batchkit
import batchkit.jobs
from _support import Gate
from batchkit.testing import MockClock

ray = pytest.importorskip("ray", reason='needs Ray: pip install "batchkit[ray]"')

from batchkit.integrations.ray import (  # noqa: E402 - after the skip
    QUEUE_DEPTH_METRIC,
    RUNNING_BATCHES_METRIC,
    RUNNING_REQUESTS_METRIC,
    BatchkitMapper,
    BatchkitReplica,
    DecodeReplica,
    QueueDepthPolicy,
    autoscaling_stats,
    batched_deployment,
    decode_deployment,
    deployment_options,
    map_records,
    replica_health,
)

pytestmark = [
    pytest.mark.ray,
    # Ray's own modules warn about their deprecations on import and on use; not ours to fix.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
]

WAIT = 30.0  # seconds: the bound on every wait


def wait_until(predicate: Any, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def shout(records: list[dict[str, Any]]) -> list[Any]:
    """A jobs-style batch function; the record with text "poison" makes the whole call raise."""
    if any(r["text"] == "poison" for r in records):
        raise ValueError("poison record")
    return [r["text"].upper() for r in records]


def tag_with_pid(items: list[tuple[int, float]]) -> list[tuple[int, int]]:
    """Each item ``(i, delay)`` as ``(i, pid of the process that served it)``, after sleeping the
    batch's longest delay (so that batches overlap and a replica holds requests when it dies)."""
    time.sleep(max(delay for _, delay in items))
    return [(i, os.getpid()) for i, _ in items]


def fail_on_boom(items: list[str]) -> list[tuple[str, int]]:
    """Raises for a batch holding "boom" (a failing batch); otherwise each item with the pid."""
    if "boom" in items:
        raise RuntimeError("the device is gone")
    return [(x, os.getpid()) for x in items]


def slow_square(items: list[int]) -> list[int]:
    """One batch takes 1.5 s: long enough to cancel a request queued behind it."""
    time.sleep(1.5)
    return [x * x for x in items]


GATE = SimpleNamespace(started=threading.Event(), release=threading.Event())


def gated(items: list[int]) -> list[int]:
    """Holds its batch until GATE.release is set (in this process only: pickled by reference)."""
    GATE.started.set()
    assert GATE.release.wait(WAIT)
    return items


def tiny_model(seed: int = 0) -> Any:
    """A small reference Llama with random weights (built where it is called: in the replica)."""
    import torch

    from batchkit.models import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    return LlamaModel(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )


def tiny_loop(seed: int = 0) -> Any:
    """A small reference Llama behind a decode loop (built where it is called: in the replica)."""
    model = tiny_model(seed)
    return batchkit.ContinuousDecodeLoop(model, model.make_cache(num_blocks=64, block_size=4), max_num_seqs=4)


# --------------------------------------------------------------------------- in this process


def test_import_batchkit_does_not_import_ray() -> None:
    """`import batchkit` (and `batchkit.integrations`) loads no Ray module."""
    code = "import sys, batchkit, batchkit.integrations; print(any(m.split('.')[0] == 'ray' for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_importing_the_integration_does_not_import_ray() -> None:
    """`batchkit.integrations.ray` imports Ray only in the functions that need it."""
    code = "import sys, batchkit.integrations.ray; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_options_let_a_replica_hold_what_its_batcher_admits() -> None:
    """max_ongoing_requests is the batcher's queue capacity (default: five full batches per slot),
    lifting Serve's default cap of 5."""
    assert deployment_options(max_batch=32) == {"max_ongoing_requests": 160, "num_replicas": 1}
    opts = deployment_options(max_batch=16, max_concurrent_batches=2, num_replicas=3)
    assert opts == {"max_ongoing_requests": 160, "num_replicas": 3}


def test_options_never_send_more_than_the_queue_admits() -> None:
    """With a given max_queue, a replica is sent at most what its queue holds, even if every
    request sent has to wait in it."""
    assert deployment_options(max_batch=32, max_queue=100)["max_ongoing_requests"] == 100


def test_deployment_gives_its_batcher_the_queue_serve_assumes() -> None:
    """batched_deployment's replicas get the max_queue that max_ongoing_requests was sized from."""
    dep = batched_deployment(batchkit.testing.echo_batch, max_batch=8, max_concurrent_batches=2)
    assert dep.max_ongoing_requests == 80
    dep = batched_deployment(batchkit.testing.echo_batch, max_batch=8, max_queue=10)
    assert dep.max_ongoing_requests == 10


def test_autoscaling_targets_b_opt_per_batch_slot() -> None:
    """Autoscaling aims each replica at B_opt items per batch slot (max_batch without B_opt)."""
    opts = deployment_options(max_batch=32, b_opt=12, max_concurrent_batches=2, min_replicas=1, max_replicas=4)
    assert opts["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 24}
    assert "num_replicas" not in opts
    plain = deployment_options(max_batch=8, max_replicas=2)["autoscaling_config"]
    assert plain["target_ongoing_requests"] == 8


def test_queue_depth_autoscaling_names_the_policy() -> None:
    """autoscale_on_queue_depth installs QueueDepthPolicy with the B_opt target, and Ray accepts it."""
    from ray import serve

    opts = deployment_options(max_batch=8, b_opt=6, max_replicas=3, autoscale_on_queue_depth=True)
    policy = opts["autoscaling_config"]["policy"]
    assert policy == {
        "policy_function": "batchkit.integrations.ray:QueueDepthPolicy",
        "policy_kwargs": {"target_items_per_replica": 6, "items_per_batch": 6},
    }
    serve.deployment(BatchkitReplica, **opts)  # Ray's own validation of every option


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch": 0}, "max_batch must be an int >= 1"),
        ({"max_batch": 8, "b_opt": 9}, r"b_opt \(9\) cannot exceed max_batch \(8\)"),
        ({"max_batch": 8, "max_concurrent_batches": 2, "max_queue": 15}, r"max_queue \(15\) is below"),
        ({"max_batch": 8, "num_replicas": 2, "max_replicas": 3}, "either num_replicas"),
        ({"max_batch": 8, "min_replicas": 3, "max_replicas": 2}, r"min_replicas \(3\) cannot exceed"),
    ],
)
def test_options_refuse_bad_bounds(kwargs: dict[str, Any], message: str) -> None:
    """Bad bounds are a ValueError naming the argument."""
    with pytest.raises(ValueError, match=message):
        deployment_options(**kwargs)


def test_health_fails_while_the_breaker_is_open_and_recovers_at_its_probe() -> None:
    """replica_health raises CircuitOpen while the breaker is open, and passes once it may probe."""
    clock = MockClock()
    cb = batchkit.CircuitBreaker(failure_threshold=1, reset_timeout_s=10.0, clock=clock)
    with batchkit.DynamicBatcher(batchkit.testing.echo_batch, circuit_breaker=cb) as b:
        replica_health(b)
        cb.record(False)
        with pytest.raises(batchkit.CircuitOpen, match="circuit breaker"):
            replica_health(b)
        clock.advance(10.0)
        replica_health(b)


def test_health_fails_for_a_closed_batcher() -> None:
    """A closed batcher serves nothing: the replica is unhealthy."""
    b = batchkit.DynamicBatcher(batchkit.testing.echo_batch)
    b.close()
    with pytest.raises(batchkit.BatcherClosed, match="is closed"):
        replica_health(b)
    with pytest.raises(TypeError, match="DynamicBatcher or a @batched"):
        replica_health(object())


def test_autoscaling_stats_count_waiting_items_and_running_batches() -> None:
    """record_autoscaling_stats reports the queue depth and the batches running now."""
    release = threading.Event()
    started = threading.Event()

    def blocked(items: list[int]) -> list[int]:
        started.set()
        assert release.wait(WAIT)
        return items

    with batchkit.DynamicBatcher(blocked, max_batch_size=2, max_wait_ms=0) as b:
        futures = [b.submit(0)]
        assert started.wait(WAIT)
        futures += [b.submit(i) for i in range(1, 4)]
        stats = autoscaling_stats(b)
        assert stats == {QUEUE_DEPTH_METRIC: 3.0, RUNNING_BATCHES_METRIC: 1.0}
        release.set()
        assert [f.result(WAIT) for f in futures] == [0, 1, 2, 3]


def test_queue_depth_policy_asks_for_items_over_target() -> None:
    """QueueDepthPolicy asks for ceil(load / target) replicas, a running batch counting as
    items_per_batch items; it keeps the count before any report."""
    policy = QueueDepthPolicy(target_items_per_replica=8, items_per_batch=8)
    metrics = {QUEUE_DEPTH_METRIC: {"a": 10.0, "b": 6.0}, RUNNING_BATCHES_METRIC: {"a": 1.0, "b": 1.0}}
    assert policy.desired_replicas(metrics, current=2) == 4  # 16 waiting + 2 batches of 8
    assert policy.desired_replicas({QUEUE_DEPTH_METRIC: {"a": 0.0}}, current=2) == 0
    assert policy.desired_replicas(None, current=2) == 2
    ctx = SimpleNamespace(aggregated_metrics=metrics, current_num_replicas=2)
    assert policy(ctx) == (4, {})
    with pytest.raises(ValueError, match="target_items_per_replica must be > 0"):
        QueueDepthPolicy(0)


@pytest.mark.anyio
async def test_a_cancelled_request_drops_its_item() -> None:
    """Cancelling the task awaiting a replica call (what Ray does on cancel) drops the queued item:
    the batch function never sees it and the batcher holds nothing afterwards."""
    release = threading.Event()
    started = threading.Event()
    seen: list[int] = []

    def blocked(items: list[int]) -> list[int]:
        seen.extend(items)
        started.set()
        assert release.wait(WAIT)
        return items

    replica = BatchkitReplica(blocked, {"max_batch_size": 1, "max_wait_ms": 0})
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(replica, 1)
            with anyio.fail_after(WAIT):
                while not started.is_set():
                    await anyio.sleep(0.01)
            with anyio.CancelScope() as scope:
                tg.start_soon(replica, 2)  # queued behind the running batch
                with anyio.fail_after(WAIT):
                    while replica.statistics().pending < 1:
                        await anyio.sleep(0.01)
                scope.cancel()
            tg.cancel_scope.cancel()  # cancels the waiting call for item 2 (and item 1's await)
        release.set()
        with anyio.fail_after(WAIT):
            while replica.statistics().in_flight:
                await anyio.sleep(0.01)
        stats = replica.statistics()
        assert seen == [1]
        assert stats.pending == 0
        assert stats.cancelled >= 1
    finally:
        release.set()
        replica.batcher.close()


@pytest.mark.anyio
async def test_replica_batch_answers_each_item_and_isolates_failures() -> None:
    """BatchkitReplica.batch returns one result per item, a failed item's exception in its slot."""

    def half(items: list[int]) -> list[Any]:
        return [ValueError(f"odd {x}") if x % 2 else x // 2 for x in items]

    replica = BatchkitReplica(half, {"max_batch_size": 4, "max_wait_ms": 1})
    try:
        with anyio.fail_after(WAIT):
            out = await replica.batch([0, 1, 2, 4])
        assert [out[0], out[2], out[3]] == [0, 1, 2]
        assert isinstance(out[1], ValueError)
        assert await replica(6) == 3
    finally:
        replica.batcher.close()


def test_replica_builds_a_class_target_in_place() -> None:
    """A class target is instantiated in the replica with the bound arguments."""

    class Scale:
        def __init__(self, k: int) -> None:
            self.k = k

        def __call__(self, items: list[int]) -> list[int]:
            return [x * self.k for x in items]

    replica = BatchkitReplica(Scale, {"max_batch_size": 4, "max_wait_ms": 1}, (3,))
    try:
        assert replica.batcher.submit(2).result(WAIT) == 6
        replica.check_health()
        assert set(replica.record_autoscaling_stats()) == {QUEUE_DEPTH_METRIC, RUNNING_BATCHES_METRIC}
    finally:
        replica.batcher.close()


@pytest.mark.anyio
async def test_decode_replica_streams_what_it_returns_and_aborts_a_stream_left_early() -> None:
    """DecodeReplica.generate streams the tokens __call__ returns; leaving the stream early (what
    a Ray cancel does) aborts the request and frees its KV blocks."""
    pytest.importorskip("torch")
    replica = DecodeReplica(tiny_loop)
    try:
        with anyio.fail_after(WAIT):
            whole = await replica([1, 2, 3], max_new_tokens=6, ignore_eos=True)
            streamed = [t async for t in replica.generate([1, 2, 3], max_new_tokens=6, ignore_eos=True)]
            assert streamed == whole
            assert len(whole) == 6
            stream = replica.generate([4, 5], max_new_tokens=50, ignore_eos=True)
            async for _ in stream:
                break
            await stream.aclose()  # type: ignore[attr-defined]
            while replica.statistics().scheduler.running:
                await anyio.sleep(0.01)
        stats = replica.statistics().scheduler
        assert stats.aborted == 1
        assert stats.kv_usage == 0.0
        assert replica.record_autoscaling_stats() == {QUEUE_DEPTH_METRIC: 0.0, RUNNING_REQUESTS_METRIC: 0.0}
    finally:
        replica.loop.close(timeout=WAIT)


def test_decode_deployment_is_sized_from_max_num_seqs() -> None:
    """decode_deployment sends a replica at most max_waiting requests (default 5 * max_num_seqs)."""
    assert decode_deployment(tiny_loop, max_num_seqs=8).max_ongoing_requests == 40
    assert decode_deployment(tiny_loop, max_num_seqs=8, max_waiting=20).max_ongoing_requests == 20


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_num_seqs": 8, "max_waiting": 4}, r"max_waiting \(4\) is below max_num_seqs \(8\)"),
        ({"max_num_seqs": 0}, "max_num_seqs must be an int >= 1"),
        ({"max_num_seqs": 8, "max_waiting": 0}, "max_waiting must be an int >= 1"),
    ],
)
def test_decode_deployment_names_its_own_options_in_its_errors(options: dict[str, Any], message: str) -> None:
    """Its errors name max_num_seqs / max_waiting, the arguments given (they named
    deployment_options' max_batch / max_queue)."""
    with pytest.raises(ValueError, match=message):
        decode_deployment(tiny_loop, **options)


def test_a_replica_admits_all_serve_sends_while_a_small_batch_runs() -> None:
    """A replica's queue holds every request Serve may send it, even when the running batch is a
    single item (on the previous main, the 40th of 40 requests failed with QueueFull)."""
    dep = batched_deployment(gated, max_batch=8, max_wait_ms=0)
    replica = dep.func_or_class()  # what Serve builds in each replica
    GATE.started.clear()
    GATE.release.clear()
    try:
        futures = [replica.batcher.submit(0)]
        assert GATE.started.wait(WAIT)  # a batch of one runs
        futures += [replica.batcher.submit(i) for i in range(1, dep.max_ongoing_requests)]
        GATE.release.set()
        assert [f.result(WAIT) for f in futures] == list(range(dep.max_ongoing_requests))
    finally:
        GATE.release.set()
        replica.batcher.close()


def test_deployment_kwargs_merge_into_the_derived_autoscaling_config() -> None:
    """An autoscaling_config in deployment_kwargs adds to the derived target and policy, and
    other deployment_kwargs replace the derived values."""
    dep = batched_deployment(
        batchkit.testing.echo_batch,
        max_batch=4,
        max_replicas=3,
        autoscale_on_queue_depth=True,
        deployment_kwargs={"autoscaling_config": {"upscale_delay_s": 0.0}, "max_ongoing_requests": 7},
    )
    config = dep._deployment_config  # Ray's own record of what it will run
    assert dep.max_ongoing_requests == 7
    assert config.autoscaling_config.upscale_delay_s == 0.0
    assert config.autoscaling_config.target_ongoing_requests == 4
    assert config.autoscaling_config.max_replicas == 3


def test_batched_deployment_refuses_what_cannot_travel_to_replicas() -> None:
    """A @batched function or a queue cannot be shipped to replicas; the error says what to pass."""

    @batchkit.batched(max_batch=4)
    def f(xs: list[int]) -> list[int]:
        return xs

    try:
        with pytest.raises(TypeError, match="plain batch function"):
            batched_deployment(f)
    finally:
        f.close()
    with pytest.raises(TypeError, match="pass max_queue and on_full"):
        batched_deployment(batchkit.testing.echo_batch, queue=batchkit.BoundedQueue(8))


def test_mapper_rows_match_the_single_process_job(tmp_path: Path) -> None:
    """BatchkitMapper's rows hold the same outputs and the same failures as batchkit.jobs.run."""
    records = [{"id": f"r{i}", "text": "poison" if i == 7 else f"item {i}"} for i in range(40)]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    batchkit.jobs.run(shout, src, tmp_path / "out.jsonl", max_batch=8, backoff_s=0.0)
    job_out = {o["id"]: o["output"] for o in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    job_dead = {o["id"]: o["error"] for o in map(json.loads, (tmp_path / "out.dead.jsonl").read_text().splitlines())}

    mapper = BatchkitMapper(shout, max_batch=8, max_wait_ms=1, backoff_s=0.0)
    try:
        columns = {"id": np.array([r["id"] for r in records]), "text": np.array([r["text"] for r in records])}
        rows = mapper(columns)
    finally:
        mapper.batcher.close()
    out = {i: o for i, o, e in zip(rows["id"], rows["output"], rows["error"], strict=True) if e is None}
    dead = {i: e for i, e in zip(rows["id"], rows["error"], strict=True) if e is not None}
    assert out == job_out
    assert dead == job_dead == {"r7": "ValueError: poison record"}


# --------------------------------------------------------------------------- docs/scale-out.md, in this process

# Promises of docs/scale-out.md checked without a Ray cluster: the derived Serve options, what a
# replica's batcher gets, its health and autoscaling reports, and the Ray Data mapper's rows.


async def until(condition: Any, what: str) -> None:
    """Poll condition() on the event loop until it holds; fail after WAIT seconds."""
    deadline = asyncio.get_running_loop().time() + WAIT
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


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


# --------------------------------------------------------------------------- on a local Ray instance


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    """One local Ray instance and Serve (no HTTP proxy) for the cluster tests."""
    from ray import serve

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    t0 = time.monotonic()
    try:
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        serve.start(proxy_location="Disabled")
    except Exception as exc:
        ray.shutdown()
        pytest.skip(f"Ray could not start a local instance here ({time.monotonic() - t0:.0f} s): {exc!r}")
    try:
        yield serve
    finally:
        serve.shutdown()  # type: ignore[no-untyped-call]
        ray.shutdown()


def call_with_retries(handle: Any, item: Any, retried: list[int], attempts: int = 8) -> Any:
    """What a caller does to lose nothing: retry a request whose replica died under it."""
    for attempt in range(attempts):
        try:
            return handle.remote(item).result(timeout_s=WAIT)
        except Exception:
            if attempt == attempts - 1:
                raise
            retried.append(item[0])
            time.sleep(0.25 * (attempt + 1))
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- docs/scale-out.md's snippets
# Its not-run snippets run here as written, on the local instance, with small stand-ins for what
# they load. A stand-in is an instance of the real class (a PretrainedLM, a SentenceEncoder
# subclass that overrides only what exists on SentenceEncoder), so that a snippet calling what
# the real object lacks fails here as it would for a reader. This test comes before the other
# cluster tests: the page's Ray Data job needs a CPU for its reader beside its two actors, which
# the two_replicas deployment (kept for the module) would take.


def tiny_pretrained(source: str) -> Any:
    """Stands in for load_pretrained: a real PretrainedLM around tiny_model (no tokenizer)."""
    from batchkit.models import PretrainedLM

    return PretrainedLM(
        model=tiny_model(),
        tokenizer=None,
        eos_token_id=None,
        stop_token_ids=(),
        max_model_len=256,
        name=source,
        path=Path(source),
    )


def tiny_encoder(source: str) -> Any:
    """Stands in for load_encoder: a SentenceEncoder whose vector of a text is [len(text), 1.0]."""
    import torch

    from batchkit.models import SentenceEncoder

    class TinyEncoder(SentenceEncoder):
        def __init__(self) -> None:  # no weights to read
            self.name, self.dimension = source, 2

        def encode(self, texts: Any) -> tuple[Any, list[int]]:
            return torch.tensor([[float(len(t)), 1.0] for t in texts]), [len(t) for t in texts]

    return TinyEncoder()


def counting_mapper(log: Path) -> type[BatchkitMapper]:
    """BatchkitMapper that appends a line to ``log`` for each record it maps (the actors run on
    this machine, so they share its files)."""

    class CountingMapper(BatchkitMapper):
        def __call__(self, batch: Any) -> dict[str, list[Any]]:
            rows = super().__call__(batch)
            with log.open("a") as f:
                f.write("mapped\n" * len(rows["id"]))
            return rows

    return CountingMapper


def test_stand_ins_define_only_what_the_real_classes_have() -> None:
    """The stand-ins hide no AttributeError: each public name they have, the real class has too."""
    pytest.importorskip("torch")
    from batchkit.models import PretrainedLM, SentenceEncoder

    assert type(tiny_pretrained("m")) is PretrainedLM
    encoder = tiny_encoder("m")
    assert isinstance(encoder, SentenceEncoder)
    extra = {n for n in vars(type(encoder)) if not n.startswith("_")} - set(dir(SentenceEncoder))
    assert not extra


@pytest.mark.timeout(240)
def test_scale_out_snippets_run_against_stand_ins(
    cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every not-run snippet of docs/scale-out.md runs as written on the local instance (the models
    replaced by tiny stand-ins, a small reviews.jsonl), and its Ray Data job maps each record once."""
    pytest.importorskip("torch")
    import ray.data

    import batchkit.integrations.ray
    import batchkit.models
    from _docs import ROOT, read_blocks, run_python_block

    ray.data.DataContext.get_current().enable_progress_bars = False
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(batchkit.models, "load_encoder", tiny_encoder)
    monkeypatch.setattr(batchkit.models, "load_pretrained", tiny_pretrained)
    mapped = tmp_path / "mapped.log"
    monkeypatch.setattr(batchkit.integrations.ray, "BatchkitMapper", counting_mapper(mapped))
    reviews = [{"id": f"r{i}", "text": f"review {i}"} for i in range(30)] + [{"id": "r30"}]  # r30: no text
    (tmp_path / "reviews.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reviews))

    blocks = [b for b in read_blocks(ROOT / "docs" / "scale-out.md") if "not-run" in b.markers]
    assert len(blocks) == 3
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for block in blocks:
        apps_before = set(cluster.status().applications)
        try:
            run_python_block(block, namespace, "asyncio")
        finally:
            for name in set(cluster.status().applications) - apps_before:
                cluster.delete(name)  # free the CPUs for the next snippet and the other tests
    assert namespace["vector"] == [5.0, 1.0]
    assert namespace["vectors"] == [[1.0, 1.0]] * 3
    assert len(namespace["tokens"]) == 64
    assert namespace["failed"].take_all()[0]["id"] == "r30"
    assert len(mapped.read_text().splitlines()) == len(reviews)  # written and filtered, mapped once


@pytest.fixture(scope="module")
def two_replicas(cluster: Any) -> Any:
    """tag_with_pid behind two replicas (a quarter CPU each, so Ray Data still finds room)."""
    app = batched_deployment(
        tag_with_pid, max_batch=8, max_wait_ms=5, num_replicas=2, ray_actor_options={"num_cpus": 0.25}
    )
    return cluster.run(app.bind(), name="tag", route_prefix=None)


@pytest.mark.timeout(120)
def test_two_replicas_share_the_load_and_answer_each_request_once(two_replicas: Any) -> None:
    """Requests through one handle reach both replicas; each gets exactly its own answer."""
    # 0.1 s per batch of at most 8: one replica alone cannot keep up with the submissions, so the
    # router must use both (a faster function can let the first replica drain as fast as it fills).
    responses = [two_replicas.remote((i, 0.1)) for i in range(200)]
    answers = [r.result(timeout_s=WAIT) for r in responses]
    assert [x for x, _ in answers] == list(range(200))
    per_replica = Counter(pid for _, pid in answers)
    assert len(per_replica) == 2, per_replica
    assert min(per_replica.values()) >= 20, per_replica  # shared, not one replica doing it all


@pytest.mark.timeout(120)
def test_a_killed_replica_loses_no_request_the_caller_retries(two_replicas: Any) -> None:
    """SIGKILL one replica mid-load: every caller that retries gets its answer."""
    # Concurrent requests, slow enough that one replica cannot take them all: both answer.
    pids: set[int] = set()
    for _ in range(5):
        pids |= {
            pid for _, pid in (r.result(timeout_s=WAIT) for r in [two_replicas.remote((i, 0.05)) for i in range(40)])
        }
        if len(pids) == 2:
            break
    assert len(pids) == 2, pids
    victim = min(pids)
    results: dict[int, Any] = {}
    errors: list[BaseException] = []
    retried: list[int] = []

    def caller(items: range) -> None:
        for i in items:
            try:
                results[i] = call_with_retries(two_replicas, (i, 0.2), retried)
            except BaseException as exc:
                errors.append(exc)

    # 12 callers on 2 replicas, 0.2 s per batch: each replica holds several requests at any moment.
    threads = [threading.Thread(target=caller, args=(range(k, 144, 12),)) for k in range(12)]
    for t in threads:
        t.start()
    # Kill the victim while it serves this load: it has answered some of it, and most is still to come.
    wait_until(
        lambda: len(results) >= 24 and victim in {pid for _, pid in list(results.values())},
        "the victim to serve part of the load",
    )
    os.kill(victim, signal.SIGKILL)  # a Ray worker this test's ray.init started
    answered_before_kill = len(results)
    for t in threads:
        t.join(timeout=90)
    assert not any(t.is_alive() for t in threads)
    assert answered_before_kill < 144, "the load was over before the kill: the test did not test anything"
    assert not errors, errors[:3]
    assert sorted(results) == list(range(144))
    assert all(results[i][0] == i for i in results)
    # Whether a request the victim held comes back to the caller as an error (and is retried by
    # call_with_retries, counted in `retried`) or is re-routed by Ray itself, none is lost.


@pytest.mark.timeout(120)
def test_serve_replaces_a_replica_whose_breaker_is_open(cluster: Any) -> None:
    """A failing batch opens the replica's circuit breaker; its health check then fails, and Serve
    replaces it with a fresh replica that serves."""
    app = batched_deployment(
        fail_on_boom,
        max_batch=4,
        max_wait_ms=1,
        name="breaker",
        circuit_breaker=batchkit.CircuitBreaker(failure_threshold=1, reset_timeout_s=600.0),
        ray_actor_options={"num_cpus": 0.25},
        deployment_kwargs={"health_check_period_s": 0.5, "health_check_timeout_s": 5.0},
    )
    handle = cluster.run(app.bind(), name="breaker", route_prefix=None)
    _, first_pid = handle.remote("ok").result(timeout_s=WAIT)
    with pytest.raises(Exception, match="the device is gone"):
        handle.remote("boom").result(timeout_s=WAIT)
    with pytest.raises(Exception, match="CircuitOpen"):
        handle.remote("ok").result(timeout_s=WAIT)  # fails fast while the breaker is open

    def served_by_a_new_replica() -> bool:
        try:
            return bool(handle.remote("ok").result(timeout_s=WAIT)[1] != first_pid)
        except Exception:
            return False  # still the old replica (fails fast) or the swap in progress

    wait_until(served_by_a_new_replica, "Serve to replace the unhealthy replica", timeout=60)
    cluster.delete("breaker")


@pytest.mark.timeout(120)
def test_ray_cancellation_reaches_the_batcher(cluster: Any) -> None:
    """A request cancelled through its DeploymentResponse is dropped from the replica's batcher
    before its batch runs."""
    from ray.serve.exceptions import RequestCancelledError

    app = batched_deployment(
        slow_square,
        max_batch=1,
        max_wait_ms=0,
        name="slow",
        ray_actor_options={"num_cpus": 0.25},
        deployment_kwargs={"max_ongoing_requests": 8},  # room for the statistics() calls
    )
    handle = cluster.run(app.bind(), name="slow", route_prefix=None)
    stats = handle.statistics
    first = handle.remote(3)
    wait_until(lambda: stats.remote().result(timeout_s=WAIT).in_flight == 1, "the first batch to run")
    second = handle.remote(4)
    wait_until(lambda: stats.remote().result(timeout_s=WAIT).pending == 1, "the second item to queue")
    second.cancel()
    with pytest.raises(RequestCancelledError):
        second.result(timeout_s=WAIT)
    assert first.result(timeout_s=WAIT) == 9
    wait_until(lambda: stats.remote().result(timeout_s=WAIT).cancelled == 1, "the batcher to drop the item")
    final = stats.remote().result(timeout_s=WAIT)
    assert (final.succeeded, final.batches, final.pending) == (1, 1, 0)
    cluster.delete("slow")


@pytest.mark.timeout(120)
def test_tokens_stream_through_a_decode_replica(cluster: Any) -> None:
    """A decode replica streams a request's tokens through a handle, the same as one process."""
    pytest.importorskip("torch")
    app = decode_deployment(tiny_loop, max_num_seqs=4, name="decode", ray_actor_options={"num_cpus": 0.25})
    handle = cluster.run(app.bind(), name="decode", route_prefix=None)
    streamed = list(handle.options(stream=True).generate.remote([1, 2, 3], max_new_tokens=6, ignore_eos=True))
    with tiny_loop() as loop:
        expected = loop.submit([1, 2, 3], max_new_tokens=6, ignore_eos=True).result(WAIT)
    assert streamed == expected
    assert handle.remote([1, 2, 3], max_new_tokens=6, ignore_eos=True).result(timeout_s=WAIT) == expected
    cluster.delete("decode")


@pytest.mark.timeout(120)
def test_ray_data_job_equals_the_single_process_job(cluster: Any, tmp_path: Path) -> None:
    """map_records over read_json gives the outputs and failures of batchkit.jobs.run on the same file."""
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    src = tmp_path / "in.jsonl"
    with src.open("w") as f:
        for i in range(500):
            f.write(json.dumps({"id": f"r{i}", "text": "poison" if i in (13, 401) else f"item {i}"}) + "\n")
    batchkit.jobs.run(shout, src, tmp_path / "out.jsonl", max_batch=16, backoff_s=0.0)
    job_out = {o["id"]: o["output"] for o in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    job_dead = {o["id"]: o["error"] for o in map(json.loads, (tmp_path / "out.dead.jsonl").read_text().splitlines())}

    ds = map_records(ray.data.read_json(str(src)), shout, replicas=2, num_cpus=0.25, max_batch=16, backoff_s=0.0)
    rows = ds.take_all()
    assert len(rows) == 500
    assert Counter(r["id"] for r in rows) == Counter(f"r{i}" for i in range(500))  # each record once
    assert {r["id"]: r["output"] for r in rows if r["error"] is None} == job_out
    assert {r["id"]: r["error"] for r in rows if r["error"] is not None} == job_dead
    assert len(job_dead) == 2

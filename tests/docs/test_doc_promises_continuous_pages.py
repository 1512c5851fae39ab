"""Promises of docs/continuous.md, checked as a user reads them: which request preemption picks,
blocks freed the step a request ends or is given up, the loop after close(), and its statistics."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import pytest

import batchkit
from batchkit.continuous import Request

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

WAIT = 30.0
VOCAB = 16


class GatedStep:
    """A step function with uniform logits (greedy picks token 0) that can hold the engine."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.go.set()
        self.stepped = threading.Event()

    def __call__(self, batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
        self.stepped.set()
        assert self.go.wait(WAIT)
        return torch.zeros(len(batch.sample_indices), VOCAB)


def _cache(num_blocks: int = 16) -> batchkit.PagedKVCache:
    return batchkit.PagedKVCache(num_layers=1, num_blocks=num_blocks, block_size=4, num_kv_heads=1, head_dim=4)


@pytest.mark.parametrize(
    ("priorities", "victim"),
    [((0, 1, 1), "C"), ((1, 0, 0), "A"), ((0, 0, 0), "C")],
    ids=["worst-priority-most-recent", "worst-priority-oldest", "equal-most-recent"],
)
def test_running_out_of_blocks_preempts_the_worst_running_request(priorities: tuple[int, ...], victim: str) -> None:
    """When decoding runs out of blocks, the running request with the highest priority value, then
    the most recent, is preempted (back to waiting)."""
    sched = batchkit.Scheduler(batchkit.PagedKVAllocator(num_blocks=8, block_size=4))
    names = ("A", "B", "C")
    for i, (name, priority) in enumerate(zip(names, priorities, strict=True)):
        params = batchkit.SamplingParams(max_new_tokens=40, ignore_eos=True)
        sched.add(Request(name, [1, 2, 3], params, priority=priority, arrival=float(i)))
    for _ in range(30):
        step = sched.schedule()
        sched.update(step, [5] * sum(step.samples))
        if sched.statistics().preemptions:
            break
    assert sched.statistics().preemptions == 1
    statuses = {}
    for name in names:
        request = sched.get(name)
        assert request is not None
        statuses[name] = request.status.name
    assert statuses == {n: ("WAITING" if n == victim else "RUNNING") for n in names}


def test_a_finished_request_has_freed_its_blocks_when_its_result_arrives() -> None:
    """Requests end on max_new_tokens and free their blocks in the same step."""
    with batchkit.ContinuousDecodeLoop(GatedStep(), _cache(), max_num_seqs=4) as loop:
        for n in range(1, 6):
            assert loop.submit([1, 2, 3], max_new_tokens=n).result(WAIT) == [0] * n
            s = loop.statistics().scheduler
            assert (s.kv_usage, s.running, s.finished) == (0.0, 0, n)


def test_cancelling_a_submit_future_aborts_the_request_and_frees_its_blocks() -> None:
    step = GatedStep()
    with batchkit.ContinuousDecodeLoop(step, _cache(), max_num_seqs=4) as loop:
        step.go.clear()
        step.stepped.clear()
        doomed = loop.submit([1, 2, 3, 4, 5], max_new_tokens=1000)
        assert step.stepped.wait(WAIT)  # running: its blocks are held
        assert loop.statistics().scheduler.kv_usage > 0
        assert doomed.cancel()
        step.go.set()
        assert loop.submit([9], max_new_tokens=2).result(WAIT) == [0, 0]  # the loop serves on
        s = loop.statistics().scheduler
        assert (s.aborted, s.running, s.kv_usage) == (1, 0, 0.0)


def test_leaving_a_sync_stream_early_aborts_the_request_and_frees_its_blocks() -> None:
    with batchkit.ContinuousDecodeLoop(GatedStep(), _cache(), max_num_seqs=4) as loop:
        for token in loop.generate_sync([1, 2], max_new_tokens=1000):
            assert token == 0
            break  # leaving the stream: the generator is closed as it goes
        assert loop.submit([9], max_new_tokens=2).result(WAIT) == [0, 0]
        s = loop.statistics().scheduler
        assert (s.aborted, s.running, s.kv_usage) == (1, 0, 0.0)


def test_a_closed_loop_refuses_new_requests_with_batcher_closed() -> None:
    """After close(), submit() raises on the call and generate_sync() on its first iteration."""
    loop = batchkit.ContinuousDecodeLoop(GatedStep(), _cache(), max_num_seqs=4)
    assert loop.submit([1], max_new_tokens=2).result(WAIT) == [0, 0]
    loop.close()
    with pytest.raises(batchkit.BatcherClosed):
        loop.submit([1], max_new_tokens=1)
    stream = loop.generate_sync([1], max_new_tokens=1)
    with pytest.raises(batchkit.BatcherClosed):
        next(stream)


def test_statistics_report_what_the_page_lists() -> None:
    """TTFT, TPOT, queue wait, tokens/s, running / waiting / swapped counts, KV usage,
    preemptions, steps and step times."""
    with batchkit.ContinuousDecodeLoop(GatedStep(), _cache(), max_num_seqs=4) as loop:
        futures = [loop.submit([1, 2, 3], max_new_tokens=4) for _ in range(3)]
        assert [f.result(WAIT) for f in futures] == [[0] * 4] * 3
        stats = loop.statistics()
    s = stats.scheduler
    assert (s.running, s.waiting, s.swapped, s.preemptions, s.finished) == (0, 0, 0, 0, 3)
    assert s.generated_tokens == 12
    assert s.ttft is not None
    assert s.ttft.count == 3
    assert s.tpot is not None
    assert s.tpot.count > 0
    assert s.queue_wait is not None
    assert s.queue_wait.count == 3
    assert s.kv_usage == 0.0
    assert stats.steps >= 4
    assert stats.step_time is not None
    assert stats.step_time.count == stats.steps
    assert stats.tokens_per_s > 0

"""The engine never leaves callers waiting: a cancel racing a result, or a fault of the loop itself.

A ``submit()`` future cancelled by its caller between the engine's check and its ``set_result``
must not kill the engine thread; and if the engine does end on an error of its own, every request
it held ends with ``BatcherClosed`` and new ones are refused.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import batchkit  # noqa: E402
from batchkit import BatcherClosed  # noqa: E402


def _zeros(batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
    return torch.zeros(len(batch.sample_indices), 8)


def _cache() -> batchkit.PagedKVCache:
    return batchkit.PagedKVCache(num_layers=1, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=4)


def test_a_future_cancelled_while_its_result_is_set_does_not_stop_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    set_result = concurrent.futures.Future.set_result

    def cancelled_first(fut: concurrent.futures.Future[Any], result: Any) -> None:
        fut.cancel()  # the caller's cancel lands just after the engine checked done()
        set_result(fut, result)

    with batchkit.ContinuousDecodeLoop(_zeros, _cache()) as loop:
        monkeypatch.setattr(concurrent.futures.Future, "set_result", cancelled_first)
        first = loop.submit([1, 2], max_new_tokens=1)
        with pytest.raises(concurrent.futures.CancelledError):
            first.result(timeout=30)
        monkeypatch.undo()
        assert loop.submit([1, 2], max_new_tokens=1).result(timeout=30) == [0]


class Fatal(BaseException):
    """Not an Exception: a step's failure that the loop does not catch."""


def test_an_engine_that_fails_ends_every_request_and_refuses_new_ones() -> None:
    started = threading.Event()

    def step(batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
        started.set()
        raise Fatal("the engine cannot go on")

    loop = batchkit.ContinuousDecodeLoop(step, _cache(), engine="caller", max_num_seqs=1)
    running = loop.submit([1, 2], max_new_tokens=4)
    waiting = loop.submit([3, 4], max_new_tokens=4)  # max_num_seqs=1: still waiting when it fails
    with pytest.raises(Fatal):
        loop.run_engine()
    assert started.is_set()
    for fut in (running, waiting):
        with pytest.raises(BatcherClosed, match="engine failed") as info:
            fut.result(timeout=30)
        assert isinstance(info.value.__cause__, Fatal)
    with pytest.raises(BatcherClosed):
        loop.submit([1], max_new_tokens=1)
    loop.close()

"""The inbox's close machinery: close() ends every request it leaves behind, whoever was to run
the engine, and a closed loop refuses new requests with BatcherClosed."""

from __future__ import annotations

import pytest
from _continuous_steps import WAIT, GatedStep, small_cache, tiny_llama

import batchkit
from batchkit import BatcherClosed, ContinuousDecodeLoop

torch = pytest.importorskip("torch")


def test_close_ends_requests_of_a_caller_engine_that_never_ran() -> None:
    """close() aborts what is left: with engine="caller" and no run_engine(), submitted requests
    end with BatcherClosed instead of waiting for ever."""
    model = tiny_llama()
    loop = ContinuousDecodeLoop(model, model.make_cache(num_blocks=16, block_size=4), engine="caller")
    futures = [loop.submit([1, 2, 3], max_new_tokens=4), loop.submit([4, 5], max_new_tokens=2)]
    loop.close(timeout=WAIT)
    for fut in futures:
        with pytest.raises(BatcherClosed):
            fut.result(timeout=WAIT)
    with pytest.raises(BatcherClosed):
        loop.submit([1], max_new_tokens=1)


def test_close_of_a_loop_driven_by_step_once_aborts_what_is_left_and_frees_its_blocks() -> None:
    """api.md: close() aborts what is left, freeing its blocks and counting it aborted; also on a
    loop that only step_once() drove (requests added with scheduler.add kept running, held
    their blocks, and step_once() went on stepping them after close)."""
    from batchkit.continuous import Request, SamplingParams

    model = tiny_llama()
    loop = ContinuousDecodeLoop(model, model.make_cache(64, 4), max_num_seqs=2)
    for i in range(4):  # two run, two wait
        loop.scheduler.add(Request(i, [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=50, ignore_eos=True)))
    for _ in range(3):
        loop.step_once()
    assert loop.statistics().scheduler.kv_usage > 0
    loop.close()
    stats = loop.statistics().scheduler
    assert (stats.running, stats.waiting, stats.swapped, stats.aborted) == (0, 0, 0, 4)
    assert stats.kv_usage == 0
    with pytest.raises(BatcherClosed):
        loop.step_once()


def test_a_closed_loop_refuses_new_requests_with_batcher_closed() -> None:
    """After close(), submit() raises on the call and generate_sync() on its first iteration."""
    loop = batchkit.ContinuousDecodeLoop(GatedStep(), small_cache(), max_num_seqs=4)
    assert loop.submit([1], max_new_tokens=2).result(WAIT) == [0, 0]
    loop.close()
    with pytest.raises(batchkit.BatcherClosed):
        loop.submit([1], max_new_tokens=1)
    stream = loop.generate_sync([1], max_new_tokens=1)
    with pytest.raises(batchkit.BatcherClosed):
        next(stream)

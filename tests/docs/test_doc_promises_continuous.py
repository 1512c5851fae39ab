"""docs/continuous.md and docs/api.md promises of ContinuousDecodeLoop: close() ends every request
it leaves behind, and a request no step could run is refused at submit, not inside a shared step."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import batchkit
from batchkit import BatcherClosed, ContinuousDecodeLoop, PagedKVCache

torch = pytest.importorskip("torch")

WAIT = 30


def _tiny_llama() -> Any:
    from batchkit.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    return LlamaModel(cfg)


def test_close_ends_requests_of_a_caller_engine_that_never_ran() -> None:
    """close() aborts what is left: with engine="caller" and no run_engine(), submitted requests
    end with BatcherClosed instead of waiting for ever."""
    model = _tiny_llama()
    loop = ContinuousDecodeLoop(model, model.make_cache(num_blocks=16, block_size=4), engine="caller")
    futures = [loop.submit([1, 2, 3], max_new_tokens=4), loop.submit([4, 5], max_new_tokens=2)]
    loop.close(timeout=WAIT)
    for fut in futures:
        with pytest.raises(BatcherClosed):
            fut.result(timeout=WAIT)
    with pytest.raises(BatcherClosed):
        loop.submit([1], max_new_tokens=1)


def test_an_out_of_vocabulary_prompt_is_refused_at_submit_and_fails_no_other_request() -> None:
    """A token id past the model's vocabulary is a ValueError at submit: it never reaches a step,
    where its failure would fail every request batched with it."""
    model = _tiny_llama()
    loop = ContinuousDecodeLoop(model, model.make_cache(num_blocks=16, block_size=4), engine="caller")
    good = loop.submit([1, 2], max_new_tokens=3)
    with pytest.raises(ValueError, match="vocab"):
        loop.submit([64], max_new_tokens=3)
    with pytest.raises(ValueError, match=">= 0"):
        loop.submit([-1], max_new_tokens=3)
    with pytest.raises(ValueError, match="vocab"):
        next(loop.generate_sync([1, 1000], max_new_tokens=3))
    runner = threading.Thread(target=loop.run_engine)
    runner.start()
    try:
        assert len(good.result(timeout=WAIT)) == 3
    finally:
        loop.close(timeout=WAIT)
        runner.join(WAIT)


@pytest.mark.parametrize("prompt", ["123", b"12", [1.0, 2.0], [True]])
def test_a_prompt_that_is_not_token_ids_is_a_type_error(prompt: Any) -> None:
    kv = PagedKVCache(1, 16, 4, 1, 4)
    loop = ContinuousDecodeLoop(lambda batch, kv: None, kv, engine="caller")
    with pytest.raises(TypeError, match="prompt_ids"):
        loop.submit(prompt, max_new_tokens=2)
    loop.close()


def test_token_ids_may_be_numpy_or_torch_integers() -> None:
    model = _tiny_llama()
    with batchkit.ContinuousDecodeLoop(model, model.make_cache(num_blocks=16, block_size=4)) as loop:
        a = loop.submit(np.array([1, 2]), max_new_tokens=2)  # type: ignore[arg-type]
        b = loop.submit(torch.tensor([1, 2]), max_new_tokens=2)
        assert a.result(timeout=WAIT) == b.result(timeout=WAIT)


@pytest.mark.parametrize("priority", ["a", None, 1.5, True])
def test_a_priority_that_is_not_an_int_is_a_type_error_at_submit(priority: Any) -> None:
    """As for BoundedQueue: a priority is an int, checked when the request is made."""
    kv = PagedKVCache(1, 16, 4, 1, 4)
    loop = ContinuousDecodeLoop(lambda batch, kv: None, kv, engine="caller")
    with pytest.raises(TypeError, match="priority"):
        loop.submit([1], max_new_tokens=2, priority=priority)
    loop.close()


@pytest.mark.parametrize("sampled", [[], [7, 8]])
def test_scheduler_update_refuses_a_wrong_number_of_tokens_and_changes_nothing(sampled: list[int]) -> None:
    """update(step, sampled) takes one token per request that samples: another count is a
    ValueError (not a StopIteration escaping into the caller's loop), and the step can be applied
    afterwards with the right tokens."""
    from batchkit.continuous import Request

    sched = batchkit.Scheduler(batchkit.PagedKVAllocator(num_blocks=16, block_size=4))
    sched.add(Request("r1", [1, 2, 3], batchkit.SamplingParams(max_new_tokens=2)))
    step = sched.schedule()
    with pytest.raises(ValueError, match="one sampled token per sequence"):
        sched.update(step, sampled)
    request = sched.get("r1")
    assert request is not None
    assert request.num_computed == 0
    events = sched.update(step, [7])
    assert [(e.request_id, e.token) for e in events] == [("r1", 7)]


class _EchoStep:
    """A fake model: the next token is (last input token + 1) % 50."""

    def __call__(self, batch: batchkit.StepBatch, kv: PagedKVCache) -> Any:
        last = batch.input_ids[batch.sample_indices]
        return torch.nn.functional.one_hot((last + 1) % 50, 50).to(torch.float32)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_set_batch_limit_holds_from_the_next_step_on_and_loses_nothing(mode: str) -> None:
    """set_batch_limit(size): at most size requests run from the next step on, also when more are
    running already (the worst are preempted, and finish later with the same tokens)."""
    from batchkit.continuous import Request

    kv = PagedKVCache(1, 64, 4, 1, 4)
    loop = ContinuousDecodeLoop(
        _EchoStep(),
        kv,
        max_num_seqs=8,
        engine="caller",
        preemption_mode=mode,  # type: ignore[arg-type]
        num_cpu_blocks=64 if mode == "swap" else 0,
    )
    for i in range(8):
        loop.scheduler.add(Request(i, [i + 1], batchkit.SamplingParams(max_new_tokens=6)))
    step, _ = loop.step_once()
    assert len(step.requests) == 8
    loop.set_batch_limit(2)
    outputs: dict[Any, list[int]] = {}
    for _ in range(200):
        step, events = loop.step_once()
        assert len(step.requests) <= 2
        for ev in events:
            if ev.finished:
                request = loop.scheduler.get(ev.request_id)
                assert request is None
        for req in step.requests:
            if req.status.name == "FINISHED":
                outputs[req.request_id] = list(req.output)
        if not loop.scheduler.has_work():
            break
    assert sorted(outputs) == list(range(8))
    for i in range(8):
        assert outputs[i] == [(i + 1 + k) % 50 for k in range(1, 7)]
    loop.close()


def test_a_cancelled_submit_future_counts_as_done_for_wait_and_as_completed() -> None:
    """api.md: cancelling a ``submit`` future aborts the request; the future is then done for
    ``concurrent.futures.wait()`` and ``as_completed()`` too (it stayed "not done" for them: they
    hung), and the loop's other requests carry on."""
    import concurrent.futures

    model = _tiny_llama()
    loop = ContinuousDecodeLoop(model, model.make_cache(64, 16), max_num_seqs=4)
    try:
        doomed = loop.submit([1, 2, 3], max_new_tokens=500, ignore_eos=True)
        kept = loop.submit([4, 5], max_new_tokens=3, ignore_eos=True)
        assert doomed.cancel()
        done, not_done = concurrent.futures.wait([doomed], timeout=30)
        assert done == {doomed}
        assert not not_done
        assert list(concurrent.futures.as_completed([doomed], timeout=30)) == [doomed]
        assert len(kept.result(timeout=60)) == 3
    finally:
        loop.close()
    assert loop.statistics().scheduler.aborted == 1


def test_close_of_a_loop_driven_by_step_once_aborts_what_is_left_and_frees_its_blocks() -> None:
    """api.md: close() aborts what is left, freeing its blocks and counting it aborted; also on a
    loop that only step_once() drove (requests added with scheduler.add kept running, held
    their blocks, and step_once() went on stepping them after close)."""
    from batchkit.continuous import Request, SamplingParams

    model = _tiny_llama()
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

"""The one submit path (``Submitter``): a request no step could run is refused at submit, not
inside a shared step; a ``submit`` future, cancelled, aborts its request."""

from __future__ import annotations

import threading
from typing import Any, cast

import numpy as np
import pytest
from _continuous_steps import WAIT, GatedStep, small_cache, tiny_llama

import batchkit
from _support import one_layer_cache as _cache
from _support import zeros_step as _zeros
from batchkit import ContinuousDecodeLoop, PagedKVCache

torch = pytest.importorskip("torch")


def test_an_out_of_vocabulary_prompt_is_refused_at_submit_and_fails_no_other_request() -> None:
    """A token id past the model's vocabulary is a ValueError at submit: it never reaches a step,
    where its failure would fail every request batched with it."""
    model = tiny_llama()
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
    model = tiny_llama()
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


def test_a_cancelled_submit_future_counts_as_done_for_wait_and_as_completed() -> None:
    """api.md: cancelling a ``submit`` future aborts the request; the future is then done for
    ``concurrent.futures.wait()`` and ``as_completed()`` too (it stayed "not done" for them: they
    hung), and the loop's other requests carry on."""
    import concurrent.futures

    model = tiny_llama()
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


def test_cancelling_a_submit_future_aborts_the_request_and_frees_its_blocks() -> None:
    step = GatedStep()
    with batchkit.ContinuousDecodeLoop(step, small_cache(), max_num_seqs=4) as loop:
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


# --------------------------------------------------------------------------- docs/api.md: what submit() refuses


def test_a_seed_no_generator_takes_is_refused_by_the_submit_call() -> None:
    """ "a sampling value no step could use (ValueError / TypeError); submit() raises on the
    call": a seed torch cannot take does not reach the engine thread."""
    with batchkit.ContinuousDecodeLoop(_zeros, _cache()) as loop:
        with pytest.raises(ValueError, match="seed"):
            loop.submit([1], max_new_tokens=2, temperature=1.0, seed=2**70)
        assert len(loop.submit([1], max_new_tokens=2, temperature=1.0, seed=2**63).result(WAIT)) == 2


@pytest.mark.parametrize("prompt", [None, 5, "tensor"])
def test_a_prompt_that_is_not_a_sequence_is_a_type_error_naming_prompt_ids(prompt: Any) -> None:
    """prompt_ids are token ids: None, one bare id or a 0-d tensor is refused at submit with a
    TypeError naming prompt_ids (it was "'NoneType' object is not iterable")."""
    if prompt == "tensor":
        prompt = torch.tensor(5)
    with batchkit.ContinuousDecodeLoop(_zeros, _cache()) as loop:
        with pytest.raises(TypeError, match="prompt_ids"):
            loop.submit(prompt)
        assert loop.submit(cast(Any, torch.tensor([1, 2])), max_new_tokens=2).result(WAIT) == [0, 0]


def test_an_unhashable_tenant_is_a_type_error_naming_tenant() -> None:
    """tenant= names whose quota a request counts against: a list is refused at submit with a
    TypeError that names tenant (it was Python's bare "unhashable type: 'list'")."""
    with batchkit.ContinuousDecodeLoop(_zeros, _cache(), tenant_quotas={"a": 4}) as loop:
        with pytest.raises(TypeError, match="tenant"):
            loop.submit([1], tenant=cast(Any, ["a"]))
        assert loop.submit([1], max_new_tokens=1, tenant="a").result(WAIT) == [0]

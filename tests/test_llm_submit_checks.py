"""What a request is refused for at submit, and how priorities take a seat or KV room.

A value that could only fail inside a step (the sampler, the stop check) would fail every request
batched into that step, so each one is refused on the call; and a better-priority request takes
the place of a worse running one, as docs/continuous.md says, but only when that lets it in.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import batchkit  # noqa: E402
from batchkit import KVCacheExhausted, PagedKVAllocator, SamplingParams, Scheduler  # noqa: E402
from batchkit.continuous import Request  # noqa: E402


def _zeros(batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
    return torch.zeros(len(batch.sample_indices), 16)


@pytest.fixture
def loop() -> Iterator[batchkit.ContinuousDecodeLoop]:
    kv = batchkit.PagedKVCache(num_layers=1, num_blocks=9, block_size=4, num_kv_heads=1, head_dim=4)
    # engine="caller" and no engine: nothing is stepped, so each check is about the call itself.
    lp = batchkit.ContinuousDecodeLoop(_zeros, kv, engine="caller", tenant_quotas={"small": 2})
    yield lp
    lp.close()


@pytest.mark.parametrize(
    ("sampling", "error"),
    [
        ({"temperature": math.nan}, ValueError),
        ({"temperature": math.inf}, ValueError),
        ({"temperature": "0.7"}, ValueError),
        ({"top_k": 2.5}, ValueError),
        ({"top_k": True}, ValueError),
        ({"top_p": math.nan}, ValueError),
        ({"seed": "x"}, TypeError),
        ({"seed": 1.5}, TypeError),
        ({"stop_token_ids": 5}, TypeError),
        ({"stop_token_ids": [1.0]}, TypeError),
        ({"eos_token_id": "2"}, TypeError),
    ],
)
def test_a_sampling_value_no_step_could_use_is_refused_at_submit(
    loop: batchkit.ContinuousDecodeLoop, sampling: dict[str, Any], error: type[Exception]
) -> None:
    name = next(iter(sampling))
    with pytest.raises(error, match=name):
        loop.submit([1, 2], max_new_tokens=2, **sampling)
    assert loop.queue_depth() == 0


@pytest.mark.parametrize("stop", [[""], [1], ["ok", None]])
def test_stop_must_be_non_empty_strings(stop: list[Any]) -> None:
    with pytest.raises(ValueError, match="stop must be non-empty strings"):
        SamplingParams(stop=tuple(stop))


def test_numpy_numbers_are_accepted_as_plain_ones() -> None:
    np = pytest.importorskip("numpy")
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.int32(4), stop_token_ids=np.array([7]))
    assert (p.top_k, p.seed, p.stop_token_ids) == (3, 4, (7,))
    assert type(p.top_k) is int
    assert type(p.seed) is int


def test_a_prompt_that_can_never_fit_is_refused_by_the_submit_call(loop: batchkit.ContinuousDecodeLoop) -> None:
    # 8 usable blocks of 4 tokens: a 32-token prompt plus its first token needs 9.
    with pytest.raises(KVCacheExhausted, match="32-token prompt needs 9 KV blocks"):
        loop.submit(list(range(32)), max_new_tokens=1)
    with pytest.raises(KVCacheExhausted, match="quota"):
        loop.submit(list(range(8)), max_new_tokens=1, tenant="small")
    loop.submit(list(range(31)), max_new_tokens=1)  # fits: accepted
    assert loop.queue_depth() == 1


def test_generate_refuses_it_on_its_first_iteration(loop: batchkit.ContinuousDecodeLoop) -> None:
    stream = loop.generate_sync(list(range(32)), max_new_tokens=1)
    with pytest.raises(KVCacheExhausted):
        next(stream)


def _params(n: int = 50) -> SamplingParams:
    return SamplingParams(max_new_tokens=n)


def _step(s: Scheduler) -> None:
    step = s.schedule()
    s.update(step, [1] * sum(step.samples))


def test_a_better_priority_request_takes_the_seat_of_a_worse_running_one() -> None:
    s = Scheduler(PagedKVAllocator(num_blocks=64, block_size=4), max_num_seqs=1)
    s.add(Request("low", [1, 2, 3], _params(), priority=5))
    _step(s)
    s.add(Request("high", [1, 2, 3], _params(3), priority=0))
    _step(s)
    assert [r.request_id for r in s.running] == ["high"]
    assert [r.request_id for r in s.waiting] == ["low"]
    assert s.statistics().preemptions == 1
    # An equal priority never preempts: it waits its turn.
    s.add(Request("same", [1, 2, 3], _params(3), priority=0))
    _step(s)
    assert [r.request_id for r in s.running] == ["high"]


def test_no_one_is_preempted_for_a_request_held_back_by_its_own_tenant_quota() -> None:
    a = PagedKVAllocator(num_blocks=17, block_size=4, tenant_quotas={"A": 4})
    s = Scheduler(a, max_num_seqs=8)
    s.add(Request("a1", list(range(15)), _params(), priority=0, tenant="A"))  # 4 blocks: A's whole quota
    s.add(Request("b1", list(range(12)), _params(), priority=5, tenant="B"))
    s.add(Request("b2", list(range(12)), _params(), priority=5, tenant="B"))
    _step(s)
    s.add(Request("a2", [1, 2, 3], _params(5), priority=0, tenant="A"))
    _step(s)
    assert {r.request_id for r in s.running} == {"a1", "b1", "b2"}
    assert [r.request_id for r in s.waiting] == ["a2"]
    assert s.statistics().preemptions == 0


@pytest.mark.parametrize(
    "limits",
    [
        {"max_num_seqs": 2.5},
        {"max_num_seqs": True},
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 64.0},
        {"max_num_batched_tokens": -1},
    ],
)
def test_the_loop_limits_are_ints(limits: dict[str, Any]) -> None:
    name = next(iter(limits))
    with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
        Scheduler(PagedKVAllocator(num_blocks=8, block_size=4), **limits)

"""StepRunner: one scheduled step on the model, answered as a StepOutput; a row that cannot
sample fails its own request there, as data, and the scheduler is left to the loop."""

from __future__ import annotations

from typing import Any

import pytest

from batchkit import PagedKVAllocator, PagedKVCache, SamplingParams, Scheduler
from batchkit.continuous import Request, StepBatch
from batchkit.continuous.runner import StepRunner, mask_bad_rows
from batchkit.testing import MockClock

torch = pytest.importorskip("torch")

VOCAB = 8


def runner_and_scheduler(step: Any) -> tuple[StepRunner, Scheduler]:
    kv = PagedKVCache(1, 16, 4, 1, 4)
    allocator = PagedKVAllocator(kv.num_blocks, kv.block_size)
    clock = MockClock()
    return StepRunner(step, kv, None, allocator, clock), Scheduler(allocator, clock=clock)


def next_token(batch: StepBatch, kv: Any) -> Any:
    """A fake model: the next token is the last input token + 1."""
    last = batch.input_ids[batch.sample_indices]
    return torch.nn.functional.one_hot((last + 1) % VOCAB, VOCAB).to(torch.float32)


def test_run_answers_a_token_per_sampling_request() -> None:
    """Each request that samples gets the token its row of logits picks, in step order; nothing
    fails, and the scheduler's requests are untouched until the loop updates them."""
    runner, sched = runner_and_scheduler(next_token)
    sched.add(Request("a", [1, 2], SamplingParams(max_new_tokens=2)))
    sched.add(Request("b", [5], SamplingParams(max_new_tokens=2)))
    step = sched.schedule()
    out = runner.run(step)
    assert out.tokens == [3, 6]
    assert out.failed == {}
    assert out.logprobs is None
    assert [r.output for r in step.requests] == [[], []]


def test_a_row_no_token_can_be_drawn_from_fails_its_request_alone() -> None:
    """A NaN row is reported in failed with FloatingPointError; its neighbour samples as usual."""

    def nan_for_b(batch: StepBatch, kv: Any) -> Any:
        logits = next_token(batch, kv)
        logits[batch.seq_ids.index("b")] = float("nan")
        return logits

    runner, sched = runner_and_scheduler(nan_for_b)
    sched.add(Request("a", [1], SamplingParams(max_new_tokens=2)))
    sched.add(Request("b", [4], SamplingParams(max_new_tokens=2)))
    out = runner.run(sched.schedule())
    assert out.tokens[0] == 2
    assert list(out.failed) == ["b"]
    assert isinstance(out.failed["b"], FloatingPointError)


def test_mask_bad_rows_zeroes_nan_and_all_minus_inf_rows() -> None:
    """Rows holding a NaN or only -inf become zeros and are named; other rows are unchanged."""
    logits = torch.tensor([[0.0, 1.0], [float("nan"), 1.0], [float("-inf"), float("-inf")]])
    masked, bad = mask_bad_rows(logits)
    assert bad == [1, 2]
    assert torch.equal(masked, torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))

"""Logprobs from the continuous loop: generated tokens' and prompt tokens', from the raw logits."""

from __future__ import annotations

from typing import Any

import pytest

from batchkit import ContinuousDecodeLoop, PagedKVCache, SamplingParams

torch = pytest.importorskip("torch")

WAIT = 30


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "3"])
def test_a_logprobs_count_outside_0_to_20_or_not_an_int_is_refused(field: str, value: object) -> None:
    """SamplingParams checks both counts at submit: an int in [0, 20] or None."""
    with pytest.raises(ValueError, match=rf"{field} must be an int in \[0, 20\]"):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


VOCAB = 40


class TableStep:
    """A fake model: the logits after token t are row t of a fixed random table; records batches."""

    def __init__(self) -> None:
        self.table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0))
        self.batches: list[Any] = []

    def __call__(self, batch: Any, kv: Any) -> Any:
        self.batches.append(batch)
        return self.table[batch.input_ids[batch.sample_indices]]

    def expected(self, context_token: int, token: int) -> float:
        return float(torch.log_softmax(self.table[context_token], -1)[token])


def make_loop(step: Any, **kw: Any) -> ContinuousDecodeLoop:
    kv = PagedKVCache(1, 64, 4, 1, 4)
    return ContinuousDecodeLoop(step, kv, **kw)


def test_generated_tokens_carry_their_raw_logprob_and_the_top_k() -> None:
    """Each item is the sampled token with log_softmax of the raw logits (not the tempered
    ones), and the k most likely tokens, most likely first; the sampled token's logprob is its
    top entry's exact value when it is the most likely token."""
    step = TableStep()
    with make_loop(step) as loop:
        greedy = loop.submit_logprobs([3], max_new_tokens=4, logprobs=5).result(timeout=WAIT)
        hot = loop.submit_logprobs([3], max_new_tokens=4, logprobs=2, temperature=0.7, seed=1).result(timeout=WAIT)
    context = 3
    for item in greedy:
        assert not item.prompt
        assert item.logprob == item.top_logprobs[0][1]
        assert item.token == item.top_logprobs[0][0]
        assert item.logprob == pytest.approx(step.expected(context, item.token), abs=1e-6)
        assert len(item.top_logprobs) == 5
        values = [v for _, v in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        context = item.token
    context = 3
    for item in hot:
        assert item.logprob == pytest.approx(step.expected(context, item.token), abs=1e-6)
        assert len(item.top_logprobs) == 2
        context = item.token


def test_the_logprobs_calls_with_logprobs_none_give_each_tokens_own_logprob() -> None:
    """logprobs=None passed to the logprobs calls means their default, 0 (each token's own
    logprob, no alternatives), not an item without a logprob (NaN)."""
    step = TableStep()
    with make_loop(step) as loop:
        items = loop.submit_logprobs([3], max_new_tokens=3, logprobs=None).result(timeout=WAIT)
        synced = list(loop.generate_logprobs_sync([3], max_new_tokens=3, logprobs=None))
    assert [i.token for i in items] == [i.token for i in synced]
    context = 3
    for item in items:
        assert item.logprob == pytest.approx(step.expected(context, item.token), abs=1e-6)
        assert not item.top_logprobs
        context = item.token


def test_prompt_logprobs_cover_every_prompt_token_after_the_first_across_chunks_and_cached_prefixes() -> None:
    """With prompt_logprobs, the stream starts with one entry per prompt token after the first,
    each predicted from the token before it, though the prompt is prefilled in several chunks;
    a second request with the same prompt gets them all too (it bypasses the prefix cache)."""
    step = TableStep()
    prompt = [5, 9, 1, 7, 7, 2, 30, 11, 4, 8, 6]
    with make_loop(step, max_num_batched_tokens=4, enable_prefix_caching=True) as loop:
        first = list(loop.generate_logprobs_sync(prompt, max_new_tokens=2, prompt_logprobs=3))
        second = list(loop.generate_logprobs_sync(prompt, max_new_tokens=2, prompt_logprobs=1))
        hits = loop.allocator.statistics()
    for items, k in ((first, 3), (second, 1)):
        prompt_items = [i for i in items if i.prompt]
        assert [i.token for i in prompt_items] == prompt[1:]
        for pos, item in enumerate(prompt_items, start=1):
            assert item.logprob == pytest.approx(step.expected(prompt[pos - 1], prompt[pos]), abs=1e-6)
            assert len(item.top_logprobs) == k
        assert len(items) == len(prompt) - 1 + 2
    assert [i.token for i in first] == [i.token for i in second]
    assert hits.prefix_hit_rate == 0


def test_requests_without_logprobs_get_logits_only_at_their_sampling_rows() -> None:
    """A step whose requests ask for no prompt logprobs hands the model exactly the sampling
    rows (no sample_rows); one beside a prompt-logprobs request gets its row among the others."""
    step = TableStep()
    with make_loop(step) as loop:
        loop.submit([1, 2, 3], max_new_tokens=2).result(timeout=WAIT)
        plain = list(step.batches)
        loop.submit_logprobs([1, 2, 3], max_new_tokens=1, prompt_logprobs=0).result(timeout=WAIT)
    assert all(b.sample_rows is None and len(b.sample_indices) == sum(b.sampling) for b in plain)
    mixed = step.batches[len(plain)]
    assert mixed.sample_indices.tolist() == [0, 1, 2]
    assert mixed.sample_rows.tolist() == [2]


@pytest.mark.anyio
async def test_generate_logprobs_streams_items_to_a_task() -> None:
    """The async form streams the same items as the sync one."""
    step = TableStep()
    with make_loop(step) as loop:
        items = [i async for i in loop.generate_logprobs([3, 4], max_new_tokens=3, logprobs=1)]
        same = list(loop.generate_logprobs_sync([3, 4], max_new_tokens=3, logprobs=1))
    assert items == same
    assert [len(i.top_logprobs) for i in items] == [1, 1, 1]

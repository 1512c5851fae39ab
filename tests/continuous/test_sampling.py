"""Logit rows the sampler must survive: +inf, all -inf, and a tiny temperature.

A row no token can be drawn from fails its own request only; a row that a valid request makes
extreme (+inf logits, a temperature that overflows the division) still samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import batchkit  # noqa: E402
from batchkit import SamplingParams  # noqa: E402
from batchkit.continuous import Request, TokenEvent, sample  # noqa: E402

VOCAB = 16


def _loop(first_row: Callable[[Any], None]) -> batchkit.ContinuousDecodeLoop:
    """A loop whose step returns zeros, with ``first_row`` applied to the first sampling row."""

    def step(batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
        out = torch.zeros(len(batch.sample_indices), VOCAB)
        first_row(out[0])
        return out

    kv = batchkit.PagedKVCache(num_layers=1, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=4)
    return batchkit.ContinuousDecodeLoop(step, kv, engine="caller")


def _one_step(loop: batchkit.ContinuousDecodeLoop, **sampling: Any) -> dict[Any, TokenEvent]:
    for rid in ("a", "b"):
        loop.scheduler.add(Request(rid, [1, 2], SamplingParams(max_new_tokens=2, seed=1, **sampling)))
    _, events = loop.step_once()
    return {e.request_id: e for e in events}


def _set_inf(row: Any) -> None:
    row[3] = math.inf


def _all_neg_inf(row: Any) -> None:
    row.fill_(-math.inf)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_inf_logit_is_a_certainty_and_the_neighbour_goes_on(temperature: float) -> None:
    events = _one_step(_loop(_set_inf), temperature=temperature)
    assert events["a"].token == 3
    assert events["a"].error is None
    assert events["b"].error is None
    assert events["b"].token is not None


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_of_only_minus_inf_fails_its_own_request_alone(temperature: float) -> None:
    loop = _loop(_all_neg_inf)
    events = _one_step(loop, temperature=temperature)
    assert isinstance(events["a"].error, FloatingPointError)
    assert events["a"].finish_reason == "error"
    assert events["b"].error is None
    assert events["b"].token is not None
    assert loop.scheduler.get("a") is None
    assert loop.scheduler.get("b") is not None


@pytest.mark.parametrize("temperature", [1e-37, 1e-45, 1e-46, 5e-324])  # the last two are 0 in float32
@pytest.mark.parametrize("sampling", [{}, {"top_p": 0.5}, {"top_k": 2}])
def test_a_tiny_temperature_samples_like_greedy(sampling: dict[str, Any], temperature: float) -> None:
    logits = torch.tensor([[-5.0, -3.0, -4.0], [2.0, 1.0, 9.0]])
    params = [SamplingParams(temperature=temperature, **sampling)] * 2
    gens = [torch.Generator().manual_seed(0) for _ in range(2)]
    assert sample(logits, params, gens) == [1, 2]


def test_a_temperature_that_is_zero_in_float32_fails_no_request_of_its_step() -> None:
    """1e-46 divided the logits by zero (NaN) and failed every request of its step, its
    neighbours' too: it samples greedily."""
    loop = _loop(lambda row: row.__setitem__(5, 1.0))
    loop.scheduler.add(Request("tiny", [1, 2], SamplingParams(max_new_tokens=2, temperature=1e-46)))
    loop.scheduler.add(Request("other", [1, 2], SamplingParams(max_new_tokens=2, temperature=0.7, seed=1)))
    _, events = loop.step_once()
    by_id = {e.request_id: e for e in events}
    assert (by_id["tiny"].token, by_id["tiny"].error) == (5, None)
    assert by_id["other"].error is None


def test_a_detokenize_hook_that_fails_on_one_output_fails_that_request_alone() -> None:
    def detokenize(ids: Any) -> str:
        if 13 in ids:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "not text")
        return " ".join(map(str, ids))

    def step(batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
        out = torch.zeros(len(batch.sample_indices), VOCAB)
        out[0, 13] = 1.0  # the first request samples 13, which the hook cannot decode
        out[1:, 2] = 1.0
        return out

    kv = batchkit.PagedKVCache(num_layers=1, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=4)
    loop = batchkit.ContinuousDecodeLoop(step, kv, engine="caller", detokenize=detokenize)
    for rid in ("a", "b"):
        loop.scheduler.add(Request(rid, [1, 2], SamplingParams(max_new_tokens=3, stop=("x",))))
    _, events = loop.step_once()
    by_id = {e.request_id: e for e in events}
    assert isinstance(by_id["a"].error, UnicodeDecodeError)
    assert by_id["a"].finished
    assert by_id["b"].token == 2
    assert by_id["b"].error is None
    assert loop.scheduler.get("a") is None
    assert loop.allocator.statistics().num_seqs == 1


def _draws(logits: Any, params: list[SamplingParams]) -> list[int]:
    gens = [torch.Generator().manual_seed(i) for i in range(len(params))]
    return sample(logits, params, gens)


class TestOneCheckPerStep:
    """sample()'s +inf check and max shift run once per step over every row: one host read of a flag
    per step, not one per sampled row (on a GPU each is a device sync), and draws unchanged."""

    def test_sample_reads_one_flag_per_step_not_per_row(self, monkeypatch: pytest.MonkeyPatch) -> None:
        n = 16
        logits = torch.randn(n, 50, generator=torch.Generator().manual_seed(0))
        params = [SamplingParams(temperature=0.7)] * n
        reads = 0
        original = torch.Tensor.__bool__

        def counting_bool(self: Any) -> bool:
            nonlocal reads
            reads += 1
            return bool(original(self))

        monkeypatch.setattr(torch.Tensor, "__bool__", counting_bool)
        _draws(logits, params)
        assert reads <= 1

    def test_sample_keeps_certainties_and_tiny_temperatures(self) -> None:
        logits = torch.zeros(3, 6)
        logits[0, 4] = float("inf")  # a certainty
        logits[1, 2] = 1.0  # with a tiny temperature: greedy-like
        logits[2] = torch.arange(6, dtype=torch.float32)
        params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1e-30), SamplingParams(temperature=0)]
        assert _draws(logits, params) == [4, 2, 5]


class TestBadRowsAreFoundWithOneReduction:
    """The decode loop finds the rows no token can be drawn from (a NaN, every logit -inf) with one
    reduction over the step's logits, not with element-wise passes over all of them (each a full
    [num_sampling, vocab] pass per step), and still fails exactly those rows' requests."""

    def test_broken_rows_fail_alone_without_elementwise_passes(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def step(batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
            out = torch.zeros(len(batch.sample_indices), VOCAB)
            out[:, 3] = 5.0
            out[0, 0] = float("nan")
            out[1] = float("-inf")
            return out

        kv = batchkit.PagedKVCache(num_layers=1, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=4)
        loop = batchkit.ContinuousDecodeLoop(step, kv, engine="caller")
        for rid in ("a", "b", "c"):
            loop.scheduler.add(Request(rid, [1, 2], SamplingParams(max_new_tokens=2, temperature=0.5, seed=1)))
        shapes: list[tuple[int, ...]] = []
        for name in ("isnan", "isneginf", "isposinf"):
            original = getattr(torch, name)

            def spy(x: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                shapes.append(tuple(x.shape))
                return _original(x, *args, **kwargs)

            monkeypatch.setattr(torch, name, spy)
        _, events = loop.step_once()
        by_id = {e.request_id: e for e in events}
        assert isinstance(by_id["a"].error, FloatingPointError)
        assert isinstance(by_id["b"].error, FloatingPointError)
        assert by_id["c"].error is None
        assert by_id["c"].token == 3
        assert all(VOCAB not in s for s in shapes), shapes  # never an element-wise pass over [rows, vocab]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_takes_each_rows_first_best_logit(dtype: str) -> None:
    """Greedy rows take the first of tied best logits, in every dtype, whether every row is
    greedy (one reduction for all) or only some are (row by row)."""
    logits = torch.zeros(3, 10, dtype=getattr(torch, dtype))
    logits[0, [2, 7]] = 1.0
    logits[1, [9, 4]] = 2.0
    logits[2, 5] = -1.0  # the rest tie at 0: the first one wins
    greedy = SamplingParams(temperature=0)
    assert sample(logits, [greedy] * 3, [None] * 3) == [2, 4, 0]
    hot = SamplingParams(temperature=1.0, seed=1)
    mixed = sample(logits, [greedy, hot, greedy], [None, torch.Generator().manual_seed(1), None])
    assert (mixed[0], mixed[2]) == (2, 0)


def test_a_row_whose_sampling_raises_fails_its_own_request_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler raising on one request's row (any cause: the tiny temperature was one) fails
    that request with the error; the step's other requests go on (they all failed)."""
    import batchkit.continuous.runner as runner_module

    real = sample

    def faulty(logits: Any, params: Any, generators: Any) -> list[int]:
        if any(p.top_k == 3 for p in params):  # the marked request's row
            raise RuntimeError("the sampler cannot draw this row")
        return real(logits, params, generators)

    monkeypatch.setattr(runner_module, "sample", faulty)
    loop = _loop(lambda row: row.__setitem__(5, 1.0))
    loop.scheduler.add(Request("good", [1, 2], SamplingParams(max_new_tokens=2)))  # the first row: 5 is best
    loop.scheduler.add(Request("bad", [1, 2], SamplingParams(max_new_tokens=2, temperature=0.7, top_k=3, seed=1)))
    _, events = loop.step_once()
    by_id = {e.request_id: e for e in events}
    assert isinstance(by_id["bad"].error, RuntimeError)
    assert by_id["bad"].finished
    assert (by_id["good"].token, by_id["good"].error) == (5, None)
    assert loop.scheduler.get("bad") is None
    assert loop.scheduler.get("good") is not None


# --------------------------------------------------------------------------- docs/api.md: SamplingParams and sample()


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"ignore_eos": "no"}, TypeError, "ignore_eos"),
        ({"ignore_eos": 1}, TypeError, "ignore_eos"),
        ({"ignore_eos": None}, TypeError, "ignore_eos"),
        ({"stop": None}, ValueError, "stop"),
        ({"stop": 3}, ValueError, "stop"),
        ({"stop_token_ids": None}, TypeError, "stop_token_ids"),
        ({"seed": 2**64}, ValueError, "seed"),
        ({"seed": -(2**63) - 1}, ValueError, "seed"),
    ],
)
def test_every_sampling_field_is_checked_on_construction(
    kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    """ "Every field is checked on construction", each error naming its field: ignore_eos must be
    a bool (the string "no" would otherwise mean yes), stop and stop_token_ids sequences, and the
    seed within what a torch generator takes."""
    with pytest.raises(error, match=name):
        batchkit.SamplingParams(**kwargs)


def test_numpy_bools_and_the_seed_range_ends_are_accepted() -> None:
    assert batchkit.SamplingParams(ignore_eos=cast(Any, np.bool_(True))).ignore_eos is True
    assert batchkit.SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert batchkit.SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_sample_needs_one_params_and_one_generator_per_row() -> None:
    """sample(logits, params, generators): one token per row under each row's SamplingParams; a
    params list of another length is a ValueError (all-greedy rows gave a token for every row,
    whatever the lists held)."""
    from batchkit.continuous import sample

    greedy = batchkit.SamplingParams()
    assert sample(torch.zeros(2, 5), [greedy, greedy], [None, None]) == [0, 0]
    for params, gens in (([greedy], [None, None]), ([greedy, greedy], [None])):
        with pytest.raises(ValueError, match="per row"):
            sample(torch.zeros(2, 5), params, gens)

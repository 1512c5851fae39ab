"""batchkit.serve, the request fields docs/serving.md lists: each takes its documented values and
refuses others; sampling (temperature, logit_bias, penalties, n, seeds), stop strings, roles and
content parts, fields batchkit does not implement, include_usage, default_max_tokens, token-id
prompts, embeddings as floats and base64, the batchkit headers, a client leaving a plain request.

The promises of docs/serving.md's "request fields" part.
"""

from __future__ import annotations

import base64
import json
import re
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _serve_app_support import CHAT, EMBED, HI, _metrics, _post, httpx, openai
from _serve_app_support import needs_model_packages as needs_models

from _support import LiveServer
from _support import wait_until as _wait_until

pytestmark = [pytest.mark.timeout(600), needs_models]

WAIT_S = 120.0
DEFAULT_MAX_TOKENS = 5


@pytest.fixture(scope="module")
def live(models: tuple[Any, Any]) -> Iterator[LiveServer]:
    """The server of this module: a default_max_tokens of its own, which a test checks."""
    from batchkit.serve import create_app

    lm, encoder = models
    app = create_app(lm, embedding_model=encoder, num_blocks=256, max_num_seqs=4, default_max_tokens=DEFAULT_MAX_TOKENS)
    with LiveServer(app) as server:
        yield server


def test_temperature_defaults_to_1_as_openai(live: LiveServer) -> None:
    """ "`temperature` (default 1, as OpenAI)": a seeded request without it samples exactly as the
    same request with temperature 1, not greedily."""
    body = {"model": CHAT, "prompt": "Once upon a time", "max_tokens": 12, "seed": 11, "ignore_eos": True}
    texts = [
        _post(f"{live.url}/v1/completions", {**body, **extra}).json()["choices"][0]["text"]
        for extra in ({}, {"temperature": 1}, {"temperature": 0})
    ]
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


def test_logit_bias_forces_a_token_streamed_or_not(client: Any, models: tuple[Any, Any]) -> None:
    """ "`logit_bias` ... added to those logits before sampling": +100 on one token makes it every
    greedy choice, through the openai client, streamed or not; the logprobs stay the raw ones."""
    lm, _ = models
    (banana,) = lm.encode(" banana")
    kwargs: dict[str, Any] = {"model": CHAT, "messages": HI, "max_tokens": 3, "temperature": 0}
    r = client.chat.completions.create(**kwargs, logit_bias={str(banana): 100}, logprobs=True)
    assert r.choices[0].message.content == " banana banana banana"
    assert all(t.logprob < -1.0 for t in r.choices[0].logprobs.content), "raw logprobs, not the biased ones"
    chunks = client.chat.completions.create(**kwargs, logit_bias={str(banana): 100}, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " banana banana banana"


def test_penalties_change_what_a_repeating_greedy_request_writes(client: Any) -> None:
    """ "`frequency_penalty` (-2 to 2) ... `repetition_penalty` (> 0)": a prompt the model answers
    by repeating itself is answered otherwise under each; the neutral values answer as no field."""
    kwargs: dict[str, Any] = {"model": CHAT, "prompt": "1, 1, 1, 1, 1, 1, 1, 1,", "max_tokens": 12, "temperature": 0}
    plain = client.completions.create(**kwargs).choices[0].text
    assert plain.startswith(" 1, 1, 1"), plain
    for extra in ({"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 1.5}}):
        assert client.completions.create(**kwargs, **extra).choices[0].text != plain, extra
    neutral = {"frequency_penalty": 0, "presence_penalty": 0, "extra_body": {"repetition_penalty": 1, "min_p": 0}}
    assert client.completions.create(**kwargs, **neutral).choices[0].text == plain


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("frequency_penalty", "1"),
        ("repetition_penalty", 0),
        ("min_p", 1.5),
        ("logit_bias", [1, 2]),
        ("logit_bias", {"banana": 1}),
        ("logit_bias", {"-1": 1}),
        ("logit_bias", {"15": 101}),
        ("logit_bias", {"15": True}),
        ("logit_bias", {"49152": 1}),  # SmolLM2's vocabulary holds 49152 tokens: ids 0 to 49151
    ],
)
def test_a_bad_penalty_or_bias_is_a_bad_request_naming_it(live: LiveServer, field: str, value: Any) -> None:
    """ "Bad values ... 400 `invalid_value` naming the field", a token id past the vocabulary too."""
    for path, body in (
        ("/v1/chat/completions", {"model": CHAT, "messages": HI, "max_tokens": 1}),
        ("/v1/completions", {"model": CHAT, "prompt": "Hi", "max_tokens": 1}),
    ):
        r = _post(f"{live.url}{path}", {**body, field: value})
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_value", field)


def test_n_samples_are_the_requests_seeded_seed_plus_j(client: Any) -> None:
    """ "`n` ... sample `j` is seeded `seed + j`; `usage` counts each prompt once": chat with
    n=3 answers three choices by index, each the text of the same request with n=1 and seed
    7 + j, and the usage counts the prompt once."""
    kwargs: dict[str, Any] = {"model": CHAT, "messages": HI, "max_tokens": 8, "temperature": 1.0}
    r = client.chat.completions.create(**kwargs, n=3, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(**kwargs, seed=7 + j) for j in range(3)]
    assert [c.message.content for c in r.choices] == [s.choices[0].message.content for s in singles]
    assert len({c.message.content for c in r.choices}) > 1, "the seeds were meant to differ"
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_n_with_several_prompts_orders_choices_prompt_by_prompt(client: Any) -> None:
    """On /v1/completions "choice `i * n + j` is prompt `i`'s sample `j`", streamed or not."""
    kwargs: dict[str, Any] = {"model": CHAT, "max_tokens": 6, "temperature": 1.0, "seed": 3}
    prompts = ["Once upon a time", "The capital of France is"]
    r = client.completions.create(**kwargs, prompt=prompts, n=2)
    want = [
        client.completions.create(**{**kwargs, "seed": 3 + j}, prompt=p).choices[0].text
        for p in prompts
        for j in (0, 1)
    ]
    assert [(c.index, c.text) for c in r.choices] == list(enumerate(want))
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(**kwargs, prompt=prompts, n=2, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == want


def test_n_streamed_chat_gives_each_choice_its_role_text_and_finish(client: Any) -> None:
    kwargs: dict[str, Any] = {"model": CHAT, "messages": HI, "max_tokens": 5, "temperature": 1.0, "seed": 11}
    plain = client.chat.completions.create(**kwargs, n=2)
    texts, roles, finishes = ["", ""], [None, None], [None, None]
    for chunk in client.chat.completions.create(**kwargs, n=2, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles[c.index] = roles[c.index] or c.delta.role
            finishes[c.index] = finishes[c.index] or c.finish_reason
    assert texts == [c.message.content for c in plain.choices]
    assert roles == ["assistant", "assistant"]
    assert finishes == [c.finish_reason for c in plain.choices]


# For each field of serving.md's field table: a value it takes and one it refuses (None: no
# value is refused by type or range alone). The chat route unless the table says completions.
FIELD_VALUES: dict[str, tuple[Any, Any]] = {
    "model": (CHAT, 7),
    "messages": (HI, []),
    "prompt": ("Hi", [[1], 2.5]),
    "stream": (False, "yes"),
    "stream_options.include_usage": (None, None),  # only with stream: checked in its own tests
    "logprobs": (True, 3),  # chat: a boolean
    "top_logprobs": (None, 21),
    "echo": (True, "no"),
    "temperature": (0.5, 2.5),
    "top_p": (0.5, 0),
    "top_k": (5, -2),
    "stop_token_ids": ([2], [-1]),
    "min_tokens": (2, 3),  # more than the max_tokens (2) of the request
    "include_stop_str_in_output": (True, "x"),
    "min_p": (0.1, 1.5),
    "seed": (3, 2**64),
    "presence_penalty": (1.0, 2.5),
    "frequency_penalty": (-1.0, -2.5),
    "repetition_penalty": (1.1, 0),
    "logit_bias": ({"15": 1}, {"15": 200}),
    "stop": (["."], 5),
    "n": (2, 0),
    "max_tokens / max_completion_tokens": (2, 0),
    "ignore_eos": (True, "x"),
}


def _field_table() -> list[str]:
    text = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    table = text.split("The fields of the two generation routes", 1)[1].split("\n\n", 2)[1]
    names = []
    for row in table.splitlines()[2:]:
        cell = row.split("|")[1]
        names.append(" / ".join(re.findall(r"`([^`]+)`", cell)))
    return names


def test_the_field_table_lists_each_field_the_tests_know() -> None:
    assert _field_table() == list(FIELD_VALUES), "serving.md's field table and FIELD_VALUES disagree"


@pytest.mark.parametrize("field", [f for f, (ok, bad) in FIELD_VALUES.items() if ok is not None or bad is not None])
def test_each_documented_field_takes_its_values_and_refuses_others(live: LiveServer, field: str) -> None:
    """serving.md's field table: a documented value is answered 200; a value outside the
    limits is 400 naming the field (invalid_value)."""
    ok, bad = FIELD_VALUES[field]
    name = field.split(" / ")[0]
    completions = name in ("prompt", "echo")
    path = "/v1/completions" if completions else "/v1/chat/completions"
    body: dict[str, Any] = {"model": CHAT, "max_tokens": 2, "temperature": 0}
    body |= {"prompt": "Hi"} if completions else {"messages": HI}
    if ok is not None:
        r = _post(f"{live.url}{path}", {**body, name: ok})
        assert r.status_code == 200, r.text
    if bad is not None:
        r = _post(f"{live.url}{path}", {**body, name: bad})
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_value", name), r.text


def test_up_to_4_stop_strings(live: LiveServer) -> None:
    """ "`stop` (up to 4 strings)": four are taken, a fifth is 400 naming `stop`."""
    url = f"{live.url}/v1/chat/completions"
    body = {"model": CHAT, "messages": HI, "max_tokens": 2, "temperature": 0}
    assert _post(url, {**body, "stop": ["a", "b", "c", "d"]}).status_code == 200
    r = _post(url, {**body, "stop": ["a", "b", "c", "d", "e"]})
    assert r.status_code == 400
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == ("stop", "invalid_value")


def test_every_documented_role_and_text_content_parts_are_taken(client: Any) -> None:
    """Roles `system`, `developer`, `user`, `assistant` are accepted, and so is text content as
    OpenAI's list of text parts; an image part is 400 naming the message (a `tool` message answers
    a tool call, which this server never makes: tests/serve refuses it)."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Answer in English."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": [{"type": "text", "text": "What is 6 times 7?"}]},
    ]
    r = client.chat.completions.create(model=CHAT, messages=messages, max_tokens=2, temperature=0)
    assert r.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=CHAT,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}],
            max_tokens=2,
        )
    assert (err.value.code, err.value.param) == ("invalid_value", "messages[0].content")


UNSUPPORTED = [
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "tool_choice", "required"),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "modalities", ["text", "audio"]),
    ("/v1/chat/completions", "web_search_options", {}),
    ("/v1/completions", "best_of", 2),
    ("/v1/completions", "suffix", "!"),
    ("/v1/embeddings", "dimensions", 8),
]


@pytest.mark.parametrize(("path", "field", "value"), UNSUPPORTED)
def test_an_unimplemented_openai_field_is_refused_naming_it(
    live: LiveServer, path: str, field: str, value: Any
) -> None:
    """ "Fields OpenAI defines that batchkit does not implement ... are refused with 400
    `unsupported_parameter` naming the field ... never silently ignored"."""
    if path == "/v1/embeddings":
        body: dict[str, Any] = {"model": EMBED, "input": "hello"}
    elif path == "/v1/completions":
        body = {"model": CHAT, "prompt": "Hi", "max_tokens": 1}
    else:
        body = {"model": CHAT, "messages": HI, "max_tokens": 1}
    r = _post(f"{live.url}{path}", {**body, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("unsupported_parameter", field)
    assert field in err["message"]


def test_neutral_values_and_fields_openai_does_not_define_are_accepted(live: LiveServer) -> None:
    """The neutral value of each unimplemented field is accepted (`tools: []`, `tool_choice`
    "none"/"auto", `response_format: {"type": "text"}`...), and a field OpenAI does not define is
    ignored, as OpenAI does."""
    chat = {
        "model": CHAT,
        "messages": HI,
        "max_tokens": 1,
        "logprobs": False,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "n": 1,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "logit_bias": {},
        "modalities": ["text"],
        "not_an_openai_field": {"anything": [1, 2]},
    }
    r = _post(f"{live.url}/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert _post(f"{live.url}/v1/chat/completions", {**chat, "tool_choice": "auto"}).status_code == 200
    completion = {"model": CHAT, "prompt": "Hi", "max_tokens": 1, "echo": False, "best_of": 1, "suffix": None}
    r = _post(f"{live.url}/v1/completions", {**completion, "logprobs": None, "extension_of_mine": 1})
    assert r.status_code == 200, r.text
    r = _post(f"{live.url}/v1/embeddings", {"model": EMBED, "input": "hi", "dimensions": None, "user": "me"})
    assert r.status_code == 200, r.text


def test_include_usage_sends_a_final_chunk_with_empty_choices_and_the_usage(client: Any) -> None:
    """ "with `stream_options: {"include_usage": true}`, a final chunk with empty `choices` and the
    usage, as OpenAI sends it": the chunks before it carry no usage, the one before it the
    finish_reason."""
    chunks = list(
        client.chat.completions.create(
            model=CHAT,
            messages=HI,
            max_tokens=3,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 3
    assert last.usage.total_tokens == last.usage.prompt_tokens + 3
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


def test_without_max_tokens_a_request_generates_default_max_tokens(live: LiveServer) -> None:
    """ "Without `max_tokens` a request may generate `--default-max-tokens`" (here the app's
    `default_max_tokens=5`); finish_reason is then `length`."""
    for path, body in (
        ("/v1/completions", {"model": CHAT, "prompt": "Once upon a time"}),
        ("/v1/chat/completions", {"model": CHAT, "messages": HI}),
    ):
        r = _post(f"{live.url}{path}", {**body, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == DEFAULT_MAX_TOKENS
        assert r.json()["choices"][0]["finish_reason"] == "length"


def test_a_completion_prompt_may_be_a_list_of_token_ids(live: LiveServer, models: tuple[Any, Any]) -> None:
    """ "`prompt`: one string or one list of token ids": the ids are the prompt, as counted in usage."""
    lm, _ = models
    ids = lm.encode("The capital of France is")
    body = {"model": CHAT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    by_ids = _post(f"{live.url}/v1/completions", {**body, "prompt": ids}).json()
    by_text = _post(f"{live.url}/v1/completions", {**body, "prompt": "The capital of France is"}).json()
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]


def test_embeddings_as_float_and_base64_are_the_same_vectors(live: LiveServer) -> None:
    """`encoding_format` `float` or `base64` (little-endian float32, as OpenAI): the same
    vectors; another format is 400; another model name is 404 `model_not_found`."""
    url = f"{live.url}/v1/embeddings"
    floats = _post(url, {"model": EMBED, "input": ["hello", "world"], "encoding_format": "float"}).json()
    packed = _post(url, {"model": EMBED, "input": ["hello", "world"], "encoding_format": "base64"}).json()
    for f, b in zip(floats["data"], packed["data"], strict=True):
        raw = base64.b64decode(b["embedding"])
        decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert len(decoded) == len(f["embedding"]) == 384
        assert max(abs(x - y) for x, y in zip(decoded, f["embedding"], strict=True)) < 1e-6
    r = _post(url, {"model": EMBED, "input": "hello", "encoding_format": "int8"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "encoding_format")
    r = _post(url, {"model": "text-embedding-3-small", "input": "hello"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")


def test_a_known_route_with_another_method_is_405_with_an_openai_body(live: LiveServer) -> None:
    """405 `method_not_allowed` for a known route with another method, each route."""
    for method, path in (("GET", "/v1/embeddings"), ("GET", "/v1/completions"), ("POST", "/v1/models")):
        r = httpx.request(method, f"{live.url}{path}", timeout=30)
        assert r.status_code == 405, (method, path)
        assert r.json()["error"]["code"] == "method_not_allowed"


def test_bad_batchkit_headers_are_400_invalid_header(live: LiveServer) -> None:
    """ "a bad `X-Batchkit-*` header" is 400 with code `invalid_header`."""
    body = {"model": CHAT, "prompt": "Hi", "max_tokens": 1}
    for headers in ({"X-Batchkit-Priority": "1.5"}, {"X-Batchkit-Tenant": "t" * 500}):
        r = _post(f"{live.url}/v1/completions", body, headers=headers)
        assert r.status_code == 400, headers
        assert r.json()["error"]["code"] == "invalid_header"


def test_a_client_leaving_a_non_streamed_request_aborts_it_and_frees_its_blocks(live: LiveServer) -> None:
    """ "A client that disconnects aborts its request at once, streaming or not": a plain request
    whose connection closes mid-generation is aborted, its KV blocks freed, and it is counted
    with status 499."""
    loop = live.state.loop

    def count(name: str, *labels: tuple[str, str]) -> float:
        return _metrics(live.url).get((name, tuple(sorted(labels))), 0.0)

    left = count("batchkit_http_requests_total", ("route", "completions"), ("status", "499"))
    aborted = loop.statistics().scheduler.aborted
    body = json.dumps({"model": CHAT, "prompt": "Count:", "max_tokens": 3000, "ignore_eos": True}).encode()
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        _wait_until(
            lambda: loop.statistics().scheduler.generated_tokens > 0 and loop.statistics().scheduler.running == 1,
            "the request to decode",
        )
    _wait_until(lambda: loop.statistics().scheduler.aborted == aborted + 1, "the request to be aborted")
    _wait_until(lambda: loop.allocator.statistics().used_blocks == 0, "its KV blocks to be freed")
    _wait_until(
        lambda: count("batchkit_http_requests_total", ("route", "completions"), ("status", "499")) == left + 1,
        "the request to be counted 499",
    )

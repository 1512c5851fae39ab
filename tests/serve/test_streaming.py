"""batchkit.serve, streamed answers (Server-Sent Events): their text equals the unstreamed one, a
client that leaves frees its KV blocks and is counted 499, streams flow while a long prompt is
tokenized.

The fixtures are tests/_serve_fixtures.py's.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from typing import Any

import pytest
from _serve_app_support import (
    BIG,
    CHAT,
    DEADLINE_S,
    QUESTION,
    WAIT_S,
    _metrics,
    _stand_in_lm,
    _StandInTokenizer,
    _SteppedModel,
    httpx,
    needs_models,
)

from _support import LiveServer
from _support import wait_until as _wait_until

pytestmark = pytest.mark.timeout(600)


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

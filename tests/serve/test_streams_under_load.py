"""batchkit.serve, streams under real clients: a slow reader, many streams at once, a pool too small
for them all (preemption), include_usage, stop strings never sent.

The promises of docs/serving.md's "streams" part.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from typing import Any

import pytest
from _serve_app_support import CHAT, QUESTION, _events, _idle, _metric, _metrics, _stream_text, httpx
from _serve_app_support import needs_model_packages as needs_models

from _support import LiveServer
from _support import wait_until as _wait_until

pytestmark = [pytest.mark.timeout(600), needs_models]

WAIT_S = 120.0


def test_a_slow_reader_gets_the_whole_stream(live: LiveServer) -> None:
    """A client that reads nothing until the generation has finished on the server still gets
    every piece of text, the finish chunk and ``[DONE]``: the same text as the non-streamed
    answer."""
    body = {"model": CHAT, "prompt": "The three primary colours are", "max_tokens": 12, "temperature": 0}
    want = httpx.post(f"{live.url}/v1/completions", json=body, timeout=WAIT_S).json()
    _wait_until(lambda: _idle(live.url), "the server to be idle")
    finished = _metric(live.url, "batchkit_decode_requests_finished_total", loop="chat")
    with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}, timeout=WAIT_S) as r:
        assert r.status_code == 200
        _wait_until(
            lambda: _metric(live.url, "batchkit_decode_requests_finished_total", loop="chat") == finished + 1,
            "the generation to finish before the client reads",
        )
        events = list(_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    assert _stream_text(events) == want["choices"][0]["text"]
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == want["choices"][0]["finish_reason"]
    assert last["usage"] == want["usage"]


def test_many_concurrent_streams_each_get_their_own_whole_answer(live: LiveServer) -> None:
    """Twelve streams at once on four seats (the rest wait their turn): each ends with ``[DONE]``
    and carries the text and usage the same request gets alone."""
    prompts = [f"Write the number {i} in words:" for i in range(12)]
    alone = {
        p: httpx.post(
            f"{live.url}/v1/completions",
            json={"model": CHAT, "prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
            timeout=WAIT_S,
        ).json()
        for p in prompts[:3]
    }
    barrier = threading.Barrier(len(prompts))

    def stream(prompt: str) -> list[str]:
        body = {"model": CHAT, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        barrier.wait(timeout=WAIT_S)
        with httpx.stream("POST", f"{live.url}/v1/completions", json={**body, "stream": True}, timeout=WAIT_S) as r:
            assert r.status_code == 200, r.read()
            return list(_events(r.iter_lines()))

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        results = dict(zip(prompts, pool.map(stream, prompts), strict=True))
    for prompt, events in results.items():
        assert events[-1] == "[DONE]", prompt
        last = json.loads(events[-2])
        assert last["usage"]["completion_tokens"] == 4
        assert last["choices"][0]["finish_reason"] == "length"
        if prompt in alone:
            assert _stream_text(events) == alone[prompt]["choices"][0]["text"]
            assert last["usage"] == alone[prompt]["usage"]
    _wait_until(lambda: _idle(live.url), "every stream's blocks to be freed")


def test_streams_on_a_pool_too_small_for_them_all_are_preempted_and_clients_may_still_leave(
    models: tuple[Any, Any],
) -> None:
    """Four streams whose answers need twice the KV pool: requests are preempted and resume
    (`batchkit_decode_preemptions_total` moves); the two read to the end get every token and
    `[DONE]`, the two whose clients leave midway are aborted, wherever they were, and in the end
    no block, sequence or request is left."""
    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=9, block_size=16, max_num_seqs=4, warmup=False)
    body = {"model": CHAT, "prompt": "Count:", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    barrier = threading.Barrier(4)
    with LiveServer(app) as server:
        url = f"{server.url}/v1/completions"

        def stream(leave_after: int | None) -> list[str]:
            barrier.wait(timeout=WAIT_S)
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=WAIT_S) as r:
                assert r.status_code == 200, r.read()
                events = []
                for event in _events(r.iter_lines()):
                    events.append(event)
                    if leave_after is not None and len(events) == leave_after:
                        break
                return events

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(stream, [None, 20, None, 35]))
        _wait_until(lambda: _idle(server.url), "every block to be freed")
        m = _metrics(server.url)
        assert m[("batchkit_decode_preemptions_total", (("loop", "chat"),))] > 0
        assert m[("batchkit_decode_requests_swapped", (("loop", "chat"),))] == 0
        assert m[("batchkit_kv_sequences", (("pool", "chat"),))] == 0
        assert m[("batchkit_decode_requests_finished_total", (("loop", "chat"),))] == 2
        assert m[("batchkit_decode_requests_aborted_total", (("loop", "chat"),))] == 2
        for events in (results[0], results[2]):
            assert events[-1] == "[DONE]"
            last = json.loads(events[-2])
            assert (last["usage"]["completion_tokens"], last["choices"][0]["finish_reason"]) == (60, "length")
        _wait_until(
            lambda: _metric(server.url, "batchkit_http_requests_total", route="completions", status="499") == 2,
            "the two streams left to be counted 499",
        )
        assert _metric(server.url, "batchkit_http_requests_total", route="completions", status="200") == 2


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_include_usage_counts_what_the_plain_answer_counts(client: Any, route: str) -> None:
    """`stream_options.include_usage`'s final usage is the usage of the same greedy request not
    streamed (with a stop string, too), and the streamed text is the plain text."""
    for stop in (None, ["Paris"]):
        if route == "chat":
            kwargs: dict[str, Any] = {"model": CHAT, "messages": QUESTION, "max_tokens": 16, "temperature": 0}
            plain = client.chat.completions.create(**kwargs, stop=stop)
            chunks = list(
                client.chat.completions.create(**kwargs, stop=stop, stream=True, stream_options={"include_usage": True})
            )
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            want = plain.choices[0].message.content
        else:
            kwargs = {"model": CHAT, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
            plain = client.completions.create(**kwargs, stop=stop)
            chunks = list(
                client.completions.create(**kwargs, stop=stop, stream=True, stream_options={"include_usage": True})
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            want = plain.choices[0].text
        assert text == want
        assert chunks[-1].choices == []
        assert chunks[-1].usage.model_dump() == plain.usage.model_dump()
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == [plain.choices[0].finish_reason]


def test_a_stop_string_is_never_sent_in_a_stream(live: LiveServer, client: Any) -> None:
    """ "A stop string ends the text before it; text that might be the start of a stop string is
    held back until it is not": with a stop string taken from the middle of the greedy answer,
    no chunk carries any of it, and the chunks join to the answer cut before it."""
    body = {"model": CHAT, "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}
    full = httpx.post(f"{live.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=WAIT_S).json()
    text = full["choices"][0]["text"]
    assert len(text) >= 20, text
    stop = text[len(text) // 2 : len(text) // 2 + 6]  # likely to span tokens: a piece holds its start back
    cut = text[: text.index(stop)]
    with httpx.stream(
        "POST",
        f"{live.url}/v1/completions",
        json={**body, "ignore_eos": True, "stop": [stop], "stream": True},
        timeout=WAIT_S,
    ) as r:
        events = list(_events(r.iter_lines()))
    pieces = [c["choices"][0]["text"] for c in map(json.loads, events[:-1])]
    assert "".join(pieces) == cut
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "stop"
    sent = ""
    for piece in pieces:
        sent += piece
        assert stop not in sent


def test_a_stop_string_before_an_emoji_is_not_sent(live: LiveServer) -> None:
    """Greedy SmolLM2 continues this prompt with a token holding a space and the first byte of an
    emoji: a stop string `" "` ends the request at that token, and neither the space nor a
    U+FFFD reaches the client, streamed or not (both used to get `" \\ufffd"`)."""
    body = {"model": CHAT, "prompt": "Emoji list: 😀 😃 😄", "max_tokens": 4, "temperature": 0}
    url = f"{live.url}/v1/completions"
    free = httpx.post(url, json=body, timeout=WAIT_S).json()["choices"][0]["text"]
    assert free.startswith(" \U0001f60f"), free  # the premise: a space, then an emoji
    plain = httpx.post(url, json={**body, "stop": " "}, timeout=WAIT_S).json()
    assert (plain["choices"][0]["text"], plain["choices"][0]["finish_reason"]) == ("", "stop")
    with httpx.stream("POST", url, json={**body, "stop": " ", "stream": True}, timeout=WAIT_S) as r:
        events = list(_events(r.iter_lines()))
    assert _stream_text(events) == ""
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "stop"


def test_a_stop_string_completed_by_a_token_ending_mid_character_is_not_sent() -> None:
    """A byte-level token may complete a stop string and begin a multi-byte character at once
    (``"f"`` + the first byte of ``"é"``): the loop stops the request at that token, as the
    decoded text holds the stop string, so the text must end before it there too. It used to
    wait for the character to complete, which never came, and then sent the held-back stop
    string with a U+FFFD."""
    from batchkit.serve.protocol import IncrementalDetokenizer

    pieces = {1: b"The ca", 2: b"f\xc3", 3: b"\xa9"}  # byte-level tokens: 2 and 3 split "é"
    tail = IncrementalDetokenizer(
        lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace"), ["caf"]
    )
    sent = tail.push(1) + tail.push(2)
    assert tail.stopped
    assert sent + tail.finish() == "The "

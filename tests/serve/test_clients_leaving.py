"""batchkit.serve, clients that leave, as the openai package (sync and async) and httpx do it: closing
a stream, leaving while a request waits for a seat; the async client's answers equal the sync one's.

The promises of docs/serving.md's "clients that leave" part.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from _serve_app_support import CHAT, QUESTION, _events, _idle, _metric, _used_blocks, httpx, openai
from _serve_app_support import needs_model_packages as needs_models

from _support import LiveServer
from _support import wait_until as _wait_until

pytestmark = [pytest.mark.timeout(600), needs_models]

WAIT_S = 120.0


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

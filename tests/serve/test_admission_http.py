"""batchkit.serve, admission over HTTP: 503 + Retry-After for a flood, the priority header, tenant
quotas, deadlines (504), samples (prompts times n) against max_waiting, one answer per refused
request.

The fixtures are tests/_serve_fixtures.py's.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any

import anyio
import pytest
from _serve_app_support import (
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
    openai,
)

from _support import LiveServer
from _support import wait_until as _wait_until
from batchkit._errors import DeadlineExceeded, QueueFull
from batchkit.serve.app import ModelServer
from batchkit.serve.errors import ApiError
from batchkit.serve.replies import GenerationReply

pytestmark = pytest.mark.timeout(600)


@needs_models
def test_a_prompt_longer_than_the_kv_pool_is_refused_by_the_openai_client(client: Any) -> None:
    """The openai client raises BadRequestError (400) for a prompt the KV pool can never hold."""
    long = [{"role": "user", "content": "word " * 5000}]
    with pytest.raises(openai.BadRequestError, match="KV pool"):
        client.chat.completions.create(model=CHAT, messages=long, max_tokens=1)


@needs_models
@pytest.mark.parametrize("value", ["high", "1_000", "1.0", ""])
def test_a_bad_priority_header_is_refused(live: LiveServer, value: str) -> None:
    """X-Batchkit-Priority must be an integer in ASCII digits ("1_000" passed as 1000: Python's
    int() takes underscores)."""
    body = {"model": CHAT, "messages": QUESTION, "max_tokens": 1}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, headers={"X-Batchkit-Priority": value}, timeout=30)
    assert r.status_code == 400
    assert "X-Batchkit-Priority" in r.json()["error"]["message"].replace("x-batchkit-priority", "X-Batchkit-Priority")


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

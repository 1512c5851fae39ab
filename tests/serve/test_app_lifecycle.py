"""batchkit.serve, the app's life: health and readiness, a shutdown that finishes what was accepted, a
shutdown while the model loads, plain uvicorn past its graceful timeout, a mounted app, an import
that loads no web framework.

The fixtures are tests/_serve_fixtures.py's.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import threading
from typing import Any

import anyio
import pytest
from _serve_app_support import CHAT, DEADLINE_S, EMBED, LONG_BODY, _metrics, _unloaded_app, httpx, needs_models, uvicorn

from _support import LiveServer
from _support import wait_until as _wait_until

pytestmark = pytest.mark.timeout(600)


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


def test_max_request_bytes_is_checked_when_the_app_is_made() -> None:
    """A limit that is no positive int is a ValueError naming it."""
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_request_bytes must be an int >= 1"):
            _unloaded_app(max_request_bytes=bad)

"""batchkit.serve, the limits docs/serving.md promises: a full queue refuses a stream before it starts,
a tenant's whole quota, a full embedding queue, end_grace_from_thread, and the create_app options
that match batchkit serve's flags.

The promises of docs/serving.md's "admission" part.
"""

from __future__ import annotations

import concurrent.futures
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from _serve_app_support import CHAT, EMBED, _metrics, _post, httpx
from _serve_app_support import needs_model_packages as needs_models

from _support import LiveServer
from _support import wait_until as _wait_until

pytestmark = [pytest.mark.timeout(600), needs_models]

WAIT_S = 120.0


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
    assert options - {"warmup", "freeze_heap"} == flag_options  # always on in batchkit serve
    lm, encoder = models
    values: dict[str, Any] = {
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
        "compile_step": False,
        "native_attention": False,
        "freeze_heap": False,
    }
    assert set(values) == options
    app = create_app(lm, embedding_model=encoder, **values)
    assert (app.state.batchkit.model_name, app.state.batchkit.embedding_model_name) == ("chat", "vectors")

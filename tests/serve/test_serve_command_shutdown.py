"""batchkit.serve, ``batchkit serve``'s shutdown with real clients: a stream whose client leaves during
the grace ends the wait; Ctrl-C lets streams run on, and a second one ends them with an error event.

The promises of docs/serving.md's "batchkit serve: shutdown" part.
"""

from __future__ import annotations

import concurrent.futures
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _serve_app_support import CHAT, QUESTION, _events, _free_port, _metric, _metrics, httpx, openai
from _serve_app_support import needs_model_packages as needs_models

from _support import LiveServer, wait_for_ready
from _support import wait_until as _wait_until

pytestmark = [pytest.mark.timeout(600), needs_models]

WAIT_S = 120.0


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

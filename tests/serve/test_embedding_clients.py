"""batchkit.serve, embeddings for real clients: a batch of inputs keeps its order; a client leaving
cancels what has not run.

The promises of docs/serving.md's "embeddings" part.
"""

from __future__ import annotations

import json
import math
import socket
from typing import Any

import pytest
from _serve_app_support import EMBED, _metric
from _serve_app_support import needs_model_packages as needs_models

from _support import LiveServer
from _support import wait_until as _wait_until

pytestmark = [pytest.mark.timeout(600), needs_models]

WAIT_S = 120.0


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

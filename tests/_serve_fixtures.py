"""The fixtures of the server's tests (tests/serve/): the real models, loaded once per session, and
a live server over them per module. Everything they need is imported when a test first asks for
one, so that collecting the tests needs neither the models nor the serve extra. A plugin of
tests/conftest.py, not a conftest.py of tests/serve/, because mypy checks tests/ as one tree of
modules and two ``conftest`` modules would clash."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from _support import CHAT_MODEL, EMBEDDING_MODEL, LiveServer


@pytest.fixture(scope="session")
def models() -> tuple[Any, Any]:
    """The chat model and the embedding model, loaded once for every server of the session."""
    from batchkit.models.pretrained import load_encoder, load_pretrained

    return load_pretrained(CHAT_MODEL), load_encoder(EMBEDDING_MODEL)


@pytest.fixture(scope="module")
def live(models: tuple[Any, Any]) -> Iterator[LiveServer]:
    """The server every test of this module talks to (unless it needs its own limits)."""
    from batchkit.serve import create_app

    lm, encoder = models
    app = create_app(lm, embedding_model=encoder, num_blocks=256, max_num_seqs=4, max_waiting=32)
    with LiveServer(app) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> Iterator[Any]:
    from _serve_app_support import DEADLINE_S, openai

    with openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", timeout=DEADLINE_S, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def reference(models: tuple[Any, Any]) -> Callable[[list[int], int], str]:
    """transformers' greedy text for a prompt (the same weights, read by transformers itself)."""
    import torch
    import transformers

    lm, _ = models
    hf = transformers.AutoModelForCausalLM.from_pretrained(lm.path, local_files_only=True).eval()  # type: ignore[no-untyped-call]
    cache: dict[tuple[tuple[int, ...], int], str] = {}

    def greedy(prompt: list[int], max_new_tokens: int) -> str:
        key = (tuple(prompt), max_new_tokens)
        if key not in cache:
            config = transformers.GenerationConfig(  # type: ignore[no-untyped-call]
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(lm.stop_token_ids), pad_token_id=0
            )
            with torch.inference_mode():
                out = hf.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                    generation_config=config,
                )
            cache[key] = lm.decode(out[0, len(prompt) :].tolist())
        return cache[key]

    return greedy

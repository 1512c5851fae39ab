"""batchkit.serve, chat and text completions over HTTP: their text equals transformers' greedy decode,
stop strings and vLLM's stop ids, min_tokens and seeds.

The fixtures are tests/_serve_fixtures.py's.
"""

from __future__ import annotations

from typing import Any

import pytest
from _serve_app_support import CHAT, DEADLINE_S, QUESTION, httpx, needs_models

from _support import LiveServer

pytestmark = pytest.mark.timeout(600)


@needs_models
def test_chat_equals_transformers_greedy(client: Any, models: tuple[Any, Any], reference: Any) -> None:
    """A non-streamed greedy chat answer is transformers' greedy text, ended by EOS, with exact usage."""
    lm, _ = models
    prompt = lm.chat_prompt(QUESTION)
    r = client.chat.completions.create(model=CHAT, messages=QUESTION, temperature=0, max_tokens=16)
    choice = r.choices[0]
    assert choice.message.content == reference(prompt, 16)
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert r.usage.prompt_tokens == len(prompt)
    assert 0 < r.usage.completion_tokens < 16


@needs_models
def test_completions_take_max_completion_tokens_like_chat(live: LiveServer) -> None:
    """/v1/completions takes the same sampling fields as chat: max_completion_tokens limits the
    output (it was ignored, so the request ran to --default-max-tokens)."""
    body = {"model": CHAT, "prompt": "Once upon a time", "max_completion_tokens": 3, "temperature": 0}
    r = httpx.post(f"{live.url}/v1/completions", json={**body, "ignore_eos": True}, timeout=DEADLINE_S)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["choices"][0]["finish_reason"] == "length"


@needs_models
def test_completion_with_a_stop_string_ends_before_it(client: Any, models: tuple[Any, Any], reference: Any) -> None:
    """A stop string ends the text just before it, with finish_reason 'stop', streamed or not."""
    lm, _ = models
    full = reference(lm.chat_prompt(QUESTION), 16)
    want = full[: full.index("Paris")]
    r = client.chat.completions.create(model=CHAT, messages=QUESTION, temperature=0, max_tokens=16, stop=["Paris"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, "stop")
    chunks = client.chat.completions.create(
        model=CHAT, messages=QUESTION, temperature=0, max_tokens=16, stop="Paris", stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


@needs_models
def test_vllm_stop_token_ids_and_include_stop_str_in_output(
    client: Any, models: tuple[Any, Any], reference: Any
) -> None:
    """vLLM's extensions: a stop token id ends the answer, its text left out unless
    include_stop_str_in_output (which keeps a stop string too), streamed or not."""
    lm, _ = models
    full = reference(lm.chat_prompt(QUESTION), 16)
    (paris,) = lm.encode(" Paris")  # one token, which the greedy answer holds
    cut = full.index(" Paris")
    base = {"model": CHAT, "messages": QUESTION, "temperature": 0, "max_tokens": 16}
    r = client.chat.completions.create(**base, extra_body={"stop_token_ids": [paris]})
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (full[:cut], "stop")
    assert r.usage.completion_tokens == len(lm.encode(full[:cut])) + 1  # the stop token counts
    kept = client.chat.completions.create(
        **base, extra_body={"stop_token_ids": [paris], "include_stop_str_in_output": True}
    )
    assert kept.choices[0].message.content == full[: cut + len(" Paris")]
    chunks = client.chat.completions.create(**base, stream=True, extra_body={"stop_token_ids": [paris]})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full[:cut]
    stop = client.chat.completions.create(**base, stop=["Par"], extra_body={"include_stop_str_in_output": True})
    assert stop.choices[0].message.content == full[: cut + len(" Par")]


@needs_models
def test_vllm_min_tokens_runs_past_the_eos(client: Any) -> None:
    """min_tokens: the answer does not end before that many tokens (EOS masked until then)."""
    base = {"model": CHAT, "messages": QUESTION, "temperature": 0, "max_tokens": 40}
    short = client.chat.completions.create(**base)
    assert short.choices[0].finish_reason == "stop"
    want = short.usage.completion_tokens + 4
    r = client.chat.completions.create(**base, extra_body={"min_tokens": want})
    assert r.usage.completion_tokens >= want
    assert r.choices[0].message.content.startswith(short.choices[0].message.content)


@needs_models
def test_seeded_sampling_repeats(client: Any) -> None:
    """The same seed, temperature and top_p give the same sampled text."""
    kwargs = {"model": CHAT, "messages": QUESTION, "temperature": 1.0, "top_p": 0.9, "seed": 7, "max_tokens": 8}
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first

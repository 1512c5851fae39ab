"""batchkit.serve, logprobs over HTTP: chat and completions logprobs, echoed prompts, special tokens by
name, bytes that spell the answer, logprobs of the text a stop string ends.

The fixtures are tests/_serve_fixtures.py's.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from _serve_app_support import CHAT, DEADLINE_S, QUESTION, httpx, needs_models, openai

from _support import LiveServer

pytestmark = pytest.mark.timeout(600)


def test_chat_logprobs_reach_the_openai_client_sync_async_and_streamed(client: Any, live: LiveServer) -> None:
    """Greedy chat with logprobs/top_logprobs: each token's logprob is its top entry's (greedy),
    the streamed chunks carry the same entries, and the async client reads the same."""
    import asyncio

    kwargs: dict[str, Any] = {
        "model": CHAT,
        "messages": QUESTION,
        "temperature": 0,
        "max_tokens": 6,
        "logprobs": True,
        "top_logprobs": 3,
    }
    r = client.chat.completions.create(**kwargs)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3
        assert c.logprob == c.top_logprobs[0].logprob
        assert c.bytes == list(c.token.encode())
    streamed = [
        item
        for chunk in client.chat.completions.create(**kwargs, stream=True)
        if chunk.choices
        if chunk.choices[0].logprobs
        for item in chunk.choices[0].logprobs.content
    ]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]

    async def read() -> Any:
        async with openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0) as a:
            return await a.chat.completions.create(**kwargs)

    again = asyncio.run(read()).choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in again] == [(c.token, c.logprob) for c in content]


def test_echoed_prompt_logprobs_of_several_prompts_come_back_as_choices_by_index(client: Any, live: LiveServer) -> None:
    """/v1/completions with echo, logprobs and max_tokens=0 for two prompts (a string and token
    ids): each choice holds its prompt's text and a logprob per token, the first None."""
    tokenized = httpx.post(f"{live.url}/tokenize", json={"prompt": "Paris is in France"}, timeout=DEADLINE_S).json()
    ids = tokenized["tokens"]
    assert tokenized["count"] == len(ids)
    r = client.completions.create(
        model=CHAT, prompt=["The capital of France is", ids], echo=True, logprobs=2, max_tokens=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[1].text == "Paris is in France"
    lp = r.choices[1].logprobs
    assert len(lp.tokens) == len(ids)
    assert (lp.token_logprobs[0], lp.top_logprobs[0]) == (None, None)
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert r.usage.completion_tokens == 0
    back = httpx.post(f"{live.url}/detokenize", json={"tokens": ids}, timeout=DEADLINE_S).json()
    assert back == {"prompt": "Paris is in France"}
    info = httpx.get(f"{live.url}/tokenizer_info", timeout=DEADLINE_S).json()
    assert info["eos_token"]
    assert info["chat_template"]


@needs_models
def test_special_tokens_are_spelled_by_name_in_logprobs_echo_and_detokenize(client: Any, live: LiveServer) -> None:
    """A chat-formatted prompt holds special tokens: its logprob entries spell each by name (as
    '' they overwrote each other in top_logprobs, and the chosen token's entry was lost), the
    echo of its token ids and /detokenize keep them, so /tokenize then /detokenize round-trips."""
    text = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>"
    ids = httpx.post(f"{live.url}/tokenize", json={"prompt": text}, timeout=DEADLINE_S).json()["tokens"]
    back = httpx.post(f"{live.url}/detokenize", json={"tokens": ids}, timeout=DEADLINE_S).json()
    assert back == {"prompt": text}
    r = client.completions.create(model=CHAT, prompt=ids, echo=True, logprobs=5, max_tokens=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text
    assert lp.tokens[0] == "<|im_start|>"
    assert lp.tokens[-1] == "<|im_end|>"
    assert "".join(lp.tokens) == text
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top[token] == logprob  # the chosen token's own entry, special or not
        assert len(top) >= 5


def _text_and_logprob_tokens(url: str, body: dict[str, Any]) -> tuple[str, list[str]]:
    """The answer's text and the token strings of its logprobs (chat or completions, streamed or
    not: the chunks' pieces joined)."""
    chat = "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not body.get("stream"):
        choice = httpx.post(f"{url}{path}", json=body, timeout=DEADLINE_S).json()["choices"][0]
        if chat:
            return choice["message"]["content"], [c["token"] for c in choice["logprobs"]["content"]]
        return choice["text"], choice["logprobs"]["tokens"]
    text = ""
    tokens: list[str] = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=DEADLINE_S) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                text += (choice["delta"].get("content") or "") if chat else choice["text"]
                if choice["logprobs"]:
                    lps = choice["logprobs"]
                    tokens += [c["token"] for c in lps["content"]] if chat else lps["tokens"]
    return text, tokens


@needs_models
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_with_a_stop_string_the_logprobs_are_those_of_the_returned_text(live: LiveServer, route: str) -> None:
    """A stop string that begins inside one token and ends in the next: the text ends before it,
    and the logprobs end with the token the cut splits (kept, whole); the next token, which
    completed the stop string, has none. Streamed and unstreamed alike."""
    body: dict[str, Any] = {"model": CHAT, "temperature": 0, "max_tokens": 8, "ignore_eos": True}
    if route == "chat":
        body |= {"messages": QUESTION, "logprobs": True}
    else:
        body |= {"prompt": "The capital of France is", "logprobs": 0}
    text, tokens = _text_and_logprob_tokens(live.url, body)
    # Each token's string is its text (offsets in the text are theirs), but a special token's:
    # spelled by name, left out of the text (the EOS that ignore_eos runs past).
    assert "".join(t for t in tokens if t != "<|im_end|>") == text
    starts = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    split = next(
        i
        for i in range(len(tokens) - 1)
        if len(tokens[i]) >= 2 and tokens[i + 1] and text.find(tokens[i][1:] + tokens[i + 1][0]) == starts[i] + 1
    )
    stop = tokens[split][1:] + tokens[split + 1][0]
    for stream in (False, True):
        cut = _text_and_logprob_tokens(live.url, {**body, "stop": [stop], "stream": stream})
        assert cut == (text[: starts[split] + 1], tokens[: split + 1]), (stop, stream)


@needs_models
def test_chat_logprobs_bytes_spell_the_answer_where_tokens_split_characters(live: LiveServer) -> None:
    """An answer of emojis, which SmolLM2 spells with tokens holding parts of a character: the
    tokens' ``bytes``, joined, are the answer's UTF-8 (each gave U+FFFD's bytes before)."""
    body: dict[str, Any] = {
        "model": CHAT,
        "messages": [{"role": "user", "content": "Repeat exactly: \U0001f431\U0001f436"}],
    }
    body |= {"temperature": 0, "max_tokens": 12, "logprobs": True}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=DEADLINE_S).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert any(c["token"] == "\ufffd" for c in content)  # the answer has a split character
    assert content[-1]["token"] == "<|im_end|>"  # the EOS that ended it, by name: no part of the text
    raw = bytes(b for c in content for b in c["bytes"])
    assert raw.decode(errors="replace") == r["choices"][0]["message"]["content"]


@needs_models
def test_chat_logprobs_bytes_spell_the_content_of_an_answer_that_ends_on_eos(client: Any) -> None:
    """The EOS entry that ends an answer stays, spelled by name, with empty bytes: joined, the
    entries' bytes are the content's UTF-8, streamed or not (they ended in '<|im_end|>')."""
    kwargs: dict[str, Any] = {"model": CHAT, "messages": QUESTION, "temperature": 0, "max_tokens": 32}
    kwargs |= {"logprobs": True, "top_logprobs": 2}
    r = client.chat.completions.create(**kwargs)
    assert r.choices[0].finish_reason == "stop"
    content = r.choices[0].logprobs.content
    assert (content[-1].token, content[-1].bytes) == ("<|im_end|>", [])
    assert bytes(b for c in content for b in c.bytes).decode() == r.choices[0].message.content
    text = ""
    streamed: list[Any] = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            streamed += chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else []
    assert (streamed[-1].token, streamed[-1].bytes) == ("<|im_end|>", [])
    assert bytes(b for c in streamed for b in c.bytes).decode() == text == r.choices[0].message.content

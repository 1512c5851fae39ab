"""batchkit.serve, refused fields and prompts, as the openai client sees them: unimplemented fields,
prompts past the context, a request that fills the KV pool exactly, a tenant's quota before the
stream starts; logprobs 0.

The promises of docs/serving.md's "refused fields and prompts" part.
"""

from __future__ import annotations

from typing import Any

import pytest
from _serve_app_support import BLOCK_SIZE, CHAT, NUM_BLOCKS, QUESTION, _idle, _metrics, httpx, openai
from _serve_app_support import needs_model_packages as needs_models

from _support import LiveServer
from _support import wait_until as _wait_until

pytestmark = [pytest.mark.timeout(600), needs_models]

WAIT_S = 120.0


@pytest.mark.parametrize(
    ("field", "value"),
    [("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required")],
)
def test_the_openai_client_gets_bad_request_for_an_unimplemented_field_streamed_or_not(
    client: Any, field: str, value: Any
) -> None:
    """ "refused with 400 `unsupported_parameter` naming the field", here as the openai client
    raises it, for a streamed request too (the refusal comes before any byte of a stream)."""
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=CHAT, messages=QUESTION, max_tokens=2, stream=stream, **{field: value})
        assert (err.value.status_code, err.value.code, err.value.param) == (400, "unsupported_parameter", field)


def test_logprobs_0_on_completions_returns_the_sampled_tokens_logprobs(client: Any) -> None:
    """On /v1/completions `logprobs` is a count, and 0 still asks for the sampled tokens' log
    probabilities (OpenAI: "may return up to logprobs+1 elements"): each token comes with its
    logprob and no alternatives. A field's neutral value is that value, not one equal to it in
    Python: `best_of: true` is refused, and `echo: 0` is not a boolean."""
    r = client.completions.create(model=CHAT, prompt="Hi", max_tokens=2, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == 2
    assert all(x <= 0 for x in lp.token_logprobs)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=CHAT, prompt="Hi", max_tokens=1, best_of=True)
    assert (err.value.code, err.value.param) == ("unsupported_parameter", "best_of")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=CHAT, prompt="Hi", max_tokens=1, echo=0)
    assert (err.value.code, err.value.param) == ("invalid_value", "echo")
    assert client.completions.create(model=CHAT, prompt="Hi", max_tokens=1, logprobs=None).choices[0].logprobs is None


def test_a_prompt_past_the_context_is_a_bad_request_streamed_or_not(client: Any, models: tuple[Any, Any]) -> None:
    """ "400 `context_length_exceeded`: prompt + `max_tokens` longer than the model's context, or
    than the whole KV pool": a prompt past it blames `messages` (or `prompt`), a limit that
    pushes past it blames `max_tokens`, streamed or not."""
    long_text = "word " * (NUM_BLOCKS * BLOCK_SIZE + 10)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(
                model=CHAT, messages=[{"role": "user", "content": long_text}], max_tokens=2, stream=stream
            )
        assert (err.value.code, err.value.param) == ("context_length_exceeded", "messages")
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=CHAT, prompt=long_text, max_tokens=2, stream=stream)
        assert (err.value.code, err.value.param) == ("context_length_exceeded", "prompt")
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=CHAT, messages=QUESTION, max_tokens=10**6, stream=stream)
        assert (err.value.code, err.value.param) == ("context_length_exceeded", "max_tokens")
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=CHAT, messages=QUESTION, max_completion_tokens=10**6, stream=stream)
        assert (err.value.code, err.value.param) == ("context_length_exceeded", "max_completion_tokens")


def test_a_request_that_fills_the_kv_pool_exactly_is_served(models: tuple[Any, Any]) -> None:
    """400 `context_length_exceeded` is for "prompt + `max_tokens` longer than ... the whole KV
    pool": prompt + max_tokens equal to the pool's tokens (its blocks in /metrics times 16) is
    served to the last token (it was refused: the server counted one token less), one more is
    refused naming `max_tokens`, and a prompt that fills the pool alone naming `prompt`."""
    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=5, block_size=16, warmup=False)
    prompt = lm.encode("Count from one to twenty:")
    body = {"model": CHAT, "prompt": prompt, "temperature": 0, "ignore_eos": True}
    with LiveServer(app) as server:
        blocks = [k for k in _metrics(server.url) if k[0] == "batchkit_kv_blocks"]
        pool = int(sum(_metrics(server.url)[k] for k in blocks)) * 16
        url = f"{server.url}/v1/completions"
        for total in (pool - 1, pool):
            r = httpx.post(url, json={**body, "max_tokens": total - len(prompt)}, timeout=WAIT_S)
            assert r.status_code == 200, (total, pool, r.text)
            assert r.json()["usage"] == {
                "prompt_tokens": len(prompt),
                "completion_tokens": total - len(prompt),
                "total_tokens": total,
            }
        r = httpx.post(url, json={**body, "max_tokens": pool + 1 - len(prompt)}, timeout=WAIT_S)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("context_length_exceeded", "max_tokens")
        r = httpx.post(url, json={**body, "prompt": [prompt[-1]] * pool, "max_tokens": 1}, timeout=WAIT_S)
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("context_length_exceeded", "prompt")
        _wait_until(lambda: _idle(server.url), "the pool to be free")


def test_a_request_past_its_tenants_quota_is_refused_before_its_stream_starts(models: tuple[Any, Any]) -> None:
    """ "a request that needs more than its tenant's whole quota gets 400
    (`context_length_exceeded`)": a short prompt whose `max_tokens` would outgrow the quota is
    refused up front, a JSON 400 naming `max_tokens` even when streamed (it used to start a 200
    stream and end it with that error as an event after generating up to the quota); one that
    fills the quota exactly is served, and so is one without `max_tokens`, capped by the quota."""
    from batchkit.serve import create_app

    lm, _ = models
    app = create_app(lm, num_blocks=16, block_size=16, tenant_quotas={"bulk": 2}, warmup=False)
    prompt = lm.encode("Count:")
    body = {"model": CHAT, "prompt": prompt, "temperature": 0, "ignore_eos": True}
    bulk = {"X-Batchkit-Tenant": "bulk"}
    with LiveServer(app) as server:
        url = f"{server.url}/v1/completions"
        for stream in (True, False):
            r = httpx.post(
                url, json={**body, "max_tokens": 33 - len(prompt), "stream": stream}, headers=bulk, timeout=WAIT_S
            )
            assert r.status_code == 400, r.text
            assert r.headers["content-type"].startswith("application/json")
            assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("context_length_exceeded", "max_tokens")
        r = httpx.post(url, json={**body, "max_tokens": 32 - len(prompt)}, headers=bulk, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 32 - len(prompt)
        # without max_tokens, --default-max-tokens (256) is capped by the quota too
        r = httpx.post(url, json=body, headers=bulk, timeout=WAIT_S)
        assert r.status_code == 200, r.text
        assert (r.json()["usage"]["completion_tokens"], r.json()["choices"][0]["finish_reason"]) == (
            32 - len(prompt),
            "length",
        )
        # another tenant is held to the pool only
        r = httpx.post(
            url, json={**body, "max_tokens": 33 - len(prompt)}, headers={"X-Batchkit-Tenant": "chat"}, timeout=WAIT_S
        )
        assert r.status_code == 200, r.text
        _wait_until(lambda: _idle(server.url), "the pool to be free")

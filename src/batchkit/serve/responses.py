"""The OpenAI wire format's response bodies: chat and completion responses and their streamed
chunks, usage, logprobs (:class:`TokenString`, a token's text with its bytes), embeddings. No I/O
here; :mod:`batchkit.serve.protocol` reads the requests.
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Sequence
from typing import Any

__all__ = [
    "MIN_LOGPROB",
    "TokenString",
    "TokenText",
    "chat_choice",
    "chat_chunk",
    "chat_logprobs",
    "chat_response",
    "completion_choice",
    "completion_chunk",
    "completion_logprobs",
    "completion_response",
    "embedding_response",
    "token_string",
    "usage",
]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    usage_: dict[str, int] | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    """A ``chat.completion.chunk`` of choice ``index``; ``delta`` None gives the usage-only chunk
    (no choices)."""
    choices = (
        []
        if delta is None
        else [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    )
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def chat_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "index": index,
        "message": {"role": "assistant", "content": text},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_response(rid: str, model: str, choices: list[dict[str, Any]], usage_: dict[str, int]) -> dict[str, Any]:
    """A ``chat.completion`` of ``choices`` (:func:`chat_choice`)."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_,
    }


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    choice: dict[str, Any] | None,
    usage_: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A streamed ``text_completion`` of one choice; ``choice`` None gives the usage-only chunk."""
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [] if choice is None else [choice],
        "usage": usage_,
    }


def completion_response(
    rid: str, model: str, choices: Sequence[dict[str, Any]], usage_: dict[str, int]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": list(choices),
        "usage": usage_,
    }


# A logprob of -inf is no JSON number: clamped as vLLM does.
MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


TokenText = tuple[str, float, Sequence[tuple[str, float]]]  # a token's text, logprob and top alternatives


class TokenString(str):
    """One token's text alone, carrying the bytes the token adds to a text (``raw``): a token
    that holds part of a character reads as U+FFFD but keeps its own bytes, and a special token
    reads as its name but adds none; chat logprobs' ``bytes`` give them (joined, they spell the
    text)."""

    raw: bytes

    def __new__(cls, text: str, raw: bytes) -> TokenString:
        token = super().__new__(cls, text)
        token.raw = raw
        return token


def token_string(lm: Any, cache: dict[int, TokenString], token: int) -> TokenString:
    """Token ``token``'s :class:`TokenString` from a ``PretrainedLM``, kept in ``cache`` (a
    response may name the same tokens many times). A special token is spelled by name
    (``<|im_end|>``), as vLLM and OpenAI spell them: as '' they would all be one key of a
    completions ``top_logprobs`` object, overwriting each other. Its bytes are none: an output's
    text is decoded with special tokens skipped, so it never holds one (the EOS that ends it)."""
    text = cache.get(token)
    if text is None:
        raw = lm.token_bytes(token) if lm.decode([token]) else b""
        text = cache[token] = TokenString(lm.decode([token], skip_special_tokens=False), raw)
    return text


def _utf8(text: str) -> list[int]:
    """The bytes of a token's text as OpenAI's ``bytes`` field: its own for a :class:`TokenString`."""
    return list(text.raw if isinstance(text, TokenString) else text.encode())


def chat_logprobs(entries: Sequence[TokenText]) -> dict[str, Any]:
    """OpenAI's chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    return {
        "content": [
            {
                "token": text,
                "logprob": _logprob(lp),
                "bytes": _utf8(text),
                "top_logprobs": [{"token": t, "logprob": _logprob(v), "bytes": _utf8(t)} for t, v in top],
            }
            for text, lp, top in entries
        ]
    }


def completion_logprobs(entries: Sequence[TokenText | str], text_offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``); a bare string is a token without a logprob (an echoed prompt's first).
    Each ``top_logprobs`` holds the token itself too when it is not among the alternatives (up to
    ``logprobs + 1`` entries, as OpenAI's and vLLM's)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for entry in entries:
        offsets.append(text_offset)
        if isinstance(entry, str):
            tokens.append(entry)
            token_logprobs.append(None)
            tops.append(None)
            text_offset += len(entry)
            continue
        text, lp, top = entry
        tokens.append(text)
        token_logprobs.append(_logprob(lp))
        alternatives = {t: _logprob(v) for t, v in top}
        alternatives.setdefault(text, _logprob(lp))
        tops.append(alternatives)
        text_offset += len(text)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": tops}


def embedding_response(
    model: str, vectors: Sequence[Sequence[float]], prompt_tokens: int, encoding_format: str
) -> dict[str, Any]:
    data = []
    for i, v in enumerate(vectors):
        if encoding_format == "base64":
            # OpenAI's base64 format: little-endian float32, what its clients decode with numpy.
            packed = struct.pack(f"<{len(v)}f", *v)
            embedding: Any = base64.b64encode(packed).decode("ascii")
        else:
            embedding = [float(x) for x in v]
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }

"""The OpenAI wire format: request validation. No I/O here. The response bodies are
:mod:`batchkit.serve.responses`'s and the text of an output :mod:`batchkit.serve.detokenizer`'s;
both are re-exported here, where :mod:`batchkit.jobs.openai_batch` reads the wire format whole.

Validation follows what OpenAI's API accepts for the fields batchkit implements; a field it
does not implement is refused (400) when set to something other than its neutral value, never
silently ignored. Unknown fields are ignored, as OpenAI does for fields it does not know.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..continuous.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY
from .detokenizer import IncrementalDetokenizer
from .errors import ApiError
from .responses import (
    TokenString,
    TokenText,
    chat_choice,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    completion_response,
    embedding_response,
    token_string,
    usage,
)
from .structured import ResponseFormat, parse_response_format

if TYPE_CHECKING:
    from ..continuous.grammar import Grammar

__all__ = [
    "EmbeddingRequest",
    "GenerationRequest",
    "IncrementalDetokenizer",
    "TokenString",
    "TokenText",
    "TokenizeRequest",
    "chat_choice",
    "chat_chunk",
    "chat_response",
    "chat_logprobs",
    "completion_choice",
    "completion_chunk",
    "completion_logprobs",
    "completion_response",
    "embedding_response",
    "new_id",
    "parse_body",
    "parse_chat",
    "parse_completion",
    "parse_detokenize",
    "parse_embedding",
    "parse_tokenize",
    "token_string",
    "usage",
]

MAX_STOP_STRINGS = 4
SEED_RANGE = (-(2**63), 2**64 - 1)  # what a torch generator takes
MAX_EMBEDDING_INPUTS = 2048
MAX_PROMPTS_PER_REQUEST = 64  # prompts of one /v1/completions request (--max-prompts-per-request)
MAX_N = 128  # choices per prompt (n), as OpenAI's limit
# As Hugging Face's TGI and TEI servers (--payload-limit): room for a long-context prompt or a
# full embedding request of short texts, and a bound on what one request makes the process hold.
MAX_REQUEST_BYTES = 2_000_000
# OpenAI's message roles but "tool": a tool message answers a tool call, which this server refuses.
CHAT_ROLES = ("system", "developer", "user", "assistant")
_NO_TOOL_CALLS = "it makes no tool calls: send what a call did as text in a message's 'content'"
# The message fields OpenAI defines besides role and content, none of which the chat template is
# given: each is refused unless it holds its neutral value (a response's message sent back holds
# refusal: null, tool_calls: []), as dropping it would change what the model reads; and the fix.
_UNRENDERED_MESSAGE_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "name": ((None,), "put the name in the message's 'content'"),
    "tool_calls": ((None, []), _NO_TOOL_CALLS),
    "function_call": ((None,), _NO_TOOL_CALLS),
    "tool_call_id": ((None,), _NO_TOOL_CALLS),
    "refusal": ((None,), "send the refusal as the message's 'content'"),
    "audio": ((None,), "send the transcript as the message's 'content'"),
}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------- parsing

# A str from JSON holds a surrogate code point only where the body escaped one without its pair
# (json.loads joins a pair into one character), or (json.loads decodes with "surrogatepass") where
# its UTF-8 bytes encode one: not Unicode text, and no tokenizer takes it.
_SURROGATE = re.compile("[\ud800-\udfff]")
# Where a UTF-8 body can give json.loads a surrogate: a \uD800-\uDFFF escape, or the bytes
# ED A0-BF that begin a surrogate's UTF-8 form. A body with neither holds none and is not walked.
# Two searches, not one alternation: each then starts at a literal (a fast scan, not byte by byte).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE_UTF8 = re.compile(b"\xed[\xa0-\xbf]")


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body.

    Raises:
        ApiError: 422 ``invalid_json`` for a body that is not JSON, not an object, or nested
            deeper than the parser goes; 400 ``invalid_value`` naming the field (``messages[0].content``)
            of a string that holds a lone surrogate escape (``"\\ud800"``), which is no Unicode text.
    """
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(422, "the request body is JSON nested too deeply to parse", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(422, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(422, "the request body must be a JSON object", code="invalid_json")
    if _may_hold_a_surrogate(raw):
        _check_text(body)
    return body


def _may_hold_a_surrogate(raw: bytes) -> bool:
    """False when no string json.loads made of ``raw`` can hold a surrogate (one scan of the bytes);
    True when one may (then the parsed body is walked to name the field)."""
    if json.detect_encoding(raw) not in ("utf-8", "utf-8-sig"):
        return True  # UTF-16 or UTF-32: rare; the walk decides
    if _SURROGATE_ESCAPE.search(raw) is not None:
        return True
    return b"\xed" in raw and _SURROGATE_UTF8.search(raw) is not None


def _check_text(body: dict[str, Any]) -> None:
    """400 for a string (key or value) of ``body`` that holds a lone surrogate. Iterative:
    json.loads has already nested as deep as the interpreter's recursion allows."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            hit = _SURROGATE.search(value)
            if hit is not None:
                raise _invalid(
                    path,
                    f"'{path}' is not valid Unicode text: it holds a lone surrogate ({hit.group()!a}) at "
                    f"character {hit.start()}; send text as UTF-8, a surrogate only as half of a pair",
                )
        elif isinstance(value, dict):
            for key, item in value.items():
                if _SURROGATE.search(key) is not None:  # named by its parent: the name itself cannot be sent back
                    where = f" in '{path}'" if path else ""
                    raise ApiError(
                        400,
                        f"the field name {key!a}{where} is not valid Unicode text: it holds a lone surrogate",
                        param=path or None,
                        code="invalid_value",
                    )
                todo.append((f"{path}.{key}" if path else key, item))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", item) for i, item in enumerate(value))


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def _opt_number(
    body: Mapping[str, Any], name: str, default: float, lo: float, hi: float, *, lo_open: bool = False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _invalid(name, f"'{name}' must be a number, got {value!r}")
    if value < lo or value > hi or (lo_open and value == lo):
        interval = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise _invalid(name, f"'{name}' must be in {interval}, got {value!r}")
    return float(value)


def _opt_int(body: Mapping[str, Any], name: str, *, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(name, f"'{name}' must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise _invalid(name, f"'{name}' must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise _invalid(name, f"'{name}' must be <= {hi}, got {value!r}")
    return value


def _opt_bool(body: Mapping[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _invalid(name, f"'{name}' must be a boolean, got {value!r}")
    return value


def _model(body: Mapping[str, Any]) -> str:
    model = body.get("model")
    if model is None:  # required, as OpenAI's API has it
        raise _invalid("model", "'model' is required: name the served model (GET /v1/models lists them)")
    if not isinstance(model, str):
        raise _invalid("model", f"'model' must be a string, got {model!r}")
    return model


def _unsupported(body: Mapping[str, Any], name: str, neutral: Sequence[Any], *, where: str = "", fix: str = "") -> None:
    """400 ``unsupported_parameter`` naming ``where + name`` (``messages[1].tool_calls``) when
    ``body`` sets ``name`` to anything but a ``neutral`` value; ``fix`` tells what to do instead."""
    # The neutral values themselves, not values equal to one in Python: 0 == False, True == 1,
    # but completions' logprobs=0 asks for the sampled tokens' logprobs and best_of=true is no count.
    value = body.get(name)
    if name in body and not any(value == n and type(value) is type(n) for n in neutral):
        param = f"{where}{name}"
        message = f"'{param}' is not supported by this server" + (f"; {fix}" if fix else "")
        raise ApiError(400, message, param=param, code="unsupported_parameter")


@dataclass(frozen=True)
class GenerationRequest:
    """A validated chat or completion request (``messages`` for chat, ``prompt`` for completions)."""

    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()  # vLLM's extension: the caller's, besides the model's EOS ids
    include_stop_str_in_output: bool = False  # vLLM's extension: the text ends after the stop string
    min_tokens: int = 0  # vLLM's extension: no stop token or stop string before this many tokens
    ignore_eos: bool = False
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None  # the first of ``prompts``
    max_tokens_param: str = "max_tokens"  # the field max_tokens came from (errors name it)
    # Alternatives per token (chat's top_logprobs, completions' logprobs); None: no logprobs.
    logprobs: int | None = None
    echo: bool = False  # completions: the prompt's text (and its logprobs) before the output
    prompts: tuple[str | list[int], ...] = ()  # completions: every prompt, answered as choices by index
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's extension, as min_p
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    response_format: ResponseFormat | None = None  # json_object or json_schema; None: text
    n: int = 1  # choices per prompt: choice i * n + j is prompt i's sample j, seeded seed + j

    def sampling_options(self, stop_token_ids: Sequence[int], grammar: Grammar | None = None) -> dict[str, Any]:
        """The decode loop's sampling options for this request (the fields of :class:`batchkit.SamplingParams`
        but the output limit), ``stop_token_ids`` being the model's (dropped with ``ignore_eos``),
        ``grammar`` the one ``response_format`` compiles to (see :mod:`batchkit.serve.structured`).

        Raises:
            ApiError: 400 for a ``response_format`` without its ``grammar`` (a caller that does
                not compile it refuses it rather than answer unconstrained).
        """
        if self.response_format is not None and grammar is None:
            raise ApiError(
                400, "'response_format' is not supported here", param="response_format", code="unsupported_parameter"
            )
        options: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": self.stop_ids(stop_token_ids),
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": self.logit_bias,
            "min_tokens": self.min_tokens,
        }
        if grammar is not None:
            options["grammar"] = grammar
        if self.stop:
            options["stop"] = self.stop
        if self.logprobs is not None:
            options["logprobs"] = self.logprobs
            if self.echo:
                options["prompt_logprobs"] = self.logprobs
        return options

    def stop_ids(self, model_stop_ids: Sequence[int]) -> tuple[int, ...]:
        """The token ids that end this request: the caller's ``stop_token_ids``, then the model's
        EOS ids ``model_stop_ids`` unless ``ignore_eos`` (which leaves the caller's, as vLLM's)."""
        own = self.stop_token_ids
        return own + tuple(t for t in (() if self.ignore_eos else model_stop_ids) if t not in own)

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse a token id past the vocabulary, in a token-id prompt or in ``logit_bias``.

        Raises:
            ApiError: 400 ``invalid_value`` naming the prompt (``prompt`` / ``prompt[i]``) or
                ``logit_bias``.
        """
        for i, prompt in enumerate(self.prompts):
            if not isinstance(prompt, str) and (min(prompt) < 0 or max(prompt) >= vocab_size):
                raise _invalid(self.prompt_param(i), f"token ids must be in [0, {vocab_size})")
        if self.stop_token_ids and max(self.stop_token_ids) >= vocab_size:
            raise _invalid("stop_token_ids", f"'stop_token_ids' must be in [0, {vocab_size})")
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:
            raise _invalid(
                "logit_bias", f"'logit_bias' token ids must be in [0, {vocab_size}), got {self.logit_bias[-1][0]}"
            )

    def prompt_param(self, index: int) -> str:
        """The field errors about prompt ``index`` name: ``messages``, ``prompt`` or ``prompt[i]``."""
        if self.messages is not None:
            return "messages"
        return "prompt" if len(self.prompts) == 1 else f"prompt[{index}]"


def _common(body: Mapping[str, Any], max_tokens_names: Sequence[str], min_max_tokens: int = 1) -> dict[str, Any]:
    n = _opt_int(body, "n", lo=1, hi=MAX_N) or 1
    # Tools: silently ignored, the model would answer in plain text.
    for name in ("tools", "functions"):
        _unsupported(body, name, (None, []))
    for name in ("tool_choice", "function_call"):
        _unsupported(body, name, (None, "none", "auto"))
    # Audio output and web search: the answer would be plain text without them, silently.
    _unsupported(body, "audio", (None,))
    _unsupported(body, "modalities", (None, ["text"]))
    _unsupported(body, "web_search_options", (None,))
    # Each is checked, the first given wins (max_completion_tokens, OpenAI's newer name).
    limits = [(name, _opt_int(body, name, lo=min_max_tokens)) for name in max_tokens_names]
    max_tokens_param, max_tokens = next(((n, v) for n, v in limits if v is not None), ("max_tokens", None))
    stop_value = body.get("stop")
    if stop_value is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_value, str):
        stop = (stop_value,) if stop_value else ()
    elif isinstance(stop_value, list) and all(isinstance(s, str) for s in stop_value):
        if len(stop_value) > MAX_STOP_STRINGS:
            raise _invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop_value)}")
        stop = tuple(s for s in stop_value if s)
    else:
        raise _invalid("stop", f"'stop' must be a string or a list of strings, got {stop_value!r}")
    stream = _opt_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _invalid("stream_options", "'stream_options' must be an object")
    if options is not None and not stream:  # as OpenAI
        raise _invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    include_usage = (options or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise _invalid(
            "stream_options.include_usage", f"'stream_options.include_usage' must be a boolean, got {include_usage!r}"
        )
    seed = _opt_int(body, "seed", lo=SEED_RANGE[0], hi=SEED_RANGE[1])
    min_tokens = _opt_int(body, "min_tokens", lo=0) or 0
    if max_tokens is not None and min_tokens > max_tokens:  # as vLLM
        raise _invalid("min_tokens", f"'min_tokens' ({min_tokens}) must not exceed '{max_tokens_param}' ({max_tokens})")
    return {
        "model": _model(body),
        "n": n,
        "stream": stream,
        "include_usage": bool(include_usage),
        "max_tokens": max_tokens,
        "max_tokens_param": max_tokens_param,
        # OpenAI's default temperature is 1 (sampling): pass 0 for greedy decoding.
        "temperature": _opt_number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _opt_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        "seed": seed,
        "stop": stop,
        # Extensions vLLM's server also takes (the openai client sends them with extra_body=).
        "top_k": max(_opt_int(body, "top_k", lo=-1) or 0, 0),  # -1 is off, as 0 (vLLM's)
        "ignore_eos": _opt_bool(body, "ignore_eos"),
        "stop_token_ids": _stop_token_ids(body),
        "include_stop_str_in_output": _opt_bool(body, "include_stop_str_in_output"),
        "min_tokens": min_tokens,
        "presence_penalty": _opt_number(body, "presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        "frequency_penalty": _opt_number(body, "frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        "repetition_penalty": _opt_number(body, "repetition_penalty", 1.0, 0.0, math.inf, lo_open=True),
        "min_p": _opt_number(body, "min_p", 0.0, 0.0, 1.0),
        "logit_bias": _logit_bias(body),
        "response_format": parse_response_format(body),
    }


def _stop_token_ids(body: Mapping[str, Any]) -> tuple[int, ...]:
    """vLLM's ``stop_token_ids``: a list of token ids (>= 0) that end the output, each kept in it."""
    value = body.get("stop_token_ids")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_token(t) and t >= 0 for t in value):
        raise _invalid("stop_token_ids", f"'stop_token_ids' must be a list of token ids (integers >= 0), got {value!r}")
    return tuple(dict.fromkeys(int(t) for t in value))


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: an object of token ids (decimal strings) to biases in [-100, 100]."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _invalid("logit_bias", f"'logit_bias' must be an object of token ids to biases, got {value!r}")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise _invalid("logit_bias", f"'logit_bias' keys must be token ids (decimal integers), got {key!r}")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise _invalid("logit_bias", f"'logit_bias' values must be numbers in [-100, 100], got {bias!r} for {key}")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


def _message_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _invalid(f"messages[{index}].content", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise _invalid(f"messages[{index}].content", "content must be a string or a list of text parts")


def _message(m: Any, index: int) -> dict[str, str]:
    """Message ``index`` as the chat template is given it: its role and its text."""
    where = f"messages[{index}]"
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise _invalid(where, "each message needs a string 'role' and a 'content'")
    role = m["role"]
    if role == "tool":
        message = f"role 'tool' ({where}.role) is not supported by this server; {_NO_TOOL_CALLS}"
        raise ApiError(400, message, param=f"{where}.role", code="unsupported_parameter")
    if role not in CHAT_ROLES:
        raise _invalid(f"{where}.role", f"'role' must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
    for name, (neutral, fix) in _UNRENDERED_MESSAGE_FIELDS.items():
        _unsupported(m, name, neutral, where=f"{where}.", fix=fix)
    if m.get("content") is None and role != "assistant":  # as OpenAI: only an assistant's may be absent
        raise _invalid(f"{where}.content", f"a {role} message needs a 'content'")
    return {"role": role, "content": _message_text(m.get("content"), index)}


def parse_chat(body: Mapping[str, Any]) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body.

    Raises:
        ApiError: 400 naming the offending field.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "'messages' must be a non-empty list of {role, content} objects")
    clean = [_message(m, i) for i, m in enumerate(messages)]
    # As OpenAI: logprobs is a boolean; top_logprobs (0 to 20) the alternatives, only with it.
    top_logprobs = _opt_int(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
    logprobs: int | None = None
    if _opt_bool(body, "logprobs"):
        logprobs = top_logprobs or 0
    elif top_logprobs is not None:
        raise _invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    return GenerationRequest(
        messages=clean, logprobs=logprobs, **_common(body, ("max_completion_tokens", "max_tokens"))
    )


def parse_completion(body: Mapping[str, Any], max_prompts: int = MAX_PROMPTS_PER_REQUEST) -> GenerationRequest:
    """Validate a ``/v1/completions`` body. ``prompt``: a string, a list of token ids, or a list
    of at most ``max_prompts`` of either (answered as ``choices`` by index).

    Raises:
        ApiError: 400 naming the offending field.
    """
    _unsupported(body, "best_of", (None, 1))
    _unsupported(body, "suffix", (None, ""))
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt)):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        items = prompt
    else:
        raise _invalid(
            "prompt", "'prompt' must be a non-empty string, a list of token ids, or a non-empty list of either"
        )
    if len(items) > max_prompts:
        raise _invalid(
            "prompt", f"at most {max_prompts} prompts per request (--max-prompts-per-request), got {len(items)}"
        )
    prompts: list[str | list[int]] = []
    for i, item in enumerate(items):
        where = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            if not item:
                raise _invalid(where, f"'{where}' must not be empty")
            prompts.append(item)
        elif item and all(_is_token(t) for t in item):
            prompts.append([int(t) for t in item])
        else:
            raise _invalid(where, f"'{where}' must be a non-empty string or a non-empty list of token ids")
    echo = _opt_bool(body, "echo")
    # logprobs is a count here: 0 still asks for the sampled tokens' own logprobs.
    logprobs = _opt_int(body, "logprobs", lo=0, hi=MAX_LOGPROBS)
    # max_completion_tokens too, as on chat: the docs promise the same sampling fields on both
    # routes. With echo, max_tokens=0 asks for the prompt alone (its logprobs, for scoring).
    common = _common(body, ("max_completion_tokens", "max_tokens"), 0 if echo else 1)
    return GenerationRequest(prompt=prompts[0], prompts=tuple(prompts), logprobs=logprobs, echo=echo, **common)


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


@dataclass(frozen=True)
class TokenizeRequest:
    """A validated ``/tokenize`` body (vLLM's): a ``prompt`` or chat ``messages``."""

    model: str | None
    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool
    return_token_strs: bool


def parse_tokenize(body: Mapping[str, Any]) -> TokenizeRequest:
    """Validate a ``/tokenize`` body: ``prompt`` (text) or ``messages`` (rendered with the chat
    template), ``add_special_tokens`` (default true, as vLLM), ``return_token_strs``; ``model``
    optional (as vLLM: these routes serve the one model).

    Raises:
        ApiError: 400 naming the offending field.
    """
    model = _model(body) if body.get("model") is not None else None
    prompt = body.get("prompt")
    messages = None
    if "messages" in body:
        messages = parse_chat({**body, "model": model or ""}).messages
    elif not isinstance(prompt, str):
        raise _invalid("prompt", "'prompt' must be a string (or send 'messages' to tokenize a chat)")
    add = body.get("add_special_tokens", True)
    if not isinstance(add, bool):
        raise _invalid("add_special_tokens", f"'add_special_tokens' must be a boolean, got {add!r}")
    return TokenizeRequest(
        model, prompt if messages is None else None, messages, add, _opt_bool(body, "return_token_strs")
    )


def parse_detokenize(body: Mapping[str, Any], vocab_size: int) -> tuple[str | None, list[int]]:
    """Validate a ``/detokenize`` body: ``tokens``, a list of token ids in ``[0, vocab_size)``.

    Raises:
        ApiError: 400 naming the offending field.
    """
    model = _model(body) if body.get("model") is not None else None
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_token(t) for t in tokens):
        raise _invalid("tokens", "'tokens' must be a list of token ids (integers)")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise _invalid("tokens", f"token ids must be in [0, {vocab_size}), got {bad[0]}")
    return model, [int(t) for t in tokens]


@dataclass(frozen=True)
class EmbeddingRequest:
    """A validated ``/v1/embeddings`` body."""

    model: str
    inputs: list[str]
    encoding_format: str


def parse_embedding(body: Mapping[str, Any], max_inputs: int = MAX_EMBEDDING_INPUTS) -> EmbeddingRequest:
    """Validate a ``/v1/embeddings`` body (``input``: a string or a list of at most ``max_inputs`` strings).

    Raises:
        ApiError: 400 naming the offending field.
    """
    value = body.get("input")
    if isinstance(value, str):
        inputs = [value]
    elif isinstance(value, list) and value and all(isinstance(s, str) for s in value):
        inputs = list(value)
    else:
        raise _invalid("input", "'input' must be a string or a non-empty list of strings")
    if len(inputs) > max_inputs:
        raise _invalid("input", f"at most {max_inputs} inputs per request, got {len(inputs)}")
    if "" in inputs:  # as OpenAI: an empty string has nothing to embed
        raise _invalid("input", f"input {inputs.index('')} is an empty string; every input needs text")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise _invalid("encoding_format", f"'encoding_format' must be 'float' or 'base64', got {fmt!r}")
    _unsupported(body, "dimensions", (None,))
    return EmbeddingRequest(model=_model(body), inputs=inputs, encoding_format=fmt)

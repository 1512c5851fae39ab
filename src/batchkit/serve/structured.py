"""Structured output for batchkit serve: OpenAI's ``response_format`` (``json_object``, and
``json_schema`` with ``strict``) read from a request body, and compiled into the decode loop's
:class:`~batchkit.continuous.grammar.Grammar` for the served model's tokenizer.

Parsing is the wire format (no I/O, no xgrammar); compiling needs xgrammar and the tokenizer,
and runs once per (tokenizer, schema): :func:`compile_in_thread` off the event loop first, then
:func:`grammar_for` finds it in the compiler's cache.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from ..continuous.grammar import INSTALL_HINT, Grammar, json_grammar
from .errors import ApiError

if TYPE_CHECKING:
    from ..models.pretrained import PretrainedLM

__all__ = ["ResponseFormat", "compile_in_thread", "grammar_for", "parse_response_format"]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name
_TYPES = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class ResponseFormat:
    """A request's ``response_format`` other than text: ``json_object``, or ``json_schema`` with
    its ``name``, its ``schema`` (compact JSON text; None: any object) and ``strict``."""

    type: str
    name: str | None = None
    schema: str | None = None
    strict: bool = False

    def schema_value(self) -> Any:
        """The schema as a JSON value (None for any object)."""
        return None if self.schema is None else json.loads(self.schema)


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


def parse_response_format(body: Mapping[str, Any]) -> ResponseFormat | None:
    """The body's ``response_format`` (None: absent, null or ``{"type": "text"}``).

    Raises:
        ApiError: 400 ``invalid_value`` naming the field (``response_format.type``,
            ``response_format.json_schema.name``...).
    """
    value = body.get("response_format")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _invalid("response_format", f"'response_format' must be an object with a 'type', got {value!r}")
    kind = value.get("type")
    if kind not in _TYPES:
        raise _invalid(
            "response_format.type",
            f"'response_format.type' must be one of 'text', 'json_object', 'json_schema', got {kind!r}",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _invalid(
            "response_format.json_schema",
            "'response_format.json_schema' must be an object with a 'name' and a 'schema' when 'type' is 'json_schema'",
        )
    name = spec.get("name")
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise _invalid(
            "response_format.json_schema.name",
            f"'response_format.json_schema.name' must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
        )
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise _invalid(
            "response_format.json_schema.schema",
            f"'response_format.json_schema.schema' must be a JSON schema object, got {schema!r}",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _invalid(
            "response_format.json_schema.strict",
            f"'response_format.json_schema.strict' must be a boolean, got {strict!r}",
        )
    text = None if schema is None else json.dumps(schema, separators=(",", ":"))
    return ResponseFormat("json_schema", name, text, bool(strict))


def grammar_for(fmt: ResponseFormat | None, lm: PretrainedLM) -> Grammar | None:
    """The grammar ``fmt`` asks of ``lm``'s output (None for none): compiled on the first call
    for a (tokenizer, schema), a cache hit (microseconds) after. Takes ``lm.lock`` meanwhile
    (building the tokenizer's info reads the tokenizer).

    Raises:
        ApiError: 400 naming ``response_format``: a schema xgrammar does not support, or no
            xgrammar on the server (the message says what to install).
    """
    if fmt is None:
        return None
    param = "response_format" if fmt.schema is None else "response_format.json_schema.schema"
    try:
        with lm.lock:
            return json_grammar(
                lm.tokenizer,
                fmt.schema_value(),
                strict=fmt.strict,
                vocab_size=lm.model.config.vocab_size,
                stop_token_ids=lm.stop_token_ids,
            )
    except ModuleNotFoundError:
        raise ApiError(
            400,
            f"'response_format' {fmt.type} needs xgrammar on the server: {INSTALL_HINT}",
            param="response_format",
            code="unsupported_parameter",
        ) from None
    except (ValueError, TypeError) as exc:
        raise _invalid(param, f"'{param}' is not a JSON schema this server supports: {exc}") from None


async def compile_in_thread(fmt: ResponseFormat | None, lm: PretrainedLM) -> None:
    """Compile ``fmt``'s grammar in a worker thread, so that :func:`grammar_for` on the event
    loop is a cache hit.

    Raises:
        ApiError: as :func:`grammar_for`.
    """
    if fmt is not None:
        await anyio.to_thread.run_sync(grammar_for, fmt, lm)

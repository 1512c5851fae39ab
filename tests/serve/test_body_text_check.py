"""parse_body's check for lone surrogates: a scan of the body's bytes decides whether the parsed
body is walked at all, and the answer is the walk's, so the refused and accepted bodies are those
of a walk over every string (the oracle below)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchkit.serve.errors import ApiError
from batchkit.serve.protocol import parse_body

_LONE = re.compile("[\ud800-\udfff]")


def _refused_by_a_full_walk(body: Any) -> bool:
    """The oracle: whether any key or string value of ``body`` holds a surrogate code point."""
    if isinstance(body, str):
        return _LONE.search(body) is not None
    if isinstance(body, dict):
        return any(_refused_by_a_full_walk(k) or _refused_by_a_full_walk(v) for k, v in body.items())
    if isinstance(body, list):
        return any(_refused_by_a_full_walk(v) for v in body)
    return False


def _refused(raw: bytes) -> bool:
    try:
        parse_body(raw)
    except ApiError as err:
        status = (err.status, err.code)
    else:
        return False
    assert status == (400, "invalid_value")
    return True


@pytest.mark.parametrize(
    ("raw", "refused"),
    [
        (b'{"p": "\\ud800"}', True),  # a lone high surrogate escape
        (b'{"p": "\\uDC00x"}', True),  # a lone low one, upper-case hex
        (b'{"p": "\\uDbFf"}', True),  # mixed-case hex
        (b'{"p": "\\ud83d\\ude00"}', False),  # a pair: one character (an emoji)
        (b'{"p": "\\\\ud800"}', False),  # an escaped backslash, then the letters "ud800"
        (b'{"p": "\\ue000 \\ud7ff"}', False),  # the code points either side of the surrogates
        (b'{"p": "\xed\xa0\x80"}', True),  # a surrogate's own UTF-8 bytes (json.loads passes them)
        (b'{"p": "\xed\x9f\xbf"}', False),  # U+D7FF in UTF-8: the ED byte of ordinary text
        ('{"p": "한국어"}'.encode(), False),  # Hangul: ED bytes, no surrogate
        (b'\xef\xbb\xbf{"p": "\\ud800"}', True),  # behind a UTF-8 byte-order mark
        (b'{"\\ud800": 1}', True),  # in a field name
        (b'{"a": [1, {"b": ["x", "\\udfff"]}]}', True),  # deep in lists and objects
        ('{"p": "\ud800"}'.encode("utf-16-le", "surrogatepass"), True),  # UTF-16: the walk decides
        ('{"p": "é"}'.encode("utf-16-le"), False),
        ('{"p": "é"}'.encode("utf-32"), False),
    ],
)
def test_the_refused_and_accepted_bodies_are_pinned(raw: bytes, refused: bool) -> None:
    """Each body is refused exactly when a string of it holds a surrogate, however it got there."""
    assert _refused(raw) is refused
    assert _refused_by_a_full_walk(json.loads(raw)) is refused


def test_the_refusal_still_names_the_field() -> None:
    """Only whether the body is walked changed: a refusal names the field as before."""
    with pytest.raises(ApiError) as info:
        parse_body(b'{"model": "m", "input": ["fine", "\\ud83d"]}')
    assert info.value.param == "input[1]"
    assert "lone surrogate" in info.value.message


_TEXT = st.text(
    alphabet=st.sampled_from(["a", " ", "\\", "u", "é", "한", "\ud800", "\udc00", "\U0001f600"]), max_size=6
)
_JSON = st.recursive(
    st.none() | st.integers() | _TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(body=st.dictionaries(_TEXT, _JSON, max_size=3), ascii_only=st.booleans())
def test_parse_body_refuses_what_a_walk_over_every_string_refuses(body: dict[str, Any], ascii_only: bool) -> None:
    """Escaped (ensure_ascii) or raw UTF-8 (surrogates passed as their own bytes), a body is
    refused exactly when the oracle walk finds a surrogate in what json.loads makes of it (two
    escapes of a pair become one character)."""
    raw = json.dumps(body, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    assert _refused(raw) is _refused_by_a_full_walk(json.loads(raw))

"""Reading a job's input: numbered records, with malformed lines reported rather than raised."""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Malformed", "Row", "count_lines", "iter_lines", "parse_line", "read_jsonl", "read_records"]

MAX_QUOTED = 1000  # characters of a malformed line kept in its dead letter


@dataclass(frozen=True, slots=True)
class Malformed:
    """An input line that is not a JSON object: why, and (the start of) what it held."""

    reason: str
    text: str


# (line number, record, its content); a JSONL line's record is None until parsed (parse_line):
# a resume skips finished lines by their content's digest, without parsing them.
Row = tuple[int, dict[str, Any] | Malformed | None, bytes]


def iter_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, bytes]]:
    """Yield ``(line_number, content)`` for each non-blank line of a file (1-based numbers; the
    content without its line ending, and without a UTF-8 byte order mark at the start of the
    file, as some Windows tools write). Reads one line at a time."""
    with Path(path).open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if n == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            if not raw.strip():
                continue  # blank lines (a trailing empty line, say) are not records
            yield n, raw.rstrip(b"\r\n")


def parse_line(content: bytes) -> dict[str, Any] | Malformed:
    """One JSONL line's record, or a :class:`Malformed` saying why it is not a JSON object."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        quote = content.decode("utf-8", "replace")[:MAX_QUOTED]
        return Malformed(f"not UTF-8: {exc.reason} at byte {exc.start}", quote)
    try:
        rec = json.loads(text)
    except ValueError as exc:
        return Malformed(f"malformed JSON: {exc}", text[:MAX_QUOTED])
    if not isinstance(rec, dict):
        return Malformed(f"expected a JSON object, got {type(rec).__name__}", text[:MAX_QUOTED])
    return rec


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[Row]:
    """Yield ``(line_number, None, content)`` for each non-blank line of a JSONL file (see
    :func:`iter_lines`; :func:`parse_line` makes the record). Memory does not grow with the file."""
    for n, content in iter_lines(path):
        yield n, None, content


def read_records(records: Iterable[Any], content: Callable[[object], bytes]) -> Iterator[Row]:
    """Number an iterable of records from 1 (the position stands in for the line number), each
    with ``content(record)``; an element that is not a mapping yields a :class:`Malformed`."""
    for n, rec in enumerate(records, start=1):
        if isinstance(rec, dict):
            yield n, rec, content(rec)
        elif isinstance(rec, Mapping):
            rec = dict(rec)
            yield n, rec, content(rec)
        else:
            text = repr(rec)
            yield (
                n,
                Malformed(f"expected a mapping (a dict), got {type(rec).__name__}", text[:MAX_QUOTED]),
                text.encode("utf-8", "surrogatepass"),
            )


def count_lines(path: str | os.PathLike[str]) -> int:
    """Lines in a file (for a progress bar's total): a fast scan of bytes, not a parse."""
    n = 0
    last = b"\n"
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")

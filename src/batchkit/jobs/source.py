"""Reading a job's input: numbered records, with malformed lines reported rather than raised."""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Malformed", "count_lines", "read_jsonl", "read_records"]

MAX_QUOTED = 1000  # characters of a malformed line kept in its dead letter


@dataclass(frozen=True, slots=True)
class Malformed:
    """An input line that is not a JSON object: why, and (the start of) what it held."""

    reason: str
    text: str


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any] | Malformed]]:
    """Yield ``(line_number, record)`` for each non-blank line of a JSONL file (1-based numbers);
    a line that is not valid UTF-8 JSON holding an object yields a :class:`Malformed` instead.

    A UTF-8 byte order mark at the start of the file (as some Windows tools write) is skipped.
    Reads one line at a time: memory does not grow with the file.
    """
    with Path(path).open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if n == 1 and raw.startswith(codecs.BOM_UTF8):
                raw = raw[len(codecs.BOM_UTF8) :]
            if not raw.strip():
                continue  # blank lines (a trailing empty line, say) are not records
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                quote = raw.decode("utf-8", "replace").rstrip("\r\n")[:MAX_QUOTED]
                yield n, Malformed(f"not UTF-8: {exc.reason} at byte {exc.start}", quote)
                continue
            try:
                rec = json.loads(text)
            except ValueError as exc:
                yield n, Malformed(f"malformed JSON: {exc}", text[:MAX_QUOTED])
                continue
            if not isinstance(rec, dict):
                yield (
                    n,
                    Malformed(f"expected a JSON object, got {type(rec).__name__}", text[:MAX_QUOTED]),
                )
                continue
            yield n, rec


def read_records(records: Iterable[Any]) -> Iterator[tuple[int, dict[str, Any] | Malformed]]:
    """Number an iterable of records from 1 (the position stands in for the line number); an
    element that is not a mapping yields a :class:`Malformed`."""
    for n, rec in enumerate(records, start=1):
        if isinstance(rec, dict):
            yield n, rec
        elif isinstance(rec, Mapping):
            yield n, dict(rec)
        else:
            yield n, Malformed(f"expected a mapping (a dict), got {type(rec).__name__}", repr(rec)[:MAX_QUOTED])


def count_lines(path: str | os.PathLike[str]) -> int:
    """Lines in a file (for a progress bar's total): a fast scan of bytes, not a parse."""
    n = 0
    last = b"\n"
    with Path(path).open("rb") as f:
        while chunk := f.read(1 << 20):
            n += chunk.count(b"\n")
            last = chunk[-1:]
    return n + (last != b"\n")

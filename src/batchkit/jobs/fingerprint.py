"""What a committed result was computed from, and whether the input read again still holds it.

Each line a job commits is journaled with the number of the input line it answers and a digest
of that record's content (the line's bytes; for an iterable or a Parquet row, its JSON form).
A resumed job matches the input against them with :class:`InputCheck` before it skips anything,
so that a result is never kept for a record that changed, moved under ``--line-ids``, or left
the input. The check knows nothing of files: it is told each line's number and digest, and asks
for the line's key (which costs a JSON parse) only where the digest alone cannot say.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import JobStateError
from .source import Malformed

__all__ = [
    "Committed",
    "Fingerprints",
    "InputCheck",
    "canonical_json",
    "changed_input",
    "content_digest",
    "is_id",
    "record_key",
]


def content_digest(content: bytes) -> str:
    """A record's fingerprint: 64 bits of BLAKE2b over its content, as 16 hex digits."""
    return hashlib.blake2b(content, digest_size=8).hexdigest()


def is_id(value: object) -> bool:
    """Whether ``value`` can identify a record: a string or an integer (a bool is neither)."""
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def record_key(record: dict[str, Any] | Malformed, id_field: str | None, line: int) -> Any:
    """The key a job files a record's result under: its id, the line number with ``id_field``
    None, or None for a record the job can only key by its line (malformed, no usable id)."""
    if id_field is None:
        return line
    if isinstance(record, Malformed):
        return None
    value = record.get(id_field)
    return value if is_id(value) else None


@dataclass(slots=True)
class Fingerprints:
    """Where each line of a file came from, in the file's order: the input line it answers and
    the digest of that record."""

    lines: list[int] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)

    def append(self, line: int, digest: str) -> None:
        self.lines.append(line)
        self.digests.append(digest)

    def extend(self, other: Fingerprints) -> None:
        self.lines.extend(other.lines)
        self.digests.extend(other.digests)

    def __len__(self) -> int:
        return len(self.lines)

    def to_json(self, prefix: str) -> dict[str, Any]:
        """The journal's fields for these lines: ``<prefix>_lines`` and ``<prefix>_digests`` (the
        digests concatenated, 16 hex digits each)."""
        return {f"{prefix}_lines": self.lines, f"{prefix}_digests": "".join(self.digests)}

    @classmethod
    def from_json(cls, record: dict[str, Any], prefix: str) -> Fingerprints:
        """Read what :meth:`to_json` wrote; ValueError if it is not that."""
        lines, digests = record[f"{prefix}_lines"], record[f"{prefix}_digests"]
        if not isinstance(lines, list) or not isinstance(digests, str) or len(digests) != 16 * len(lines):
            raise ValueError(f"malformed {prefix} fingerprints")
        return cls([int(n) for n in lines], [digests[i : i + 16] for i in range(0, len(digests), 16)])


Committed = tuple[Any, int, str]
"""A record an earlier run finished: ``(key, line, digest)``: its key (None: a dead letter keyed
by its line), the input line it was read from, and its content's digest. A plain tuple: a resume
makes one per finished record."""


class InputCheck:
    """Match the input, line by line in order, against what earlier runs committed.

    A committed record matches the first line whose key is its key, and that line must hold the
    content its result was computed from. Records keyed by their line (every record with
    ``--line-ids``; a dead letter without a usable id) must be at that line, unchanged. Lines
    that are new, or repeat an id already matched, are not this check's concern.
    ``key_of(line, content)`` gives a line's key (see :func:`record_key`); it is asked only
    where the digest alone cannot tell, so that an unchanged input is not parsed.
    """

    def __init__(self, committed: list[Committed], *, keyed_by_line: bool, key_of: Callable[[int, bytes], Any]) -> None:
        self.keyed_by_line = keyed_by_line
        self.key_of = key_of
        self._committed = committed
        # Committed records by the line they were read from: several when one moved away and
        # another was later committed at its old line (an id job whose input grew above it).
        self._by_line: dict[int, list[int]] = {}
        for i, (_, line, _) in enumerate(committed):
            self._by_line.setdefault(line, []).append(i)
        self._by_key = {} if keyed_by_line else {key: i for i, (key, _, _) in enumerate(committed) if key is not None}
        self._matched: set[int] = set()  # indices of the committed records matched so far
        self.found: dict[int, Any] = {}  # input line -> key of the committed record found there
        # Every committed record is matched: the rest of the input cannot change the verdict.
        # (An attribute, not a property: a resume asks once per input line.)
        self.done = not committed

    def _match(self, index: int, line: int) -> None:
        self._matched.add(index)
        self.found[line] = self._committed[index][0]
        self.done = len(self._matched) == len(self._committed)

    def feed(self, line: int, content: bytes) -> str | None:
        """Take the next input line; return why the input no longer holds a committed record, or
        None."""
        digest = content_digest(content)
        matched = self._matched
        committed = self._committed
        here = [i for i in self._by_line.get(line, ()) if i not in matched]
        for i in here:
            if committed[i][2] == digest:
                self._match(i, line)  # where it was, as it was
                return None
        for i in here:
            key = committed[i][0]
            if self.keyed_by_line or key is None:  # such a record cannot move: it changed
                return _changed(key, line, self.keyed_by_line)
        if self.keyed_by_line:
            return None  # a line after the committed ones
        key = self.key_of(line, content)
        if key is None or (moved := self._by_key.get(key)) is None or moved in matched:
            return None  # no id, a new record, or a repeat of an id matched above
        if committed[moved][2] != digest:
            return _changed(key, committed[moved][1], self.keyed_by_line)
        self._match(moved, line)  # the record moved (lines were added or removed above it)
        return None

    def finish(self) -> str | None:
        """The input ended: return why, if a committed record was not found in it."""
        missing = sorted(
            ((line, key) for i, (key, line, _) in enumerate(self._committed) if i not in self._matched),
            key=lambda m: m[0],
        )
        if not missing:
            return None
        line, key = missing[0]
        what = f"line {line}" if self.keyed_by_line or key is None else f"the record with id {key!r} (line {line})"
        more = f" (and {len(missing) - 1:,} more)" if len(missing) > 1 else ""
        return f"{what}{more} is no longer in the input"

    def run(self, lines: Iterable[tuple[int, bytes]]) -> str | None:
        """Feed ``(line, content)`` pairs until the verdict is known; return the first reason, or None."""
        for line, content in lines:
            reason = self.feed(line, content)
            if reason is not None:
                return reason
            if self.done:
                return None
        return self.finish()


def _changed(key: Any, line: int, keyed_by_line: bool) -> str:
    if keyed_by_line:
        return (
            f"line {line} is not the record its result was computed from (with --line-ids a line's number "
            "is its id: a line added or removed above it moves every id below)"
        )
    if key is None:
        return f"line {line}, a dead letter, changed since it was written"
    return f"the record with id {key!r} changed since its result was written"


def canonical_json(record: object) -> bytes:
    """The content a record from an iterable or a Parquet file is fingerprinted by: its JSON with
    sorted keys (keys of mixed types sorted by type name, then text), a set as its sorted items,
    other values JSON cannot hold by ``tolist()`` or ``repr()`` (an object whose repr holds its
    address fingerprints differently in every process: such a resume is refused, never wrong)."""
    text = json.dumps(_canonical(record), ensure_ascii=False, separators=(",", ":"), default=_jsonable)
    return text.encode("utf-8", "surrogatepass")


def _canonical(obj: object) -> Any:
    if isinstance(obj, dict):
        items = sorted(obj.items(), key=lambda kv: (type(kv[0]).__name__, str(kv[0])))
        return {str(k) if not isinstance(k, str) else k: _canonical(v) for k, v in items}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((_canonical(v) for v in obj), key=lambda v: json.dumps(v, default=_jsonable))
    return obj


def _jsonable(obj: object) -> Any:
    tolist = getattr(obj, "tolist", None)
    return _canonical(tolist()) if callable(tolist) else repr(obj)


def changed_input(output: Path, reason: str) -> JobStateError:
    """The refusal of a resume whose input no longer holds what the output was computed from."""
    return JobStateError(
        f"{output} holds results computed from other input: {reason}: restore the input as it was, or delete the "
        "output, its dead-letter file and its journal to start over (or choose another output)"
    )

"""Bulk jobs' input and output edges: a byte order mark, lines that are not UTF-8, Parquet
outputs of a job with no results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchkit.jobs import run


def _double(records: list[dict[str, Any]]) -> list[int]:
    return [2 * r["v"] for r in records]


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_a_byte_order_mark_at_the_start_of_the_input_is_not_a_malformed_line(tmp_path: Path) -> None:
    """Windows tools often start UTF-8 files with a BOM: the first record is still a record."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'\xef\xbb\xbf{"id": "a", "v": 1}\r\n{"id": "b", "v": 2}\r\n')
    report = run(_double, src, tmp_path / "out.jsonl", backoff_s=0)
    assert (report.succeeded, report.failed, report.malformed) == (2, 0, 0)
    assert sorted((r["id"], r["output"]) for r in _lines(tmp_path / "out.jsonl")) == [("a", 2), ("b", 4)]
    again = run(_double, src, tmp_path / "out.jsonl", backoff_s=0)
    assert (again.items, again.skipped) == (0, 2)


def test_a_line_that_is_not_utf8_is_quoted_like_any_malformed_line(tmp_path: Path) -> None:
    """The dead letter quotes the start of the line (without its newline), however long it is."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\xff" + b"x" * 5000 + b"\n" + b'{"id": "ok", "v": 1}\n')
    report = run(_double, src, tmp_path / "out.jsonl", backoff_s=0)
    assert (report.succeeded, report.malformed) == (1, 1)
    (letter,) = _lines(tmp_path / "out.dead.jsonl")
    assert letter["line"] == 1
    assert letter["error"].startswith("not UTF-8")
    assert not letter["input"].endswith("\n")
    assert len(letter["input"]) <= 1000


def test_a_parquet_output_without_results_still_has_the_jobs_columns(tmp_path: Path) -> None:
    """An empty input (or one whose every record failed) gives a Parquet file with the id and
    output columns, and no rows."""
    pq = pytest.importorskip("pyarrow.parquet")
    src = tmp_path / "in.jsonl"
    src.write_text("")
    report = run(_double, src, tmp_path / "out.parquet", id_field="sku")
    assert report.output == str((tmp_path / "out.parquet").resolve())
    table = pq.read_table(tmp_path / "out.parquet")
    assert table.num_rows == 0
    assert table.column_names == ["sku", "output"]

    src.write_text('{"sku": "a"}\n')  # no "v": the record fails
    report = run(_double, src, tmp_path / "failed.parquet", id_field="sku", retries=0)
    assert (report.succeeded, report.failed) == (0, 1)
    assert pq.read_table(tmp_path / "failed.parquet").column_names == ["sku", "output"]


def test_a_repeated_id_counts_as_a_duplicate_on_a_rerun_too(tmp_path: Path) -> None:
    """docs/jobs.md: an id seen again later in the input is counted as a duplicate. A rerun
    skips the first occurrence (done) and still counts the repeat as a duplicate, not as a
    second skipped record."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "v": 1}\n{"id": "b", "v": 2}\n{"id": "a", "v": 3}\n')
    first = run(_double, src, tmp_path / "out.jsonl")
    assert (first.succeeded, first.duplicates, first.skipped) == (2, 1, 0)
    again = run(_double, src, tmp_path / "out.jsonl")
    assert (again.items, again.skipped, again.duplicates) == (0, 2, 1)

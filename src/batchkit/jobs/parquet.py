"""Parquet in and out for bulk jobs (needs pyarrow: ``pip install 'batchkit[parquet]'``).

Input is streamed a row group batch at a time, so memory does not grow with the file. Output is
journaled as JSONL like any job (that is what makes it resumable and exactly once) and converted
to Parquet, in chunks, once the job has committed every record.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .fingerprint import canonical_json
from .source import Row

__all__ = ["export_parquet", "is_parquet", "open_parquet", "parquet_rows", "read_parquet", "require_pyarrow"]

CHUNK_ROWS = 8192


def is_parquet(path: str | os.PathLike[str]) -> bool:
    """Whether a job's input or output path names a Parquet file (by its ``.parquet`` suffix)."""
    return Path(path).suffix.lower() == ".parquet"


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "Parquet input or output needs pyarrow: pip install 'batchkit[parquet]'", name="pyarrow"
        ) from exc
    return pyarrow


def require_pyarrow() -> None:
    """Raise the install hint now if pyarrow is missing (a Parquet output is written at the end)."""
    _pyarrow()


def read_parquet(path: str | os.PathLike[str]) -> Iterator[Row]:
    """Yield ``(row_number, record, content)`` for each row of a Parquet file (1-based; the
    content is the row's JSON form, what it is fingerprinted by), one batch of rows at a time."""
    f = open_parquet(path)
    n = 0
    for batch in f.iter_batches(batch_size=CHUNK_ROWS):
        for rec in batch.to_pylist():
            n += 1
            yield n, rec, canonical_json(rec)


def open_parquet(path: str | os.PathLike[str]) -> Any:
    """A ``pyarrow.parquet.ParquetFile`` (it reads the footer).

    Raises:
        ValueError: the file is not Parquet (a JSONL input named ``.parquet``, say).
    """
    pa = _pyarrow()
    try:
        return pa.parquet.ParquetFile(str(path))
    except pa.ArrowInvalid as exc:
        raise ValueError(
            f"{str(path)!r} is not a Parquet file ({exc}): a path ending in .parquet is read as Parquet; "
            "give a JSONL input a .jsonl name"
        ) from None


def parquet_rows(path: str | os.PathLike[str]) -> int:
    """Rows in a Parquet file (from its footer; for a progress bar's total)."""
    return int(open_parquet(path).metadata.num_rows)


def export_parquet(
    jsonl: str | os.PathLike[str], target: str | os.PathLike[str], *, key_field: str | None = None
) -> int:
    """Write the records of a JSONL file to a Parquet file, atomically (a temporary file renamed
    into place); return the rows written.

    Two passes over ``jsonl``, a chunk of rows at a time: the first infers each chunk's schema and
    merges them into one that holds every row (ints and floats in one column become floats, a
    struct takes every key any row has, a null column takes the type of the others); the second
    writes the rows in it. With no rows at all, the file still has the job's columns,
    ``key_field`` and ``"output"`` (of Parquet's null type), so that readers find them.

    Raises:
        ValueError: the rows fit no one Parquet schema (results of varying types, such as ints in
            some rows and strings in others, or types Parquet cannot store, such as empty
            objects): keep such a job's output as JSONL (the message names ``jsonl``, which
            holds every row).
    """
    pa = _pyarrow()
    schema = None
    for chunk in _chunks(jsonl):
        with _unfit(pa, jsonl):
            inferred = pa.Table.from_pylist(chunk).schema
            schema = inferred if schema is None else pa.unify_schemas([schema, inferred], promote_options="permissive")
    if schema is None:
        schema = pa.schema([(key_field, pa.null()), ("output", pa.null())] if key_field is not None else [])
    target = Path(target)
    tmp = target.with_name(f".{target.name}.tmp")
    rows = 0
    try:
        with _unfit(pa, jsonl), pa.parquet.ParquetWriter(str(tmp), schema) as writer:
            for chunk in _chunks(jsonl):
                writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
                rows += len(chunk)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return rows


def _chunks(jsonl: str | os.PathLike[str]) -> Iterator[list[dict[str, Any]]]:
    """The records of ``jsonl`` in lists of up to :data:`CHUNK_ROWS` (blank lines skipped)."""
    with Path(jsonl).open("rb") as f:
        chunk: list[dict[str, Any]] = []
        for raw in f:
            if raw.strip():
                chunk.append(json.loads(raw))
            if len(chunk) == CHUNK_ROWS:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


@contextlib.contextmanager
def _unfit(pa: Any, jsonl: str | os.PathLike[str]) -> Iterator[None]:
    """Turn pyarrow's refusal of the rows into the ValueError :func:`export_parquet` raises."""
    try:
        yield
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as exc:
        raise ValueError(
            f"the job's results do not fit one Parquet schema ({exc}): every result is in {str(jsonl)!r}; "
            "write the output as JSONL instead"
        ) from None

"""How many bytes a bulk job's journal grows by per record.

Runs ``batchkit.jobs.run`` over synthetic records (``{"id": "r<i>", "text": "x"}``, an identity
batch function) in a temporary folder, for each ``--cases`` pair of record count and
``max_batch``, and prints the journal's size past its header divided by the records.

Run:  .venv/bin/python benchmarks/jobs_journal.py [--cases 1000x8,10000x64,100000x64] [--json PATH]

The journal's size does not vary between runs: ``--repeat`` and ``--warmup`` are refused above 1
and 0.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import _harness as harness

import batchkit.jobs


def journal_bytes_per_record(records: int, max_batch: int) -> tuple[float, int]:
    """Journal bytes per record past the header, and the commits the journal holds."""
    with tempfile.TemporaryDirectory() as folder:
        src, out = Path(folder) / "in.jsonl", Path(folder) / "out.jsonl"
        src.write_text("".join(json.dumps({"id": f"r{i}", "text": "x"}) + "\n" for i in range(records)))

        def identity(batch: list[dict[str, Any]]) -> list[str]:
            return [r["text"] for r in batch]

        batchkit.jobs.run(identity, src, out, id_field="id", max_batch=max_batch)
        lines = (Path(folder) / "out.jsonl.journal").read_bytes().splitlines(keepends=True)
        return sum(len(line) for line in lines[1:]) / records, len(lines) - 1


def main() -> None:
    ap = harness.parser(__doc__, once=True)
    ap.add_argument("--cases", default="1000x8,10000x64,100000x64", help="comma-separated RECORDSxMAX_BATCH")
    args = ap.parse_args()
    try:
        cases = [tuple(int(x) for x in case.split("x")) for case in args.cases.split(",")]
    except ValueError:
        cases = []
    if not cases or any(len(c) != 2 or min(c) < 1 for c in cases):
        ap.error(f"--cases must be comma-separated RECORDSxMAX_BATCH pairs of ints >= 1, got {args.cases!r}")
    record = harness.start(args)
    print("| records | max_batch | journal bytes per record | commits |")
    print("| --- | --- | --- | --- |")
    for records, max_batch in cases:
        per_record, commits = journal_bytes_per_record(records, max_batch)
        record.add("journal bytes per record", per_record, "bytes", records=records, max_batch=max_batch)
        record.add("commits", commits, records=records, max_batch=max_batch)
        print(f"| {records:,} | {max_batch} | {per_record:.1f} | {commits:,} |")
    record.write()


if __name__ == "__main__":
    main()

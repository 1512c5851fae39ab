"""Offline bulk job: rewrite product descriptions overnight, exactly once, resumable.

The job is stopped part-way (as a crash or Ctrl-C would stop it), then rerun with the same call:
it skips what is done and finishes. One record keeps failing and ends in the dead-letter file; a
malformed line does too. Run:

    python examples/bulk_job.py

The same job from the shell, run in this folder on a ``products.jsonl`` of ``{"sku": ...,
"description": ...}`` lines (its records are identified by ``sku``, not the default ``id``)::

    batchkit run bulk_job:rewrite --input products.jsonl --output out.jsonl --id-field sku
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import batchkit.jobs


def rewrite(records: list[dict[str, Any]]) -> list[Any]:
    """Pretend model: one call rewrites a whole batch. A record it cannot handle gets an
    exception in its slot; only that record fails."""
    out: list[Any] = []
    for r in records:
        text = r["description"]
        if not text:
            out.append(ValueError("empty description: nothing to rewrite"))
        else:
            out.append({"title": text.split(",")[0].title(), "description": text.capitalize() + "."})
    return out


class StopAfter:
    """Stops the job after a few commits, the way a crash would (the commits made are durable)."""

    def __init__(self, commits: int) -> None:
        self.left = commits

    def __call__(self, progress: batchkit.jobs.JobProgress) -> None:
        self.left -= 1
        if self.left == 0:
            raise KeyboardInterrupt


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        products = folder / "products.jsonl"
        with products.open("w") as f:
            for i in range(5000):
                desc = "" if i == 1234 else f"a sturdy widget, model {i}, ships in {1 + i % 5} days"
                f.write(json.dumps({"sku": f"P{i:05d}", "description": desc}) + "\n")
            f.write('{"sku": "P99999", "description": \n')  # a torn line in the input
        out = folder / "rewritten.jsonl"
        options: dict[str, Any] = {"id_field": "sku", "max_batch": 64, "retries": 1, "backoff_s": 0.01}

        try:
            batchkit.jobs.run(rewrite, products, out, on_commit=StopAfter(10), **options)
        except KeyboardInterrupt:
            done = len(out.read_text().splitlines())
            print(f"stopped after {done} records were committed")

        report = batchkit.jobs.run(rewrite, products, out, **options)
        print(report.summary())

        lines = [json.loads(line) for line in out.read_text().splitlines()]
        skus = [line["sku"] for line in lines]
        assert len(skus) == len(set(skus)) == 4999, "every good record exactly once"
        print(f"first line: {json.dumps(lines[0])}")
        for letter in map(json.loads, Path(report.dead_letter).read_text().splitlines()):
            print(f"dead letter: line {letter['line']}: {letter['error']}")


if __name__ == "__main__":
    main()

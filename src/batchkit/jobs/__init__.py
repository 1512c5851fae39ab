"""Offline bulk jobs: run a batch function over a JSONL file, exactly once, resumable.

::

    import batchkit.jobs

    def shout(records: list[dict]) -> list[str]:
        return [r["text"].upper() for r in records]

    report = batchkit.jobs.run(shout, "in.jsonl", "out.jsonl", max_batch=64)
    print(report.summary())

or from the shell: ``batchkit run mymodule:shout --input in.jsonl --output out.jsonl``.

- :func:`run`: the job (see its docstring for every option), returning a :class:`JobReport`.
- :func:`generate_fn`: a :class:`~batchkit.ContinuousDecodeLoop` plus a tokenizer as a job function.
- :mod:`batchkit.jobs.openai_batch`: OpenAI Batch API files answered as ``batchkit serve`` answers
  them (``batchkit run --model M --format openai-batch``; imported on use: it reads the server's protocol).
- :class:`JobStore`: the output, dead-letter file and journal, and how a crash is recovered.
- :func:`add_run_parser`, :func:`run_cli`: the ``batchkit run`` sub-command.

See docs/jobs.md for the guarantees and the file formats.
"""

from __future__ import annotations

from .cli import add_run_parser, run_cli
from .generate import GenerateFunction, Generation, generate_fn
from .runner import JobProgress, JobReport, run
from .store import JobStateError, JobStore

__all__ = [
    "run",
    "JobReport",
    "JobProgress",
    "JobStateError",
    "JobStore",
    "generate_fn",
    "GenerateFunction",
    "Generation",
    "add_run_parser",
    "run_cli",
]

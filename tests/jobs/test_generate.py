"""A generate_fn job: a prompt the KV cache can never hold fails only its own record (it used to
end the whole job, and every rerun, with KVCacheExhausted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import batchkit
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

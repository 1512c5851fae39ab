"""docs/api.md's LLM-side promises still checked here: the planner's shapes and the allocator's
token counts (tests/kv, whose files another change holds), the bulk-job example's shell command
(a docs snippet, with tests/docs/test_examples.py's), and the benchmark commands the docs quote.
The rest moved to the test files of their units: tests/continuous, tests/models, tests/demo,
tests/kv/test_quotas.py, tests/test_sim.py and tests/test_bench.py."""

from __future__ import annotations

import ast
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pytest

import batchkit

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- planning


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"head_dim": -128}, "head_dim"),
        ({"dtype_bytes": 0}, "dtype_bytes"),
        ({"num_layers": 2.5}, "num_layers"),
        ({"num_params": -1}, "num_params"),
    ],
)
def test_a_model_shape_no_model_has_is_a_value_error(fields: dict[str, Any], name: str) -> None:
    """A ModelShape whose KV bytes per token would be 0 or negative is refused (plan() divided by
    it: ZeroDivisionError, or a negative block size)."""
    shape: dict[str, Any] = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "num_params": 10**9, **fields}
    with pytest.raises(ValueError, match=name):
        batchkit.ModelShape(**shape)


def test_kv_cache_bytes_refuses_every_negative_size() -> None:
    """kv_cache_bytes is 2 * tokens * num_layers * num_kv_heads * head_dim * dtype_bytes: a
    negative factor is a ValueError naming it, never a negative byte count."""
    assert batchkit.kv_cache_bytes(3, 2, 4, 8, 1) == 2 * 3 * 2 * 4 * 8
    for name in ("head_dim", "dtype_bytes"):
        sizes: dict[str, int] = {"tokens": 1, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype_bytes": 2}
        sizes[name] = -1
        with pytest.raises(ValueError, match=name):
            batchkit.kv_cache_bytes(**sizes)


def test_plan_takes_a_model_shape() -> None:
    """kv.plan(model, ...) plans for a ModelShape; a model object instead is a TypeError saying so."""
    from batchkit.models import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1))
    with pytest.raises(TypeError, match="ModelShape"):
        batchkit.kv.plan(cast(Any, model), device_bytes=10**9)


# --------------------------------------------------------------------------- examples


def test_the_bulk_job_examples_shell_command_runs_the_same_job(tmp_path: Path) -> None:
    """examples/bulk_job.py says its job runs from the shell with the `batchkit run` command in
    its docstring: run that command (in a folder holding the example and a products.jsonl of the
    kind it describes) and every record comes out, none dead-lettered."""
    example = ROOT / "examples" / "bulk_job.py"
    doc = ast.get_docstring(ast.parse(example.read_text(encoding="utf-8"))) or ""
    lines = [line.strip() for line in doc.splitlines() if line.strip().startswith("batchkit run ")]
    assert len(lines) == 1, doc
    argv = shlex.split(lines[0])
    shutil.copy(example, tmp_path / "bulk_job.py")
    records = [{"sku": f"P{i:03d}", "description": f"a widget, model {i}"} for i in range(20)]
    (tmp_path / "products.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    done = subprocess.run(
        [sys.executable, "-m", "batchkit", *argv[1:], "--no-progress"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["sku"] for r in out) == [r["sku"] for r in records]


# --------------------------------------------------------------------------- load testing


def test_the_overhead_benchmark_refuses_fewer_requests_than_callers() -> None:
    """benchmarks/overhead.py --requests N (docs/benchmarks.md): its rows run 512 callers, so
    fewer than 512 requests left every caller idle and the run died on an assertion; it is a
    usage error (status 2) that says so."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--requests", "100", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--requests must be at least 512" in done.stderr


# --------------------------------------------------------------------------- PagedKVAllocator


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda a: a.append_slots("s", 1.5), "n"),
        (lambda a: a.append_slots("s", True), "n"),
        (lambda a: a.can_append_slots(["s"], 0.5), "n"),
        (lambda a: a.allocate("t", 2.5), "prompt"),
        (lambda a: a.mark_computed("s", 1.5), "num_tokens"),
        (lambda a: a.blocks_needed(2.5), "num_tokens"),
        (lambda a: a.can_allocate(1.5), "num_tokens"),
        (lambda a: a.slot_mapping("s", 0.5, 2), "start"),
    ],
)
def test_a_token_count_that_is_not_an_int_changes_nothing(call: Any, name: str) -> None:
    """ "Every method checks its preconditions before changing anything": a fractional (or bool)
    count is a ValueError naming it. append_slots(seq, 1.5) handed out a slot of the null block 0
    and counted a token the caller never wrote."""
    a = batchkit.PagedKVAllocator(16, 4)
    a.allocate("s", [1, 2, 3])
    before = (a.num_tokens("s"), a.statistics())
    with pytest.raises(ValueError, match=name):
        call(a)
    assert (a.num_tokens("s"), a.statistics()) == before
    assert a.append_slots("s", cast(Any, np.int64(2))).tolist() == [7, 8]  # numpy ints are ints
    assert a.allocate("u", cast(Any, np.int64(3))) == 0


# --------------------------------------------------------------------------- docs/benchmarks.md commands


def _script_flags(script: Path) -> set[str]:
    """The --flags a benchmark script's argparse parser defines (read from its source)."""
    flags: set[str] = {"--help"}
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {str(a.value) for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags


def test_every_benchmark_command_in_the_docs_names_a_script_and_flags_it_has() -> None:
    """docs/benchmarks.md (and the other pages) quote `.venv/bin/python benchmarks/<name>.py
    --flag ...` commands: each script exists and defines every flag quoted for it."""
    pattern = re.compile(r"benchmarks/(\w+)\.py((?:\s+--?[\w-]+(?:\s+(?!--)[^\s#`]+)?)*)")
    seen = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if not line.lstrip().startswith((".venv/bin/python benchmarks/", "python benchmarks/")):
                continue
            for m in pattern.finditer(line):
                script = ROOT / "benchmarks" / f"{m.group(1)}.py"
                assert script.exists(), f"{page.name}:{n}: no {script.name}"
                quoted = set(re.findall(r"(?<!\S)(--[\w-]+)", m.group(2)))
                missing = quoted - _script_flags(script)
                assert not missing, f"{page.name}:{n}: {script.name} has no {sorted(missing)}"
                seen += 1
    assert seen >= 10  # docs/benchmarks.md alone quotes a dozen

"""Every example is a program: run each one so that none can rot."""

from __future__ import annotations

import ast
import json
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The example's main() runs to completion and prints its report."""
    if "torch" in path.read_text():
        pytest.importorskip("torch")
    module = runpy.run_path(str(path), run_name="example")
    old_argv = sys.argv
    sys.argv = [str(path)]
    try:
        module["main"]()
    finally:
        sys.argv = old_argv
    assert capsys.readouterr().out.strip()


def test_cli_demo_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    """`batchkit demo` (short run) prints every row of its two comparison tables."""
    pytest.importorskip("torch")
    from batchkit.cli import main

    args = ["demo", "--seconds", "0.3", "--callers", "8", "--llm-requests", "4", "--llm-max-out", "12"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for row in ("one request at a time", "batchkit (max_batch_size", "one at a time", "static batches", "continuous"):
        assert row in out


def test_readme_names_every_example() -> None:
    """README.md's list of examples is complete: a new example is also announced."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in EXAMPLES if f"`{p.name}`" not in readme]
    assert not missing, f"README.md does not list {missing}"


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

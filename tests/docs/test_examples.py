"""Every example is a program: run each one so that none can rot."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))


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

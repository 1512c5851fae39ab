"""benchmarks/_harness.py: the options, machine line, timings and JSON record every benchmark shares;
and the scripts' command lines as the docs quote them."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from _support import load_benchmark

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def harness() -> ModuleType:
    """The helper, imported as a module (benchmarks/ is not a package)."""
    return load_benchmark("_harness")


def test_the_parser_has_the_common_options_with_their_defaults(harness: ModuleType) -> None:
    """--repeat 1, --warmup 0, --json unset, and the first paragraph of the docstring as description."""
    ap = harness.parser("First paragraph.\n\nSecond.")
    args = ap.parse_args([])
    assert (args.repeat, args.warmup, args.json) == (1, 0, None)
    assert ap.description == "First paragraph."


def test_a_script_declares_a_common_option_again_with_its_own_default(harness: ModuleType) -> None:
    """The later declaration wins, aliases included (overhead.py's --repeats)."""
    ap = harness.parser(None)
    ap.add_argument("--repeat", "--repeats", type=int, default=5)
    assert ap.parse_args([]).repeat == 5
    assert ap.parse_args(["--repeats", "2"]).repeat == 2


@pytest.mark.parametrize(
    ("argv", "match"),
    [(["--repeat", "0"], "--repeat must be at least 1"), (["--warmup", "-1"], "--warmup must be at least 0")],
)
def test_the_parser_refuses_counts_out_of_range(
    harness: ModuleType, capsys: pytest.CaptureFixture[str], argv: list[str], match: str
) -> None:
    """A usage error (status 2) that names the option."""
    with pytest.raises(SystemExit) as exc:
        harness.parser(None).parse_args(argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_the_machine_line_names_cpu_flags_cores_load_and_versions(harness: ModuleType) -> None:
    """One line beginning "machine:" with every flag the kernels depend on, yes or no."""
    line = harness.machine().line()
    assert line.startswith("machine: ")
    assert "\n" not in line
    for flag in ("amx_bf16", "avx512_bf16", "avx2"):
        assert f"{flag} yes" in line or f"{flag} no" in line
    assert "cores usable" in line
    assert "load " in line
    assert f"python {sys.version_info.major}.{sys.version_info.minor}" in line


def test_a_summary_is_the_median_and_range(harness: ModuleType) -> None:
    """Median, lowest and highest of the runs; formatted with a scale."""
    s = harness.Summary.of([3.0, 1.0, 2.0])
    assert (s.median, s.low, s.high) == (2.0, 1.0, 3.0)
    assert s.format(".0f", scale=10) == "20 (10-30, 3 runs)"
    assert harness.Summary.of([4.0]).format() == "4.0 (1 run)"
    with pytest.raises(ValueError, match="at least one value"):
        harness.Summary.of([])


def test_interleave_runs_each_once_a_round_and_drops_the_warmup_rounds(harness: ModuleType) -> None:
    """Rounds in order a, b, a, b, ...; the warm-up rounds run but are not returned."""
    calls: list[str] = []
    counter = iter(range(100))

    def run(name: str) -> int:
        calls.append(name)
        return next(counter)

    out = harness.interleave({"a": lambda: run("a"), "b": lambda: run("b")}, repeat=2, warmup=1)
    assert calls == ["a", "b"] * 3
    assert out == {"a": [2, 4], "b": [3, 5]}


def test_the_record_writes_every_figure_its_settings_and_the_machine(
    harness: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """start() prints the machine line first; write() puts the settings, machine and figures in --json."""
    path = tmp_path / "out" / "run.json"
    args = harness.parser(None).parse_args(["--repeat", "2", "--json", str(path)])
    record = harness.start(args, "demo.py")
    assert capsys.readouterr().out.startswith("machine: ")
    record.add("step", [2.0, 1.0], "ms", rows=16)
    record.add("verdict", "met")
    record.write()
    data = json.loads(path.read_text())
    assert data["script"] == "demo.py"
    assert data["settings"] == {"repeat": 2, "warmup": 0}
    assert set(data["machine"]["flags"]) >= {"amx_bf16", "avx512_bf16", "avx2"}
    assert data["figures"] == [
        {
            "name": "step",
            "unit": "ms",
            "settings": {"rows": 16},
            "median": 1.5,
            "min": 1.0,
            "max": 2.0,
            "runs": [2.0, 1.0],
        },
        {"name": "verdict", "unit": "", "value": "met"},
    ]


def test_a_percentile_is_the_nearest_rank_and_nan_for_none(harness: ModuleType) -> None:
    """The q quantile of the sorted figures, at index int(q * n) (the last for q = 1)."""
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert harness.percentile(xs, 0.5) == 3.0
    assert harness.percentile(xs, 0.99) == 5.0
    assert harness.percentile(xs, 1.0) == 5.0
    assert harness.percentile([], 0.5) != harness.percentile([], 0.5)  # NaN


def test_a_script_that_measures_once_refuses_other_counts(
    harness: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """parser(once=True) takes --repeat 1 --warmup 0 and refuses anything else, rather than ignore it."""
    ap = harness.parser(None, once=True)
    assert ap.parse_args(["--repeat", "1"]).repeat == 1
    with pytest.raises(SystemExit):
        ap.parse_args(["--repeat", "3"])
    assert "measures once" in capsys.readouterr().err


def test_poisson_arrivals_rise_until_one_falls_past_the_window(harness: ModuleType) -> None:
    """Increasing offsets, all but the last inside the window; the same seed, the same schedule."""
    at = harness.poisson_arrivals(100.0, 1.0, seed=7)
    assert at == sorted(set(at))
    assert all(a < 1.0 for a in at[:-1])
    assert at[-1] >= 1.0
    assert at == harness.poisson_arrivals(100.0, 1.0, seed=7)


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


def _script_flags(script: Path, seen: frozenset[Path] = frozenset()) -> set[str]:
    """The --flags a benchmark script's argparse parser defines (read from its source, and from
    the sources of the sibling benchmark modules it imports, whose helpers may add them)."""
    flags: set[str] = {"--help"}
    seen |= {script}
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {str(a.value) for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
        elif isinstance(node, ast.ImportFrom) and node.module and (script.parent / f"{node.module}.py").is_file():
            sibling = script.parent / f"{node.module}.py"
            if sibling not in seen and not node.module.startswith("_"):
                flags |= _script_flags(sibling, seen)
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

"""The command line, through its real entry points (``python -m batchkit`` and the ``batchkit`` script).

Every case is a promise about what a user sees: the exit status (0 done, 1 the target failed, 2 a
usage error), the one line on stderr that names the argument and the fix, and that no command hangs
(each run has a 60 s limit; the cases run in parallel threads to keep the file quick).
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from batchkit.cli import main

LIMIT_S = 60  # no case may run longer than this
pytestmark = pytest.mark.timeout(300)  # the first test waits for the parallel runs to start

TARGET = """\
import threading

def ok(xs):
    return list(xs)

def boom(xs):
    raise ValueError("boom: the model rejected the batch")

def hang(xs):
    threading.Event().wait(3600)  # never returns within any test's patience
    return xs

NOT_CALLABLE = 3

def item(i):
    return i * 2

def import_fails():
    pass
"""

BROKEN_IMPORT = "raise RuntimeError('this module fails on import')\n"


@dataclass(frozen=True)
class Case:
    """One command line and what it must produce."""

    id: str
    args: tuple[str, ...]
    status: int
    stderr: str = ""  # a substring of stderr
    stdout: str = ""  # a substring of stdout
    missing: tuple[str, ...] = ()  # optional extras to hide from the run
    script: bool = False  # run the installed `batchkit` console script instead of `python -m batchkit`
    slow: bool = False  # starts torch: started first, so that the quick cases run beside it


TINY_LLM = ("--llm-requests", "2", "--llm-max-out", "8", "--llm-batch", "2")
FAST = ("--no-progress", "--duration", "0.05", "--concurrency", "2", "--batch-sizes", "2")

CASES = [
    # ---- plan
    Case("plan-preset", ("plan", "--preset", "llama-3-8b"), 0, stdout="max_num_seqs"),
    Case("plan-config-missing", ("plan", "--config", "nope.json"), 2, "argument --config: no such file 'nope.json'"),
    Case("plan-config-dir", ("plan", "--config", "."), 2, "argument --config: . is a folder"),
    Case("plan-config-invalid-json", ("plan", "--config", "bad.json"), 2, "bad.json is not valid JSON"),
    Case("plan-config-not-object", ("plan", "--config", "list.json"), 2, "holds a JSON list"),
    Case("plan-config-no-hidden-size", ("plan", "--config", "nohidden.json"), 2, "config needs hidden_size"),
    Case("plan-config-bad-layers", ("plan", "--config", "badlayers.json"), 2, "num_hidden_layers must be a whole"),
    Case("plan-config-unknown-dtype", ("plan", "--config", "int4.json"), 2, "pass --dtype-bytes"),
    Case("plan-config-fp8-is-one-byte", ("plan", "--config", "fp8.json"), 0, stdout="1 bytes per value"),
    Case("plan-dtype-bytes-override", ("plan", "--dtype-bytes", "1"), 0, stdout="1 bytes per value"),
    Case("plan-preset-unknown", ("plan", "--preset", "nope"), 2, "argument --preset: invalid choice"),
    Case("plan-device-inf", ("plan", "--device-gib", "inf"), 2, "argument --device-gib: must be a finite number"),
    Case("plan-device-zero", ("plan", "--device-gib", "0"), 2, "argument --device-gib"),
    Case("plan-weights-negative", ("plan", "--weights-gib", "-100"), 2, "argument --weights-gib: must be a finite"),
    Case("plan-activation-nan", ("plan", "--activation-gib", "nan"), 2, "argument --activation-gib"),
    Case("plan-utilization-above-1", ("plan", "--gpu-memory-utilization", "1.5"), 2, "--gpu-memory-utilization"),
    Case("plan-block-size-huge", ("plan", "--block-size", "1e12"), 2, "argument --block-size: expected a whole"),
    Case(  # 0.3 GiB left for the cache, one block of 1024 tokens needs 0.5 GiB
        "plan-block-size-no-block-fits",
        ("plan", "--device-gib", "16.5", "--block-size", "1024"),
        2,
        "lower --block-size",
    ),
    Case("plan-mean-len-zero", ("plan", "--mean-len", "0"), 2, "argument --mean-len: must be in 1.."),
    Case("plan-no-room", ("plan", "--device-gib", "8"), 2, "raise --device-gib"),
    Case("plan-config-and-preset", ("plan", "--config", "fp8.json", "--preset", "llama-2-7b"), 2, "not allowed with"),
    # ---- demo
    Case("demo-callers-zero", ("demo", "--callers", "0"), 2, "argument --callers: must be in 1..1,024, got 0"),
    Case("demo-callers-negative", ("demo", "--callers", "-5"), 2, "argument --callers: must be in 1..1,024"),
    Case("demo-callers-huge", ("demo", "--callers", "1000000000000"), 2, "argument --callers"),
    Case("demo-max-batch-zero", ("demo", "--max-batch", "0"), 2, "argument --max-batch: must be in 1.."),
    Case("demo-seconds-nan", ("demo", "--seconds", "nan"), 2, "argument --seconds: must be a finite number"),
    Case("demo-llm-max-out-huge", ("demo", "--llm-max-out", "1000000000000"), 2, "argument --llm-max-out"),
    Case("demo-llm-batch-zero", ("demo", "--llm-batch", "0"), 2, "argument --llm-batch"),
    Case("demo-without-torch", ("demo",), 2, "needs torch: pip install 'batchkit[torch]'", missing=("torch",)),
    Case(  # both halves, tiny: one torch start-up for the whole demo
        "demo-runs",
        (*("demo", "--callers", "2", "--seconds", "0.1", "--threads", "1"), *TINY_LLM),
        0,
        stdout="one request at a time (FIFO)",
        slow=True,
    ),
    Case(  # the start-up line says what it chose; rows follow
        "demo-names-its-cpu-threads",
        ("demo", "--part", "llm", "--threads", "1", *TINY_LLM),
        0,
        stdout="CPU threads: 1 (",
        slow=True,
    ),
    # ---- bench: targets
    Case("bench-missing-module", ("bench", "nosuch_module_xyz:f"), 2, "no module named 'nosuch_module_xyz'"),
    Case("bench-missing-attribute", ("bench", "bk_target:nope"), 2, "bk_target has no attribute 'nope'"),
    Case("bench-not-callable", ("bench", "bk_target:NOT_CALLABLE"), 2, "bk_target:NOT_CALLABLE is not callable"),
    Case("bench-no-colon", ("bench", "bk_target"), 2, "expected 'module:function'"),
    Case("bench-module-fails-on-import", ("bench", "bk_broken:f"), 1, "RuntimeError: this module fails on import"),
    Case("bench-target-raises", ("bench", "bk_target:boom", *FAST), 1, "bk_target:boom failed: ValueError: boom"),
    Case(
        "bench-target-raises-traceback",
        ("bench", "bk_target:boom", "--traceback", *FAST),
        1,
        "Traceback (most recent call last)",
    ),
    Case(
        "bench-target-never-returns",
        ("bench", "bk_target:hang", "--timeout", "0.5", *FAST),
        1,
        "the target ran longer than --timeout 0.5 s",
    ),
    Case("bench-make-item-missing", ("bench", "bk_target:ok", "--make-item", "bk_target:nope"), 2, "--make-item"),
    Case(
        "bench-make-item-used-for-demo",  # ints reach the MLP's torch.stack: proof the option is not ignored
        ("bench", "demo", "--make-item", "bk_target:item", "--threads", "1", *FAST),
        1,
        "demo failed: TypeError",
        slow=True,
    ),
    Case("bench-demo-without-torch", ("bench",), 2, "needs torch: pip install 'batchkit[torch]'", missing=("torch",)),
    # ---- bench: numbers
    Case("bench-batch-sizes-zero", ("bench", "bk_target:ok", "--batch-sizes", "0"), 2, "argument --batch-sizes"),
    Case("bench-batch-sizes-empty-item", ("bench", "bk_target:ok", "--batch-sizes", "1,,2"), 2, "comma-separated"),
    Case("bench-batch-sizes-huge", ("bench", "bk_target:ok", "--batch-sizes", "1000000000000"), 2, "--batch-sizes"),
    Case("bench-rate-zero", ("bench", "bk_target:ok", "--rate", "0"), 2, "argument --rate: must be a finite number"),
    Case("bench-rate-negative", ("bench", "bk_target:ok", "--rate", "-100"), 2, "argument --rate"),
    Case("bench-rate-nan", ("bench", "bk_target:ok", "--rate", "nan"), 2, "argument --rate"),
    Case("bench-rate-huge", ("bench", "bk_target:ok", "--rate", "1e12"), 2, "argument --rate"),
    Case("bench-concurrency-zero", ("bench", "bk_target:ok", "--concurrency", "0"), 2, "argument --concurrency"),
    Case("bench-concurrency-huge", ("bench", "bk_target:ok", "--concurrency", "1e12"), 2, "argument --concurrency"),
    Case(
        "bench-rate-and-concurrency", ("bench", "bk_target:ok", "--rate", "5", "--concurrency", "2"), 2, "not allowed"
    ),
    Case("bench-duration-zero", ("bench", "bk_target:ok", "--duration", "0"), 2, "argument --duration"),
    Case("bench-timeout-zero", ("bench", "bk_target:ok", "--timeout", "0"), 2, "argument --timeout"),
    Case("bench-sla-negative", ("bench", "bk_target:ok", "--sla-ms", "-1"), 2, "argument --sla-ms"),
    # ---- bench: outputs, checked before the run (the hanging target proves nothing ran)
    Case("bench-json-no-folder", ("bench", "bk_target:hang", "--json", "no/such/dir/r.json"), 2, "cannot write"),
    Case("bench-json-is-folder", ("bench", "bk_target:hang", "--json", "."), 2, "argument --json: '.' is a folder"),
    Case("bench-plot-no-folder", ("bench", "bk_target:hang", "--plot", "no/such/dir/r.png"), 2, "argument --plot"),
    Case(
        "bench-plot-without-matplotlib",
        ("bench", "bk_target:hang", "--plot", "r.png"),
        2,
        "--plot needs matplotlib: pip install 'batchkit[plot]'",
        missing=("matplotlib",),
    ),
    # ---- bench: runs
    Case(
        "bench-duplicate-sizes-measured-once",
        ("bench", "bk_target:ok", "--no-progress", "--duration", "0.05", "--concurrency", "2", "--batch-sizes", "2,2"),
        0,
        stdout="QPS_max = mean batch at B_opt",
    ),
    Case(
        "bench-open-loop-with-json",
        ("bench", "bk_target:ok", "--rate", "100", "--duration", "0.1", "--batch-sizes", "2", "--json", "r.json"),
        0,
        stdout="wrote r.json",
    ),
    # ---- run (batchkit.jobs), mounted on the same command line
    Case("run-missing-input", ("run", "bk_target:ok", "--input", "nope.jsonl", "--output", "o.jsonl"), 2, "--input"),
    Case(
        "run-missing-module",
        ("run", "nosuch_module_xyz:f", "--input", "in.jsonl", "--output", "o.jsonl"),
        2,
        "no module",
    ),
    Case(
        "run-target-and-model",
        ("run", "bk_target:ok", "--model", "x", "--input", "in.jsonl", "--output", "o.jsonl"),
        2,
        "give MODULE:FUNCTION or --model, not both",
    ),
    Case("run-neither-target-nor-model", ("run", "--input", "in.jsonl", "--output", "o.jsonl"), 2, "or --model"),
    Case(
        "run-unknown-model",
        ("run", "--model", "no-such-model", "--input", "in.jsonl", "--output", "o.jsonl"),
        2,
        "argument --model: model source",
    ),
    # ---- serve: bad input is refused before the port opens
    Case("serve-no-model", ("serve",), 2, "give --model, --embedding-model, or both"),
    Case("serve-unknown-model", ("serve", "--model", "no-such-model"), 2, "argument --model: model source"),
    Case("serve-port-out-of-range", ("serve", "--model", "x", "--port", "70000"), 2, "argument --port: must be in"),
    Case("serve-num-blocks-zero", ("serve", "--model", "x", "--num-blocks", "0"), 2, "argument --num-blocks"),
    Case(
        "serve-num-blocks-one", ("serve", "--model", "x", "--num-blocks", "1"), 2, "argument --num-blocks: must be in 2"
    ),
    Case("serve-timeout-zero", ("serve", "--model", "x", "--request-timeout-s", "0"), 2, "--request-timeout-s"),
    Case("serve-wait-inf", ("serve", "--model", "x", "--embedding-max-wait-ms", "inf"), 2, "must be a finite"),
    Case("serve-quotas-missing", ("serve", "--model", "x", "--tenant-quotas", "nope.json"), 2, "--tenant-quotas"),
    # ---- the installed console script, from the folder holding the target
    Case("script-finds-target-in-cwd", ("bench", "bk_target:ok", *FAST), 0, stdout="B_opt", script=True),
    Case("script-target-raises", ("bench", "bk_target:boom", *FAST), 1, "ValueError: boom", script=True),
    Case("script-usage-error", ("plan", "--device-gib", "-1"), 2, "argument --device-gib", script=True),
    Case("script-help", ("bench", "--help"), 0, stdout="usage: batchkit bench", script=True),
    Case(
        "script-run-finds-target-in-cwd",
        ("run", "bk_target:ok", "--input", "in.jsonl", "--output", "out.jsonl"),
        0,
        stdout="2 succeeded",
        script=True,
    ),
]

# The one-line promise covers usage errors and failures without --traceback.
_ONE_LINE = {c.id for c in CASES if c.status != 0 and "--traceback" not in c.args}


def _script() -> str | None:
    return shutil.which("batchkit", path=str(Path(sys.executable).parent))


def _template(root: Path) -> Path:
    """A folder holding the target modules, config files and stand-ins that hide optional extras."""
    root.mkdir()
    (root / "bk_target.py").write_text(TARGET)
    (root / "bk_broken.py").write_text(BROKEN_IMPORT)
    (root / "in.jsonl").write_text('{"id": 1, "x": 2}\n{"id": 2, "x": 3}\n')
    (root / "bad.json").write_text('{"num_hidden_layers": 4,')
    (root / "list.json").write_text("[1, 2]")
    (root / "nohidden.json").write_text('{"num_hidden_layers": 4, "num_attention_heads": 8}')
    (root / "badlayers.json").write_text('{"num_hidden_layers": 0, "num_attention_heads": 8, "hidden_size": 64}')
    common = '"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096'
    (root / "fp8.json").write_text(f'{{{common}, "torch_dtype": "float8_e4m3fn"}}')
    (root / "int4.json").write_text(f'{{{common}, "torch_dtype": "int4"}}')
    for extra in ("torch", "matplotlib"):
        pkg = root / "hide" / extra / extra  # put hide/<extra> first on the path: importing <extra> fails
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{extra}'\", name='{extra}')\n")
    return root


def _run(case: Case, template: Path, base_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run one case; `base_env` is a copy of the environment taken in pytest's own thread (copying
    ``os.environ`` here, in a pool thread, races pytest setting PYTEST_CURRENT_TEST: KeyError)."""
    run_dir = shutil.copytree(template, template.parent / case.id)  # each case writes in its own folder
    env = dict(base_env)
    paths = [str(run_dir / "hide" / m) for m in case.missing]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if case.script:
        script = _script()
        assert script is not None
        cmd = [script, *case.args]
    else:
        cmd = [sys.executable, "-m", "batchkit", *case.args]
    return subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, timeout=LIMIT_S, check=False)


@pytest.fixture(scope="module")
def results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, concurrent.futures.Future[subprocess.CompletedProcess[str]]]]:
    """Start every selected case at once (4 at a time); each test waits for its own."""
    template = _template(tmp_path_factory.mktemp("cli") / "template")
    selected = {
        item.callspec.params["case"].id
        for item in request.session.items
        if hasattr(item, "callspec") and isinstance(item.callspec.params.get("case"), Case)
    }
    base_env = dict(os.environ)  # copied here, before any pool thread starts
    base_env.pop("PYTEST_CURRENT_TEST", None)
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        order = sorted((c for c in CASES if c.id in selected), key=lambda c: not c.slow)
        yield {c.id: pool.submit(_run, c, template, base_env) for c in order}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cli_case(case: Case, results: dict[str, concurrent.futures.Future[subprocess.CompletedProcess[str]]]) -> None:
    """The command ends within the limit with the promised exit status and message; a failure is
    one line on stderr (no traceback) unless --traceback was asked for."""
    if case.script and _script() is None:
        pytest.skip("the batchkit console script is not installed (pip install -e .)")
    proc = results[case.id].result(timeout=LIMIT_S * len(CASES))
    detail = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == case.status, detail
    assert case.stderr in proc.stderr, detail
    assert case.stdout in proc.stdout, detail
    if case.id in _ONE_LINE:
        assert len(proc.stderr.strip().splitlines()) == 1, detail
        assert "Traceback" not in proc.stderr, detail


def test_every_option_has_help_and_a_shown_default() -> None:
    """`--help` describes every option, and shows each default (explicitly when it is not a value)."""
    from batchkit.cli import _build_parser

    parser = _build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, p in sub.choices.items():  # type: ignore[union-attr]
        text = " ".join(p.format_help().split())  # undo the line wrapping
        for action in p._actions:
            assert action.help, f"{name} {action.option_strings} has no help"
            if action.required or action.dest == "help" or name == "run":  # run's help is batchkit.jobs's
                continue
            if action.default not in (None, False):
                assert f"(default: {action.default})" in text, f"{name} {action.dest}: default not shown"
            elif action.default is None:
                assert "default" in action.help, f"{name} {action.dest}: say what happens by default"


def test_one_by_one_baseline_serves_in_arrival_order() -> None:
    """The demo's unbatched baseline is a FIFO queue with one worker: inputs run one at a time, in
    the order they were submitted, so its latency percentiles reflect honest queueing."""
    torch = pytest.importorskip("torch")
    from batchkit.demo.mlp import OneByOneServer

    seen: list[int] = []
    started = threading.Event()
    release = threading.Event()

    def model(x: object) -> object:
        assert isinstance(x, torch.Tensor)
        assert x.shape == (1, 1)  # one input per call
        seen.append(int(x[0, 0]))
        started.set()
        assert release.wait(10)
        return x

    server = OneByOneServer(model)
    try:
        first = server.submit(torch.tensor([0.0]))
        assert started.wait(10)  # the worker is busy: the rest queue up behind it
        rest = [server.submit(torch.tensor([float(i)])) for i in (3, 1, 2)]
        release.set()
        for fut in [first, *rest]:
            fut.result(timeout=10)
    finally:
        release.set()
        server.close(timeout=10)
    assert seen == [0, 3, 1, 2]


def test_version_prints_the_installed_distributions_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`batchkit --version` prints `batchkit X.Y.Z` (the installed distribution's version) and
    exits 0; it needs no sub-command."""
    from batchkit.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"batchkit {importlib.metadata.version('batchkit')}\n"


def test_demo_warns_when_the_load_average_says_its_timings_will_not_hold() -> None:
    """A load of half the CPUs or more (at least 1) is other work on the CPUs the demo times."""
    from batchkit.demo.cli import busy_machine_warning as _busy_machine_warning

    warning = _busy_machine_warning(cpus=2, load=1.5)
    assert warning is not None
    assert warning.startswith("warning: the load average is 1.50 on 2 CPUs")
    assert "will not hold" in warning
    assert _busy_machine_warning(cpus=2, load=0.4) is None
    assert _busy_machine_warning(cpus=16, load=4.0) is None


# --------------------------------------------------------------------------- docs/jobs.md: the exit statuses


def test_top_level_help_lists_every_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/jobs.md documents 0, 1, 2 and 130; `batchkit --help` names all four."""
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for status in ("0 done", "1 the target or model failed", "2 a usage error", "130 interrupted"):
        assert status in out


def test_top_level_help_names_the_sigterm_status(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/jobs.md documents exit status 143 (terminated by SIGTERM) beside 0, 1, 2 and 130;
    `batchkit --help`, which lists the exit statuses, names it too."""
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "143 terminated" in out

"""The documentation is executable: what README.md and docs/ show runs as written.

- Every fenced ``python`` block runs, in order, one namespace per page (async blocks with
  top-level ``await`` run under anyio, on asyncio and on trio). README.md's blocks are whole
  programs: each runs alone, in a namespace of its own, compiled as a file is (no top-level
  ``await``), so that each one pasted into a file runs as written. A block behind a visible
  ``<!-- not-run: reason -->`` comment (one that needs a cluster, a server or a download) is
  compiled here and runs as written elsewhere, against small stand-ins (a tiny model, a local
  Ray instance): ``NOT_RUN_STAND_INS`` names the test that runs each page's not-run blocks.
  A block behind ``<!-- file: path -->`` is also written to ``path`` in the folder the page's
  commands run in (for example the module a ``batchkit bench`` line loads).
- Every ``bash`` line that invokes ``batchkit`` or ``python -m batchkit`` runs as written, with
  this file's small-size flags appended (argparse keeps the last value) and output files sent to a
  temporary folder. A plain block behind ``<!-- output: ... -->`` is the exact output of the
  command block before it.
- docs/api.md lists signatures in a form this file parses (`` `batchkit.Name(params)` `` at the
  start of a heading or list item, members as `` `method(params)` `` under it) and each one is
  compared with ``inspect.signature``: parameter names, kinds and defaults. Every public name is
  documented there.
- docs/continuous.md's "Guarantees" list is checked by the tests at the end of this file.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

import batchkit
from _docs import ROOT, WHOLE_PROGRAM_PAGES, Block, read_blocks, run_python_block
from _docs import compile_block as _compile

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WAIT = 30  # seconds: the bound on every wait in these tests
CLI_TIMEOUT = 120

# --------------------------------------------------------------------------- reading the pages

KNOWN_MARKERS = {"not-run", "file", "output"}
# The test that runs a page's not-run blocks as written, with stand-ins for what they need, so
# that an error in such a snippet cannot hide behind its marker.
NOT_RUN_STAND_INS = {
    "scale-out.md": "tests/integrations/test_ray.py::test_scale_out_snippets_run_against_stand_ins",
    "serving.md": "tests/docs/test_doc_promises_serving_clients.py::test_not_run_snippets_run_against_a_live_server",
}
# Pages whose not-run blocks no test runs yet, each with the reason; remove an entry when its
# runner lands.
NOT_RUN_PENDING: dict[str, str] = {}


def all_blocks() -> Iterator[Block]:
    for page in PAGES:
        yield from read_blocks(page)


def test_markers_are_known_and_give_a_reason() -> None:
    """A typo in a marker cannot silently exempt a snippet: every marker is known and says why."""
    for b in all_blocks():
        for key, value in b.markers.items():
            assert key in KNOWN_MARKERS, f"{b.where}: unknown marker {key!r}"
            assert value, f"{b.where}: marker {key!r} needs a value (the reason, the path...)"
        assert "not-run" not in b.markers or b.lang == "python", f"{b.where}: not-run only applies to python"


# --------------------------------------------------------------------------- python blocks


def test_every_not_run_snippet_has_a_test_that_runs_it() -> None:
    """A page with not-run python blocks names, in NOT_RUN_STAND_INS, a test that exists and runs
    them against stand-ins (or says in NOT_RUN_PENDING why none does yet)."""
    pages = {b.page.name for b in all_blocks() if "not-run" in b.markers}
    unrun = sorted(pages - set(NOT_RUN_STAND_INS) - set(NOT_RUN_PENDING))
    assert not unrun, f"no test runs the not-run snippets of {unrun}: add one to NOT_RUN_STAND_INS"
    for page, test in NOT_RUN_STAND_INS.items():
        path, _, name = test.partition("::")
        assert page in pages, f"{page} has no not-run block left: remove it from NOT_RUN_STAND_INS"
        assert f"def {name}(" in (ROOT / path).read_text(encoding="utf-8"), f"{test} does not exist"


def python_pages() -> list[Any]:
    params = []
    for page in PAGES:
        blocks = [b for b in read_blocks(page) if b.lang == "python"]
        if not blocks:
            continue
        is_async = page not in WHOLE_PROGRAM_PAGES and any(_compile(b).co_flags & inspect.CO_COROUTINE for b in blocks)
        for backend in ("asyncio", "trio") if is_async else ("asyncio",):
            params.append(pytest.param(page, backend, id=f"{page.name}-{backend}"))
    return params


@pytest.mark.parametrize(("page", "backend"), python_pages())
def test_python_snippets_run_as_written(
    page: Path, backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every python block of the page runs, in order, in one namespace (on a whole-program page,
    each alone in its own), and leaves no thread behind."""
    text = page.read_text(encoding="utf-8")
    if "torch" in text or "batchkit.models" in text:
        pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)  # a snippet that writes a file writes it here
    threads_before = set(threading.enumerate())
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for block in read_blocks(page):
        if block.lang != "python":
            continue
        if "not-run" in block.markers:
            _compile(block)  # still valid Python
            continue
        if "file" in block.markers:
            _write_file(tmp_path, block)
        if page in WHOLE_PROGRAM_PAGES:
            namespace = {"__name__": "__main__"}
        run_python_block(block, namespace, backend)
    _assert_no_thread_left(threads_before, page)


def _write_file(folder: Path, block: Block) -> None:
    target = folder / block.markers["file"]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(block.text, encoding="utf-8")
    init = target.parent / "__init__.py"
    if target.suffix == ".py" and target.parent != folder and not init.exists():
        init.write_text("", encoding="utf-8")


def _assert_no_thread_left(before: set[threading.Thread], page: Path) -> None:
    """A snippet that starts a batcher or a loop also closes it: the docs teach no leaks."""
    left = [t for t in threading.enumerate() if t not in before and t.name.startswith("batchkit")]
    for t in left:
        t.join(timeout=WAIT)
    alive = [t.name for t in left if t.is_alive()]
    assert not alive, f"{page.name}: the snippets leave {alive} running; close what they open"


# --------------------------------------------------------------------------- command lines

# Appended to a documented command so that it runs in seconds; argparse keeps the last value given,
# so the command as written is still parsed (and must be valid).
SMALL = {
    "demo": ["--seconds", "0.3", "--callers", "4", "--llm-requests", "4", "--llm-max-out", "8"],
    "bench": ["--duration", "0.2", "--batch-sizes", "1,2", "--concurrency", "4"],
    "plan": [],
    "run": [],
}
OUTPUT_FLAGS = {"--json", "--plot"}  # their files go to the test's temporary folder

# Commands the CLI cannot run yet, each with the reason; remove an entry when its fix lands.
PENDING: dict[str, str] = {}


@dataclass(frozen=True)
class Command:
    block: Block
    line: int
    argv: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.block.page.relative_to(ROOT)}:{self.line}"

    @property
    def args(self) -> list[str]:
        """The arguments after ``batchkit`` / ``python -m batchkit``."""
        return list(self.argv[1:] if self.argv[0] == "batchkit" else self.argv[3:])

    @property
    def subcommand(self) -> str:
        return next((a for a in self.args if not a.startswith("-")), "")


def commands_in(block: Block) -> list[Command]:
    """The ``batchkit`` / ``python -m batchkit`` lines of a bash block (continuations joined)."""
    out: list[Command] = []
    pending = ""
    first = 0
    for offset, raw in enumerate(block.text.splitlines(), start=1):
        if not pending:
            first = block.line + offset
        pending += raw.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        argv = shlex.split(pending, comments=True)
        pending = ""
        if argv and (argv[0] == "batchkit" or (argv[0].endswith("python") and argv[1:3] == ["-m", "batchkit"])):
            out.append(Command(block, first, tuple(argv)))
    return out


def documented_commands() -> list[Command]:
    return [c for b in all_blocks() if b.lang == "bash" for c in commands_in(b)]


def real_argv(cmd: Command, folder: Path) -> list[str]:
    """The command as written, run with this interpreter, small sizes, outputs in ``folder``."""
    if cmd.argv[0] == "batchkit":
        script = Path(sys.executable).with_name("batchkit")
        assert script.exists(), f"no batchkit console script beside {sys.executable}: pip install -e ."
        head = [str(script)]
    else:
        head = [sys.executable, "-m", "batchkit"]
    rest = cmd.args
    for i, arg in enumerate(rest[:-1]):
        if arg in OUTPUT_FLAGS:
            rest[i + 1] = str(folder / Path(rest[i + 1]).name)
    assert cmd.subcommand in SMALL, f"{cmd.where}: no small sizes known for `batchkit {cmd.subcommand}`; add to SMALL"
    return head + rest + SMALL[cmd.subcommand]


def _cli_params() -> list[Any]:
    params = []
    for cmd in documented_commands():
        marks = [pytest.mark.xfail(reason=r, strict=False) for key, r in PENDING.items() if key in " ".join(cmd.argv)]
        params.append(pytest.param(cmd, id=cmd.where, marks=marks))
    return params


def run_command(cmd: Command, folder: Path) -> subprocess.CompletedProcess[str]:
    """Run a documented command in ``folder``, after writing the page's ``file:`` blocks there."""
    for b in read_blocks(cmd.block.page):
        if "file" in b.markers:
            _write_file(folder, b)
    env = {**os.environ, "MPLBACKEND": "Agg"}
    env.pop("PYTHONPATH", None)  # the command finds the user's module from the folder, as a user's would
    return subprocess.run(
        real_argv(cmd, folder), cwd=folder, env=env, capture_output=True, text=True, timeout=CLI_TIMEOUT, check=False
    )


@pytest.mark.parametrize("cmd", _cli_params())
def test_cli_lines_run_as_written(cmd: Command, tmp_path: Path) -> None:
    """Each documented command line exits 0 (with small sizes) and prints something."""
    rest = cmd.args[1:]
    target = rest[0] if rest and not rest[0].startswith("-") else "demo"
    if cmd.subcommand == "demo" or (cmd.subcommand == "bench" and target == "demo"):
        pytest.importorskip("torch")  # the demo serves a torch model
    result = run_command(cmd, tmp_path)
    assert result.returncode == 0, f"{cmd.where}: `{' '.join(cmd.argv)}` failed:\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), f"{cmd.where}: printed nothing"
    for i, arg in enumerate(cmd.argv[:-1]):
        if arg in OUTPUT_FLAGS:
            assert (tmp_path / Path(cmd.argv[i + 1]).name).stat().st_size > 0, f"{cmd.where}: {arg} wrote nothing"


def _outputs() -> list[Any]:
    params = []
    for page in PAGES:
        blocks = read_blocks(page)
        for prev, b in itertools.pairwise(blocks):
            if "output" in b.markers:
                params.append(pytest.param(prev, b, id=b.where))
    return params


@pytest.mark.parametrize(("command_block", "output_block"), _outputs())
def test_documented_output_is_what_the_command_prints(
    command_block: Block, output_block: Block, tmp_path: Path
) -> None:
    """A block marked as a command's output is exactly what that command prints today."""
    cmds = commands_in(command_block)
    assert command_block.lang == "bash", f"{output_block.where}: an output follows a bash block"
    assert len(cmds) == 1, f"{output_block.where}: an output follows a block of one command"
    sub = cmds[0].subcommand
    assert not SMALL[sub], f"{output_block.where}: `{sub}` runs with changed sizes; its output cannot be exact"
    result = run_command(cmds[0], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.rstrip() == output_block.text.rstrip()


# --------------------------------------------------------------------------- docs/api.md against the code

API_PAGE = ROOT / "docs" / "api.md"
ENTRY = re.compile(r"^(?P<lead>#+|-)\s+(?=`)")
SPAN = re.compile(r"`(?P<name>[A-Za-z_][\w.]*)(?:\((?P<params>[^`]*)\))?(?:\s*->[^`]*)?`(?:,\s*|:|\s|$)")
# Modules whose public names (``__all__``) api.md documents one by one.
SUBMODULES = ("collate", "sim", "testing", "kv", "continuous", "bench", "models")
HEAVY = ("models",)  # need torch


@dataclass(frozen=True)
class Entry:
    """One documented name: ``batchkit.X(...)`` or, under such a heading, a member ``m(...)``."""

    line: int
    path: str  # dotted, from batchkit: "DynamicBatcher", "DynamicBatcher.submit", "kv.plan"
    params: str | None  # None: an attribute or property (no parentheses)

    @property
    def where(self) -> str:
        return f"docs/api.md:{self.line}"


def api_entries() -> list[Entry]:
    """The signatures of docs/api.md: the code spans that open a heading, or open a list item
    (several, separated by commas: `` - `a()`, `b(x)`: ... ``)."""
    entries: list[Entry] = []
    owner: str | None = None
    for n, line in enumerate(API_PAGE.read_text(encoding="utf-8").splitlines(), start=1):
        lead = ENTRY.match(line)
        if line.startswith("#") and not (lead and SPAN.match(line, lead.end())):
            owner = None  # a plain heading ends the members of the last one
        if not lead:
            continue
        pos = lead.end()
        while m := SPAN.match(line, pos):
            name = m.group("name")
            if name.startswith("batchkit."):
                path = name.removeprefix("batchkit.")
                if lead.group("lead").startswith("#"):
                    owner = path
            else:
                assert owner is not None, f"docs/api.md:{n}: member {name!r} under no `batchkit.X(...)` heading"
                path = f"{owner}.{name}"
            entries.append(Entry(n, path, m.group("params")))
            if lead.group("lead").startswith("#") or not m.group(0).rstrip().endswith(","):
                break
            pos = m.end()
            assert pos < len(line), f"docs/api.md:{n}: keep a list of signatures on one line"
    return entries


INSTANCE_ATTRIBUTE = object()  # what resolve() returns for an attribute each instance sets


def resolve(path: str) -> tuple[Any, Any]:
    """(owner, object) for a dotted path from ``batchkit``."""
    if path.split(".")[0] in HEAVY:
        pytest.importorskip("torch")
    owner: Any = None
    obj: Any = batchkit
    for part in path.split("."):
        if inspect.isclass(obj) and not hasattr(obj, part) and _sets_attribute(obj, part):
            return obj, INSTANCE_ATTRIBUTE
        owner, obj = obj, getattr(obj, part)
    return owner, obj


def _sets_attribute(cls: type, name: str) -> bool:
    if name in getattr(cls, "__slots__", ()):
        return True
    return re.search(rf"\bself\.{name}\s*[:=]", inspect.getsource(cls)) is not None


Param = tuple[str, str, str | None]  # name, kind, default (source text) or None


def documented_params(text: str) -> list[Param]:
    fn = ast.parse(f"def f({text}): pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    a = fn.args
    positional = [(p, "POSITIONAL_ONLY") for p in a.posonlyargs] + [(p, "POSITIONAL_OR_KEYWORD") for p in a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out: list[Param] = [
        (p.arg, kind, None if d is None else ast.unparse(d)) for (p, kind), d in zip(positional, defaults, strict=True)
    ]
    if a.vararg:
        out.append((a.vararg.arg, "VAR_POSITIONAL", None))
    for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append((p.arg, "KEYWORD_ONLY", None if d is None else ast.unparse(d)))
    if a.kwarg:
        out.append((a.kwarg.arg, "VAR_KEYWORD", None))
    return out


def actual_params(owner: Any, name: str, obj: Any) -> list[tuple[str, str, Any]]:
    """(name, kind, default or inspect.Parameter.empty), without ``self``."""
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())
    if inspect.isclass(owner) and inspect.isfunction(inspect.getattr_static(owner, name)):
        params = params[1:]  # self (static and class methods are not plain functions here)
    factory = {}
    if dataclasses.is_dataclass(obj) and inspect.isclass(obj):
        factory = {
            f.name: f.default_factory() for f in dataclasses.fields(obj) if f.default_factory is not dataclasses.MISSING
        }
    return [(p.name, p.kind.name, factory.get(p.name, p.default)) for p in params]


def same_default(documented: str, actual: Any) -> bool:
    if documented == "...":
        return type(actual) is object or type(actual).__name__.startswith("_")  # a private "not given" sentinel
    try:
        value = ast.literal_eval(documented)
    except ValueError:
        return documented == repr(actual)
    if type(value) in (int, float) and type(actual) in (int, float):
        return bool(value == actual)  # 99 documents 99.0
    return type(value) is type(actual) and bool(value == actual)


def _entry_params() -> list[Any]:
    return [pytest.param(e, id=e.path) for e in api_entries()]


@pytest.mark.parametrize("entry", _entry_params())
def test_api_md_matches_the_code(entry: Entry) -> None:
    """Each signature in docs/api.md has the code's parameter names, kinds and defaults."""
    owner, obj = resolve(entry.path)
    if entry.params is None:
        return  # an attribute: resolving it was the check
    assert callable(obj), f"{entry.where}: {entry.path} is not callable"
    doc = documented_params(entry.params)
    real = actual_params(owner, entry.path.rsplit(".", 1)[-1], obj)
    assert [(n, k) for n, k, _ in doc] == [(n, k) for n, k, _ in real], (
        f"{entry.where}: {entry.path} parameters differ from the code: documented {doc}, actual {real}"
    )
    for (name, _, d), (_, _, a) in zip(doc, real, strict=True):
        if a is inspect.Parameter.empty:
            assert d is None, f"{entry.where}: {entry.path}({name}) has no default in the code, documented {d}"
        else:
            assert d is not None, f"{entry.where}: {entry.path}({name}) defaults to {a!r}; the doc shows it required"
            assert same_default(d, a), f"{entry.where}: {entry.path}({name}) default is {a!r}, documented {d}"


def public_paths() -> set[str]:
    """Dotted paths from ``batchkit`` of every public name api.md must document."""
    paths: set[str] = set()
    for name in batchkit.__all__:
        obj = getattr(batchkit, name)
        if name == "__version__" or inspect.ismodule(obj) or _is_error(obj):
            continue
        paths.add(name)
    for mod_name in SUBMODULES:
        if mod_name in HEAVY and not _has_torch():
            continue
        mod = getattr(batchkit, mod_name)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if _is_error(obj) or getattr(batchkit, name, None) is obj:
                continue  # documented as batchkit.<name>
            paths.add(f"{mod_name}.{name}")
    return paths


def _is_error(obj: Any) -> bool:
    return inspect.isclass(obj) and issubclass(obj, BaseException)


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def public_members(cls: type) -> set[str]:
    """Methods and properties a class of batchkit's defines (not fields, not inherited from torch)."""
    names: set[str] = set()
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("batchkit"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in fields:
                continue
            if isinstance(value, (property, staticmethod, classmethod)) or inspect.isfunction(value):
                names.add(name)
    return names


def test_api_md_documents_every_public_name() -> None:
    """Every public name (and every method of a public class) has an entry in docs/api.md."""
    documented = {e.path for e in api_entries()}
    missing = sorted(public_paths() - documented)
    assert not missing, f"docs/api.md has no entry for {missing}"
    for path in sorted(documented):
        _, obj = resolve(path)
        if inspect.isclass(obj) and not _is_error(obj) and not issubclass(obj, __import__("enum").Enum):
            undocumented = sorted(m for m in public_members(obj) if f"{path}.{m}" not in documented)
            assert not undocumented, f"docs/api.md: {path} does not list {undocumented}"


def test_api_md_names_every_error() -> None:
    """Every public error class is named in docs/api.md (with the builtin it also is)."""
    text = API_PAGE.read_text(encoding="utf-8")
    for name in batchkit.__all__:
        if _is_error(getattr(batchkit, name)):
            assert f"`{name}`" in text, f"docs/api.md does not name {name}"


def test_everything_api_md_shows_is_reachable_from_import_batchkit() -> None:
    """api.md's promise: after a bare ``import batchkit`` every documented path resolves."""
    # Members are checked above; here, the module-level path of each entry.
    paths = sorted(
        {".".join(e.path.split(".")[: 2 if e.path.split(".")[0] in SUBMODULES else 1]) for e in api_entries()}
    )
    # The torch-backed paths: tests/docs/test_public_api.py resolves batchkit.models from a bare import.
    paths = [p for p in paths if p.split(".")[0] not in HEAVY]
    code = "import batchkit, functools\nfor p in " + repr(paths) + ": functools.reduce(getattr, p.split('.'), batchkit)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=CLI_TIMEOUT, check=False)
    assert out.returncode == 0, out.stderr[-2000:]


# --------------------------------------------------------------------------- what the pages say about the project


def test_benchmark_commands_name_the_venv_interpreter() -> None:
    """A benchmark command in the docs runs with the project's interpreter (.venv/bin/python or
    scripts/dev bench): a bare ``python`` may be one without batchkit or torch."""
    for page in PAGES:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
            for m in re.finditer(r"(\S*)\s+benchmarks/\w+\.(?:py|sh)", line):
                runner = m.group(1).strip("`(")
                assert runner in (".venv/bin/python", "bash"), (
                    f"{page.relative_to(ROOT)}:{n}: run benchmarks with .venv/bin/python (or scripts/dev bench), "
                    f"not {runner!r}"
                )


def test_readme_lists_every_extra() -> None:
    """README.md's install section names every optional extra of pyproject.toml, and no other."""
    tomllib = pytest.importorskip("tomllib")
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    )
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`batchkit\[([\w-]+)\]`", readme))
    assert named == extras, f"README names extras {sorted(named)}; pyproject.toml has {sorted(extras)}"


def test_relative_links_point_at_files() -> None:
    """Every relative link in README.md and docs/ names a file or folder that exists."""
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)}: broken link {target}"


# --------------------------------------------------------------------------- docs/continuous.md "Guarantees"

VOCAB = 16


def _one_token_logits(batch: Any, token: int = 1) -> Any:
    torch = pytest.importorskip("torch")
    logits = torch.zeros(len(batch.sample_indices), VOCAB)
    logits[:, token] = 1.0
    return logits


def _loop(step: Callable[..., Any] | None = None, num_blocks: int = 64, block_size: int = 4, **kw: Any) -> Any:
    pytest.importorskip("torch")
    kv = batchkit.PagedKVCache(num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=1, head_dim=4)
    return batchkit.ContinuousDecodeLoop(step or (lambda batch, kv: _one_token_logits(batch)), kv, **kw)


def test_guarantee_a_prefix_hits_only_after_the_step_that_writes_them() -> None:
    """Guarantee (a), allocator level: a full block is a hit only once marked computed."""
    alloc = batchkit.PagedKVAllocator(num_blocks=32, block_size=4, enable_prefix_caching=True)
    prompt = list(range(1, 11))  # two full blocks and a partial one
    alloc.allocate("first", prompt)
    assert alloc.allocate("twin-before-the-step", prompt) == 0  # nothing written yet
    alloc.mark_computed("first", 4)  # the step wrote block 0 only
    assert alloc.allocate("twin-after-one-block", prompt) == 4
    alloc.mark_computed("first", 10)
    assert alloc.allocate("twin-after-the-prompt", prompt) == 8


def test_guarantee_a_a_request_aborted_mid_prefill_leaves_only_its_computed_blocks() -> None:
    """Guarantee (a), scheduler level: abort after one prefill chunk has run and another was
    scheduled; an identical prompt then reuses the computed chunk's block and nothing more."""
    from batchkit.continuous import Request

    alloc = batchkit.PagedKVAllocator(num_blocks=32, block_size=4, enable_prefix_caching=True)
    sched = batchkit.Scheduler(alloc, max_num_batched_tokens=4)  # prefill in chunks of one block
    prompt = list(range(1, 14))
    sched.add(Request("a", prompt, batchkit.SamplingParams(max_new_tokens=2)))
    sched.update(sched.schedule(), [])  # chunk 1 (tokens 0..3) computed
    in_flight = sched.schedule()  # chunk 2 scheduled, its K/V not written yet
    assert sched.abort("a")
    sched.update(in_flight, [])
    sched.add(Request("b", prompt, batchkit.SamplingParams(max_new_tokens=2)))
    sched.schedule()
    b = sched.get("b")
    assert b is not None
    assert b.num_computed == 4
    assert alloc.statistics().prefix_hits == 4  # block 0 only: chunk 2 never ran


def test_guarantee_b_stop_strings_without_detokenize_are_refused_at_submit() -> None:
    """Guarantee (b): stop= without detokenize= is a ValueError naming the fix, before any work."""
    loop = _loop()
    try:
        with pytest.raises(ValueError, match=r"detokenize=.*ContinuousDecodeLoop"):
            loop.submit([1, 2, 3], max_new_tokens=4, stop=["\n"])
        with pytest.raises(ValueError, match="detokenize="):
            next(iter(loop.generate_sync([1, 2, 3], max_new_tokens=4, stop=["\n"])))
        assert loop.statistics().scheduler.waiting == 0
        assert loop.submit([1, 2, 3], max_new_tokens=2).result(timeout=WAIT) == [1, 1]  # still serving
    finally:
        loop.close()


def test_guarantee_c_a_request_that_outgrows_the_cache_fails_alone_and_frees_its_blocks() -> None:
    """Guarantee (c): with the pool to itself, a request that outgrows it ends with
    KVCacheExhausted from its stream and from its future; its blocks return; others are served."""
    loop = _loop(num_blocks=4, block_size=4, watermark=0.0)  # 3 usable blocks: 12 tokens
    try:
        tokens: list[int] = []

        def stream() -> None:
            for tok in loop.generate_sync([1, 2, 3, 4], max_new_tokens=50, ignore_eos=True):
                tokens.append(tok)

        with pytest.raises(batchkit.KVCacheExhausted):
            stream()
        assert 0 < len(tokens) < 50  # it streamed what fitted, then failed
        with pytest.raises(batchkit.KVCacheExhausted):
            loop.submit([1, 2, 3, 4], max_new_tokens=50).result(timeout=WAIT)
        assert loop.statistics().scheduler.kv_usage == 0
        assert loop.submit([5, 6], max_new_tokens=3).result(timeout=WAIT) == [1, 1, 1]
    finally:
        loop.close()


def test_guarantee_d_max_waiting_refuses_new_requests_at_once() -> None:
    """Guarantee (d): with max_waiting requests already waiting, submit and generate raise
    QueueFull at once; the queued ones are still served."""
    entered, release = threading.Event(), threading.Event()

    def step(batch: Any, kv: Any) -> Any:
        entered.set()
        assert release.wait(WAIT)
        return _one_token_logits(batch)

    loop = _loop(step, max_num_seqs=1, max_waiting=1)
    try:
        running = loop.submit([1], max_new_tokens=1)
        assert entered.wait(WAIT)  # the engine is inside the first request's step
        waiting = loop.submit([2], max_new_tokens=1)  # the one waiting request allowed
        with pytest.raises(batchkit.QueueFull, match="max_waiting"):
            loop.submit([3], max_new_tokens=1)
        with pytest.raises(batchkit.QueueFull):
            next(iter(loop.generate_sync([3], max_new_tokens=1)))
        release.set()
        assert running.result(timeout=WAIT) == [1]
        assert waiting.result(timeout=WAIT) == [1]
    finally:
        release.set()
        loop.close()


@pytest.mark.anyio
async def test_guarantee_d_async_generate_is_refused_too() -> None:
    """Guarantee (d) for async callers: generate() raises QueueFull on its first iteration."""
    entered, release = threading.Event(), threading.Event()

    def step(batch: Any, kv: Any) -> Any:
        entered.set()
        assert release.wait(WAIT)
        return _one_token_logits(batch)

    loop = _loop(step, max_num_seqs=1, max_waiting=1)
    try:
        first = loop.submit([1], max_new_tokens=1)
        with anyio.fail_after(WAIT):
            await anyio.to_thread.run_sync(entered.wait, WAIT)
        second = loop.submit([2], max_new_tokens=1)
        with pytest.raises(batchkit.QueueFull):
            async for _ in loop.generate([3], max_new_tokens=1):
                pass
        release.set()
        assert first.result(timeout=WAIT) == [1]
        assert second.result(timeout=WAIT) == [1]
    finally:
        release.set()
        await loop.aclose()

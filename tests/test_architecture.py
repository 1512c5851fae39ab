"""The layout of docs/architecture.md, held by the code: no module reaches into another's
private attributes, and no module imports from a floor above its own."""

from __future__ import annotations

import ast
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "batchkit"

# (file, attribute) pairs where a module still reads another object's private attribute. Each
# entry says why it remains and what removes it. A NEW pair fails the test: name the interface
# instead (a public method or attribute with a docstring). An entry that no longer occurs only
# warns, so that whoever removes a violation can delete its line here at leisure.
ALLOWED_PRIVATE_REACHES: dict[tuple[str, str], str] = {
    # The standard library's fast accessor of the running loop (no exception when there is
    # none); asyncio.get_running_loop raises instead, which the hot path cannot afford.
    ("_waiters.py", "_get_running_loop"): "asyncio's private accessor",
    # torch's oneDNN linear on a weight reordered once has no public API on CPU (ipex wraps the
    # same ops); a tensor's _version is how a cached reordered copy learns its weight was written.
    # Removed when torch exposes prepacked linears publicly, or when the step is compiled.
    ("models/llama.py", "_reorder_linear_weight"): "torch.ops.mkldnn's weight reorder",
    ("models/llama.py", "_linear_pointwise"): "torch.ops.mkldnn's prepacked linear",
    ("models/llama.py", "_version"): "torch.Tensor's in-place write counter",
    # os._exit: `batchkit serve` stopped while --compile-step background still compiles ends
    # without finalizing the interpreter, which aborts with a thread inside torch's C++.
    ("serve/cli.py", "_exit"): "os._exit, the process's end without finalization",
}

# Floors of docs/architecture.md ("Layout and floors"): a module may import only from lower
# floors, or from its own subpackage. A dotted name covers a subpackage and its modules unless
# a module is listed on its own.
FLOORS: dict[str, int] = {
    "_errors": 0,
    "_argtypes": 0,
    "_clock": 0,
    "_cpu": 0,
    "_waiters": 0,
    "_validate": 0,
    "dynamic._progress": 0,
    "metrics": 0,
    "collate": 0,
    "testing": 0,
    "kv.ops": 0,
    "kv.planner": 1,
    "kv.attention": 1,
    "kv.native": 0,
    "kv.blocks": 0,
    "kv.tables": 0,
    "kv.prefix": 0,
    "kv.swap": 0,
    "_cuda": 0,
    "continuous.sampling": 0,
    "continuous.step": 0,
    "continuous.stops": 0,
    "continuous.logprobs": 0,
    "continuous.grammar": 0,
    "continuous.request": 1,
    "continuous.options": 1,
    "continuous.stream": 1,
    "dynamic._queue_core": 1,
    "dynamic._loop_thread": 1,
    "dynamic._offload": 0,
    "dynamic.ledger": 1,
    "dynamic.batch_function": 1,
    "control.controller": 1,
    "control.breaker": 1,
    "control.tuner": 1,
    "control": 1,
    "kv.quotas": 1,
    "kv.supply": 1,
    "kv.growth": 1,
    "kv.sequences": 1,
    "kv.swapping": 1,
    "kv.allocator": 1,
    "kv.cache": 1,
    "dynamic.queue": 2,
    "dynamic.former": 2,
    "continuous.queues": 2,
    "continuous.preemption": 2,
    "continuous.scheduler": 2,
    "continuous.runner": 2,
    "kv": 2,
    "kv.compiled": 2,
    "dynamic._threads": 3,
    "dynamic._loop_pump": 3,
    "dynamic.shell": 3,
    "dynamic.batcher": 3,
    "sim": 3,
    "continuous.inbox": 3,
    "continuous.engine": 3,
    "continuous.submit": 3,
    "continuous.loop": 3,
    "continuous": 4,
    "dynamic.async_batcher": 4,
    "models": 4,
    "demo.mlp": 4,
    "bench": 5,
    "dynamic.decorator": 5,
    "dynamic": 5,
    "demo.llm": 5,
    "demo": 5,
    "jobs": 6,
    "jobs.openai_batch": 7,  # answers OpenAI Batch lines with serve/'s wire format: above serve/
    "serve": 6,
    "integrations": 6,
    "cli": 7,
    "__main__": 8,
    "": 9,  # batchkit/__init__.py
}


def _dotted(path: Path) -> str:
    """A module's dotted name relative to batchkit ("" for the package's ``__init__.py``), from
    its path relative to the package (a folder stands for its ``__init__.py``)."""
    parts = list(path.with_suffix("").parts) if path.suffix else list(path.parts)
    if parts and parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> list[tuple[str, Path]]:
    """Every module of the package as (dotted name relative to batchkit, path)."""
    return [(_dotted(path.relative_to(PACKAGE)), path) for path in sorted(PACKAGE.rglob("*.py"))]


def _is_package(name: str) -> bool:
    return (PACKAGE / name.replace(".", "/") / "__init__.py").exists() or name == ""


def _exists(name: str) -> bool:
    rel = name.replace(".", "/")
    return _is_package(name) or (PACKAGE / f"{rel}.py").exists()


def _floor(name: str) -> int | None:
    """The floor of a module, or of the nearest subpackage that contains it (None: unplaced;
    the package root's floor covers only ``__init__.py``)."""
    probe = name
    while probe:
        if probe in FLOORS:
            return FLOORS[probe]
        probe = probe.rpartition(".")[0]
    return FLOORS[""] if name == "" else None


def _own_names(tree: ast.AST) -> set[str]:
    """Private names this module defines itself (functions, methods, classes, assigned
    attributes and variables): reading them on another object is the module's own business."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries
    return {n for n in names if n.startswith("_")}


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str | None:
    """The batchkit-relative dotted name an import statement refers to (None: not batchkit)."""
    if node.level == 0:
        if node.module is None or not (node.module == "batchkit" or node.module.startswith("batchkit.")):
            return None
        return node.module.removeprefix("batchkit").removeprefix(".")
    base = module.split(".") if module else []
    if not is_pkg:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
    if node.module:
        base = [*base, *node.module.split(".")]
    return ".".join(base)


def _private_reaches() -> dict[tuple[str, str], int]:
    found: dict[tuple[str, str], int] = {}
    for module, path in _modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        own = _own_names(tree)
        rel = str(path.relative_to(PACKAGE)).replace("\\", "/")
        for node in ast.walk(tree):
            attr = None
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                v = node.value
                if isinstance(v, ast.Name) and v.id in ("self", "cls"):
                    continue
                if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super":
                    continue
                if node.attr in own and isinstance(v, ast.Name):
                    continue  # e.g. ``stream._next_or_park()`` on a class of this module
                attr = node.attr
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, path.name == "__init__.py", node)
                if target is None:
                    continue
                for alias in node.names:
                    name = alias.name
                    if not name.startswith("_") or name.startswith("__"):
                        continue
                    if _exists(f"{target}.{name}" if target else name):
                        continue  # a package-private module: shared through its public names
                    attr = name
                    found[(rel, attr)] = found.get((rel, attr), 0) + 1
                continue
            if attr is not None:
                found[(rel, attr)] = found.get((rel, attr), 0) + 1
    return found


def test_no_new_reaches_into_private_attributes() -> None:
    """No module reads another object's private attribute (``x._name``, ``from m import _name``)
    beyond the commented allow-list: what two modules share is a named, documented interface."""
    found = _private_reaches()
    new = sorted(k for k in found if k not in ALLOWED_PRIVATE_REACHES)
    assert not new, (
        "modules reach into privates of other objects (file, attribute): "
        f"{new}; add a public method or attribute to the owner instead"
    )
    stale = sorted(k for k in ALLOWED_PRIVATE_REACHES if k not in found)
    if stale:
        warnings.warn(f"allow-list entries no longer needed, delete them: {stale}", stacklevel=1)


def test_every_module_has_a_floor() -> None:
    """Every module of the package is placed on a floor of docs/architecture.md."""
    missing = [name for name, _ in _modules() if _floor(name) is None]
    assert not missing, f"add these modules to docs/architecture.md and FLOORS: {missing}"


def _imported_modules(module: str, path: Path) -> list[str]:
    """The batchkit modules ``module`` imports (dotted, relative to batchkit), lazy imports included."""
    targets: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = _resolve(module, path.name == "__init__.py", node)
            if base is None:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}" if base else alias.name
                targets.append(sub if _exists(sub) else base)
        elif isinstance(node, ast.Import):
            targets += [
                a.name.removeprefix("batchkit").removeprefix(".")
                for a in node.names
                if a.name == "batchkit" or a.name.startswith("batchkit.")
            ]
    return targets


@pytest.mark.parametrize(("module", "path"), _modules(), ids=[name or "batchkit" for name, _ in _modules()])
def test_imports_go_down_the_floors(module: str, path: Path) -> None:
    """A module imports only from lower floors of docs/architecture.md (or its own subpackage),
    lazy imports included: the cores never depend on their shells."""
    own = _floor(module)
    assert own is not None
    upward = []
    for target in _imported_modules(module, path):
        parent = module.rpartition(".")[0]
        same_package = parent != "" and (parent == target.rpartition(".")[0] or parent == target)
        same_package = same_package or target.startswith(f"{module}.")
        floor = _floor(target)
        if same_package or floor is None:
            continue
        if floor >= own:
            upward.append(f"{target} (floor {floor})")
    assert not upward, f"{module} (floor {own}) imports from its floor or above: {upward}"


# The package rules of docs/architecture.md: (package, what it may import from outside itself).
PACKAGE_RULES: dict[str, tuple[str, ...]] = {
    "kv": ("_errors", "_validate", "_cuda", "_cpu"),
    "control": ("_errors", "_validate", "_clock"),
    "dynamic": ("_errors", "_validate", "_clock", "_waiters", "metrics", "control"),
    "continuous": ("_errors", "_validate", "_clock", "_waiters", "metrics", "control", "kv"),
}


@pytest.mark.parametrize("package", sorted(PACKAGE_RULES))
def test_packages_import_only_what_their_rule_allows(package: str) -> None:
    """kv imports nothing above it; control nothing of what it drives; dynamic and continuous
    never import each other (docs/architecture.md, "Package rules")."""
    allowed = PACKAGE_RULES[package]
    broken = sorted(
        f"{module} imports {target}"
        for module, path in _modules()
        if module == package or module.startswith(f"{package}.")
        for target in _imported_modules(module, path)
        if not (target == package or target.startswith(f"{package}."))
        and not any(target == a or target.startswith(f"{a}.") for a in allowed)
    )
    assert not broken, f"{package}/ breaks its package rule: {broken}"


def test_the_package_rules_are_the_ones_the_architecture_doc_states() -> None:
    """Each package rule here is a line of docs/architecture.md's "Package rules" section."""
    text = ARCHITECTURE_MD.read_text(encoding="utf-8")
    section = text[text.index("## Package rules") :].split("\n## ")[0]
    missing = [
        package
        for package, allowed in PACKAGE_RULES.items()
        if not re.search(rf"^- `{package}/` imports .*" + "".join(f"(?=.*`{a}`)" for a in allowed), section, re.M)
    ]
    assert not missing, f"docs/architecture.md's package rules do not state the rule of: {missing}"


# Scripts that use batchkit as its users do: they may import only public names, and every name
# they import must exist (a renamed module fails here, not when someone runs the script).
SCRIPTS = sorted(
    [*(PACKAGE.parent.parent / "benchmarks").glob("*.py"), *(PACKAGE.parent.parent / "examples").glob("*.py")]
)
# The GPU scripts time and probe the kernel module itself (its launch switches, raw kernels).
PRIVATE_OK = {("gpu_probe.py", "_cuda"), ("kv_kernels.py", "_cuda")}


def _batchkit_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, name) for each ``from batchkit... import name`` and (module, None) for each
    ``import batchkit...`` of a script, lazy imports included."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            if node.module == "batchkit" or node.module.startswith("batchkit."):
                out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names if a.name == "batchkit" or a.name.startswith("batchkit.")]
    return out


@pytest.mark.parametrize("path", SCRIPTS, ids=[f"{p.parent.name}/{p.name}" for p in SCRIPTS])
def test_scripts_import_public_names_that_exist(path: Path) -> None:
    """Every batchkit module and name a benchmark or example imports exists and is public."""
    import importlib

    bad = []
    for module, name in _batchkit_imports(path):
        parts = [*module.split(".")[1:], *([name] if name is not None else [])]
        private = [p for p in parts if p.startswith("_") and (path.name, p) not in PRIVATE_OK]
        if private:
            bad.append(f"{module}{'' if name is None else ' import ' + name}: private {private}")
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and (exc.name == "batchkit" or exc.name.startswith("batchkit.")):
                bad.append(f"{module}: no such module")
                continue
            pytest.skip(f"{path.name} needs {exc.name}")
        if name is not None and not hasattr(mod, name) and not _exists(".".join([*module.split(".")[1:], name])):
            bad.append(f"{module} import {name}: no such name")
    assert not bad, f"{path.name}: {bad}"


# The "Layout and floors" table of docs/architecture.md, read as data: each row's floor, module
# (a file, or a folder ending in "/") and the backticked names of its "owns" cell.
ARCHITECTURE_MD = PACKAGE.parent.parent / "docs" / "architecture.md"
ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`([^`]+)`\s*\|(.*)\|[^|]*\|\s*$")
CODE_NAME = re.compile(r"@?([A-Za-z_]\w*)(?:\(.*\))?")


@dataclass(frozen=True)
class FloorRow:
    floor: int
    module: str  # as the table spells it: "kv/planner.py", "jobs/", "__init__.py"
    owns: tuple[str, ...]  # the backticked words of the "owns" cell

    @property
    def dotted(self) -> str:
        return _dotted(Path(self.module))

    @property
    def files(self) -> list[Path]:
        """The files the row covers: its own file, or a folder's __init__.py and the files its
        "owns" cell names."""
        if not self.module.endswith("/"):
            return [PACKAGE / self.module]
        folder = PACKAGE / self.module
        return [folder / "__init__.py", *(folder / w for w in self.owns if re.fullmatch(r"[\w.]+\.(py|cu)", w))]


def _floor_table() -> list[FloorRow]:
    rows = []
    for line in ARCHITECTURE_MD.read_text(encoding="utf-8").splitlines():
        if m := ROW.match(line):
            rows.append(FloorRow(int(m.group(1)), m.group(2), tuple(re.findall(r"`([^`]+)`", m.group(3)))))
    return rows


def _defined_names(path: Path) -> set[str]:
    """What a module defines or imports: functions, classes, methods, assigned names, attributes."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _module_file(dotted: str) -> Path:
    rel = PACKAGE / dotted.replace(".", "/")
    return rel / "__init__.py" if _is_package(dotted) else rel.with_suffix(".py")


def _known_names(row: FloorRow) -> set[str]:
    """What a row's files define, and what the batchkit modules they import from define (a row
    may name what it drives: ``AsyncBatcher`` drives ``BatchFormer``)."""
    own = [p for p in row.files if p.suffix == ".py" and p.exists()]
    used = []
    for path in own:
        module = _dotted(path.relative_to(PACKAGE))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            target = _resolve(module, path.name == "__init__.py", node) if isinstance(node, ast.ImportFrom) else None
            if target and _exists(target):
                used.append(_module_file(target))
    return set().union(*(_defined_names(p) for p in [*own, *used]))


def _is_defined(row: FloorRow, word: str, names: set[str]) -> bool:
    """Whether a backticked word of a row's "owns" cell names something that exists (words that
    are not code names, such as ``batchkit run`` or ``paged_kv.cu``, pass)."""
    if word.startswith("batchkit."):
        return _exists(word.removeprefix("batchkit."))
    m = CODE_NAME.fullmatch(word)
    if m is None or m.group(1) == "batchkit" or m.group(1) in names:
        return True
    return _exists(f"{row.dotted}.{m.group(1)}".lstrip("."))  # a submodule (``mlp`` of ``demo/``)


def test_the_floor_table_is_read_whole() -> None:
    """Every row of the floor table parses (a row this file cannot read is checked by nothing)."""
    text = ARCHITECTURE_MD.read_text(encoding="utf-8").split("## Layout and floors", 1)[1].split("\n## ", 1)[0]
    table = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith(("| floor", "| ---"))]
    assert len(_floor_table()) == len(table) > 40


def test_every_module_the_floor_table_names_exists() -> None:
    """Each module of the floor table, and each file a folder's row names, is in the package."""
    missing = [str(p.relative_to(PACKAGE)) for row in _floor_table() for p in row.files if not p.exists()]
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_every_module_is_in_the_floor_table() -> None:
    """Each file of the package is a row of the floor table, or is named in its folder's row."""
    covered = {p for row in _floor_table() for p in row.files}
    files = [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.cu")]
    unlisted = sorted(str(p.relative_to(PACKAGE)) for p in files if p not in covered)
    assert not unlisted, f"add these modules to docs/architecture.md's floor table: {unlisted}"


def test_the_floor_table_gives_the_floors_this_file_enforces() -> None:
    """A row's floor is the floor FLOORS holds the module to."""
    wrong = [
        f"{row.module}: {row.floor} vs {_floor(row.dotted)}"
        for row in _floor_table()
        if row.floor != _floor(row.dotted)
    ]
    assert not wrong, f"docs/architecture.md and FLOORS disagree: {wrong}"


def test_the_names_the_floor_table_gives_are_defined_in_their_modules() -> None:
    """Each code name of a row's "owns" cell (``plan``, ``BlockPool``, ``one_line(exc)``) is
    defined or imported by that row's files, and each ``batchkit.x.y`` it names is a module."""
    undefined = [
        f"{row.module}: {word}"
        for row in _floor_table()
        for names in [_known_names(row)]
        for word in row.owns
        if not _is_defined(row, word, names)
    ]
    assert not undefined, f"docs/architecture.md names what its module does not define: {undefined}"


# Import cycles still in the package, as (module, module) edges of the cycle: each entry says
# what removes it. A NEW cycle fails the test; an entry that no longer occurs only warns.
ALLOWED_CYCLES: dict[tuple[str, str], str] = {}


def _import_edges(module: str, path: Path) -> tuple[set[str], set[str]]:
    """The batchkit modules ``module`` imports when it is imported (module level, ``if
    TYPE_CHECKING:`` blocks and class bodies included), and those it imports inside functions."""
    is_pkg = path.name == "__init__.py"
    eager: set[str] = set()
    lazy: set[str] = set()

    def targets(node: ast.Import | ast.ImportFrom) -> list[str]:
        if isinstance(node, ast.Import):
            return [
                a.name.removeprefix("batchkit").removeprefix(".")
                for a in node.names
                if a.name == "batchkit" or a.name.startswith("batchkit.")
            ]
        base = _resolve(module, is_pkg, node)
        if base is None:
            return []
        subs = [f"{base}.{a.name}" if base else a.name for a in node.names]
        return [sub if _exists(sub) else base for sub in subs]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                (lazy if in_function else eager).update(t for t in targets(child) if t != module)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return eager, lazy


def _import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """Each module's eager and lazy (function-level) imports of other batchkit modules."""
    eager: dict[str, set[str]] = {}
    lazy: dict[str, set[str]] = {}
    for module, path in _modules():
        eager[module], lazy[module] = _import_edges(module, path)
    return eager, lazy


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each sorted)."""
    reach = {m: _reachable(graph, m) for m in graph}
    components = {frozenset(m2 for m2 in reach[m] if m in reach.get(m2, set())) | {m} for m in graph}
    return sorted(sorted(c) for c in components if len(c) > 1)


def _cycle_edges(graph: dict[str, set[str]], component: list[str]) -> set[tuple[str, str]]:
    return {(a, b) for a in component for b in graph[a] if b in component}


def test_no_module_imports_itself_back() -> None:
    """No import cycle among the package's modules (module-level and ``TYPE_CHECKING`` imports
    count): each module can be read, and imported, before those above it."""
    eager, _ = _import_graph()
    edges = {e for c in _cycles(eager) for e in _cycle_edges(eager, c)}
    new = sorted(e for e in edges if e not in ALLOWED_CYCLES)
    assert not new, f"import cycles (module, module it imports): {new}; split out what both need"
    stale = sorted(e for e in ALLOWED_CYCLES if e not in edges)
    if stale:
        warnings.warn(f"allowed cycles no longer occur, delete them: {stale}", stacklevel=1)


def test_no_cycle_is_dodged_by_an_import_inside_a_function() -> None:
    """An import inside a function of a module that imports the importer back (directly or not)
    is a cycle hidden from the reader: it fails as the cycle would."""
    eager, lazy = _import_graph()
    dodged = sorted(
        (module, target)
        for module, targets in lazy.items()
        for target in targets
        if module in _reachable(eager, target) and (module, target) not in ALLOWED_CYCLES
    )
    assert not dodged, f"imports inside functions that dodge a cycle (module, module it imports): {dodged}"


def test_the_cycle_check_sees_a_cycle() -> None:
    """The checks above find a cycle of two modules and one through a third."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert _cycles(graph) == [["a", "b"], ["c", "d", "e"]]

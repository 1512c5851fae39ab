"""The public surface: what ``import batchkit`` exports and what it must not do, and the packages
it pulls in (README.md's runtime dependencies and extras, read from pyproject.toml)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import batchkit

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 30.0

EXPECTED = {
    "AdaptiveBatchController",
    "AdaptiveTuner",
    "AllocatorStatistics",
    "CircuitBreaker",
    "ContinuousDecodeLoop",
    "Decision",
    "InvalidBlock",
    "KVPlan",
    "ModelShape",
    "PagedKVAllocator",
    "PagedKVCache",
    "SamplingParams",
    "Scheduler",
    "StepBatch",
    "UnknownSequence",
    "kv_cache_bytes",
    "sim",
    "AsyncBatchedFunction",
    "AsyncBatcher",
    "BatchInfo",
    "BatchSizeMismatch",
    "BatchTimeout",
    "BatchedFunction",
    "BatcherClosed",
    "BatcherStatistics",
    "BatchkitError",
    "BoundedQueue",
    "CircuitOpen",
    "Clock",
    "CpuThreads",
    "DeadlineExceeded",
    "DynamicBatcher",
    "KVCacheExhausted",
    "LatencySummary",
    "MonotonicClock",
    "QueueEmpty",
    "QueueEntry",
    "QueueFull",
    "QueueStatistics",
    "ThreadGovernor",
    "__version__",
    "adapt_cpu_threads",
    "batched",
    "collate",
    "configure_cpu_threads",
    "continuous",
    "kv",
    "testing",
}


def test_all_is_pinned() -> None:
    """Adding or removing a public name is a deliberate change: update this set with it."""
    assert set(batchkit.__all__) == EXPECTED
    for name in batchkit.__all__:
        assert hasattr(batchkit, name), name


def test_import_loads_no_heavy_module_and_starts_no_thread() -> None:
    """``import batchkit`` pulls in neither torch nor cupy and starts no thread."""
    code = (
        "import sys, threading; import batchkit; "
        "print(sorted(m for m in ('torch', 'cupy') if m in sys.modules), threading.active_count())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["[]", "1"]


def test_optional_submodules_load_on_first_access_only() -> None:
    """``batchkit.bench``, ``.jobs``, ``.models`` and ``.serve`` (docs/api.md's promise: every name
    is reachable from ``import batchkit``) load on first attribute access; a star import does not
    load them, and bench, jobs and serve do not pull in torch."""
    code = (
        "import sys, batchkit\n"
        "lazy = {'bench', 'jobs', 'models', 'serve'}\n"
        "from batchkit import *\n"
        "assert not any('batchkit.' + m in sys.modules for m in lazy)\n"
        "assert lazy <= set(dir(batchkit))\n"
        "assert callable(batchkit.bench.sweep) and callable(batchkit.jobs.run) and batchkit.serve\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["False"]


def test_models_resolves_from_a_bare_import() -> None:
    """``import batchkit; batchkit.models.LlamaModel`` works where torch is installed."""
    pytest.importorskip("torch")
    code = "import batchkit; print(batchkit.models.LlamaModel.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["LlamaModel"]


def test_unknown_attributes_still_raise_attribute_error() -> None:
    """The lazy loader answers only for its submodules; a typo is an AttributeError."""
    with pytest.raises(AttributeError, match="no attribute 'Batcher'"):
        _ = batchkit.Batcher


def test_errors_share_one_root_and_their_builtin() -> None:
    """Every error is a BatchkitError and also the builtin it resembles."""
    assert issubclass(batchkit.DeadlineExceeded, TimeoutError)
    assert issubclass(batchkit.BatchTimeout, TimeoutError)
    assert issubclass(batchkit.KVCacheExhausted, MemoryError)
    assert issubclass(batchkit.BatchSizeMismatch, ValueError)
    for name in ("QueueFull", "QueueEmpty", "DeadlineExceeded", "BatcherClosed", "BatchSizeMismatch"):
        assert issubclass(getattr(batchkit, name), batchkit.BatchkitError)


def test_integrations_load_on_first_access_without_ray() -> None:
    """``batchkit.integrations.ray`` (documented in docs/api.md) resolves from a bare ``import
    batchkit``, loads only on access, and does not import Ray or start a thread."""
    code = (
        "import sys, threading, batchkit\n"
        "from batchkit import *\n"
        "assert 'batchkit.integrations' not in sys.modules\n"
        "assert 'integrations' in dir(batchkit)\n"
        "opts = batchkit.integrations.ray.deployment_options(max_batch=32)\n"
        "print(opts['max_ongoing_requests'], 'ray' in sys.modules, threading.active_count())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.split() == ["160", "False", "1"]


def _pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return project


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~; ]", requirement, maxsplit=1)[0].lower()


def test_the_runtime_needs_only_anyio_numpy_threadpoolctl_and_typing_extensions() -> None:
    """ "runtime needs only `anyio`, `numpy`, `threadpoolctl`, `typing-extensions`"."""
    assert {_name(r) for r in _pyproject()["dependencies"]} == {"anyio", "numpy", "threadpoolctl", "typing-extensions"}


def test_each_extra_adds_the_packages_the_readme_lists() -> None:
    """The extras table: where the "adds" column lists packages, they are exactly the extra's."""
    extras = _pyproject()["optional-dependencies"]
    rows = re.findall(r"^\| `batchkit\[([\w-]+)\]` \| ([^|]*) \|", (ROOT / "README.md").read_text(), re.MULTILINE)
    checked = 0
    for extra, adds in rows:
        names = [a.strip() for a in re.sub(r"\[[^\]]*\]", "", adds).split(",")]
        if not all(re.fullmatch(r"[a-z][a-z0-9-]*", n) for n in names):
            continue  # prose ("CuPy for CUDA 12, ..."), checked by reading
        assert {_name(r) for r in extras[extra]} == set(names), extra
        checked += 1
    assert checked >= 9
    assert extras["cuda"] == ["batchkit[cuda12]"]


def test_import_batchkit_starts_no_thread_and_loads_neither_torch_nor_cupy() -> None:
    """ "`import batchkit` imports neither torch nor cupy and starts no thread" (a fresh process)."""
    import subprocess

    code = (
        "import sys, threading\n"
        "n = threading.active_count()\n"
        "import batchkit\n"
        "print(threading.active_count() - n, 'torch' in sys.modules, 'cupy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S, check=True)
    assert out.stdout.split() == ["0", "False", "False"]

"""README.md, checked as a user finds it: what the overview promises beyond its snippets (which
tests/docs/test_docs.py runs as written).

Threads are told apart by identity: each test compares the live threads before and after, so a
thread some other test left behind is not counted.
"""

from __future__ import annotations

import concurrent.futures
import re
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

import batchkit

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 30.0


def _new_threads(before: set[threading.Thread]) -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t not in before and t.is_alive()}


def test_a_batcher_starts_its_threads_on_first_use_and_close_joins_them() -> None:
    """ "a batcher starts its threads on first use and joins them on `close()`", and `close()`
    drains: what was submitted before it gets its result."""
    before = set(threading.enumerate())

    @batchkit.batched(max_batch=8, max_wait_ms=20)
    def embed(texts: list[str]) -> list[list[float]]:
        return [[float(len(t)), 1.0] for t in texts]

    assert not _new_threads(before)  # decorating starts nothing
    assert embed("hello") == [5.0, 1.0]
    future = embed.submit("hey")
    assert isinstance(future, concurrent.futures.Future)
    assert _new_threads(before)
    embed.close()
    assert future.result(timeout=0) == [3.0, 1.0]
    assert not _new_threads(before)


def test_map_streams_results_in_order_with_a_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    """`list(embed.map(corpus, progress=True))`: an offline job, streamed, results in order."""
    pytest.importorskip("tqdm")

    @batchkit.batched(max_batch=8, max_wait_ms=1)
    def embed(texts: list[str]) -> list[int]:
        return [int(t.split()[1]) for t in texts]

    try:
        corpus = [f"document {i}" for i in range(200)]
        assert list(embed.map(corpus, progress=True)) == list(range(200))
    finally:
        embed.close()
    assert "200/200" in capsys.readouterr().err


def test_a_method_gets_one_batcher_per_instance_and_its_close_frees_the_threads() -> None:
    """`@batched` on a method: "one batcher per instance; `obj.method.close()` frees it and its
    threads"; the other instance's batcher runs on."""

    class Model:
        def __init__(self, scale: int) -> None:
            self.scale = scale

        @batchkit.batched(max_batch=4, max_wait_ms=1)
        def predict(self, xs: list[int]) -> list[int]:
            return [x * self.scale for x in xs]

    before = set(threading.enumerate())
    a, b = Model(2), Model(3)
    assert (a.predict(5), b.predict(5)) == (10, 15)
    a_and_b = _new_threads(before)
    a.predict.close()
    only_b = _new_threads(before)
    assert only_b
    assert only_b < a_and_b
    assert b.predict(1) == 3
    b.predict.close()
    assert not _new_threads(before)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_async_batch_function_gives_an_awaitable_on_asyncio_and_trio(backend: str) -> None:
    """ "An `async def` batch function gives an awaitable (`await score(x)`)", and `acall` works
    "from async code (asyncio or trio)"."""
    if backend == "trio":
        pytest.importorskip("trio")
    sizes: list[int] = []

    @batchkit.batched(max_batch=16, max_wait_ms=5)
    async def score(xs: list[int]) -> list[int]:
        sizes.append(len(xs))
        return [x + 1 for x in xs]

    @batchkit.batched(max_batch=16, max_wait_ms=5)
    def double(xs: list[int]) -> list[int]:
        return [2 * x for x in xs]

    async def main() -> tuple[list[int], int]:
        results: list[int] = [0] * 10

        async def one(i: int) -> None:
            results[i] = await score(i)

        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(one, i)
        return results, await double.acall(21)

    try:
        results, doubled = anyio.run(main, backend=backend)
    finally:
        double.close()
    assert results == [i + 1 for i in range(10)]
    assert doubled == 42
    assert sum(sizes) == 10


def test_an_offloading_async_batcher_joins_its_worker_threads_on_aclose() -> None:
    """`AsyncBatcher(offload=True)` runs batches "in the batcher's own worker threads, one per
    concurrent batch, joined by `aclose()`"."""
    before = set(threading.enumerate())

    def work(xs: list[int]) -> list[int]:
        return [x * x for x in xs]

    async def main() -> list[int]:
        async with batchkit.AsyncBatcher(work, max_batch_size=4, max_concurrent_batches=2, offload=True) as b:
            out: list[int] = [0] * 12

            async def one(i: int) -> None:
                out[i] = await b.submit(i)

            async with anyio.create_task_group() as tg:
                for i in range(12):
                    tg.start_soon(one, i)
            assert 1 <= len(_new_threads(before)) <= 2
        return out

    assert anyio.run(main) == [i * i for i in range(12)]
    assert not _new_threads(before)


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

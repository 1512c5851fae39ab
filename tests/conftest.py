"""Shared fixtures: every async test runs on asyncio and on trio."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest_plugins = ["_serve_fixtures"]  # the server tests' models and live servers


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Run each ``@pytest.mark.anyio`` test once per backend."""
    return str(request.param)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip cleanly where no CUDA device is present."""
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _cpu_threads_restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test that runs the command line in-process (``batchkit.cli.main``) configures this
    process's CPU threads (batchkit._cpu.configure_cpu_threads): the OpenMP variables, the
    thread governor and torch's thread count are put back after it, so that no later test runs
    on a team it did not choose."""
    from batchkit import _cpu

    for name in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY"):  # monkeypatch restores them, set or not
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_cpu, "_governor", _cpu._governor)
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    if torch is not None and threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)  # the torch loaded before the test (a test may swap in a fake)


@pytest.fixture(scope="session")
def kernel() -> Callable[..., Any]:
    """batchkit's native CPU extension (batchkit.kv.native), built once a session (about 30 s
    the first time, then loaded from torch's extensions cache) and left off between tests: each
    test turns it on with ``native_on``."""
    from batchkit.kv import native

    if not native.build_decode_attention():
        pytest.skip(f"the native extension does not build here: {native._failed}")
    built = native._kernel
    assert built is not None
    native._kernel = None
    return built


@pytest.fixture
def native_on(kernel: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The native extension on for this test only."""
    from batchkit.kv import native

    monkeypatch.setattr(native, "_kernel", kernel)


@pytest.fixture(autouse=True)
def _native_attention_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that builds the native decode attention (a docs snippet, a compiled step) turns it
    on for this process: it is put back as it was after the test, so that no later test's
    attention changes kernel under it."""
    from batchkit.kv import native

    monkeypatch.setattr(native, "_kernel", native._kernel)

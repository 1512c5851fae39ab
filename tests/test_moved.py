"""The old module paths of batchkit.dynamic and batchkit.control: aliases that warn."""

from __future__ import annotations

import importlib
import sys

import pytest

import batchkit
import batchkit.dynamic.batcher

OLD_PATHS = {
    "batchkit._queue_core": "batchkit.dynamic._queue_core",
    "batchkit.former": "batchkit.dynamic.former",
    "batchkit.queue": "batchkit.dynamic.queue",
    "batchkit.batcher": "batchkit.dynamic.batcher",
    "batchkit.async_batcher": "batchkit.dynamic.async_batcher",
    "batchkit.decorator": "batchkit.dynamic.decorator",
    "batchkit._progress": "batchkit.dynamic._progress",
    "batchkit.adaptive": "batchkit.control",
}


@pytest.mark.parametrize(("old", "new"), OLD_PATHS.items())
def test_an_old_path_warns_with_the_new_one_and_is_the_moved_module(
    old: str, new: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Importing an old path raises a DeprecationWarning that names the new path and gives the
    very module that moved (not a copy)."""
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=rf"^{old} moved to {new}; ") as record:
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert sys.modules[old] is module
    assert len(record) == 1


def test_the_warning_points_at_the_importing_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """The DeprecationWarning is attributed to the user's import statement, not to batchkit."""
    monkeypatch.delitem(sys.modules, "batchkit.adaptive", raising=False)
    with pytest.warns(DeprecationWarning, match="moved to") as record:
        import batchkit.adaptive  # noqa: F401 - the import under test
    assert record[0].filename == __file__


def test_a_patch_through_an_old_path_is_a_patch_of_the_moved_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """batchkit.batcher is batchkit.dynamic.batcher: setting an attribute on one sets it on both."""
    monkeypatch.delitem(sys.modules, "batchkit.batcher", raising=False)
    with pytest.warns(DeprecationWarning, match="moved to"):
        old = importlib.import_module("batchkit.batcher")
    monkeypatch.setattr(old, "DynamicBatcher", None)
    assert batchkit.dynamic.batcher.DynamicBatcher is None
    monkeypatch.undo()
    assert batchkit.dynamic.batcher.DynamicBatcher is batchkit.DynamicBatcher

"""The module paths that moved into :mod:`batchkit.dynamic` and :mod:`batchkit.control`: each old
module makes its name an alias of the new one, so ``batchkit.batcher.DynamicBatcher`` (and a
``monkeypatch`` of it) is the same object as ``batchkit.dynamic.batcher.DynamicBatcher``."""

from __future__ import annotations

import importlib
import sys


def alias(old: str, new: str) -> None:
    """Make the module named ``old`` (being imported now) the module named ``new``."""
    sys.modules[old] = importlib.import_module(new)

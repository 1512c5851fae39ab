"""Moved to :mod:`batchkit.dynamic._progress`; this path is an alias of it for one release."""

from typing import TYPE_CHECKING

from ._moved import alias

if TYPE_CHECKING:
    from .dynamic._progress import *  # noqa: F403 - what type checkers see through the alias

alias(__name__, "batchkit.dynamic._progress")

"""Moved to :mod:`batchkit.dynamic.former`; this path is an alias of it for one release."""

from typing import TYPE_CHECKING

from ._moved import alias

if TYPE_CHECKING:
    from .dynamic.former import *  # noqa: F403 - what type checkers see through the alias

alias(__name__, "batchkit.dynamic.former")

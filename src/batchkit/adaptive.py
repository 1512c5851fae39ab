"""Moved to :mod:`batchkit.control` (``controller``, ``breaker``, ``tuner``); this path is an
alias of that package for one release."""

from typing import TYPE_CHECKING

from ._moved import alias

if TYPE_CHECKING:
    from .control import *  # noqa: F403 - what type checkers see through the alias

alias(__name__, "batchkit.control")

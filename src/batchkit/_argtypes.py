"""What every ``batchkit`` sub-command shares: argparse value types (whole and finite numbers
within a range, each refused with one line naming the range), the one-line text of an error,
and importing a ``module:function`` target from the current folder."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

__all__ = ["float_in", "import_from_cwd", "int_in", "one_line"]


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """A parser of whole numbers in ``lo..hi``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number in {lo}..{hi:,}, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi:,}, got {text}")
        return value

    return parse


def float_in(lo: float, hi: float, *, lo_open: bool = False) -> Callable[[str], float]:
    """A parser of finite numbers in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    bounds = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number in {bounds}, got {text!r}") from None
        if not math.isfinite(value) or value < lo or (lo_open and value == lo) or value > hi:
            raise argparse.ArgumentTypeError(f"must be a finite number in {bounds}, got {text}")
        return value

    return parse


def one_line(exc: BaseException) -> str:
    """``"Type: first line ..."``: how a command reports an error on one line."""
    lines = str(exc).strip().splitlines()
    text = lines[0] + (" ..." if len(lines) > 1 else "") if lines else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def import_from_cwd() -> None:
    """Let ``module:function`` name a module in the current folder, as ``python -m batchkit`` does
    (the ``batchkit`` console script starts with its own folder on ``sys.path`` instead)."""
    cwd = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
        sys.path.insert(0, cwd)

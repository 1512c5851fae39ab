"""argparse value types shared by every ``batchkit`` sub-command: whole numbers and finite
numbers within a range, each refused with one line naming the range."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["float_in", "int_in"]


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

"""What every ``batchkit`` sub-command shares: argparse value types (whole and finite numbers
within a range, each refused with one line naming the range), the limits and the flags that
several commands take alike (``--threads``, ``--max-wait-ms``, ``--price-per-hour``,
``--progress``), the error a command raises for a bad argument found after parsing
(:class:`UsageError`), the one-line text of an error, and importing a ``module:function`` target from
the current folder."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

__all__ = [
    "MAX_SECONDS",
    "MAX_THREADS",
    "MAX_WAIT_MS",
    "UsageError",
    "add_max_wait_ms",
    "add_price_per_hour",
    "add_progress",
    "add_threads",
    "float_in",
    "import_from_cwd",
    "int_in",
    "one_line",
    "wants_progress",
]


class UsageError(Exception):
    """A bad argument found after parsing; its message names the argument and the fix. The
    command prints it as one line on stderr and exits with status 2 (``batchkit`` and every
    sub-command alike)."""


# Upper bounds: generous for real use, small enough that a typo cannot hang the machine or
# exhaust its memory. Each command's --help states the ones it takes.
MAX_THREADS = 256
MAX_WAIT_MS = 10_000.0
MAX_SECONDS = 3600.0
MAX_PRICE_PER_HOUR = 1e6


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


def add_threads(parser: argparse.ArgumentParser, *, help: str) -> None:
    """``--threads N``, 1..``MAX_THREADS``; None where not given (the command picks)."""
    parser.add_argument("--threads", metavar="N", type=int_in(1, MAX_THREADS), default=None, help=help)


def add_max_wait_ms(parser: argparse.ArgumentParser, *, default: float | None, help: str) -> None:
    """``--max-wait-ms MS``: a batcher's ``max_wait_ms``, in [0, ``MAX_WAIT_MS``]."""
    parser.add_argument("--max-wait-ms", metavar="MS", type=float_in(0, MAX_WAIT_MS), default=default, help=help)


def add_price_per_hour(parser: argparse.ArgumentParser, *, metavar: str, help: str) -> None:
    """``--price-per-hour``: the accelerator's price, in [0, ``MAX_PRICE_PER_HOUR``], for a
    report's cost lines; None where not given (no cost)."""
    parser.add_argument(
        "--price-per-hour", metavar=metavar, type=float_in(0, MAX_PRICE_PER_HOUR), default=None, help=help
    )


def add_progress(parser: argparse.ArgumentParser, *, help: str) -> None:
    """``--progress`` / ``--no-progress``: None where neither is given (the command shows a bar when
    stderr is a terminal)."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help=help)


def wants_progress(progress: bool | None) -> bool:
    """Whether to draw the progress bar: ``--progress`` as given, else when stderr is a terminal."""
    return progress if progress is not None else sys.stderr.isatty()


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

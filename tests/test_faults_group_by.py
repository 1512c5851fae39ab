"""A ``group_by`` key that is not equal to itself (a NaN) or cannot be compared could never be
found again to form a batch: its submit is a ValueError, nothing is queued, and the batcher
keeps serving (it left the callers waiting forever, and a raising ``__eq__`` killed the
dispatcher)."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

import pytest

import batchkit


class _EqRaises:
    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparing")


def _key(item: int) -> Hashable:
    if item < 0:
        return float("nan") if item == -1 else _EqRaises()
    return item % 2


def test_dynamic_batcher_refuses_a_key_unequal_to_itself() -> None:
    with batchkit.DynamicBatcher(lambda xs: xs, max_batch_size=2, max_wait_ms=1, group_by=_key) as b:
        for bad in (-1, -2):
            with pytest.raises(ValueError, match="group key"):
                b.submit(bad)
        futures = [b.submit(i) for i in range(4)]
        assert [f.result(timeout=10) for f in futures] == [0, 1, 2, 3]
    s = b.statistics()
    assert (s.submitted, s.succeeded, s.pending) == (4, 4, 0)


def test_async_batcher_refuses_a_key_unequal_to_itself() -> None:
    async def fn(xs: list[int]) -> list[int]:
        return xs

    async def main() -> list[Any]:
        async with batchkit.AsyncBatcher(fn, max_batch_size=2, max_wait_ms=1, group_by=_key) as b:
            for bad in (-1, -2):
                with pytest.raises(ValueError, match="group key"):
                    await b.submit(bad)
            return list(await asyncio.wait_for(asyncio.gather(*(b.submit(i) for i in range(4))), 10))

    assert asyncio.run(main()) == [0, 1, 2, 3]

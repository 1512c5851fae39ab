"""Cost-bounded batches (docs/api.md, DynamicBatcher): the bound, and an item over it on its own."""

from __future__ import annotations

import pytest

import batchkit
from batchkit.testing import MockClock

WAIT = 10.0


def test_batches_stay_within_max_batch_cost_and_an_oversized_item_runs_alone() -> None:
    clock = MockClock()
    seen: list[list[str]] = []

    def fn(xs: list[str]) -> list[str]:
        seen.append(list(xs))
        return xs

    b = batchkit.DynamicBatcher(fn, max_batch_size=100, max_wait_ms=100, size_fn=len, max_batch_cost=10, clock=clock)
    futs = [b.submit(s) for s in ["aaaa", "bbbb", "ccc", "x" * 11, "d"]]
    clock.advance(0.2)
    assert [f.result(WAIT) for f in futs] == ["aaaa", "bbbb", "ccc", "x" * 11, "d"]
    assert all(sum(map(len, batch)) <= 10 for batch in seen if len(batch) > 1)
    assert ["x" * 11] in seen
    assert sorted(x for batch in seen for x in batch) == sorted(["aaaa", "bbbb", "ccc", "x" * 11, "d"])
    b.close()


def test_size_fn_runs_at_submit_and_its_errors_fail_that_submit() -> None:
    def cost(x: str) -> float:
        if x == "boom":
            raise ZeroDivisionError("no cost")
        return -1.0 if x == "neg" else 1.0

    b = batchkit.DynamicBatcher(lambda xs: xs, max_wait_ms=0, size_fn=cost, max_batch_cost=10)
    with pytest.raises(ZeroDivisionError):
        b.submit("boom")
    with pytest.raises(ValueError, match="cost"):
        b.submit("neg")
    assert b.submit("ok").result(WAIT) == "ok"
    b.close()

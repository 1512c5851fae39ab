"""docs/api.md's promises about @batched: close refuses new work, arguments are checked by name."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

import batchkit


def test_close_before_first_call_refuses_later_calls() -> None:
    """close() is DynamicBatcher.close: new work is refused with BatcherClosed, used or not."""

    @batchkit.batched(max_batch=4, max_wait_ms=1)
    def echo(xs: list[int]) -> list[int]:
        return xs

    before = set(threading.enumerate())  # the threads, not their count: an earlier test's may still be exiting
    echo.close()
    assert set(threading.enumerate()) <= before  # closing an unused function starts nothing
    with pytest.raises(batchkit.BatcherClosed):
        echo(1)
    with pytest.raises(batchkit.BatcherClosed):
        echo.submit(1)
    echo.close()  # idempotent


def test_aclose_before_first_call_refuses_later_calls() -> None:
    @batchkit.batched(max_batch=4, max_wait_ms=1)
    async def echo(xs: list[int]) -> list[int]:
        return xs

    async def main() -> None:
        await echo.aclose()
        with pytest.raises(batchkit.BatcherClosed):
            await echo(1)

    anyio.run(main)


def test_close_on_an_unused_method_refuses_that_instance_only() -> None:
    class Model:
        @batchkit.batched(max_batch=4, max_wait_ms=1)
        def run(self, xs: list[int]) -> list[int]:
            return xs

    a, b = Model(), Model()
    a.run.close()
    with pytest.raises(batchkit.BatcherClosed):
        a.run(1)
    assert b.run(2) == 2
    b.run.close()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_a_bad_max_batch_is_named_max_batch(bad: Any) -> None:
    """@batched's parameter is max_batch: the error names it, not the batcher's max_batch_size."""
    with pytest.raises(ValueError, match="max_batch must be"):
        batchkit.batched(max_batch=bad)(lambda xs: xs)


@pytest.mark.parametrize("bad", [0, 1.5, True])
def test_map_refuses_a_window_that_is_not_a_positive_int(bad: Any) -> None:
    @batchkit.batched(max_batch=4, max_wait_ms=1)
    def echo(xs: list[int]) -> list[int]:
        return xs

    with pytest.raises(ValueError, match="window"):
        list(echo.map([1, 2], window=bad))
    echo.close()


def test_an_override_and_the_method_it_overrides_keep_their_own_batchers() -> None:
    """On a method each instance gets its own batcher: one per decorated method, so that a
    subclass's override and ``super().method`` do not share (and swap) one."""

    class Base:
        @batchkit.batched(max_batch=4, max_wait_ms=1)
        def tag(self, xs: list[int]) -> list[str]:
            return ["base"] * len(xs)

    class Child(Base):
        @batchkit.batched(max_batch=4, max_wait_ms=1)
        def tag(self, xs: list[int]) -> list[str]:
            return ["child"] * len(xs)

        def base_tag(self, x: int) -> str:
            return str(super().tag(x))

    first, second = Child(), Child()
    assert first.tag(0) == "child"
    assert first.base_tag(0) == "base"
    assert second.base_tag(0) == "base"  # the base method used first on this instance
    assert second.tag(0) == "child"
    for c in (first, second):
        c.tag.close()
        Base.tag.__get__(c).close()

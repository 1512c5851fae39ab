"""An ``async def`` batch function runs on the batcher's own asyncio loop, whatever its callers run."""

from __future__ import annotations

import asyncio

import anyio
import trio

import batchkit


def test_trio_callers_share_an_async_batch_function_that_awaits_anyio() -> None:
    loops: list[str] = []

    @batchkit.batched(max_batch=4, max_wait_ms=1)
    async def score(xs: list[str]) -> list[int]:
        loops.append(type(asyncio.get_running_loop()).__module__)
        await anyio.sleep(0)
        return [len(x) for x in xs]

    async def main() -> list[int]:
        out: list[int] = []

        async def one(s: str) -> None:
            out.append(await score(s))

        async with trio.open_nursery() as nursery:
            for s in ["a", "bb", "ccc"]:
                nursery.start_soon(one, s)
        return sorted(out)

    assert trio.run(main) == [1, 2, 3]
    assert loops
    assert all(m.startswith("asyncio") for m in loops)
    score.close()

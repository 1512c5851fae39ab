"""OffloadThreads: a plain batch function called in the batcher's own threads."""

from __future__ import annotations

import asyncio
import threading

import pytest

from batchkit.dynamic._offload import OffloadThreads


def _thread(items: list[int]) -> threading.Thread:
    return threading.current_thread()


def test_calls_run_in_the_same_named_thread_and_a_stuck_call_gets_it_replaced() -> None:
    async def main() -> None:
        pool = OffloadThreads("model", 1)
        first = await pool.run(_thread, [1])
        assert first is not threading.current_thread()
        assert first.name.startswith("batchkit-model")
        assert await pool.run(_thread, [2]) is first
        pool.abandon()  # as after a batch timeout: later calls get a fresh thread
        assert await pool.run(_thread, [3]) is not first
        await pool.aclose(None, join=True)
        assert not first.is_alive()

    asyncio.run(main())


def test_a_generator_exit_of_the_function_is_raised_to_the_awaiting_task() -> None:
    def stop(items: list[int]) -> list[int]:
        raise GeneratorExit

    async def main() -> None:
        pool = OffloadThreads("model", 1)
        with pytest.raises(GeneratorExit):
            await pool.run(stop, [1])
        await pool.aclose(None, join=True)

    asyncio.run(main())


def test_aclose_joins_the_idle_threads() -> None:
    async def main() -> list[threading.Thread]:
        pool = OffloadThreads("model", 2)
        threads = list(await asyncio.gather(pool.run(_thread, [1]), pool.run(_thread, [2])))
        await pool.aclose(None, join=True)
        return threads

    assert not any(t.is_alive() for t in asyncio.run(main()))

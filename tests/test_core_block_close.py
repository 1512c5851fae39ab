"""close() answers the callers blocked on a full "block" queue at once, threads and tasks alike."""

from __future__ import annotations

import asyncio
import threading

import trio

import batchkit

WAIT = 10.0


class _Watched(batchkit.BoundedQueue[object]):
    """A "block" queue that counts the writers that started waiting for room."""

    def __init__(self, maxsize: int, writers: int) -> None:
        super().__init__(maxsize, on_full="block")
        self._writers = writers
        self._count = 0
        self._count_lock = threading.Lock()
        self.all_waiting = threading.Event()

    def _one_more(self) -> None:
        with self._count_lock:
            self._count += 1
            if self._count >= self._writers:
                self.all_waiting.set()

    def wait_for_room(self, timeout: float | None = None) -> bool:
        self._one_more()
        return super().wait_for_room(timeout)

    async def await_room(self) -> None:
        self._one_more()
        await super().await_room()


def test_close_answers_writers_blocked_for_room_with_batcher_closed() -> None:
    gate = threading.Event()
    started = threading.Event()

    def fn(xs: list[object]) -> list[object]:
        started.set()
        assert gate.wait(WAIT)
        return xs

    q = _Watched(1, writers=3)
    b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, queue=q)
    first = b.submit(0)
    assert started.wait(WAIT)
    second = b.submit(1)  # the queue is full now
    outcomes: dict[str, str] = {}
    answered = threading.Semaphore(0)

    def record(name: str, call: object) -> None:
        try:
            outcomes[name] = repr(call() if callable(call) else call)
        except batchkit.BatcherClosed:
            outcomes[name] = "BatcherClosed"
        except BaseException as exc:  # handed to the test thread
            outcomes[name] = repr(exc)
        finally:
            answered.release()

    def from_thread() -> None:
        record("thread", lambda: b.submit(2))

    def from_asyncio() -> None:
        async def main() -> object:
            return await b.asubmit(3)

        record("asyncio", lambda: asyncio.run(main()))

    def from_trio() -> None:
        async def main() -> object:
            return await b.asubmit(4)

        record("trio", lambda: trio.run(main))

    writers = [threading.Thread(target=f, daemon=True) for f in (from_thread, from_asyncio, from_trio)]
    for t in writers:
        t.start()
    assert q.all_waiting.wait(WAIT)
    closer = threading.Thread(target=b.close, daemon=True)
    closer.start()
    for _ in writers:
        assert answered.acquire(timeout=WAIT)  # answered while the batch still runs
    assert outcomes == {"thread": "BatcherClosed", "asyncio": "BatcherClosed", "trio": "BatcherClosed"}
    gate.set()
    closer.join(WAIT)
    assert [first.result(WAIT), second.result(WAIT)] == [0, 1]

"""PromptTokenizer: prompts tokenized in worker threads, several at once, each on a tokenizer
copy that no other thread holds meanwhile (no model: a stand-in with a copyable tokenizer)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import anyio

from batchkit.serve.tokenizing import PromptTokenizer


@dataclasses.dataclass
class FakeLM:
    tokenizer: Any
    lock: Any = dataclasses.field(default_factory=threading.Lock)


def test_tokenizing_runs_in_several_threads_each_on_its_own_copy() -> None:
    """Three prompts at once take three copies (and then reuse them); the model's own tokenizer
    is never used, so its lock (shared with the engine's decoding) is never taken."""
    lm = FakeLM(tokenizer={"vocab": [1, 2, 3]})
    prompts = PromptTokenizer(lm, max_threads=3)  # type: ignore[arg-type]
    assert prompts.limiter.total_tokens == 3
    inside = threading.Barrier(3, timeout=10)
    used: list[int] = []

    def work(own: Any) -> int:
        assert own.tokenizer is not lm.tokenizer
        assert own.tokenizer == lm.tokenizer
        used.append(id(own))
        inside.wait()  # all three at once: the limiter lets three threads in
        return len(own.tokenizer["vocab"])

    async def main() -> list[int]:
        out: list[int] = []

        async def one() -> None:
            out.append(await prompts.run(work))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(one)
        return out

    assert anyio.run(main) == [3, 3, 3]
    assert len(set(used)) == 3
    assert prompts.num_copies == 3
    assert not lm.lock.locked()
    anyio.run(prompts.run, lambda own: None)
    assert prompts.num_copies == 3  # reused, not made again


def test_the_default_limit_is_more_than_one_thread() -> None:
    prompts = PromptTokenizer(FakeLM(tokenizer=[]))  # type: ignore[arg-type]
    assert prompts.limiter.total_tokens >= 2

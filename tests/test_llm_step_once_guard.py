"""step_once() from a second thread while the engine thread steps the loop is refused, not a race
that corrupts the scheduler (positions outside a sequence, lost requests)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import batchkit  # noqa: E402
from batchkit.models import LlamaConfig, LlamaModel  # noqa: E402


def test_step_once_beside_a_running_engine_thread_is_a_runtime_error() -> None:
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    release = threading.Event()
    stepping = threading.Event()
    forward = model.forward

    def held_step(*args: Any) -> Any:
        stepping.set()
        assert release.wait(timeout=30)
        return forward(*args)

    model.forward = held_step  # type: ignore[method-assign, assignment]
    with batchkit.ContinuousDecodeLoop(model, model.make_cache(num_blocks=32, block_size=4)) as loop:
        fut = loop.submit([1, 2, 3], max_new_tokens=2)  # starts the engine thread
        assert stepping.wait(timeout=30)
        with pytest.raises(RuntimeError, match="engine runs in thread"):
            loop.step_once()
        release.set()
        assert len(fut.result(timeout=60)) == 2


def test_step_once_still_drives_a_loop_whose_threaded_api_is_unused() -> None:
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    with batchkit.ContinuousDecodeLoop(model, model.make_cache(num_blocks=32, block_size=4)) as loop:
        loop.scheduler.add(batchkit.continuous.Request("r", [1, 2, 3], batchkit.SamplingParams(max_new_tokens=2)))
        tokens = []
        while loop.scheduler.has_work():
            tokens += [ev.token for ev in loop.step_once()[1] if ev.token is not None]
        assert len(tokens) == 2

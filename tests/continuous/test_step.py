"""A step function that fails in the ways a user's model can: raises, returns the wrong shape,
dtype or type, NaN, or logits wider than the model's vocabulary. The requests of that step fail
with a clear error, and the loop serves the next ones."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import pytest

from _support import one_layer_cache as _cache
from _support import zeros_step as _zeros

torch = pytest.importorskip("torch")

import batchkit  # noqa: E402
from batchkit.continuous import Request  # noqa: E402
from batchkit.models import LlamaConfig, LlamaModel  # noqa: E402

VOCAB = 64


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )


def _raise(b: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
    raise ValueError("step")


FAULTS: dict[str, tuple[Callable[[batchkit.StepBatch, batchkit.PagedKVCache], Any], type[BaseException]]] = {
    "raises": (_raise, ValueError),
    "none": (lambda b, kv: None, TypeError),
    "list": (lambda b, kv: [[0.0] * VOCAB] * len(b.sample_indices), TypeError),
    "too_few_rows": (lambda b, kv: torch.zeros(len(b.sample_indices) - 1, VOCAB), ValueError),
    "one_dimensional": (lambda b, kv: torch.zeros(len(b.sample_indices)), ValueError),
    "int_dtype": (lambda b, kv: torch.zeros(len(b.sample_indices), VOCAB, dtype=torch.int64), ValueError),
    "nan": (lambda b, kv: torch.full((len(b.sample_indices), VOCAB), float("nan")), FloatingPointError),
    "memory_error": (lambda b, kv: (_ for _ in ()).throw(MemoryError("oom")), MemoryError),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_faulty_step_fails_its_requests_and_the_loop_serves_on(model: LlamaModel, fault: str) -> None:
    faulty, error = FAULTS[fault]
    calls = 0

    def step(batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
        nonlocal calls
        calls += 1
        return faulty(batch, kv) if calls == 1 else model(batch, kv)

    with batchkit.ContinuousDecodeLoop(step, model.make_cache(num_blocks=32, block_size=4), max_num_seqs=8) as loop:
        first = loop.submit([1, 2, 3], max_new_tokens=2)
        with pytest.raises(error):
            first.result(timeout=60)
        assert len(loop.submit([1, 2], max_new_tokens=2).result(timeout=60)) == 2


def test_logits_wider_than_the_vocabulary_are_malformed(model: LlamaModel) -> None:
    class Wide:
        """The model's step, declaring the model's config, with 5 logits too many."""

        config = model.config

        def __call__(self, batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
            logits = torch.zeros(len(batch.sample_indices), VOCAB + 5)
            logits[:, VOCAB + 2] = 1.0  # the greedy pick is an id the model does not have
            return logits

    with batchkit.ContinuousDecodeLoop(Wide(), model.make_cache(num_blocks=32, block_size=4), max_num_seqs=8) as loop:
        fut = loop.submit([1, 2, 3], max_new_tokens=1)
        try:
            tokens = fut.result(timeout=60)
        except ValueError:
            return
        except concurrent.futures.TimeoutError:
            pytest.fail("the request was never answered")
        assert all(0 <= t < VOCAB for t in tokens), tokens


def test_a_signal_during_in_fresh_thread_is_raised_once_its_function_returned() -> None:
    """Ctrl-C while a model loads in the fresh thread: KeyboardInterrupt comes out only after the
    thread's function has returned (a process exiting under a thread still in torch aborts)."""
    import signal
    import sys
    import threading
    import time

    started, release, done = threading.Event(), threading.Event(), threading.Event()

    def load() -> int:
        started.set()
        release.wait(30)
        done.set()
        return 1

    def main_thread_waits() -> bool:
        """Whether the main thread waits in in_fresh_thread for the function (not in Thread.start)."""
        frame = sys._current_frames().get(threading.main_thread().ident or 0)
        while frame is not None:
            caller = frame.f_back
            if frame.f_code.co_name == "wait" and caller is not None and caller.f_code.co_name == "in_fresh_thread":
                return True
            frame = caller
        return False

    def interrupt() -> None:
        started.wait(30)
        for _ in range(10_000):  # until the main thread waits for the loading thread (10 s at most)
            if main_thread_waits():
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
                break
            time.sleep(0.001)
        threading.Timer(0.2, release.set).start()

    assert threading.current_thread() is threading.main_thread()
    threading.Thread(target=interrupt).start()
    with pytest.raises(KeyboardInterrupt):
        batchkit.continuous.in_fresh_thread(load)
    assert done.is_set()


# --------------------------------------------------------------------------- docs/api.md: check_logits


def test_check_logits_refuses_rows_without_a_single_logit() -> None:
    """check_logits: logits [num_sampling, vocab]; a vocab of 0 leaves nothing to sample."""
    from batchkit.continuous import check_logits

    loop = batchkit.ContinuousDecodeLoop(_zeros, _cache())
    loop.scheduler.add(Request("a", [1, 2, 3], batchkit.SamplingParams(max_new_tokens=2)))
    batch = loop.build_batch(loop.scheduler.schedule())
    assert check_logits(torch.zeros(1, VOCAB), batch).shape == (1, VOCAB)
    with pytest.raises(ValueError, match="vocab"):
        check_logits(torch.zeros(1, 0), batch)

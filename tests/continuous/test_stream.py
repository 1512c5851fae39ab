"""A request's stream, read by its caller: leaving it early aborts the request."""

from __future__ import annotations

import pytest
from _continuous_steps import WAIT, GatedStep, small_cache

import batchkit

torch = pytest.importorskip("torch")


def test_leaving_a_sync_stream_early_aborts_the_request_and_frees_its_blocks() -> None:
    with batchkit.ContinuousDecodeLoop(GatedStep(), small_cache(), max_num_seqs=4) as loop:
        for token in loop.generate_sync([1, 2], max_new_tokens=1000):
            assert token == 0
            break  # leaving the stream: the generator is closed as it goes
        assert loop.submit([9], max_new_tokens=2).result(WAIT) == [0, 0]
        s = loop.statistics().scheduler
        assert (s.aborted, s.running, s.kv_usage) == (1, 0, 0.0)

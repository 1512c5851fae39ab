"""The decode loop finds the rows no token can be drawn from (a NaN, every logit -inf) with one
reduction over the step's logits, not with element-wise passes over all of them (each a full
[num_sampling, vocab] pass per step), and still fails exactly those rows' requests."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import batchkit  # noqa: E402
from batchkit import SamplingParams  # noqa: E402
from batchkit.continuous import Request  # noqa: E402

VOCAB = 16


def test_broken_rows_fail_alone_without_elementwise_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    def step(batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
        out = torch.zeros(len(batch.sample_indices), VOCAB)
        out[:, 3] = 5.0
        out[0, 0] = float("nan")
        out[1] = float("-inf")
        return out

    kv = batchkit.PagedKVCache(num_layers=1, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=4)
    loop = batchkit.ContinuousDecodeLoop(step, kv, engine="caller")
    for rid in ("a", "b", "c"):
        loop.scheduler.add(Request(rid, [1, 2], SamplingParams(max_new_tokens=2, temperature=0.5, seed=1)))
    shapes: list[tuple[int, ...]] = []
    for name in ("isnan", "isneginf", "isposinf"):
        original = getattr(torch, name)

        def spy(x: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            shapes.append(tuple(x.shape))
            return _original(x, *args, **kwargs)

        monkeypatch.setattr(torch, name, spy)
    _, events = loop.step_once()
    by_id = {e.request_id: e for e in events}
    assert isinstance(by_id["a"].error, FloatingPointError)
    assert isinstance(by_id["b"].error, FloatingPointError)
    assert by_id["c"].error is None
    assert by_id["c"].token == 3
    assert all(VOCAB not in s for s in shapes), shapes  # never an element-wise pass over [rows, vocab]

"""sample()'s +inf check and max shift run once per step over every row: one host read of a flag
per step, not one per sampled row (on a GPU each is a device sync), and draws unchanged."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchkit.continuous.sampling import SamplingParams, sample  # noqa: E402


def _draws(logits: Any, params: list[SamplingParams]) -> list[int]:
    gens = [torch.Generator().manual_seed(i) for i in range(len(params))]
    return sample(logits, params, gens)


def test_sample_reads_one_flag_per_step_not_per_row(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 16
    logits = torch.randn(n, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.7)] * n
    reads = 0
    original = torch.Tensor.__bool__

    def counting_bool(self: Any) -> bool:
        nonlocal reads
        reads += 1
        return bool(original(self))

    monkeypatch.setattr(torch.Tensor, "__bool__", counting_bool)
    _draws(logits, params)
    assert reads <= 1


def test_sample_keeps_certainties_and_tiny_temperatures() -> None:
    logits = torch.zeros(3, 6)
    logits[0, 4] = float("inf")  # a certainty
    logits[1, 2] = 1.0  # with a tiny temperature: greedy-like
    logits[2] = torch.arange(6, dtype=torch.float32)
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1e-30), SamplingParams(temperature=0)]
    assert _draws(logits, params) == [4, 2, 5]

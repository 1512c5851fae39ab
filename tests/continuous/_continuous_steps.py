"""Step functions and caches the continuous/ unit tests share: a gated step with uniform logits,
a one-layer Llama of 64 tokens, a small cache."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import batchkit

if TYPE_CHECKING:
    import torch
else:
    import pytest

    torch = pytest.importorskip("torch")

WAIT = 30.0
GATED_VOCAB = 16


class GatedStep:
    """A step function with uniform logits (greedy picks token 0) that can hold the engine."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.go.set()
        self.stepped = threading.Event()

    def __call__(self, batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
        self.stepped.set()
        assert self.go.wait(WAIT)
        return torch.zeros(len(batch.sample_indices), GATED_VOCAB)


def small_cache(num_blocks: int = 16) -> batchkit.PagedKVCache:
    """A one-layer cache of ``num_blocks`` blocks of 4 tokens."""
    return batchkit.PagedKVCache(num_layers=1, num_blocks=num_blocks, block_size=4, num_kv_heads=1, head_dim=4)


def tiny_llama() -> Any:
    """A seeded one-layer Llama over a 64-token vocabulary."""
    from batchkit.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    return LlamaModel(cfg)

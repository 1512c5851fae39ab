"""Paged KV cache: block bookkeeping (allocator), tensors and ops (cache), memory planning."""

from __future__ import annotations

from . import native as native  # the native CPU decode attention (built on request; no torch import)
from .allocator import AllocatorStatistics, InvalidBlock, PagedKVAllocator, UnknownSequence
from .cache import PagedKVCache
from .planner import KVPlan, ModelShape, kv_cache_bytes, plan

__all__ = [
    "AllocatorStatistics",
    "InvalidBlock",
    "KVPlan",
    "ModelShape",
    "PagedKVAllocator",
    "PagedKVCache",
    "UnknownSequence",
    "kv_cache_bytes",
    "plan",
]

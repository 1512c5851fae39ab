"""batchkit: batching for any model callable, with bounded latency, bounded memory and nothing lost.

Importing batchkit starts no thread and imports neither torch nor cupy.
"""

from __future__ import annotations

from . import collate, sim, testing
from ._clock import Clock, MonotonicClock
from ._errors import (
    BatcherClosed,
    BatchkitError,
    BatchSizeMismatch,
    BatchTimeout,
    CircuitOpen,
    DeadlineExceeded,
    KVCacheExhausted,
    QueueEmpty,
    QueueFull,
)
from .adaptive import AdaptiveBatchController, AdaptiveTuner, CircuitBreaker, Decision
from .batcher import BatcherStatistics, BatchInfo, DynamicBatcher
from .continuous import ContinuousDecodeLoop, SamplingParams, Scheduler, StepBatch
from .decorator import AsyncBatchedFunction, BatchedFunction, batched
from .kv import (
    AllocatorStatistics,
    InvalidBlock,
    KVPlan,
    ModelShape,
    PagedKVAllocator,
    PagedKVCache,
    UnknownSequence,
    kv_cache_bytes,
)
from .metrics import LatencySummary
from .queue import BoundedQueue, QueueEntry, QueueStatistics

__version__ = "0.1.0"

__all__ = [
    "AdaptiveBatchController",
    "AdaptiveTuner",
    "AllocatorStatistics",
    "AsyncBatchedFunction",
    "BatchInfo",
    "BatchSizeMismatch",
    "BatchTimeout",
    "BatchedFunction",
    "BatcherClosed",
    "BatcherStatistics",
    "BatchkitError",
    "BoundedQueue",
    "CircuitBreaker",
    "CircuitOpen",
    "Clock",
    "ContinuousDecodeLoop",
    "DeadlineExceeded",
    "Decision",
    "DynamicBatcher",
    "InvalidBlock",
    "KVCacheExhausted",
    "KVPlan",
    "LatencySummary",
    "ModelShape",
    "MonotonicClock",
    "PagedKVAllocator",
    "PagedKVCache",
    "QueueEmpty",
    "QueueEntry",
    "QueueFull",
    "QueueStatistics",
    "SamplingParams",
    "Scheduler",
    "StepBatch",
    "UnknownSequence",
    "__version__",
    "batched",
    "collate",
    "kv_cache_bytes",
    "sim",
    "testing",
]

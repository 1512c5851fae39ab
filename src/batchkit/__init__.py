"""batchkit: batching for any model callable, with bounded latency, bounded memory and nothing lost.

Importing batchkit starts no thread and imports neither torch nor cupy.
"""

from __future__ import annotations

from . import collate, testing
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
from .batcher import BatcherStatistics, BatchInfo, DynamicBatcher
from .decorator import AsyncBatchedFunction, BatchedFunction, batched
from .metrics import LatencySummary
from .queue import BoundedQueue, QueueEntry, QueueStatistics

__version__ = "0.1.0"

__all__ = [
    "AsyncBatchedFunction",
    "BatchInfo",
    "BatchSizeMismatch",
    "BatchTimeout",
    "BatchedFunction",
    "BatcherClosed",
    "BatcherStatistics",
    "BatchkitError",
    "BoundedQueue",
    "CircuitOpen",
    "Clock",
    "DeadlineExceeded",
    "DynamicBatcher",
    "KVCacheExhausted",
    "LatencySummary",
    "MonotonicClock",
    "QueueEmpty",
    "QueueEntry",
    "QueueFull",
    "QueueStatistics",
    "__version__",
    "batched",
    "collate",
    "testing",
]

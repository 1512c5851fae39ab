"""Dynamic batching: requests gathered into batches for a batch function.

The layers, each one module: ``_queue_core`` (admission, priorities, deadlines; no I/O),
``former`` (when a batch forms, told the time), ``queue`` (:class:`BoundedQueue`, the blocking
and async shells of the core), ``shell`` (what both batchers share), ``batch_function`` (what a
batch function's return means), ``batcher`` (:class:`DynamicBatcher`, worker threads),
``async_batcher`` (:class:`AsyncBatcher`, on the callers' event loop) and ``decorator``
(``@batched``). Nothing here imports :mod:`batchkit.continuous`.
"""

from .async_batcher import AsyncBatcher
from .batcher import DynamicBatcher
from .decorator import AsyncBatchedFunction, BatchedFunction, batched
from .former import BatchFormer, BatchInfo, FormedBatch
from .queue import BoundedQueue, QueueEntry, QueueStatistics
from .shell import BatcherOptions, BatcherStatistics

__all__ = [
    "AsyncBatchedFunction",
    "AsyncBatcher",
    "BatchFormer",
    "BatchInfo",
    "BatchedFunction",
    "BatcherOptions",
    "BatcherStatistics",
    "BoundedQueue",
    "DynamicBatcher",
    "FormedBatch",
    "QueueEntry",
    "QueueStatistics",
    "batched",
]

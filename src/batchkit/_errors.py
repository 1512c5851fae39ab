"""The exceptions batchkit raises.

Every error derives from :class:`BatchkitError` and from the builtin it most resembles, so that
``except TimeoutError`` or ``except MemoryError`` in application code keeps working.
"""

from __future__ import annotations

__all__ = [
    "BatchSizeMismatch",
    "BatchTimeout",
    "BatcherClosed",
    "BatchkitError",
    "CircuitOpen",
    "DeadlineExceeded",
    "InvalidBlock",
    "JobStateError",
    "KVCacheExhausted",
    "QueueEmpty",
    "QueueFull",
    "UnknownSequence",
]


class BatchkitError(Exception):
    """Root of every error batchkit raises on purpose."""


class QueueFull(BatchkitError, RuntimeError):
    """A bounded queue had no room for an item (or dropped it to make room for another).

    Raise the queue's ``maxsize``, choose ``on_full="block"`` to wait for room, or add capacity
    (more replicas, a bigger batch) so that the queue drains faster than it fills.
    """


class QueueEmpty(BatchkitError, LookupError):
    """A non-blocking get found no item waiting."""


class DeadlineExceeded(BatchkitError, TimeoutError):
    """An item's deadline passed before it was served."""


class BatcherClosed(BatchkitError, RuntimeError):
    """The batcher is closed (or closing) and accepts no new work."""


class BatchSizeMismatch(BatchkitError, ValueError):
    """A batch function returned something other than one result per input."""


class BatchTimeout(BatchkitError, TimeoutError):
    """A batch function ran longer than the batcher's ``batch_timeout_s``."""


class KVCacheExhausted(BatchkitError, MemoryError):
    """The paged KV cache (or a tenant's quota of it) has no room for the request."""


class CircuitOpen(BatchkitError, RuntimeError):
    """Repeated failures opened the circuit breaker; new work fails fast until it cools down."""


class UnknownSequence(BatchkitError, KeyError):
    """The sequence id is not allocated in the KV cache (never was, or was already freed)."""


class InvalidBlock(BatchkitError, ValueError):
    """A block id outside the pool, or the reserved null block, was passed where a real block is needed."""


class JobStateError(BatchkitError, RuntimeError):
    """A bulk job's output, dead-letter file and journal do not describe this job (another job's,
    edited by hand, or in use by another process); the message says which file and what to do."""

"""batchkit: batching for any model callable, with bounded latency, bounded memory and nothing lost.

Importing batchkit starts no thread and imports neither torch nor cupy. The submodules
``batchkit.bench``, ``batchkit.jobs``, ``batchkit.models`` (which needs torch) and
``batchkit.serve`` load on first attribute access, so that every name of docs/api.md is reachable
after a bare ``import batchkit``.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from . import collate, continuous, kv, sim, testing
from ._clock import Clock, MonotonicClock
from ._cpu import CpuThreads, ThreadGovernor, adapt_cpu_threads, configure_cpu_threads
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
from .continuous import ContinuousDecodeLoop, SamplingParams, Scheduler, StepBatch
from .control import AdaptiveBatchController, AdaptiveTuner, CircuitBreaker, Decision
from .dynamic import (
    AsyncBatchedFunction,
    AsyncBatcher,
    BatchedFunction,
    BatcherStatistics,
    BatchInfo,
    BoundedQueue,
    DynamicBatcher,
    QueueEntry,
    QueueStatistics,
    batched,
)
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

if TYPE_CHECKING:  # for type checkers: the real imports are lazy (see __getattr__)
    from . import bench as bench
    from . import demo as demo
    from . import jobs as jobs
    from . import models as models
    from . import serve as serve

__version__ = "0.1.0"

# Submodules loaded on first access: not in __all__, so that ``from batchkit import *`` stays light.
_LAZY_SUBMODULES = frozenset({"bench", "demo", "integrations", "jobs", "models", "serve"})


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY_SUBMODULES:
        module = importlib.import_module(f".{name}", __name__)
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBMODULES})


__all__ = [
    "AdaptiveBatchController",
    "AdaptiveTuner",
    "AllocatorStatistics",
    "AsyncBatchedFunction",
    "AsyncBatcher",
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
    "CpuThreads",
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
    "ThreadGovernor",
    "UnknownSequence",
    "__version__",
    "adapt_cpu_threads",
    "batched",
    "collate",
    "configure_cpu_threads",
    "continuous",
    "kv",
    "kv_cache_bytes",
    "sim",
    "testing",
]

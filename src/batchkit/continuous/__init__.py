"""Continuous (iteration-level) batching for autoregressive decoding."""

from __future__ import annotations

from .loop import ContinuousDecodeLoop, LoopStatistics
from .request import Request, RequestStatus, ScheduledStep, TokenEvent
from .sampling import SamplingParams, sample
from .scheduler import Scheduler, SchedulerStatistics
from .step import StepBatch, check_logits, in_fresh_thread

__all__ = [
    "ContinuousDecodeLoop",
    "LoopStatistics",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "ScheduledStep",
    "Scheduler",
    "SchedulerStatistics",
    "StepBatch",
    "TokenEvent",
    "check_logits",
    "in_fresh_thread",
    "sample",
]

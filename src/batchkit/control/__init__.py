"""Batch size over time: the adaptive controller (clipped sign updates), the circuit breaker,
and the tuner that applies a policy to a live batcher or decode loop. Cores told the time; only
:meth:`AdaptiveTuner.start` owns a thread."""

from .breaker import BreakerState, CircuitBreaker
from .controller import AdaptiveBatchController, Decision, is_out_of_memory
from .tuner import AdaptiveTuner, BatchSizePolicy, TunableTarget

__all__ = [
    "AdaptiveBatchController",
    "AdaptiveTuner",
    "BatchSizePolicy",
    "BreakerState",
    "CircuitBreaker",
    "Decision",
    "TunableTarget",
    "is_out_of_memory",
]

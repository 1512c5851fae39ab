"""The tuner: applies a batch-size policy (an :class:`~batchkit.AdaptiveBatchController` or
any ``decide()``) to a live batcher or decode loop, on demand (``step()``) or on a timer thread."""

from __future__ import annotations

import logging
import math
import numbers
import threading
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .._clock import Clock, checked_clock
from .controller import AdaptiveBatchController, is_finite

# The name api.md documents for the tuner's step errors (the module's name before control/).
logger = logging.getLogger("batchkit.adaptive")

__all__ = ["AdaptiveTuner", "BatchSizePolicy", "TunableTarget"]


class BatchSizePolicy(Protocol):
    """What :class:`AdaptiveTuner` drives: anything that turns a snapshot into a batch size."""

    def decide(self, queue_depth: float, latencies_s: list[float], now: float) -> int: ...


class _ControllerPolicy:
    def __init__(self, controller: AdaptiveBatchController) -> None:
        self.controller = controller

    def decide(self, queue_depth: float, latencies_s: list[float], now: float) -> int:
        self.controller.observe_latencies(latencies_s, now)
        return self.controller.update(queue_depth, now).batch_size


@runtime_checkable
class TunableTarget(Protocol):
    """What :class:`AdaptiveTuner` drives: a runtime with a queue, a latency record and one batch
    limit. :class:`~batchkit.DynamicBatcher` implements it (``max_batch_size``; end-to-end
    latency), and so does :class:`~batchkit.ContinuousDecodeLoop` (``max_num_seqs``; TPOT)."""

    def queue_depth(self) -> int:
        """Requests waiting now (not yet running)."""
        ...

    def latency_samples(self, since: int = 0) -> tuple[list[float], int]:
        """Latencies (seconds) recorded after the first ``since``, and the count to pass next."""
        ...

    def set_batch_limit(self, size: int) -> None:
        """Apply a new limit on the requests that run together."""
        ...


class AdaptiveTuner:
    """Applies a policy to a live :class:`~batchkit.DynamicBatcher` (``max_batch_size``) or
    :class:`~batchkit.ContinuousDecodeLoop` (``max_num_seqs``), from their own statistics.

    ``target`` is any :class:`TunableTarget` (both of those implement it). Call :meth:`step`
    periodically (or :meth:`start` a timer thread). ``policy`` is an :class:`AdaptiveBatchController` or any object with
    ``decide(queue_depth, latencies_s, now)``. A controller gets the backlog a batch of the
    current size would leave behind, as inside a batcher: a batcher's waiting items less its
    ``max_batch_size`` (its next batch takes those), a decode loop's waiting requests as they are.
    Any other policy gets the target's ``queue_depth()``.

    Raises:
        TypeError: ``target`` is neither a :class:`TunableTarget` nor a decode loop.
    """

    def __init__(
        self, target: Any, policy: AdaptiveBatchController | BatchSizePolicy, *, clock: Clock | None = None
    ) -> None:
        self.target = target
        if isinstance(target, TunableTarget):
            self._tunable: TunableTarget = target
        else:
            raise TypeError(
                f"AdaptiveTuner needs a TunableTarget (queue_depth, latency_samples, set_batch_limit), "
                f"got {type(target).__name__}: pass a DynamicBatcher or a ContinuousDecodeLoop"
            )
        self.policy: BatchSizePolicy = (
            _ControllerPolicy(policy) if isinstance(policy, AdaptiveBatchController) else policy
        )
        self.clock: Clock = checked_clock(clock)
        self._seen = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step(self) -> int:
        """Read the target, ask the policy, apply its batch size; return it.

        Raises:
            ValueError: the policy chose a batch size below 1, or something that is not a finite
                number (a bool, a string, None, NaN): nothing is applied.
        """
        t = self._tunable
        lat, self._seen = t.latency_samples(self._seen)
        depth = float(t.queue_depth())
        if isinstance(self.policy, _ControllerPolicy):
            depth = self._backlog(depth)
        chosen = self.policy.decide(depth, lat, self.clock.now())
        # A number (a float is truncated); not a bool, a string int() would parse, None or NaN.
        if isinstance(chosen, (bool, np.bool_)) or not isinstance(chosen, numbers.Real) or not math.isfinite(chosen):
            raise ValueError(f"the policy chose batch size {chosen!r}; a batch size must be an int >= 1")
        size = int(chosen)
        if size < 1:  # a target at batch size 0 would never run another batch
            raise ValueError(f"the policy chose batch size {size}; a batch size must be >= 1")
        t.set_batch_limit(size)
        return size

    def _backlog(self, depth: float) -> float:
        # An AdaptiveBatchController's Q_t is the backlog a batch of the current size would leave
        # behind, as a batcher's own controller sees it. A batcher's waiting items are what its
        # next batch takes (up to max_batch_size of them); a decode loop's waiting requests are
        # already what its running set left out, and so is the depth of a target without a
        # max_batch_size.
        size = getattr(self.target, "max_batch_size", None)
        if isinstance(size, numbers.Real) and not isinstance(size, bool):
            return max(0.0, depth - float(size))
        return depth

    def start(self, interval_s: float = 0.1) -> None:
        """Run :meth:`step` every ``interval_s`` seconds on a daemon thread until :meth:`stop`.

        A step that raises (a policy's error, say) is logged on the ``batchkit.adaptive`` logger,
        once until the error changes, and the timer goes on: the target keeps its last batch size
        meanwhile.

        Raises:
            ValueError: ``interval_s`` is not a finite number > 0.
        """
        if not (is_finite(interval_s) and interval_s > 0):
            raise ValueError(f"interval_s must be a finite number of seconds > 0, got {interval_s!r}")
        if self._thread is not None:
            return
        self._stop.clear()  # a tuner stopped before starts again

        def run() -> None:
            last_error = ""
            while not self._stop.wait(interval_s):
                try:
                    self.step()
                except Exception as exc:  # noqa: BLE001 - a failing step must not end the tuning for good
                    error = f"{type(exc).__name__}: {exc}"
                    if error != last_error:
                        logger.error("AdaptiveTuner.step failed (the batch size stays as it is): %s", error)
                    last_error = error
                else:
                    last_error = ""

        self._thread = threading.Thread(target=run, name="batchkit-tuner", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

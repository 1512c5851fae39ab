"""What Ray Serve is told about a replica that holds one batcher: ``max_ongoing_requests`` and
the autoscaling config, derived from the batcher's bounds and ``batchkit bench``'s ``B_opt``.

Pure functions over numbers and dicts: nothing here imports Ray (:func:`require_ray` only
looks for it, and names the extra to install when it is missing).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from .._validate import non_negative_float, positive_int

__all__ = ["default_max_queue", "deployment_options", "merge_options", "require_ray"]

INSTALL_HINT = 'batchkit.integrations.ray needs Ray: pip install "batchkit[ray]"'
# Where Serve imports the queue-depth policy from: QueueDepthPolicy lives beside the replica
# hooks that feed it, in batchkit.integrations.ray.
QUEUE_DEPTH_POLICY = "batchkit.integrations.ray:QueueDepthPolicy"


def require_ray() -> None:
    """Raise ``ModuleNotFoundError`` naming the extra when Ray is not installed."""
    if importlib.util.find_spec("ray") is None:
        raise ModuleNotFoundError(INSTALL_HINT, name="ray")


def _non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    return value


def default_max_queue(max_batch: int, max_concurrent_batches: int = 1) -> int:
    """A replica's batcher queue when none is given: five full batches per batch slot (one
    running, four waiting)."""
    return 5 * max_batch * max_concurrent_batches


def deployment_options(
    *,
    max_batch: int,
    b_opt: int | None = None,
    max_concurrent_batches: int = 1,
    max_queue: int | None = None,
    num_replicas: int | None = None,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    autoscale_on_queue_depth: bool = False,
    upscale_delay_s: float | None = None,
    downscale_delay_s: float | None = None,
) -> dict[str, Any]:
    """Ray Serve deployment options for a replica that holds one batcher.

    Ray Serve sends a replica at most ``max_ongoing_requests`` requests at a time (default **5**)
    and holds the rest at the caller's handle. A batcher only sees what the replica holds, so with
    the default no batch ever exceeds 5 items, however many callers wait. Worse, requests held at
    a handle are not woken when a replica frees up: the router polls replicas with a backoff of up
    to a second. Measured (benchmarks/ray_replicas.py, 128 callers, a sleep-bound batch function
    that serves 194 req/s in one process): 6 req/s with a mean batch of 1.4 at the default,
    still only 28 req/s at ``max_ongoing_requests = 2 * max_batch``, and 181 req/s with the value
    derived here. So the replica should hold everything its batcher can admit, and the handle
    only true overload:

    - ``max_ongoing_requests = max_queue``, the batcher's queue capacity: everything a replica is
      sent may have to wait in its queue at once (a batch that started small leaves the rest
      waiting), so a replica is never sent more than its queue admits, and
      :func:`batched_deployment` gives its batcher that ``max_queue``. It defaults to ``5 *
      max_batch * max_concurrent_batches`` (a running batch and four waiting per slot: enough to
      keep every slot full while callers come and go); size it to the concurrency one replica
      must absorb (Little's law: ``L = lambda * W`` per replica).
    - ``target_ongoing_requests = b_opt * max_concurrent_batches`` (autoscaling only): the
      autoscaler adds replicas when each holds more than ``B_opt`` items per batch slot (the batch
      size ``batchkit bench`` found best: past it, more waiting buys latency and no throughput),
      and removes them when batches run under it. Without ``b_opt``, ``max_batch`` stands in.

    Args:
        max_batch: the batcher's ``max_batch_size`` (>= 1).
        b_opt: ``B_opt`` from ``batchkit bench`` (1 <= b_opt <= max_batch).
        max_concurrent_batches: the batcher's batch slots (>= 1).
        max_queue: the batcher's queue capacity (default ``5 * max_batch * max_concurrent_batches``;
            at least ``max_batch * max_concurrent_batches``, or no batch could fill).
        num_replicas: a fixed replica count (default 1 when no min/max is given).
        min_replicas, max_replicas: autoscale between these (either one turns autoscaling on; a
            missing ``min_replicas`` is 1, a missing ``max_replicas`` is ``max(min_replicas, 1)``).
        autoscale_on_queue_depth: scale on batchkit's own queue depth (:class:`QueueDepthPolicy`,
            fed by each replica's ``record_autoscaling_stats``) instead of Serve's request count.
            Choose it when one request can carry many items (:meth:`BatchkitReplica.batch`), since
            Serve counts requests, not items.
        upscale_delay_s, downscale_delay_s: passed to the autoscaling config when given (finite
            seconds >= 0; only with autoscaling).

    Returns:
        Keyword arguments for ``serve.deployment(...)`` or ``Deployment.options(...)``.

    Raises:
        ValueError: a bound below 1, ``b_opt`` above ``max_batch``, ``num_replicas`` together with
            ``min_replicas``/``max_replicas``, ``min_replicas > max_replicas``, or an autoscaling
            delay that is not finite seconds >= 0 or comes without autoscaling.
    """
    max_queue = _queue_capacity(max_batch, max_concurrent_batches, b_opt, max_queue)
    autoscaling = min_replicas is not None or max_replicas is not None or autoscale_on_queue_depth
    _check_delays(autoscaling, upscale_delay_s=upscale_delay_s, downscale_delay_s=downscale_delay_s)
    if not autoscaling:
        replicas = positive_int("num_replicas", num_replicas if num_replicas is not None else 1)
        return {"max_ongoing_requests": max_queue, "num_replicas": replicas}
    if num_replicas is not None:
        raise ValueError("pass either num_replicas (a fixed count) or min_replicas/max_replicas (autoscaling)")
    config = _autoscaling_config(min_replicas, max_replicas, b_opt or max_batch, max_concurrent_batches)
    config.update({k: v for k, v in _delays(upscale_delay_s, downscale_delay_s).items() if v is not None})
    if autoscale_on_queue_depth:
        target = config["target_ongoing_requests"]
        config["policy"] = {
            "policy_function": QUEUE_DEPTH_POLICY,
            "policy_kwargs": {"target_items_per_replica": target, "items_per_batch": b_opt or max_batch},
        }
    return {"max_ongoing_requests": max_queue, "autoscaling_config": config}


def _queue_capacity(max_batch: int, max_concurrent_batches: int, b_opt: int | None, max_queue: int | None) -> int:
    """The batcher's queue capacity (``max_ongoing_requests``), the bounds checked: every slot
    can hold a full batch, and ``b_opt`` is a batch size the batcher can form."""
    positive_int("max_batch", max_batch)
    positive_int("max_concurrent_batches", max_concurrent_batches)
    if b_opt is not None and positive_int("b_opt", b_opt) > max_batch:
        raise ValueError(f"b_opt ({b_opt}) cannot exceed max_batch ({max_batch}): pass the B_opt batchkit bench found")
    slots = max_batch * max_concurrent_batches
    if max_queue is None:
        return default_max_queue(max_batch, max_concurrent_batches)
    if positive_int("max_queue", max_queue) < slots:
        raise ValueError(
            f"max_queue ({max_queue}) is below max_batch * max_concurrent_batches ({slots}): a replica would never "
            "hold a full batch; raise max_queue or lower max_batch"
        )
    return max_queue


def _delays(upscale_delay_s: float | None, downscale_delay_s: float | None) -> dict[str, float | None]:
    return {"upscale_delay_s": upscale_delay_s, "downscale_delay_s": downscale_delay_s}


def _check_delays(autoscaling: bool, *, upscale_delay_s: float | None, downscale_delay_s: float | None) -> None:
    """The autoscaling delays given are finite seconds >= 0, and come with autoscaling."""
    for name, delay in _delays(upscale_delay_s, downscale_delay_s).items():
        if delay is None:
            continue
        non_negative_float(name, delay, note="(seconds)")
        if not autoscaling:
            raise ValueError(
                f"{name} is an autoscaling setting and this deployment does not autoscale: pass min_replicas / "
                "max_replicas (or autoscale_on_queue_depth) instead of a fixed num_replicas"
            )


def _autoscaling_config(
    min_replicas: int | None, max_replicas: int | None, items_per_batch: int, max_concurrent_batches: int
) -> dict[str, Any]:
    """The replica range (a missing ``min_replicas`` is 1, a missing ``max_replicas`` is
    ``max(min_replicas, 1)``) and ``target_ongoing_requests``: ``items_per_batch`` (``B_opt``)
    per batch slot."""
    lo = _non_negative_int("min_replicas", min_replicas if min_replicas is not None else 1)
    hi = positive_int("max_replicas", max_replicas if max_replicas is not None else max(lo, 1))
    if lo > hi:
        raise ValueError(f"min_replicas ({lo}) cannot exceed max_replicas ({hi})")
    return {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": items_per_batch * max_concurrent_batches}


def merge_options(options: dict[str, Any], overrides: Mapping[str, Any] | None) -> None:
    """``options.update(overrides)``, merging an ``autoscaling_config`` dict into the derived one."""
    for key, value in (overrides or {}).items():
        derived = options.get(key)
        if key == "autoscaling_config" and isinstance(derived, dict) and isinstance(value, Mapping):
            options[key] = {**derived, **value}
        else:
            options[key] = value

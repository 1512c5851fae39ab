"""batchkit on Ray: one batcher per Ray Serve replica, and batchkit-backed Ray Data pipelines.

Needs Ray (``pip install "batchkit[ray]"``, Ray 2.60 or newer). See docs/scale-out.md for when to
use replicas at all and what each knob does.

Serving::

    from ray import serve
    from batchkit.integrations.ray import batched_deployment

    def embed(texts: list[str]) -> list[list[float]]: ...        # a batch function

    app = batched_deployment(embed, max_batch=32, max_wait_ms=10, b_opt=24, num_replicas=2).bind()
    handle = serve.run(app)
    vector = handle.remote("hello").result()                  # one item in, one result out

Bulk work::

    import ray.data
    from batchkit.integrations.ray import map_records

    ds = map_records(ray.data.read_json("in.jsonl"), embed, max_batch=64, replicas=2)
    ds.write_json("out/")                                      # {"id": ..., "output": ..., "error": None}

- :func:`deployment_options`: ``max_ongoing_requests``, ``target_ongoing_requests`` and the
  autoscaling config derived from the batcher's bounds and ``batchkit bench``'s ``B_opt``.
- :func:`batched_deployment`: a Serve deployment around a batch function (or a class whose
  instances are one), with health from the circuit breaker and queue-depth autoscaling stats.
- :class:`BatchkitReplica`: that deployment's body, usable as a base class.
- :func:`replica_health`, :func:`autoscaling_stats`: the same two hooks for a hand-written
  deployment whose methods are ``@batched``.
- :class:`QueueDepthPolicy`: a Serve autoscaling policy on batchkit's queue depth.
- :class:`BatchkitMapper`, :func:`map_records`: ``map_batches`` through a batcher, with the
  per-record outcome of ``batchkit.jobs``.

Importing this module does not import Ray; the functions that need it import it when called.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from .._errors import QueueFull
from .._validate import positive_int
from ..control import CircuitBreaker
from ..dynamic.batcher import BatcherShell, DynamicBatcher
from ..dynamic.decorator import AsyncBatchedFunction, BatchedFunction
from .ray_options import default_max_queue, deployment_options, merge_options, require_ray

__all__ = [
    "deployment_options",
    "default_max_queue",
    "batched_deployment",
    "BatchkitReplica",
    "replica_health",
    "autoscaling_stats",
    "QueueDepthPolicy",
    "BatchkitMapper",
    "map_records",
    "QUEUE_DEPTH_METRIC",
    "RUNNING_BATCHES_METRIC",
    "RUNNING_REQUESTS_METRIC",
    "DecodeReplica",
    "decode_deployment",
]

QUEUE_DEPTH_METRIC = "batchkit_queue_depth"
"""The ``record_autoscaling_stats`` key for items waiting in a replica's batcher queue."""
RUNNING_BATCHES_METRIC = "batchkit_running_batches"
"""The ``record_autoscaling_stats`` key for a replica's batches running now."""
RUNNING_REQUESTS_METRIC = "batchkit_running_requests"
"""The ``record_autoscaling_stats`` key for a decode loop's requests running now (each an item)."""

_DEFAULT = object()  # "not given", distinct from None


def _batchers(targets: Sequence[Any]) -> list[BatcherShell[Any, Any]]:
    out: list[BatcherShell[Any, Any]] = []
    for t in targets:
        if isinstance(t, AsyncBatchedFunction) and t.loop_batcher is not None:
            out.append(t.loop_batcher)  # the replica's loop awaits it there; threads use the portal
        if isinstance(t, (BatchedFunction, AsyncBatchedFunction)):
            out.append(t.batcher)
        elif isinstance(t, DynamicBatcher):
            out.append(t)
        else:
            raise TypeError(f"expected a DynamicBatcher or a @batched function (bound to its instance), got {t!r}")
    if not out:
        raise TypeError("pass at least one DynamicBatcher or @batched function")
    return out


# ---------------------------------------------------------------------- replica hooks


def replica_health(*batchers: Any) -> None:
    """Raise if a replica holding these batchers should be reported unhealthy.

    Call it from a deployment's ``check_health``: Serve restarts a replica whose health check
    keeps raising, which is the cure for a model that fails every batch (a poisoned CUDA context,
    a lost device). Unhealthy means: a batcher is closed, or its circuit breaker is open and not
    yet due for its probe. A half-open breaker is healthy: its probe batch decides.

    Args:
        batchers: ``DynamicBatcher`` objects or ``@batched`` functions (bound, for methods).

    Raises:
        CircuitOpen: a batcher's circuit breaker is open.
        BatcherClosed: a batcher is closed.
        TypeError: something else was passed.
    """
    from .._errors import BatcherClosed, CircuitOpen

    for b in _batchers(batchers):
        if b.closed:
            raise BatcherClosed(f"batcher {b.name!r} is closed: this replica serves nothing; let Serve replace it")
        cb = b.circuit_breaker
        # Read-only: check() would move the breaker to half-open from this (health) thread, outside
        # the batcher's lock. An open breaker past its cool-down is due for a probe: healthy.
        if cb is not None and cb.state == "open" and cb.clock.now() < cb.half_open_at:
            raise CircuitOpen(
                f"batcher {b.name!r}: repeated failing batches opened its circuit breaker "
                f"(opened {cb.opens} time(s)); the replica fails fast until a probe batch succeeds"
            )


def autoscaling_stats(*batchers: Any) -> dict[str, float]:
    """What a deployment's ``record_autoscaling_stats`` should return: the items waiting in these
    batchers' queues (:data:`QUEUE_DEPTH_METRIC`) and their batches running now
    (:data:`RUNNING_BATCHES_METRIC`), summed. :class:`QueueDepthPolicy` scales on them."""
    depth = 0
    running = 0
    for b in _batchers(batchers):
        s = b.statistics()
        depth += s.pending
        running += s.running_batches
    return {QUEUE_DEPTH_METRIC: float(depth), RUNNING_BATCHES_METRIC: float(running)}


class QueueDepthPolicy:
    """A Ray Serve autoscaling policy on batchkit's items rather than Serve's requests.

    Each period it takes the replicas' :data:`QUEUE_DEPTH_METRIC` and
    :data:`RUNNING_BATCHES_METRIC` (averaged by Serve over ``look_back_period_s``), counts the
    load in items as ``waiting items + running batches * items_per_batch`` over all replicas (plus
    :data:`RUNNING_REQUESTS_METRIC`, a decode loop's running requests), and
    asks for ``ceil(load / target_items_per_replica)`` replicas (0 when idle); Serve then applies
    min/max replicas, the scaling factors and the up/down delays. Until a replica has reported,
    it keeps the current count. :func:`deployment_options` with ``autoscale_on_queue_depth=True``
    configures it with ``B_opt`` per batch slot as the target and ``B_opt`` items per batch.
    """

    def __init__(self, target_items_per_replica: float, items_per_batch: float = 1.0) -> None:
        for name, value in (
            ("target_items_per_replica", target_items_per_replica),
            ("items_per_batch", items_per_batch),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be > 0, got {value!r}")
        self.target_items_per_replica = float(target_items_per_replica)
        self.items_per_batch = float(items_per_batch)

    def desired_replicas(self, metrics: Mapping[str, Mapping[Any, float]] | None, current: int) -> int:
        """The replica count for these per-replica metrics (``{metric: {replica: value}}``)."""
        keys = (QUEUE_DEPTH_METRIC, RUNNING_BATCHES_METRIC, RUNNING_REQUESTS_METRIC)
        if not metrics or not any(k in metrics for k in keys):
            return current
        waiting = sum(metrics.get(QUEUE_DEPTH_METRIC, {}).values())
        running = sum(metrics.get(RUNNING_BATCHES_METRIC, {}).values())
        requests = sum(metrics.get(RUNNING_REQUESTS_METRIC, {}).values())
        load = waiting + running * self.items_per_batch + requests
        return max(1, math.ceil(load / self.target_items_per_replica)) if load > 0 else 0

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """Serve's policy signature: an ``AutoscalingContext`` in, (replicas, policy state) out."""
        return self.desired_replicas(ctx.aggregated_metrics, ctx.current_num_replicas), {}


# ---------------------------------------------------------------------- the replica


class BatchkitReplica:
    """The body of a Serve replica: one :class:`~batchkit.DynamicBatcher` around a batch function.

    :func:`batched_deployment` builds a deployment from it; subclass it to add methods. Serve
    calls ``check_health`` (:func:`replica_health`) and ``record_autoscaling_stats``
    (:func:`autoscaling_stats`) on it. A request cancelled by Ray (the caller's
    ``response.cancel()``, a disconnected HTTP client) cancels the awaiting task, and the batcher
    drops the item if its batch has not been dispatched yet.

    Args:
        target: a batch function (``list[item] -> list[result]``, sync or async), or a class whose
            instance is one (built here, in the replica, from ``args`` and ``kwargs``: load the
            model in its ``__init__``).
        batcher_options: ``DynamicBatcher`` keyword arguments. A ``circuit_breaker`` given is
            copied, so each replica has its own.
        args, kwargs: for ``target`` when it is a class.
    """

    def __init__(
        self,
        target: Callable[..., Any],
        batcher_options: Mapping[str, Any] | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        fn = target(*args, **(kwargs or {})) if isinstance(target, type) else target
        options = dict(batcher_options or {})
        if options.get("circuit_breaker") is not None:
            options["circuit_breaker"] = copy.deepcopy(options["circuit_breaker"])
        self.batcher: DynamicBatcher[Any, Any] = DynamicBatcher(fn, **options)

    async def __call__(self, item: Any) -> Any:
        """One item in, its result out (through this replica's batcher)."""
        return await self.batcher.asubmit(item)

    async def submit(self, item: Any, *, priority: int = 0, deadline_ms: float | None = None) -> Any:
        """One item with a priority class and a deadline (see ``DynamicBatcher.submit``)."""
        return await self.batcher.asubmit(item, priority=priority, deadline_ms=deadline_ms)

    async def batch(self, items: list[Any]) -> list[Any]:
        """Many items in one request (a page of a bulk job), each batched with everyone else's.

        Returns one result per item; a failed item's slot holds its exception instead of failing
        the whole request. Items wait for room in the replica's queue instead of failing with
        :class:`~batchkit.QueueFull`, so a request may carry more items than the queue holds.
        Serve counts this as one request: scale on queue depth (``autoscale_on_queue_depth``)
        when callers send lists.
        """
        import anyio

        results: list[Any] = [None] * len(items)

        async def one(i: int, item: Any) -> None:
            try:
                results[i] = await self._submit_waiting(item)
            except Exception as exc:  # noqa: BLE001 - one item's failure is that item's result
                results[i] = exc

        async with anyio.create_task_group() as tg:
            for i, item in enumerate(items):
                tg.start_soon(one, i, item)
        return results

    async def _submit_waiting(self, item: Any) -> Any:
        """``asubmit(item)``, waiting for room while the queue is full, whatever its ``on_full``
        (a submit to a full ``drop_oldest`` queue would evict another caller's item); a closed
        batcher still raises :class:`~batchkit.BatcherClosed`."""
        b = self.batcher
        q = b.queue
        while True:
            # Every freed slot and the close wake the waiters (see BoundedQueue.stop_waiting).
            while len(q) >= q.maxsize and not b.closed:
                await q.await_room()
            try:
                return await b.asubmit(item)
            except QueueFull:
                if b.closed:
                    raise
                # Another request took the room first (or evicted this item): wait and try again.

    def statistics(self) -> Any:
        """This replica's ``BatcherStatistics``."""
        return self.batcher.statistics()

    def check_health(self) -> None:
        """Serve's health hook (see :func:`replica_health`)."""
        replica_health(self.batcher)

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook (see :func:`autoscaling_stats`)."""
        return autoscaling_stats(self.batcher)

    def __del__(self) -> None:
        # Serve drops the replica on shutdown; fail what is left instead of running it (callers of
        # a replica being torn down are already being answered by Serve).
        batcher = getattr(self, "batcher", None)
        if batcher is not None and not batcher.closed:
            batcher.close(drain=False, timeout=5.0)


def batched_deployment(
    target: Callable[..., Any],
    *,
    max_batch: int = 8,
    max_wait_ms: float = 20.0,
    b_opt: int | None = None,
    name: str | None = None,
    num_replicas: int | None = None,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    autoscale_on_queue_depth: bool = False,
    ray_actor_options: Mapping[str, Any] | None = None,
    deployment_kwargs: Mapping[str, Any] | None = None,
    circuit_breaker: Any = _DEFAULT,
    **batcher_options: Any,
) -> Any:
    """A Ray Serve deployment whose every replica batches through its own batcher.

    ``batched_deployment(fn, max_batch=32, max_wait_ms=10, num_replicas=2).bind()`` is an
    application for ``serve.run``; the handle's ``remote(item)`` returns that item's result. When
    ``target`` is a class, ``.bind(*args, **kwargs)`` passes its constructor's arguments, and each
    replica builds its own instance (load the model there, not in the driver).

    The deployment's ``max_ongoing_requests`` and autoscaling come from :func:`deployment_options`
    (read why there: Serve's default of 5 ongoing requests caps every batch at 5). Each replica has
    a :class:`~batchkit.CircuitBreaker` (default ``CircuitBreaker()``; ``circuit_breaker=None``
    for none) whose open state fails Serve's health check, so Serve replaces a replica whose batch
    function keeps failing.

    Args:
        target: a batch function, or a class whose instances are batch functions.
        max_batch, max_wait_ms: the batcher's ``max_batch_size`` and ``max_wait_ms``.
        b_opt, num_replicas, min_replicas, max_replicas, autoscale_on_queue_depth: see
            :func:`deployment_options`.
        name: the deployment's name (default: the target's name).
        ray_actor_options: Serve's per-replica resources (``{"num_cpus": 1, "num_gpus": 1}``).
        deployment_kwargs: more ``serve.deployment`` options; they override the derived ones,
            except that an ``autoscaling_config`` dict is merged into the derived one (so
            ``{"autoscaling_config": {"upscale_delay_s": 5}}`` keeps the target and policy).
        circuit_breaker: a ``CircuitBreaker`` (each replica gets a copy) or None.
        batcher_options: other ``DynamicBatcher`` keyword arguments (``max_queue``,
            ``max_concurrent_batches``, ``isolate_errors``, ``batch_timeout_s``, ...).

    Raises:
        ModuleNotFoundError: Ray is not installed (the message names the extra).
        TypeError: ``target`` is not callable, or is a ``@batched`` function (pass the plain batch
            function: the batcher must be built in the replica, not pickled from the driver), or
            a ``queue`` is given (pass ``max_queue`` and ``on_full``).
        ValueError: see :func:`deployment_options`.
    """
    require_ray()
    options = _replica_batcher_options(target, max_batch, max_wait_ms, name, circuit_breaker, batcher_options)
    serve_options = deployment_options(
        max_batch=max_batch,
        b_opt=b_opt,
        max_concurrent_batches=options.get("max_concurrent_batches", 1),
        max_queue=options["max_queue"],
        num_replicas=num_replicas,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        autoscale_on_queue_depth=autoscale_on_queue_depth,
    )
    deployment_name: str = name or str(getattr(target, "__name__", "BatchkitReplica"))
    return _deployment(
        BatchkitReplica, (target, options), deployment_name, serve_options, ray_actor_options, deployment_kwargs
    )


def _replica_batcher_options(
    target: Callable[..., Any],
    max_batch: int,
    max_wait_ms: float,
    name: str | None,
    circuit_breaker: Any,
    batcher_options: Mapping[str, Any],
) -> dict[str, Any]:
    """The ``DynamicBatcher`` options each replica builds its batcher with (a queue sized by
    :func:`default_max_queue` unless given), after refusing what cannot be shipped to replicas."""
    if isinstance(target, (BatchedFunction, AsyncBatchedFunction, DynamicBatcher)):
        raise TypeError(
            "pass the plain batch function (or a class building it), not a @batched function or a "
            "DynamicBatcher: each replica builds its own batcher"
        )
    if not callable(target):
        raise TypeError(f"target must be a batch function or a class whose instances are one, got {target!r}")
    if "queue" in batcher_options:
        raise TypeError(
            "a BoundedQueue cannot be shipped to replicas (each replica builds its own): "
            "pass max_queue and on_full instead"
        )
    cb = CircuitBreaker() if circuit_breaker is _DEFAULT else circuit_breaker
    if cb is not None and not isinstance(cb, CircuitBreaker):
        raise TypeError(f"circuit_breaker must be a batchkit.CircuitBreaker or None, got {cb!r}")
    options: dict[str, Any] = dict(batcher_options)
    options.update(max_batch_size=max_batch, max_wait_ms=max_wait_ms, circuit_breaker=cb)
    options.setdefault("max_queue", default_max_queue(max_batch, options.get("max_concurrent_batches", 1)))
    options.setdefault("name", name or getattr(target, "__name__", "batch_fn"))
    return options


def _deployment(
    base: type[Any],
    base_args: tuple[Any, ...],
    name: str,
    serve_options: dict[str, Any],
    ray_actor_options: Mapping[str, Any] | None,
    deployment_kwargs: Mapping[str, Any] | None,
) -> Any:
    """``serve.deployment`` of a subclass of ``base`` named ``name``: each replica is
    ``base(*base_args, args, kwargs)``, with ``.bind(*args, **kwargs)``'s arguments."""
    from ray import serve

    if ray_actor_options is not None:
        serve_options["ray_actor_options"] = dict(ray_actor_options)
    merge_options(serve_options, deployment_kwargs)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base.__init__(self, *base_args, args, kwargs)

    replica = type(name, (base,), {"__init__": __init__, "__module__": __name__})
    return serve.deployment(replica, name=name, **serve_options)


# ---------------------------------------------------------------------- a decode loop per replica


class DecodeReplica:
    """The body of a Serve replica around one :class:`~batchkit.ContinuousDecodeLoop`.

    ``generate`` streams a request's tokens (call it through ``handle.options(stream=True)``);
    ``__call__`` returns them all at once. A streaming request that Ray cancels (the caller's
    ``cancel()``, or a client that goes away) leaves the loop's ``async for`` early, which aborts
    the request and frees its KV blocks. ``record_autoscaling_stats`` reports the requests
    waiting for admission and running (:class:`QueueDepthPolicy` counts both).

    Args:
        make_loop: called in the replica, with ``args`` and ``kwargs``, to build the loop (and
            its model and KV cache): the driver never holds the model.
    """

    def __init__(
        self, make_loop: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> None:
        from ..continuous.loop import ContinuousDecodeLoop

        loop = make_loop(*args, **(kwargs or {}))
        if not isinstance(loop, ContinuousDecodeLoop):
            raise TypeError(f"make_loop must return a batchkit.ContinuousDecodeLoop, got {type(loop).__name__}")
        self.loop: ContinuousDecodeLoop = loop

    async def generate(self, prompt_ids: Sequence[int], **sampling: Any) -> AsyncIterator[int]:
        """Stream the new tokens of one request (``SamplingParams`` fields as keywords)."""
        async for token in self.loop.generate(list(prompt_ids), **sampling):
            yield token

    async def __call__(self, prompt_ids: Sequence[int], **sampling: Any) -> list[int]:
        """All the new tokens of one request."""
        return await self.loop.agenerate_all(list(prompt_ids), **sampling)

    def statistics(self) -> Any:
        """This replica's ``LoopStatistics``."""
        return self.loop.statistics()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook: requests waiting and running."""
        s = self.loop.statistics().scheduler
        return {QUEUE_DEPTH_METRIC: float(self.loop.queue_depth()), RUNNING_REQUESTS_METRIC: float(s.running)}

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.close(timeout=5.0)


def decode_deployment(
    make_loop: Callable[..., Any],
    *,
    max_num_seqs: int,
    max_waiting: int | None = None,
    name: str | None = None,
    num_replicas: int | None = None,
    min_replicas: int | None = None,
    max_replicas: int | None = None,
    autoscale_on_queue_depth: bool = False,
    ray_actor_options: Mapping[str, Any] | None = None,
    deployment_kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """A Ray Serve deployment whose every replica runs its own continuous decode loop.

    ``decode_deployment(make_loop, max_num_seqs=32).bind(model_dir)`` builds, in each replica,
    ``make_loop(model_dir)`` (which loads the model, makes the KV cache and returns the loop). The
    handle's ``options(stream=True).generate.remote(prompt_ids, max_new_tokens=...)`` streams
    tokens; ``remote(prompt_ids, ...)`` returns them all.

    Sized like :func:`deployment_options` with the loop's ``max_num_seqs`` as the batch: a replica
    is sent at most ``max_waiting`` requests (default ``5 * max_num_seqs``), the most that could
    wait for admission at once; give the loop a ``max_waiting`` at least as large. Autoscaling
    targets ``max_num_seqs`` requests per replica.

    Raises:
        ModuleNotFoundError: Ray is not installed.
        ValueError: see :func:`deployment_options`.
    """
    require_ray()
    if not callable(make_loop):
        raise TypeError(f"make_loop must be a callable that builds a ContinuousDecodeLoop, got {make_loop!r}")
    # This function's names, not deployment_options' (max_batch / max_queue), in its errors.
    positive_int("max_num_seqs", max_num_seqs)
    if max_waiting is not None and positive_int("max_waiting", max_waiting) < max_num_seqs:
        raise ValueError(
            f"max_waiting ({max_waiting}) is below max_num_seqs ({max_num_seqs}): a replica would never be sent "
            "enough requests to fill its seats; raise max_waiting or lower max_num_seqs"
        )
    serve_options = deployment_options(
        max_batch=max_num_seqs,
        max_queue=max_waiting,
        num_replicas=num_replicas,
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        autoscale_on_queue_depth=autoscale_on_queue_depth,
    )
    if autoscale_on_queue_depth:
        # A running request is one item, reported as such (not as batches of B_opt).
        serve_options["autoscaling_config"]["policy"]["policy_kwargs"]["items_per_batch"] = 1
    deployment_name: str = name or str(getattr(make_loop, "__name__", "DecodeReplica"))
    return _deployment(
        DecodeReplica, (make_loop,), deployment_name, serve_options, ray_actor_options, deployment_kwargs
    )


# ---------------------------------------------------------------------- Ray Data


class BatchkitMapper:
    """A callable class for Ray Data's ``map_batches``: each actor batches its rows through its own
    batcher, with the per-record outcome of :func:`batchkit.jobs.run`.

    Each output row is ``{id_field: id, "output": result, "error": None}``, or ``{id_field: id,
    "output": None, "error": "ExcType: message"}`` for a record that still failed after
    ``retries`` further tries (a dead letter, kept in the dataset instead of a file: filter on
    ``error``). The batch function receives records as dicts of plain Python values, exactly as a
    ``batchkit.jobs`` batch function does, so one function serves both.

    ``map_batches`` already hands over blocks of rows; the batcher adds what a block does not
    give: ``max_batch`` independent of Ray's block size, cost-bounded batches (``size_fn`` +
    ``max_batch_cost``), ``group_by``, several batches in flight, and isolation of the record that
    makes a batch raise (``isolate_errors`` is on) so that its block-mates still succeed.

    Use :func:`map_records`, or directly::

        ds.map_batches(BatchkitMapper, fn_constructor_args=(fn,), fn_constructor_kwargs={"max_batch": 64},
                       compute=ray.data.ActorPoolStrategy(size=2), batch_size=256)

    Args:
        fn: a batch function (list of record dicts -> one result per record), or a class whose
            instance is one (built in the actor, with ``fn_args``/``fn_kwargs``).
        id_field: the record field copied to the output row (None: no id column).
        max_batch, max_wait_ms, max_concurrent_batches: the batcher's settings.
        retries: further tries of a record whose call failed, after ``backoff_s * 2**(n-1)`` s.
        backoff_s: the first retry's delay.
        batcher_options: other ``DynamicBatcher`` keyword arguments.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        id_field: str | None = "id",
        max_batch: int = 32,
        max_wait_ms: float = 20.0,
        max_concurrent_batches: int = 1,
        retries: int = 2,
        backoff_s: float = 0.5,
        fn_args: Sequence[Any] = (),
        fn_kwargs: Mapping[str, Any] | None = None,
        **batcher_options: Any,
    ) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an int >= 0, got {retries!r}")
        if isinstance(fn, (BatchedFunction, AsyncBatchedFunction, DynamicBatcher)):
            raise TypeError("pass the plain batch function: each Ray Data actor builds its own batcher")
        self.fn = fn(*fn_args, **(fn_kwargs or {})) if isinstance(fn, type) else fn
        self.id_field = id_field
        self.retries = retries
        self.backoff_s = backoff_s
        batcher_options.setdefault("isolate_errors", True)
        # A Ray Data block can be larger than any queue we would pick: wait for room instead of
        # refusing (the caller is this actor's own loop, never a user waiting on a socket).
        batcher_options.setdefault("on_full", "block")
        batcher_options.setdefault("max_queue", default_max_queue(max_batch, max_concurrent_batches))
        self.batcher: DynamicBatcher[Any, Any] = DynamicBatcher(
            self.fn,
            max_batch_size=max_batch,
            max_wait_ms=max_wait_ms,
            max_concurrent_batches=max_concurrent_batches,
            name=f"ray-data-{getattr(self.fn, '__name__', type(self.fn).__name__)}",
            **batcher_options,
        )

    def map_records(self, records: Sequence[dict[str, Any]]) -> list[tuple[Any, BaseException | None]]:
        """Each record's ``(result, None)`` or ``(None, error)``, in order."""
        outcomes: list[tuple[Any, BaseException | None]] = [(None, None)] * len(records)
        todo = list(range(len(records)))
        attempt = 0
        while todo:
            futures = [(i, self.batcher.submit(records[i])) for i in todo]
            self.batcher.flush()  # the block is all there is for now: do not wait for company
            failed = []
            for i, fut in futures:
                try:
                    outcomes[i] = (fut.result(), None)
                except Exception as exc:  # noqa: BLE001 - a record's failure is that record's outcome
                    outcomes[i] = (None, exc)
                    failed.append(i)
            if not failed or attempt >= self.retries:
                break
            attempt += 1
            time.sleep(self.backoff_s * 2 ** (attempt - 1))
            todo = failed
        return outcomes

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, list[Any]]:
        """One Ray Data batch (a dict of columns, ``batch_format="numpy"`` or ``"pyarrow"``'s
        ``to_pydict``) in, the output columns out."""
        records = _rows(batch)
        outcomes = self.map_records(records)
        out: dict[str, list[Any]] = {}
        if self.id_field is not None:
            out[self.id_field] = [r.get(self.id_field) for r in records]
        out["output"] = [_plain(result) for result, _ in outcomes]
        out["error"] = [None if err is None else _error_text(err) for _, err in outcomes]
        return out

    def __del__(self) -> None:
        batcher = getattr(self, "batcher", None)
        if batcher is not None and not batcher.closed:
            batcher.close(drain=False, timeout=5.0)


def _plain(value: Any) -> Any:
    """numpy and torch values as Python ones, as batchkit.jobs writes them."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else value


def _error_text(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _rows(batch: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A dict of columns (numpy arrays or lists) as a list of records of plain Python values."""
    columns = {k: _plain(v) if not isinstance(v, list) else v for k, v in batch.items()}
    n = len(next(iter(columns.values()))) if columns else 0
    return [{k: col[i] for k, col in columns.items()} for i in range(n)]


def map_records(
    ds: Any,
    fn: Callable[..., Any],
    *,
    replicas: int = 1,
    num_cpus: float = 0.5,
    num_gpus: float = 0,
    block_rows: int = 256,
    **mapper_options: Any,
) -> Any:
    """``ds.map_batches`` through :class:`BatchkitMapper` on ``replicas`` actors.

    Args:
        ds: a ``ray.data.Dataset`` of records (for example ``ray.data.read_json("in.jsonl")``).
        fn: the batch function (or a class building it in each actor).
        replicas: actors, each with its own batcher (and model).
        num_cpus, num_gpus: each actor's resources. The default of half a CPU leaves room for
            Ray Data's read tasks on a small machine (actors taking every CPU starve the reader).
        block_rows: rows per ``map_batches`` call (``batch_size``).
        mapper_options: :class:`BatchkitMapper` keyword arguments (``max_batch``, ``id_field``...).

    Returns:
        The mapped dataset (lazy: ``write_json``, ``take_all``... run it).
    """
    require_ray()
    import ray.data

    positive_int("replicas", replicas)
    positive_int("block_rows", block_rows)
    return ds.map_batches(
        BatchkitMapper,
        fn_constructor_args=(fn,),
        fn_constructor_kwargs=mapper_options,
        compute=ray.data.ActorPoolStrategy(size=replicas),
        batch_size=block_rows,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
    )

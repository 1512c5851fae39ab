"""Autoscaling on batchkit's queue depth (QueueDepthPolicy) on a local Ray instance.

Two callers each keep one ``batch`` request of ``--items`` items in flight to a deployment with
``max_batch=4`` (0.5 s per batch) and ``autoscale_on_queue_depth=True``. Serve sees 2 ongoing
requests against a target of 4 per replica, so its own request-count policy would keep one
replica; batchkit's queue holds the items, and QueueDepthPolicy asks for more. Prints the replica
states once a second and how long the scale-up took.

Run:  .venv/bin/python benchmarks/ray_autoscale.py [--items 16] [--max-replicas 3] [--timeout-s 60] [--json PATH]
(needs ``pip install "batchkit[ray]"``; starts and stops a local Ray instance; the metrics push
interval is set to 0.5 s through Serve's environment variables so that the run is short).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import _harness as harness

PUSH = {
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
}
os.environ.update(PUSH)  # before Serve is imported: the driver's handles read them at import


def slow(items: list[int]) -> list[int]:
    """Half a second per batch, whatever its size."""
    time.sleep(0.5)
    return items


def main() -> None:
    parser = harness.parser(
        __doc__, once=True, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--items", type=int, default=16)
    parser.add_argument("--max-replicas", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    args = parser.parse_args()
    record = harness.start(args)

    import ray
    from ray import serve

    from batchkit.integrations.ray import batched_deployment

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": PUSH},  # and the replicas' pushes
    )
    serve.start(proxy_location="Disabled")
    try:
        app = batched_deployment(
            slow,
            max_batch=4,
            max_wait_ms=5,
            max_queue=4 * args.items,
            min_replicas=1,
            max_replicas=args.max_replicas,
            autoscale_on_queue_depth=True,
            ray_actor_options={"num_cpus": 0.25},
            deployment_kwargs={"autoscaling_config": {"upscale_delay_s": 0.0, "look_back_period_s": 2.0}},
        )
        handle = serve.run(app.bind(), name="autoscale", route_prefix=None)
        stop = threading.Event()

        def pump() -> None:
            while not stop.is_set():
                handle.batch.remote(list(range(args.items))).result(timeout_s=60)

        threads = [threading.Thread(target=pump, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        t0 = time.monotonic()
        scaled = None
        asked = None
        while time.monotonic() - t0 < args.timeout_s:
            states = serve.status().applications["autoscale"].deployments["slow"].replica_states
            print(f"{time.monotonic() - t0:5.1f} s  {dict(states)}", flush=True)
            if asked is None and sum(states.values()) >= 2:
                asked = time.monotonic() - t0
            if states.get("RUNNING", 0) >= 2:
                scaled = time.monotonic() - t0
                break
            time.sleep(1.0)
        stop.set()
        for t in threads:
            t.join(timeout=60)
    finally:
        serve.shutdown()
        ray.shutdown()
    print()
    print(f"2 callers x 1 request of {args.items} items; Serve's target 4 requests per replica")
    record.add("asked for more replicas after", asked, "s")
    record.add("a second replica running after", scaled, "s")
    if scaled is None:
        print(f"no scale-up within {args.timeout_s:g} s")
    else:
        print(f"asked for more replicas after {asked:.1f} s; a second one running after {scaled:.1f} s")
    record.write()


if __name__ == "__main__":
    main()

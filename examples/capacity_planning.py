"""Plan capacity before deploying: KV memory for an LLM, then batch sizing in the simulator.

Runs in a second or two on a CPU, with no model at all:

    python examples/capacity_planning.py
"""

from __future__ import annotations

import batchkit
from batchkit import sim
from batchkit.kv import plan
from batchkit.kv.planner import PRESETS


def main() -> None:
    # 1. How many sequences fit? Llama-3-8B on a 24 GiB card.
    shape = batchkit.ModelShape.from_hf_config(PRESETS["llama-3-8b"])
    p = plan(shape, device_bytes=24 * 1024**3, activation_bytes=2 * 1024**3, mean_seq_len=2048)
    print(
        f"Llama-3-8B on 24 GiB: {p.num_blocks:,} KV blocks, {p.max_tokens:,} tokens, "
        f"{p.max_num_seqs} sequences of 2048 tokens at once"
    )

    # 2. Which batch size? A model whose batch costs 15 ms + 5 ms per item, at 120 requests/s.
    cost = sim.linear_cost(fixed_ms=15, per_item_ms=5)
    print("fixed max_batch_size at 120 req/s:")
    for b in (1, 4, 8, 16):
        r = sim.simulate(cost, sim.poisson(rate=120, duration_s=60, seed=1), max_batch_size=b, max_wait_ms=10)
        print(
            f"  B={b:2d}: served {r.throughput:6.1f}/s, P99 {r.latency.p99_ms:9.1f} ms, "
            f"mean batch {r.mean_batch_size:4.1f}"
        )

    # 3. Or let the controller choose, through a traffic step 40 -> 120 -> 40 requests/s.
    ctl = batchkit.AdaptiveBatchController(target_queue=1, min_batch=1, max_batch=16, latency_slo_ms=200)
    phases = [(20, 40), (20, 120), (20, 40)]
    r = sim.simulate(
        cost,
        sim.steps(phases, seed=2),
        max_batch_size=1,
        max_wait_ms=10,
        controller=ctl,
        phases=[(0, 20), (20, 40), (40, 60)],
    )
    for name, ph in zip(("low", "high", "low"), r.phases, strict=True):
        print(f"  adaptive, {name:4} phase: P99 {ph.latency.p99_ms:6.1f} ms, mean batch {ph.mean_batch_size:4.1f}")


if __name__ == "__main__":
    main()

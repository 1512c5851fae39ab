"""Serve a torch model to many concurrent callers with dynamic batching.

Each request is one input vector; batchkit stacks whatever arrives within max_wait_ms (or
max_batch_size) into one forward pass and hands each caller its row. Run:

    python examples/torch_model_server.py
"""

from __future__ import annotations

import concurrent.futures
import time

import torch

import batchkit


class Classifier:
    """A small torch model behind a batched method: one batcher per instance."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).eval()

    @batchkit.batched(max_batch=32, max_wait_ms=5, max_queue=1024, on_full="block")
    def predict(self, xs: list[torch.Tensor]) -> list[int]:
        with torch.inference_mode():
            return self.net(torch.stack(xs)).argmax(dim=1).tolist()


def main() -> None:
    torch.set_num_threads(2)
    model = Classifier()
    inputs = [torch.randn(256) for _ in range(2000)]
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        labels = list(pool.map(model.predict, inputs))
    elapsed = time.perf_counter() - t0
    with torch.inference_mode():
        expected = model.net(torch.stack(inputs)).argmax(dim=1).tolist()
    assert labels == expected, "batched answers must equal the unbatched model's"
    s = model.predict.statistics()
    print(f"{len(labels)} requests in {elapsed:.2f} s ({len(labels) / elapsed:,.0f} req/s)")
    print(f"batches: {s.batches}, mean size {s.mean_batch_size:.1f}, p99 latency {s.latency.p99_ms:.1f} ms")
    model.predict.close()


if __name__ == "__main__":
    main()

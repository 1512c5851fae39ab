"""Stream tokens from a small Llama-style model with continuous batching.

Many async callers each stream their own request; the decode loop re-forms the batch at every
step. The model is randomly initialised (no download), so the tokens are meaningless; the point
is the serving. Run:

    python examples/llm_streaming.py
"""

from __future__ import annotations

import anyio
import torch

import batchkit
from batchkit.models import LlamaConfig, LlamaModel


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = LlamaModel(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2))
    kv = model.make_cache(num_blocks=256, block_size=16)
    loop = batchkit.ContinuousDecodeLoop(model, kv, max_num_seqs=8, max_num_batched_tokens=512)

    async def client(i: int, results: dict[int, list[int]]) -> None:
        prompt = [(7 * i + k) % 512 for k in range(5 + i)]
        tokens = []
        async for tok in loop.generate(prompt, max_new_tokens=8 + 4 * i, temperature=0.8, top_p=0.95, seed=i):
            tokens.append(tok)  # a server would send each token to its client here
        results[i] = tokens

    async def run() -> dict[int, list[int]]:
        results: dict[int, list[int]] = {}
        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(client, i, results)
        return results

    results = anyio.run(run)
    for i in sorted(results)[:3]:
        print(f"request {i}: {len(results[i])} tokens, first {results[i][:5]}")
    s = loop.statistics()
    print(
        f"{s.scheduler.finished} requests, {s.steps} steps, {s.tokens_per_s:.0f} tokens/s; "
        f"TTFT p50 {s.scheduler.ttft.p50_ms:.1f} ms, TPOT p50 {s.scheduler.tpot.p50_ms:.1f} ms"
    )
    loop.close()


if __name__ == "__main__":
    main()

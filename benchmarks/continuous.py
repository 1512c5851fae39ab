"""Continuous batching: against static batching, against Hugging Face transformers, and the
scheduler's own CPU cost. Everything runs on CPU (2 torch threads) with the same randomly
initialised Llama config (hidden 256, 4 layers, 8 heads, 4 KV heads, vocab 1024), side by side.

1. batchkit continuous vs static batches (same model code, same requests; outputs uniform in
   8..256; batch 32): useful tokens/s and utilisation eta = sum(l_i) / (K * l_max).
2. transformers on the same weights and prompts: its continuous batching
   (``generate_batch``, ``attn_implementation="paged|sdpa"``, with its defaults and with a 512-token
   step budget) on 32 prompts x 64 new tokens, and
   its padded static ``generate()`` on all 32 prompts at once, with equal (64) and with mixed
   (8..256) output lengths (static generate runs to the longest; only each request's own
   tokens count).
3. Scheduler CPU time per step (schedule + update, no model) with 256 running sequences.

Run:  .venv/bin/python benchmarks/continuous.py [--skip-hf] [--repeat 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import _harness as harness
import torch

from batchkit.continuous import ContinuousDecodeLoop, Request, SamplingParams
from batchkit.demo import llm as demo


def batchkit_tokens_per_s(model, requests, batch: int = 32) -> float:  # type: ignore[no-untyped-def]
    return demo.serve(model, requests, "continuous", batch=batch).tokens_per_s


def hf_model(model):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        **demo.MODEL_SHAPE, max_position_embeddings=1024, eos_token_id=None, bos_token_id=None, pad_token_id=0
    )
    hf = LlamaForCausalLM(cfg).eval()
    hf.load_state_dict(model.state_dict(), strict=False)
    return hf


def hf_generate_batch(hf, prompts: list[list[int]], new_tokens: int, budget: int | None = None) -> float:  # type: ignore[no-untyped-def]
    """``generate_batch`` tokens/s: with transformers' defaults, or with ``budget`` tokens per step
    (``max_batch_tokens``; its default sizes the step from the free memory)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    hf.set_attn_implementation("paged|sdpa")
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = None if budget is None else ContinuousBatchingConfig(max_batch_tokens=budget)
    t0 = time.perf_counter()
    out = hf.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb, progress_bar=False)
    dt = time.perf_counter() - t0
    hf.set_attn_implementation("sdpa")
    return sum(len(o.generated_tokens) for o in out.values()) / dt


def hf_static_generate(hf, prompts: list[list[int]], lengths: list[int]) -> float:  # type: ignore[no-untyped-def]
    """Padded static generation of all prompts at once to the longest length; useful tokens/s."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(lengths),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return sum(lengths) / (time.perf_counter() - t0)


def scheduler_step_us(n_running: int = 256, steps: int = 300) -> tuple[float, float]:
    """Microseconds per step of schedule()+update(), and of building the StepBatch, at n running."""
    kv = demo.make_model().make_cache(num_blocks=n_running * 20, block_size=16)
    vocab = demo.MODEL_SHAPE["vocab_size"]

    def step(batch, kv):  # type: ignore[no-untyped-def]
        return torch.zeros(batch.sample_indices.shape[0], vocab)

    loop = ContinuousDecodeLoop(step, kv, max_num_seqs=n_running, max_num_batched_tokens=8192, watermark=0.0)
    for i in range(n_running):
        loop.scheduler.add(Request(i, [1] * 16, SamplingParams(max_new_tokens=steps + 10)))
    loop.step_once()  # prefill everything
    sched_t = build_t = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        s = loop.scheduler.schedule()
        t1 = time.perf_counter()
        loop.build_batch(s, kv.device)
        t2 = time.perf_counter()
        loop.scheduler.update(s, [0] * sum(s.samples))
        t3 = time.perf_counter()
        sched_t += (t1 - t0) + (t3 - t2)
        build_t += t2 - t1
    return sched_t / steps * 1e6, build_t / steps * 1e6


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--skip-hf", action="store_true", help="only the batchkit measurements")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--repeat", "--repeats", type=int, default=3, help="interleaved runs of each side (default 3)")
    args = ap.parse_args()
    record = harness.start(args)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    model = demo.make_model()
    mixed = demo.make_requests(args.requests, 8, 256, seed=1)
    runs = harness.interleave(  # interleaved: machine noise hits both alike
        {kind: lambda kind=kind: demo.serve(model, mixed, kind, batch=32) for kind in ("continuous", "static")},
        args.repeat,
        args.warmup,
    )
    ratios = [c.tokens_per_s / s.tokens_per_s for c, s in zip(runs["continuous"], runs["static"], strict=True)]
    for kind, kind_runs in runs.items():
        record.add("tokens/s", [r.tokens_per_s for r in kind_runs], "tok/s", section=1, batching=kind)
    record.add("continuous / static", ratios, section=1)
    cont = sorted(runs["continuous"], key=lambda r: r.tokens_per_s)[args.repeat // 2]
    stat = sorted(runs["static"], key=lambda r: r.tokens_per_s)[args.repeat // 2]
    print(
        f"1. continuous vs static, {args.requests} requests, outputs uniform 8..256, batch 32 "
        f"(median of {args.repeat} interleaved runs)"
    )
    for r in (cont, stat):
        print(
            f"   {r.name:30} {r.tokens_per_s:7.0f} tok/s  utilisation {r.utilisation:.2f}  "
            f"TTFT p50/p99 {r.ttft_p50:.0f}/{r.ttft_p99:.0f} ms  TPOT p50/p99 {r.tpot_p50:.1f}/{r.tpot_p99:.1f} ms"
        )
    bound = 1 / stat.utilisation
    print(
        f"   ratio {harness.median(ratios):.2f}x (per run: {', '.join(f'{x:.2f}' for x in ratios)}; "
        f"the padding bound 1/eta_static is {bound:.2f}x)"
    )

    sched_us, build_us = scheduler_step_us()
    record.add("scheduler CPU per step (schedule + update)", sched_us, "us", section=3, running=256)
    record.add("building the StepBatch tensors", build_us, "us", section=3, running=256)
    print(
        f"3. scheduler CPU per step at 256 running: {sched_us:.0f} us (schedule + update); "
        f"building the StepBatch tensors: {build_us:.0f} us"
    )

    if not args.skip_hf:
        against_transformers(args, record, model)
    record.write()


def against_transformers(args: argparse.Namespace, record: harness.Record, model: torch.nn.Module) -> None:
    """Section 2: transformers' generate_batch and padded generate() on the same weights."""
    hf = hf_model(model)
    equal = demo.make_requests(32, 64, 64, seed=2)
    prompts = [r.prompt for r in equal]
    mixed32 = demo.make_requests(32, 8, 256, seed=3)
    hf_cb = hf_generate_batch(hf, prompts, 64)
    hf_cb512 = hf_generate_batch(hf, prompts, 64, budget=512)
    runs = harness.interleave(  # interleaved, ratios per run
        {
            "batchkit equal": lambda: batchkit_tokens_per_s(model, equal),
            "generate() equal": lambda: hf_static_generate(hf, prompts, [64] * 32),
            "batchkit mixed": lambda: batchkit_tokens_per_s(model, mixed32),
            "generate() mixed": lambda: hf_static_generate(
                hf, [r.prompt for r in mixed32], [r.max_new_tokens for r in mixed32]
            ),
        },
        args.repeat,
        args.warmup,
    )
    ours_eq, hf_eq, ours_mix, hf_mix = runs.values()
    eq_ratios = [a / b for a, b in zip(ours_eq, hf_eq, strict=True)]
    mix_ratios = [a / b for a, b in zip(ours_mix, hf_mix, strict=True)]
    for name, values in runs.items():
        record.add(name, values, "tok/s", section=2)
    record.add("generate_batch", hf_cb, "tok/s", section=2)
    record.add("generate_batch max_batch_tokens=512", hf_cb512, "tok/s", section=2)
    record.add("batchkit / generate() equal", eq_ratios, section=2)
    record.add("batchkit / generate() mixed", mix_ratios, section=2)
    med = harness.median
    print(f"2. against transformers (same weights, same prompts; median of {args.repeat} interleaved runs)")
    print(
        f"   32 x 64 new tokens: batchkit {med(ours_eq):.0f} tok/s; transformers generate_batch {hf_cb:.0f} tok/s "
        f"({med(ours_eq) / hf_cb:.1f}x), with max_batch_tokens=512 {hf_cb512:.0f} tok/s "
        f"({med(ours_eq) / hf_cb512:.1f}x); padded generate() {med(hf_eq):.0f} tok/s "
        f"({med(eq_ratios):.2f}x; runs {', '.join(f'{x:.2f}' for x in eq_ratios)})"
    )
    print(
        f"   32 x mixed 8..256 : batchkit {med(ours_mix):.0f} tok/s; padded generate() {med(hf_mix):.0f} useful tok/s "
        f"({med(mix_ratios):.2f}x; runs {', '.join(f'{x:.2f}' for x in mix_ratios)})"
    )


if __name__ == "__main__":
    main()

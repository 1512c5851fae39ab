"""What plain requests pay for the sampling features other requests use beside them.

One ContinuousDecodeLoop over a small random LlamaModel, stepped in this thread (``step_once``):
``--rows`` greedy requests decode together, every ``--rows`` of them plain (``plain``), or
``--special`` of them using a feature: ``logprobs=5``, penalties and a logit bias (``penalties``:
``frequency_penalty``, ``presence_penalty``, ``repetition_penalty``, ``logit_bias``), or ``n``
(the special rows are samples of one prompt, the way ``generate_n`` queues them, their prompt
taken from the prefix cache). The batch has as many rows in every mode, so the ratio to ``plain``
is what the feature costs the step. Each mode's median step time, the modes interleaved over
``--repeat`` rounds after ``--warmup`` unrecorded ones.

``--plain-only`` prints the plain mode's figure alone: run it under the code before the
features (``PYTHONPATH=<old checkout>/src``) and after, to see what a step of plain requests
pays for the checks that find no feature in use.

    .venv/bin/python benchmarks/sampling_overhead.py --rows 16 --special 4 --steps 48 [--json PATH]
    .venv/bin/python benchmarks/sampling_overhead.py --plain-only
"""

from __future__ import annotations

import argparse
import itertools
from typing import Any

import _harness as harness
import torch

from batchkit import ContinuousDecodeLoop
from batchkit.continuous import Request, SamplingParams
from batchkit.models import LlamaConfig, LlamaModel

MODES = ("plain", "logprobs", "penalties", "n")


def _params(mode: str, special: bool, new_tokens: int) -> dict[str, Any]:
    base: dict[str, Any] = {"max_new_tokens": new_tokens, "ignore_eos": True}
    if special and mode == "logprobs":
        base["logprobs"] = 5
    if special and mode == "penalties":
        base |= {
            "frequency_penalty": 0.5,
            "presence_penalty": 0.5,
            "repetition_penalty": 1.2,
            "logit_bias": {7: 2.0, 11: -5.0},
        }
    return base


def step_round(loop: ContinuousDecodeLoop, requests: list[Request], steps: int) -> list[float]:
    """Add ``requests`` to ``loop``, run their prefills, then ``steps`` decode steps, and abort
    them: the times of the steps where every one of them still ran."""
    for req in requests:
        loop.scheduler.add(req)
    while loop.scheduler.waiting or any(r.num_computed < r.prompt_len for r in loop.scheduler.running):
        loop.step_once()  # the prefills
    times = []
    for _ in range(steps):
        full = len(loop.scheduler.running) == len(requests)
        seconds, _ = harness.timed(loop.step_once)
        if full:
            times.append(seconds)
    for req in requests:
        loop.scheduler.abort(req.request_id)
    loop.step_once()  # the aborts
    return times


def one_round(loop: ContinuousDecodeLoop, mode: str, rows: int, special: int, steps: int, tag: Any) -> list[float]:
    """The step times of one round: ``rows`` requests, ``special`` of them using ``mode``'s feature."""
    requests = []
    prompt = list(range(1, 41))  # 40 tokens: samples of it share 2 full blocks of 16
    lead: Request | None = None
    for i in range(rows):
        is_special = i >= rows - special and mode != "plain"
        req = Request((tag, i), [1 + i, *prompt], SamplingParams(**_params(mode, is_special, steps + 8)))
        if is_special and mode == "n":
            req = Request((tag, i), prompt, SamplingParams(**_params(mode, True, steps + 8)))
            req.after, lead = lead, lead or req
        requests.append(req)
    return step_round(loop, requests, steps)


def parse_args(doc: str | None, special: str, steps: int) -> tuple[argparse.Namespace, harness.Record]:
    """The options of the step-overhead benchmarks (this one and grammar_overhead.py), parsed and
    checked, and the run's record (the machine line printed); torch seeded, 2 threads."""
    p = harness.parser(doc)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--special", type=int, default=4, help=f"rows {special} (of --rows)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--repeat", type=int, default=5, help="interleaved rounds of the modes (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded rounds before them (default 1)")
    p.add_argument("--plain-only", action="store_true", help="only the plain mode (runs under older code too)")
    args = p.parse_args()
    if not 0 < args.special <= args.rows:
        p.error("--special must be in [1, --rows]")
    record = harness.start(args)
    torch.manual_seed(0)
    torch.set_num_threads(2)
    return args, record


def main() -> None:
    args, record = parse_args(__doc__, "using the feature", steps=48)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    model = LlamaModel(config)
    modes = ("plain",) if args.plain_only else MODES
    kw: dict[str, Any] = {"max_num_seqs": args.rows}
    if not args.plain_only:
        kw["enable_prefix_caching"] = True
    loop = ContinuousDecodeLoop(model, model.make_cache(num_blocks=1024, block_size=16), engine="caller", **kw)
    tags = itertools.count()
    rounds = harness.interleave(
        {m: lambda m=m: one_round(loop, m, args.rows, args.special, args.steps, next(tags)) for m in modes},
        args.repeat,
        args.warmup,  # the first steps of a shape are slow
    )
    times = {m: [t * 1e3 for r in rounds[m] for t in r] for m in modes}
    for m in modes:
        record.add("step", times[m], "ms", mode=m)
    plain = harness.median(times["plain"])
    print(f"{args.rows} rows, {args.steps} decode steps x {args.repeat} rounds, torch threads 2")
    print(f"plain: median step {plain:.3f} ms")
    for m in modes[1:]:
        med = harness.median(times[m])
        print(f"{args.special} of them {m}: median step {med:.3f} ms ({med / plain:.3f}x plain)")
    record.write()


if __name__ == "__main__":
    main()

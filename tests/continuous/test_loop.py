"""ContinuousDecodeLoop and its scheduler: the step contract, budgets, admission, preemption,
stop conditions, streaming, abort, and token equality with Hugging Face transformers."""

from __future__ import annotations

import concurrent.futures
import math
import random
import re
import threading
from collections.abc import AsyncGenerator, Hashable, Iterator, Sequence
from typing import Any, cast

import anyio
import numpy as np
import pytest
from _continuous_steps import GatedStep, small_cache

import batchkit
from _support import one_layer_cache, zeros_step
from batchkit import BatcherClosed, ContinuousDecodeLoop, KVCacheExhausted, PagedKVAllocator, SamplingParams, Scheduler
from batchkit.continuous import Request, RequestStatus, StepBatch, sample

torch = pytest.importorskip("torch")

from batchkit.models import LlamaConfig, LlamaModel  # noqa: E402

WAIT = 30
VOCAB = 50


class EchoStep:
    """A fake model: the next token is (last input token + 1) % VOCAB; records every batch."""

    def __init__(self) -> None:
        self.batches: list[StepBatch] = []

    def __call__(self, batch: StepBatch, kv: Any) -> Any:
        self.batches.append(batch)
        last = batch.input_ids[batch.sample_indices]
        return torch.nn.functional.one_hot((last + 1) % VOCAB, VOCAB).to(torch.float32)


def make_loop(step: Any = None, num_blocks: int = 64, block_size: int = 4, **kw: Any) -> ContinuousDecodeLoop:
    from batchkit import PagedKVCache

    kv = PagedKVCache(1, num_blocks, block_size, 1, 4)
    return ContinuousDecodeLoop(step or EchoStep(), kv, **kw)


def drive(
    loop: ContinuousDecodeLoop, arrivals: dict[int, list[Request]], max_steps: int = 10_000
) -> dict[Any, list[int]]:
    """Run the loop's steps in this thread, adding requests at the given step numbers."""
    out: dict[Any, list[int]] = {}
    for step_no in range(max_steps):
        for req in arrivals.get(step_no, []):
            loop.scheduler.add(req)
        if step_no > max(arrivals) and not loop.scheduler.has_work():
            return out
        _, events = loop.step_once()
        for ev in events:
            assert ev.error is None, ev.error
            if ev.token is not None:
                out.setdefault(ev.request_id, []).append(ev.token)
    raise AssertionError("the loop did not finish")


def test_build_batch_is_the_batch_step_once_hands_the_model() -> None:
    """build_batch(schedule()) gives the very StepBatch a step would get: the same ids,
    positions, slots, tables, lengths and sample indices (a decode and a chunked prefill together)."""

    def two_requests(echo: EchoStep) -> ContinuousDecodeLoop:
        loop = make_loop(echo, max_num_batched_tokens=6)
        loop.scheduler.add(Request("a", [1, 2, 3], SamplingParams(max_new_tokens=3)))
        loop.step_once()
        loop.scheduler.add(Request("b", [4, 5, 6, 7, 8], SamplingParams(max_new_tokens=3)))
        return loop

    probe = two_requests(EchoStep())
    built = probe.build_batch(probe.scheduler.schedule())
    echo = EchoStep()
    two_requests(echo).step_once()
    seen = echo.batches[-1]
    assert seen.num_seqs == 2
    tensors = ("input_ids", "positions", "query_start", "query_lens", "seq_lens", "slot_mapping", "block_tables")
    for name in (*tensors, "sample_indices"):
        assert torch.equal(getattr(built, name), getattr(seen, name)), name
    assert (built.seq_ids, built.sampling) == (seen.seq_ids, seen.sampling)


def test_in_fresh_thread_runs_elsewhere_and_hands_back_the_result_or_the_error() -> None:
    """in_fresh_thread runs the function in a new thread that has ended when it returns, returns
    its value, and raises its exception (the same object) in the caller."""
    from batchkit.continuous import in_fresh_thread

    seen: list[threading.Thread] = []

    def where(x: int, *, plus: int) -> int:
        seen.append(threading.current_thread())
        return x + plus

    assert in_fresh_thread(where, 1, plus=2) == 3
    assert seen[0] is not threading.current_thread()
    assert not seen[0].is_alive()
    boom = ValueError("boom")

    def fail() -> None:
        raise boom

    with pytest.raises(ValueError, match="boom") as info:
        in_fresh_thread(fail)
    assert info.value is boom


# --------------------------------------------------------------------------- the step contract


def test_step_batch_follows_the_contract() -> None:
    """A prefill chunk and a decode share a step; only sequences at the end of their tokens sample."""
    step = EchoStep()
    loop = make_loop(step, max_num_batched_tokens=4)
    loop.scheduler.add(Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_new_tokens=2)))
    loop.step_once()  # a: first 4 prompt tokens, no sample
    b0 = step.batches[0]
    assert b0.input_ids.tolist() == [1, 2, 3, 4]
    assert b0.positions.tolist() == [0, 1, 2, 3]
    assert b0.sample_indices.tolist() == []
    loop.scheduler.add(Request("b", [9], SamplingParams(max_new_tokens=3)))
    loop.step_once()  # a: last 2 prompt tokens (samples); b: its 1-token prompt (samples)
    b1 = step.batches[1]
    assert b1.input_ids.tolist() == [5, 6, 9]
    assert b1.positions.tolist() == [4, 5, 0]
    assert b1.query_start.tolist() == [0, 2, 3]
    assert b1.seq_lens.tolist() == [6, 1]
    assert b1.sample_indices.tolist() == [1, 2]
    assert b1.slot_mapping.tolist() == (
        loop.allocator.slot_mapping("a", 4, 6).tolist() + loop.allocator.slot_mapping("b", 0, 1).tolist()
    )


def test_step_batch_fields_are_typed_as_the_contract_says() -> None:
    """Every tensor a step gets is on the cache's device, int64 but for the int32 block tables;
    sample_rows is None, or an int64 tensor when a request asks for its prompt's logprobs;
    seq_ids and sampling are tuples."""
    step = EchoStep()
    loop = make_loop(step)
    loop.scheduler.add(Request("a", [1, 2, 3], SamplingParams(max_new_tokens=2)))
    loop.step_once()
    loop.scheduler.add(Request("b", [4, 5], SamplingParams(max_new_tokens=1, prompt_logprobs=1)))
    loop.step_once()
    plain, with_prompt_logits = step.batches
    assert plain.sample_rows is None
    assert isinstance(with_prompt_logits.sample_rows, torch.Tensor)
    int64 = ("input_ids", "positions", "query_start", "query_lens", "seq_lens", "slot_mapping", "sample_indices")
    for batch in step.batches:
        for name in int64:
            value = getattr(batch, name)
            assert (type(value), value.dtype, value.device) == (torch.Tensor, torch.int64, loop.kv.device), name
        tables = batch.block_tables
        assert (type(tables), tables.dtype, tables.device) == (torch.Tensor, torch.int32, loop.kv.device)
        assert type(batch.seq_ids) is tuple
        assert type(batch.sampling) is tuple
        assert all(type(s) is bool for s in batch.sampling)
    rows = with_prompt_logits.sample_rows
    assert (rows.dtype, rows.device) == (torch.int64, loop.kv.device)
    assert with_prompt_logits.seq_ids == ("a", "b")


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (lambda b: torch.zeros(b.sample_indices.shape[0] + 1, VOCAB), "one row per sequence"),
        (lambda b: [0.0], "must return a torch.Tensor"),
        (lambda b: torch.zeros(b.sample_indices.shape[0], VOCAB, dtype=torch.int64), "float tensor"),
    ],
)
def test_bad_step_output_fails_its_requests_and_the_loop_keeps_serving(bad: Any, message: str) -> None:
    """A step returning the wrong thing fails that step's callers with a clear error; later work runs."""
    calls = {"n": 0}
    echo = EchoStep()

    def step(batch: StepBatch, kv: Any) -> Any:
        calls["n"] += 1
        return bad(batch) if calls["n"] == 1 else echo(batch, kv)

    with make_loop(step) as loop:
        fut = loop.submit([1, 2], max_new_tokens=2)
        with pytest.raises((TypeError, ValueError), match=message):
            fut.result(WAIT)
        assert loop.submit([1], max_new_tokens=2).result(WAIT) == [2, 3]


# --------------------------------------------------------------------------- scheduling


def test_token_budget_is_shared_and_long_prompts_are_chunked() -> None:
    """A long prompt is prefilled in chunks while running decodes keep getting their token."""
    step = EchoStep()
    loop = make_loop(step, num_blocks=128, max_num_batched_tokens=8)
    drive(
        loop,
        {
            0: [Request("short", [1], SamplingParams(max_new_tokens=20))],
            2: [Request("long", list(range(40)), SamplingParams(max_new_tokens=1))],
        },
    )
    for b in step.batches:
        assert b.num_tokens <= 8
    # While the long prompt was being prefilled, the short request decoded every step.
    prefill_steps = [b for b in step.batches if len(b.seq_ids) == 2]
    assert len(prefill_steps) >= 40 // 8
    assert all("short" in b.seq_ids for b in prefill_steps)


def test_admission_reserves_the_whole_prompt() -> None:
    """A prompt is admitted only when blocks for all of it are free (no admit-then-preempt)."""
    loop = make_loop(num_blocks=9, block_size=4, watermark=0.0)  # 8 usable blocks
    sched = loop.scheduler
    sched.add(Request("a", list(range(20)), SamplingParams(max_new_tokens=8)))  # 5 blocks
    sched.add(Request("b", list(range(16)), SamplingParams(max_new_tokens=4)))  # 4 blocks: must wait
    step = sched.schedule()
    assert [r.request_id for r in step.requests] == ["a"]
    assert [r.request_id for r in sched.waiting] == ["b"]


def test_requests_that_can_never_fit_are_refused() -> None:
    """A prompt larger than the whole cache fails at once; one that outgrows it alone fails later."""
    loop = make_loop(num_blocks=5, block_size=4, watermark=0.0)
    with pytest.raises(KVCacheExhausted, match="shorten the prompt"):
        loop.scheduler.add(Request("x", list(range(20)), SamplingParams(max_new_tokens=2)))
    loop.scheduler.add(Request("y", [1], SamplingParams(max_new_tokens=40)))
    errors = []
    for _ in range(40):
        _, events = loop.step_once()
        errors += [e.error for e in events if e.error is not None]
    assert len(errors) == 1
    assert isinstance(errors[0], KVCacheExhausted)
    assert loop.allocator.statistics().used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_when_blocks_run_out_loses_nothing(mode: str) -> None:
    """Decodes that outgrow the cache preempt the newest request; every request still finishes right."""
    loop = make_loop(num_blocks=13, block_size=4, watermark=0.0, preemption_mode=mode, num_cpu_blocks=32)
    reqs = {i: Request(i, [i], SamplingParams(max_new_tokens=20)) for i in range(4)}
    out = drive(loop, {0: list(reqs.values())})
    assert loop.scheduler.statistics().preemptions > 0
    for i in range(4):
        assert out[i] == [(i + k) % VOCAB for k in range(1, 21)]
    s = loop.allocator.statistics()
    assert (s.used_blocks, s.num_seqs, s.cpu_free_blocks) == (0, 0, 32)


def test_higher_priority_waiting_request_preempts_a_lower_running_one() -> None:
    """Priority: an urgent request pushes out the worst running one when there is no room."""
    loop = make_loop(num_blocks=9, block_size=4, watermark=0.0)
    sched = loop.scheduler
    sched.add(Request("low", list(range(28)), SamplingParams(max_new_tokens=4), priority=5))
    loop.step_once()
    sched.add(Request("urgent", list(range(12)), SamplingParams(max_new_tokens=1), priority=0))
    step, _ = loop.step_once()
    assert [r.request_id for r in step.requests] == ["urgent"]
    assert sched.statistics().preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["low"]


def test_prefix_caching_lets_a_preempted_request_reuse_its_blocks() -> None:
    """With prefix caching, a recomputed request skips the tokens still cached."""
    loop = make_loop(num_blocks=64, block_size=4, enable_prefix_caching=True)
    first = Request("a", list(range(1, 13)), SamplingParams(max_new_tokens=1))
    drive(loop, {0: [first]})
    loop.scheduler.add(Request("b", list(range(1, 13)), SamplingParams(max_new_tokens=1)))
    step, _ = loop.step_once()
    assert step.num_new_tokens == (4,)  # 8 of 12 prompt tokens came from the cache
    assert loop.allocator.statistics().prefix_hits == 8


@pytest.mark.parametrize(
    ("params", "expected", "reason"),
    [
        ({"max_new_tokens": 3}, [2, 3, 4], "length"),
        ({"max_new_tokens": 10, "stop_token_ids": (4,)}, [2, 3, 4], "stop"),
        ({"max_new_tokens": 10, "eos_token_id": 3}, [2, 3], "eos"),
        ({"max_new_tokens": 4, "eos_token_id": 3, "ignore_eos": True}, [2, 3, 4, 5], "length"),
        ({"max_new_tokens": 10, "stop": ("45",)}, [2, 3, 4, 5], "stop"),
    ],
)
def test_stop_conditions(params: dict[str, Any], expected: list[int], reason: str) -> None:
    """max_new_tokens, stop ids, EOS (unless ignored) and stop strings end a request at once."""
    loop = make_loop(detokenize=lambda ids: "".join(str(t) for t in ids))
    req = Request("r", [1], SamplingParams(**params))
    out = drive(loop, {0: [req]})
    assert out["r"] == expected
    assert req.finish_reason == reason
    assert loop.allocator.statistics().used_blocks == 0


def test_abort_frees_everything() -> None:
    """Aborting running and waiting requests frees their blocks."""
    loop = make_loop()
    loop.scheduler.add(Request("a", [1, 2, 3], SamplingParams(max_new_tokens=50)))
    loop.scheduler.add(Request("b", [1], SamplingParams(max_new_tokens=50)))
    loop.step_once()
    assert loop.scheduler.abort("a")
    assert loop.scheduler.abort("b")
    assert not loop.scheduler.abort("b")
    assert loop.allocator.statistics().used_blocks == 0
    assert not loop.scheduler.has_work()


def test_loop_abort_takes_effect_at_the_next_step_once() -> None:
    """loop.abort(id) for a request added with scheduler.add is applied by step_once too (not
    only by the engine thread) and reported as a finished "abort" event."""
    loop = make_loop()
    loop.scheduler.add(Request("a", [1, 2, 3], SamplingParams(max_new_tokens=50)))
    loop.scheduler.add(Request("b", [1], SamplingParams(max_new_tokens=50)))
    loop.step_once()
    loop.abort("a")
    loop.abort("nobody")
    _, events = loop.step_once()
    aborted = [ev for ev in events if ev.finish_reason == "abort"]
    assert [(ev.request_id, ev.finished, ev.token) for ev in aborted] == [("a", True, None)]
    assert {ev.request_id for ev in events if ev.token is not None} == {"b"}
    loop.scheduler.abort("b")
    assert loop.allocator.statistics().used_blocks == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nan_logits_fail_only_their_request(temperature: float) -> None:
    """A row of NaN logits is an error for its request (not a silent token 0, nor a failure of
    the whole step); the other requests of the step go on."""

    class NanForPromptTwo(EchoStep):
        def __call__(self, batch: StepBatch, kv: Any) -> Any:
            logits = super().__call__(batch, kv)
            last = batch.input_ids[batch.sample_indices]
            return logits.masked_fill((last == 2)[:, None], float("nan"))

    with make_loop(NanForPromptTwo()) as loop:
        good = loop.submit([5], max_new_tokens=3, temperature=temperature, seed=1)
        bad = loop.submit([2], max_new_tokens=3, temperature=temperature, seed=1)
        with pytest.raises(FloatingPointError, match="NaN"):
            bad.result(WAIT)
        assert len(good.result(WAIT)) == 3
        assert loop.allocator.statistics().used_blocks == 0


def test_a_logit_bias_past_the_logits_fails_only_its_own_request() -> None:
    """A step that declares no vocabulary (no config.vocab_size) cannot have a logit_bias id
    checked at submit: one past its logits fails its own request, with ValueError, at its first
    token; the requests batched into the same step are answered."""
    echo = EchoStep()
    loop = make_loop(echo, engine="caller")  # nothing runs until all four are queued
    others = [loop.submit([1 + i], max_new_tokens=3) for i in range(3)]
    bad = loop.submit([5], max_new_tokens=3, logit_bias={100: 1.0})
    engine = threading.Thread(target=loop.run_engine)
    engine.start()
    try:
        with pytest.raises(ValueError, match=r"logit_bias holds token id 100, past the vocabulary \(50 tokens\)"):
            bad.result(WAIT)
        assert [f.result(WAIT) for f in others] == [[2, 3, 4], [3, 4, 5], [4, 5, 6]]
    finally:
        loop.close(WAIT)
        engine.join(WAIT)
    assert len(echo.batches[0].seq_ids) == 4  # the bad request shared the first step
    assert loop.allocator.statistics().used_blocks == 0


def test_once_a_step_has_run_a_logit_bias_past_its_logits_is_refused_at_submit() -> None:
    """The first step tells the loop its logits' width: from then on an id past it is refused by
    the submit call, and the last id within it is biased as asked."""
    with make_loop() as loop:
        assert loop.submit([1], max_new_tokens=1).result(WAIT) == [2]
        with pytest.raises(ValueError, match=r"logit_bias holds token id 50, past the vocabulary \(50 tokens\)"):
            loop.submit([1], max_new_tokens=1, logit_bias={50: 1.0})
        assert loop.queue_depth() == 0
        assert loop.submit([1], max_new_tokens=1, logit_bias={49: 100.0}).result(WAIT) == [49]


# --------------------------------------------------------------------------- sampling


def test_sampling_is_reproducible_under_a_seed_and_respects_top_k_top_p() -> None:
    """Same seed, same tokens; top_k=1 and a tiny top_p are greedy."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=g)
    p = SamplingParams(temperature=1.0, seed=3)

    def draw(params: SamplingParams) -> list[int]:
        gens = [torch.Generator().manual_seed(params.seed or 0) for _ in range(4)]
        return sample(logits, [params] * 4, gens)

    assert draw(p) == draw(p)
    greedy = logits.argmax(-1).tolist()
    assert draw(SamplingParams(temperature=0.7, top_k=1, seed=1)) == greedy
    assert draw(SamplingParams(temperature=0.7, top_p=1e-6, seed=1)) == greedy
    bads: tuple[dict[str, Any], ...] = ({"max_new_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -1})
    for bad in bads:
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


# --------------------------------------------------------------------------- runtime


@pytest.mark.anyio
async def test_generate_streams_tokens_to_many_tasks() -> None:
    """Concurrent async callers each receive their own stream, in order."""
    with make_loop() as loop:
        results: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            results[i] = [t async for t in loop.generate([i], max_new_tokens=5)]

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                for i in range(10):
                    tg.start_soon(one, i)
        assert results == {i: [(i + k) % VOCAB for k in range(1, 6)] for i in range(10)}


@pytest.mark.anyio
async def test_leaving_the_stream_early_aborts_and_frees() -> None:
    """Breaking out of generate() aborts the request and its blocks return to the pool."""
    with make_loop() as loop:
        gen = loop.generate([1], max_new_tokens=1000)
        got = []
        with anyio.fail_after(WAIT):
            async for t in gen:
                got.append(t)
                if len(got) == 3:
                    break
            await cast("AsyncGenerator[int, None]", gen).aclose()
            while loop.scheduler.has_work():
                await anyio.sleep(0.001)
        assert got == [2, 3, 4]
        assert loop.allocator.statistics().used_blocks == 0
        assert loop.scheduler.statistics().aborted == 1


def test_sync_generate_submit_and_close() -> None:
    """The sync iterator, futures from threads, and close() refusing new work."""
    loop = make_loop()
    assert list(loop.generate_sync([5], max_new_tokens=3)) == [6, 7, 8]
    futs = []
    ts = [threading.Thread(target=lambda i=i: futs.append(loop.submit([i], max_new_tokens=2))) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(WAIT)
    assert sorted(f.result(WAIT)[0] for f in futs) == list(range(1, 9))
    stats = loop.statistics()
    assert stats.scheduler.finished == 9
    assert stats.steps > 0
    loop.close()
    with pytest.raises(BatcherClosed):
        loop.submit([1])


# --------------------------------------------------------------------------- the whole stack against transformers


def _hf_pair(dtype: Any) -> tuple[Any, Any]:
    transformers = pytest.importorskip("transformers")
    from batchkit.models import LlamaModel

    cfg = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=96,
        max_position_embeddings=256,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval().to(dtype)
    return hf, LlamaModel.from_hf(hf)


def _hf_greedy(hf: Any, prompt: Sequence[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(torch.tensor([list(prompt)]), max_new_tokens=n, do_sample=False)
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.mark.parametrize(("mode", "prefix"), [("recompute", False), ("recompute", True), ("swap", False)])
def test_greedy_tokens_equal_transformers_under_preemption(mode: str, prefix: bool) -> None:
    """32 requests of mixed lengths, arriving at random steps into a KV pool too small for them
    all (preemption forced): every request's greedy tokens equal transformers' generate(),
    run one request at a time. Float64 keeps near-ties out of the argmax."""
    hf, model = _hf_pair(torch.float64)
    rng = random.Random(42)
    shared = [rng.randrange(96) for _ in range(8)]  # some prompts share a prefix
    prompts = [
        (shared if i % 3 == 0 else []) + [rng.randrange(96) for _ in range(rng.randint(1, 24))] for i in range(32)
    ]
    lengths = [rng.randint(1, 40) for _ in prompts]
    kv = model.make_cache(num_blocks=40, block_size=4)
    loop = ContinuousDecodeLoop(
        model,
        kv,
        max_num_seqs=12,
        max_num_batched_tokens=48,
        watermark=0.0,
        preemption_mode=mode,  # type: ignore[arg-type]
        num_cpu_blocks=64 if mode == "swap" else 0,
        enable_prefix_caching=prefix,
    )
    arrivals: dict[int, list[Request]] = {}
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        arrivals.setdefault(rng.randint(0, 60), []).append(Request(i, p, SamplingParams(max_new_tokens=n)))
    out = drive(loop, arrivals)
    assert loop.scheduler.statistics().preemptions > 0, "the pool was meant to force preemption"
    for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)):
        assert out[i] == _hf_greedy(hf, p, n), f"request {i} diverged"
    assert loop.allocator.statistics().used_blocks == 0


def test_threaded_loop_matches_transformers() -> None:
    """The same equality through the threaded runtime, with requests submitted from threads."""
    hf, model = _hf_pair(torch.float64)
    rng = random.Random(7)
    prompts = [[rng.randrange(96) for _ in range(rng.randint(1, 16))] for _ in range(12)]
    lengths = [rng.randint(1, 24) for _ in prompts]
    with ContinuousDecodeLoop(model, model.make_cache(num_blocks=48, block_size=4), max_num_seqs=6) as loop:
        futs = [loop.submit(p, max_new_tokens=n) for p, n in zip(prompts, lengths, strict=True)]
        for f, p, n in zip(futs, prompts, lengths, strict=True):
            assert f.result(WAIT) == _hf_greedy(hf, p, n)


def test_llama_refuses_a_mismatched_state_dict() -> None:
    """Loading weights of the wrong shape is a clear ValueError."""
    from batchkit.models import LlamaConfig, LlamaModel

    model = LlamaModel(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    sd = model.state_dict()
    sd["model.embed_tokens.weight"] = torch.zeros(5, 5)
    with pytest.raises(ValueError, match="does not fit"):
        model.load_hf_state_dict(sd)
    del sd["lm_head.weight"]
    sd["model.embed_tokens.weight"] = torch.zeros(32, 16)
    with pytest.raises(ValueError, match="missing"):
        model.load_hf_state_dict(sd)


def test_allocator_and_scheduler_validate_configuration() -> None:
    """Bad limits and a swap mode without a CPU pool are refused."""
    a = PagedKVAllocator(8, 4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(a, max_num_seqs=0)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        Scheduler(a, preemption_mode="swap")


# --------------------------------------------------------------------------- scheduler invariants (property test)

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 40), st.integers(0, 2)),
        st.tuples(st.just("abort"), st.integers(0, 40), st.just(0), st.just(0)),
        st.tuples(st.just("step"), st.integers(1, 4), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops=_ops, mode=st.sampled_from(["recompute", "swap"]), prefix=st.booleans())
def test_scheduler_invariants_under_random_traffic(ops: list[Any], mode: str, prefix: bool) -> None:
    """Random adds, aborts and steps: every step respects the token budget and max_num_seqs,
    every request ends exactly once with exactly its own tokens, and no block leaks."""
    budget, max_seqs = 24, 5
    loop = make_loop(
        num_blocks=24,
        block_size=4,
        watermark=0.0,
        preemption_mode=mode,
        num_cpu_blocks=32,
        enable_prefix_caching=prefix,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
    )
    sched = loop.scheduler
    expected: dict[int, list[int]] = {}
    got: dict[Hashable, list[int]] = {}
    ended: set[Hashable] = set()
    next_id = 0

    def run_steps(n: int) -> None:
        for _ in range(n):
            step, events = loop.step_once()
            assert step.num_tokens <= budget
            assert len(sched.running) <= max_seqs
            for ev in events:
                assert ev.request_id not in ended, "an event after the end"
                if ev.token is not None:
                    got.setdefault(ev.request_id, []).append(ev.token)
                if ev.finished:
                    ended.add(ev.request_id)
                    reasons[ev.request_id] = ev.finish_reason

    reasons: dict[Hashable, str | None] = {}
    for kind, a, b, prio in ops:
        if kind == "add":
            prompt = [(next_id + k) % VOCAB for k in range(a)]
            try:
                sched.add(Request(next_id, prompt, SamplingParams(max_new_tokens=b), priority=prio))
            except KVCacheExhausted:
                ended.add(next_id)
            else:
                expected[next_id] = [(prompt[-1] + k) % VOCAB for k in range(1, b + 1)]
            next_id += 1
        elif kind == "abort":
            if sched.abort(a):
                ended.add(a)
        else:
            run_steps(a)
    guard = 0
    while sched.has_work():
        run_steps(1)
        guard += 1
        assert guard < 5000, "the scheduler stopped making progress"
    for rid, want in expected.items():
        assert rid in ended
        out = got.get(rid, [])
        assert out == want[: len(out)], f"request {rid} got tokens that are not its own"
        if reasons.get(rid) == "length":
            assert out == want, f"request {rid} finished without all its tokens"
    s = loop.allocator.statistics()
    assert (s.used_blocks, s.num_seqs, s.cpu_free_blocks) == (0, 0, 32)


# --------------------------------------------------------------------------- defects found from outside (issue 9)


def _drive_collect(loop: ContinuousDecodeLoop, max_steps: int = 2_000) -> tuple[dict[Any, list[int]], dict[Any, Any]]:
    """Step the loop until it is idle; return tokens and errors per request."""
    out: dict[Any, list[int]] = {}
    errors: dict[Any, Any] = {}
    for _ in range(max_steps):
        if not loop.scheduler.has_work():
            return out, errors
        _, events = loop.step_once()
        for ev in events:
            if ev.error is not None:
                errors[ev.request_id] = ev.error
            if ev.token is not None:
                out.setdefault(ev.request_id, []).append(ev.token)
    raise AssertionError("the loop did not finish")


def test_prefix_cache_never_serves_blocks_of_an_aborted_prefill() -> None:
    """A 64-token prompt prefilled in 16-token chunks is aborted after its first chunk: a later
    request sharing the prompt (and the same prompt again) reuse only the block whose K/V was
    written, and their greedy tokens equal transformers'. Fails on the allocator that indexed
    every full prompt block at admission."""
    hf, model = _hf_pair(torch.float64)
    rng = random.Random(3)
    prompt = [rng.randrange(96) for _ in range(64)]
    longer = [*prompt, *(rng.randrange(96) for _ in range(5))]
    loop = ContinuousDecodeLoop(
        model,
        model.make_cache(num_blocks=32, block_size=16),
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        watermark=0.0,
    )
    loop.scheduler.add(Request("a", prompt, SamplingParams(max_new_tokens=6)))
    step, _ = loop.step_once()
    assert step.num_new_tokens == (16,)
    assert loop.scheduler.abort("a")  # what leaving generate() early does at the next step boundary
    loop.scheduler.add(Request("b", longer, SamplingParams(max_new_tokens=6)))
    loop.scheduler.add(Request("a-again", prompt, SamplingParams(max_new_tokens=6)))
    out, errors = _drive_collect(loop)
    assert not errors
    assert out["b"] == _hf_greedy(hf, longer, 6)
    assert out["a-again"] == _hf_greedy(hf, prompt, 6)
    assert loop.allocator.statistics().used_blocks == 0


def test_prefix_cache_never_serves_blocks_of_a_preempted_prefill() -> None:
    """A low-priority request preempted (by recompute) after its first prefill chunk by a
    higher-priority one sharing its prompt: both produce transformers' greedy tokens. Fails on
    the allocator that indexed every full prompt block at admission."""
    hf, model = _hf_pair(torch.float64)
    rng = random.Random(4)
    prompt = [rng.randrange(96) for _ in range(64)]
    longer = [*prompt, *(rng.randrange(96) for _ in range(8))]
    loop = ContinuousDecodeLoop(
        model,
        model.make_cache(num_blocks=9, block_size=16),  # 8 blocks: not enough for both
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        watermark=0.0,
    )
    loop.scheduler.add(Request("low", prompt, SamplingParams(max_new_tokens=6), priority=1))
    loop.step_once()
    loop.scheduler.add(Request("high", longer, SamplingParams(max_new_tokens=6), priority=0))
    out, errors = _drive_collect(loop)
    assert not errors
    assert loop.scheduler.statistics().preemptions >= 1, "the pool was meant to force a preemption"
    assert out["high"] == _hf_greedy(hf, longer, 6)
    assert out["low"] == _hf_greedy(hf, prompt, 6)


def test_stop_strings_without_detokenize_are_refused_at_submit() -> None:
    """A request with stop strings and no detokenize hook is refused with a ValueError naming the
    fix, instead of silently running to max_new_tokens (the previous behaviour)."""
    loop = make_loop()
    with pytest.raises(ValueError, match="detokenize="):
        loop.submit([1], max_new_tokens=10, stop=("x",))
    with pytest.raises(ValueError, match="detokenize="):
        list(loop.generate_sync([1], max_new_tokens=10, stop="x"))
    with pytest.raises(ValueError, match="detokenize="):
        loop.scheduler.add(Request("r", [1], SamplingParams(max_new_tokens=10, stop=("x",))))
    assert loop.submit([1], max_new_tokens=2, stop_token_ids=(9,)).result(WAIT) == [2, 3]
    loop.close()


def test_a_request_that_outgrows_the_cache_gets_kv_cache_exhausted_and_the_loop_serves_on() -> None:
    """A request that outgrows the whole KV pool while generating, with nothing left to preempt,
    ends with KVCacheExhausted on its stream; its blocks are freed and other requests are served."""
    with make_loop(num_blocks=5, block_size=4, watermark=0.0) as loop:  # 16 token slots
        with pytest.raises(KVCacheExhausted, match="outgrew"):
            list(loop.generate_sync([1], max_new_tokens=100))
        fut = loop.submit([1], max_new_tokens=100)
        with pytest.raises(KVCacheExhausted, match="max_new_tokens"):
            fut.result(WAIT)
        assert loop.submit([1], max_new_tokens=3).result(WAIT) == [2, 3, 4]
        assert loop.allocator.statistics().used_blocks == 0


def test_a_request_that_can_never_be_readmitted_is_ended_not_parked() -> None:
    """A worse-priority request that must give way while holding more tokens than admission
    allows (the cache less its watermark) ends with KVCacheExhausted instead of waiting for ever
    at the head of the queue; the better one and later ones are served. The previous scheduler
    parked it and never finished."""
    loop = make_loop(num_blocks=11, block_size=4, watermark=0.1)  # 10 blocks, 9 admissible
    loop.scheduler.add(Request("worse", [1], SamplingParams(max_new_tokens=200), priority=1))
    for _ in range(30):
        loop.step_once()
    loop.scheduler.add(Request("better", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=8), priority=0))
    out, errors = _drive_collect(loop)
    assert isinstance(errors.get("worse"), KVCacheExhausted)
    assert len(out["better"]) == 8
    loop.scheduler.add(Request("later", [1], SamplingParams(max_new_tokens=2)))
    out, errors = _drive_collect(loop)
    assert out["later"] == [2, 3]
    assert not errors
    assert loop.allocator.statistics().used_blocks == 0


def busy_loop(max_waiting: int) -> tuple[ContinuousDecodeLoop, concurrent.futures.Future[list[int]], threading.Event]:
    """A one-seat loop whose engine is held inside the step of a first request (``[1]``, 2
    tokens) until the returned event is set: what is submitted meanwhile waits."""
    entered, release = threading.Event(), threading.Event()
    echo = EchoStep()

    def blocking_step(batch: StepBatch, kv: Any) -> Any:
        entered.set()
        assert release.wait(WAIT)
        return echo(batch, kv)

    loop = make_loop(blocking_step, max_num_seqs=1, max_waiting=max_waiting)
    first = loop.submit([1], max_new_tokens=2)
    assert entered.wait(WAIT)
    return loop, first, release


def test_max_waiting_refuses_requests_beyond_it_with_queue_full() -> None:
    """With max_waiting=2, two requests may wait while the engine is busy; a third is refused at
    once with QueueFull, and the accepted ones all complete."""
    from batchkit import QueueFull

    loop, first, release = busy_loop(max_waiting=2)
    with loop:
        queued = [loop.submit([1], max_new_tokens=2) for _ in range(2)]
        with pytest.raises(
            QueueFull,
            match=r"^2 requests are already waiting, 2 of them beyond the 0 free decode seats \(max_waiting=2",
        ):
            loop.submit([1], max_new_tokens=2)
        release.set()
        assert [f.result(WAIT) for f in [first, *queued]] == [[2, 3]] * 3
    with pytest.raises(ValueError, match="max_waiting"):
        make_loop(max_waiting=0)


def test_max_waiting_counts_the_requests_beyond_the_free_seats() -> None:
    """A burst at an idle loop: its 3 free seats take 3 of the waiting requests at the next step,
    so 3 + max_waiting (2) are let in and the 6th is refused, its message counting the waiting
    requests beyond the free seats; all that were let in complete."""
    from batchkit import QueueFull

    loop = make_loop(max_num_seqs=3, max_waiting=2, engine="caller")  # nothing runs until run_engine()
    assert loop.free_seats() == 3
    futures = [loop.submit([1], max_new_tokens=2) for _ in range(5)]
    refused = (
        "5 requests are already waiting, 2 of them beyond the 3 free decode seats (max_waiting=2 bounds those "
        "beyond the seats): no room for this request; retry later, raise max_waiting, or add capacity"
    )
    with pytest.raises(QueueFull, match=f"^{re.escape(refused)}$"):
        loop.submit([1], max_new_tokens=2)
    engine = threading.Thread(target=loop.run_engine)
    engine.start()
    try:
        assert [f.result(WAIT) for f in futures] == [[2, 3]] * 5
    finally:
        loop.close(WAIT)
        engine.join(WAIT)


def test_tenant_quotas_hold_a_tenant_to_its_share_of_the_cache() -> None:
    """ContinuousDecodeLoop(tenant_quotas=...): a tenant at its quota waits while another tenant
    is served; a request that can never fit its tenant's quota is refused with KVCacheExhausted."""
    with make_loop(num_blocks=33, block_size=4, watermark=0.0, tenant_quotas={"bulk": 2}) as loop:
        with pytest.raises(KVCacheExhausted, match="quota"):
            loop.submit(list(range(1, 12)), tenant="bulk").result(WAIT)
        small = [loop.submit([1], max_new_tokens=3, tenant="bulk") for _ in range(3)]
        other = loop.submit(list(range(1, 20)), max_new_tokens=3, tenant="chat")
        assert other.result(WAIT) == [20, 21, 22]
        assert [f.result(WAIT) for f in small] == [[2, 3, 4]] * 3
        assert loop.allocator.statistics().tenant_usage == {}


def test_the_callers_thread_can_run_the_engine() -> None:
    """engine='caller': no thread is started; requests wait until run_engine() runs the engine in
    the calling thread, which returns once close() is called from another thread."""
    loop = make_loop(engine="caller")
    before = set(threading.enumerate())
    fut = loop.submit([1], max_new_tokens=3)
    assert set(threading.enumerate()) <= before  # no engine thread was started

    def wait_then_close() -> None:
        fut.result(WAIT)
        loop.close(timeout=WAIT)

    worker = threading.Thread(target=wait_then_close)
    worker.start()
    loop.run_engine()  # returns when the worker closes the loop
    worker.join(WAIT)
    assert fut.result(0) == [2, 3, 4]
    with pytest.raises(RuntimeError, match="engine='caller'"):
        make_loop().run_engine()
    with pytest.raises(ValueError, match="engine must be"):
        make_loop(engine="process")


def test_the_loop_is_a_tunable_target() -> None:
    """ContinuousDecodeLoop implements batchkit.control.TunableTarget: queue depth counts the
    requests not yet running, TPOT samples come back once each, and the batch limit is
    max_num_seqs (refused below 1)."""
    from batchkit.control import TunableTarget

    loop = make_loop(max_num_seqs=1)
    assert isinstance(loop, TunableTarget)
    for i in range(3):
        loop.scheduler.add(Request(i, [1], SamplingParams(max_new_tokens=3)))
    assert loop.queue_depth() == 3
    loop.step_once()
    assert loop.queue_depth() == 2
    loop.step_once()
    loop.step_once()
    samples, seen = loop.latency_samples()
    assert len(samples) == 2  # request 0: two gaps between its three tokens
    assert seen == 2
    assert loop.latency_samples(seen) == ([], 2)
    loop.set_batch_limit(4)
    assert loop.scheduler.max_num_seqs == 4
    with pytest.raises(ValueError, match="max_num_seqs"):
        loop.set_batch_limit(0)


def test_a_request_past_its_deadline_is_dropped_wherever_it_is() -> None:
    """A waiting request and a running one each past its deadline end with DeadlineExceeded at
    the next step boundary (the running one after the tokens it already produced); their blocks
    are freed and a request without a deadline is untouched."""
    from batchkit import DeadlineExceeded
    from batchkit.testing import MockClock

    clock = MockClock()
    loop = make_loop(max_num_seqs=2, clock=clock)
    s = loop.scheduler
    s.add(Request("no-deadline", [1], SamplingParams(max_new_tokens=6)))
    s.add(Request("running", [1], SamplingParams(max_new_tokens=50), deadline=2.0))
    s.add(Request("waiting", [1], SamplingParams(max_new_tokens=2), deadline=1.0))  # max_num_seqs=2: waits
    _, events = loop.step_once()
    assert {e.request_id for e in events} == {"no-deadline", "running"}
    clock.advance(1.5)  # past "waiting"'s deadline only
    _, events = loop.step_once()
    errors = {e.request_id: e.error for e in events if e.error is not None}
    assert list(errors) == ["waiting"]
    assert isinstance(errors["waiting"], DeadlineExceeded)
    clock.advance(1.0)  # past "running"'s
    out, errors = _drive_collect(loop)
    assert list(errors) == ["running"]
    assert isinstance(errors["running"], DeadlineExceeded)
    assert len(out["no-deadline"]) == 4  # 2 tokens before, 4 after: 6 in all
    assert s.statistics().expired == 2
    assert loop.allocator.statistics().used_blocks == 0


def test_deadline_s_reaches_the_caller_as_deadline_exceeded() -> None:
    """submit/generate_sync(deadline_s=...): a request still waiting when its deadline passes
    raises DeadlineExceeded from its future or stream; deadline_s must be a positive finite number."""
    from batchkit import DeadlineExceeded
    from batchkit.testing import MockClock

    clock = MockClock()
    entered = threading.Event()
    release = threading.Event()
    echo = EchoStep()

    def blocking_step(batch: StepBatch, kv: Any) -> Any:
        entered.set()
        assert release.wait(WAIT)
        return echo(batch, kv)

    with make_loop(blocking_step, max_num_seqs=1, clock=clock) as loop:
        first = loop.submit([1], max_new_tokens=1)
        assert entered.wait(WAIT)  # the engine is busy with the first request
        late = loop.submit([1], max_new_tokens=1, deadline_s=0.5)
        clock.advance(1.0)
        release.set()
        assert first.result(WAIT) == [2]
        with pytest.raises(DeadlineExceeded, match="deadline"):
            late.result(WAIT)
        for bad in (0, -1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match="deadline_s"):
                loop.submit([1], deadline_s=bad)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_run_with_runs_the_app_beside_an_engine_in_this_thread(backend: str) -> None:
    """run_with(main): main runs on an event loop in a second thread while this thread steps the
    model; its result comes back, its exception is raised here, and the loop is closed after."""
    loop = make_loop(engine="caller")

    async def main() -> list[int]:
        return [t async for t in loop.generate([1], max_new_tokens=3)]

    assert loop.run_with(main, backend=backend) == [2, 3, 4]
    with pytest.raises(BatcherClosed):
        loop.submit([1])

    failing = make_loop(engine="caller")

    async def boom() -> None:
        await failing.agenerate_all([1], max_new_tokens=1)
        raise LookupError("the app failed")

    with pytest.raises(LookupError, match="the app failed"):
        failing.run_with(boom)
    with pytest.raises(RuntimeError, match="engine='caller'"):
        make_loop().run_with(main)


# ------------------------------------------------------------------- slot mappings from the allocator (issue 11)


def test_a_prefill_that_stops_one_token_short_is_not_reserved_twice() -> None:
    """A prompt whose last chunk is its last token alone: the step that computes that token
    reserves no second slot for it, so the allocator holds exactly the tokens computed, the step
    writes each token at its own position, and the prefix cache indexes the sequence's real
    tokens. Fails on the previous main: the vectorised decode path reserved a slot for that
    token again and recorded it twice, so later blocks were indexed one token off."""
    a = PagedKVAllocator(64, block_size=2, enable_prefix_caching=True)
    sched = Scheduler(a, max_num_batched_tokens=4)
    sched.add(Request("r", [10, 11, 12, 13, 14], SamplingParams(max_new_tokens=6)))
    req = sched.get("r")
    assert req is not None
    sampled = iter([20, 21, 22, 23, 24, 25])
    while sched.has_work():
        step = sched.schedule()
        assert step.slot_mapping is not None
        starts = {r.request_id: r.num_computed for r in step.requests}
        slots = a.slot_mapping("r", starts["r"], starts["r"] + step.num_new_tokens[0])
        assert step.slot_mapping.tolist() == slots.tolist(), "the step writes each token at its own position"
        sched.update(step, [next(sampled) for s in step.samples if s])
        if req.status is RequestStatus.RUNNING:  # the prompt is reserved whole, then one slot per token
            assert a.num_tokens("r") == max(req.num_computed, req.prompt_len)
    # Ten tokens were computed (the last sampled one never is): five full blocks, real content.
    assert a.allocate("same", [10, 11, 12, 13, 14, 20, 21, 22, 23, 24, 99]) == 10
    assert a.allocate("shifted", [10, 11, 12, 13, 14, 14, 20, 21, 22, 23, 99]) == 4


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stop_strings_read_a_short_window_of_the_output_and_match_where_the_whole_text_does(seed: int) -> None:
    """The scheduler's stop check decodes a few of the latest tokens per step, not the whole
    output (O(n^2) per request): a stop string is still found at the first token whose whole
    decoded output holds it, also when that token splits a multi-byte character."""
    pieces = {0: b"a", 1: b" ", 2: b"\xc3", 3: b"\xa9", 4: b"z", 5: b"\xc3\xa9", 6: b""}
    windows: list[int] = []

    def detokenize(ids: Sequence[int]) -> str:
        windows.append(len(ids))
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    rng = random.Random(seed)
    script = [rng.choice([0, 1, 4, 5, 6]) for _ in range(400)] + [4, 2, 3, 4]  # ends "zéz"
    stop = ("z\u00e9z",)
    whole = [detokenize(script[: n + 1]) for n in range(len(script))]
    want = next(n + 1 for n, text in enumerate(whole) if stop[0] in text)
    windows.clear()
    sched = Scheduler(PagedKVAllocator(num_blocks=256, block_size=4), detokenize=detokenize)
    sched.add(Request("r", [1], SamplingParams(max_new_tokens=len(script), stop=stop)))
    events: list[Any] = []
    while sched.has_work():
        step = sched.schedule()
        req = step.requests[0]
        events += sched.update(step, [script[len(req.output)]])
    assert [e.token for e in events if e.token is not None] == script[:want]
    assert events[-1].finish_reason == "stop"
    assert max(windows) < 20


def _zeros(batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
    return torch.zeros(len(batch.sample_indices), 8)


def _cache() -> batchkit.PagedKVCache:
    return batchkit.PagedKVCache(num_layers=1, num_blocks=16, block_size=4, num_kv_heads=1, head_dim=4)


class Fatal(BaseException):
    """Not an Exception: a step's failure that the loop does not catch."""


class TestTheEngineNeverLeavesCallersWaiting:
    """The engine never leaves callers waiting: a cancel racing a result, or a fault of the loop itself.

    A ``submit()`` future cancelled by its caller between the engine's check and its ``set_result``
    must not kill the engine thread; and if the engine does end on an error of its own, every request
    it held ends with ``BatcherClosed`` and new ones are refused.
    """

    def test_a_future_cancelled_while_its_result_is_set_does_not_stop_the_engine(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        set_result = concurrent.futures.Future.set_result

        def cancelled_first(fut: concurrent.futures.Future[Any], result: Any) -> None:
            fut.cancel()  # the caller's cancel lands just after the engine checked done()
            set_result(fut, result)

        with batchkit.ContinuousDecodeLoop(_zeros, _cache()) as loop:
            monkeypatch.setattr(concurrent.futures.Future, "set_result", cancelled_first)
            first = loop.submit([1, 2], max_new_tokens=1)
            with pytest.raises(concurrent.futures.CancelledError):
                first.result(timeout=30)
            monkeypatch.undo()
            assert loop.submit([1, 2], max_new_tokens=1).result(timeout=30) == [0]

    def test_an_engine_that_fails_ends_every_request_and_refuses_new_ones(self) -> None:
        started = threading.Event()

        def step(batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
            started.set()
            raise Fatal("the engine cannot go on")

        loop = batchkit.ContinuousDecodeLoop(step, _cache(), engine="caller", max_num_seqs=1)
        running = loop.submit([1, 2], max_new_tokens=4)
        waiting = loop.submit([3, 4], max_new_tokens=4)  # max_num_seqs=1: still waiting when it fails
        with pytest.raises(Fatal):
            loop.run_engine()
        assert started.is_set()
        for fut in (running, waiting):
            with pytest.raises(BatcherClosed, match="engine failed") as info:
                fut.result(timeout=30)
            assert isinstance(info.value.__cause__, Fatal)
        with pytest.raises(BatcherClosed):
            loop.submit([1], max_new_tokens=1)
        loop.close()
        # As close() ends what is left: nothing counted running or waiting, the blocks all free.
        stats = loop.statistics().scheduler
        assert (stats.running, stats.waiting, stats.aborted) == (0, 0, 2)
        assert loop.scheduler.allocator.num_free_blocks == loop.scheduler.allocator.num_blocks - 1

    def test_requests_still_in_the_inbox_when_the_engine_fails_are_counted_aborted(self) -> None:
        loop = batchkit.ContinuousDecodeLoop(_zeros, _cache(), engine="caller")
        queued = loop.submit([1, 2], max_new_tokens=4)

        def fail(*_: Any) -> Any:
            raise Fatal("before any step")

        loop.core.admit = fail  # type: ignore[method-assign,assignment]  # the fault hits as the inbox is read
        with pytest.raises(Fatal):
            loop.run_engine()
        with pytest.raises(BatcherClosed, match="engine failed"):
            queued.result(timeout=30)
        assert loop.statistics().scheduler.aborted == 1


class TestStepOnceFromASecondThreadIsRefused:
    """step_once() from a second thread while the engine thread steps the loop is refused, not a race
    that corrupts the scheduler (positions outside a sequence, lost requests)."""

    def test_step_once_beside_a_running_engine_thread_is_a_runtime_error(self) -> None:
        torch.manual_seed(0)
        model = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1))
        release = threading.Event()
        stepping = threading.Event()
        forward = model.forward

        def held_step(*args: Any) -> Any:
            stepping.set()
            assert release.wait(timeout=30)
            return forward(*args)

        model.forward = held_step  # type: ignore[method-assign, assignment]
        with batchkit.ContinuousDecodeLoop(model, model.make_cache(num_blocks=32, block_size=4)) as loop:
            fut = loop.submit([1, 2, 3], max_new_tokens=2)  # starts the engine thread
            assert stepping.wait(timeout=30)
            with pytest.raises(RuntimeError, match="engine runs in thread"):
                loop.step_once()
            release.set()
            assert len(fut.result(timeout=60)) == 2

    def test_step_once_still_drives_a_loop_whose_threaded_api_is_unused(self) -> None:
        torch.manual_seed(0)
        model = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1))
        with batchkit.ContinuousDecodeLoop(model, model.make_cache(num_blocks=32, block_size=4)) as loop:
            loop.scheduler.add(batchkit.continuous.Request("r", [1, 2, 3], batchkit.SamplingParams(max_new_tokens=2)))
            tokens = []
            while loop.scheduler.has_work():
                tokens += [ev.token for ev in loop.step_once()[1] if ev.token is not None]
            assert len(tokens) == 2


def _zeros_16(batch: batchkit.StepBatch, kv: batchkit.PagedKVCache) -> Any:
    return torch.zeros(len(batch.sample_indices), 16)


@pytest.fixture
def loop() -> Iterator[batchkit.ContinuousDecodeLoop]:
    kv = batchkit.PagedKVCache(num_layers=1, num_blocks=9, block_size=4, num_kv_heads=1, head_dim=4)
    # engine="caller" and no engine: nothing is stepped, so each check is about the call itself.
    lp = batchkit.ContinuousDecodeLoop(_zeros_16, kv, engine="caller", tenant_quotas={"small": 2})
    yield lp
    lp.close()


def _params(n: int = 50) -> SamplingParams:
    return SamplingParams(max_new_tokens=n)


def _step(s: Scheduler) -> None:
    step = s.schedule()
    s.update(step, [1] * sum(step.samples))


class TestWhatSubmitRefusesAndHowPrioritiesTakeASeat:
    """What a request is refused for at submit, and how priorities take a seat or KV room.

    A value that could only fail inside a step (the sampler, the stop check) would fail every request
    batched into that step, so each one is refused on the call; and a better-priority request takes
    the place of a worse running one, as docs/continuous.md says, but only when that lets it in.
    """

    @pytest.mark.parametrize(
        ("sampling", "error"),
        [
            ({"temperature": math.nan}, ValueError),
            ({"temperature": math.inf}, ValueError),
            ({"temperature": "0.7"}, ValueError),
            ({"top_k": 2.5}, ValueError),
            ({"top_k": True}, ValueError),
            ({"top_p": math.nan}, ValueError),
            ({"seed": "x"}, TypeError),
            ({"seed": 1.5}, TypeError),
            ({"stop_token_ids": 5}, TypeError),
            ({"stop_token_ids": [1.0]}, TypeError),
            ({"eos_token_id": "2"}, TypeError),
        ],
    )
    def test_a_sampling_value_no_step_could_use_is_refused_at_submit(
        self, loop: batchkit.ContinuousDecodeLoop, sampling: dict[str, Any], error: type[Exception]
    ) -> None:
        name = next(iter(sampling))
        with pytest.raises(error, match=name):
            loop.submit([1, 2], max_new_tokens=2, **sampling)
        assert loop.queue_depth() == 0

    @pytest.mark.parametrize("stop", [[""], [1], ["ok", None]])
    def test_stop_must_be_non_empty_strings(self, stop: list[Any]) -> None:
        with pytest.raises(ValueError, match="stop must be non-empty strings"):
            SamplingParams(stop=tuple(stop))

    def test_numpy_numbers_are_accepted_as_plain_ones(self) -> None:
        np = pytest.importorskip("numpy")
        p = SamplingParams(
            max_new_tokens=np.int64(5),
            temperature=np.float32(0.5),
            top_k=np.int64(3),
            seed=np.int32(4),
            stop_token_ids=np.array([7]),
        )
        assert (p.max_new_tokens, p.top_k, p.seed, p.stop_token_ids) == (5, 3, 4, (7,))
        assert type(p.max_new_tokens) is int
        assert type(p.top_k) is int
        assert type(p.seed) is int
        with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
            SamplingParams(max_new_tokens=np.float64(5))

    def test_a_prompt_that_can_never_fit_is_refused_by_the_submit_call(
        self, loop: batchkit.ContinuousDecodeLoop
    ) -> None:
        # 8 usable blocks of 4 tokens: a 32-token prompt plus its first token needs 9.
        with pytest.raises(
            KVCacheExhausted, match="32-token prompt, with its first generated token, needs 9 KV blocks"
        ):
            loop.submit(list(range(32)), max_new_tokens=1)
        with pytest.raises(KVCacheExhausted, match="quota"):
            loop.submit(list(range(8)), max_new_tokens=1, tenant="small")
        loop.submit(list(range(31)), max_new_tokens=1)  # fits: accepted
        assert loop.queue_depth() == 1

    def test_a_prompt_that_exactly_fills_the_cache_is_refused_for_its_first_generated_token(self) -> None:
        """Admission counts the first generated token too, whatever max_new_tokens: with 7 usable
        blocks of 4, a 28-token prompt is refused and says so; a 27-token one is served."""
        with make_loop(num_blocks=8, block_size=4) as loop:  # block 0 is reserved: 7 usable, 28 tokens
            with pytest.raises(
                KVCacheExhausted,
                match=r"a 28-token prompt, with its first generated token, needs 8 KV blocks but admission has 7",
            ):
                loop.submit(list(range(28)), max_new_tokens=1)
            assert loop.submit(list(range(27)), max_new_tokens=1).result(WAIT) == [27]

    def test_generate_refuses_it_on_its_first_iteration(self, loop: batchkit.ContinuousDecodeLoop) -> None:
        stream = loop.generate_sync(list(range(32)), max_new_tokens=1)
        with pytest.raises(KVCacheExhausted):
            next(stream)

    def test_a_better_priority_request_takes_the_seat_of_a_worse_running_one(self) -> None:
        s = Scheduler(PagedKVAllocator(num_blocks=64, block_size=4), max_num_seqs=1)
        s.add(Request("low", [1, 2, 3], _params(), priority=5))
        _step(s)
        s.add(Request("high", [1, 2, 3], _params(3), priority=0))
        _step(s)
        assert [r.request_id for r in s.running] == ["high"]
        assert [r.request_id for r in s.waiting] == ["low"]
        assert s.statistics().preemptions == 1
        # An equal priority never preempts: it waits its turn.
        s.add(Request("same", [1, 2, 3], _params(3), priority=0))
        _step(s)
        assert [r.request_id for r in s.running] == ["high"]

    def test_no_one_is_preempted_for_a_request_held_back_by_its_own_tenant_quota(self) -> None:
        a = PagedKVAllocator(num_blocks=17, block_size=4, tenant_quotas={"A": 4})
        s = Scheduler(a, max_num_seqs=8)
        s.add(Request("a1", list(range(15)), _params(), priority=0, tenant="A"))  # 4 blocks: A's whole quota
        s.add(Request("b1", list(range(12)), _params(), priority=5, tenant="B"))
        s.add(Request("b2", list(range(12)), _params(), priority=5, tenant="B"))
        _step(s)
        s.add(Request("a2", [1, 2, 3], _params(5), priority=0, tenant="A"))
        _step(s)
        assert {r.request_id for r in s.running} == {"a1", "b1", "b2"}
        assert [r.request_id for r in s.waiting] == ["a2"]
        assert s.statistics().preemptions == 0

    @pytest.mark.parametrize(
        "limits",
        [
            {"max_num_seqs": 2.5},
            {"max_num_seqs": True},
            {"max_num_seqs": 0},
            {"max_num_batched_tokens": 64.0},
            {"max_num_batched_tokens": -1},
        ],
    )
    def test_the_loop_limits_are_ints(self, limits: dict[str, Any]) -> None:
        name = next(iter(limits))
        with pytest.raises(ValueError, match=f"{name} must be an int >= 1"):
            Scheduler(PagedKVAllocator(num_blocks=8, block_size=4), **limits)


LONG_RUN = 12_000  # past the 10,000 samples the recent window keeps


class TestStatistics:
    """statistics() fields as docs/api.md defines them: the scheduler's whole-run latencies and the
    recent views of the scheduler and the loop."""

    def test_scheduler_latencies_cover_every_request(self) -> None:
        """``ttft``, ``tpot`` and ``queue_wait`` of ``SchedulerStatistics`` count every request of a
        run longer than the recent window."""
        sched = Scheduler(PagedKVAllocator(num_blocks=1024, block_size=4), max_num_seqs=512)
        for i in range(LONG_RUN):
            sched.add(Request(i, [1], SamplingParams(max_new_tokens=2)))
        while sched.has_work():
            step = sched.schedule()
            sched.update(step, [0] * sum(step.samples))
        s = sched.statistics()
        assert s.finished == LONG_RUN
        assert (s.ttft.count, s.tpot.count, s.queue_wait.count) == (LONG_RUN, LONG_RUN, LONG_RUN)

    def test_scheduler_and_loop_name_their_recent_views(self) -> None:
        """``SchedulerStatistics`` has ``ttft_recent``, ``tpot_recent`` and ``queue_wait_recent`` (the
        last 10,000 samples), ``LoopStatistics`` has ``step_time_recent``; both views agree on a short
        run."""
        torch = pytest.importorskip("torch")
        kv = batchkit.PagedKVCache(1, 16, 4, 1, 2, dtype=torch.float32)
        loop = batchkit.ContinuousDecodeLoop(lambda batch, kv: torch.zeros(len(batch.sample_indices), 8), kv)
        try:
            assert loop.submit([1, 2], max_new_tokens=3).result(timeout=WAIT) == [0, 0, 0]
        finally:
            loop.close()
        s = loop.statistics()
        sched = s.scheduler
        assert (sched.ttft_recent.count, sched.tpot_recent.count, sched.queue_wait_recent.count) == (1, 2, 1)
        assert (sched.ttft.count, sched.tpot.count, sched.queue_wait.count) == (1, 2, 1)
        assert s.step_time_recent.count == s.step_time.count == s.steps
        assert s.step_time_recent.max_ms == s.step_time.max_ms


# --------------------------------------------------------------------------- n samples of one prompt


class TableStep:
    """A fake model whose logits are a fixed random row per last input token: sampling under a
    seed is reproducible, and different seeds draw different tokens."""

    def __init__(self) -> None:
        self.table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 2

    def __call__(self, batch: StepBatch, kv: Any) -> Any:
        return self.table[batch.input_ids[batch.sample_indices]]


async def _all(streams: list[Any]) -> list[list[Any]]:
    """Every stream read to its end, all at once (as a server reads the choices of a request)."""
    out: list[list[Any]] = [[] for _ in streams]

    async def read(i: int) -> None:
        out[i] = [t async for t in streams[i]]

    with anyio.fail_after(WAIT):
        async with anyio.create_task_group() as tg:
            for i in range(len(streams)):
                tg.start_soon(read, i)
    return out


class TestGenerateN:
    @pytest.mark.anyio
    async def test_sample_i_is_the_request_seeded_seed_plus_i(self) -> None:
        prompt = [1, 2, 3]
        with make_loop(TableStep()) as loop:
            got = await _all(loop.generate_n(prompt, 3, max_new_tokens=6, temperature=1.0, seed=7))
            want = []
            for i in range(3):
                want.append([t async for t in loop.generate(prompt, max_new_tokens=6, temperature=1.0, seed=7 + i)])
        assert got == want
        assert len({tuple(x) for x in got}) > 1, "the seeds were meant to draw different samples"

    @pytest.mark.anyio
    async def test_a_seed_at_the_top_of_the_range_wraps_around(self) -> None:
        with make_loop(TableStep()) as loop:
            got = await _all(loop.generate_n([4], 2, max_new_tokens=4, temperature=1.0, seed=2**64 - 1))
            wrapped = [t async for t in loop.generate([4], max_new_tokens=4, temperature=1.0, seed=-(2**63))]
        assert got[1] == wrapped

    @pytest.mark.anyio
    async def test_the_samples_after_the_first_take_its_prompt_blocks_from_the_prefix_cache(self) -> None:
        """A prompt of 10 tokens in blocks of 4: the first sample computes it; the other two are
        admitted after it and each take its 2 full blocks (8 tokens) from the prefix cache."""
        prompt = list(range(1, 11))
        with make_loop(EchoStep(), enable_prefix_caching=True) as loop:
            got = await _all(loop.generate_n(prompt, 3, max_new_tokens=3))
            stats = loop.allocator.statistics()
        assert got == [[11, 12, 13]] * 3
        assert stats.prefix_hits == 2 * 8
        assert stats.used_blocks == 0

    @pytest.mark.anyio
    async def test_without_prefix_caching_the_samples_run_together(self) -> None:
        echo = EchoStep()
        with make_loop(echo, enable_prefix_caching=False) as loop:
            got = await _all(loop.generate_n([5, 6], 3, max_new_tokens=2, detailed=True))
        assert [[item.token for item in g] for g in got] == [[7, 8]] * 3
        assert all(math.isfinite(item.logprob) for g in got for item in g)
        assert max(b.num_seqs for b in echo.batches) == 3

    @pytest.mark.anyio
    async def test_a_refusal_refuses_every_sample_and_none_runs(self) -> None:
        """max_waiting=2 while the engine is busy: the three samples cannot all be queued, so each
        of the three iterators raises QueueFull and none of them is queued."""
        from batchkit import QueueFull

        loop, first, release = busy_loop(max_waiting=2)
        with loop:
            streams = loop.generate_n([9], 3, max_new_tokens=2)
            for stream in streams:
                with pytest.raises(QueueFull, match="max_waiting=2"):
                    await stream.__anext__()
            release.set()
            assert first.result(WAIT) == [2, 3]
            assert [f.result(WAIT) for f in [loop.submit([1], max_new_tokens=1)]] == [[2]]
        assert loop.scheduler.statistics().finished == 2, "only the two plain requests ran"

    @pytest.mark.anyio
    async def test_max_waiting_lets_in_all_n_samples_or_none(self) -> None:
        """With one request waiting and max_waiting=3, 3 samples are refused whole (none is
        queued, even for a moment: the queue still holds the one), and 2 are let in and run."""
        from batchkit import QueueFull

        loop, first, release = busy_loop(max_waiting=3)
        with loop:
            waiting = loop.submit([1], max_new_tokens=1)
            refused = loop.generate_n([9], 3, max_new_tokens=2)
            with pytest.raises(
                QueueFull,
                match=r"^1 request is already waiting, 1 of them beyond the 0 free decode seats \(max_waiting=3 .*"
                "no room for these 3 samples",
            ):
                await refused[0].__anext__()
            assert loop.queue_depth() == 1
            fits = loop.generate_n([9], 2, max_new_tokens=2)
            got: list[list[int]] = [[], []]

            async def read(i: int) -> None:
                got[i] = [t async for t in fits[i]]

            with anyio.fail_after(WAIT):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(read, 0)  # its first read queues both samples
                    while loop.queue_depth() < 3:
                        await anyio.sleep(0.001)
                    assert loop.queue_depth() == 3
                    release.set()
                    tg.start_soon(read, 1)
            assert got == [[10, 11], [10, 11]]
            assert first.result(WAIT) == [2, 3]
            assert waiting.result(WAIT) == [2]
        assert loop.scheduler.statistics().aborted == 0

    @pytest.mark.anyio
    async def test_leaving_one_sample_aborts_it_alone(self) -> None:
        with make_loop(EchoStep()) as loop:
            streams = loop.generate_n([1], 2, max_new_tokens=50)
            with anyio.fail_after(WAIT):
                assert await streams[0].__anext__() == 2
                await streams[0].aclose()
                rest = [t async for t in streams[1]]
            assert rest == [(1 + k) % VOCAB for k in range(1, 51)]
            while loop.scheduler.has_work():
                await anyio.sleep(0.001)
            stats = loop.scheduler.statistics()
        assert (stats.aborted, stats.finished) == (1, 1)

    def test_n_and_the_sampling_fields_are_checked_on_the_call(self) -> None:
        with make_loop() as loop:
            for bad in (0, True, 1.5):
                with pytest.raises(ValueError, match="n must be an int >= 1"):
                    loop.generate_n([1], bad)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="temperature"):
                loop.generate_n([1], 2, temperature=-1)


def test_a_request_following_another_waits_until_that_one_has_computed_its_prompt() -> None:
    """Scheduler: ``after`` holds a waiting request back while the request it follows computes
    the same prompt (chunked over two steps here); a request behind it is admitted meanwhile."""
    alloc = PagedKVAllocator(num_blocks=32, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(alloc, max_num_batched_tokens=6)
    lead = Request("lead", list(range(1, 11)), SamplingParams(max_new_tokens=2))
    follower = Request("follower", list(range(1, 11)), SamplingParams(max_new_tokens=2))
    follower.after = lead
    other = Request("other", [40], SamplingParams(max_new_tokens=2))
    for r in (lead, follower, other):
        sched.add(r, now=0.0)
    first = sched.schedule(now=0.0)
    assert [r.request_id for r in first.requests] == ["lead"]  # 6 of its 10 tokens: the budget
    sched.update(first, [], now=0.0)
    second = sched.schedule(now=1.0)
    assert [r.request_id for r in second.requests] == ["lead", "other"], "the follower waits"
    sched.update(second, [7, 8], now=1.0)
    third = sched.schedule(now=2.0)
    assert "follower" in [r.request_id for r in third.requests]
    assert follower.after is None
    assert alloc.statistics().prefix_hits == 8


# --------------------------------------------------------------------------- min_tokens

EOS = 40


class PreferEos(EchoStep):
    """EchoStep whose EOS is always the most likely token: (last + 1) only the second."""

    def __call__(self, batch: StepBatch, kv: Any) -> Any:
        rows = len(batch.sample_indices)
        eos = torch.nn.functional.one_hot(torch.full((rows,), EOS), VOCAB).to(torch.float32)
        return super().__call__(batch, kv) + 2 * eos


def _letters(ids: Sequence[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


def _tokens_and_reason(prompt: list[int], **params: Any) -> tuple[list[int], str | None]:
    """One request's greedy tokens and finish reason, the loop stepped in this thread."""
    loop = make_loop(PreferEos(), detokenize=_letters, eos_token_id=EOS)
    loop.scheduler.add(Request("r", prompt, SamplingParams(eos_token_id=EOS, **params)))
    tokens: list[int] = []
    for _ in range(100):
        _, events = loop.step_once()
        for ev in events:
            assert ev.error is None, ev.error
            assert ev.token is not None
            tokens.append(ev.token)
            if ev.finished:
                return tokens, ev.finish_reason
    raise AssertionError("the request did not finish")


class TestMinTokens:
    """vLLM's min_tokens: the stop tokens are masked and stop strings do not count until the
    output holds min_tokens tokens."""

    def test_eos_is_masked_until_min_tokens_then_ends_the_output(self) -> None:
        assert _tokens_and_reason([1], max_new_tokens=8) == ([EOS], "eos")
        assert _tokens_and_reason([1], max_new_tokens=8, min_tokens=3) == ([2, 3, 4, EOS], "eos")
        assert _tokens_and_reason([1], max_new_tokens=3, min_tokens=3) == ([2, 3, 4], "length")

    def test_stop_token_ids_are_masked_too_whatever_ignore_eos(self) -> None:
        got = _tokens_and_reason([1], max_new_tokens=8, min_tokens=2, stop_token_ids=[EOS], ignore_eos=True)
        assert got == ([2, 3, EOS], "stop")
        # ignore_eos alone: EOS stops nothing, so nothing is masked (EOS is drawn every time).
        assert _tokens_and_reason([1], max_new_tokens=3, min_tokens=2, ignore_eos=True) == ([EOS] * 3, "length")

    def test_a_stop_string_counts_once_it_ends_in_the_min_tokens_th_tokens_text(self) -> None:
        # EOS masked for 3 tokens: 2 3 4 ("cde"), then EOS.
        # "d" ends in the 2nd token's text, before the 3rd: it never counts.
        assert _tokens_and_reason([1], max_new_tokens=8, min_tokens=3, stop="d") == ([2, 3, 4, EOS], "eos")
        # "de" ends in the 3rd token's: it counts there.
        assert _tokens_and_reason([1], max_new_tokens=8, min_tokens=3, stop="de") == ([2, 3, 4], "stop")
        assert _tokens_and_reason([1], max_new_tokens=8, stop="d") == ([EOS], "eos")

    def test_min_tokens_is_checked_against_max_new_tokens(self) -> None:
        for bad in (-1, 9, 1.5):
            with pytest.raises(ValueError, match="min_tokens"):
                SamplingParams(max_new_tokens=8, min_tokens=bad)  # type: ignore[arg-type]
        assert SamplingParams(max_new_tokens=8, min_tokens=8).min_tokens == 8


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_set_batch_limit_holds_from_the_next_step_on_and_loses_nothing(mode: str) -> None:
    """set_batch_limit(size): at most size requests run from the next step on, also when more are
    running already (the worst are preempted, and finish later with the same tokens)."""
    from batchkit.continuous import Request

    kv = batchkit.PagedKVCache(1, 64, 4, 1, 4)
    loop = ContinuousDecodeLoop(
        EchoStep(),
        kv,
        max_num_seqs=8,
        engine="caller",
        preemption_mode=mode,  # type: ignore[arg-type]
        num_cpu_blocks=64 if mode == "swap" else 0,
    )
    for i in range(8):
        loop.scheduler.add(Request(i, [i + 1], batchkit.SamplingParams(max_new_tokens=6)))
    step, _ = loop.step_once()
    assert len(step.requests) == 8
    loop.set_batch_limit(2)
    outputs: dict[Any, list[int]] = {}
    for _ in range(200):
        step, events = loop.step_once()
        assert len(step.requests) <= 2
        for ev in events:
            if ev.finished:
                request = loop.scheduler.get(ev.request_id)
                assert request is None
        for req in step.requests:
            if req.status.name == "FINISHED":
                outputs[req.request_id] = list(req.output)
        if not loop.scheduler.has_work():
            break
    assert sorted(outputs) == list(range(8))
    for i in range(8):
        assert outputs[i] == [(i + 1 + k) % 50 for k in range(1, 7)]
    loop.close()


def test_a_finished_request_has_freed_its_blocks_when_its_result_arrives() -> None:
    """Requests end on max_new_tokens and free their blocks in the same step."""
    with batchkit.ContinuousDecodeLoop(GatedStep(), small_cache(), max_num_seqs=4) as loop:
        for n in range(1, 6):
            assert loop.submit([1, 2, 3], max_new_tokens=n).result(WAIT) == [0] * n
            s = loop.statistics().scheduler
            assert (s.kv_usage, s.running, s.finished) == (0.0, 0, n)


# --------------------------------------------------------------------------- docs/api.md: a loop's arguments and close


def test_close_aborts_the_running_requests_frees_their_blocks_and_counts_them() -> None:
    """close(): "abort what is left (its callers get BatcherClosed)": the requests it ends are
    aborted in the scheduler too, so statistics() shows none running, them aborted, and no KV
    block still held."""
    loop = batchkit.ContinuousDecodeLoop(zeros_step, one_layer_cache(), max_num_seqs=4)
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
        return zeros_step(batch, kv)

    loop = batchkit.ContinuousDecodeLoop(gated, one_layer_cache(), max_num_seqs=4)
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

    idle = batchkit.ContinuousDecodeLoop(zeros_step, one_layer_cache(), engine="caller")
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
    args: dict[str, Any] = {"kv_cache": one_layer_cache(), **kwargs}
    kv = args.pop("kv_cache")
    with pytest.raises(error, match=name):
        batchkit.ContinuousDecodeLoop(zeros_step, kv, **args)


def test_an_int_like_eos_token_id_of_the_loop_is_taken() -> None:
    """eos_token_id may be a numpy integer, like every other token id; it stops requests."""
    with batchkit.ContinuousDecodeLoop(zeros_step, one_layer_cache(), eos_token_id=cast(Any, np.int64(0))) as loop:
        assert loop.submit([1], max_new_tokens=5).result(WAIT) == [0]


def test_extra_eos_ids_is_a_settable_tuple_of_token_ids() -> None:
    """extra_eos_ids: "settable tuple of more end-of-sequence ids": any sequence of ids is kept
    as a tuple and stops later requests (not those with ignore_eos); one bare id or a string is a
    TypeError on setting, not a failure of every later submit."""
    with batchkit.ContinuousDecodeLoop(zeros_step, one_layer_cache()) as loop:
        loop.extra_eos_ids = cast(Any, [np.int64(0)])
        assert loop.extra_eos_ids == (0,)
        assert loop.submit([1], max_new_tokens=5).result(WAIT) == [0]
        assert loop.submit([1], max_new_tokens=3, ignore_eos=True).result(WAIT) == [0, 0, 0]
        for bad in (5, "2", ("2",), (True,)):
            with pytest.raises(TypeError, match="extra_eos_ids"):
                loop.extra_eos_ids = cast(Any, bad)
        assert loop.extra_eos_ids == (0,)


def test_run_with_on_a_loop_it_already_closed_is_batcher_closed_and_main_never_starts() -> None:
    """run_with() returns main's result "the loop closed": a second run_with() (or run_engine())
    on it raises BatcherClosed, not "the engine already runs", and does not start main."""
    loop = batchkit.ContinuousDecodeLoop(zeros_step, one_layer_cache(), engine="caller")
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

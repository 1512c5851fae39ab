"""StepRunner: one scheduled step on the model, from its block moves to its sampled tokens.

Everything torch that a step does lives here: the block moves, the :class:`StepBatch`, the call of
the user's step, the logits' repair (a row no token can be drawn from, a ``logit_bias`` past the
logits, a grammar that leaves nothing), penalties and biases, grammar masks, sampling and
logprobs. It answers a :class:`StepOutput`; it never changes the scheduler: which requests fail
is data for the engine, which tells the scheduler (``schedule()`` -> :meth:`StepRunner.run` ->
``update()``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from .._clock import Clock
from ..kv.allocator import PagedKVAllocator
from ..kv.cache import PagedKVCache
from .grammar import GrammarMatchers
from .logprobs import TokenLogprobs, logprobs_of
from .request import Request, ScheduledStep
from .sampling import SamplingParams, adjust_logits, sample
from .step import StepBatch, check_logits

__all__ = ["LogitsPlan", "StepFn", "StepOutput", "StepRunner", "logit_bias_past", "logits_plan"]

StepFn = Callable[[StepBatch, PagedKVCache], Any]
Tensor = Any

_UNADJUSTED = SamplingParams()  # what a row whose request fails samples with (its token is dropped)
_NO_TOKEN = "the step's logits for this request are NaN or all -inf"


def logit_bias_past(params: SamplingParams, vocab_size: int) -> ValueError | None:
    """The error for a ``logit_bias`` that names a token id past a vocabulary of ``vocab_size``
    (an index past the logits: the bias could not be added), or None."""
    bias = params.logit_bias_pairs
    if bias and bias[-1][0] >= vocab_size:  # sorted by id: the last is the largest
        return ValueError(f"logit_bias holds token id {bias[-1][0]}, past the vocabulary ({vocab_size} tokens)")
    return None


@dataclass(frozen=True, slots=True)
class LogitsPlan:
    """A step's logits rows when some request wants its prompt's logprobs: ``rows`` index the
    flattened tokens (the batch's ``sample_indices``), ``sample_rows`` the logits rows that
    sample, ``prompt`` holds ``(request, logits row, position of the token it predicts)``."""

    rows: list[int]
    sample_rows: list[int]
    prompt: list[tuple[Request, int, int]]


def logits_plan(step: ScheduledStep) -> LogitsPlan | None:
    """Where ``step`` needs logits when a request in it wants its prompt's logprobs (None: only
    at the sampling rows, the usual case): every position of its chunk whose next token is a
    prompt token without its logprobs yet, beside the sampling rows."""
    if not any(r.needs_prompt_logits for r in step.requests):
        return None
    rows: list[int] = []
    sample_rows: list[int] = []
    prompt: list[tuple[Request, int, int]] = []
    start = 0
    for req, n, samples in zip(step.requests, step.num_new_tokens, step.samples, strict=True):
        computed = req.num_computed
        if req.needs_prompt_logits:
            for pos in range(max(computed, req.prompt_logprobs_done), min(computed + n, req.prompt_len - 1)):
                prompt.append((req, len(rows), pos + 1))
                rows.append(start + pos - computed)
        if samples:
            sample_rows.append(len(rows))
            rows.append(start + n - 1)
        start += n
    return LogitsPlan(rows, sample_rows, prompt)


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What a step produced: one token per sampling request, in order (a failed row's token is
    there, to be dropped), each one's :class:`TokenLogprobs` when any request asked (None where
    it did not), the requests whose rows failed with what each raises, and when the model's
    call began and the sampling ended."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None] | None
    failed: Mapping[Hashable, BaseException]
    started: float
    ended: float


class StepRunner:
    """Runs scheduled steps through the user's step function on a KV cache.

    Args:
        step_fn: ``step_fn(batch, kv) -> logits`` (the contract of :mod:`batchkit.continuous.step`).
        kv: the cache the step reads and writes.
        cpu_cache: the CPU swap pool's tensors (None: the scheduler never swaps).
        allocator: the block tables of the requests a step runs.
        clock: when a step's model call begins and its sampling ends.
    """

    def __init__(
        self,
        step_fn: StepFn,
        kv: PagedKVCache,
        cpu_cache: PagedKVCache | None,
        allocator: PagedKVAllocator,
        clock: Clock,
    ) -> None:
        self.step_fn = step_fn
        self.kv = kv
        self.cpu_cache = cpu_cache
        self.allocator = allocator
        self.clock = clock
        self.grammars = GrammarMatchers()  # the matchers of requests with SamplingParams.grammar
        # The width of the step's logits, once a step has returned some: the vocabulary a
        # logit_bias is checked against at submit when the step declares none (vocab_size()).
        self.logits_width: int | None = None

    def vocab_size(self) -> int | None:
        """The step model's vocabulary size when it declares one (``step_fn.config.vocab_size``,
        as :class:`batchkit.models.LlamaModel` does), so that a token id past it is refused at
        submit instead of failing the whole step it would be batched into."""
        size = getattr(getattr(self.step_fn, "config", None), "vocab_size", None)
        return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None

    def run(self, step: ScheduledStep) -> StepOutput:
        """Run ``step``: block moves, the model, then a token for each request that samples.

        Raises:
            Exception: what the step function raises, or ValueError for logits that break the
                step contract (:func:`check_logits`): the whole step failed.
        """
        import torch

        with torch.inference_mode():
            self._move_blocks(step)
            plan = logits_plan(step)
            batch = self._batch(step, self.kv.device, plan)
            started = self.clock.now()
            all_logits = check_logits(self.step_fn(batch, self.kv), batch, self.vocab_size())
            if self.logits_width is None and all_logits.shape[0]:
                self.logits_width = int(all_logits.shape[1])
            logits = all_logits if batch.sample_rows is None else all_logits.index_select(0, batch.sample_rows)
            sampling = [r for r, s in zip(step.requests, step.samples, strict=True) if s]
            tokens, failed = self._draw(logits, sampling)
            token_lps = None
            if plan is not None or any(r.params.logprobs is not None for r in sampling):
                token_lps = self._logprobs(all_logits, plan, sampling, tokens)
        return StepOutput(tokens, token_lps, failed, started, self.clock.now())

    def _draw(self, logits: Tensor, sampling: list[Request]) -> tuple[list[int], dict[Hashable, BaseException]]:
        """A token per row of ``logits`` (one per request of ``sampling``), and the requests whose
        rows failed, each with its error: a row no token can be drawn from, a ``logit_bias`` past
        the logits, a grammar that allows nothing or refuses the token, sampling that raises."""
        failed: dict[Hashable, BaseException | None] = {}  # None: no token could be drawn

        def fail_rows(rows: Sequence[int]) -> None:
            for i in rows:
                failed.setdefault(sampling[i].request_id, None)

        logits, bad = mask_bad_rows(logits)
        fail_rows(bad)
        params = [r.params for r in sampling]
        if any(p.adjusts_logits or p.min_tokens for p in params):
            params, errors = _refuse_bias_past(int(logits.shape[1]), sampling, params)
            failed.update(errors)
            logits = adjust_logits(logits, params, [r.tokens for r in sampling], [r.prompt_len for r in sampling])
        constrained = any(p.grammar is not None for p in params)
        if constrained:
            logits, dead = self.grammars.mask(logits, sampling)
            fail_rows(dead)
        try:
            tokens = sample(logits, params, [r.generator for r in sampling])
        except Exception:  # noqa: BLE001 - found again row by row
            tokens, errors = _sample_each(logits, sampling)
            failed.update(errors)
        if constrained:
            skip = [i for i, r in enumerate(sampling) if r.request_id in failed] if failed else ()
            fail_rows(self.grammars.advance(sampling, tokens, skip))
        return tokens, {rid: error or FloatingPointError(_NO_TOKEN) for rid, error in failed.items()}

    def _move_blocks(self, step: ScheduledStep) -> None:
        """Perform the step's block moves, in the order :class:`ScheduledStep` gives."""
        kv, cpu = self.kv, self.cpu_cache
        if step.swap_out or step.swap_in:
            assert cpu is not None  # the scheduler swaps only with num_cpu_blocks > 0
            if step.swap_out:
                kv.swap_blocks(cpu, step.swap_out)
            if step.swap_in:
                cpu.swap_blocks(kv, step.swap_in)
        if step.copies:
            kv.copy_blocks(step.copies)

    def _logprobs(
        self, logits: Tensor, plan: LogitsPlan | None, sampling: list[Request], tokens: list[int]
    ) -> list[TokenLogprobs | None]:
        """The sampled tokens' logprobs (None for a request that did not ask), and the prompt
        entries of ``plan``, kept on their requests until their first token's event."""
        rows: list[int] = []
        targets: list[int] = []
        counts: list[int] = []
        prompt_flags: list[bool] = []
        for req, row, pos in plan.prompt if plan is not None else ():
            rows.append(row)
            targets.append(req.tokens[pos])
            counts.append(cast(int, req.params.prompt_logprobs))
            prompt_flags.append(True)
        num_prompt = len(rows)
        sample_rows: Sequence[int] = plan.sample_rows if plan is not None else range(len(sampling))
        asked: list[int] = []
        for i, (req, token) in enumerate(zip(sampling, tokens, strict=True)):
            if req.params.logprobs is not None:
                rows.append(sample_rows[i])
                targets.append(token)
                counts.append(req.params.logprobs)
                prompt_flags.append(False)
                asked.append(i)
        entries = logprobs_of(logits, rows, targets, counts, prompt_flags)
        for (req, _, pos), entry in zip(plan.prompt if plan is not None else (), entries, strict=False):
            req.prompt_logprobs.append(entry)
            req.prompt_logprobs_done = max(req.prompt_logprobs_done, pos)
        out: list[TokenLogprobs | None] = [None] * len(sampling)
        for i, entry in zip(asked, entries[num_prompt:], strict=True):
            out[i] = entry
        return out

    def build_batch(self, step: ScheduledStep, device: Any = "cpu") -> StepBatch:
        """The :class:`StepBatch` that :meth:`run` hands the step function for ``step`` (a
        ``Scheduler.schedule()`` result), on ``device``."""
        return self._batch(step, device, logits_plan(step))

    def _batch(self, step: ScheduledStep, device: Any, plan: LogitsPlan | None) -> StepBatch:
        import numpy as np
        import torch

        reqs = step.requests
        counts = step.num_new_tokens
        starts = [r.num_computed for r in reqs]
        if all(n == 1 for n in counts):  # a pure decode step
            ids = [r.tokens[s] for r, s in zip(reqs, starts, strict=True)]
            positions = starts
        else:
            ids, positions = [], []
            for r, s, n in zip(reqs, starts, counts, strict=True):
                ids.extend(r.tokens[s : s + n])
                positions.extend(range(s, s + n))
        rids = [r.request_id for r in reqs]
        tables = self.allocator.block_tables(rids)
        q_lens = np.asarray(counts, dtype=np.int64)
        pos = np.asarray(positions, dtype=np.int64)
        slots = step.slot_mapping  # as the scheduler reserved them
        if slots is None:  # a step built by hand: derive them from the block tables
            seq_idx = np.repeat(np.arange(len(reqs)), q_lens)
            bs = self.allocator.block_size
            slots = tables[seq_idx, pos // bs].astype(np.int64) * bs + pos % bs
        ends = np.cumsum(q_lens)
        query_start = np.concatenate(([0], ends))
        if plan is None:
            sample_idx = (ends - 1)[np.asarray(step.samples, dtype=bool)]
        else:
            sample_idx = np.asarray(plan.rows, dtype=np.int64)
        seq_lens = np.asarray(starts, dtype=np.int64) + q_lens
        return StepBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
            positions=torch.from_numpy(pos).to(device),
            query_start=torch.from_numpy(query_start).to(device),
            query_lens=torch.from_numpy(q_lens).to(device),
            seq_lens=torch.from_numpy(seq_lens).to(device),
            slot_mapping=torch.from_numpy(slots).to(device),
            block_tables=torch.from_numpy(tables).to(device),
            sample_indices=torch.from_numpy(sample_idx).to(device),
            seq_ids=tuple(rids),
            sampling=step.samples,
            sample_rows=None if plan is None else torch.tensor(plan.sample_rows, dtype=torch.int64, device=device),
        )


def mask_bad_rows(logits: Tensor) -> tuple[Tensor, list[int]]:
    """``logits`` with each row no token can be drawn from (a NaN, or every logit -inf: a broken
    model state there) set to zeros, and those rows.

    Such a row fails its own request, not its neighbours': sampled from zeros so that the others
    go on, its token is then dropped. One reduction finds both: a row's max is NaN if the row
    holds a NaN (max propagates it), and -inf only if every logit is -inf.
    """
    import torch

    row_max = logits.amax(dim=1)
    bad = torch.isnan(row_max) | torch.isneginf(row_max)
    if not bad.any():
        return logits, []
    return logits.masked_fill(bad[:, None], 0.0), bad.nonzero().flatten().tolist()


def _refuse_bias_past(
    width: int, sampling: list[Request], params: list[SamplingParams]
) -> tuple[list[SamplingParams], dict[Hashable, Exception]]:
    """``params`` with an unadjusted entry for each request whose ``logit_bias`` names an id past
    the logits' ``width`` (so that the bias is not added out of bounds and the step goes on for
    the other rows), and those requests, each with its ValueError.

    Each request is checked once, at its first sampled token (its output still empty): the check
    at submit covers only a request submitted when the vocabulary was known.
    """
    errors: dict[Hashable, Exception] = {}
    checked = list(params)
    for i, (req, p) in enumerate(zip(sampling, params, strict=True)):
        if p.logit_bias and not req.output and (error := logit_bias_past(p, width)) is not None:
            errors[req.request_id] = error
            checked[i] = _UNADJUSTED
    return checked, errors


def _sample_each(logits: Tensor, sampling: list[Request]) -> tuple[list[int], dict[Hashable, Exception]]:
    """Sample row by row after the step's sampling raised: a token per row, and the requests
    whose row raised again, each with its error (its token, 0, is dropped): such a row fails its
    own request alone, not every request of the step. (Rows sampled before the fault draw again:
    a seeded request's stream moves on by that draw.)"""
    tokens: list[int] = []
    errors: dict[Hashable, Exception] = {}
    for i, req in enumerate(sampling):
        try:
            tokens += sample(logits[i : i + 1], [req.params], [req.generator])
        except Exception as exc:  # noqa: BLE001 - the request gets it
            errors[req.request_id] = exc
            tokens.append(0)
    return tokens, errors

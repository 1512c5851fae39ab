"""A :class:`~batchkit.ContinuousDecodeLoop` as a job's batch function: prompt field in, text out."""

from __future__ import annotations

import concurrent.futures
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import KVCacheExhausted

if TYPE_CHECKING:
    from ..continuous.loop import ContinuousDecodeLoop

__all__ = ["GenerateFunction", "Generation", "LoopFunction", "OutputLine", "generate_fn", "qualified_name"]


def qualified_name(obj: object) -> str:
    """``module:qualname`` of a function, a method, a class, or else of an object's class (for a
    ``functools.partial``, of the function it wraps)."""
    if isinstance(obj, functools.partial):
        obj = obj.func
    if not hasattr(obj, "__qualname__"):
        obj = type(obj)
    return f"{getattr(obj, '__module__', None)}:{getattr(obj, '__qualname__', type(obj).__qualname__)}"


@dataclass(frozen=True, slots=True)
class Generation:
    """One request's result: the decoded text and its token counts."""

    text: str
    num_tokens: int  # generated
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class OutputLine:
    """A result that is its record's whole output line (an OpenAI Batch answer, say) rather than
    the value under ``"output"``: ``fields`` holds the id field too, under the function's
    :attr:`LoopFunction.result_field` the value a resume checks each committed line for."""

    fields: dict[str, Any]
    num_tokens: int  # generated, for the job's tokens/s and cost


class LoopFunction:
    """A decode loop as a job's function: :func:`batchkit.jobs.run` submits each record on its
    own (:meth:`submit`), keeps ``2 * max_num_seqs`` in flight, and journals :attr:`job_name`
    and :meth:`settings` as what the results were computed with."""

    job_name = "batchkit.jobs:LoopFunction"  # the function's name in the job's journal
    result_field = "output"  # the output lines' field that holds each result
    loop: ContinuousDecodeLoop

    @property
    def max_num_seqs(self) -> int:
        """Requests the loop runs at once (the job keeps twice as many in flight)."""
        return int(self.loop.scheduler.max_num_seqs)

    def settings(self) -> dict[str, Any]:
        """What shapes each record's result besides the record, as the job's journal records it."""
        raise NotImplementedError

    def submit(self, record: dict[str, Any]) -> concurrent.futures.Future[Any]:
        """Start one record; the future resolves to its result or fails with its error."""
        raise NotImplementedError


class GenerateFunction(LoopFunction):
    """Generate text for records through a decode loop (see :func:`generate_fn`).

    Calling it with a list of records returns their texts (a batch function, usable anywhere);
    :func:`batchkit.jobs.run` instead submits each record on its own with :meth:`submit`, so that
    the loop batches continuously and the job can count tokens.
    """

    def __init__(
        self,
        loop: ContinuousDecodeLoop,
        *,
        encode: Callable[[str], Sequence[int]],
        decode: Callable[[list[int]], str],
        prompt_field: str = "prompt",
        **sampling: Any,
    ) -> None:
        if not callable(encode) or not callable(decode):
            raise TypeError("encode and decode must be callables: text -> token ids, and token ids -> text")
        if not isinstance(prompt_field, str) or not prompt_field:
            raise ValueError(f"prompt_field must be a non-empty string, got {prompt_field!r}")
        self.loop = loop
        self.encode = encode
        self.decode = decode
        self.prompt_field = prompt_field
        self.sampling = sampling

    job_name = "batchkit.jobs:generate_fn"

    def settings(self) -> dict[str, Any]:
        """What shapes each record's text besides its prompt, as a job's journal records it: the
        model's type, the tokenizer's functions, the prompt field and the sampling options."""
        return {
            "model": qualified_name(self.loop.step_fn),
            "encode": qualified_name(self.encode),
            "decode": qualified_name(self.decode),
            "prompt_field": self.prompt_field,
            "sampling": self.sampling,
        }

    def submit(self, record: dict[str, Any]) -> concurrent.futures.Future[Generation]:
        """Start generating for one record; the future resolves to a :class:`Generation` or fails
        with the record's own error (no prompt field, a prompt the tokenizer or loop refuses, a
        prompt too long for the KV cache).

        Raises:
            QueueFull: the loop's ``max_waiting`` is reached (retry later).
            BatcherClosed: the loop is closed.
        """
        out: concurrent.futures.Future[Generation] = concurrent.futures.Future()
        prompt = record.get(self.prompt_field)
        if not isinstance(prompt, str):
            out.set_exception(
                KeyError(
                    f"record has no text under {self.prompt_field!r} (got {type(prompt).__name__}); "
                    "set prompt_field= to the field that holds the prompt"
                )
            )
            return out
        if not prompt:  # a chat template would wrap it into a prompt of its own: refuse it first
            out.set_exception(ValueError(f"the prompt under {self.prompt_field!r} is empty"))
            return out
        try:
            ids = list(self.encode(prompt))
            fut = self.loop.submit(ids, **self.sampling)
        except (ValueError, TypeError, KVCacheExhausted) as exc:  # this prompt's fault: a per-item failure
            # (at submit, KVCacheExhausted means the prompt can never fit the cache, not that it is full now)
            out.set_exception(exc)
            return out

        def finish(f: concurrent.futures.Future[list[int]]) -> None:
            if f.cancelled():
                out.cancel()
                return
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            tokens = f.result()
            try:
                out.set_result(Generation(self.decode(tokens), len(tokens), len(ids)))
            except Exception as e:  # noqa: BLE001 - a decode failure is this item's failure
                out.set_exception(e)

        fut.add_done_callback(finish)
        return out

    def __call__(self, records: list[dict[str, Any]]) -> list[str | BaseException]:
        """Generate for a list of records; a record that fails gets its exception in its slot."""
        futures = [self.submit(r) for r in records]
        results: list[str | BaseException] = []
        for f in futures:
            exc = f.exception()
            results.append(exc if exc is not None else f.result().text)
        return results

    def __repr__(self) -> str:
        return f"<GenerateFunction prompt_field={self.prompt_field!r} sampling={self.sampling!r} loop={self.loop!r}>"


def generate_fn(
    loop: ContinuousDecodeLoop,
    *,
    encode: Callable[[str], Sequence[int]],
    decode: Callable[[list[int]], str],
    prompt_field: str = "prompt",
    **sampling: Any,
) -> GenerateFunction:
    """Wrap a decode loop and a tokenizer's ``encode``/``decode`` as a job function.

    Each record's ``prompt_field`` is encoded, generated with ``sampling`` (``max_new_tokens``,
    ``temperature``, ``seed``, ... as :class:`~batchkit.SamplingParams`), and decoded; the text is
    the record's output and the generated tokens count in the job's tokens/s and cost::

        job = batchkit.jobs.generate_fn(loop, encode=tok.encode, decode=tok.decode, max_new_tokens=64)
        batchkit.jobs.run(job, "prompts.jsonl", "answers.jsonl")

    Raises:
        TypeError: ``encode`` or ``decode`` is not callable. ValueError: an empty ``prompt_field``.
    """
    return GenerateFunction(loop, encode=encode, decode=decode, prompt_field=prompt_field, **sampling)

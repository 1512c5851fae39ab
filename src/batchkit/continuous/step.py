"""The step contract: what the loop hands the user's decode step, and what comes back.

``step_fn(batch: StepBatch, kv: PagedKVCache) -> logits``

The batch flattens this step's new tokens of every scheduled sequence, side by side: prefill
chunks (many tokens of one prompt) and decodes (one token each). For sequence ``i``, its tokens
are ``input_ids[query_start[i]:query_start[i + 1]]`` at ``positions`` of the same range; their
K/V go to ``slot_mapping`` of the same range (write them with ``kv.scatter`` before attending);
the sequence's context after this step is ``seq_lens[i]`` tokens addressed by
``block_tables[i]``. The step returns logits ``[len(sample_indices), vocab]``, one row per entry
of ``sample_indices`` (which index into the flattened tokens): each sequence that samples this
step gets a row at its last token. A sequence still mid-prefill (a chunk that does not end its
prompt) does not sample. A sequence that asks for its prompt's logprobs
(``SamplingParams(prompt_logprobs=)``) also gets a row at every token of its prefill chunk; then
``sample_rows`` tells which rows of the logits are the sampling ones (None: every row is), and a
step that computes logits at exactly ``sample_indices`` serves both without knowing.

Worked example: sequences A (prompt of 5, first chunk of 3) and B (decoding at position 9)::

    input_ids      = [a0, a1, a2, b9]
    positions      = [0, 1, 2, 9]
    query_start    = [0, 3, 4]        query_lens = [3, 1]
    seq_lens       = [3, 10]
    sample_indices = [3]              # only B samples; A's prompt is not done
    logits.shape   = (1, vocab)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["StepBatch", "check_logits", "in_fresh_thread"]

_T = TypeVar("_T")

Tensor = Any


@dataclass(frozen=True)
class StepBatch:
    """One step's work for the user's step function: torch tensors on the KV cache's device
    (int64, but ``block_tables`` int32), and ``seq_ids`` / ``sampling`` as tuples."""

    input_ids: Tensor  # [num_tokens] int64
    positions: Tensor  # [num_tokens] int64
    query_start: Tensor  # [num_seqs + 1] int64, prefix sums of query_lens
    query_lens: Tensor  # [num_seqs] int64
    seq_lens: Tensor  # [num_seqs] int64, context length after this step
    slot_mapping: Tensor  # [num_tokens] int64
    block_tables: Tensor  # [num_seqs, max_blocks] int32, padded with block 0
    sample_indices: Tensor  # [num_rows] int64, rows of the flattened tokens whose logits are wanted
    seq_ids: tuple[Hashable, ...]  # the scheduled sequences, in order
    sampling: tuple[bool, ...]  # whether each scheduled sequence samples this step
    sample_rows: Tensor | None = None  # [num_sampling] int64 rows of the logits that sample; None: all

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)


def check_logits(logits: Any, batch: StepBatch, vocab_size: int | None = None) -> Tensor:
    """Validate what a step function returned; raise a clear TypeError/ValueError otherwise.

    With ``vocab_size`` (the model's), logits wider than it are refused: a token sampled past
    the vocabulary would reach the caller and fail the next step of every request beside it."""
    import torch

    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the step function must return a torch.Tensor of logits, got {type(logits).__name__}")
    n = int(batch.sample_indices.shape[0])
    if logits.dim() != 2 or logits.shape[0] != n or (n and logits.shape[1] == 0):
        raise ValueError(
            f"the step function must return logits [len(batch.sample_indices)={n}, vocab] (one row per sequence "
            "that samples, and per prompt token asking for logprobs: per entry of batch.sample_indices), got "
            f"shape {tuple(logits.shape)}"
        )
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be a float tensor, got {logits.dtype}")
    if vocab_size is not None and logits.shape[1] > vocab_size:
        raise ValueError(
            f"the step function returned {logits.shape[1]} logits per row for a vocabulary of {vocab_size} "
            "(step_fn.config.vocab_size): token ids past it do not exist"
        )
    return logits


def in_fresh_thread(fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> _T:
    """Run ``fn(*args, **kwargs)`` in a new thread that ends when it returns; return its result
    (or raise its exception) here.

    Why: on a CPU, torch's OpenMP runtime gives every thread that runs a parallel operation its
    own team of worker threads, and keeps it until that thread ends. Once two teams exist on a
    machine with few cores, OpenMP stops spinning between operations and every step of a decode
    loop pays for it: a loop whose engine thread runs the model is about 1.5x slower per step when
    the main thread has ever run torch work. The main thread never ends, so its team never goes.
    Build the model and its KV cache through this function (``load_pretrained`` and
    ``PretrainedLM.make_loop`` do), and the engine thread's team is the only one.

    A signal that interrupts the wait here (Ctrl-C, ``batchkit run``'s SIGTERM) is raised once
    ``fn`` has returned: a process that exits while the thread still runs torch code aborts
    (status 134, "terminate called without an active exception"). A second signal is not held.
    """
    box: list[Any] = []

    finished = threading.Event()

    def run() -> None:
        try:
            box.append((True, fn(*args, **kwargs)))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            box.append((False, exc))
        finally:
            finished.set()

    t = threading.Thread(target=run, name="batchkit-setup")
    t.start()
    # An Event, not Thread.join: a join that a signal interrupts marks the thread ended while it runs.
    try:
        finished.wait()
    except BaseException:
        finished.wait()
        raise
    t.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]

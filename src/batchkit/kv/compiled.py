"""The KV write and paged attention as torch custom operators, for steps compiled by ``torch.compile``.

A compiled function that writes into the KV cache with a plain ``index_copy_`` is functionalized:
the write is replayed as a copy of the whole cache tensor, per layer (``benchmarks/compiled_step.py``
measured it 150x slower than eager). Declared as custom operators that mutate the cache
(``mutates_args``), the write stays an in-place call in the compiled graph, and inductor fuses the
elementwise work around it (norms, rotary embedding, residuals, SiLU) without copying the cache.
Attention is an operator too, opaque to the compiler, which reads the step's attention plan (see
:mod:`batchkit.kv.attention`) from :func:`attention_plan`.

Importing this module registers ``torch.ops.batchkit.write_kv`` and
``torch.ops.batchkit.paged_attention`` (it imports torch; ``batchkit.kv`` does not import it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from . import native
from .attention import AttentionPlan, planned_attention
from .ops import write_slots

__all__ = ["attention_plan", "paged_attention", "write_kv"]


@torch.library.custom_op("batchkit::write_kv", mutates_args=("kv",))
def write_kv(kv: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slots`` (int64, no
    padding) of layer ``layer`` of ``kv`` (:attr:`PagedKVCache.kv`), in place."""
    write_slots(kv[layer, 0], kv[layer, 1], key, value, slots)


@write_kv.register_fake
def _(kv: torch.Tensor, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    return None


_step = threading.local()  # the attention plan of the step this thread runs (see attention_plan)


@contextmanager
def attention_plan(plan: AttentionPlan) -> Iterator[None]:
    """Make ``plan`` the one :func:`paged_attention` uses in this thread while the block runs.

    The plan is not an input of the operator: a compiled graph guards on the shapes of its
    inputs, and the plan's (one or two groups, a group of one sequence) would compile the step
    again for each combination. The step's tensors stay its inputs (rows, slots, the cache).

    Where the native extension is built (:mod:`batchkit.kv.native`) and the step is decodes
    alone, ``torch.ops.batchkit_native.paged_attention`` runs them on its kernel without Python;
    any other step goes through :func:`paged_attention`."""
    outer = getattr(_step, "plan", None)
    _step.plan = plan
    if len(plan.groups) == 1 and plan.groups[0].whole:  # decodes alone: the native operator's, in C++
        group = plan.groups[0]
        decodes = native.decodes(group.tables.view(plan.num_tokens, -1), group.lens, group.window)
    else:
        decodes = native.decodes(None, None)
    try:
        with decodes:
            yield
    finally:
        _step.plan = outer


@torch.library.custom_op("batchkit::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, kv: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    """:func:`~batchkit.kv.attention.planned_attention` of ``query`` over layer ``layer`` of ``kv``
    (:attr:`PagedKVCache.kv`) with the plan set by :func:`attention_plan`.

    Raises:
        RuntimeError: no plan is set in this thread.
    """
    plan = getattr(_step, "plan", None)
    if plan is None:
        raise RuntimeError("batchkit::paged_attention runs inside `with attention_plan(plan):` only")
    out: torch.Tensor = planned_attention(query, kv[layer, 0], kv[layer, 1], plan, scale)
    return out


@paged_attention.register_fake
def _(query: torch.Tensor, kv: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    return torch.empty_like(query)

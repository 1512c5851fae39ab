"""Stack, pad and split helpers for numpy arrays and torch tensors.

A batch function receives a list of per-request inputs and must return one output per input.
These helpers do the two conversions every such function needs::

    padded = collate.pad(token_id_arrays, pad_value=0, pad_to_multiple=8)
    out = model(padded.batch)                 # [B, L, ...]
    return collate.unpad(out, padded)         # one [l_i, ...] per request

torch is never imported here: tensors are recognised by type and handled with their own methods.
"""

from __future__ import annotations

import bisect
import functools
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = ["Padded", "pad", "split", "stack", "unpad"]

Side = Literal["left", "right"]


def _is_torch(x: object) -> bool:
    return type(x).__module__.startswith("torch")


def _check_items(items: Sequence[Any], what: str) -> None:
    if len(items) == 0:
        raise ValueError(f"{what} needs at least one item, got an empty list")
    if _is_torch(items[0]) and not all(_is_torch(x) for x in items):
        raise ValueError(f"{what} needs items of one kind: the first is a torch tensor, so every item must be one")


def _is_count(value: object) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def stack(items: Sequence[Any]) -> Any:
    """Stack equally shaped arrays (numpy) or tensors (torch) into one batch along a new axis 0.

    Raises:
        ValueError: no items, or shapes differ (use :func:`pad` for variable lengths).
    """
    _check_items(items, "stack")
    if not _is_torch(items[0]):
        items = [np.asarray(x) for x in items]
    first = items[0]
    shapes = {tuple(x.shape) for x in items}
    if len(shapes) > 1:
        raise ValueError(f"stack needs equal shapes, got {sorted(shapes)}; use collate.pad for variable lengths")
    if _is_torch(first):
        import torch

        return torch.stack(list(items))
    return np.stack(items)


def split(batch: Any, n: int | None = None) -> list[Any]:
    """Split a batch along axis 0 into its rows (the first ``n`` only, when given)."""
    rows = batch.shape[0]
    if n is None:
        n = rows
    if not _is_count(n) or not 0 <= n <= rows:
        raise ValueError(f"n must be in 0..{rows} (the batch's first dimension), got {n!r}")
    return [batch[i] for i in range(n)]


@dataclass(frozen=True)
class Padded:
    """A padded batch and what :func:`unpad` needs to undo it.

    Attributes:
        batch: ``[B, L, ...]`` with ``B >= len(lengths)`` (extra rows are batch padding).
        mask: ``[B, L]`` bool, True on real positions.
        lengths: the real length of each item.
        side: where the padding went.
    """

    batch: Any
    mask: Any
    lengths: tuple[int, ...]
    side: Side

    @property
    def num_items(self) -> int:
        return len(self.lengths)


def _round_up(n: int, multiple: int | None) -> int:
    if multiple is None:
        return n
    return -(-n // multiple) * multiple


def _holds(value: float, cast: Callable[[float], Any]) -> bool:
    """Whether an int or bool dtype holds ``value`` exactly (``cast`` converts to it)."""
    if not math.isfinite(value):
        return False
    with np.errstate(invalid="ignore", over="ignore"):
        try:
            return bool(cast(value) == value)
        except (OverflowError, RuntimeError, ValueError):  # too large for any int dtype (numpy, torch)
            return False


def pad(
    items: Sequence[Any],
    *,
    pad_value: float = 0,
    side: Side = "right",
    pad_to_multiple: int | None = None,
    allowed_batch_sizes: Sequence[int] | None = None,
) -> Padded:
    """Pad variable-length items (``[l_i, ...]``) to one ``[B, L, ...]`` batch.

    Args:
        pad_value: fill for padded positions.
        side: ``"right"`` (default) or ``"left"`` (decoder-only generation pads left).
        pad_to_multiple: round ``L`` up to a multiple (tensor-core and kernel friendly shapes).
        allowed_batch_sizes: round ``B`` up to the smallest allowed size, adding all-padding
            rows (keeps shapes in a small set, e.g. for CUDA graphs).

    Raises:
        ValueError: no items, a torch tensor first and another kind of item after it, a bad side,
            a ``pad_value`` that is not a number,
            a ``pad_to_multiple`` or ``allowed_batch_sizes`` that is not an int >= 1, trailing
            shapes that differ, more items
            than the largest allowed batch size, or a ``pad_value`` the items' dtype cannot hold
            exactly (``0.5`` or ``-1`` for unsigned ints, ``2`` for bools).
    """
    _check_items(items, "pad")
    if not _is_torch(items[0]):
        items = [np.asarray(x) for x in items]
    if any(len(x.shape) == 0 for x in items):
        raise ValueError("pad needs items with a first (length) dimension, got a 0-d item; use collate.stack")
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    if not isinstance(pad_value, (numbers.Number, np.number, np.bool_)):
        # None would fill a float batch with NaN, silently; a str fails deep inside numpy or torch.
        raise ValueError(f"pad_value must be a number (the fill of padded positions), got {pad_value!r}")
    if pad_to_multiple is not None and not (_is_count(pad_to_multiple) and pad_to_multiple >= 1):
        raise ValueError(f"pad_to_multiple must be an int >= 1 or None, got {pad_to_multiple!r}")
    if allowed_batch_sizes is not None and not all(_is_count(b) and b >= 1 for b in allowed_batch_sizes):
        raise ValueError(f"allowed_batch_sizes must be ints >= 1, got {list(allowed_batch_sizes)!r}")
    trailing = {tuple(x.shape[1:]) for x in items}
    if len(trailing) > 1:
        raise ValueError(f"items must agree on every dimension after the first, got {sorted(trailing)}")
    lengths = tuple(int(x.shape[0]) for x in items)
    max_len = _round_up(max(lengths), pad_to_multiple)
    rows = len(items)
    if allowed_batch_sizes:
        sizes = sorted(allowed_batch_sizes)
        i = bisect.bisect_left(sizes, rows)
        if i == len(sizes):
            raise ValueError(f"{rows} items exceed the largest allowed batch size {sizes[-1]}; split the batch")
        rows = sizes[i]
    first = items[0]
    batch: Any
    mask: Any
    # The batch takes the items' common dtype, as stack does: an int item next to a float one
    # must not have the float's values truncated.
    if _is_torch(first):
        import torch

        dtype = functools.reduce(torch.promote_types, (x.dtype for x in items))
        exact = not (dtype.is_floating_point or dtype.is_complex)
        if exact and not _holds(pad_value, lambda v: torch.tensor(v).to(dtype).item()):
            raise ValueError(f"pad_value {pad_value!r} is not a value of the items' dtype {dtype}")
        batch = torch.full((rows, max_len, *first.shape[1:]), pad_value, dtype=dtype, device=first.device)
        mask = torch.zeros((rows, max_len), dtype=torch.bool, device=first.device)
    else:
        np_dtype = functools.reduce(np.promote_types, (x.dtype for x in items))
        exact = not np.issubdtype(np_dtype, np.inexact)
        if exact and not _holds(pad_value, lambda v: np.array(v).astype(np_dtype).item()):
            raise ValueError(f"pad_value {pad_value!r} is not a value of the items' dtype {np_dtype}")
        batch = np.full((rows, max_len, *first.shape[1:]), pad_value, dtype=np_dtype)
        mask = np.zeros((rows, max_len), dtype=bool)
    for i, (x, n) in enumerate(zip(items, lengths, strict=False)):
        start = 0 if side == "right" else max_len - n
        batch[i, start : start + n] = x
        mask[i, start : start + n] = True
    return Padded(batch=batch, mask=mask, lengths=lengths, side=side)


def unpad(outputs: Any, padded: Padded) -> list[Any]:
    """Undo :func:`pad` on a model output ``[B, L, ...]``: one ``[l_i, ...]`` per real item.

    Raises:
        ValueError: ``outputs`` has fewer than two dimensions, fewer rows than the padded batch
            has items, or another length.
    """
    if len(outputs.shape) < 2:
        raise ValueError(f"outputs must be [rows, length, ...] like the padded batch, got shape {tuple(outputs.shape)}")
    if outputs.shape[0] < padded.num_items:
        raise ValueError(f"outputs has {outputs.shape[0]} rows for {padded.num_items} items")
    max_len = padded.mask.shape[1]
    if outputs.shape[1] != max_len:
        raise ValueError(f"outputs has length {outputs.shape[1]}, the padded batch {max_len}")
    out = []
    for i, n in enumerate(padded.lengths):
        start = 0 if padded.side == "right" else max_len - n
        out.append(outputs[i, start : start + n])
    return out

"""Options that cannot both apply are refused, not silently half-applied."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import batchkit
from batchkit import collate


def _double(xs: list[int]) -> list[int]:
    return [2 * x for x in xs]


@pytest.mark.parametrize("extra", [{"max_queue": 8}, {"on_full": "block"}])
def test_a_queue_with_its_own_capacity_refuses_max_queue_and_on_full(extra: dict[str, object]) -> None:
    q: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(4)
    with pytest.raises(ValueError, match="not both"):
        batchkit.DynamicBatcher(_double, queue=q, **extra)  # type: ignore[arg-type]


def test_a_queue_alone_is_taken_with_its_capacity() -> None:
    q: batchkit.BoundedQueue[int] = batchkit.BoundedQueue(4)
    with batchkit.DynamicBatcher(_double, queue=q, max_wait_ms=0) as b:
        assert b.queue.maxsize == 4
        assert b(3) == 6


@pytest.mark.parametrize(
    ("dtype", "pad_value"), [(np.int64, 0.5), (np.uint8, -1), (np.uint8, 300), (np.bool_, 2), (np.int32, float("nan"))]
)
def test_pad_refuses_a_pad_value_an_int_batch_cannot_hold(dtype: type, pad_value: float) -> None:
    items: list[np.ndarray[Any, Any]] = [np.ones(2, dtype=dtype), np.ones(3, dtype=dtype)]
    with pytest.raises(ValueError, match="pad_value"):
        collate.pad(items, pad_value=pad_value)


def test_pad_keeps_exact_pad_values_and_any_float_one() -> None:
    ints = collate.pad([np.ones(1, dtype=np.int64), np.ones(2, dtype=np.int64)], pad_value=-1)
    assert ints.batch.tolist() == [[1, -1], [1, 1]]
    floats = collate.pad([np.ones(1, dtype=np.float32), np.ones(2, dtype=np.float32)], pad_value=0.5)
    assert floats.batch.tolist() == [[1.0, 0.5], [1.0, 1.0]]


def test_pad_refuses_an_inexact_pad_value_for_torch_ints() -> None:
    torch = pytest.importorskip("torch")
    items = [torch.ones(2, dtype=torch.int64), torch.ones(3, dtype=torch.int64)]
    with pytest.raises(ValueError, match="pad_value"):
        collate.pad(items, pad_value=0.5)
    assert collate.pad(items, pad_value=7).batch[0].tolist() == [1, 1, 7]

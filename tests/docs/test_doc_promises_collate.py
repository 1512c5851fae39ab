"""docs/api.md's collate promises: pad keeps every item's values, for numpy and torch alike."""

from __future__ import annotations

import numpy as np
import pytest

from batchkit import collate


def test_pad_keeps_the_values_of_items_of_different_numpy_dtypes() -> None:
    """An int item first and a float item after: the batch takes their common dtype (as stack does)."""
    padded = collate.pad([np.array([1, 2]), np.array([0.5])])
    assert padded.batch.dtype == np.float64
    assert padded.batch.tolist() == [[1.0, 2.0], [0.5, 0.0]]
    assert [o.tolist() for o in collate.unpad(padded.batch, padded)] == [[1.0, 2.0], [0.5]]


def test_pad_keeps_the_values_of_items_of_different_torch_dtypes() -> None:
    torch = pytest.importorskip("torch")
    padded = collate.pad([torch.tensor([1, 2]), torch.tensor([0.5])], side="left")
    assert padded.batch.dtype == torch.float32
    assert padded.batch.tolist() == [[1.0, 2.0], [0.0, 0.5]]


def test_pad_keeps_the_dtype_of_items_that_agree() -> None:
    padded = collate.pad([np.arange(3, dtype=np.int32), np.arange(1, dtype=np.int32)], pad_value=-1)
    assert padded.batch.dtype == np.int32
    assert padded.batch.tolist() == [[0, 1, 2], [0, -1, -1]]


def test_pad_refuses_0d_items_with_value_error() -> None:
    with pytest.raises(ValueError, match="0-d"):
        collate.pad([np.float32(1.0), np.float32(2.0)])

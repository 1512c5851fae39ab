"""Bad arguments to ``batchkit.collate`` are a ``ValueError`` that names them, never a stray
``TypeError``/``IndexError``/``OverflowError`` from numpy or torch."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from batchkit import collate


@pytest.mark.parametrize("multiple", [1.5, True, 0, -2])
def test_pad_to_multiple_must_be_an_int_of_at_least_one(multiple: Any) -> None:
    with pytest.raises(ValueError, match="pad_to_multiple"):
        collate.pad([np.arange(3)], pad_to_multiple=multiple)


def test_pad_to_multiple_takes_a_numpy_int() -> None:
    multiple: Any = np.int64(4)
    assert collate.pad([np.arange(3)], pad_to_multiple=multiple).batch.shape == (1, 4)


@pytest.mark.parametrize("sizes", [[0], [-1, 1], [2.5], [True, 4]])
def test_allowed_batch_sizes_must_be_ints_of_at_least_one(sizes: list[Any]) -> None:
    with pytest.raises(ValueError, match="allowed_batch_sizes"):
        collate.pad([np.arange(3)], allowed_batch_sizes=sizes)


@pytest.mark.parametrize("n", [1.5, True])
def test_split_count_must_be_an_int(n: Any) -> None:
    with pytest.raises(ValueError, match="n must be"):
        collate.split(np.zeros((3, 2)), n)


def test_unpad_of_a_one_dimensional_output_is_a_value_error() -> None:
    padded = collate.pad([np.arange(3), np.arange(1)])
    with pytest.raises(ValueError, match="outputs"):
        collate.unpad(np.zeros(2), padded)


def test_a_pad_value_too_large_for_the_int_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="pad_value"):
        collate.pad([np.arange(3), np.arange(1)], pad_value=2**70)


def test_a_torch_tensor_first_and_a_numpy_array_after_is_a_value_error() -> None:
    torch = pytest.importorskip("torch")
    for fn in (collate.pad, collate.stack):
        with pytest.raises(ValueError, match="one kind"):
            fn([torch.arange(3), np.arange(3)])
    with pytest.raises(ValueError, match="pad_value"):
        collate.pad([torch.arange(3), torch.arange(1)], pad_value=2**70)

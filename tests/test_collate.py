"""collate: stack, split, pad and unpad for numpy arrays and torch tensors."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import batchkit
from batchkit import collate

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_stack_then_split_round_trips(lib: str) -> None:
    """stack makes a [B, ...] batch and split returns the rows."""
    rows = [np.arange(3) + i for i in range(4)]
    items = rows if lib == "numpy" else [torch.tensor(r) for r in rows]
    batch = collate.stack(items)
    assert tuple(batch.shape) == (4, 3)
    for got, want in zip(collate.split(batch), rows, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    assert len(collate.split(batch, 2)) == 2


def test_stack_refuses_ragged_and_empty_input() -> None:
    """Different shapes point to pad; an empty list is refused."""
    with pytest.raises(ValueError, match=r"use collate\.pad"):
        collate.stack([np.zeros(2), np.zeros(3)])
    with pytest.raises(ValueError, match="at least one item"):
        collate.stack([])


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_pad_then_unpad_returns_each_item(lib: str, side: str) -> None:
    """Padding to a multiple and back strips exactly the padding, on either side."""
    seqs = [np.arange(n) + 1 for n in (3, 5, 1)]
    items = seqs if lib == "numpy" else [torch.tensor(s) for s in seqs]
    padded = collate.pad(items, pad_value=0, side=side, pad_to_multiple=4)  # type: ignore[arg-type]
    assert tuple(padded.batch.shape) == (3, 8)
    assert int(padded.mask.sum()) == 9
    if side == "left":
        assert int(padded.batch[2, -1]) == 1
        assert int(padded.batch[2, 0]) == 0
    for got, want in zip(collate.unpad(padded.batch, padded), seqs, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)


def test_pad_rounds_batch_up_to_an_allowed_size() -> None:
    """allowed_batch_sizes adds all-padding rows up to the next allowed size, or refuses too many."""
    items = [np.ones((2, 3)) for _ in range(3)]
    padded = collate.pad(items, allowed_batch_sizes=[1, 4, 8])
    assert padded.batch.shape == (4, 2, 3)
    assert not padded.mask[3].any()
    assert len(collate.unpad(padded.batch, padded)) == 3
    with pytest.raises(ValueError, match="largest allowed batch size"):
        collate.pad(items, allowed_batch_sizes=[2])


def test_pad_validates_its_arguments() -> None:
    """Bad sides, multiples and mismatched trailing shapes are ValueErrors naming the fix."""
    with pytest.raises(ValueError, match="side must be"):
        collate.pad([np.ones(2)], side="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pad_to_multiple"):
        collate.pad([np.ones(2)], pad_to_multiple=0)
    with pytest.raises(ValueError, match="every dimension after the first"):
        collate.pad([np.ones((2, 3)), np.ones((2, 4))])
    padded = collate.pad([np.ones(2)])
    with pytest.raises(ValueError, match="rows"):
        collate.unpad(np.ones((0, 2)), padded)


class TestPadValues:
    """A pad_value the batch's dtype cannot hold exactly is refused, not silently half-applied."""

    @pytest.mark.parametrize(
        ("dtype", "pad_value"),
        [(np.int64, 0.5), (np.uint8, -1), (np.uint8, 300), (np.bool_, 2), (np.int32, float("nan"))],
    )
    def test_pad_refuses_a_pad_value_an_int_batch_cannot_hold(self, dtype: type, pad_value: float) -> None:
        items: list[np.ndarray[Any, Any]] = [np.ones(2, dtype=dtype), np.ones(3, dtype=dtype)]
        with pytest.raises(ValueError, match="pad_value"):
            collate.pad(items, pad_value=pad_value)

    def test_pad_keeps_exact_pad_values_and_any_float_one(self) -> None:
        ints = collate.pad([np.ones(1, dtype=np.int64), np.ones(2, dtype=np.int64)], pad_value=-1)
        assert ints.batch.tolist() == [[1, -1], [1, 1]]
        floats = collate.pad([np.ones(1, dtype=np.float32), np.ones(2, dtype=np.float32)], pad_value=0.5)
        assert floats.batch.tolist() == [[1.0, 0.5], [1.0, 1.0]]

    def test_pad_refuses_an_inexact_pad_value_for_torch_ints(self) -> None:
        torch = pytest.importorskip("torch")
        items = [torch.ones(2, dtype=torch.int64), torch.ones(3, dtype=torch.int64)]
        with pytest.raises(ValueError, match="pad_value"):
            collate.pad(items, pad_value=0.5)
        assert collate.pad(items, pad_value=7).batch[0].tolist() == [1, 1, 7]


class TestBadArgumentsAreValueErrorsThatNameThem:
    """Bad arguments to ``batchkit.collate`` are a ``ValueError`` that names them, never a stray
    ``TypeError``/``IndexError``/``OverflowError`` from numpy or torch."""

    @pytest.mark.parametrize("multiple", [1.5, True, 0, -2])
    def test_pad_to_multiple_must_be_an_int_of_at_least_one(self, multiple: Any) -> None:
        with pytest.raises(ValueError, match="pad_to_multiple"):
            collate.pad([np.arange(3)], pad_to_multiple=multiple)

    def test_pad_to_multiple_takes_a_numpy_int(self) -> None:
        multiple: Any = np.int64(4)
        assert collate.pad([np.arange(3)], pad_to_multiple=multiple).batch.shape == (1, 4)

    @pytest.mark.parametrize("sizes", [[0], [-1, 1], [2.5], [True, 4]])
    def test_allowed_batch_sizes_must_be_ints_of_at_least_one(self, sizes: list[Any]) -> None:
        with pytest.raises(ValueError, match="allowed_batch_sizes"):
            collate.pad([np.arange(3)], allowed_batch_sizes=sizes)

    @pytest.mark.parametrize("n", [1.5, True])
    def test_split_count_must_be_an_int(self, n: Any) -> None:
        with pytest.raises(ValueError, match="n must be"):
            collate.split(np.zeros((3, 2)), n)

    def test_unpad_of_a_one_dimensional_output_is_a_value_error(self) -> None:
        padded = collate.pad([np.arange(3), np.arange(1)])
        with pytest.raises(ValueError, match="outputs"):
            collate.unpad(np.zeros(2), padded)

    def test_a_pad_value_too_large_for_the_int_dtype_is_a_value_error(self) -> None:
        with pytest.raises(ValueError, match="pad_value"):
            collate.pad([np.arange(3), np.arange(1)], pad_value=2**70)

    def test_a_torch_tensor_first_and_a_numpy_array_after_is_a_value_error(self) -> None:
        torch = pytest.importorskip("torch")
        for fn in (collate.pad, collate.stack):
            with pytest.raises(ValueError, match="one kind"):
                fn([torch.arange(3), np.arange(3)])
        with pytest.raises(ValueError, match="pad_value"):
            collate.pad([torch.arange(3), torch.arange(1)], pad_value=2**70)


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


@pytest.mark.parametrize("pad_value", [None, "0"])
def test_pad_refuses_a_pad_value_that_is_not_a_number(pad_value: Any) -> None:
    """A ``pad_value`` that is not a number is a ValueError naming it, for float items too
    (None would otherwise fill their padding with NaN, silently)."""
    np = pytest.importorskip("numpy")
    for items in ([np.arange(3), np.arange(5)], [np.ones(2), np.ones(3)]):
        with pytest.raises(ValueError, match="pad_value"):
            batchkit.collate.pad(items, pad_value=pad_value)
    padded = batchkit.collate.pad([np.ones(2), np.ones(3)], pad_value=np.float32(-1))
    assert padded.batch.tolist() == [[1.0, 1.0, -1.0], [1.0, 1.0, 1.0]]
    assert batchkit.collate.pad([np.array([True]), np.array([False, True])], pad_value=False).batch.dtype == bool

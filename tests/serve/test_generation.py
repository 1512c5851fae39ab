"""Generation: a request's tokens kept once, in one list, with its text, logprobs, usage and
finish reason read from that list (no model: a scripted stream and a character decoder)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import pytest

pytest.importorskip("prometheus_client")  # batchkit.serve.metrics: the serve extra

from prometheus_client import CollectorRegistry

from batchkit.continuous.logprobs import TokenLogprobs
from batchkit.serve.admission import WaitingRoom
from batchkit.serve.generation import Generation, TokenIds
from batchkit.serve.metrics import ServerMetrics


def _decode(ids: Sequence[int]) -> str:
    return "".join(chr(ord("a") + t) for t in ids)


async def _stream(items: list[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


def _generation(
    items: list[Any],
    *,
    detailed: bool = False,
    max_tokens: int = 10,
    stop: Sequence[str] = (),
    decode: Callable[[Sequence[int]], str] = _decode,
    include_stop: bool = False,
) -> Generation:
    return Generation(
        _stream(items),
        route="completions",
        rid="cmpl-1",
        index=0,
        prompt_tokens=3,
        max_tokens=max_tokens,
        stop=stop,
        stop_token_ids=(25,),
        include_stop=include_stop,
        t_arrival=0.0,
        decode=decode,
        token_text=lambda item: (decode([item.token]), item.logprob, []),
        metrics=ServerMetrics(CollectorRegistry()),
        detailed=detailed,
    )


async def _read_all(gen: Generation) -> str:
    parts = []
    while (text := await gen.next_text()) is not None:
        parts.append(text)
    return "".join(parts) + gen.tail.finish()


def test_plain_tokens_live_in_one_list_that_the_detokenizer_reads() -> None:
    gen = _generation([0, 1, 2])
    assert anyio.run(_read_all, gen) == "abc"
    assert gen.output == [0, 1, 2]
    assert gen.tail.ids is gen.output
    assert (gen.completion_tokens, gen.finish_reason, gen.usage()["total_tokens"]) == (3, "stop", 6)


def test_detailed_tokens_are_kept_once_as_their_logprob_entries() -> None:
    """The detokenizer reads the ids through the TokenLogprobs list; logprobs are its unsent tail."""
    items = [TokenLogprobs(1, -0.5, (), prompt=True), TokenLogprobs(0, -1.0), TokenLogprobs(1, -2.0)]
    gen = _generation(items, detailed=True, max_tokens=2)

    async def main() -> None:
        assert await gen.next_text() == "a"
        assert gen.has_unsent_logprobs
        assert gen.take_logprobs() == [("a", -1.0, [])]
        assert not gen.has_unsent_logprobs
        assert await gen.next_text() == "b"
        assert gen.take_logprobs() == [("b", -2.0, [])]

    anyio.run(main)
    assert gen.output == items[1:]
    assert isinstance(gen.tail.ids, TokenIds)
    assert gen.tail.ids[0:2] == [0, 1]
    assert gen.prompt_entries() == [("b", -0.5, [])]
    assert gen.finish_reason == "length"


def test_a_stop_token_or_string_ends_with_stop() -> None:
    gen = _generation([0, 25])
    assert anyio.run(_read_all, gen) == "a"  # the stop token's text is left out, as vLLM's
    assert (gen.finish_reason, gen.completion_tokens) == ("stop", 2)
    gen = _generation([0, 1, 2, 3], stop=["c"])
    assert anyio.run(_read_all, gen) == "ab"
    assert gen.finish_reason == "stop"


def test_include_stop_keeps_the_stop_token_or_string_in_the_text() -> None:
    """vLLM's include_stop_str_in_output: the text ends after the stop string or stop token."""
    gen = _generation([0, 25], include_stop=True)
    assert anyio.run(_read_all, gen) == "az"
    gen = _generation([0, 1, 2, 3], stop=["bc", "c"], include_stop=True)
    assert anyio.run(_read_all, gen) == "abc"
    assert gen.finish_reason == "stop"


def test_a_stop_token_ends_the_text_held_back_before_it() -> None:
    """Text held back as a possible stop string's start is sent when a stop token ends the request."""
    gen = _generation([0, 1, 25], stop=["bcd"])
    assert anyio.run(_read_all, gen) == "ab"
    detailed = _generation([TokenLogprobs(0, -1.0), TokenLogprobs(25, -2.0)], detailed=True)
    assert anyio.run(_read_all, detailed) == "a"
    assert detailed.take_logprobs() == [("a", -1.0, []), ("z", -2.0, [])]  # the stop token's entry stays


PIECES = {0: "ab", 1: "c\n", 2: "\n", 3: "d", 4: "e"}


def _pieces(ids: Sequence[int]) -> str:
    return "".join(PIECES[t] for t in ids)


def _detailed(tokens: list[int]) -> list[TokenLogprobs]:
    return [TokenLogprobs(t, -float(i + 1)) for i, t in enumerate(tokens)]


async def _read_streamed(gen: Generation) -> list[tuple[str, list[str]]]:
    """Each piece of text with the logprob entries (their token strings) sent with it, as the
    server streams them: a chunk when either is non-empty."""
    chunks = []
    while (text := await gen.next_text()) is not None:
        if text or gen.has_unsent_logprobs:
            chunks.append((text, [t for t, _, _ in gen.take_logprobs()]))
    rest = gen.tail.finish()
    if rest or gen.has_unsent_logprobs:
        chunks.append((rest, [t for t, _, _ in gen.take_logprobs()]))
    return chunks


def test_with_a_stop_string_the_logprobs_are_those_of_the_text_before_it() -> None:
    """The tokens past the cut (the stop string's, "\n") have no logprob entry; the token the cut
    splits ("c\n": "c" returned) keeps its own, whole. Streamed or not, the same entries."""
    items = [0, 1, 2, 3]  # "ab" "c\n" "\n" "d", stop "\n\n": the text is "abc"
    gen = _generation(_detailed(items), detailed=True, stop=["\n\n"], decode=_pieces)
    assert anyio.run(_read_all, gen) == "abc"
    assert gen.take_logprobs() == [("ab", -1.0, []), ("c\n", -2.0, [])]
    assert (gen.completion_tokens, gen.finish_reason) == (3, "stop")  # usage counts every token generated
    gen = _generation(_detailed(items), detailed=True, stop=["\n\n"], decode=_pieces)
    assert anyio.run(_read_streamed, gen) == [("ab", ["ab"]), ("c", ["c\n"])]


def test_a_stop_string_at_the_start_leaves_no_logprobs() -> None:
    gen = _generation(_detailed([2, 2, 3]), detailed=True, stop=["\n\n"], decode=_pieces)
    assert anyio.run(_read_streamed, gen) == []
    assert gen.take_logprobs() == []


def test_a_streamed_tokens_logprobs_wait_while_its_text_may_begin_a_stop_string() -> None:
    """A token whose text is held back (it may begin the stop string) is sent with that text once
    it is released, never before; finished without a stop string, every entry is sent."""
    gen = _generation(_detailed([0, 2, 3, 2]), detailed=True, stop=["\n\n"], decode=_pieces)
    chunks = anyio.run(_read_streamed, gen)
    assert chunks == [("ab", ["ab"]), ("\nd", ["\n", "d"]), ("\n", ["\n"])]
    assert not gen.tail.stopped


def test_an_echo_alone_reads_the_first_token_only_for_the_prompt_logprobs() -> None:
    """max_tokens=0: the sampled token is not part of the answer."""
    items = [TokenLogprobs(1, -0.5, (), prompt=True), TokenLogprobs(0, -1.0)]
    gen = _generation(items, detailed=True, max_tokens=0)
    assert anyio.run(_read_all, gen) == ""
    assert (gen.output, gen.completion_tokens, len(gen.prompt_logprobs)) == ([], 0, 1)


def test_completion_logprobs_text_offsets_run_on_from_one_call_to_the_next() -> None:
    """A stream sends its logprobs chunk by chunk: each chunk's text_offset goes on from the
    token strings of the chunks before (the echoed prompt's first, a bare string, included)."""
    gen = _generation([], detailed=True)
    echoed = gen.completion_logprobs(["ab", ("c", -1.0, [])])
    first = gen.completion_logprobs([("de", -0.5, []), ("f", -0.1, [])])
    second = gen.completion_logprobs([("ghi", -0.2, [])])
    assert (echoed["text_offset"], first["text_offset"], second["text_offset"]) == ([0, 2], [3, 5], [6])
    assert gen.text_offset == 9


def test_its_waiting_places_are_given_back_at_its_first_read() -> None:
    """The loop queues a generation within its first read: its places are released then."""
    room = WaitingRoom(4)
    gen = _generation([0, 1])
    gen.places = room.take(1, 1, num_waiting=0)[0]

    async def main() -> None:
        assert room.num_held == 1
        assert await gen.next_text() == "a"
        assert room.num_held == 0
        assert await gen.next_text() == "b"
        await gen.close()

    anyio.run(main)
    assert room.num_held == 0


def test_its_waiting_places_are_given_back_when_it_is_closed_unread() -> None:
    """A generation dropped before its first read (a sibling failed) was never queued."""
    room = WaitingRoom(4)
    gen = _generation([0])
    gen.places = room.take(1, 1, num_waiting=0)[0]
    anyio.run(gen.close)
    assert room.num_held == 0

"""Matching a sent history against a stored one read a page at a time (`memory.record.history_match`).

The stored history was made into units again from its first turn with every page read, so
the work grew with the square of the history's length: a 3,000-turn history read in pages
of 16 to 512 turns had 11,016 turns made into units, where 3,000 is all there is.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from memory.events import TurnStatus
from memory.record.history_match import Unit, sent_units, shared_prefix


@dataclass
class Stored:
    """A stored turn that counts how often its text is read."""

    role: str
    seq: int
    text: str
    status: str = TurnStatus.COMPLETED
    reads: list[int] = field(default_factory=lambda: [0])

    @property
    def content(self) -> str:
        self.reads[0] += 1
        return self.text


@dataclass(frozen=True)
class Sent:
    role: str
    text: str
    index: int | None = None


async def doubling_pages(
    turns: Sequence[Stored], first: int = 16, most: int = 512
) -> AsyncIterator[list[Stored]]:
    """Oldest first, in pages that double in size, as the branch history is read."""
    start, size = 0, first
    while start < len(turns):
        yield list(turns[start : start + size])
        start, size = start + size, min(size * 2, most)


async def fixed_pages(turns: Sequence[Stored], size: int) -> AsyncIterator[list[Stored]]:
    for start in range(0, len(turns), size):
        yield list(turns[start : start + size])


def conversation(count: int) -> list[Stored]:
    reads = [0]
    return [
        Stored("user" if seq % 2 == 0 else "assistant", seq, f"message {seq}", reads=reads)
        for seq in range(count)
    ]


def as_sent(turns: Sequence[Stored]) -> list[Unit]:
    return sent_units([Sent(t.role, t.text) for t in turns])


async def test_a_long_stored_history_is_made_into_units_once_however_many_pages_it_comes_in() -> None:
    stored = conversation(3_000)
    sent = as_sent([*stored, Stored("user", 3_000, "a new message")])

    matched, units = await shared_prefix(sent, doubling_pages(stored))

    assert matched == len(units) == 3_000
    assert [u.text for u in units] == [f"message {seq}" for seq in range(3_000)]
    # Each stored turn's text read once (11,016 reads when every page made the history into units again).
    assert stored[0].reads[0] == 3_000


async def test_the_units_and_the_match_do_not_depend_on_where_the_pages_end() -> None:
    """Answers spread over several turns, cut short, empty, still streaming: the same units
    and the same count whichever page boundaries they fall across."""
    C, S = TurnStatus.COMPLETED, TurnStatus.STREAMING
    cut, failed = TurnStatus.INTERRUPTED_BY_USER, TurnStatus.FAILED
    shapes = [
        ("user", "hi", C),
        ("assistant", "", C),  # a tool step: no text
        ("tool", "result", C),
        ("assistant", "hello  there", C),
        ("user", "a question", C),
        ("assistant", "", failed),  # failed before any text: the question's unit keeps its seq
        ("user", "again", C),
        ("assistant", "the answer was cut", cut),
        ("user", "more", C),
        ("assistant", "one part", C),
        ("tool", "x", C),
        ("assistant", "and another", C),
        ("user", "last", C),
        ("assistant", "", S),
    ]
    stored = [Stored(role, seq, text, status) for seq, (role, text, status) in enumerate(shapes)]
    sent_histories = [
        [
            Sent("user", "hi"),
            Sent("assistant", "hello there"),
            Sent("user", "a question"),
            Sent("user", "again"),
            Sent("assistant", "the answer"),
            Sent("user", "more"),
            Sent("assistant", "one part"),
            Sent("assistant", "and another"),
            Sent("user", "last"),
            Sent("user", "new"),
        ],
        [Sent("user", "hi"), Sent("assistant", "hello there"), Sent("user", "an edit")],
        [
            Sent("user", "hi"),
            Sent("assistant", "hello there"),
            Sent("user", "a question"),
            Sent("user", "again"),
            Sent("assistant", "the answer was cut"),
            Sent("user", "more"),
            Sent("assistant", "other"),
        ],
        [Sent("user", "hi")],
    ]
    for messages in sent_histories:
        sent = sent_units(messages)
        whole = await shared_prefix(sent, fixed_pages(stored, len(stored)))
        for size in range(1, len(stored) + 1):
            matched, units = await shared_prefix(sent, fixed_pages(stored, size))
            # Reading stops early once a unit differs: the units read so far are the whole read's first ones.
            assert matched == whole[0], (size, messages)
            assert units == whole[1][: len(units)], size
            assert len(units) > matched or units == whole[1], size
        for a, b in itertools.pairwise(whole[1]):
            assert a.last_seq < b.last_seq

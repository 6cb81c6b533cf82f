"""Matching a history a client sends against a stored conversation's history.

Clients that own their history (OpenAI-compatible frontends) send it whole with every
request. Both sides are reduced to the same units, judged on what the user saw:

- a user message is one unit;
- everything the assistant said between two user messages is one unit: the text of
  every model step joined (tool calls and tool results are not compared: the server's
  own tool steps never reached the client);
- whitespace runs count as one space, and empty assistant units are left out.

A stored assistant unit that a stop (or an error) cut short is *open-ended*: the
client may send back a shorter text (what it had received when it stopped reading),
and it still matches as long as the stored text starts with it.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from anyio import to_thread

from memory.events import INTERRUPTED_STATUSES, TurnStatus


class StoredTurn(Protocol):
    """The fields of a stored turn the matcher reads."""

    @property
    def role(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def content(self) -> str: ...
    @property
    def seq(self) -> int: ...


class SentMessage(Protocol):
    """The fields of a client's message the matcher reads."""

    @property
    def role(self) -> str: ...
    @property
    def text(self) -> str: ...
    @property
    def index(self) -> int | None: ...


@dataclass(frozen=True, slots=True)
class Unit:
    """A user message, or all the assistant said before the next one."""

    role: str
    text: str
    open_ended: bool = False
    # Stored units: the newest seq the unit covers (a fork after it keeps turns up to here),
    # and the user turn itself.
    last_seq: int = 0
    turn: Any = None
    # Sent units: the text as the client wrote it (what an import stores), and the client's index
    # of the first message it was made of (what a refusal of it names).
    raw: str = ""
    index: int | None = None


def normalize(text: str) -> str:
    return " ".join(text.split())


class StoredUnits:
    """A stored history (oldest first) made into units as its turns come: each turn is read once,
    however many pages it comes in. Turns still streaming or failed count only as seqs."""

    def __init__(self) -> None:
        self._closed: list[Unit] = []  # units no later turn can change, empty answers left out
        self._open: Unit | None = None  # the newest unit: its answer may go on in the next turn

    def add(self, turns: Iterable[StoredTurn]) -> None:
        for turn in turns:
            if turn.role == "user" and turn.status == TurnStatus.COMPLETED:
                self._start(Unit("user", normalize(turn.content or ""), last_seq=turn.seq, turn=turn))
                continue
            visible = turn.role == "assistant" and (
                turn.status == TurnStatus.COMPLETED or turn.status in INTERRUPTED_STATUSES
            )
            text = (turn.content or "") if visible else ""
            last = self._open
            if last is not None and last.role == "assistant":
                self._open = replace(
                    last,
                    text=normalize(f"{last.text} {text}") if text else last.text,
                    open_ended=last.open_ended or (visible and turn.status in INTERRUPTED_STATUSES),
                    last_seq=turn.seq,
                )
            else:
                open_ended = visible and turn.status in INTERRUPTED_STATUSES
                self._start(Unit("assistant", normalize(text), open_ended=open_ended, last_seq=turn.seq))

    def _start(self, unit: Unit) -> None:
        if self._open is not None:
            _keep(self._closed, self._open)
        self._open = unit

    @property
    def final(self) -> list[Unit]:
        """The units no later turn can change: all but the newest."""
        return self.units[:-1]

    @property
    def units(self) -> list[Unit]:
        units = list(self._closed)
        if self._open is not None:
            _keep(units, self._open)
        return units


def sent_units(messages: Iterable[SentMessage]) -> list[Unit]:
    """A client's messages (user, assistant, tool; no system) as units."""
    units: list[Unit] = []
    for message in messages:
        if message.role == "user":
            units.append(Unit("user", normalize(message.text), raw=message.text, index=message.index))
        elif message.role == "assistant":
            if units and units[-1].role == "assistant":
                last = units[-1]
                raw = (
                    f"{last.raw}\n\n{message.text}" if last.raw and message.text else last.raw or message.text
                )
                units[-1] = replace(last, text=normalize(f"{last.text} {message.text}"), raw=raw)
            else:
                units.append(
                    Unit("assistant", normalize(message.text), raw=message.text, index=message.index)
                )
    return _without_empty_answers(units)


def _without_empty_answers(units: list[Unit]) -> list[Unit]:
    kept: list[Unit] = []
    for unit in units:
        _keep(kept, unit)
    return kept


def _keep(kept: list[Unit], unit: Unit) -> None:
    """Add a unit to those kept; an empty answer is left out."""
    if unit.role == "assistant" and not unit.text:
        if kept:  # a fork after the previous unit must still keep this one's turns
            kept[-1] = replace(kept[-1], last_seq=max(kept[-1].last_seq, unit.last_seq))
        return
    kept.append(unit)


def same(sent: Unit, stored: Unit) -> bool:
    """Whether a sent unit is the stored one (a cut-short answer may come back shorter)."""
    if sent.role != stored.role:
        return False
    if sent.text == stored.text:
        return True
    return stored.open_ended and stored.text.startswith(sent.text)


def matched_prefix(sent: Sequence[Unit], stored: Sequence[Unit]) -> int:
    """How many leading units the two histories share."""
    count = 0
    for a, b in zip(sent, stored, strict=False):
        if not same(a, b):
            break
        count += 1
    return count


async def shared_prefix(
    sent: Sequence[Unit], pages: AsyncIterable[Sequence[StoredTurn]]
) -> tuple[int, list[Unit]]:
    """`matched_prefix` of the sent units and a stored history read oldest first a page at a
    time, and the stored units read (all of them when the history ends within what matches).

    Reading stops at the first stored unit that differs, or once the stored history is
    longer than the sent one: the rest can change neither the count nor the units before
    it. A unit is final once the next one has begun, so only those are compared early.

    Each page is made into units and compared in a worker thread: a history of megabytes
    takes the CPU for a good part of a second, which on the event loop would freeze every
    other stream of the process.
    """
    built = StoredUnits()
    matched = 0

    def compare(page: Sequence[StoredTurn]) -> list[Unit]:
        nonlocal matched
        built.add(page)
        final = built.final
        # The units compared already are final: only the new ones need comparing.
        matched += matched_prefix(sent[matched:], final[matched:])
        return final

    async for page in pages:
        final = await to_thread.run_sync(compare, page)
        if matched < len(final):
            return matched, final
    units = built.units
    return matched + matched_prefix(sent[matched:], units[matched:]), units

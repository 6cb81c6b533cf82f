"""The context builder: persisted turns in, a prompt the OpenAI chat API accepts out.

Everything a turn received is stored byte for byte (partial tool-call arguments,
interrupted text, results of calls whose turn later failed); the model sees again only
what is complete and consistent:

- `streaming` and `failed` turns never appear, nor turns of unknown roles;
- an interrupted turn (`interrupted_by_user`, `interrupted_by_error`) contributes its
  visible text only, never its tool calls, except a call cut off while its tool ran whose
  side effect may have happened: that call appears with a result saying so
  (`tool_result_interrupted`), so the model neither runs it again unaware nor claims it
  ran; with `interrupted_policy="drop_turn"` it contributes nothing;
- a tool call appears only with arguments that parse as a JSON object, a state past
  `streaming`, and a later completed tool turn answering its id; that result is placed
  right after the call, in call order, whatever turns came between in storage;
- a tool turn whose call does not appear is dropped, and so is every empty message;
- tool results longer than `tool_result_max_chars` are cut, with a note saying how much
  was left out (the stored turn, and the display history, keep them whole).

The window is chosen newest first in *units*: a user message, an assistant text, or an
assistant message with tool calls plus its results (never split). Walking backwards
means a call's results are already known when the call is reached, and the walk stops
as soon as the window is full, so the cost depends on the window, not on the length of
the conversation. The current exchange (from the newest user message to the end, which
includes the tool steps of the reply being generated) is kept even over the token
budget; older units are added while they fit both `max_turns` and the token budget.

The builder is pure: it takes `TurnView`s, not ORM rows, and touches no database;
`read_window` is the one read that feeds it.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from sqlalchemy import text as sql_text

from memory.events import INTERRUPTED_STATUSES, ToolCallState, TurnStatus
from memory.prompt.templates import PromptSet
from memory.prompt.tokens import count_tokens
from memory.recall.remembering import FORGOTTEN
from memory.recall.sentence_keys import sentences
from memory.record.turns import recent_turn_rows

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

    from memory.config import Settings
    from memory.storage.db import Database
    from memory.storage.models import Turn

# OpenAI bills a few tokens of framing per message and primes the reply with three.
MESSAGE_OVERHEAD_TOKENS = 4
REPLY_PRIMING_TOKENS = 3

# What the OpenAI API accepts as a function name.
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_KNOWN_STATUSES = frozenset({TurnStatus.COMPLETED, TurnStatus.AWAITING_APPROVAL}) | INTERRUPTED_STATUSES

InterruptedPolicy = Literal["keep_text", "drop_turn"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnView:
    """The fields of a persisted turn the builder reads, detached from the session."""

    role: str
    status: str
    content: str = ""
    tool_calls: tuple[Mapping[str, Any], ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    seq: int = 0
    id: Any = None
    created_at: datetime | None = None
    conversation_id: Any = None
    # User turns: images and files sent with the message ({"type": "image", "url"} or
    # {"type": "file", "filename", "data" | "url"}), given to the model as content parts.
    attachments: tuple[Mapping[str, Any], ...] = ()
    prompt_part: Mapping[str, Any] | None = None  # a reply's first turn: what its prompt showed

    @classmethod
    def from_row(cls, turn: Turn) -> TurnView:
        """A view of an ORM `Turn` (copies what it reads, so the session may close)."""
        calls = turn.tool_calls if isinstance(turn.tool_calls, list) else []
        return cls(
            role=turn.role,
            status=turn.status,
            content=turn.content or "",
            tool_calls=tuple(dict(call) for call in calls if isinstance(call, Mapping)),
            tool_call_id=turn.tool_call_id,
            name=turn.name,
            seq=turn.seq,
            id=turn.id,
            created_at=turn.created_at,
            conversation_id=turn.conversation_id,
            attachments=_attachments(turn.meta),
            prompt_part=turn.prompt_part if isinstance(turn.prompt_part, Mapping) else None,
        )


def _attachments(meta: object) -> tuple[Mapping[str, Any], ...]:
    found = meta.get("attachments") if isinstance(meta, Mapping) else None
    return tuple(a for a in found if isinstance(a, Mapping)) if isinstance(found, list) else ()


def _content_parts(text: str, attachments: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A user message's text and attachments as OpenAI chat content parts."""
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    for item in attachments:
        if item.get("type") == "image":
            parts.append(
                {
                    "type": "image_url",
                    "image_url": {"url": item.get("url"), "detail": item.get("detail", "auto")},
                }
            )
        elif item.get("type") == "file":
            file: dict[str, Any] = {"filename": item.get("filename") or "file"}
            if item.get("data"):
                file["file_data"] = item.get("data")
            else:
                file["file_url"] = item.get("url")
            parts.append({"type": "file", "file": file})
    return parts


@dataclass(frozen=True, slots=True)
class ContextBudget:
    """How much history goes into a prompt, and how it is shaped."""

    max_turns: int = 10
    max_tokens: int = 6000
    reply_reserve: int = 1024
    memory_reserve: int = 800
    # Of the memory reserve, what a conversation's first reply may give its standing memories.
    standing_tokens: int = 0
    tool_result_max_chars: int = 4000
    interrupted_policy: InterruptedPolicy = "keep_text"

    def __post_init__(self) -> None:
        if self.interrupted_policy not in ("keep_text", "drop_turn"):
            raise ValueError(
                f"interrupted_policy must be keep_text or drop_turn, not {self.interrupted_policy!r}"
            )
        if self.max_turns < 1 or self.tool_result_max_chars < 1:
            raise ValueError("max_turns and tool_result_max_chars must be positive")

    @property
    def prompt_room(self) -> int:
        """The tokens a prompt may take: CONTEXT_MAX_TOKENS less the reply's reserve."""
        return self.max_tokens - self.reply_reserve

    @property
    def rows_to_read(self) -> int:
        """Enough stored turns that the window (counted in tool-call groups) can fill after sanitizing."""
        return self.max_turns * 4 + 20

    @classmethod
    def from_settings(cls, settings: Settings) -> ContextBudget:
        """The budget the settings describe."""
        return cls(
            max_turns=settings.context_max_turns,
            max_tokens=settings.context_max_tokens,
            reply_reserve=settings.reply_reserve_tokens,
            memory_reserve=settings.memory_reserve_tokens,
            standing_tokens=settings.memory_standing_tokens,
            tool_result_max_chars=settings.tool_result_max_chars,
            interrupted_policy=settings.interrupted_policy,
        )


class PromptMemory(Protocol):
    """One recalled memory as the memory block shows it (``memory.recall.found.FoundMemory`` is one)."""

    @property
    def text(self) -> str: ...
    @property
    def created_at(self) -> datetime: ...
    @property
    def conversation_id(self) -> Any: ...
    @property
    def conversation_title(self) -> str | None: ...
    @property
    def role(self) -> str: ...
    @property
    def score(self) -> float: ...


M = TypeVar("M", bound=PromptMemory)


@dataclass(frozen=True, slots=True)
class ShownMemory:
    """A memory as a reply's prompt showed it, kept to show it again with that message."""

    turn_id: Any
    chunk_index: int
    text: str
    created_at: datetime
    conversation_id: Any
    conversation_title: str | None
    role: str
    score: float
    indexed: bool = True
    # What the block showed of it, when only its best sentences (memory.recall.excerpts).
    excerpt: str | None = None
    # Shown in the conversation's standing block (memory.recall.standing), not recalled for the reply.
    standing: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (str(self.turn_id), self.chunk_index)

    def to_json(self) -> dict[str, Any]:
        return {
            "turn_id": str(self.turn_id),
            "chunk_index": self.chunk_index,
            "text": self.text,
            "created_at": self.created_at.isoformat(),
            "conversation_id": str(self.conversation_id) if self.conversation_id else None,
            "conversation_title": self.conversation_title,
            "role": self.role,
            "score": self.score,
            "indexed": self.indexed,
            **({"excerpt": self.excerpt} if self.excerpt is not None else {}),
            **({"standing": True} if self.standing else {}),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ShownMemory:
        return cls(
            turn_id=data["turn_id"],
            chunk_index=int(data.get("chunk_index") or 0),
            text=str(data["text"]),
            created_at=datetime.fromisoformat(data["created_at"]),
            conversation_id=data.get("conversation_id"),
            conversation_title=data.get("conversation_title"),
            role=str(data.get("role") or "user"),
            score=float(data.get("score") or 0.0),
            indexed=bool(data.get("indexed", True)),
            excerpt=data["excerpt"] if isinstance(data.get("excerpt"), str) else None,
            standing=data.get("standing") is True,
        )

    @classmethod
    def of(cls, memory: PromptMemory, *, standing: bool = False) -> ShownMemory:
        return cls(
            turn_id=getattr(memory, "turn_id", None),
            chunk_index=int(getattr(memory, "chunk_index", 0) or 0),
            text=memory.text,
            created_at=memory.created_at,
            conversation_id=memory.conversation_id,
            conversation_title=memory.conversation_title,
            role=memory.role,
            score=memory.score,
            indexed=bool(getattr(memory, "indexed", True)),
            excerpt=getattr(memory, "excerpt", None),
            standing=standing,
        )


@dataclass(frozen=True, slots=True)
class ShownPart:
    """What a reply's prompt showed before its user's words: the time it said, and the memories."""

    now: str
    memories: tuple[ShownMemory, ...]
    # The user message the reply answers: forgetting it also forgets the replies that were shown
    # it (memory/recall/forgetting.py), a regenerated answer included.
    asked: str | None = None

    def to_json(self) -> dict[str, Any]:
        shown = {"now": self.now, "memories": [m.to_json() for m in self.memories]}
        return shown | ({"asked": self.asked} if self.asked is not None else {})

    @classmethod
    def stored(cls, data: Mapping[str, Any] | None) -> ShownPart | None:
        """The part stored on a reply's first assistant turn, or None (none stored, or unreadable)."""
        if not isinstance(data, Mapping):
            return None
        try:
            memories = tuple(ShownMemory.from_json(m) for m in data.get("memories") or ())
            asked = data.get("asked")
            return cls(str(data["now"]), memories, asked if isinstance(asked, str) else None)
        except (KeyError, TypeError, ValueError):
            return None


def _shown_memories(turns: Sequence[TurnView]) -> list[ShownMemory]:
    """Every memory a stored part among `turns` showed (to check which still exist)."""
    shown: list[ShownMemory] = []
    for turn in turns:
        part = ShownPart.stored(turn.prompt_part) if turn.role == "assistant" else None
        if part is not None:
            shown.extend(part.memories)
    return shown


@dataclass(slots=True)
class BuiltContext:
    """A prompt ready for the provider, and what went into it."""

    messages: list[dict[str, Any]]
    # Turns represented in `messages`, oldest first: retrieval need not find them again.
    window_turn_ids: list[Any]
    prompt_version: str
    token_count: int
    # Why things were left out, by reason (for logs and debugging).
    dropped: dict[str, int] = field(default_factory=dict)
    # The memories that made it into the prompt, best first.
    memory_used: list[PromptMemory] = field(default_factory=list)
    # The reply's part as this prompt showed it, when it was made now (not replayed): stored
    # with the reply so that later prompts show the same text with its message.
    new_part: ShownPart | None = None


@dataclass(slots=True)
class _Unit:
    messages: list[dict[str, Any]]
    turn_ids: list[Any]
    tokens: int
    is_user: bool = False
    part: str | None = None  # a user unit's replayed part (memories and time), shown before its words
    shown: tuple[ShownMemory, ...] = ()


def _message_tokens(content: str | None) -> int:
    return MESSAGE_OVERHEAD_TOKENS + (count_tokens(content) if content else 0)


def _system_tokens(prompts: PromptSet, instructions: str | None) -> int:
    """The system message: chatmem's prompt, then the client's instructions after a blank line."""
    tokens = _message_tokens(prompts.render("system"))
    return tokens + count_tokens(instructions) + 1 if instructions else tokens


def _time_tokens(prompts: PromptSet, now: datetime) -> int:
    """The current time before the user's words: the reply's part when no memory is shown."""
    return count_tokens(prompts.render("current_time", now=_spoken_time(now))) + 1


def fixed_tokens(prompts: PromptSet, instructions: str | None, user_text: str | None, now: datetime) -> int:
    """What a reply's prompt spends whatever history and memory it gets: the system message (with the
    client's instructions), the time part and the new user message (none for tool results).

    The window (`build_window`) counts the same: history gets what is left of `prompt_room` after
    this and the memory reserve, and the memory block what is left after the history. A request
    whose fixed part exceeds `ContextBudget.prompt_room` cannot be answered within the budget.
    """
    user = _message_tokens(user_text) if user_text else 0
    return _system_tokens(prompts, instructions) + _time_tokens(prompts, now) + user


def _parse_arguments(raw: Any, state: Any) -> str | None:
    """The arguments string to send again, or None when they are not a complete JSON object."""
    if not isinstance(raw, str):
        return None
    if not raw.strip():
        # Models send no arguments at all for parameterless tools; a finished call means "{}".
        return "{}" if state != ToolCallState.STREAMING else None
    try:
        parsed = json.loads(raw)
    except ValueError:
        return None
    return raw if isinstance(parsed, dict) else None


def _tool_content(text: str, prompts: PromptSet, max_chars: int) -> str:
    if not text.strip():
        return prompts.render("tool_result_empty")
    if len(text) <= max_chars:
        return text
    note = prompts.render(
        "tool_result_truncated",
        kept_chars=max_chars,
        total_chars=len(text),
        omitted_chars=len(text) - max_chars,
    )
    return f"{text[:max_chars]}\n{note}"


def _unique_id(call_id: str, seq: int, emitted: set[str], dropped: Counter[str]) -> str:
    """`call_id`, or a new id if a newer call in the window has it already.

    Some servers (Ollama, llama.cpp) number calls afresh in every step, so ids repeat
    within a conversation; the API refuses a prompt in which two calls share an id.
    """
    unique = call_id
    if unique in emitted:
        dropped["tool_call_id_renamed"] += 1
        unique = f"{call_id}_{seq}"
        while unique in emitted:
            unique += "_"
    emitted.add(unique)
    return unique


def _assistant_unit(
    turn: TurnView,
    pending: dict[str, TurnView],
    emitted: set[str],
    prompts: PromptSet,
    budget: ContextBudget,
    dropped: Counter[str],
) -> _Unit | None:
    text = turn.content or ""
    calls: list[dict[str, Any]] = []
    results: list[TurnView] = []
    # Calls cut off while their tool ran, whose side effect may have happened: the model is told so.
    uncertain: list[dict[str, Any]] = []
    if turn.status in INTERRUPTED_STATUSES:
        for call in turn.tool_calls:
            call_id, name = call.get("id"), call.get("name")
            arguments = _parse_arguments(call.get("arguments"), call.get("state"))
            if (
                call.get("side_effect_may_have_happened") is True
                and call.get("state") == ToolCallState.CANCELLED
                and isinstance(call_id, str)
                and call_id
                and isinstance(name, str)
                and _TOOL_NAME.match(name)
                and arguments is not None
            ):
                uncertain.append(
                    {
                        "id": _unique_id(call_id, turn.seq, emitted, dropped),
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }
                )
            else:
                dropped["tool_call_of_interrupted_turn"] += 1
    else:
        for call in turn.tool_calls:
            call_id, name = call.get("id"), call.get("name")
            state = call.get("state")
            if not (
                isinstance(call_id, str) and call_id and isinstance(name, str) and _TOOL_NAME.match(name)
            ):
                dropped["tool_call_malformed"] += 1
                continue
            arguments = _parse_arguments(call.get("arguments"), state)
            if arguments is None or state == ToolCallState.STREAMING:
                dropped["tool_call_incomplete"] += 1
                continue
            # A result answers the nearest call before it with its id, and only that one.
            result = pending.pop(call_id, None)
            if result is None:
                dropped["tool_call_unanswered"] += 1
                continue
            calls.append(
                {
                    "id": _unique_id(call_id, turn.seq, emitted, dropped),
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
            results.append(result)
    has_text = bool(text.strip())
    if uncertain:
        note = prompts.render("tool_result_interrupted")
        unit_messages = [
            {"role": "assistant", "content": text if has_text else None, "tool_calls": uncertain}
        ]
        unit_tokens = _message_tokens(text if has_text else None)
        for call in uncertain:
            unit_tokens += count_tokens(call["function"]["name"]) + count_tokens(
                call["function"]["arguments"]
            )
            unit_messages.append({"role": "tool", "tool_call_id": call["id"], "content": note})
            unit_tokens += _message_tokens(note)
        return _Unit(unit_messages, [turn.id], unit_tokens)
    if not calls:
        if not has_text:
            dropped["empty_message"] += 1
            return None
        return _Unit([{"role": "assistant", "content": text}], [turn.id], _message_tokens(text))

    messages: list[dict[str, Any]] = [
        {"role": "assistant", "content": text if has_text else None, "tool_calls": calls}
    ]
    tokens = _message_tokens(text if has_text else None)
    for call in calls:
        tokens += count_tokens(call["function"]["name"]) + count_tokens(call["function"]["arguments"])
    for call, result in zip(calls, results, strict=True):
        content = _tool_content(result.content or "", prompts, budget.tool_result_max_chars)
        if len(result.content or "") > budget.tool_result_max_chars:
            dropped["tool_result_truncated"] += 1
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
        tokens += _message_tokens(content)
    return _Unit(messages, [turn.id, *(result.id for result in results)], tokens)


def _select_window(
    turns: Sequence[TurnView],
    prompts: PromptSet,
    budget: ContextBudget,
    token_budget: int,
    dropped: Counter[str],
    alive: Collection[tuple[str, int]] | None,
) -> tuple[list[_Unit], int]:
    """Units newest first, and their tokens.

    Once the conversation is longer than the window, its start is sticky: it may begin only at
    a turn whose `seq` is at or past a boundary that moves in steps of half the window
    (`_sticky_start`), so the history in front of the newest turns stays the same prompt prefix
    for several replies and a model server reads it from its cache, instead of re-reading the
    whole history after every reply because the oldest unit slid out.
    """
    units: list[_Unit] = []
    first_seqs: list[int] = []  # each unit's first turn
    current = 0  # units of the current exchange (the latest user message and what follows it)
    used = 0
    in_current_exchange = True
    # Completed tool results newer than the walk's position, by the call id they answer.
    pending: dict[str, TurnView] = {}
    # Call ids already in the window (newer), which no older call or result may reuse.
    emitted: set[str] = set()
    position = len(turns)
    while position > 0 and len(units) < budget.max_turns:
        turn = turns[position - 1]
        status = turn.status
        if status not in _KNOWN_STATUSES:
            dropped[f"{status}_turn"] += 1
            position -= 1
            continue
        unit: _Unit | None = None
        if turn.role == "tool":
            if status != TurnStatus.COMPLETED or not turn.tool_call_id:
                dropped["tool_result_unusable"] += 1
            elif turn.tool_call_id in pending:
                # Two results for one call: the newer one answers it.
                dropped["tool_result_duplicate"] += 1
            else:
                pending[turn.tool_call_id] = turn
        elif status in INTERRUPTED_STATUSES and budget.interrupted_policy == "drop_turn":
            dropped["interrupted_turn"] += 1
        elif turn.role == "assistant":
            unit = _assistant_unit(turn, pending, emitted, prompts, budget, dropped)
        elif turn.role == "user":
            text = turn.content or ""
            if turn.attachments:
                content = _content_parts(text, turn.attachments)
                unit = _Unit([{"role": "user", "content": content}], [turn.id], _message_tokens(text), True)
            elif text.strip():
                unit = _Unit([{"role": "user", "content": text}], [turn.id], _message_tokens(text), True)
            else:
                dropped["empty_message"] += 1
            answer = turns[position] if position < len(turns) else None
            if unit is not None and answer is not None and answer.role == "assistant":
                if answer.status in _KNOWN_STATUSES:
                    shown = ShownPart.stored(answer.prompt_part)
                    _replay_part(unit, shown, prompts, budget, alive, dropped, turn.conversation_id)
        else:
            dropped["unknown_role"] += 1
        if unit is not None:
            if not in_current_exchange and used + unit.tokens > token_budget:
                dropped["over_token_budget"] += 1
                break
            units.append(unit)
            first_seqs.append(turn.seq)
            used += unit.tokens
            current += in_current_exchange
            in_current_exchange = in_current_exchange and not unit.is_user
        position -= 1
    if pending:
        dropped["tool_result_orphaned"] += len(pending)
    if position > 0:
        dropped["older_turns_outside_window"] += position
        kept = _sticky_start(first_seqs, current, budget.max_turns)
        for unit in units[kept:]:
            dropped["older_turns_outside_window"] += len(unit.turn_ids)
            used -= unit.tokens
        del units[kept:]
    return units, used


def _sticky_start(first_seqs: Sequence[int], current: int, max_turns: int) -> int:
    """How many of the units (newest first) a cut window keeps: those from the first boundary
    (a multiple of half the window, in turns) at or after the oldest unit that fitted, but
    never fewer than half the window nor the current exchange. A pure function of the stored
    turns, so consecutive replies agree on the start without any state: it moves once per
    half window. (A window the token budget holds to fewer units keeps them all.)"""
    step = max(1, max_turns // 2)
    boundary = -(-first_seqs[-1] // step) * step  # the oldest fitting unit's seq, rounded up
    kept = len(first_seqs)
    while kept > max(current, step) and first_seqs[kept - 1] < boundary:
        kept -= 1
    return kept


def _replay_part(
    unit: _Unit,
    part: ShownPart | None,
    prompts: PromptSet,
    budget: ContextBudget,
    alive: Collection[tuple[str, int]] | None,
    dropped: Counter[str],
    conversation: Any,
) -> None:
    """Show a user message again with the part its reply was given, minus memories gone since.

    A memory forgotten, corrected, expired or deleted with its conversation since it was
    shown is left out (`alive`: the memories that still exist; None: all of them), so a
    replayed block never brings a forgotten fact back; that changes the prompt's prefix once.
    """
    if part is None:
        return
    kept = tuple(m for m in part.memories if alive is None or m.key in alive)
    if len(kept) < len(part.memories):
        dropped["memory_gone_since_shown"] += len(part.memories) - len(kept)
    standing = [m for m in kept if m.standing]
    standing_text, standing_used = _standing_block(standing, prompts, budget.memory_reserve, dropped)
    room = budget.memory_reserve - _part_tokens(standing_text)
    recalled = [m for m in kept if not m.standing]
    text, used = _memory_block(recalled, prompts, room, conversation, dropped, part.now)
    unit.part = _part_text(standing_text, text or prompts.render("current_time", now=part.now))
    unit.shown = tuple(m for m in kept if m in standing_used or m in used)
    unit.tokens += count_tokens(unit.part) + 1


def _part_tokens(text: str | None) -> int:
    return count_tokens(text) + 1 if text else 0


def _part_text(standing: str | None, part: str) -> str:
    """A reply's part: the standing block, if the conversation's first reply got one, then the time
    and the recalled memories."""
    return f"{standing}\n\n{part}" if standing else part


def _standing_block(
    memory: Sequence[PromptMemory], prompts: PromptSet, room: int, dropped: Counter[str]
) -> tuple[str | None, list[PromptMemory]]:
    """The standing block (memory.recall.standing) within `room` tokens, and the items in it.

    `memory` is oldest first, as the block shows it; the newest that fit are kept, so a later
    statement that corrects an earlier one is the one left when not both fit.
    """
    if not memory or room <= 0:
        return None, []
    used = count_tokens(prompts.render("standing_block", items=""))
    lines: list[str] = []
    kept: list[PromptMemory] = []
    for item in reversed(memory):
        text = " ".join(item.text.split())
        # A sentence a line, short ones too ("I live in Leeds."): a small model finds one fact
        # among lines better than in a paragraph.
        line = "\n".join(prompts.render("standing_item", text=s) for s in sentences(text, min_chars=0))
        tokens = count_tokens(line) + 1
        if not text or used + tokens > room:
            dropped["standing_over_budget" if text else "memory_empty"] += 1
            continue
        lines.append(line)
        kept.append(item)
        used += tokens
    if not lines:
        return None, []
    return prompts.render("standing_block", items="\n".join(reversed(lines))), kept[::-1]


def standing_that_fits(memory: Sequence[M], prompts: PromptSet, budget: ContextBudget) -> list[M]:
    """Of `memory` (oldest first), what a standing block of the budget's size shows."""
    shown = {id(m) for m in _standing_block(memory, prompts, budget.standing_tokens, Counter())[1]}
    return [m for m in memory if id(m) in shown]


def _memory_block(
    memory: Sequence[PromptMemory],
    prompts: PromptSet,
    reserve: int,
    current_conversation: Any,
    dropped: Counter[str],
    now: str,
) -> tuple[str | None, list[PromptMemory]]:
    """The memory block within `reserve` tokens (best-scored items first), and the items in it.

    A memory from the block's own day (`now`, as the block says it) is dated "today": the
    block's time line already says the date, and an ISO date costs a small model's tokenizer
    about ten tokens (a digit each) on every line. Other memories keep their ISO date.
    """
    if not memory:
        return None, []
    today = _spoken_day(now)
    today_word = prompts.render("memory_today")
    roles = {
        "user": prompts.render("memory_role_user"),
        "assistant": prompts.render("memory_role_assistant"),
        "tool": prompts.render("memory_role_tool"),
    }
    used = count_tokens(prompts.render("memory_block", items="", now=now))
    lines: list[str] = []
    kept: list[PromptMemory] = []
    for item in sorted(memory, key=lambda item: item.score, reverse=True):
        # Its best sentences when recall chose them (memory.recall.excerpts), else all of it.
        text = _shown_text(item)
        if not text:
            dropped["memory_empty"] += 1
            continue
        # The title on its memory's line too: a title's own line breaks made lines of their own,
        # which could pass for the block's end.
        title = " ".join((item.conversation_title or "").split())
        if current_conversation is not None and item.conversation_id == current_conversation:
            conversation = prompts.render("memory_this_conversation")
        elif title:
            conversation = prompts.render("memory_conversation", title=title)
        else:
            conversation = prompts.render("memory_untitled_conversation")
        line = prompts.render(
            "memory_item",
            date=today_word if item.created_at.date() == today else item.created_at.date().isoformat(),
            conversation=conversation,
            role=roles.get(item.role, roles["assistant"]),
            text=text,
        )
        tokens = count_tokens(line) + 1
        if used + tokens > reserve:
            dropped["memory_over_budget"] += 1
            continue
        lines.append(line)
        kept.append(item)
        used += tokens
    if not lines:
        return None, []
    return prompts.render("memory_block", items="\n".join(lines), now=now), kept


@dataclass(frozen=True, slots=True)
class PromptWindow:
    """The sanitized recent window of a conversation, chosen once; memory is added per prompt.

    Recall reads it (the rewriter's history, the turns retrieval must not return again)
    and the reply's first model step is built from it: one read and one build per reply.
    """

    messages: list[dict[str, Any]]  # oldest first, without the system message; users' own words
    turn_ids: list[Any]  # the turns represented in `messages`, oldest first
    tokens: int  # replayed parts included
    dropped: dict[str, int]
    current_conversation: Any
    now: datetime
    # The parts earlier replies were given, by the index (in `messages`) of their user message.
    parts: dict[int, str] = field(default_factory=dict)
    # What those parts show of each memory (turn id -> the texts shown): a new block does not
    # show it again, unless it is another excerpt of it (memory.recall.excerpts).
    shown_texts: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # The conversation's "use memory in this chat" switch, read with the turns.
    use_memory: bool = True
    # The turn id of the window's latest user message (the one the reply answers).
    asked: Any = None
    # The tokens the new memory block may take: the memory reserve, or what the window left of it.
    part_room: int = 0

    @property
    def opens_conversation(self) -> bool:
        """The reply answers the window's only user message, and no earlier reply's part is shown:
        the conversation's first reply (or one whose current exchange fills the window), which
        is given the standing block (memory.recall.standing)."""
        return not self.parts and sum(1 for m in self.messages if m.get("role") == "user") == 1


def build_window(
    turns: Sequence[TurnView],
    *,
    prompts: PromptSet,
    budget: ContextBudget,
    now: datetime | None = None,
    alive: Collection[tuple[str, int]] | None = None,
    use_memory: bool = True,
    instructions: str | None = None,
) -> PromptWindow:
    """The recent window the next prompt shows, within what the budget leaves after system and memory.

    `alive`: the (turn id, chunk) of the stored parts' memories that still exist (None: all).
    `instructions`: the client's, which go into the system message (the history gets less).
    """
    now = now or datetime.now(UTC)
    dropped: Counter[str] = Counter()
    system_tokens = _system_tokens(prompts, instructions)
    # The reply's part is held to memory_reserve, or is the time alone when no memory is shown.
    time_tokens = _time_tokens(prompts, now)
    token_budget = budget.prompt_room - budget.memory_reserve - system_tokens - time_tokens
    units, window_tokens = _select_window(turns, prompts, budget, token_budget, dropped, alive)
    # The memory block gets less than its reserve only when the current exchange alone ate into it.
    part_room = max(0, min(budget.memory_reserve, budget.prompt_room - system_tokens - window_tokens))
    messages: list[dict[str, Any]] = []
    turn_ids: list[Any] = []
    parts: dict[int, str] = {}
    shown: dict[str, set[str]] = {}
    for unit in reversed(units):
        if unit.part is not None:
            parts[len(messages)] = unit.part
            for m in unit.shown:
                shown.setdefault(str(m.turn_id), set()).add(_shown_text(m))
        messages.extend(unit.messages)
        turn_ids.extend(unit.turn_ids)
    current_conversation = turns[-1].conversation_id if turns else None
    return PromptWindow(
        messages,
        turn_ids,
        window_tokens,
        dict(dropped),
        current_conversation,
        now,
        parts,
        {turn: frozenset(texts) for turn, texts in shown.items()},
        use_memory,
        next((unit.turn_ids[0] for unit in units if unit.is_user), None),
        part_room,
    )


def _shown_text(memory: PromptMemory | ShownMemory) -> str:
    """What a block shows of a memory: its excerpt if it has one, else its text (spacing normalised)."""
    return " ".join((getattr(memory, "excerpt", None) or memory.text).split())


def _memory_key(memory: PromptMemory) -> tuple[str, int]:
    return (str(getattr(memory, "turn_id", None)), int(getattr(memory, "chunk_index", 0) or 0))


def _already_shown(memory: PromptMemory, shown: Mapping[str, frozenset[str]]) -> bool:
    """An earlier message of the window shows this memory, or the part of it this block would show."""
    texts = shown.get(str(getattr(memory, "turn_id", None)))
    if not texts:
        return False
    text = _shown_text(memory)
    return any(text in earlier for earlier in texts)


# Which memories shown by stored parts still exist (in a live conversation that is remembered,
# or none): an indexed one while its memory row is
# there with the same text (not forgotten, corrected, expired or deleted); one shown before
# it was indexed, once its row is there, while that row is neither gone nor corrected (the part
# holds the old text), and until then while its turn is there and not forgotten (nor a reply
# shown a memory forgotten since: memory/recall/forgetting.py).
_LIVE_SHOWN = """
    SELECT s.turn_id::text AS turn_id, s.chunk_index
    FROM unnest(CAST(:turn_ids AS uuid[]), CAST(:chunks AS int[]), CAST(:texts AS text[]),
                CAST(:indexed AS boolean[])) AS s(turn_id, chunk_index, text, indexed)
    WHERE EXISTS (
        SELECT 1 FROM memory_items m LEFT JOIN conversations c ON c.id = m.conversation_id
        WHERE m.turn_id = s.turn_id AND m.kind = 'chunk' AND m.chunk_index = s.chunk_index
          AND m.deleted_at IS NULL
          AND (m.text = s.text OR (NOT s.indexed AND m.edited_at IS NULL))
          AND (m.conversation_id IS NULL OR (c.deleted_at IS NULL AND c.memory_mode <> 'none'))
    ) OR (NOT s.indexed AND NOT EXISTS (
        SELECT 1 FROM memory_items m
        WHERE m.turn_id = s.turn_id AND m.kind = 'chunk' AND m.chunk_index = s.chunk_index
    ) AND EXISTS (
        SELECT 1 FROM turns t JOIN conversations c ON c.id = t.conversation_id
        WHERE t.id = s.turn_id AND t.deleted_at IS NULL AND c.deleted_at IS NULL
          AND c.memory_mode <> 'none'
          AND t.seq > c.memory_forgotten_seq AND t.memory_use IS DISTINCT FROM :forgotten
    ))
"""
LIVE_SHOWN_MEMORIES = sql_text(_LIVE_SHOWN)
# The same as a condition of the reply's own write (memory.record.turns.note_reply_memory): one
# statement, not a read and then the write, before every first token that shows memories.
NOT_ALL_STILL_SHOWN = f"(SELECT count(*) FROM ({_LIVE_SHOWN}) AS live) < :shown_count"


def _shown_params(shown: Sequence[ShownMemory]) -> dict[str, Any]:
    """LIVE_SHOWN_MEMORIES's parameters: each distinct memory once (by its key)."""
    memories = {m.key: m for m in shown}
    return {
        "turn_ids": [m.turn_id for m in memories.values()],
        "chunks": [m.chunk_index for m in memories.values()],
        "texts": [m.text for m in memories.values()],
        "indexed": [m.indexed for m in memories.values()],
        "forgotten": FORGOTTEN,
    }


async def _live(session: AsyncSession, shown: Sequence[ShownMemory]) -> set[tuple[str, int]]:
    """The keys of the shown memories that still exist as they were shown (LIVE_SHOWN_MEMORIES)."""
    if not shown:
        return set()
    found = await session.execute(LIVE_SHOWN_MEMORIES, _shown_params(shown))
    return {(row.turn_id, row.chunk_index) for row in found}


async def memories_still_shown(session: AsyncSession, memories: Sequence[ShownMemory]) -> bool:
    """Every one of these memories still exists as it was shown (none corrected, forgotten or deleted).

    Asked by a reply storing what its prompt part or its recall tool showed, under
    ``lock_shown_memories`` (memory/recall/forgetting.py).
    """
    return await _live(session, memories) >= {m.key for m in memories}


def unless_still_shown(memories: Sequence[ShownMemory]) -> tuple[str, dict[str, Any]]:
    """``memories_still_shown`` as a condition of a reply's note (memory.record.turns.note_reply_memory):
    true when one of them no longer exists as it was shown. Asked under ``lock_shown_memories`` too.
    """
    params = _shown_params(memories)
    return NOT_ALL_STILL_SHOWN, {**params, "shown_count": len(params["turn_ids"])}


@dataclass(frozen=True)
class StoredWindow:
    """What a window is built from, as read: the newest turns, the still existing memories of
    their parts, and the conversation's memory switch. Built into a window with any budget
    of the same `rows_to_read` (`window_from`)."""

    turns: list[TurnView]
    alive: set[tuple[str, int]]
    use_memory: bool


async def read_stored_window(
    session: AsyncSession, conversation_id: Any, budget: ContextBudget
) -> StoredWindow:
    """The rows of the conversation's recent window, in the caller's transaction."""
    rows = await recent_turn_rows(session, conversation_id, budget.rows_to_read)
    turns = [TurnView.from_row(row) for row in rows]
    alive = await _live(session, _shown_memories(turns))
    use_memory = bool(rows[-1].use_memory) if rows else True
    return StoredWindow(turns, alive, use_memory)


def window_from(
    stored: StoredWindow, *, prompts: PromptSet, budget: ContextBudget, instructions: str | None = None
) -> PromptWindow:
    """The window those rows make within `budget`, beside the client's `instructions`."""
    return build_window(
        stored.turns,
        prompts=prompts,
        budget=budget,
        alive=stored.alive,
        use_memory=stored.use_memory,
        instructions=instructions,
    )


async def read_window(
    db: Database,
    conversation_id: Any,
    *,
    prompts: PromptSet,
    budget: ContextBudget,
    instructions: str | None = None,
) -> PromptWindow:
    """The conversation's recent window as it stands now (one read)."""
    async with db.session() as session:
        stored = await read_stored_window(session, conversation_id, budget)
    return window_from(stored, prompts=prompts, budget=budget, instructions=instructions)


def prompt_from_window(
    window: PromptWindow,
    *,
    prompts: PromptSet,
    budget: ContextBudget,
    memory: Sequence[PromptMemory] = (),
    standing: Sequence[PromptMemory] = (),
) -> BuiltContext:
    """OpenAI chat messages: the system prompt, then the window; the reply's part in its latest user message.

    The system prompt is the same for every reply, and the window only grows at its end
    between the steps of a reply: together they are a prefix the model server can cache
    (llama-server's prompt cache, hosted prompt-cache discounts). What changes per reply,
    the memories that fit and the current time, goes before the user's words in the latest
    user message: the one place every chat template accepts (a second system message, or
    two user messages in a row, are refused by some), and a small model reads a block
    before the question better than after it. `standing` (a conversation's first reply only:
    memory.recall.standing, oldest first) goes first in that part, before the time: the same
    in every new conversation until the user says something new, it joins the cached prefix.
    """
    dropped: Counter[str] = Counter(window.dropped)
    system_text = prompts.render("system")
    messages = list(window.messages)
    for index, part in window.parts.items():
        messages[index] = _with_part(messages[index], part)
    latest = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), None)
    tokens = window.tokens
    memory_used: list[PromptMemory] = []
    new_part: ShownPart | None = None
    if latest is None:
        if memory:
            dropped["memory_without_user_message"] += len(memory)
    elif latest not in window.parts:  # a later step of a reply replays the part its first step made
        now = _spoken_time(window.now)
        standing_room = min(budget.standing_tokens, window.part_room)
        standing_text, standing_used = _standing_block(standing, prompts, standing_room, dropped)
        in_standing = {_memory_key(m) for m in standing_used}
        # What an earlier message of the window, or the standing block, shows is not shown twice.
        fresh = [
            m
            for m in memory
            if not _already_shown(m, window.shown_texts) and _memory_key(m) not in in_standing
        ]
        if len(fresh) < len(memory):
            dropped["memory_already_shown"] += len(memory) - len(fresh)
        memory_text, memory_used = _memory_block(
            fresh,
            prompts,
            window.part_room - _part_tokens(standing_text),
            window.current_conversation,
            dropped,
            now,
        )
        part = _part_text(standing_text, memory_text or prompts.render("current_time", now=now))
        words = messages[latest]["content"]
        messages[latest] = _with_part(messages[latest], part)
        if isinstance(words, str):
            tokens += count_tokens(messages[latest]["content"]) - count_tokens(words)
        else:
            tokens += count_tokens(part) + 1
        asked = str(window.asked) if window.asked is not None else None
        shown = (
            *(ShownMemory.of(m, standing=True) for m in standing_used),
            *(ShownMemory.of(m) for m in memory_used),
        )
        new_part = ShownPart(now, shown, asked)
    return BuiltContext(
        messages=[{"role": "system", "content": system_text}, *messages],
        window_turn_ids=list(window.turn_ids),
        prompt_version=prompts.version,
        token_count=_message_tokens(system_text) + tokens + REPLY_PRIMING_TOKENS,
        dropped=dict(dropped),
        memory_used=memory_used,
        new_part=new_part,
    )


def _with_part(message: dict[str, Any], part: str) -> dict[str, Any]:
    """A user message with the reply's part before its words (a text part first, with attachments)."""
    content = message["content"]
    if isinstance(content, list):
        first = content[0] if content else None
        if isinstance(first, dict) and first.get("type") == "text":
            return {**message, "content": [{**first, "text": f"{part}\n\n{first['text']}"}, *content[1:]]}
        return {**message, "content": [{"type": "text", "text": part}, *content]}
    return {**message, "content": f"{part}\n\n{content}"}


_SPOKEN_TIME = "%A, %d %B %Y, %H:%M UTC"


def _spoken_time(now: datetime) -> str:
    """The current time as the model is told it, to the minute: "Wednesday, 25 November 2026, 23:50 UTC"."""
    now = now.astimezone(UTC)
    return f"{now:%A}, {now.day} {now:%B %Y, %H:%M} UTC"


def _spoken_day(spoken: str) -> date | None:
    """The day a time told by `_spoken_time` falls on (None if it is not one: nothing is "today")."""
    try:
        return datetime.strptime(spoken, _SPOKEN_TIME).date()
    except ValueError:
        return None


def build_context(
    turns: Sequence[TurnView],
    *,
    prompts: PromptSet,
    budget: ContextBudget,
    memory: Sequence[PromptMemory] = (),
    standing: Sequence[PromptMemory] = (),
    now: datetime | None = None,
    alive: Collection[tuple[str, int]] | None = None,
) -> BuiltContext:
    """OpenAI chat messages for the next reply: the system prompt, then the window with the reply's part."""
    window = build_window(turns, prompts=prompts, budget=budget, now=now, alive=alive)
    return prompt_from_window(window, prompts=prompts, budget=budget, memory=memory, standing=standing)

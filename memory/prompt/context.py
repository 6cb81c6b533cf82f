"""The context builder: persisted turns in, a prompt the OpenAI chat API accepts out.

Everything a turn received is stored byte for byte (partial tool-call arguments,
interrupted text, results of calls whose turn later failed); the model sees again only
what is complete and consistent:

- `streaming` and `failed` turns never appear, nor turns of unknown roles;
- an interrupted turn (`interrupted_by_user`, `interrupted_by_error`) contributes its
  visible text only, never its tool calls; with `interrupted_policy="drop_turn"` it
  contributes nothing;
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, Protocol

from memory.events import INTERRUPTED_STATUSES, ToolCallState, TurnStatus
from memory.prompt.templates import PromptSet
from memory.prompt.tokens import count_tokens
from memory.record.turns import recent_turn_rows

if TYPE_CHECKING:
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


@dataclass(slots=True)
class _Unit:
    messages: list[dict[str, Any]]
    turn_ids: list[Any]
    tokens: int
    is_user: bool = False


def _message_tokens(content: str | None) -> int:
    return MESSAGE_OVERHEAD_TOKENS + (count_tokens(content) if content else 0)


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
    if turn.status in INTERRUPTED_STATUSES:
        if turn.tool_calls:
            dropped["tool_call_of_interrupted_turn"] += len(turn.tool_calls)
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
) -> tuple[list[_Unit], int]:
    """Units newest first, and their tokens."""
    units: list[_Unit] = []
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
        else:
            dropped["unknown_role"] += 1
        if unit is not None:
            if not in_current_exchange and used + unit.tokens > token_budget:
                dropped["over_token_budget"] += 1
                break
            units.append(unit)
            used += unit.tokens
            in_current_exchange = in_current_exchange and not unit.is_user
        position -= 1
    if pending:
        dropped["tool_result_orphaned"] += len(pending)
    if position > 0:
        dropped["older_turns_outside_window"] += position
    return units, used


def _memory_block(
    memory: Sequence[PromptMemory],
    prompts: PromptSet,
    reserve: int,
    current_conversation: Any,
    dropped: Counter[str],
    now: str,
) -> tuple[str | None, list[PromptMemory]]:
    """The memory block within `reserve` tokens (best-scored items first), and the items in it."""
    if not memory:
        return None, []
    roles = {
        "user": prompts.render("memory_role_user"),
        "assistant": prompts.render("memory_role_assistant"),
        "tool": prompts.render("memory_role_tool"),
    }
    used = count_tokens(prompts.render("memory_block", items="", now=now))
    lines: list[str] = []
    kept: list[PromptMemory] = []
    for item in sorted(memory, key=lambda item: item.score, reverse=True):
        text = " ".join(item.text.split())
        if not text:
            dropped["memory_empty"] += 1
            continue
        if current_conversation is not None and item.conversation_id == current_conversation:
            conversation = prompts.render("memory_this_conversation")
        elif item.conversation_title and item.conversation_title.strip():
            conversation = prompts.render("memory_conversation", title=item.conversation_title.strip())
        else:
            conversation = prompts.render("memory_untitled_conversation")
        line = prompts.render(
            "memory_item",
            date=item.created_at.date().isoformat(),
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

    messages: list[dict[str, Any]]  # oldest first, without the system message
    turn_ids: list[Any]  # the turns represented in `messages`, oldest first
    tokens: int
    dropped: dict[str, int]
    current_conversation: Any
    now: datetime


def build_window(
    turns: Sequence[TurnView], *, prompts: PromptSet, budget: ContextBudget, now: datetime | None = None
) -> PromptWindow:
    """The recent window the next prompt shows, within what the budget leaves after system and memory."""
    now = now or datetime.now(UTC)
    dropped: Counter[str] = Counter()
    system_tokens = _message_tokens(prompts.render("system"))
    token_budget = budget.max_tokens - budget.reply_reserve - budget.memory_reserve - system_tokens
    units, window_tokens = _select_window(turns, prompts, budget, token_budget, dropped)
    messages: list[dict[str, Any]] = []
    turn_ids: list[Any] = []
    for unit in reversed(units):
        messages.extend(unit.messages)
        turn_ids.extend(unit.turn_ids)
    current_conversation = turns[-1].conversation_id if turns else None
    return PromptWindow(messages, turn_ids, window_tokens, dict(dropped), current_conversation, now)


async def read_window(
    db: Database, conversation_id: Any, *, prompts: PromptSet, budget: ContextBudget
) -> PromptWindow:
    """The conversation's recent window as it stands now (one read)."""
    async with db.session() as session:
        rows = await recent_turn_rows(session, conversation_id, budget.rows_to_read)
    return build_window([TurnView.from_row(row) for row in rows], prompts=prompts, budget=budget)


def prompt_from_window(
    window: PromptWindow,
    *,
    prompts: PromptSet,
    budget: ContextBudget,
    memory: Sequence[PromptMemory] = (),
) -> BuiltContext:
    """OpenAI chat messages: the system prompt, then the window; the reply's part in its latest user message.

    The system prompt is the same for every reply, and the window only grows at its end
    between the steps of a reply: together they are a prefix the model server can cache
    (llama-server's prompt cache, hosted prompt-cache discounts). What changes per reply,
    the memories that fit and the current time, goes before the user's words in the latest
    user message: the one place every chat template accepts (a second system message, or
    two user messages in a row, are refused by some), and a small model reads a block
    before the question better than after it.
    """
    dropped: Counter[str] = Counter(window.dropped)
    system_text = prompts.render("system")
    now = _spoken_time(window.now)
    memory_text, memory_used = _memory_block(
        memory, prompts, budget.memory_reserve, window.current_conversation, dropped, now
    )
    part = memory_text if memory_text is not None else prompts.render("current_time", now=now)
    messages = list(window.messages)
    latest = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), None)
    tokens = window.tokens
    if latest is None:
        if memory_used:
            dropped["memory_without_user_message"] += len(memory_used)
        memory_used = []
    else:
        words = messages[latest]["content"]
        messages[latest] = {**messages[latest], "content": f"{part}\n\n{words}"}
        tokens += count_tokens(messages[latest]["content"]) - count_tokens(words)
    return BuiltContext(
        messages=[{"role": "system", "content": system_text}, *messages],
        window_turn_ids=list(window.turn_ids),
        prompt_version=prompts.version,
        token_count=_message_tokens(system_text) + tokens + REPLY_PRIMING_TOKENS,
        dropped=dict(dropped),
        memory_used=memory_used,
    )


def _spoken_time(now: datetime) -> str:
    """The current time as the model is told it, to the minute: "Wednesday, 25 November 2026, 23:50 UTC"."""
    now = now.astimezone(UTC)
    return f"{now:%A}, {now.day} {now:%B %Y, %H:%M} UTC"


def build_context(
    turns: Sequence[TurnView],
    *,
    prompts: PromptSet,
    budget: ContextBudget,
    memory: Sequence[PromptMemory] = (),
    now: datetime | None = None,
) -> BuiltContext:
    """OpenAI chat messages for the next reply: system (with memories), then the sanitized recent window."""
    window = build_window(turns, prompts=prompts, budget=budget, now=now)
    return prompt_from_window(window, prompts=prompts, budget=budget, memory=memory)

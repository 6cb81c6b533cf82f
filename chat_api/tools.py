"""Server-side tools: one registry, and execution that runs a side effect at most once.

Each logical call gets an idempotency key from tenant, turn, call position, tool name and
canonical arguments; the key is unique in `tool_invocations`. A call whose key exists is
not run again: a succeeded call returns its stored result, and a side-effecting call
whose earlier run may have happened (running, cancelled) is reported, not repeated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from sqlalchemy import select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.sql import func

from memory.config import Settings
from memory.events import ToolCallState
from memory.json_values import JsonObject, JsonValue
from memory.prompt.context import ShownMemory
from memory.recall.recaller import Recaller
from memory.record.conversations import Owner
from memory.storage.db import Database
from memory.storage.models import ToolInvocation


@dataclass(frozen=True)
class ToolContext:
    """What a tool may know about the call it serves, and what it may use."""

    owner: Owner
    conversation_id: uuid.UUID
    turn_id: uuid.UUID
    db: Database
    recaller: Recaller  # the user's long-term memory, as the chat searches it
    # The memories this call showed the model (the recall tool fills it); their turns are kept on
    # the tool turn, so that forgetting one of them finds the reply (memory/recall/forgetting.py).
    shown: list[ShownMemory] = field(default_factory=list)


# A tool: its arguments (a JSON object) and context in, a JSON result out.
ToolFunc = Callable[[JsonObject, ToolContext], Awaitable[JsonValue]]


@dataclass(frozen=True)
class Tool:
    """A tool the model may call."""

    name: str
    description: str
    parameters: JsonObject
    func: ToolFunc
    side_effects: bool = False
    # The turn waits (`awaiting_approval`) until a person approves or rejects the call.
    requires_approval: bool = False
    # Waiting longer than this counts as a rejection (None: wait as long as it takes).
    approval_timeout_seconds: float | None = None

    def schema(self) -> JsonObject:
        """The OpenAI `tools` entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class ToolRegistry:
    """Tools by name."""

    def __init__(self) -> None:
        self._tools: dict[str, Tool] = {}

    def register(self, tool: Tool) -> None:
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} registered twice")
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def require(self, name: str) -> Tool:
        tool = self._tools.get(name)
        if tool is None:
            raise KeyError(name)
        return tool

    def replace(self, tool: Tool) -> None:
        """Swap a registered tool for a changed copy (same name)."""
        self.require(tool.name)
        self._tools[tool.name] = tool

    def names(self) -> list[str]:
        return list(self._tools)

    def schemas(self) -> list[JsonObject]:
        return [tool.schema() for tool in self._tools.values()]

    def __len__(self) -> int:
        return len(self._tools)


def canonical_json(value: JsonValue) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def idempotency_key(
    owner: Owner, turn_id: uuid.UUID, call_index: int, name: str, arguments: JsonObject
) -> str:
    """The key of one logical call: same tenant, turn, position, tool and arguments → same key."""
    raw = "\x1f".join([owner.tenant_id, str(turn_id), str(call_index), name, canonical_json(arguments)])
    return hashlib.sha256(raw.encode()).hexdigest()


class ToolFailed(Exception):
    """A tool could not do what it was asked; the message is its result, and the call is `failed`."""


@dataclass
class ToolOutcome:
    state: str
    result: JsonValue
    reused: bool = False


async def begin_invocation(
    db: Database,
    owner: Owner,
    turn_id: uuid.UUID,
    call_index: int,
    call_id: str,
    tool: Tool,
    arguments: JsonObject,
) -> tuple[str, ToolOutcome | None]:
    """Claim the call's key: (key, None) means run the tool; otherwise the known outcome."""
    key = idempotency_key(owner, turn_id, call_index, tool.name, arguments)
    async with db.transaction() as session:
        inserted = (
            await session.execute(
                insert(ToolInvocation)
                .values(
                    tenant_id=owner.tenant_id,
                    user_id=owner.user_id,
                    turn_id=turn_id,
                    call_index=call_index,
                    call_id=call_id,
                    tool_name=tool.name,
                    arguments=arguments,
                    idempotency_key=key,
                    state=ToolCallState.RUNNING,
                    side_effect_may_have_happened=tool.side_effects,
                    attempts=1,
                )
                .on_conflict_do_nothing(index_elements=["idempotency_key"])
                .returning(ToolInvocation.id)
            )
        ).scalar_one_or_none()
        if inserted is not None:
            return key, None
        row = (
            await session.execute(
                select(ToolInvocation).where(ToolInvocation.idempotency_key == key).with_for_update()
            )
        ).scalar_one()
        if row.state == ToolCallState.SUCCEEDED:
            return key, ToolOutcome(ToolCallState.SUCCEEDED, row.result, reused=True)
        if tool.side_effects:
            note: JsonObject = {
                "error": f"not run again: an earlier attempt ended {row.state}",
                "side_effect_may_have_happened": row.side_effect_may_have_happened,
            }
            return key, ToolOutcome(ToolCallState.FAILED, note, reused=True)
        row.attempts += 1
        row.state = ToolCallState.RUNNING
        return key, None


async def finish_invocation(db: Database, key: str, state: str, result: JsonValue) -> None:
    """Record how the call ended."""
    async with db.transaction() as session:
        await session.execute(
            update(ToolInvocation)
            .where(ToolInvocation.idempotency_key == key)
            .values(state=state, result=result, updated_at=func.now())
        )


async def cancel_invocation(db: Database, key: str, *, side_effect_may_have_happened: bool) -> None:
    """Record that stop cancelled the call while it ran."""
    async with db.transaction() as session:
        await session.execute(
            update(ToolInvocation)
            .where(ToolInvocation.idempotency_key == key, ToolInvocation.state == ToolCallState.RUNNING)
            .values(
                state=ToolCallState.CANCELLED,
                side_effect_may_have_happened=side_effect_may_have_happened,
                updated_at=func.now(),
            )
        )


# --- built-in tools --------------------------------------------------------------------

RECALL_TOOL_ITEMS = 8


async def _current_time(args: JsonObject, _: ToolContext) -> JsonObject:
    name = str(args.get("timezone") or "UTC")
    try:
        zone: tzinfo = ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ToolFailed(f"unknown timezone {name!r}") from None
    now = datetime.now(UTC).astimezone(zone)
    return {"timezone": name, "iso": now.isoformat(timespec="seconds"), "weekday": now.strftime("%A")}


async def _recall_memory(args: JsonObject, ctx: ToolContext) -> JsonObject:
    """The model's own query, over the user's whole memory, minus the prompt's window."""
    query = str(args.get("query") or "")
    if not query.strip():
        return {"query": query, "items": [], "note": "empty query"}
    found = await ctx.recaller.search(
        ctx.owner,
        query,
        k=RECALL_TOOL_ITEMS,
        history_conversation=ctx.conversation_id,
        exclude_window=True,
        rewrite=False,
    )
    ctx.shown.extend(ShownMemory.of(m) for m in found.memories)
    return {
        "query": query,
        "items": [
            {
                "text": m.text,
                "date": m.created_at.date().isoformat(),
                "conversation_title": m.conversation_title,
                "role": m.role,
                "score": round(m.score, 4),
            }
            for m in found.memories
        ],
    }


CURRENT_TIME = Tool(
    name="current_time",
    description="The current date and time in a timezone.",
    parameters={
        "type": "object",
        "properties": {"timezone": {"type": "string", "description": "IANA name, e.g. Europe/Paris"}},
        "additionalProperties": False,
    },
    func=_current_time,
)

RECALL_MEMORY = Tool(
    name="recall_memory",
    description="Search what the user said in earlier conversations.",
    parameters={
        "type": "object",
        "properties": {"query": {"type": "string", "description": "What to look for"}},
        "required": ["query"],
        "additionalProperties": False,
    },
    func=_recall_memory,
)


def default_registry() -> ToolRegistry:
    """The tools chatmem ships."""
    registry = ToolRegistry()
    registry.register(CURRENT_TIME)
    registry.register(RECALL_MEMORY)
    return registry


class ToolConfigError(ValueError):
    """TOOL_MODULES or the approval settings cannot be applied."""


def configured_registry(settings: Settings) -> ToolRegistry:
    """The shipped tools, the ones `TOOL_MODULES` register, and the configured approval rules."""
    registry = default_registry()
    for path in settings.tool_modules:
        try:
            module = importlib.import_module(path)
        except ImportError as exc:
            raise ToolConfigError(f"tool module {path!r} cannot be imported: {exc}") from exc
        register = getattr(module, "register", None)
        if not callable(register):
            raise ToolConfigError(f"tool module {path!r} has no register(registry) function")
        register(registry)
    unknown = (set(settings.tools_requiring_approval) | set(settings.tool_approval_timeouts)) - set(
        registry.names()
    )
    if unknown:
        raise ToolConfigError(f"approval settings name unknown tools: {', '.join(sorted(unknown))}")
    for name in settings.tools_requiring_approval:
        registry.replace(dataclasses.replace(registry.require(name), requires_approval=True))
    for name, seconds in settings.tool_approval_timeouts.items():
        registry.replace(dataclasses.replace(registry.require(name), approval_timeout_seconds=seconds))
    return registry

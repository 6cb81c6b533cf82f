"""Importing past turns: validate a whole batch, then append it to a conversation atomically.

Rules a client can rely on:

- A batch is checked item by item before anything is written; the first bad item stops
  the import with `InvalidInput` whose details name its ``index`` (and ``field``). Nothing
  is stored unless everything is.
- Items whose ``external_id`` already exists in the conversation are skipped, so an
  interrupted import can be sent again as is. Two items of one batch may not share one.
- Imported turns go after the conversation's existing turns. Within a batch they are
  ordered by ``created_at`` (stable: equal times keep request order). An item without
  ``created_at`` takes the time of the nearest dated item before it in the request (the
  first dated item's time if none precedes it, the import time if no item is dated), so
  it stays next to its neighbours. Times without a zone are UTC.
- Imported turns are ordinary ``completed`` turns (``completed_at`` = ``created_at``) with
  outbox rows in the same transaction, so the indexer picks them up like any other.

The insert is one ``INSERT ... SELECT FROM unnest(...)`` statement: a few thousand rows
go in one round trip instead of one per row. Sequence numbers are taken under the
conversation's row lock, which also serialises imports with replies and each other.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from memory.errors import ConversationBusy, InvalidInput
from memory.events import TurnStatus
from memory.json_bounds import MAX_DEPTH, json_problem, text_problem
from memory.record.conversations import Owner, get_conversation
from memory.record.outbox import NOTIFY, turn_payload
from memory.storage.models import Conversation, Turn

DEFAULT_MAX_TURNS = 5000
MAX_NAME_CHARS = 200
MAX_EXTERNAL_ID_CHARS = 256
MAX_METADATA_BYTES = 16_384

INSERT_TURNS = text(
    """
    INSERT INTO turns (id, conversation_id, tenant_id, user_id, seq, role, status, content, tool_calls,
                       name, external_id, metadata, last_event_id, created_at, updated_at, completed_at)
    SELECT t.id, CAST(:conversation_id AS uuid), CAST(:tenant_id AS text), CAST(:user_id AS text), t.seq,
           t.role, CAST(:status AS text), t.content, CAST('[]' AS jsonb), t.name, t.external_id,
           CAST(t.metadata AS jsonb), 0, t.created_at, CAST(:now AS timestamptz), t.created_at
    FROM unnest(CAST(:ids AS uuid[]), CAST(:seqs AS int[]), CAST(:roles AS text[]),
                CAST(:contents AS text[]), CAST(:names AS text[]), CAST(:external_ids AS text[]),
                CAST(:metadata AS text[]), CAST(:created_at AS timestamptz[]))
         AS t(id, seq, role, content, name, external_id, metadata, created_at)
    """
)

# Imported turns are user or assistant turns, completed: every one is recorded (see memory.record.outbox).
# Priority 1: imported history is indexed after the live turns waiting (see indexer/outbox_claims.py).
INSERT_OUTBOX = text(
    """
    INSERT INTO outbox (tenant_id, user_id, conversation_id, turn_id, payload, priority)
    SELECT CAST(:tenant_id AS text), CAST(:user_id AS text), CAST(:conversation_id AS uuid), o.turn_id,
           CAST(o.payload AS jsonb), 1
    FROM unnest(CAST(:turn_ids AS uuid[]), CAST(:payloads AS text[]))
         WITH ORDINALITY AS o(turn_id, payload, n)
    ORDER BY o.n  -- outbox ids in seq order: consumers see a conversation's turns in order
    """
)

EXISTING_EXTERNAL_IDS = text(
    """
    SELECT external_id, id, seq FROM turns
    WHERE conversation_id = :conversation_id AND external_id = ANY(CAST(:external_ids AS text[]))
    """
)


class ImportTurn(BaseModel):
    """One past turn as a client sends it."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str
    created_at: datetime | None = Field(None, description="When it was said (kept as the turn's time).")
    name: str | None = Field(None, max_length=MAX_NAME_CHARS, description="The speaker's display name.")
    external_id: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_EXTERNAL_ID_CHARS,
        description="The client's id; unique within the conversation (re-imports skip it).",
    )
    metadata: dict[str, Any] | None = Field(None, description="Any JSON object, kept as is.")


@dataclass(frozen=True, slots=True)
class ImportedItem:
    """What happened to one item of the batch, by its index in the request."""

    index: int
    turn_id: uuid.UUID
    seq: int
    external_id: str | None
    created: bool


@dataclass(slots=True)
class ImportResult:
    """The outcome of one import request."""

    conversation_id: uuid.UUID
    items: list[ImportedItem] = field(default_factory=list)
    turn_count: int = 0
    indexed_seq: int = 0

    @property
    def created(self) -> int:
        return sum(1 for i in self.items if i.created)

    @property
    def skipped(self) -> int:
        return sum(1 for i in self.items if not i.created)

    @property
    def last_seq(self) -> int:
        """The turns of this batch are all searchable once the conversation's indexed_seq reaches this."""
        return max((i.seq for i in self.items), default=0)


def _bad(index: int, field_name: str, message: str, **details: Any) -> InvalidInput:
    return InvalidInput(f"turns[{index}].{field_name}: {message}", index=index, field=field_name, **details)


def _check_string(index: int, field_name: str, value: str) -> None:
    # Postgres text refuses NUL; asyncpg cannot encode lone surrogates. Both would be 500s.
    problem = text_problem(value)
    if problem is not None:
        raise _bad(index, field_name, problem)


def _parse_item(index: int, raw: object, max_chars: int) -> ImportTurn:
    if not isinstance(raw, dict):
        raise InvalidInput(f"turns[{index}] is not an object", index=index, field="")
    try:
        item = ImportTurn.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "item"
        raise _bad(index, where, first["msg"], errors=[e["msg"] for e in exc.errors()]) from None
    _check_string(index, "content", item.content)
    if not item.content.strip():
        raise _bad(index, "content", "is empty")
    if len(item.content) > max_chars:
        raise _bad(index, "content", f"is longer than {max_chars} characters", max_chars=max_chars)
    for name in ("name", "external_id"):
        value = getattr(item, name)
        if value is not None:
            _check_string(index, name, value)
    if item.created_at is not None:
        try:
            moment = _aware(item.created_at).astimezone(UTC).replace(tzinfo=None)
        except OverflowError:  # e.g. 0001-01-01T00:00:00+14:00: before year 1 in UTC
            raise _bad(index, "created_at", "is out of range") from None
        # The driver stores the first and last instants Python can hold as -infinity and
        # infinity, which read back as no datetime: every memory search of the user would fail.
        if moment in (datetime.min, datetime.max):
            raise _bad(index, "created_at", "is out of range") from None
    if item.metadata is not None:
        problem = json_problem(item.metadata, max_bytes=MAX_METADATA_BYTES)
        if problem is not None:
            raise _bad(index, "metadata", problem, max_depth=MAX_DEPTH, max_bytes=MAX_METADATA_BYTES)
    return item


def parse_import(raw_items: object, *, max_turns: int, max_chars: int) -> list[ImportTurn]:
    """Validate a whole batch (CPU only; run it off the event loop for big batches)."""
    if not isinstance(raw_items, list):
        raise InvalidInput("turns must be a list", field="turns")
    if not raw_items:
        raise InvalidInput("turns is empty", field="turns")
    if len(raw_items) > max_turns:
        raise InvalidInput(
            f"at most {max_turns} turns per request (got {len(raw_items)}); send several requests",
            field="turns",
            max_turns=max_turns,
        )
    items = [_parse_item(index, raw, max_chars) for index, raw in enumerate(raw_items)]
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        if item.external_id is None:
            continue
        if item.external_id in first_seen:
            raise _bad(
                index,
                "external_id",
                f"repeats turns[{first_seen[item.external_id]}]",
                first_index=first_seen[item.external_id],
            )
        first_seen[item.external_id] = index
    return items


def effective_times(items: Sequence[ImportTurn], now: datetime) -> list[datetime]:
    """Each item's time: its own (naive = UTC), else the nearest dated item's before it (see module doc)."""
    own = [None if i.created_at is None else _aware(i.created_at) for i in items]
    fallback = next((t for t in own if t is not None), now)
    out: list[datetime] = []
    for value in own:
        if value is not None:
            fallback = value
        out.append(fallback)
    return out


def _aware(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


async def import_turns(
    session: AsyncSession,
    owner: Owner,
    conversation_id: uuid.UUID,
    items: Sequence[ImportTurn],
) -> ImportResult:
    """Append validated items to the owner's conversation, skipping known external ids; never commits."""
    conversation = await get_conversation(session, owner, conversation_id, for_update=True)
    if conversation.active_reply_id is not None:
        # A reply's later turns (tool results, the next model step) would land after the import.
        raise ConversationBusy(
            "a reply is streaming in this conversation; import when it has ended",
            active_reply_id=str(conversation.active_reply_id),
        )
    now = datetime.now(UTC)
    result = ImportResult(conversation_id=conversation.id)
    external_ids = [i.external_id for i in items if i.external_id is not None]
    existing: dict[str, Any] = {}
    if external_ids:
        rows = await session.execute(
            EXISTING_EXTERNAL_IDS, {"conversation_id": conversation.id, "external_ids": external_ids}
        )
        existing = {row.external_id: row for row in rows}

    fresh = [
        (index, item)
        for index, item in enumerate(items)
        if item.external_id is None or item.external_id not in existing
    ]
    if fresh:
        planned = await asyncio.to_thread(_plan, conversation, fresh, effective_times(items, now), now)
        await session.execute(INSERT_TURNS, planned.turn_params)
        await session.execute(INSERT_OUTBOX, planned.outbox_params)
        await session.execute(NOTIFY)
        conversation.next_seq += len(fresh)
        conversation.updated_at = now
        await session.flush()
        by_index = planned.by_index
    else:
        by_index = {}

    for index, item in enumerate(items):
        made = by_index.get(index)
        if made is not None:
            result.items.append(ImportedItem(index, made.id, made.seq, item.external_id, created=True))
        else:
            row = existing[str(item.external_id)]
            result.items.append(ImportedItem(index, row.id, row.seq, item.external_id, created=False))
    result.turn_count = conversation.next_seq - 1
    result.indexed_seq = conversation.indexed_seq
    return result


@dataclass(frozen=True, slots=True)
class _NewTurn:
    """The attributes of a turn that the outbox payload reads (an ORM Turn costs ~0.1 ms each)."""

    id: uuid.UUID
    conversation_id: uuid.UUID
    tenant_id: str
    user_id: str
    seq: int
    role: str
    status: str
    content: str
    name: str | None
    external_id: str | None
    meta: dict[str, Any] | None
    created_at: datetime
    completed_at: datetime
    memory_use: str | None = None  # imported history: remembered as imported


@dataclass(frozen=True, slots=True)
class _Plan:
    by_index: dict[int, _NewTurn]
    turn_params: dict[str, Any]
    outbox_params: dict[str, Any]


def _plan(
    conversation: Conversation,
    fresh: list[tuple[int, ImportTurn]],
    times: list[datetime],
    now: datetime,
) -> _Plan:
    # CPU work for thousands of rows (payloads, JSON): runs in a worker thread.
    ordered = sorted(fresh, key=lambda entry: times[entry[0]])  # stable: equal times keep request order
    turns = [
        _NewTurn(
            id=uuid.uuid4(),
            conversation_id=conversation.id,
            tenant_id=conversation.tenant_id,
            user_id=conversation.user_id,
            seq=conversation.next_seq + offset,
            role=item.role,
            status=TurnStatus.COMPLETED,
            content=item.content,
            name=item.name,
            external_id=item.external_id,
            meta=item.metadata,
            created_at=times[index],
            completed_at=times[index],
        )
        for offset, (index, item) in enumerate(ordered)
    ]
    # turn_payload only reads attributes; the outbox message stays defined in one place.
    payloads = [turn_payload(cast(Turn, t)) for t in turns]
    owner = {
        "conversation_id": conversation.id,
        "tenant_id": conversation.tenant_id,
        "user_id": conversation.user_id,
    }
    return _Plan(
        by_index={index: t for (index, _), t in zip(ordered, turns, strict=True)},
        turn_params={
            **owner,
            "status": TurnStatus.COMPLETED,
            "now": now,
            "ids": [t.id for t in turns],
            "seqs": [t.seq for t in turns],
            "roles": [t.role for t in turns],
            "contents": [t.content for t in turns],
            "names": [t.name for t in turns],
            "external_ids": [t.external_id for t in turns],
            "metadata": [None if t.meta is None else json.dumps(t.meta, ensure_ascii=False) for t in turns],
            "created_at": [t.created_at for t in turns],
        },
        outbox_params={
            **owner,
            "turn_ids": [t.id for t in turns],
            "payloads": [json.dumps(p, ensure_ascii=False) for p in payloads],
        },
    )

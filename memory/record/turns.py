"""Turn repository: reads scoped to the owner, writes that never commit (the caller does)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from functools import cache
from typing import Any, cast

from sqlalchemy import Table, TextClause, and_, column, func, insert, select, text, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncSession

from memory.errors import NotFound
from memory.events import TERMINAL_STATUSES, Event, TurnStatus
from memory.recall.remembering import FORGOTTEN
from memory.record.conversations import Owner, allocate_seq
from memory.record.reply_state import DONE_CHANNEL
from memory.record.tool_calls import ToolCall
from memory.storage.models import Conversation, Turn, TurnEventChunk


def _visible(owner: Owner):  # type: ignore[no-untyped-def]
    return and_(
        Turn.tenant_id == owner.tenant_id,
        Turn.user_id == owner.user_id,
        Turn.conversation_id == Conversation.id,
        Turn.deleted_at.is_(None),
        Conversation.deleted_at.is_(None),
    )


async def get_turn(session: AsyncSession, owner: Owner, turn_id: uuid.UUID) -> Turn:
    """The owner's turn in a live conversation, or NotFound."""
    turn = (
        await session.execute(select(Turn).join(Conversation).where(Turn.id == turn_id, _visible(owner)))
    ).scalar_one_or_none()
    if turn is None:
        raise NotFound("turn not found", turn_id=str(turn_id))
    return turn


PROMPT_COLUMNS = (
    Turn.role,
    Turn.status,
    Turn.content,
    Turn.tool_calls,
    Turn.tool_call_id,
    Turn.name,
    Turn.seq,
    Turn.id,
    Turn.created_at,
    Turn.conversation_id,
    column("meta", JSONB),  # turns.metadata, named as the model's attribute
    Turn.prompt_part,
    Conversation.use_memory,
)


# The active branch's newest turns in one round trip: at most `limit` per lineage entry, each an
# index range scan on (branch_id, seq), then the newest `limit` of those.
RECENT_TURNS = text(
    """
    SELECT t.role, t.status, t.content, t.tool_calls, t.tool_call_id, t.name, t.seq, t.id, t.created_at,
           t.conversation_id, t.metadata AS meta, t.prompt_part, c.use_memory
    FROM conversations c
    JOIN branches b ON b.id = c.active_branch_id
    CROSS JOIN LATERAL unnest(b.lineage_ids, b.lineage_max_seqs) AS l(branch_id, max_seq)
    CROSS JOIN LATERAL (
        SELECT * FROM turns t
        WHERE t.branch_id = l.branch_id AND t.seq <= l.max_seq AND t.deleted_at IS NULL
        ORDER BY t.seq DESC
        LIMIT :limit
    ) t
    WHERE c.id = :conversation_id
    ORDER BY t.seq DESC
    LIMIT :limit
    """
).columns(*PROMPT_COLUMNS)


async def recent_turn_rows(session: AsyncSession, conversation_id: uuid.UUID, limit: int) -> list[Any]:
    """The active branch's newest `limit` turns as light rows (only what a prompt needs), oldest first."""
    rows = await session.execute(RECENT_TURNS, {"conversation_id": conversation_id, "limit": limit})
    return list(reversed(rows.all()))


# A reply found to have been shown a memory forgotten since (memory/recall/forgetting.py) stays
# forgotten: none of its steps, nor its ending, make it remembered again. So does a reply begun
# before its conversation's forget mark (all memory forgotten, or the chat's "remember" turned
# on again): a step after the mark (a tool's result, an approval hours later) may retell what
# the reply was shown before it. The turn's own mark is read from the row itself: a note that
# waited for the row while a forget marked it re-reads the row, but its subquery would read what
# its statement began with.
NOTE_MEMORY_USE = """
    memory_use = CASE
        WHEN turns.memory_use = :forgotten THEN :forgotten
        WHEN EXISTS (
            SELECT 1 FROM turns AS first JOIN conversations AS c ON c.id = first.conversation_id
            WHERE first.id = turns.reply_id
              AND (first.memory_use = :forgotten OR first.seq <= c.memory_forgotten_seq)
        ) THEN :forgotten{also}
        ELSE :memory_use
    END"""


@cache
def _note_statement(with_part: bool, with_query: bool, forgotten_if: str | None = None) -> TextClause:
    """The UPDATE of a reply's turn that sets memory_use, and the part and query when given.

    Built once per shape: it runs before every first token and at endings. ``forgotten_if``: a
    condition (with its own parameters) that makes the reply forgotten as well.
    """
    also = f"\n        WHEN {forgotten_if} THEN :forgotten" if forgotten_if is not None else ""
    columns = [NOTE_MEMORY_USE.format(also=also)]
    if with_part:
        columns.append("prompt_part = CAST(:prompt_part AS jsonb)")
    if with_query:
        columns.append("rewritten_query = :rewritten_query")
    return text(f"UPDATE turns SET {', '.join(columns)} WHERE id = :turn_id")


async def note_reply_memory(
    session: AsyncSession,
    turn_id: uuid.UUID,
    memory_use: str,
    prompt_part: dict[str, Any] | None = None,
    *,
    rewritten_query: str | None = None,
    forgotten_if: tuple[str, dict[str, Any]] | None = None,
) -> None:
    """Record on an assistant turn whether its reply used memory, and (first turn) the part it showed
    and the query its recall searched.

    Later prompts show the reply's user message with that part (`memory.prompt.context`), so
    the conversation's prompt only grows at its end and a model server's cache holds; the
    remembering rule reads `memory_use` (`memory.record.outbox`, the not-yet-indexed search).
    ``forgotten_if``: a condition and its parameters (e.g. ``memory.prompt.context.unless_still_shown``)
    under which the reply is noted forgotten instead, checked by the same statement.
    """
    params: dict[str, Any] = {"turn_id": turn_id, "memory_use": memory_use, "forgotten": FORGOTTEN}
    if prompt_part is not None:
        params["prompt_part"] = json.dumps(prompt_part, ensure_ascii=False)
    if rewritten_query is not None:
        params["rewritten_query"] = rewritten_query
    condition = None
    if forgotten_if is not None:
        condition, extra = forgotten_if
        params |= extra
    statement = _note_statement(prompt_part is not None, rewritten_query is not None, condition)
    await session.execute(statement, params)


async def reply_turns(session: AsyncSession, reply_id: uuid.UUID) -> list[Turn]:
    """The assistant and tool turns produced by one reply, in order."""
    rows = await session.execute(
        select(Turn)
        .where(Turn.reply_id == reply_id, Turn.role != "user", Turn.deleted_at.is_(None))
        .order_by(Turn.seq)
    )
    return list(rows.scalars())


async def find_by_idempotency_key(session: AsyncSession, conversation_id: uuid.UUID, key: str) -> Turn | None:
    """The user turn a previous request with this Idempotency-Key created, if any."""
    return (
        await session.execute(
            select(Turn).where(Turn.conversation_id == conversation_id, Turn.idempotency_key == key)
        )
    ).scalar_one_or_none()


async def add_turn(
    session: AsyncSession,
    conversation: Conversation,
    *,
    role: str,
    status: str,
    content: str = "",
    reply_id: uuid.UUID | None = None,
    turn_id: uuid.UUID | None = None,
    **fields: Any,
) -> Turn:
    """Append a turn with the next sequence number, on the conversation's active branch."""
    seq = await allocate_seq(session, conversation.id)
    turn = Turn(
        id=turn_id or uuid.uuid4(),
        conversation_id=conversation.id,
        branch_id=conversation.active_branch_id,
        tenant_id=conversation.tenant_id,
        user_id=conversation.user_id,
        seq=seq,
        role=role,
        status=status,
        content=content,
        reply_id=reply_id,
        tool_calls=fields.pop("tool_calls", []),
        **fields,
    )
    if status in TERMINAL_STATUSES:
        turn.completed_at = func.now()
    if status == TurnStatus.STREAMING:
        turn.heartbeat_at = func.now()
    session.add(turn)
    await session.flush()
    await session.refresh(turn)
    return turn


async def begin_reply(
    session: AsyncSession,
    conversation: Conversation,
    *,
    content: str,
    reply_id: uuid.UUID,
    idempotency_key: str | None,
    model: str,
    owner_tag: str,
) -> tuple[Turn, Turn]:
    """Store the user's turn (completed) and the reply's assistant turn (streaming) in one flush.

    The hot path before the first token: the conversation row is already locked, so the
    two sequence numbers are taken from it directly, and times are set here rather than
    read back, which saves four round trips.
    """
    now = datetime.now(UTC)
    seq = conversation.next_seq
    conversation.next_seq = seq + 2
    conversation.active_reply_id = reply_id
    conversation.updated_at = now
    user_turn = Turn(
        id=uuid.uuid4(),
        seq=seq,
        role="user",
        status=TurnStatus.COMPLETED,
        content=content,
        idempotency_key=idempotency_key,
        created_at=now,
        updated_at=now,
        completed_at=now,
        **_reply_fields(conversation, reply_id),
    )
    assistant = _streaming_turn(conversation, seq + 1, reply_id, model, owner_tag, now)
    session.add_all([user_turn, assistant])
    return user_turn, assistant


async def begin_answer(
    session: AsyncSession,
    conversation: Conversation,
    *,
    reply_id: uuid.UUID,
    idempotency_key: str | None,
    model: str,
    owner_tag: str,
) -> Turn:
    """Start another reply to a user message already stored (regenerate): the streaming assistant turn."""
    now = datetime.now(UTC)
    seq = conversation.next_seq
    conversation.next_seq = seq + 1
    conversation.active_reply_id = reply_id
    conversation.updated_at = now
    assistant = _streaming_turn(conversation, seq, reply_id, model, owner_tag, now)
    assistant.idempotency_key = idempotency_key
    session.add(assistant)
    return assistant


def _reply_fields(conversation: Conversation, reply_id: uuid.UUID) -> dict[str, Any]:
    return {
        "conversation_id": conversation.id,
        "branch_id": conversation.active_branch_id,
        "tenant_id": conversation.tenant_id,
        "user_id": conversation.user_id,
        "reply_id": reply_id,
        "tool_calls": [],
        "last_event_id": 0,
    }


def _streaming_turn(
    conversation: Conversation, seq: int, reply_id: uuid.UUID, model: str, owner_tag: str, now: datetime
) -> Turn:
    return Turn(
        id=reply_id,
        seq=seq,
        role="assistant",
        status=TurnStatus.STREAMING,
        content="",
        model=model,
        owner=owner_tag,
        created_at=now,
        updated_at=now,
        heartbeat_at=func.now(),
        **_reply_fields(conversation, reply_id),
    )


async def finish_turn(
    session: AsyncSession,
    turn_id: uuid.UUID,
    *,
    status: str,
    content: str,
    tool_calls: Sequence[ToolCall],
    last_event_id: int,
    from_status: str = TurnStatus.STREAMING,
    **fields: Any,
) -> Turn | None:
    """Move a turn from `from_status` to `status`; None if it was no longer in `from_status`.

    The turn as stored after the write is returned (also when this session already held it).
    """
    result = await session.execute(
        update(Turn)
        .where(Turn.id == turn_id, Turn.status == from_status)
        .values(
            status=status,
            content=content,
            tool_calls=tool_calls,
            last_event_id=last_event_id,
            completed_at=func.now(),
            updated_at=func.now(),
            **fields,
        )
        .returning(Turn)
        .execution_options(synchronize_session=False, populate_existing=True)
    )
    return result.scalar_one_or_none()


# Plain SQL (every reply's ending runs it): a caller that holds the conversation's row in its
# session sets `active_reply_id` on it itself (start.py, a parked reply giving way). One
# statement with the notification: a data-modifying WITH always runs, and pg_notify is sent
# at commit, as on its own (memory.record.reply_state).
RELEASE_CONVERSATION = text(
    "WITH released AS (UPDATE conversations SET active_reply_id = NULL"
    " WHERE id = :conversation_id AND active_reply_id = :reply_id)"
    f" SELECT pg_notify('{DONE_CHANNEL}', CAST(:reply_id AS text))"
)


async def release_conversation(
    session: AsyncSession, conversation_id: uuid.UUID, reply_id: uuid.UUID
) -> None:
    """Let the conversation accept a new message (only if this reply still held it), and wake
    everyone waiting for the reply to end (`notify_done`, in the same statement)."""
    await session.execute(RELEASE_CONVERSATION, {"conversation_id": conversation_id, "reply_id": reply_id})


CHECKPOINT_TURN = text(
    """
    UPDATE turns SET content = :content, tool_calls = CAST(:tool_calls AS jsonb),
           last_event_id = :last_event_id, heartbeat_at = now(), updated_at = now()
    WHERE id = :turn_id AND status = 'streaming'
    """
)

HEARTBEAT = text(
    "UPDATE turns SET heartbeat_at = now() WHERE id = ANY(CAST(:ids AS uuid[])) AND status = 'streaming'"
)


# A plain INSERT, not an ORM flush: every reply's ending writes one.
INSERT_EVENT_CHUNK = insert(cast(Table, TurnEventChunk.__table__))


async def append_events(
    session: AsyncSession, reply_id: uuid.UUID, owner: Owner, events: Sequence[Event]
) -> None:
    """Persist a contiguous run of a reply's events."""
    if not events:
        return
    await session.execute(
        INSERT_EVENT_CHUNK,
        {
            "reply_id": reply_id,
            "first_id": events[0][0],
            "last_id": events[-1][0],
            "tenant_id": owner.tenant_id,
            "user_id": owner.user_id,
            "events": [list(e) for e in events],
        },
    )


async def load_events(session: AsyncSession, reply_id: uuid.UUID, after: int) -> list[Event]:
    """The persisted events of a reply with id > after, in order."""
    rows = await session.execute(
        select(TurnEventChunk.events)
        .where(TurnEventChunk.reply_id == reply_id, TurnEventChunk.last_id > after)
        .order_by(TurnEventChunk.first_id)
    )
    out: list[Event] = []
    for chunk in rows.scalars():
        out.extend(Event(int(e[0]), str(e[1]), e[2]) for e in chunk if int(e[0]) > after)
    return out


async def ending_of(session: AsyncSession, turn_id: uuid.UUID) -> Event | None:
    """The terminal event stored with an ended turn (its id is the turn's `last_event_id`), if any."""
    turn = (
        await session.execute(
            select(Turn.reply_id, Turn.last_event_id).where(
                Turn.id == turn_id, Turn.status.in_(TERMINAL_STATUSES)
            )
        )
    ).one_or_none()
    if turn is not None:
        for event in await load_events(session, turn.reply_id or turn_id, turn.last_event_id - 1):
            if event.id == turn.last_event_id:
                return event
    return None


async def last_event(session: AsyncSession, reply_id: uuid.UUID) -> Event | None:
    """The last persisted event of a reply (its ending, once it is over); None if none is stored."""
    chunk = (
        await session.execute(
            select(TurnEventChunk.events)
            .where(TurnEventChunk.reply_id == reply_id)
            .order_by(TurnEventChunk.last_id.desc())
            .limit(1)
        )
    ).scalar_one_or_none()
    if not chunk:
        return None
    e = chunk[-1]
    return Event(int(e[0]), str(e[1]), e[2])

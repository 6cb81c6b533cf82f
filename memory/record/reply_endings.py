"""The one way a reply ends: `end_reply`, in the caller's transaction.

Every terminal transition of a reply goes through it, whoever notices the end:

| who calls | status |
| --- | --- |
| the runner: the model finished (also after an approval was decided or timed out) | `completed` |
| the runner: stop, a new message, the client leaving | `interrupted_by_user` |
| the runner: the provider failed, the server shut down | `interrupted_by_error` or `failed` |
| the reaper: the owning process died (heartbeat stale) | `interrupted_by_error` |
| a stop whose owner is dead | `interrupted_by_user` |
| a stop of a parked reply (no process runs it) | `interrupted_by_user` |

It is conditional on the turn's status (`WHERE status = from_status`), so two enders racing
each other (stop and completion, a runner and the reaper) leave exactly one ending: the
loser gets None and writes nothing. In the same transaction it settles the open tool
calls, writes the outbox row, appends the terminal event after any events not yet stored,
releases the conversation and notifies `chatmem_turn_done` (one statement).
"""

from __future__ import annotations

import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Select, any_, bindparam, func, literal_column, not_, select
from sqlalchemy.dialects.postgresql import ARRAY, UUID
from sqlalchemy.ext.asyncio import AsyncSession

from memory.events import TERMINAL_EVENT, TERMINAL_STATUSES, Event, TurnStatus
from memory.json_values import JsonObject
from memory.record.conversations import Owner
from memory.record.outbox import record_finished_turn
from memory.record.process_life import silent_longer_than
from memory.record.tool_calls import ToolCall, settle_open_calls, settle_running_invocations, tool_calls_of
from memory.record.turns import append_events, finish_turn, release_conversation
from memory.storage.models import Conversation, Turn


@dataclass(frozen=True)
class Ending:
    """How a reply ends: its terminal status, and why."""

    status: str
    reason: str | None = None  # interrupted_by_user: user, new_message, client_disconnected
    error: dict[str, str] | None = None  # interrupted_by_error and failed: code and message

    def __post_init__(self) -> None:
        if self.status not in TERMINAL_STATUSES:
            raise ValueError(f"{self.status!r} is not an ending")


@dataclass(frozen=True)
class LiveState:
    """What the process running a reply holds that its turn row does not have yet."""

    content: str
    tool_calls: list[ToolCall]
    last_event_id: int  # of the last event published; the terminal event comes next
    unsaved_events: Sequence[Event] = ()  # published but not stored yet
    usage: dict[str, int] = field(default_factory=dict)
    prompt_version: str | None = None


async def end_reply(
    session: AsyncSession,
    turn_id: uuid.UUID,
    ending: Ending,
    *,
    from_status: str = TurnStatus.STREAMING,
    live: LiveState | None = None,
) -> Event | None:
    """End the reply whose current turn is `turn_id`, if that turn is still in `from_status`.

    Without `live` the turn ends with what is stored (its last checkpoint). Returns the
    terminal event, stored with the rest of the ending (the caller publishes it to live
    followers after commit), or None when the turn had already left `from_status`.
    """
    values: dict[str, Any] = {}
    unsaved: Sequence[Event] = ()
    if live is None:
        stored = (
            await session.execute(
                select(Turn).where(Turn.id == turn_id, Turn.status == from_status).with_for_update()
            )
        ).scalar_one_or_none()
        if stored is None:
            return None
        content, calls, last_event_id = (
            stored.content or "",
            tool_calls_of(stored.tool_calls),
            stored.last_event_id,
        )
    else:
        content, calls, last_event_id = live.content, live.tool_calls, live.last_event_id
        unsaved = live.unsaved_events
        values.update(usage=live.usage or None, prompt_version=live.prompt_version)
    terminal_id = last_event_id + 1
    settled = settle_open_calls(calls, ending.status)
    if live is None and ending.status != TurnStatus.COMPLETED:
        # Ended from the stored turn (its process died): a tool may have started after the last
        # checkpoint, even before any checkpoint held its call; its invocation row says so.
        await settle_running_invocations(session, turn_id, settled)
    turn = await finish_turn(
        session,
        turn_id,
        status=ending.status,
        content=content,
        tool_calls=settled,
        last_event_id=terminal_id,
        from_status=from_status,
        error=ending.error,
        interrupt_reason=ending.reason if ending.status == TurnStatus.INTERRUPTED_BY_USER else None,
        approval_expires_at=None,
        **values,
    )
    if turn is None:
        return None
    await record_finished_turn(session, turn)
    reply_id = turn.reply_id or turn.id
    data: JsonObject = {"reply_id": str(reply_id), "turn_id": str(turn.id), "status": ending.status}
    if live is not None and live.usage:
        data["usage"] = {name: count for name, count in live.usage.items()}
    if turn.interrupt_reason:
        data["reason"] = turn.interrupt_reason
    if ending.error:
        data["error"] = {key: text for key, text in ending.error.items()}
    terminal = Event(terminal_id, TERMINAL_EVENT[ending.status], data)
    await append_events(session, reply_id, Owner(turn.tenant_id, turn.user_id), [*unsaved, terminal])
    await release_conversation(session, turn.conversation_id, reply_id)  # and notifies done
    return terminal


PROCESS_DIED = {"code": "process_died", "message": "the process generating this reply stopped responding"}
REAPED = Ending(TurnStatus.INTERRUPTED_BY_ERROR, error=PROCESS_DIED)  # the ending of a dead process's reply


# The status written as a literal, not a bound parameter: asyncpg prepares every statement, and
# a generic plan can use the partial index ix_turns_streaming (`status = 'streaming'`) only for a
# query that says so in its text; with `status = $1` the reaper read the whole turns table.
IS_STREAMING = Turn.status == literal_column(f"'{TurnStatus.STREAMING.value}'")


def stale_replies(
    *,
    older_than_seconds: float,
    reply_id: uuid.UUID | None = None,
    limit: int = 100,
    spare_replies: Collection[uuid.UUID] = (),
) -> Select[uuid.UUID]:
    """The streaming turns whose owner has been silent longer than the cutoff, claimed
    (`FOR UPDATE SKIP LOCKED`), the longest silent first: what `end_stale_replies` ends."""
    query = (
        select(Turn.id)
        .where(IS_STREAMING, silent_longer_than(older_than_seconds))
        .order_by(Turn.heartbeat_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    if reply_id is not None:
        query = query.where(Turn.reply_id == reply_id)
    if spare_replies:
        running = bindparam("spare_replies", list(spare_replies), type_=ARRAY(UUID(as_uuid=True)))
        query = query.where(not_(func.coalesce(Turn.reply_id, Turn.id) == any_(running)))
    return query


async def end_stale_replies(
    session: AsyncSession,
    *,
    older_than_seconds: float,
    ending: Ending = REAPED,
    reply_id: uuid.UUID | None = None,
    limit: int = 100,
    spare_replies: Collection[uuid.UUID] = (),
) -> list[Event]:
    """End the replies whose streaming turn's heartbeat is older than the cutoff; their terminal events.

    Rows are claimed with `FOR UPDATE SKIP LOCKED`, so any number of processes run this at
    once. `spare_replies` are the replies the caller's process is running: alive by
    definition (a heartbeat can be late when the database is slow; the process is not dead).
    A turn the process owns but no longer runs (its ending could not be stored) is not
    spared: on a one-process deployment nobody else would ever end it.
    """
    query = stale_replies(
        older_than_seconds=older_than_seconds, reply_id=reply_id, limit=limit, spare_replies=spare_replies
    )
    ended = []
    for turn_id in list((await session.execute(query)).scalars()):
        if (terminal := await end_reply(session, turn_id, ending)) is not None:
            ended.append(terminal)
    return ended


def _parked_turn(reply_id: uuid.UUID, *, skip_locked: bool = False) -> Select[uuid.UUID]:
    return (
        select(Turn.id)
        .where(Turn.reply_id == reply_id, Turn.status == TurnStatus.AWAITING_APPROVAL)
        .with_for_update(skip_locked=skip_locked)
    )


async def end_parked_reply(
    session: AsyncSession, reply_id: uuid.UUID, reason: str, *, skip_locked: bool = False
) -> Event | None:
    """Stop a reply that waits for approval (its undecided calls never run); None if it was not parked.

    The conversation is locked before the parked turn, as by every writer but a streaming
    reply's ending (ARCHITECTURE.md, lock order): a correction or a deletion holding the
    conversation takes that turn next. With `skip_locked`, also None when another transaction
    holds the parked turn (a decision being written).
    """
    conversation = (
        await session.execute(
            select(Turn.conversation_id).where(
                Turn.reply_id == reply_id, Turn.status == TurnStatus.AWAITING_APPROVAL
            )
        )
    ).scalar_one_or_none()
    if conversation is None:
        return None
    await session.execute(
        select(Conversation.id).where(Conversation.id == conversation).with_for_update(key_share=True)
    )
    parked = (await session.execute(_parked_turn(reply_id, skip_locked=skip_locked))).scalar_one_or_none()
    if parked is None:
        return None
    ending = Ending(TurnStatus.INTERRUPTED_BY_USER, reason=reason)
    return await end_reply(session, parked, ending, from_status=TurnStatus.AWAITING_APPROVAL)


async def wait_for_parked_turn(session: AsyncSession, reply_id: uuid.UUID) -> None:
    """Wait until no other transaction holds the reply's parked turn (a decision on it has landed)."""
    await session.execute(_parked_turn(reply_id))

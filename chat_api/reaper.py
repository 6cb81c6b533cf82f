"""Ends turns left `streaming` by a process that died, so none stays streaming forever.

Any number of API processes run this safely at once: rows are claimed with
`FOR UPDATE SKIP LOCKED`, and only turns whose heartbeat is older than the timeout are
touched. The turn keeps its last checkpointed content; the stored event log gets its
terminal event, so a client resuming the stream sees it end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from memory.conversations import Owner
from memory.db import Database
from memory.models import ToolCallState, Turn, TurnStatus
from memory.outbox import record_finished_turn
from memory.turns import append_events, release_conversation

log = logging.getLogger(__name__)

NOTIFY_DONE = text("SELECT pg_notify('chatmem_turn_done', :reply_id)")
PROCESS_DIED = {"code": "process_died", "message": "the process generating this reply stopped responding"}


async def end_stale_turns(
    session: AsyncSession,
    *,
    older_than_seconds: float,
    status: str = TurnStatus.INTERRUPTED_BY_ERROR,
    reply_id: uuid.UUID | None = None,
    reason: str | None = None,
    limit: int = 100,
    spare_owner: str | None = None,
) -> list[Turn]:
    """End streaming turns whose heartbeat is older than the cutoff; returns the ended turns.

    `spare_owner` is the caller's own process id: its turns are alive by definition (a
    heartbeat can be late when the database is slow; the process is not dead).
    """
    cutoff = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, older_than_seconds)
    query = (
        select(Turn)
        .where(Turn.status == TurnStatus.STREAMING, Turn.heartbeat_at < cutoff)
        .order_by(Turn.heartbeat_at)
        .limit(limit)
        .with_for_update(skip_locked=True)
    )
    if reply_id is not None:
        query = query.where(Turn.reply_id == reply_id)
    if spare_owner is not None:
        query = query.where(Turn.owner.is_distinct_from(spare_owner))
    turns = list((await session.execute(query)).scalars())
    for turn in turns:
        calls = [dict(call) for call in turn.tool_calls or []]
        for call in calls:
            if call.get("state") in (ToolCallState.READY, ToolCallState.RUNNING):
                call["state"] = ToolCallState.CANCELLED
        turn.tool_calls = calls
        turn.status = status
        turn.completed_at = func.now()
        turn.updated_at = func.now()
        if status == TurnStatus.INTERRUPTED_BY_ERROR:
            turn.error = PROCESS_DIED
        else:
            turn.interrupt_reason = reason
        terminal_id = turn.last_event_id + 1
        turn.last_event_id = terminal_id
        await session.flush()
        await session.refresh(turn)  # load the server-side timestamps the payload carries
        await record_finished_turn(session, turn)
        data: dict[str, Any] = {"reply_id": str(turn.reply_id), "turn_id": str(turn.id), "status": status}
        if status == TurnStatus.INTERRUPTED_BY_ERROR:
            data["error"] = PROCESS_DIED
        else:
            data["reason"] = reason
        owner = Owner(turn.tenant_id, turn.user_id)
        reply = turn.reply_id or turn.id
        await append_events(session, reply, owner, [(terminal_id, "turn.interrupted", data)])
        await release_conversation(session, turn.conversation_id, reply)
        await session.execute(NOTIFY_DONE, {"reply_id": str(reply)})
    return turns


class Reaper:
    """The periodic loop."""

    def __init__(
        self, db: Database, *, timeout_seconds: float, interval_seconds: float, process_id: str | None = None
    ) -> None:
        self.db = db
        self.timeout = timeout_seconds
        self.interval = interval_seconds
        self.process_id = process_id

    async def reap_once(self) -> int:
        """End every stale turn now; returns how many."""
        async with self.db.transaction() as session:
            ended = await end_stale_turns(
                session, older_than_seconds=self.timeout, spare_owner=self.process_id
            )
        if ended:
            log.warning("reaper ended %d turn(s) of dead processes", len(ended))
        return len(ended)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.reap_once()
            except Exception:
                log.exception("reaper pass failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.interval)

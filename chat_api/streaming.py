"""Following a reply's events, and the SSE responses built on that.

A reply running in this process is followed in memory. One running elsewhere (or
already over) is followed through the persisted event chunks: each chunk is read once
it is committed, woken by the checkpoint NOTIFY, with a short poll as a fallback. That
path adds up to one checkpoint interval of latency (250 ms by default). Only a
contiguous run of ids is ever yielded, so a chunk committed out of order is waited for
rather than skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import select

from chat_api.replies import Event
from chat_api.runner import TERMINAL_EVENT
from chat_api.services import Services
from memory.models import Turn, TurnStatus
from memory.turns import load_events

TERMINAL_NAMES = frozenset(TERMINAL_EVENT.values())
# Ends a stream only when nothing follows it: a reply resumed after approval goes on past it.
PARKED_EVENT = TERMINAL_EVENT[TurnStatus.AWAITING_APPROVAL]
DB_POLL_SECONDS = 0.5


async def _reply_over(services: Services, reply_id: uuid.UUID) -> bool:
    async with services.db.session() as session:
        streaming = await session.execute(
            select(Turn.id).where(Turn.reply_id == reply_id, Turn.status == TurnStatus.STREAMING).limit(1)
        )
        return streaming.first() is None


async def follow_reply(services: Services, reply_id: uuid.UUID, after: int) -> AsyncIterator[Event]:
    """Every event of the reply with id > after, then live ones until its terminal event."""
    reply = services.registry.get(reply_id)
    if reply is not None:
        async for event in reply.follow(after):
            yield event
        return
    expected = after + 1
    while True:
        wake = services.signals.wake_event()
        async with services.db.session() as session:
            events = await load_events(session, reply_id, expected - 1)
        for event in events:
            if event[0] != expected:
                break  # a chunk committed out of order: wait for the gap to fill
            yield event
            expected += 1
            if event[1] in TERMINAL_NAMES and not (event[1] == PARKED_EVENT and event is not events[-1]):
                return
        if not events and await _reply_over(services, reply_id):
            # Over, and nothing more stored (e.g. an imported turn): nothing to follow.
            async with services.db.session() as session:
                if not await load_events(session, reply_id, expected - 1):
                    return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=DB_POLL_SECONDS)


def sse_item(event: Event) -> dict[str, Any]:
    event_id, name, data = event
    return {"id": str(event_id), "event": name, "data": json.dumps(data, ensure_ascii=False)}


async def sse_stream(
    services: Services, reply_id: uuid.UUID, after: int, *, stop_on_disconnect: bool
) -> AsyncIterator[dict[str, Any]]:
    """SSE items for a reply; with `stop_on_disconnect`, a client leaving early stops the reply."""
    ended = False
    try:
        async for event in follow_reply(services, reply_id, after):
            yield sse_item(event)
            ended = event[1] in TERMINAL_NAMES
    finally:
        if stop_on_disconnect and not ended:
            reply = services.registry.get(reply_id)
            if reply is not None:
                reply.request_stop("client_disconnected")

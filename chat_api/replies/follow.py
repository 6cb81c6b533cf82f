"""Following a reply's events, and the SSE responses built on that.

A reply running in this process is followed in memory. One running elsewhere (or
already over) is followed through the persisted event chunks: each chunk is read once
it is committed, woken by the checkpoint NOTIFY, with a short poll as a fallback. That
path adds up to one checkpoint interval of latency (250 ms by default). Only a
contiguous run of ids is ever yielded, so a chunk committed out of order is waited for
rather than skipped. A follower that has had nothing for a second asks whether the process
running the reply is gone (`reaper.reap_if_owner_gone`), so a stream resumed after a
crash ends at once with the reaper's ending, not after the heartbeat timeout.

Events are sent in batches: whatever is already in the log when a follower wakes goes
out as one write of consecutive SSE frames (each with its own id), not one write per
event. An idle stream still sends each token the moment it is published; a follower that
fell behind (a busy event loop, a resume) catches up in one write, so under load the
cost per token falls instead of the backlog growing. Frames are encoded here, once, as
the SSE bytes the client parses, with the same fields and separator as sse-starlette's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from chat_api.replies.hang_up import OnDisconnect, ReplyKind, hung_up
from chat_api.replies.reaper import reap_if_owner_gone
from chat_api.replies.reply import Reply
from memory.events import ENDING_NAMES, PARKED_EVENT, TERMINAL_NAMES, Event, TurnStatus
from memory.record.reply_state import reply_state
from memory.record.turns import last_event, load_events

if TYPE_CHECKING:
    from chat_api.services import Services

DB_POLL_SECONDS = 0.5
# How long a follower of another process's reply goes without events before it asks whether
# that process is gone (one indexed read; a reply rarely pauses this long).
QUIET_SECONDS = 1.0
# Bounds one write when a follower is far behind (e.g. resuming a long reply from the start).
MAX_EVENTS_PER_WRITE = 256
# sse-starlette's default line separator, which clients have seen so far.
SEP = "\r\n"


async def _reply_over(services: Services, reply_id: uuid.UUID) -> bool:
    # A parked reply counts as over here: its log ends with `turn.awaiting_approval`.
    async with services.db.session() as session:
        return await reply_state(session, reply_id) != TurnStatus.STREAMING


async def follow_reply(services: Services, reply_id: uuid.UUID, after: int) -> AsyncIterator[list[Event]]:
    """Every event of the reply with id > after, then live ones until its terminal event, in batches.

    Each batch is the consecutive events available when the follower looked (never empty).
    """
    reply = services.registry.get(reply_id)
    if reply is not None:
        async for live in _local_batches(reply, after):
            yield live
        return
    expected = after + 1
    quiet_since = time.monotonic()
    while True:
        wake = services.signals.wake_event()
        async with services.db.session() as session:
            events = await load_events(session, reply_id, expected - 1)
        batch: list[Event] = []
        ended = False
        for event in events:
            if event[0] != expected:
                break  # a chunk committed out of order: wait for the gap to fill
            batch.append(event)
            expected += 1
            # The parked event ends the stream only when nothing follows it: a reply resumed
            # after approval goes on past it.
            if event.name in TERMINAL_NAMES and not (event.name == PARKED_EVENT and event is not events[-1]):
                ended = True
                break
        if batch:
            yield batch
            quiet_since = time.monotonic()
        if ended:
            return
        if not events and await _reply_over(services, reply_id):
            async with services.db.session() as session:
                if not await load_events(session, reply_id, expected - 1):
                    # Over, and nothing stored after the follower's position. A follower at or
                    # past the log's end still gets the ending: a crash loses the events after
                    # the last checkpoint, so a client that saw them resumes past the ending the
                    # reaper stored, and would otherwise never see the reply end.
                    ending = await last_event(session, reply_id)
                    if ending is not None and ending.name in ENDING_NAMES and ending.id < expected:
                        yield [ending]
                    return  # an imported turn has no events: nothing to follow
        if time.monotonic() - quiet_since >= QUIET_SECONDS:
            await reap_if_owner_gone(services, reply_id)  # its ending, if any, is read next
            quiet_since = time.monotonic()
            continue
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=DB_POLL_SECONDS)


async def _local_batches(reply: Reply, after: int) -> AsyncIterator[list[Event]]:
    # Reply.follow hands over events already in the log without waiting, so taking those
    # at once never blocks; ids are the log positions (1, 2, …), so the log says how many.
    events = reply.follow(after)
    try:
        async for event in events:
            batch = [event]
            while batch[-1][0] < len(reply.events) and len(batch) < MAX_EVENTS_PER_WRITE:
                batch.append(await anext(events))
            yield batch
    finally:
        await events.aclose()


def sse_frame(event: Event) -> bytes:
    """One event as SSE bytes: id, event name, one data line of JSON (which never holds a newline)."""
    event_id, name, data = event
    payload = json.dumps(data, ensure_ascii=False)
    return f"id: {event_id}{SEP}event: {name}{SEP}data: {payload}{SEP}{SEP}".encode()


async def sse_stream(
    services: Services,
    reply_id: uuid.UUID,
    after: int,
    *,
    on_disconnect: OnDisconnect,
    kind: ReplyKind,
) -> AsyncIterator[bytes]:
    """SSE bytes of a reply, one write per batch; a client leaving early is `hang_up.hung_up`."""
    ended = False
    try:
        async for batch in follow_reply(services, reply_id, after):
            yield b"".join(sse_frame(event) for event in batch)
            ended = batch[-1][1] in TERMINAL_NAMES
    finally:
        if not ended:
            hung_up(services, reply_id, on_disconnect, kind)
